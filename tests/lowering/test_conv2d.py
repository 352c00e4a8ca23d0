"""keras_cct.lowering.conv2d against a direct float64 numpy convolution, forward and backward."""

import keras
import numpy as np
import pytest

from keras_cct.errors import LoweringError
from keras_cct.lowering import ALL_LOWERINGS, conv2d, conv_geometry
from keras_cct.lowering.engine import lowered_conv2d
from keras_cct.lowering.dispatch import available
from tests import reference as ref
from tests.backend_grads import to_numpy

# (input shape, kernel shape, keyword arguments)
CASES = {
    "3x3": ((2, 7, 8, 6), (3, 3, 6, 4), {}),
    "1x1": ((2, 5, 5, 8), (1, 1, 8, 3), {}),
    # a 1x1 kernel with padding (Caffe allows it): Type 1's reshape of the padded input, cropped
    "1x1_pad1": ((2, 5, 6, 8), (1, 1, 8, 3), dict(padding=1)),
    # one row of taps: Type 2 lowers the height only, here one tap (a reshape of the input)
    "k1x3": ((2, 6, 7, 4), (1, 3, 4, 5), dict(padding=((0, 0), (1, 1)))),
    # one-row and one-column kernels (JAX's native runs them as one-dimensional convolutions):
    # a vertical stride, "same" on the rows' axis, dilated groups, padding of both axes first
    "k1x3_s2": ((2, 7, 9, 4), (1, 3, 4, 5), dict(strides=2)),
    "k3x1_same": ((2, 7, 6, 4), (3, 1, 4, 5), dict(padding="same")),
    "k5x1_dil2_groups2": ((2, 11, 5, 4), (5, 1, 2, 6),
                          dict(dilation_rate=2, groups=2, padding=((4, 4), (0, 0)))),
    "k3x1_pad1": ((2, 6, 5, 4), (3, 1, 4, 3), dict(padding=1)),
    "groups2_s2_p1": ((2, 9, 9, 6), (3, 2, 3, 8), dict(groups=2, strides=2, padding=1)),
    "asym_pad_s32": ((1, 11, 10, 4), (5, 3, 4, 5),
                     dict(strides=(3, 2), padding=((1, 2), (0, 3)))),
    "dilation2_same": ((2, 10, 10, 4), (3, 3, 4, 4), dict(dilation_rate=2, padding="same")),
    "depthwise_s2": ((2, 9, 9, 8), (3, 3, 1, 8), dict(groups=8, padding="same", strides=2)),
    # the depthwise lowering's other paths: a channel multiplier, dilation, asymmetric padding
    "depthwise_mult2_dil2": ((3, 10, 9, 3), (3, 2, 1, 6),
                             dict(groups=3, dilation_rate=2, padding=((2, 1), (0, 2)))),
    "k11_s4": ((1, 23, 23, 3), (11, 11, 3, 4), dict(strides=4, padding=2)),
    # first layers: space_to_depth applies (ResNet's stem; an even kernel, uneven padding)
    "k7_s2_p3": ((2, 15, 13, 3), (7, 7, 3, 5), dict(strides=2, padding=3)),
    "k4x6_s2_asym": ((1, 14, 17, 2), (4, 6, 2, 3), dict(strides=2, padding=((1, 0), (2, 1)))),
    "stride_and_dilation": ((2, 12, 12, 4), (3, 3, 4, 6), dict(strides=2, dilation_rate=2,
                                                               padding=1)),
    # pads equal to those "same" gives at stride 3 (not at stride 1, which TensorFlow's
    # native convolves at where a stride meets a dilation)
    "stride3_dilation_same_pads": ((2, 12, 12, 4), (3, 3, 4, 6),
                                   dict(strides=3, dilation_rate=2, padding=1)),
    # "same" at a stride on an even size: one more row and column at the bottom and right
    "same_s2_even": ((2, 8, 8, 4), (3, 3, 4, 6), dict(strides=2, padding="same")),
    "k7_same_s2_even": ((1, 14, 12, 3), (7, 7, 3, 5), dict(strides=2, padding="same")),
    # 3x3 at stride 2 with padding "same" would not give: TF's native pads first in float32
    "k3_s2_p1": ((2, 8, 8, 4), (3, 3, 4, 6), dict(strides=2, padding=1)),
    "groups4_even": ((1, 8, 8, 8), (2, 2, 2, 8), dict(groups=4, padding="same")),
    # >= SEGMENT_COL2IM_CHANNELS channels per group: col2im by shifted additions
    "wide_channels": ((2, 6, 7, 20), (3, 3, 20, 4), dict(padding=1)),
    "wide_groups_s2": ((1, 7, 7, 32), (3, 2, 16, 6), dict(groups=2, strides=2, padding=1)),
}


def _run(lowering, x, k, kwargs, dy, conv=None):
    """(y, dx, dk) of sum(conv2d(x, k) * dy) on the current backend, in float64
    (``conv(x, k)`` instead of ``conv2d`` when given)."""
    if conv is not None:
        def conv2d(a, b, **_):  # noqa: F811 -- the given function replaces the front
            return conv(a, b)
    else:
        from keras_cct.lowering import conv2d
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf
        tx, tk = tf.constant(x), tf.constant(k)
        with tf.GradientTape() as tape:
            tape.watch([tx, tk])
            y = conv2d(tx, tk, lowering=lowering, **kwargs)
            loss = tf.reduce_sum(y * dy)
        return (to_numpy(y), *[to_numpy(g) for g in tape.gradient(loss, [tx, tk])])
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def loss(a, b):
            y = conv2d(a, b, lowering=lowering, **kwargs)
            return jnp.sum(y * dy), y
        (_, y), (dx, dk) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            jnp.asarray(x), jnp.asarray(k))
        return to_numpy(y), to_numpy(dx), to_numpy(dk)
    import torch
    tx = torch.tensor(x, requires_grad=True)
    tk = torch.tensor(k, requires_grad=True)
    y = conv2d(tx, tk, lowering=lowering, **kwargs)
    (y * torch.tensor(dy)).sum().backward()
    return to_numpy(y.detach()), to_numpy(tx.grad), to_numpy(tk.grad)


def _reference(case: str, seed: int):
    """(x, k, dy, (y, dx, dk)) for ``CASES[case]``: random float64 inputs and the float64
    convolution's output and gradients of ``sum(y * dy)`` (tests.reference)."""
    xs, ks, kwargs = CASES[case]
    rng = np.random.default_rng(seed)
    x, k = rng.standard_normal(xs), rng.standard_normal(ks)
    ref_kw = dict(strides=kwargs.get("strides", 1), padding=kwargs.get("padding", "valid"),
                  dilation=kwargs.get("dilation_rate", 1), groups=kwargs.get("groups", 1))
    y_ref = ref.conv2d(x, k, **ref_kw)
    dy = rng.standard_normal(y_ref.shape)
    dx_ref, dk_ref, _ = ref.conv2d_grads(x, k, dy, **ref_kw)
    return x, k, dy, (y_ref, dx_ref, dk_ref)


@pytest.mark.parametrize("lowering", ALL_LOWERINGS + ("auto",))
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference(case, lowering):
    xs, ks, kwargs = CASES[case]
    x, k, dy, (y_ref, dx_ref, dk_ref) = _reference(case, abs(hash(case)) % 2**32)
    if lowering != "auto" and lowering not in available(conv_geometry(xs, ks, **kwargs)):
        with pytest.raises(LoweringError, match=f"lowering '{lowering}' needs"):
            _run(lowering, x, k, kwargs, dy)
        return
    y, dx, dk = _run(lowering, x, k, kwargs, dy)
    assert y.dtype == np.float64
    assert y.shape == y_ref.shape
    assert ref.rel_err(y, y_ref) < 1e-12
    assert ref.rel_err(dx, dx_ref) < 1e-12
    assert ref.rel_err(dk, dk_ref) < 1e-12


@pytest.mark.parametrize("lowering", ("type1", "type2", "type3"))
@pytest.mark.parametrize("batch,parts", [(5, 2), (5, 5), (2, 3)])
def test_batch_partitions_match_reference(lowering, batch, parts):
    """CcT's batch partitioning: uneven partitions, one image each, and more partitions than
    images (empty ones) give the same outputs and gradients."""
    xs, ks, kwargs = (batch, 9, 8, 6), (3, 2, 3, 8), dict(groups=2, strides=(2, 1), padding=1)
    rng = np.random.default_rng(batch * 10 + parts)
    x, k = rng.standard_normal(xs), rng.standard_normal(ks)
    geo = conv_geometry(xs, ks, **kwargs)
    ref_kw = dict(strides=(2, 1), padding=1, groups=2)
    y_ref = ref.conv2d(x, k, **ref_kw)
    dy = rng.standard_normal(y_ref.shape)
    dx_ref, dk_ref, _ = ref.conv2d_grads(x, k, dy, **ref_kw)
    y, dx, dk = _run(lowering, x, k, kwargs, dy, conv=lambda a, b: lowered_conv2d(
        a, b, geo, lowering, partitions=parts))
    assert ref.rel_err(y, y_ref) < 1e-12
    assert ref.rel_err(dx, dx_ref) < 1e-12
    assert ref.rel_err(dk, dk_ref) < 1e-12


def test_partitions_follow_the_byte_target(monkeypatch):
    """The default partition count puts about ``$KERAS_CCT_PARTITION_BYTES`` of lowered data in
    each partition: here one image each (7 partitions for a batch of 7)."""
    from keras_cct.lowering.cost import lowered_bytes_per_image, partitions
    geo = conv_geometry((7, 9, 9, 4), (3, 3, 4, 5), padding=1)
    per_image = lowered_bytes_per_image(geo, "type1", 8)
    assert per_image == 9 * 9 * 3 * 3 * 4 * 8  # output pixels x taps x channels x float64
    monkeypatch.setenv("KERAS_CCT_PARTITION_BYTES", str(per_image))
    assert partitions(geo, "type1", 7, dtype_bytes=8) == 7
    assert partitions(geo, "type1", None) == 1
    monkeypatch.setenv("KERAS_CCT_PARTITION_BYTES", str(3 * per_image))
    assert partitions(geo, "type1", 7, dtype_bytes=8) == 3  # 3 + 3 + 1 images
    monkeypatch.setenv("KERAS_CCT_PARTITION_BYTES", "0")
    assert partitions(geo, "type1", 7) == 1
    assert partitions(geo, "type3", 7) == 1  # an ungrouped Type 3 lowers nothing


def test_partitions_only_where_the_lowering_repeats_values(monkeypatch):
    """A batch is cut into partitions only where the lowered matrix repeats input values (a
    lowered axis with more than one tap): a 1x1 kernel's Type 1, any Type 3 and a Type 2 of a
    one-row kernel copy each value at most once, and run as one partition."""
    from keras_cct.lowering.cost import partitions
    monkeypatch.setenv("KERAS_CCT_PARTITION_BYTES", "1")  # one image per partition otherwise
    one = conv_geometry((7, 9, 9, 4), (1, 1, 4, 5))
    assert partitions(one, "type1", 7) == 1
    grouped = conv_geometry((7, 9, 9, 4), (3, 3, 2, 6), groups=2, padding=1)
    assert partitions(grouped, "type3", 7) == 1
    assert partitions(grouped, "type1", 7) == 7
    assert partitions(grouped, "type2", 7) == 7
    row = conv_geometry((7, 9, 9, 4), (1, 3, 4, 5), padding=((0, 0), (1, 1)))
    assert partitions(row, "type2", 7) == 1  # Type 2 lowers the height only: one tap
    assert partitions(row, "type1", 7) == 7


def test_a_lowering_that_copies_nothing_is_a_reshape():
    """A 1x1 kernel's Type 1 at stride 1 (and a one-row kernel's Type 2, an ungrouped Type 3)
    multiplies the input itself: the cost model counts no lowering or col2im for it, and on
    JAX its program holds no gather (the gather of every row in order was a full copy of the
    input, and its col2im another)."""
    from keras_cct.lowering.cost import copies_nothing, cost
    one = conv_geometry((4, 6, 6, 8), (1, 1, 8, 16))
    assert copies_nothing(one, "type1") and copies_nothing(one, "type3")
    assert not copies_nothing(conv_geometry((4, 6, 6, 8), (1, 1, 8, 16), strides=2), "type1")
    assert not copies_nothing(conv_geometry((4, 6, 6, 8), (1, 1, 4, 16), groups=2), "type1")
    assert not copies_nothing(conv_geometry((4, 6, 6, 8), (3, 3, 8, 16)), "type1")
    assert copies_nothing(conv_geometry((4, 6, 6, 8), (1, 3, 8, 16)), "type2")
    c = cost(one, "type1", batch=4)
    assert c.lowering_elements == 0 and c.backward_movement == 0
    assert c.gemm_flops == 2 * 4 * 6 * 6 * 8 * 16
    if keras.backend.backend() == "jax":
        import jax
        x, k = np.ones((4, 6, 6, 8)), np.ones((1, 1, 8, 16))
        grad = jax.grad(lambda a, b: lowered_conv2d(a, b, one, "type1").sum(), argnums=(0, 1))
        assert "gather" not in str(jax.make_jaxpr(grad)(x, k))


def test_jax_cuts_at_most_max_partitions(monkeypatch):
    """On JAX a lowering is cut into at most ``MAX_PARTITIONS`` (4) partitions: XLA compiles
    each as another copy of the gather and the GEMM (CaffeNet's conv1 at batch 32 was 32
    partitions and 11 s of compiling). A batch of 9 with a byte target of one image: 4 GEMMs
    in the forward, where the other backends run 9; the result still matches float64."""
    if keras.backend.backend() != "jax":
        pytest.skip("MAX_PARTITIONS is set on JAX only")
    import jax
    from keras_cct.lowering import _backend as B
    from keras_cct.lowering.cost import partitions
    monkeypatch.setenv("KERAS_CCT_PARTITION_BYTES", "1")
    xs, ks = (9, 9, 9, 4), (3, 3, 4, 5)
    geo = conv_geometry(xs, ks, padding=1)
    assert partitions(geo, "type1", 9) == 9
    rng = np.random.default_rng(9)
    x, k = rng.standard_normal(xs), rng.standard_normal(ks)

    def forward(a, b):
        return lowered_conv2d(a, b, geo, "type1", custom_gradient=False)

    assert B.MAX_PARTITIONS == 4
    assert str(jax.make_jaxpr(forward)(x, k)).count("dot_general") == B.MAX_PARTITIONS
    y = to_numpy(forward(keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(k)))
    assert ref.rel_err(y, ref.conv2d(x, k, padding=1)) < 1e-12


def test_a_partition_counts_values_at_their_own_size(monkeypatch):
    """The engine's batch partitions hold a byte target of lowered data in the tensor's own
    dtype: a bfloat16 partition holds twice the images of a float32 one (they were counted at
    4 bytes per value in every dtype). Target: two float32 images' lowered matrices."""
    from keras_cct.lowering.cost import lowered_bytes_per_image, value_bytes
    from keras_cct.lowering.engine import default_partitions
    geo = conv_geometry((8, 9, 9, 4), (3, 3, 4, 5), padding=1)
    per_image = 9 * 9 * 3 * 3 * 4 * 4  # rows x (kh kw d) x 4 bytes, counted by hand
    assert lowered_bytes_per_image(geo, "type1") == per_image
    monkeypatch.setenv("KERAS_CCT_PARTITION_BYTES", str(2 * per_image))
    assert default_partitions(geo, "type1", 8, "float32") == 4
    assert default_partitions(geo, "type1", 8, "bfloat16") == 2
    most = 4 if keras.backend.backend() == "jax" else 8  # JAX: at most MAX_PARTITIONS
    assert default_partitions(geo, "type1", 8, "float64") == most
    assert value_bytes(keras.ops.zeros((1,), "bfloat16").dtype) == 2
    if keras.backend.backend() == "jax":  # what runs: one GEMM per partition
        import jax
        import jax.numpy as jnp
        x = jnp.ones((8, 9, 9, 4), jnp.bfloat16)
        k = jnp.ones((3, 3, 4, 5), jnp.bfloat16)
        jaxpr = str(jax.make_jaxpr(
            lambda a, b: lowered_conv2d(a, b, geo, "type1", custom_gradient=False))(x, k))
        assert jaxpr.count("dot_general") == 2


@pytest.mark.parametrize("case, form", [("k1x3", "rows"), ("k1x3_s2", "rows"),
                                        ("k3x1_same", "columns"),
                                        ("k5x1_dil2_groups2", "columns"),
                                        ("k3x1_pad1", "columns"), ("3x3", None),
                                        ("stride_and_dilation", None)])
def test_jax_native_runs_one_row_or_column_kernels_in_one_dimension(case, form):
    """On JAX ``native`` runs a kernel of one row or one column as a convolution over one
    spatial axis (XLA's two-dimensional one is 1.2-4.2x slower there): every convolution in
    its forward+backward program has one spatial axis, and the float32 result matches the
    float64 one; other kernels keep the two-dimensional convolution."""
    if keras.backend.backend() != "jax":
        pytest.skip("the one-dimensional form is JAX's")
    import jax
    from keras_cct.lowering._backend import jax as jax_backend
    xs, ks, kwargs = CASES[case]
    geo = conv_geometry(xs, ks, **kwargs)
    pads = geo.pad if geo.pads_are_same else ((0, 0), (0, 0))  # otherwise padded first
    assert jax_backend.one_dimensional(geo.kh, geo.kw, geo.sh, geo.sw, pads) == form
    x, k, dy, (y_ref, dx_ref, dk_ref) = _reference(case, 13)
    f32 = [a.astype(np.float32) for a in (x, k, dy)]

    def loss(a, b):
        return (conv2d(a, b, lowering="native", **kwargs) * f32[2]).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(f32[0], f32[1])
    convs = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert len(convs) == 3 * kwargs.get("groups", 1), jaxpr  # forward, two gradients (per group)
    assert {len(e.params["window_strides"]) for e in convs} == {1 if form else 2}
    y, dx, dk = _run("native", f32[0], f32[1], kwargs, f32[2])
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got.astype(np.float64), want) < 1e-5


def test_partitions_with_unknown_batch_size_tensorflow():
    """Under tf.function with a None batch dimension the partitions are cut at run time."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("dynamic batch sizes inside a traced function are TensorFlow's case")
    import tensorflow as tf
    xs, ks = (5, 8, 8, 4), (3, 3, 4, 6)
    geo = conv_geometry((None, 8, 8, 4), ks, padding=1)
    rng = np.random.default_rng(3)
    x, k = rng.standard_normal(xs), rng.standard_normal(ks)
    dy = rng.standard_normal((5, 8, 8, 6))

    @tf.function(input_signature=[tf.TensorSpec((None, 8, 8, 4), tf.float64),
                                  tf.TensorSpec(ks, tf.float64)])
    def run(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = lowered_conv2d(a, b, geo, "type1", partitions=3)
            loss = tf.reduce_sum(y * dy)
        return (y, *tape.gradient(loss, [a, b]))

    y, dx, dk = (t.numpy() for t in run(tf.constant(x), tf.constant(k)))
    dx_ref, dk_ref, _ = ref.conv2d_grads(x, k, dy, padding=1)
    assert ref.rel_err(y, ref.conv2d(x, k, padding=1)) < 1e-12
    assert ref.rel_err(dx, dx_ref) < 1e-12
    assert ref.rel_err(dk, dk_ref) < 1e-12


def test_bias_is_added():
    x = np.random.default_rng(0).standard_normal((1, 5, 5, 2))
    k = np.random.default_rng(1).standard_normal((3, 3, 2, 3))
    b = np.array([1.0, -2.0, 0.5])
    y = to_numpy(conv2d(keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(k),
                        keras.ops.convert_to_tensor(b), lowering="type3", padding=1))
    assert ref.rel_err(y, ref.conv2d(x, k, b, padding=1)) < 1e-12


@pytest.mark.parametrize("kwargs, message", [
    (dict(lowering="type9"), "`lowering` must be one of"),
    (dict(groups=3), "`groups`=3 must divide the input channels"),
    (dict(padding="full"), "`padding` must be"),
    (dict(strides=0), "`strides` must be >= 1"),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    x = keras.ops.zeros((1, 6, 6, 4))
    k = keras.ops.zeros((3, 3, 4, 4))
    with pytest.raises(LoweringError, match=message):
        conv2d(x, k, **kwargs)


def test_kernel_larger_than_padded_input():
    with pytest.raises(ValueError, match="larger than the padded input"):
        conv2d(keras.ops.zeros((1, 4, 4, 1)), keras.ops.zeros((5, 5, 1, 1)), lowering="type1")


@pytest.mark.parametrize("case", ["same_s2_even", "k7_same_s2_even"])
def test_native_pads_uneven_same_in_the_convolution(case):
    """Padding "same" at a stride on an even size pads one more row and column at the bottom
    and right. ``native`` passes it to the convolution as keras Conv2D(padding="same") does,
    not as a pad before it (on JAX and TensorFlow that trained 0.76-0.88x as fast as keras
    Conv2D): no pad op in the traced function, and the float32 result of the float64 one."""
    xs, ks, kwargs = CASES[case]
    x, k, dy, (y_ref, dx_ref, dk_ref) = _reference(case, 5)
    f32 = [a.astype(np.float32) for a in (x, k, dy)]
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf
        fn = tf.function(lambda a, b: conv2d(a, b, lowering="native", **kwargs))
        graph = fn.get_concrete_function(tf.TensorSpec(xs), tf.TensorSpec(ks)).graph
        ops = {op.type for op in graph.get_operations()}
        assert "Conv2D" in ops and not ops & {"Pad", "PadV2", "MirrorPad"}, ops
    elif backend == "jax":
        import jax
        text = str(jax.make_jaxpr(lambda a, b: conv2d(a, b, lowering="native", **kwargs))(
            f32[0], f32[1]))
        assert "conv_general_dilated" in text and " pad[" not in text, text
    y, dx, dk = _run("native", f32[0], f32[1], kwargs, f32[2])
    assert y.shape == y_ref.shape
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got.astype(np.float64), want) < 1e-5


@pytest.mark.parametrize("case", ["k3_s2_p1", "k7_s2_p3", "asym_pad_s32", "groups2_s2_p1"])
def test_native_in_float32_with_explicit_padding(case):
    """``native`` in float32 with Caffe's explicit padding (on TensorFlow passed to the op, or
    for 3x3 kernels at stride 2 a ``tf.pad`` before a VALID convolution, the faster form there)
    against the float64 convolution: output and both gradients."""
    kwargs = CASES[case][2]
    x, k, dy, (y_ref, dx_ref, dk_ref) = _reference(case, 11)
    f32 = [a.astype(np.float32) for a in (x, k, dy)]
    y, dx, dk = _run("native", f32[0], f32[1], kwargs, f32[2])
    assert y.dtype == np.float32 and y.shape == y_ref.shape
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got.astype(np.float64), want) < 1e-5


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="TensorFlow's grouped Conv2D or the split form")
@pytest.mark.parametrize("grouped_op", [True, False])
@pytest.mark.parametrize("case", ["groups2_s2_p1", "groups4_even", "wide_groups_s2"])
def test_tensorflow_native_grouped_both_forms(case, grouped_op, monkeypatch):
    """TensorFlow's ``native`` grouped layers in float32: one grouped ``Conv2D`` (where oneDNN
    computes its gradients; explicit padding padded first) or, where it does not, the split
    form -- both against the float64 convolution, output and both gradients."""
    from keras_cct.lowering._backend import tensorflow as tf_backend
    if grouped_op and not tf_backend.grouped_conv2d_works("float32"):
        pytest.skip("TensorFlow's grouped Conv2D has no gradient here (oneDNN off)")
    monkeypatch.setattr(tf_backend, "grouped_conv2d_works", lambda dtype: grouped_op)
    kwargs = CASES[case][2]
    x, k, dy, (y_ref, dx_ref, dk_ref) = _reference(case, 5)
    f32 = [a.astype(np.float32) for a in (x, k, dy)]
    y, dx, dk = _run("native", f32[0], f32[1], kwargs, f32[2])
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got.astype(np.float64), want) < 1e-5


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="PyTorch's kernel layout")
@pytest.mark.parametrize("ks, groups", [((3, 3, 4, 256), 1), ((3, 3, 4, 512), 2),
                                        ((3, 3, 4, 96), 1), ((1, 1, 8, 256), 1)])
def test_torch_native_kernel_layouts(ks, groups):
    """PyTorch's ``native`` hands oneDNN the kernel as ``(o, cg, kh, kw)`` channels-last, copied
    as a transposed matrix where its rows are a multiple of 1024 bytes (256 float32 output
    channels) and it has more than one tap, as a four-dimensional permutation otherwise: the
    same values either way, and the float32 convolution's output and both gradients equal
    the float64 one's."""
    import torch
    from keras_cct.lowering._backend import torch as torch_backend
    rng = np.random.default_rng(2)
    k = rng.standard_normal(ks)
    tk = torch.tensor(k, dtype=torch.float32, requires_grad=True)
    w = torch_backend.oihw_channels_last(tk)
    assert w.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(w, tk.permute(3, 2, 0, 1))
    matrix = ks[0] * ks[1] > 1 and ks[3] % 256 == 0
    # the matrix's transpose ends in a permuted view; the four-dimensional copy in a clone
    assert type(w.grad_fn).__name__ == ("PermuteBackward0" if matrix else "CloneBackward0")
    x = rng.standard_normal((2, 6, 7, ks[2] * groups))
    kwargs = dict(padding=ks[0] // 2, groups=groups)
    ref_kw = dict(strides=1, padding=ks[0] // 2, dilation=1, groups=groups)
    y_ref = ref.conv2d(x, k, **ref_kw)
    dy = rng.standard_normal(y_ref.shape)
    dx_ref, dk_ref, _ = ref.conv2d_grads(x, k, dy, **ref_kw)
    f32 = [a.astype(np.float32) for a in (x, k, dy)]
    y, dx, dk = _run("native", f32[0], f32[1], kwargs, f32[2])
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got.astype(np.float64), want) < 1e-5


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's kernels")
def test_tensorflow_grouped_conv2d_probe_without_onednn():
    """With oneDNN off TensorFlow's CPU kernels have no grouped gradients: the probe says so
    for float32, and float64 never has them, so ``native`` takes the split form there."""
    import os
    import subprocess
    import sys
    code = ("from keras_cct.lowering._backend import tensorflow as t; "
            "print(t.grouped_conv2d_works('float32'), t.grouped_conv2d_works('float64'))")
    from tests.conftest import ROOT
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "False"]


@pytest.mark.parametrize("case", ["asym_pad_s32", "k11_s4", "k7_s2_p3", "groups2_s2_p1",
                                  "stride_and_dilation", "k4x6_s2_asym",
                                  "stride3_dilation_same_pads", "same_s2_even"])
def test_native_in_bfloat16_with_explicit_padding(case):
    """``native`` in bfloat16 with Caffe's explicit padding (on TensorFlow a ``tf.pad`` before a
    VALID convolution: its bfloat16 Conv2D with explicit padding is not oneDNN's) equals the
    float64 convolution of the bfloat16-rounded inputs, to bfloat16's precision."""
    xs, ks, kwargs = CASES[case]
    rng = np.random.default_rng(7)
    x, k = rng.standard_normal(xs), rng.standard_normal(ks)
    xb, kb = (keras.ops.cast(keras.ops.convert_to_tensor(a, "float32"), "bfloat16")
              for a in (x, k))
    ref_kw = dict(strides=kwargs.get("strides", 1), padding=kwargs.get("padding", "valid"),
                  dilation=kwargs.get("dilation_rate", 1), groups=kwargs.get("groups", 1))
    y_ref = ref.conv2d(to_numpy(keras.ops.cast(xb, "float32")).astype(np.float64),
                       to_numpy(keras.ops.cast(kb, "float32")).astype(np.float64), **ref_kw)
    y = conv2d(xb, kb, lowering="native", **kwargs)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    y = to_numpy(keras.ops.cast(y, "float32")).astype(np.float64)
    assert y.shape == y_ref.shape
    assert ref.rel_err(y, y_ref) < 1e-2
