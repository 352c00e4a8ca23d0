"""The backend's GEMM primitives (``keras_cct.lowering._backend``: ``matmul``, ``matmul_tn``,
``matmul_nt``, ``bmm``), which every lowering ends in, against float64 numpy in float32 and
bfloat16 on the current backend; on JAX, bfloat16 products go to XLA's library GEMM."""

import keras
import numpy as np
import pytest

from keras_cct.lowering import _backend as B
from tests.backend_grads import to_numpy

#: float32: rounding of a float32 accumulation; bfloat16: inputs drawn exactly representable,
#: so only the result's rounding to bfloat16 (2**-8 relative) and the accumulation order
TOL = {"float32": 1e-5, "bfloat16": 8e-3}


def _draw(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":  # exactly representable: the reference sees the same inputs
        x = to_numpy(keras.ops.cast(keras.ops.cast(x, "bfloat16"), "float32"))
    return x


def _check(got, want, dtype):
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    got = to_numpy(keras.ops.cast(got, "float32")).astype(np.float64)
    assert np.abs(got - want).max() <= TOL[dtype] * np.abs(want).max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_2d_products_against_float64(dtype):
    rng = np.random.default_rng(0)
    a, b = _draw(rng, (37, 64), dtype), _draw(rng, (64, 23), dtype)
    c = _draw(rng, (37, 23), dtype)
    t = lambda x: keras.ops.cast(x, dtype)  # noqa: E731
    a64, b64, c64 = (x.astype(np.float64) for x in (a, b, c))
    _check(B.matmul(t(a), t(b)), a64 @ b64, dtype)
    _check(B.matmul_tn(t(a), t(c)), a64.T @ c64, dtype)
    _check(B.matmul_tn(t(c), t(a)), c64.T @ a64, dtype)  # the other operand the wider one
    _check(B.matmul_nt(t(c), t(b)), c64 @ b64.T, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ta, tb", [(False, False), (False, True), (True, False), (True, True)])
def test_batched_products_against_float64(dtype, ta, tb):
    rng = np.random.default_rng(1)
    a, b = _draw(rng, (4, 19, 32), dtype), _draw(rng, (4, 32, 11), dtype)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    a_in = np.swapaxes(a, 1, 2).copy() if ta else a
    b_in = np.swapaxes(b, 1, 2).copy() if tb else b
    got = B.bmm(keras.ops.cast(a_in, dtype), keras.ops.cast(b_in, dtype), ta=ta, tb=tb)
    _check(got, want, dtype)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA's library GEMM: JAX only")
def test_jax_bfloat16_products_ask_for_a_float32_result():
    """The form XLA's CPU backend hands to its matrix library (4-6x faster on bfloat16 units):
    a float32 result, cast back (a plain bfloat16 product asks for a bfloat16 one)."""
    import jax
    import jax.numpy as jnp
    a, b = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 4), jnp.bfloat16)
    a3, b3 = a[None], b[None]

    def asks(fn, *args):
        return "preferred_element_type=float32" in str(jax.make_jaxpr(fn)(*args))

    assert asks(B.matmul, a, b)
    assert asks(B.matmul_nt, a, b.T)
    assert asks(B.bmm, a3, b3)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA's library GEMM: JAX only")
@pytest.mark.parametrize("form", ["tn", "bmm_ta", "bmm_tb", "bmm_ta_tb", "tn_wide"])
def test_jax_bfloat16_transposed_products_are_untransposed_for_the_library(form):
    """XLA's library takes a product only with neither operand transposed (the weight
    gradients contract their left operand's first axis): the JAX backend asks for such a
    product, on a copy pinned row-major, whichever operand it transposes."""
    import jax
    import jax.numpy as jnp
    ones = lambda *s: jnp.ones(s, jnp.bfloat16)  # noqa: E731
    fn, args = {"tn": (B.matmul_tn, (ones(64, 8), ones(64, 4))),       # transposes b
                "tn_wide": (B.matmul_tn, (ones(64, 4), ones(64, 8))),  # transposes a
                "bmm_ta": (lambda a, b: B.bmm(a, b, ta=True), (ones(2, 64, 8), ones(2, 64, 4))),
                "bmm_tb": (lambda a, b: B.bmm(a, b, tb=True), (ones(2, 8, 64), ones(2, 4, 64))),
                "bmm_ta_tb": (lambda a, b: B.bmm(a, b, ta=True, tb=True),
                              (ones(2, 64, 8), ones(2, 4, 64)))}[form]
    jaxpr = jax.make_jaxpr(fn)(*args)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    (lhs_c, rhs_c), (lhs_b, _) = dots[0].params["dimension_numbers"]
    rank = dots[0].invars[0].aval.ndim
    assert tuple(lhs_c) == (rank - 1,) and tuple(rhs_c) == (len(lhs_b),)
    assert dots[0].params["preferred_element_type"] == jnp.float32
    assert "layout_constraint" in {e.primitive.name for e in jaxpr.eqns}
