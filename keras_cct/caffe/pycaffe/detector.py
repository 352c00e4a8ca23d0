"""pycaffe's ``caffe.Detector``: R-CNN-style window classification -- each window of an image
cropped (optionally with context padding, filled with the mean), warped to the net's input size
by the :class:`~keras_cct.caffe.io.transformer.Transformer`, and classified in batches.
``detect_selective_search`` (which needs the external selective-search MATLAB code) is not
provided: give the windows to :meth:`Detector.detect_windows`."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from keras_cct.caffe.io.transformer import load_image, resize_image
from keras_cct.caffe.pycaffe.blob import TEST
from keras_cct.caffe.pycaffe.classifier import input_transformer
from keras_cct.caffe.pycaffe.net import Net

PathLike = Union[str, os.PathLike]

__all__ = ["Detector"]


class Detector(Net):
    """pycaffe's ``Detector(model_file, pretrained_file, mean=None, input_scale=None,
    raw_scale=None, channel_swap=None, context_pad=None)``.

    Args:
        model_file, pretrained_file: the deploy .prototxt and its .caffemodel.
        mean, input_scale, raw_scale, channel_swap: as :class:`Transformer`'s setters.
        context_pad: pixels of context around each window, at the net's input scale (R-CNN
            uses 16); the part outside the image is filled with the mean.
    """

    def __init__(self, model_file: PathLike, pretrained_file: PathLike,
                 mean: Optional[np.ndarray] = None, input_scale: Optional[float] = None,
                 raw_scale: Optional[float] = None,
                 channel_swap: Optional[Sequence[int]] = None,
                 context_pad: Optional[int] = None) -> None:
        super().__init__(model_file, pretrained_file, TEST)
        self.transformer = input_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows: Sequence[Tuple[PathLike, Sequence]]
                       ) -> List[Dict[str, object]]:
        """Classify windows ``(ymin, xmin, ymax, xmax)`` of images: ``[(filename, windows),
        ...]`` -> one ``{"window", "prediction", "filename"}`` per window, in order."""
        crops = []
        for fname, windows in images_windows:
            image = load_image(fname).astype(np.float32)
            for window in windows:
                crops.append(self.crop(image, np.asarray(window)))
        if not crops:
            return []
        in_ = self.inputs[0]
        caffe_in = np.stack([self.transformer.preprocess(in_, c) for c in crops])
        predictions = self.forward_all(**{in_: caffe_in})[self.outputs[0]]
        detections, ix = [], 0
        for fname, windows in images_windows:
            for window in windows:
                detections.append({"window": window, "prediction": predictions[ix],
                                   "filename": fname})
                ix += 1
        return detections

    def crop(self, im: np.ndarray, window: np.ndarray) -> np.ndarray:
        """The ``(H, W, K)`` crop of ``window`` (``ymin, xmin, ymax, xmax``, end exclusive as
        pycaffe slices it), with ``context_pad`` pixels of context as pycaffe computes them."""
        window = np.asarray(window)
        if not self.context_pad:
            return im[int(window[0]):int(window[2]), int(window[1]):int(window[3])]
        crop_size = self.blobs[self.inputs[0]].width  # square inputs, as pycaffe assumes
        scale = crop_size / (1.0 * crop_size - self.context_pad * 2)
        half_h = (window[2] - window[0] + 1) / 2.0
        half_w = (window[3] - window[1] + 1) / 2.0
        center = (window[0] + half_h, window[1] + half_w)
        box = np.round(np.tile(center, 2) + scale * np.array((-half_h, -half_w, half_h, half_w)))
        scale_h = crop_size / (box[2] - box[0] + 1)
        scale_w = crop_size / (box[3] - box[1] + 1)
        pad_y = int(round(max(0, -box[0]) * scale_h))  # the part outside the image
        pad_x = int(round(max(0, -box[1]) * scale_w))
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0.0, [im_h, im_w, im_h, im_w])
        clip_h = box[2] - box[0] + 1
        clip_w = box[3] - box[1] + 1
        if clip_h <= 0 or clip_w <= 0:
            raise ValueError(f"window {tuple(window)} lies outside the {im_h}x{im_w} image")
        crop_h = min(int(round(clip_h * scale_h)), crop_size - pad_y)
        crop_w = min(int(round(clip_w * scale_w)), crop_size - pad_x)
        context = im[int(box[0]):int(box[2]), int(box[1]):int(box[3])]
        out = np.ones(self.crop_dims, dtype=np.float32) * self.crop_mean
        out[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = resize_image(context, (crop_h, crop_w))
        return out

    def configure_crop(self, context_pad: Optional[int]) -> None:
        """Set ``crop_dims`` (the input's ``(H, W, K)``), ``context_pad`` and ``crop_mean``
        (the mean in the unprocessed image's space, to fill context outside the image)."""
        in_ = self.inputs[0]
        tpose = self.transformer.transpose[in_]
        inv = [tpose[t] for t in tpose]
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inv]
        self.context_pad = context_pad
        if not context_pad:
            return
        mean = self.transformer.mean.get(in_)
        if mean is None:
            self.crop_mean = np.zeros(self.crop_dims, dtype=np.float32)
            return
        crop_mean = mean.copy().transpose(inv)
        order = self.transformer.channel_swap.get(in_)
        if order is not None:
            crop_mean = crop_mean[:, :, [list(order).index(i) for i in range(crop_mean.shape[2])]]
        raw_scale = self.transformer.raw_scale.get(in_)
        if raw_scale is not None:
            crop_mean = crop_mean / raw_scale
        self.crop_mean = crop_mean
