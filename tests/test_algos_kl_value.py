"""KL estimators and controllers, the in-reward KL penalty, entropy, the value loss and the
Safe-RLHF pieces, against NumPy references written here from the formulas of issue 3."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflow.algos as algos

TOL = {np.float64: 1e-10, np.float32: 1e-5}
KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@pytest.fixture(params=[np.float64, np.float32], ids=["f64", "f32"])
def dtype(request):
    with jax.enable_x64(request.param is np.float64):
        yield request.param


def ragged_mask(b=5, t=6, lengths=(6, 2, 0, 4, 1)):
    return (np.arange(t)[None, :] < np.array(lengths)[:b, None]).astype(np.float64)


def r_mean(x, m, axis=None):
    return (x * m).sum(axis) / (m.sum(axis) + 1e-8)


def r_agg(loss, m, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    if mode == "token-mean":
        return (loss * m).sum() / (m.sum() if batch_num_tokens is None else batch_num_tokens) * dp_size
    if mode == "token-sum":
        return (loss * m).sum() * dp_size
    n_tok = m.sum(-1)
    seq = (loss * m).sum(-1) / ((n_tok + 1e-8) if mode == "seq-mean-token-mean" else 1)
    n_seq = (n_tok > 0).sum() if global_batch_size is None else global_batch_size
    out = seq[n_tok > 0].sum() / n_seq * dp_size
    if mode == "seq-mean-token-sum-norm":
        out = out / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return out


def ref_kl(lp, ref, kind):
    d = lp - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return np.abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    x = np.clip(ref - lp, -20, 20)
    return np.clip(np.exp(x) - x - 1, -10, 10)


def kl_inputs(seed=0):
    rng = np.random.default_rng(seed)
    lp = rng.normal(-2, 1, size=(4, 6))
    ref = lp + rng.normal(0, 0.7, size=(4, 6))
    ref[0, 0] = lp[0, 0] + 25.0  # x clamps at +20, then k3 clamps at +10
    ref[0, 1] = lp[0, 1] - 30.0  # x clamps at -20
    ref[0, 2] = lp[0, 2] + 2.5  # k3 = e^2.5 - 3.5 ~ 8.7, unclamped
    return lp, ref


# --------------------------------------------------------------------------- KL


@jax.jit
def all_kl(lp, ref):
    kinds = KINDS + tuple(k + "+" for k in KINDS)
    return {k: algos.kl_penalty(lp, ref, k) for k in kinds}


def test_kl_penalty_matches_reference(dtype):
    lp, ref = (x.astype(dtype) for x in kl_inputs())
    out = all_kl(lp, ref)
    for kind in KINDS:
        want = ref_kl(lp.astype(float), ref.astype(float), kind)
        got = np.asarray(out[kind])
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, atol=TOL[dtype] * max(1, np.abs(want).max()), rtol=0, err_msg=kind)
        np.testing.assert_array_equal(np.asarray(out[kind + "+"]), got)  # "+": the same value
    k3 = np.asarray(out["k3"])
    assert k3[0, 0] == 10.0 and k3[0, 2] < 10.0 and np.all(k3 >= 0)


def test_straight_through_has_k2_gradient():
    with jax.enable_x64(True):
        lp, ref = kl_inputs(1)

        @jax.jit
        def grads(lp, ref):
            out = {}
            for kind in KINDS:
                for k in (kind, kind + "+"):
                    out[k] = jax.grad(
                        lambda x, k=k: jnp.sum(algos.kl_penalty(x, ref, k) * jnp.arange(1.0, 25.0).reshape(4, 6))
                    )(lp)
            return out

        g = grads(lp, ref)
        w = np.arange(1.0, 25.0).reshape(4, 6)
        for kind in KINDS:
            np.testing.assert_allclose(np.asarray(g[kind + "+"]), w * (lp - ref), atol=1e-12, err_msg=kind)
        # the plain estimators keep their own gradients: k1 -> 1, k3 -> 1 - e^(ref - lp) (unclamped)
        np.testing.assert_allclose(np.asarray(g["k1"]), w, atol=1e-12)
        x = ref - lp
        inside = (np.abs(x) < 20) & (np.exp(x) - x - 1 < 10)
        np.testing.assert_allclose(np.asarray(g["k3"])[inside], (w * (1 - np.exp(x)))[inside], atol=1e-10)


def test_kl_registry():
    with pytest.raises(ValueError) as err:
        algos.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4")
    assert all(k in str(err.value) for k in ("k1", "k3", "low_var_kl", "k3+"))
    with pytest.raises(KeyError):
        algos.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4+")
    with pytest.raises(KeyError, match="low_var_kl"):  # no full-vocabulary KL: it needs logits
        algos.kl_penalty(jnp.zeros(2), jnp.zeros(2), "full")

    @algos.register_kl_estimator("test_k_half")
    def half(logprob, ref_logprob):
        return 0.5 * (logprob - ref_logprob)

    try:
        with jax.enable_x64(True):
            lp, ref = kl_inputs()
            np.testing.assert_allclose(np.asarray(algos.kl_penalty(lp, ref, "test_k_half")), 0.5 * (lp - ref))
            g = jax.grad(lambda x: algos.kl_penalty(x, ref, "test_k_half+").sum())(lp)
            np.testing.assert_allclose(np.asarray(g), lp - ref, atol=1e-12)
    finally:
        algos.KL_ESTIMATOR_REGISTRY.unregister("test_k_half")


def test_kl_controllers():
    fixed = algos.get_kl_controller({"type": "fixed", "kl_coef": 0.05})
    fixed.update(10.0, 64)
    assert fixed.value == 0.05

    class Cfg:
        type, kl_coef, target_kl, horizon = "adaptive", 0.1, 0.02, 1000

    ctrl = algos.get_kl_controller(Cfg)
    beta = 0.1
    for kl, n in ((0.5, 64), (0.021, 64), (0.0, 128), (0.019, 32)):  # clipped high, inside, clipped low
        e = np.clip(kl / 0.02 - 1, -0.2, 0.2)
        beta = beta * (1 + e * n / 1000)
        ctrl.update(kl, n)
        np.testing.assert_allclose(ctrl.value, beta, rtol=1e-14)
    with jax.enable_x64(True):  # the pure step jits
        step = jax.jit(algos.adaptive_kl_coef)
        np.testing.assert_allclose(float(step(0.1, 0.5, 0.02, 1000, 64)), 0.1 * (1 + 0.2 * 64 / 1000), rtol=1e-14)
    with pytest.raises(ValueError, match="adaptive, fixed"):
        algos.get_kl_controller({"type": "pid", "kl_coef": 0.1})
    with pytest.raises(ValueError, match="horizon"):
        algos.AdaptiveKLController(0.1, 0.02, 0)


@jax.jit
def all_kl_penalties(scores, old, ref, m):
    return {kind: algos.apply_kl_penalty(scores, old, ref, m, 0.05, kind=kind) for kind in ("kl", "k3", "k3+")}


def test_apply_kl_penalty(dtype):
    rng = np.random.default_rng(2)
    m = ragged_mask()
    scores = rng.normal(size=m.shape) * m
    old = rng.normal(-2, 1, size=m.shape)
    ref = old + rng.normal(0, 0.5, size=m.shape)
    args = [x.astype(dtype) for x in (scores, old, ref, m)]
    out = all_kl_penalties(*args)
    s, o, r, mm = (x.astype(float) for x in args)
    for kind, (rewards, current_kl) in out.items():
        kl = ref_kl(o, r, kind.rstrip("+")) * mm
        np.testing.assert_allclose(np.asarray(rewards), s - 0.05 * kl, atol=TOL[dtype], rtol=0, err_msg=kind)
        np.testing.assert_allclose(float(current_kl), r_mean(kl, mm, axis=-1).mean(), atol=TOL[dtype], rtol=0)


# --------------------------------------------------------------------------- entropy


def ref_entropy(z):
    z = z - z.max(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1, keepdims=True))
    logp = z - lse
    return -(np.exp(logp) * logp).sum(-1)


def test_entropy_matches_reference_and_is_stable(dtype):
    rng = np.random.default_rng(3)
    z = rng.normal(0, 3, size=(3, 5, 11))
    z[0, 0] *= 1e4  # huge logits: no overflow
    z[0, 1] = 0.0  # uniform: log V
    z = z.astype(dtype)
    chunks = (None, 4, 15)  # direct, chunks with an overlapping tail, one chunk
    out = jax.jit(lambda z: [algos.compute_entropy_from_logits(z, chunk_size=c) for c in chunks])(z)
    for h in out:
        h = np.asarray(h)
        assert h.shape == (3, 5) and np.all(np.isfinite(h))
        np.testing.assert_allclose(h, ref_entropy(z.astype(float)), atol=TOL[dtype] * 10, rtol=0)
    np.testing.assert_allclose(np.asarray(out[0])[0, 1], np.log(11), atol=TOL[dtype])


def test_chunked_entropy_gradient():
    with jax.enable_x64(True):
        z = np.random.default_rng(4).normal(0, 2, size=(4, 5, 7))
        w = np.random.default_rng(5).normal(size=(4, 5))
        grad = jax.jit(
            jax.grad(lambda z, c: jnp.sum(algos.compute_entropy_from_logits(z, chunk_size=c) * w)),
            static_argnums=1,
        )
        direct, chunked = grad(z, None), grad(z, 3)
        np.testing.assert_allclose(np.asarray(chunked), np.asarray(direct), atol=1e-12)
        # and the analytic gradient -w p (z - E_p z)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = -w[..., None] * p * (z - (p * z).sum(-1, keepdims=True))
        np.testing.assert_allclose(np.asarray(direct), want, atol=1e-12)


def test_chunked_entropy_memory_is_bounded():
    """Compiled for a 2 GiB logits array (abstract, nothing allocated): the temporaries of
    the forward and the backward pass stay within a few chunks."""
    n, v, chunk = 4096, 1 << 17, 64
    x = jax.ShapeDtypeStruct((n, v), jnp.float32)
    chunk_bytes = chunk * v * 4
    fwd = jax.jit(lambda z: algos.compute_entropy_from_logits(z, chunk_size=chunk)).lower(x).compile()
    bwd = jax.jit(jax.grad(lambda z: algos.compute_entropy_from_logits(z, chunk_size=chunk).sum())).lower(x).compile()
    for compiled in (fwd, bwd):
        mem = compiled.memory_analysis()
        assert mem.temp_size_in_bytes <= 4 * chunk_bytes, mem.temp_size_in_bytes


def test_entropy_loss(dtype):
    z = np.random.default_rng(6).normal(size=(5, 6, 9)).astype(dtype)
    m = ragged_mask().astype(dtype)
    modes = ("token-mean", "seq-mean-token-mean")
    out = jax.jit(lambda z, m: [algos.compute_entropy_loss(z, m, mode) for mode in modes])(z, m)
    for mode, got in zip(modes, out):
        np.testing.assert_allclose(
            float(got), r_agg(ref_entropy(z.astype(float)), m.astype(float), mode), atol=TOL[dtype]
        )


# --------------------------------------------------------------------------- value loss


def ref_value_loss(vpreds, returns, values, m, eps, mode, **norm):
    v_clip = np.clip(vpreds, values - eps, values + eps)
    l1, l2 = (vpreds - returns) ** 2, (v_clip - returns) ** 2
    return 0.5 * r_agg(np.maximum(l1, l2), m, mode, **norm), r_mean((l2 > l1).astype(float), m)


def value_inputs(seed=7):
    rng = np.random.default_rng(seed)
    m = ragged_mask()
    values = rng.normal(size=m.shape)
    vpreds = values + rng.choice([-0.5, -0.1, 0.05, 0.3], size=m.shape) + rng.uniform(-0.02, 0.02, m.shape)
    returns = values + rng.normal(0, 0.5, size=m.shape)
    return vpreds, returns, values, m


@jax.jit
def all_value_losses(vpreds, returns, values, m):
    out = {mode: algos.compute_value_loss(vpreds, returns, values, m, 0.2, mode) for mode in AGG_MODES}
    out["global"] = algos.compute_value_loss(
        vpreds, returns, values, m, 0.2, "seq-mean-token-sum-norm", dp_size=2, global_batch_size=7, loss_scale_factor=3
    )
    return out


def test_value_loss_matches_reference(dtype):
    args = [x.astype(dtype) for x in value_inputs()]
    out = all_value_losses(*args)
    ref_args = [x.astype(float) for x in args]
    for mode in AGG_MODES:
        loss, clipfrac = out[mode]
        want_loss, want_frac = ref_value_loss(*ref_args, 0.2, mode)
        np.testing.assert_allclose(float(loss), want_loss, atol=TOL[dtype], rtol=0, err_msg=mode)
        np.testing.assert_allclose(float(clipfrac), want_frac, atol=TOL[dtype], rtol=0)
    assert 0 < float(out["token-mean"][1]) < 1  # both branches occur
    want, _ = ref_value_loss(
        *ref_args, 0.2, "seq-mean-token-sum-norm", dp_size=2, global_batch_size=7, loss_scale_factor=3
    )
    np.testing.assert_allclose(float(out["global"][0]), want, atol=TOL[dtype], rtol=0)


def test_value_loss_gradient_and_padding():
    with jax.enable_x64(True):
        vpreds, returns, values, m = value_inputs(8)
        grad = jax.jit(jax.grad(lambda vp: algos.compute_value_loss(vp, returns, values, m, 0.2)[0]))(vpreds)
        h = 1e-6
        fd = np.zeros_like(vpreds)
        for idx in np.ndindex(vpreds.shape):
            e = np.zeros_like(vpreds)
            e[idx] = h
            fd[idx] = (
                ref_value_loss(vpreds + e, returns, values, m, 0.2, "token-mean")[0]
                - ref_value_loss(vpreds - e, returns, values, m, 0.2, "token-mean")[0]
            ) / (2 * h)
        np.testing.assert_allclose(np.asarray(grad), fd, rtol=1e-6, atol=1e-9)
        padded = [
            np.concatenate([x, np.random.default_rng(0).normal(size=(5, 2))], axis=1) for x in (vpreds, returns, values)
        ]
        m_pad = np.concatenate([m, np.zeros((5, 2))], axis=1)
        base = all_value_losses(vpreds, returns, values, m)
        pad = all_value_losses(*padded, m_pad)
        for mode in AGG_MODES[:4]:  # (the -norm mode divides by the padded length on purpose)
            np.testing.assert_allclose(float(pad[mode][0]), float(base[mode][0]), atol=1e-12)
            np.testing.assert_allclose(float(pad[mode][1]), float(base[mode][1]), atol=1e-12)


# --------------------------------------------------------------------------- Safe-RLHF and PPO-ptx


def test_lagrangian_advantages_and_episode_cost(dtype):
    rng = np.random.default_rng(9)
    m = ragged_mask().astype(dtype)
    a_r, a_c, costs = (rng.normal(size=m.shape).astype(dtype) for _ in range(3))
    for lam in (0.0, 0.7, 5.0):
        got = jax.jit(algos.compute_lagrangian_advantages)(a_r, a_c, lam)
        want = (a_r.astype(float) - lam * a_c.astype(float)) / (1 + lam)
        np.testing.assert_allclose(np.asarray(got), want, atol=TOL[dtype], rtol=0)
    got = jax.jit(algos.compute_episode_cost)(costs, m)
    np.testing.assert_allclose(float(got), (costs.astype(float) * m).sum(-1).mean(), atol=TOL[dtype], rtol=0)


def test_lagrange_multiplier_updates():
    with jax.enable_x64(True):
        step = jax.jit(algos.update_lagrange_multiplier, static_argnames=("scale",))
        # linear: projected ascent, clipped at 0
        np.testing.assert_allclose(float(step(1.0, 3.0, 1.0, 0.1, "linear")), 1.2, rtol=1e-14)
        assert float(step(0.1, 0.0, 1.0, 0.5, "linear")) == 0.0
        # log scale: log lambda moves by lr (J_C - d); stays positive
        np.testing.assert_allclose(float(step(0.5, 3.0, 1.0, 0.1, "log")), 0.5 * np.exp(0.2), rtol=1e-14)
        np.testing.assert_allclose(float(step(0.5, -50.0, 1.0, 0.1, "log")), 0.5 * np.exp(-5.1), rtol=1e-14)
        np.testing.assert_allclose(float(step(1.0, 30.0, 1.0, 0.1, "linear", 2.0)), 2.0)  # cap
    lag = algos.LagrangeMultiplier(1.0, cost_threshold=0.5, lr=0.2)
    lam = 1.0
    for cost in (1.5, -3.0, -10.0, 2.0):
        lam = max(0.0, lam + 0.2 * (cost - 0.5))
        np.testing.assert_allclose(lag.update(cost), lam, rtol=1e-12)
    with pytest.raises(ValueError, match="linear, log"):
        algos.update_lagrange_multiplier(1.0, 1.0, 0.0, 0.1, scale="sqrt")
    with pytest.raises(ValueError, match="> 0"):
        algos.LagrangeMultiplier(0.0, 0.5, 0.1, scale="log")


def test_ptx_loss(dtype):
    rng = np.random.default_rng(10)
    m = ragged_mask().astype(dtype)
    lp = rng.normal(-2, 1, size=m.shape).astype(dtype)
    ptx = jax.jit(algos.compute_ptx_loss)(lp, m)
    np.testing.assert_allclose(
        float(ptx), r_agg(-lp.astype(float), m.astype(float), "token-mean"), atol=TOL[dtype], rtol=0
    )
    total = algos.add_ptx_loss(jnp.asarray(0.3, dtype), ptx, 0.25)
    np.testing.assert_allclose(float(total), 0.3 + 0.25 * float(ptx), atol=TOL[dtype], rtol=0)


def test_vmap_over_independent_batches():
    """KL penalty, value loss, chunked entropy (and its gradient) and the Safe-RLHF pieces vmap."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(11)
        m = np.stack([ragged_mask(), ragged_mask(lengths=(1, 6, 3, 0, 2))])
        old, ref, vp, ret, val = (rng.normal(size=m.shape) for _ in range(5))
        z = rng.normal(size=m.shape + (7,))

        def one(m, old, ref, vp, ret, val, z):
            rewards, kl = algos.apply_kl_penalty(ret, old, ref, m, 0.1, "k3+")
            vf, frac = algos.compute_value_loss(vp, ret, val, m, 0.2)
            ent, ent_grad = jax.value_and_grad(lambda z: algos.compute_entropy_loss(z, m))(z)
            h = algos.compute_entropy_from_logits(z, chunk_size=4)
            adv = algos.compute_lagrangian_advantages(vp, val, 0.5)
            return rewards, kl, vf, frac, ent, ent_grad, h, adv

        batched = jax.jit(jax.vmap(one))(m, old, ref, vp, ret, val, z)
        single = jax.jit(one)
        for i in range(2):
            want = single(m[i], old[i], ref[i], vp[i], ret[i], val[i], z[i])
            for got, w in zip(batched, want):
                np.testing.assert_allclose(np.asarray(got[i]), np.asarray(w), atol=1e-12)
