"""Batch-invariant arithmetic: sums, products and the exponential and logarithm whose result for
one element does not depend on the shape of the array it is computed in.

XLA groups a matrix product's or a reduction's terms by tiles and vector lanes that follow the
operands' shapes, and XLA:CPU evaluates ``exp`` and ``log`` with vector code whose last,
partial vector takes a scalar path with other rounding (measured: ``exp`` over 1,003 float32
values and over the same values in chunks of 7 differ in 88 of them by one spacing). A decode
step (one token per row over a KV cache) and a full forward (every token of a sequence) then
round differently for the same token, by a few float32 spacings. A model with
``ModelConfig.batch_invariant`` computes with these functions instead: every sum added one
term at a time in index order, ``exp`` and ``log`` from IEEE-exact elementwise arithmetic
(range reduction and a polynomial), so that the rollout's log-probs equal the trainer's bit for
bit (the train-rollout agreement mode; slow, for checking: a sum over n terms is n steps).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

_LN2_HI, _LN2_LO = 0.693145751953125, 1.4286067653e-06  # ln 2 split so that n * _LN2_HI is exact
_LOG2_E = 1.4426950408889634


def sum_in_index_order(term: Callable[[jax.Array], jax.Array], n: int) -> jax.Array:
    """``term(0) + term(1) + ... + term(n - 1)``, added one term at a time in that order: the
    rounding depends on the terms alone, not on the shapes around them."""
    return jax.lax.fori_loop(1, n, lambda i, acc: acc + term(i), term(0))


def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` (two operands) with each output's sum over the contracted
    indices taken in index order (row-major over the contracted letters) in at least float32;
    each term is one product per element, exact whatever the shapes."""
    (x_idx, w_idx), out_idx = spec.split("->")[0].split(","), spec.split("->")[1]
    summed = [c for c in x_idx if c in w_idx and c not in out_idx]
    acc = jnp.promote_types(jnp.result_type(x, w), jnp.float32)

    def summed_first(a, idx):  # [prod(summed sizes), rest...]
        a = jnp.moveaxis(a.astype(acc), [idx.index(c) for c in summed], range(len(summed)))
        return a.reshape(-1, *a.shape[len(summed) :])

    x_c, w_c = summed_first(x, x_idx), summed_first(w, w_idx)
    term = "".join(c for c in x_idx if c not in summed) + "," + "".join(c for c in w_idx if c not in summed)
    y = sum_in_index_order(lambda i: jnp.einsum(f"{term}->{out_idx}", x_c[i], w_c[i]), x_c.shape[0])
    return y.astype(jnp.result_type(x, w))


def divide(x: jax.Array, d) -> jax.Array:
    """``x / d`` as ``x * (1 / d)``: XLA may turn a division by a compile-time constant into a
    product with its reciprocal, so a constant divisor (the trainer's temperature) and a
    runtime one (the engine's) round alike only when both are written as that product."""
    return x * (1.0 / jnp.asarray(d, x.dtype))


def _pow2(n_int: jax.Array, dtype) -> jax.Array:
    """2**n for integer n in [-126, 127], exactly (the float's exponent bits)."""
    return jax.lax.bitcast_convert_type(((n_int + 127) << 23).astype(jnp.int32), jnp.float32).astype(dtype)


@jax.custom_jvp
def exp(x: jax.Array) -> jax.Array:
    """``e**x`` in float32 within about two spacings, from elementwise arithmetic only:
    ``x = n ln2 + r`` (|r| <= ln2 / 2, Cody-Waite), ``e**r`` by its degree-7 Taylor polynomial
    (truncation < 1e-8 relative), times ``2**n`` as two exact powers of two; below the normal
    range 0 (XLA:CPU flushes subnormals), below -104: 0."""
    x32 = jnp.clip(x.astype(jnp.float32), -104.0, 88.5)
    n = jnp.round(x32 * _LOG2_E)
    r = (x32 - n * _LN2_HI) - n * _LN2_LO
    p = 1.0 + r * (1.0 + r * (1 / 2 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (1 / 720 + r * (1 / 5040)))))))
    n_int = n.astype(jnp.int32)
    half = n_int // 2
    y = p * _pow2(half, jnp.float32) * _pow2(n_int - half, jnp.float32)
    return jnp.where(x < -104.0, 0.0, y).astype(x.dtype)


@exp.defjvp
def _exp_jvp(primals, tangents):
    y = exp(primals[0])
    return y, y * tangents[0]


@jax.custom_jvp
def log(y: jax.Array) -> jax.Array:
    """``ln y`` for normal positive float32 ``y`` within about two spacings, from elementwise
    arithmetic only: ``y = 2**e m`` with m in [sqrt(1/2), sqrt(2)) read from the float's bits,
    ``ln m = 2 atanh(s)``, ``s = (m - 1) / (m + 1)`` (|s| < 0.172) by its series to s**11."""
    y32 = y.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(y32, jnp.int32)
    e = (bits >> 23) - 127
    m = jax.lax.bitcast_convert_type((bits & 0x7FFFFF) | 0x3F800000, jnp.float32)
    big = m > 1.4142135
    m, e = jnp.where(big, m * 0.5, m), jnp.where(big, e + 1, e)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    log_m = 2.0 * s * (1.0 + s2 * (1 / 3 + s2 * (1 / 5 + s2 * (1 / 7 + s2 * (1 / 9 + s2 * (1 / 11))))))
    ef = e.astype(jnp.float32)
    return (ef * _LN2_HI + (log_m + ef * _LN2_LO)).astype(y.dtype)


@log.defjvp
def _log_jvp(primals, tangents):
    return log(primals[0]), tangents[0] / primals[0]


def logsumexp(z: jax.Array, batch_invariant: bool = True) -> jax.Array:
    """``log(sum(exp(z)))`` over the last axis: with ``batch_invariant`` by `exp`, the sum in
    index order and `log`; else ``jax.nn.logsumexp``."""
    if not batch_invariant:
        return jax.nn.logsumexp(z, axis=-1)
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1))  # a max is the same in any order
    e = exp(z - m[..., None])
    return m + log(sum_in_index_order(lambda i: e[..., i], z.shape[-1]))
