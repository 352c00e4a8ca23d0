"""Train a small CNN built from HybridConv2D on scikit-learn's handwritten digits.

The digits (1,797 real scanned 8x8 images that ship with scikit-learn) are upscaled to 28x28,
split 80/20, and a LeNet-like network of HybridConv2D layers (lowering chosen per layer by the
planner) is trained with ``model.fit``. Prints the lowering each convolution uses, the test
accuracy and the training throughput in images/s.

Run: ``python examples/train_digits.py [--epochs N] [--batch-size B]``
"""

from __future__ import annotations

import argparse
import time

import keras
import numpy as np

from keras_cct import HybridConv2D


def load_digits_28x28(seed: int = 0):
    """scikit-learn's digits as (N, 28, 28, 1) float32 in [0, 1], shuffled, split 80/20."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = digits.images.astype("float32") / 16.0
    x = keras.ops.convert_to_numpy(
        keras.ops.image.resize(x[..., None], (28, 28), interpolation="bilinear"))
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def build_model() -> keras.Model:
    """LeNet's shape (conv 20 5x5, pool, conv 50 5x5, pool, fc 500, fc 10) with HybridConv2D."""
    inputs = keras.Input((28, 28, 1), name="data")
    h = HybridConv2D(20, 5, name="conv1")(inputs)
    h = keras.layers.MaxPooling2D(2, name="pool1")(h)
    h = HybridConv2D(50, 5, name="conv2")(h)
    h = keras.layers.MaxPooling2D(2, name="pool2")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(500, activation="relu", name="ip1")(h)
    outputs = keras.layers.Dense(10, name="ip2")(h)
    return keras.Model(inputs, outputs, name="lenet_digits")


class Throughput(keras.callbacks.Callback):
    """Measures training images/s, excluding the first epoch (tracing/compilation)."""

    def __init__(self, n_images: int):
        super().__init__()
        self.n_images = n_images
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self._t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._t0)

    @property
    def images_per_second(self) -> float:
        steady = self.times[1:] or self.times
        return self.n_images * len(steady) / sum(steady)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_digits_28x28(args.seed)
    model = build_model()
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    print(f"backend: {keras.backend.backend()}; {len(x_train)} training and {len(x_test)} test "
          f"images (scikit-learn digits, 28x28)")
    for layer in model.layers:
        if isinstance(layer, HybridConv2D):
            print(f"  {layer.name}: lowering={layer.lowering} -> {layer.chosen_lowering}")
    meter = Throughput(len(x_train))
    model.fit(x_train, y_train, epochs=args.epochs, batch_size=args.batch_size,
              callbacks=[meter], verbose=2)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test accuracy: {accuracy:.4f}")
    print(f"training throughput: {meter.images_per_second:.0f} images/s "
          f"(batch {args.batch_size}, epochs 2-{args.epochs})")
    return accuracy


if __name__ == "__main__":
    main()
