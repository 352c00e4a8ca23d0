"""keras_cct.lowering.winograd: outputs and gradients of F(2x2, 3x3), F(4x4, 3x3) and (5x5
kernels, matrices built by Toom-Cook) F(4x4, 5x5) and F(2x2, 5x5) against a direct float64
numpy convolution and against Keras' own convolution, on the current backend."""

import functools

import keras
import numpy as np
import pytest

from keras_cct.lowering.geometry import conv_geometry
from keras_cct.lowering.winograd import winograd_applies, winograd_conv2d
from tests import reference as ref
from tests.backend_grads import layer_grads, to_numpy

# (input shape, kernel shape, padding, groups): odd and even sizes, padding 0, 1, "same" and
# asymmetric, groups 1 to 3 (TensorFlow transforms them at once, in another order), batch 1 to
# 3, outputs that are and are not multiples of the tile.
CASES = {
    "valid_odd": ((1, 7, 9, 5), (3, 3, 5, 4), 0, 1),
    "pad1_even": ((2, 8, 6, 6), (3, 3, 6, 3), 1, 1),
    "asym_groups2": ((3, 9, 6, 4), (3, 3, 2, 6), ((1, 2), (0, 1)), 2),
    "same_13": ((2, 13, 13, 8), (3, 3, 8, 5), "same", 1),
    "groups2_pad1": ((1, 11, 10, 8), (3, 3, 4, 4), 1, 2),
    "groups3_pad1": ((2, 7, 8, 6), (3, 3, 2, 9), 1, 3),
    "tiny": ((1, 3, 3, 2), (3, 3, 2, 2), 0, 1),
    # 5x5 kernels (CaffeNet's conv2 is 5x5, padding 2, two groups)
    "k5_pad2_groups2": ((2, 11, 9, 6), (5, 5, 3, 4), 2, 2),
    "k5_asym": ((1, 10, 13, 3), (5, 5, 3, 5), ((1, 2), (0, 3)), 1),
    "k5_tiny": ((1, 5, 5, 2), (5, 5, 2, 3), 0, 1),
}
K5 = ("k5_asym", "k5_pad2_groups2", "k5_tiny")

#: Relative error (max |err| / max |ref|) allowed in float64: only rounding of exact transforms.
F64_TOL = 1e-12
#: ... and in float32 against Keras' float32 convolution (measured about 5e-7 for tile 2 and
#: 5e-6 for tile 4 on these shapes; F(4x4)'s transforms have entries up to 8 and 1/24, and
#: F(4x4, 5x5)'s up to 21/4 and 64/45).
F32_TOL = {2: 1e-5, 4: 1e-4}


def _run(conv, x, k, dy):
    """(y, dx, dk) of ``sum(conv(x, k) * dy)`` on the current backend, in x's dtype."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf
        tx, tk = tf.constant(x), tf.constant(k)
        with tf.GradientTape() as tape:
            tape.watch([tx, tk])
            y = conv(tx, tk)
            loss = tf.reduce_sum(y * tf.cast(dy, y.dtype))
        return (to_numpy(y), *[to_numpy(g) for g in tape.gradient(loss, [tx, tk])])
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def loss(a, b):
            y = conv(a, b)
            return jnp.sum(y * dy.astype(y.dtype)), y
        # jit: one compilation per case instead of one per op and shape
        (_, y), (dx, dk) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            jnp.asarray(x), jnp.asarray(k))
        return to_numpy(y), to_numpy(dx), to_numpy(dk)
    import torch
    tx = torch.tensor(x, requires_grad=True)
    tk = torch.tensor(k, requires_grad=True)
    y = conv(tx, tk)
    (y * torch.tensor(dy, dtype=y.dtype)).sum().backward()
    return to_numpy(y.detach()), to_numpy(tx.grad), to_numpy(tk.grad)


def _case(name, dtype=np.float64):
    xs, ks, padding, groups = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    x, k = rng.standard_normal(xs).astype(dtype), rng.standard_normal(ks).astype(dtype)
    geo = conv_geometry(xs, ks, padding=padding, groups=groups)
    dy = rng.standard_normal((xs[0], geo.out_h, geo.out_w, ks[3])).astype(dtype)
    return x, k, dy, geo, padding, groups


#: F(4x4) on fewer cases: each case is one XLA compilation on JAX (seconds).
F64_RUNS = [(c, 2) for c in sorted(CASES)] + [(c, 4) for c in ("valid_odd", "asym_groups2",
                                                              "groups3_pad1", "same_13") + K5]


@pytest.mark.parametrize("case,tile", F64_RUNS)
def test_matches_float64_reference(case, tile):
    x, k, dy, geo, padding, groups = _case(case)
    y_ref = ref.conv2d(x, k, padding=padding, groups=groups)
    dx_ref, dk_ref, _ = ref.conv2d_grads(x, k, dy, padding=padding, groups=groups)
    y, dx, dk = _run(lambda a, b: winograd_conv2d(a, b, geo, tile=tile), x, k, dy)
    assert y.dtype == np.float64 and dx.dtype == np.float64 and dk.dtype == np.float64
    assert y.shape == y_ref.shape and dx.shape == x.shape and dk.shape == k.shape
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got, want) < F64_TOL


@functools.lru_cache(maxsize=None)
def _keras_reference(case):
    """(y, dx, dk) of keras.layers.Conv2D in float32 (and y of keras.ops.conv for groups 1)."""
    x, k, dy, geo, padding, groups = _case(case, np.float32)
    keras_padding = geo.keras_padding
    if keras_padding is None:  # Conv2D knows "valid" and "same" only: pad the input here
        (t, b), (l, r) = geo.pad
        x_in = np.pad(x, ((0, 0), (t, b), (l, r), (0, 0)))
        keras_padding = "valid"
    else:
        x_in = x
    layer = keras.layers.Conv2D(k.shape[-1], k.shape[0], padding=keras_padding, groups=groups,
                                use_bias=False, dtype="float32")
    layer.build(x_in.shape)
    layer.kernel.assign(k)
    y_k, (dx_k, dk_k) = layer_grads(layer, x_in, dy)
    if x_in is not x:
        (t, _), (l, _) = geo.pad
        dx_k = dx_k[:, t:t + x.shape[1], l:l + x.shape[2]]
    y_ops = to_numpy(keras.ops.conv(x_in, k, padding=keras_padding)) if groups == 1 else y_k
    return y_k, y_ops, dx_k, dk_k


@pytest.mark.parametrize("case,tile", [("valid_odd", 2), ("asym_groups2", 2), ("same_13", 2),
                                       ("same_13", 4), ("k5_pad2_groups2", 4), ("k5_asym", 4)])
def test_matches_keras_conv2d_float32(case, tile):
    """Against keras.layers.Conv2D (output and both gradients) and keras.ops.conv, in float32."""
    x, k, dy, geo, _, _ = _case(case, np.float32)
    y_k, y_ops, dx_k, dk_k = _keras_reference(case)
    y, dx, dk = _run(lambda a, b: winograd_conv2d(a, b, geo, tile=tile), x, k, dy)
    assert y.dtype == np.float32 and dx.dtype == np.float32 and dk.dtype == np.float32
    for got, want in ((y, y_k), (y, y_ops), (dx, dx_k), (dk, dk_k)):
        assert ref.rel_err(got, want) < F32_TOL[tile]


@pytest.mark.parametrize("case,tile,images", [("asym_groups2", 2, 2), ("asym_groups2", 4, 1),
                                              ("k5_pad2_groups2", 4, 1), ("pad1_even", 2, 1)])
def test_batch_partitions_match_float64_reference(case, tile, images):
    """Transformed, multiplied and lifted ``images`` images at a time (batch 3 in partitions of
    2 and 1, or batch 2 in 1 and 1): the same output and gradients as the whole batch, the
    kernel's gradient summed over the partitions."""
    x, k, dy, geo, padding, groups = _case(case)
    y_ref = ref.conv2d(x, k, padding=padding, groups=groups)
    dx_ref, dk_ref, _ = ref.conv2d_grads(x, k, dy, padding=padding, groups=groups)
    y, dx, dk = _run(lambda a, b: winograd_conv2d(a, b, geo, tile=tile, images=images),
                     x, k, dy)
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got, want) < F64_TOL


def test_images_per_partition():
    """As many whole images as keep ``V`` and ``M`` (n*n values per tile, for the input's and
    the output's channels) within PARTITION_BYTES: CaffeNet's conv3 (13x13, 256 -> 384, 7x7
    tiles of F(2x2)) holds 16 * 49 * 640 values an image, 2,007,040 bytes in float32; conv2
    (27x27, 96 -> 256, F(4x4, 5x5): 7x7 tiles of 8x8) 64 * 49 * 352; a 16-bit value counts 2
    bytes; an image larger than the target is a partition of its own."""
    from keras_cct.lowering.winograd import PARTITION_BYTES, images_per_partition
    conv3 = conv_geometry((128, 13, 13, 256), (3, 3, 256, 384), padding=1)
    assert images_per_partition(conv3, 2) == PARTITION_BYTES // (16 * 49 * 640 * 4)
    assert images_per_partition(conv3, 2, dtype_bytes=2) == PARTITION_BYTES // (16 * 49 * 640 * 2)
    conv2 = conv_geometry((128, 27, 27, 96), (5, 5, 48, 256), padding=2, groups=2)
    assert images_per_partition(conv2, 4) == PARTITION_BYTES // (64 * 49 * 352 * 4)
    big = conv_geometry((8, 224, 224, 512), (3, 3, 512, 512), padding=1)
    assert images_per_partition(big, 2) == 1


def test_layers_alike_on_one_side_share_its_transforms():
    """The compiled transforms are made per side (:func:`_side`): CaffeNet's conv4 and conv5
    (one input, 384 or 256 filters) share the input transform and its adjoint, not the lifting;
    VGG16's conv3_1 and conv3_2 (128 or 256 channels in, one output) the lifting and its
    adjoint, not the input's; other padding (another output size) shares neither. The batch
    is no part of it. Where a backend transforms each channel group as a convolution of its
    own (``WINOGRAD_GROUPS_AT_ONCE`` off: JAX), those are one group's transforms. (Their
    results: the tests above, every case through these tilings.)"""
    if keras.backend.backend() == "torch":
        pytest.skip("PyTorch's transforms are not compiled")
    from keras_cct.lowering import _backend as B
    from keras_cct.lowering.winograd import _one_group, _Tiling, _transforms

    def sides(xs, ks, padding=1, groups=1):
        t = _Tiling(conv_geometry(xs, ks, padding=padding, groups=groups), 2)
        fns = _transforms(t if B.WINOGRAD_GROUPS_AT_ONCE else _one_group(t))
        return tuple(f.fused for f in fns[:2]), tuple(f.fused for f in fns[2:4])

    conv4 = sides((32, 13, 13, 384), (3, 3, 192, 384), groups=2)
    conv5 = sides((16, 13, 13, 384), (3, 3, 192, 256), groups=2)
    assert all(a is b for a, b in zip(conv4[0], conv5[0]))
    assert not any(a is b for a, b in zip(conv4[1], conv5[1]))
    conv3_1 = sides((8, 56, 56, 128), (3, 3, 128, 256))
    conv3_2 = sides((None, 56, 56, 256), (3, 3, 256, 256))
    assert all(a is b for a, b in zip(conv3_1[1], conv3_2[1]))
    assert not any(a is b for a, b in zip(conv3_1[0], conv3_2[0]))
    valid = sides((None, 56, 56, 256), (3, 3, 256, 256), padding=0)
    assert not any(a is b for a, b in zip(valid[0] + valid[1], conv3_2[0] + conv3_2[1]))


def test_bfloat16_keeps_dtype():
    x, k, dy, geo, padding, groups = _case("asym_groups2", np.float32)
    y_ref = ref.conv2d(x, k, padding=padding, groups=groups)
    dx_ref, dk_ref, _ = ref.conv2d_grads(x, k, dy, padding=padding, groups=groups)

    def conv(a, b):
        a, b = keras.ops.cast(a, "bfloat16"), keras.ops.cast(b, "bfloat16")
        y = winograd_conv2d(a, b, geo, tile=2)
        assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
        return keras.ops.cast(y, "float32")

    y, dx, dk = _run(conv, x, k, dy)
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got, want) < 3e-2


@pytest.mark.parametrize("jit_compile,tile", [(False, 2), (True, 2), (False, 4)])
def test_unknown_batch_tensorflow(jit_compile, tile):
    """TensorFlow traces with an unknown batch size (also under XLA): forward and gradients,
    at two batch sizes through the one trace, also a loop over batch partitions (``map_batch``),
    one with an image of zeros padding the last partition (7 images by 4)."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("only TensorFlow traces with an unknown batch")
    import tensorflow as tf
    x, k, dy, geo, padding, groups = _case("asym_groups2")
    x = np.concatenate([x, 0.5 * x[:2], -x[1:]])  # 7 images
    dy = np.concatenate([dy, -dy[1:], 0.5 * dy[:2]])

    @tf.function(input_signature=[tf.TensorSpec((None,) + x.shape[1:], tf.float64),
                                  tf.TensorSpec(k.shape, tf.float64),
                                  tf.TensorSpec((None,) + dy.shape[1:], tf.float64)],
                 jit_compile=jit_compile)
    def step(a, b, d):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = winograd_conv2d(a, b, geo, tile=tile)
            loss = tf.reduce_sum(y * d)
        return (y, *tape.gradient(loss, [a, b]))

    @tf.function(input_signature=step.input_signature, jit_compile=jit_compile)
    def partitioned(a, b, d):  # one image a partition: as many as the batch
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = winograd_conv2d(a, b, geo, tile=tile, images=1)
            loss = tf.reduce_sum(y * d)
        return (y, *tape.gradient(loss, [a, b]))

    unknown = conv_geometry((None,) + x.shape[1:], k.shape, padding=padding, groups=groups)

    @tf.function(input_signature=step.input_signature, jit_compile=jit_compile)
    def unplanned(a, b, d):  # no batch anywhere; at batch 7, 2 partitions of 4, one padded
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = winograd_conv2d(a, b, unknown, tile=tile, images=4)
            loss = tf.reduce_sum(y * d)
        return (y, *tape.gradient(loss, [a, b]))

    for n in (7, 3, 1):
        y3, dx3, dk3 = (to_numpy(t) for t in unplanned(x[:n], k, dy[:n]))
        y, dx, dk = (to_numpy(t) for t in step(x[:n], k, dy[:n]))
        y2, dx2, dk2 = (to_numpy(t) for t in partitioned(x[:n], k, dy[:n]))
        dx_ref, dk_ref, _ = ref.conv2d_grads(x[:n], k, dy[:n], padding=padding, groups=groups)
        assert ref.rel_err(y, ref.conv2d(x[:n], k, padding=padding, groups=groups)) < F64_TOL
        assert ref.rel_err(dx, dx_ref) < F64_TOL and ref.rel_err(dk, dk_ref) < F64_TOL
        assert ref.rel_err(y2, y) < F64_TOL and ref.rel_err(y3, y) < F64_TOL
        assert ref.rel_err(dx3, dx_ref) < F64_TOL and ref.rel_err(dk3, dk_ref) < F64_TOL
        assert ref.rel_err(dx2, dx_ref) < F64_TOL and ref.rel_err(dk2, dk_ref) < F64_TOL


def test_applies_to_3x3_and_5x5_at_stride1_dilation1():
    """F(2x2) is offered for 3x3 kernels, F(4x4) for 3x3 and 5x5; stride 1, dilation 1."""
    for tile in (2, 4):
        assert winograd_applies(conv_geometry((1, 9, 9, 4), (3, 3, 4, 4), padding=1), tile)
        assert winograd_applies(conv_geometry((1, 9, 9, 4), (3, 3, 2, 4),
                                              padding=((0, 1), (2, 0)), groups=2), tile)
        assert not winograd_applies(conv_geometry((1, 9, 9, 4), (3, 3, 4, 4), strides=2), tile)
        assert not winograd_applies(conv_geometry((1, 9, 9, 4), (3, 3, 4, 4), dilation_rate=2),
                                    tile)
        assert not winograd_applies(conv_geometry((1, 9, 9, 4), (3, 1, 4, 4)), tile)
        assert not winograd_applies(conv_geometry((1, 9, 9, 4), (7, 7, 4, 4), padding=3), tile)
    k5 = conv_geometry((1, 9, 9, 4), (5, 5, 4, 4), padding=2)
    assert winograd_applies(k5, 4) and not winograd_applies(k5, 2)
    assert not winograd_applies(conv_geometry((1, 9, 9, 4), (5, 5, 4, 4), strides=2), 4)
    with pytest.raises(ValueError):
        winograd_conv2d(np.zeros((1, 9, 9, 4), np.float32), np.zeros((7, 7, 4, 4), np.float32),
                        conv_geometry((1, 9, 9, 4), (7, 7, 4, 4)))


def test_tensorflow_transforms_compiled_once_per_shape():
    """On TensorFlow the transforms are XLA clusters made once per tiling: eager calls of the
    same shape neither retrace nor recompile them (a new cluster per call would cost a
    compilation, tenths of a second, every step), and one trace serves every batch size, also
    in a function traced with an unknown batch (as ``fit`` traces a model): the clusters the
    planner's race compiled are the layer's own."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the transforms are compiled clusters on TensorFlow only")
    from keras_cct.lowering.winograd import _Tiling, _transforms
    rng = np.random.default_rng(7)  # a shape no other test uses: its clusters are new here
    x = rng.standard_normal((2, 10, 12, 6)).astype(np.float32)
    k = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)
    padding, groups = 1, 2
    geo = conv_geometry(x.shape, k.shape, padding=padding, groups=groups)
    dy = rng.standard_normal((2, geo.out_h, geo.out_w, 4)).astype(np.float32)
    ys = [to_numpy(winograd_conv2d(x, k, geo, tile=2)) for _ in range(3)]
    for _ in range(2):  # forward and backward, in a tape
        _run(lambda a, b: winograd_conv2d(a, b, geo, tile=2), x, k, dy)
    import tensorflow as tf
    x3 = rng.standard_normal((3,) + x.shape[1:]).astype(np.float32)
    dy3 = rng.standard_normal((3,) + dy.shape[1:]).astype(np.float32)
    _run(lambda a, b: winograd_conv2d(a, b, geo, tile=2), x3, k, dy3)  # another batch size

    @tf.function(input_signature=[tf.TensorSpec((None,) + x.shape[1:], tf.float32)])
    def unknown_batch(a):
        return winograd_conv2d(a, k, geo, tile=2)

    y3 = to_numpy(unknown_batch(x3))
    fns = [f.fused.compiled for f in _transforms(_Tiling(geo, 2))[:4]]
    assert [f.experimental_get_tracing_count() for f in fns] == [1, 1, 1, 1]
    y_ref = ref.conv2d(x.astype(np.float64), k.astype(np.float64), padding=padding, groups=groups)
    assert all(ref.rel_err(y, y_ref) < F32_TOL[2] for y in ys)
    y3_ref = ref.conv2d(x3.astype(np.float64), k.astype(np.float64), padding=padding,
                        groups=groups)
    assert ref.rel_err(y3, y3_ref) < F32_TOL[2]
