"""pycaffe's ``caffe.Classifier``: a TEST :class:`~keras_cct.caffe.pycaffe.net.Net` with a
:class:`~keras_cct.caffe.io.transformer.Transformer`, predicting class probabilities of
``(H, W, K)`` images, by default averaged over pycaffe's 10 crops."""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import numpy as np

from keras_cct.caffe.io.transformer import Transformer, oversample, resize_image
from keras_cct.caffe.pycaffe.blob import TEST
from keras_cct.caffe.pycaffe.net import Net

PathLike = Union[str, os.PathLike]

__all__ = ["Classifier", "input_transformer"]


def input_transformer(net: Net, mean=None, input_scale=None, raw_scale=None,
                      channel_swap=None) -> Transformer:
    """The :class:`Transformer` of ``net``'s first input from (H, W, K) images, with
    pycaffe's Classifier/Detector options (those not ``None`` are set)."""
    in_ = net.inputs[0]
    t = Transformer({in_: net.blobs[in_].data.shape})
    t.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        t.set_mean(in_, mean)
    if input_scale is not None:
        t.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        t.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        t.set_channel_swap(in_, channel_swap)
    return t


class Classifier(Net):
    """pycaffe's ``Classifier(model_file, pretrained_file, image_dims=None, mean=None,
    input_scale=None, raw_scale=None, channel_swap=None)``.

    Args:
        model_file, pretrained_file: the deploy .prototxt and its .caffemodel.
        image_dims: ``(height, width)`` images are resized to before cropping (default: the
            input blob's size).
        mean: the mean to subtract (``(K,)`` per channel or ``(K, H, W)``).
        input_scale, raw_scale, channel_swap: as :class:`Transformer`'s setters (e.g.
            ``raw_scale=255, channel_swap=(2, 1, 0)`` for [0, 1] RGB images and a BGR model).
    """

    def __init__(self, model_file: PathLike, pretrained_file: PathLike,
                 image_dims: Optional[Sequence[int]] = None, mean: Optional[np.ndarray] = None,
                 input_scale: Optional[float] = None, raw_scale: Optional[float] = None,
                 channel_swap: Optional[Sequence[int]] = None) -> None:
        super().__init__(model_file, pretrained_file, TEST)
        in_ = self.inputs[0]
        self.transformer = input_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[in_].data.shape[2:])
        self.image_dims = np.array(image_dims if image_dims is not None else self.crop_dims)

    def predict(self, inputs: Sequence[np.ndarray], oversample: bool = True) -> np.ndarray:
        """Class scores ``(N, classes)`` of ``N`` ``(H, W, K)`` images: each resized to
        ``image_dims``, then 10-cropped (corners, centre, mirrored) and the crops' scores
        averaged (``oversample``), or centre-cropped."""
        if not len(inputs):
            raise ValueError("predict needs at least one image")
        dims = tuple(int(d) for d in self.image_dims)
        k = np.asarray(inputs[0]).shape[2]
        images = np.zeros((len(inputs), dims[0], dims[1], k), np.float32)
        for i, im in enumerate(inputs):
            images[i] = resize_image(np.asarray(im), dims)
        if oversample:
            images = _oversample(images, self.crop_dims)
        else:
            center = np.array(dims) / 2.0
            crop = (np.tile(center, (1, 2))[0]
                    + np.concatenate([-self.crop_dims / 2.0, self.crop_dims / 2.0])).astype(int)
            images = images[:, crop[0]:crop[2], crop[1]:crop[3], :]
        in_ = self.inputs[0]
        caffe_in = np.stack([self.transformer.preprocess(in_, im) for im in images])
        out = self.forward_all(**{in_: caffe_in})
        predictions = out[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions


_oversample = oversample  # predict's argument shadows the function's name
