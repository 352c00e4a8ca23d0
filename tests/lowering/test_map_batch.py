"""The backend's ``map_batch`` (``keras_cct.lowering._backend``), which runs Winograd a batch
partition at a time: results against numpy, the partitions it cuts (counted by the function it
runs), and on TensorFlow the loop it makes where the batch size is not static (``fit``), eagerly
traced and under XLA."""

import keras
import numpy as np
import pytest

from keras_cct.lowering import _backend as B
from tests.backend_grads import to_numpy


def _run(x):
    """2x each image; summed: the images' sum, one per partition, and partition size squared."""
    size = keras.ops.cast(keras.ops.shape(x)[0], "float64")
    return [2.0 * x], [keras.ops.sum(x, axis=0), keras.ops.ones((), "float64"), size * size]


def _check(out, x, parts, sizes):
    (doubled,), (total, count, squares) = out
    np.testing.assert_array_equal(to_numpy(doubled), 2.0 * x)
    np.testing.assert_allclose(to_numpy(total), x.sum(axis=0), rtol=1e-12)
    assert float(to_numpy(count)) == parts
    assert float(to_numpy(squares)) == sum(s * s for s in sizes)


@pytest.mark.parametrize("n, images, sizes", [(10, 4, (5, 5)), (8, 8, (8,)), (3, 1, (1, 1, 1)),
                                              (5, 16, (5,)), (7, 4, (4, 3)),
                                              (13, 4, (4, 4, 4, 1))])
def test_static_batch(n, images, sizes):
    """A static batch: partitions of the divisor of ``n`` nearest ``images`` (10 by 4: 5, nearer
    by ratio than 2), where there is none ``ceil(n / ceil(n / images))`` images each and the
    remainder, on every backend."""
    x = np.random.default_rng(0).standard_normal((n, 3, 2))
    _check(B.map_batch(_run, [keras.ops.convert_to_tensor(x)], images), x, len(sizes), sizes)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_unknown_batch_tensorflow(jit_compile):
    """A batch of unknown size: one loop over partitions of one size, the divisor of the batch
    nearest ``images`` from half of it to 1.5 times it (10 by 4: 5), or where there is none
    near-equal ones, zero-padded (7 images by 4: 2 partitions of 4, one image of zeros), the
    padding cut off the concatenated results; two tensors cut alike."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("only TensorFlow traces with an unknown batch")
    import tensorflow as tf

    @tf.function(input_signature=[tf.TensorSpec((None, 3, 2), tf.float64)] * 2,
                 jit_compile=jit_compile)
    def run(a, b):
        def both(p, q):
            batched, summed = _run(p)
            return batched + [p * q], summed
        return B.map_batch(both, [a, b], 4)

    rng = np.random.default_rng(1)
    for n, sizes in ((10, (5, 5)), (8, (4, 4)), (7, (4, 4)), (3, (3,)), (1, (1,)),
                     (13, (4,) * 4)):
        x, y = rng.standard_normal((n, 3, 2)), rng.standard_normal((n, 3, 2))
        (doubled, product), summed = run(x, y)
        assert doubled.shape == (n, 3, 2) and product.shape == (n, 3, 2)
        np.testing.assert_array_equal(to_numpy(product), x * y)
        _check(([doubled], summed), x, len(sizes), sizes)


@pytest.mark.parametrize("n, images, size", [
    (32, 13, 16), (128, 13, 16),  # CaffeNet conv4: 16 is nearer 13 by ratio (1.23) than 8 (1.63)
    (128, 16, 16), (96, 16, 16), (31, 13, 11), (20, 16, 20), (12, 8, 6), (3, 16, 3),
    (40, 13, 10), (1, 1, 1), (100, 7, 5)])
def test_partition_size(n, images, size):
    """Worked by hand: the divisors of ``n`` from ``images // 2`` to ``1.5 * images``, the
    nearest by ratio either way; without one, ``ceil(n / ceil(n / images))``."""
    from keras_cct.lowering._backend.common import partition_size
    assert partition_size(n, images) == size


def test_partition_size_tensorflow_matches():
    """TensorFlow's loop sizes its partitions in the graph by the same integers as the static
    batch and the planner's race (a brute force over the divisors, written here)."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the loop is TensorFlow's")
    import tensorflow as tf
    from fractions import Fraction

    from keras_cct.lowering._backend.tensorflow import _partition_size

    def brute(n, images):
        near = [d for d in range(1, n + 1) if n % d == 0 and images // 2 <= d
                and Fraction(d) <= Fraction(3, 2) * images]
        if near:
            return min(near, key=lambda d: (max(Fraction(d, images), Fraction(images, d)), d))
        return -(-n // -(-n // images))

    for images in (1, 2, 4, 7, 13, 16, 22):
        for n in range(1, 160):
            assert int(_partition_size(tf.constant(n), images)) == brute(n, images), (n, images)
