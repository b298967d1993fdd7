"""Batch-invariant arithmetic (`jaxflow.models.ordered`) against NumPy in float64, and the
property it exists for: an element's result does not depend on the shape it is computed in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.models import ordered

RNG = np.random.default_rng(0)


def spacings(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in float32 spacings of ``want``."""
    want32 = want.astype(np.float32)
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want32)).astype(np.float64)


def in_chunks(fn, x: np.ndarray, size: int) -> np.ndarray:
    """``fn`` over ``x`` in chunks of ``size`` elements (other shapes, other vector tails)."""
    f = jax.jit(fn)
    return np.concatenate([np.asarray(f(x[i : i + size])) for i in range(0, len(x), size)])


def test_exp_is_numpys_to_two_spacings_and_shape_invariant():
    x = np.concatenate([RNG.uniform(-30, 30, 2000), RNG.uniform(-87, 88, 1000), [0.0, -1e-30, 1e-7, -87.3]])
    x = x.astype(np.float32)
    got = np.asarray(jax.jit(ordered.exp)(x))
    assert spacings(got, np.exp(x.astype(np.float64))).max() <= 2  # (normal results: XLA flushes subnormals)
    assert np.asarray(ordered.exp(np.float32(-200.0))) == 0.0
    np.testing.assert_array_equal(in_chunks(ordered.exp, x, 7), got)
    np.testing.assert_array_equal(in_chunks(ordered.exp, x, 1), got)


def test_log_is_numpys_to_two_spacings_and_shape_invariant():
    y = np.concatenate([RNG.uniform(1.0, 2.0, 1000), np.exp(RNG.uniform(-80, 80, 2000)), [1.0, 2.0, 0.5]])
    y = y.astype(np.float32)
    got = np.asarray(jax.jit(ordered.log)(y))
    want = np.log(y.astype(np.float64))
    assert (np.abs(got - want) <= 2 * np.spacing(np.maximum(np.abs(want), 1.0).astype(np.float32))).all()
    assert got[np.flatnonzero(y == 1.0)[0]] == 0.0
    np.testing.assert_array_equal(in_chunks(ordered.log, y, 7), got)


def test_derivatives_of_exp_and_log():
    x = np.float32(-1.3)
    assert float(jax.grad(ordered.exp)(x)) == pytest.approx(np.exp(-1.3), rel=3e-7)
    assert float(jax.grad(ordered.log)(np.float32(3.0))) == pytest.approx(1 / 3, rel=1e-7)


def sequential_sum_of_products(x_TxC: np.ndarray, w_CxO: np.ndarray) -> np.ndarray:
    """``x @ w`` in float32 with each output's terms added one at a time, c = 0, 1, ... (NumPy
    float32 arithmetic rounds each product and each sum once, as IEEE says)."""
    acc = x_TxC[:, :1] * w_CxO[:1]
    for c in range(1, x_TxC.shape[1]):
        acc = acc + x_TxC[:, c : c + 1] * w_CxO[c : c + 1]
    return acc


@pytest.mark.parametrize(
    "spec, x_shape, w_shape",
    [("TD,DF->TF", (37, 24), (24, 19)), ("THK,HKD->TD", (11, 3, 8), (3, 8, 16)), ("TD,VD->TV", (5, 16), (33, 16))],
)
def test_einsum_sums_in_index_order_and_each_row_is_the_same_alone(spec, x_shape, w_shape):
    x = RNG.normal(size=x_shape).astype(np.float32)
    w = RNG.normal(size=w_shape).astype(np.float32)
    f = jax.jit(lambda a, b: ordered.einsum(spec, a, b))
    got = np.asarray(f(x, w))
    w_CxO = w.T if spec.endswith("VD->TV") else w.reshape(x[0].size, -1)
    np.testing.assert_array_equal(got.reshape(x.shape[0], -1), sequential_sum_of_products(x.reshape(len(x), -1), w_CxO))
    np.testing.assert_allclose(got, np.einsum(spec, x.astype(np.float64), w.astype(np.float64)), rtol=1e-5, atol=1e-5)
    rows = np.concatenate([np.asarray(f(x[i : i + 1], w)) for i in range(x.shape[0])])
    np.testing.assert_array_equal(rows, got)


def test_logsumexp_is_scipys_and_each_row_the_same_alone():
    from scipy.special import logsumexp

    z = (RNG.normal(size=(9, 301)) * 6).astype(np.float32)
    got = np.asarray(jax.jit(ordered.logsumexp)(z))
    np.testing.assert_allclose(got, logsumexp(z.astype(np.float64), axis=-1), rtol=3e-7)
    rows = np.concatenate([np.asarray(jax.jit(ordered.logsumexp)(z[i : i + 1])) for i in range(9)])
    np.testing.assert_array_equal(rows, got)
    np.testing.assert_array_equal(np.asarray(ordered.logsumexp(z, batch_invariant=False)), jax.nn.logsumexp(z, -1))


def test_divide_rounds_a_constant_and_a_runtime_divisor_alike():
    x = RNG.normal(size=(1001,)).astype(np.float32)
    constant = np.asarray(jax.jit(lambda a: ordered.divide(a, 0.7))(x))
    runtime = np.asarray(jax.jit(ordered.divide)(x, jnp.float32(0.7)))
    np.testing.assert_array_equal(constant, runtime)
    np.testing.assert_allclose(constant, x.astype(np.float64) / 0.7, rtol=2e-7)
