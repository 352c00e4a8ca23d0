"""Caffe's LeNet, trained by keras_cct from Caffe's own files, on scikit-learn's digits.

The 1,797 handwritten digits that ship with scikit-learn (real scans, 8x8, 17 grey levels) are
upscaled to 28x28 like MNIST and split 1,397 / 400; ``cct data`` writes them as two LMDBs of
Caffe Datums; ``examples/lenet/lenet_solver.prototxt`` and ``lenet_train_test.prototxt``
(Caffe's MNIST example, only the LMDB paths changed) are trained with HybridConv2D
convolutions exactly as ``caffe train`` would (SGD with momentum, the ``inv`` policy, weight
decay, lr_mult 2 on the biases); the script prints Caffe's log, the test accuracy and the training
throughput in images/s, writes the snapshot ``lenet_digits_iter_N.caffemodel/.solverstate``, and
exports the trained net (Caffe's deploy ``lenet.prototxt``) to ONNX with ``cct export`` when the
TensorFlow backend is active. Exits with status 1 if the test accuracy is below ``--min-accuracy``.

Run: ``python examples/train_lenet_digits.py [--workdir DIR] [--max-iter N] [--min-accuracy A]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent / "lenet"


def digits_28x28(seed: int = 0):
    """scikit-learn's digits as 28x28 uint8 images; a seeded 1397/400 split."""
    import cv2
    from sklearn.datasets import load_digits
    d = load_digits()
    imgs = np.stack([cv2.resize(im.astype(np.float32) * (255.0 / 16.0), (28, 28),
                                interpolation=cv2.INTER_LINEAR) for im in d.images])
    imgs = np.clip(np.rint(imgs), 0, 255).astype(np.uint8)
    order = np.random.default_rng(seed).permutation(len(imgs))
    test, train = order[:400], order[400:]
    return (imgs[train], d.target[train]), (imgs[test], d.target[test])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="where the LMDBs, snapshots and ONNX file go "
                                          "(default: a temporary folder)")
    parser.add_argument("--max-iter", type=int, default=None,
                        help="override the solver's max_iter (1000)")
    parser.add_argument("--min-accuracy", type=float, default=0.97)
    args = parser.parse_args(argv)

    from keras_cct.caffe.train.solver import load_solver
    from keras_cct.cli import main as cct

    work = Path(args.workdir or tempfile.mkdtemp(prefix="cct_lenet_"))
    work.mkdir(parents=True, exist_ok=True)
    for name in ("lenet_solver.prototxt", "lenet_train_test.prototxt", "lenet.prototxt"):
        shutil.copy(HERE / name, work / name)

    # 1. the digits -> two LMDBs, with `cct data`
    (xtr, ytr), (xte, yte) = digits_28x28()
    for split, x, y in (("train", xtr, ytr), ("test", xte, yte)):
        np.savez(work / f"digits_{split}.npz", images=x, labels=y)
        rc = cct(["data", str(work / f"digits_{split}.npz"), str(work / f"digits_{split}_lmdb"),
                  "--overwrite"])
        if rc:
            return rc

    # 2. train LeNet from Caffe's solver and net files
    solver = load_solver(work / "lenet_solver.prototxt", snapshot_prefix=str(work / "lenet_digits"))
    if args.max_iter:
        solver.param.max_iter = args.max_iter
        solver.param.snapshot = args.max_iter
    convs = [l for l in solver.train_net.model.layers if type(l).__name__ == "HybridConv2D"]
    t0 = time.perf_counter()
    solver.solve()
    wall = time.perf_counter() - t0
    last = solver.last_test
    scores = last[2] if last and last[0] == solver.iter and last[1] == 0 else solver.test(0)
    acc = scores.get("accuracy", 0.0)
    print(f"Convolutions: " + ", ".join(f"{l.name}=HybridConv2D[{l.chosen_lowering}]"
                                        for l in convs), flush=True)
    print(f"Test accuracy: {acc:.4f} on {len(yte)} held-out digits", flush=True)
    print(f"Training: {solver.images_per_second:.1f} images/s "
          f"({solver.iter} iterations of {solver.train_sources[0].batch_size}, "
          f"{solver.train_seconds:.1f}s training, {wall:.1f}s with tests and snapshots)",
          flush=True)
    model_file = work / f"lenet_digits_iter_{solver.iter}.caffemodel"
    print(f"Snapshot: {model_file} and {model_file.with_suffix('.solverstate')}", flush=True)

    # 3. export the trained net to ONNX (needs the TensorFlow backend)
    import keras
    if keras.backend.backend() == "tensorflow":
        try:
            rc = cct(["export", str(work / "lenet.prototxt"), "--weights", str(model_file),
                      "-o", str(work / "lenet_digits.onnx")])
            if rc == 0:
                print(f"ONNX: {work / 'lenet_digits.onnx'}", flush=True)
        except SystemExit as exc:  # `cct export` not available in this installation
            print(f"ONNX export skipped ({exc})", flush=True)
    else:
        print("ONNX export skipped (needs KERAS_BACKEND=tensorflow)", flush=True)

    if acc < args.min_accuracy:
        print(f"FAILED: test accuracy {acc:.4f} < {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
