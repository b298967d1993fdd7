"""Policy losses and ``agg_loss`` against NumPy references written from verl's formulas (here,
and for the losses verl 0.9.1 added in `tests.verl_reference`).

The log-ratios are drawn from a grid that straddles every clip boundary (rho < 1 - eps,
inside, > 1 + eps, > c for the dual clip) with advantages of both signs, kept away from the
kinks so that finite differences are meaningful. Stop-gradient losses (gspo, cispo, the
selections of clip_cov / kl_cov) are differentiated by finite differences of the reference's
*surrogate*: the stop-gradient parts are frozen at the evaluation point.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflow.algos as algos
from tests.verl_reference import r_agg, r_mean, ref_bypass, ref_dppo, ref_dro, ref_sapo

TOL = {np.float64: 1e-10, np.float32: 1e-5}
EPS_LOW, EPS_HIGH, CLIP_C = 0.2, 0.28, 3.0
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CLIP_COV = dict(clip_cov_ratio=0.1, clip_cov_lb=0.02, clip_cov_ub=3.0)
KL_COV = dict(kl_cov_ratio=0.15, ppo_kl_coef=0.7)
DPPO_TV = dict(kind="tv", low=EPS_LOW, high=EPS_HIGH, c=CLIP_C)
DPPO_KL = dict(DPPO_TV, kind="kl")
SEQ_MEAN = dict(mode="seq-mean-token-mean")
SAPO = dict(tau_pos=1.3, tau_neg=2.1)
DRO_BETA = 0.6
# bypass mode with REINFORCE, token IS weights and rejection of tokens and whole sequences
BYPASS_REINFORCE = dict(
    loss_type="reinforce",
    rollout_is="token",
    rollout_is_threshold=1.8,
    rollout_rs="token_k1,seq_mean_k3",
    rollout_rs_threshold="0.4_2.5,0.3",
)


def make_inputs(seed=0, b=6, t=5):
    rng = np.random.default_rng(seed)
    lengths = np.array([5, 3, 0, 4, 1, 5, 2, 5])[:b]
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    grid = np.array([-1.5, -0.5, -0.1, 0.05, 0.1, 0.4, 1.3])  # rho: .22 .61 .90 1.05 1.11 1.49 3.7
    # every grid value with both advantage signs among the valid tokens, in a seeded order
    n_valid = int(mask.sum())
    k = rng.permutation(n_valid)
    delta = rng.choice(grid, size=(b, t))
    sign = rng.choice([-1.0, 1.0], size=(b, t))
    delta[mask > 0] = grid[k % len(grid)]
    sign[mask > 0] = np.where((k // len(grid)) % 2 == 0, 1.0, -1.0)
    delta = delta + rng.uniform(-0.02, 0.02, size=(b, t))
    old = np.minimum(rng.normal(-2.0, 0.4, size=(b, t)), -1.35)  # log_prob = old + delta < 0
    adv = sign * rng.uniform(0.3, 2.0, size=(b, t))
    weights = rng.uniform(0.5, 1.5, size=(b, t))
    return dict(old_log_prob=old, log_prob=old + delta, advantages=adv, response_mask=mask, w=weights)


def cast(d, dtype):
    return {k: v.astype(dtype) for k, v in d.items()}


@pytest.fixture(params=[np.float64, np.float32], ids=["f64", "f32"])
def dtype(request):
    with jax.enable_x64(request.param is np.float64):
        yield request.param


# --------------------------------------------------------------------------- NumPy references


def ref_vanilla(old, lp, a, m, w=None, mode="token-mean", frozen=None):
    rho = np.exp(np.clip(lp - old, -20, 20))
    l1 = -a * rho
    l2 = -a * np.clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH)
    lclip = np.maximum(l1, l2)
    l3 = -a * CLIP_C
    loss = np.where(a < 0, np.minimum(l3, lclip), lclip)
    if w is not None:
        loss = loss * w
    metrics = dict(
        pg_clipfrac=r_mean((l2 > l1).astype(float), m),
        pg_clipfrac_lower=r_mean(((lclip > l3) & (a < 0)).astype(float), m),
        ppo_kl=r_mean(old - lp, m),
    )
    return r_agg(loss, m, mode), metrics


def ref_gspo(old, lp, a, m, w=None, mode="token-mean", frozen=None):
    lp0 = lp if frozen is None else frozen  # value of sg(log_prob)
    seq = ((lp0 - old) * m).sum(-1) / np.maximum(m.sum(-1), 1)
    s = np.exp(np.minimum(seq[:, None] + lp - lp0, 10.0))
    l1, l2 = -a * s, -a * np.clip(s, 1 - EPS_LOW, 1 + EPS_HIGH)
    loss = np.maximum(l1, l2)
    if w is not None:
        loss = loss * w
    metrics = dict(pg_clipfrac=r_mean((l2 > l1).astype(float), m), pg_clipfrac_lower=0.0, ppo_kl=r_mean(old - lp, m))
    return r_agg(loss, m, mode), metrics


def ref_gpg(old, lp, a, m, w=None, mode="token-mean", frozen=None):
    loss = -lp * a * (1 if w is None else w)
    return r_agg(loss, m, mode), dict(pg_clipfrac=0.0, pg_clipfrac_lower=0.0, ppo_kl=0.0)


def ref_cispo(old, lp, a, m, w=None, mode="token-mean", frozen=None):
    lp0 = lp if frozen is None else frozen
    rho0 = np.exp(np.clip(lp0 - old, -20, 20))
    clipped = np.clip(rho0, 1 - EPS_LOW, 1 + EPS_HIGH)
    loss = -clipped * a * lp * (1 if w is None else w)
    metrics = dict(
        pg_clipfrac=r_mean((rho0 != clipped).astype(float), m), pg_clipfrac_lower=0.0, ppo_kl=r_mean(old - lp, m)
    )
    return r_agg(loss, m, mode), metrics


def clip_cov_selection(old, lp, a, m, ratio, lb, ub):
    """The first ``k`` candidates in row-major order (the deterministic key=None rule)."""
    rho = np.exp(lp - old)
    l1, l2 = -a * rho, -a * np.clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH)
    cov = (a - r_mean(a, m)) * (lp - r_mean(lp, m))
    cand = (m > 0) & ~(l2 > l1) & (cov > lb) & (cov < ub)
    k = max(int(np.floor(ratio * m.sum())), 1)
    chosen = np.zeros(cand.size, bool)
    chosen[np.flatnonzero(cand)[:k]] = True
    return chosen.reshape(cand.shape), cand


def ref_clip_cov(old, lp, a, m, w=None, mode="token-mean", frozen=None, **kw):
    kw = {**CLIP_COV, **kw}
    lp0 = lp if frozen is None else frozen
    detached, _ = clip_cov_selection(old, lp0, a, m, kw["clip_cov_ratio"], kw["clip_cov_lb"], kw["clip_cov_ub"])
    rho = np.exp(lp - old)
    loss = np.maximum(-a * rho, -a * np.clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH)) * (1 - detached)
    if w is not None:
        loss = loss * w
    metrics = dict(pg_clipfrac=r_mean(detached.astype(float), m), pg_clipfrac_lower=0.0, ppo_kl=r_mean(old - lp, m))
    return r_agg(loss, m, mode), metrics


def ref_kl_cov(old, lp, a, m, w=None, mode="token-mean", frozen=None):
    lp0 = lp if frozen is None else frozen
    valid = m > 0
    flat_idx = np.flatnonzero(valid)
    av, lv = a[valid], lp0[valid]
    cov = (av - av.mean()) * (lv - lv.mean())
    k = max(1, int(len(av) * KL_COV["kl_cov_ratio"]))
    top = np.zeros(a.size, bool)
    top[flat_idx[np.argsort(-cov, kind="stable")[:k]]] = True
    top = top.reshape(a.shape)
    d = lp - old
    loss = -a * np.exp(d) + np.where(top, KL_COV["ppo_kl_coef"] * np.abs(d), 0)
    if w is not None:
        loss = loss * w
    return r_agg(loss, m, mode), dict(pg_clipfrac=0.0, pg_clipfrac_lower=0.0, ppo_kl=r_mean(np.abs(d), m))


def ref_geo_mean(old, lp, a, m, w=None, mode=None, frozen=None):
    d = lp - old
    sgn = np.sign(a)
    dc = np.clip(d, -EPS_LOW, EPS_HIGH)
    dmin = sgn * np.minimum(sgn * d, sgn * dc)
    msum = m.sum(-1) + 1e-8
    ratio = np.exp((dmin * m).sum(-1) / msum)
    adv = (a * m).sum(-1) / msum
    loss = -adv * ratio
    if w is not None:
        loss = loss * np.exp((np.log(w + 1e-10) * m).sum(-1) / msum)
    clipped = d != dc
    metrics = dict(
        pg_clipfrac=r_mean((clipped & (a > 0)).astype(float), m),
        pg_clipfrac_lower=r_mean((clipped & (a < 0)).astype(float), m),
        ppo_kl=r_mean(-d, m),
    )
    return loss.mean(), metrics


# name -> (loss_mode, jax kwargs, reference, reference kwargs, uses IS weights)
CASES = {
    f"vanilla/{mode}": ("vanilla", dict(loss_agg_mode=mode), ref_vanilla, dict(mode=mode), False) for mode in MODES
}
CASES.update(
    {
        "vanilla/is": ("vanilla", {}, ref_vanilla, {}, True),
        "gspo": ("gspo", dict(loss_agg_mode="token-sum"), ref_gspo, dict(mode="token-sum"), False),
        "gspo/is": ("gspo", {}, ref_gspo, {}, True),
        "gpg": ("gpg", {}, ref_gpg, {}, False),
        "gpg/seq-mean-token-mean/is": (
            "gpg",
            dict(loss_agg_mode="seq-mean-token-mean"),
            ref_gpg,
            dict(mode="seq-mean-token-mean"),
            True,
        ),
        "cispo": ("cispo", {}, ref_cispo, {}, False),
        "cispo/is": (
            "cispo",
            dict(loss_agg_mode="seq-mean-token-sum"),
            ref_cispo,
            dict(mode="seq-mean-token-sum"),
            True,
        ),
        "clip_cov": ("clip_cov", dict(CLIP_COV), ref_clip_cov, {}, False),
        "clip_cov/all": ("clip_cov", dict(CLIP_COV, clip_cov_ratio=1.0), ref_clip_cov, dict(clip_cov_ratio=1.0), True),
        "kl_cov": ("kl_cov", dict(KL_COV), ref_kl_cov, {}, False),
        "kl_cov/is": ("kl_cov", dict(KL_COV), ref_kl_cov, {}, True),
        "geo_mean": ("geo_mean", {}, ref_geo_mean, {}, False),
        "geo_mean/is": ("geo_mean", {}, ref_geo_mean, {}, True),
        "dppo_tv": ("dppo_tv", {}, ref_dppo, DPPO_TV, False),
        "dppo_tv/is": ("dppo_tv", dict(loss_agg_mode="seq-mean-token-mean"), ref_dppo, DPPO_TV | SEQ_MEAN, True),
        "dppo_kl": ("dppo_kl", {}, ref_dppo, DPPO_KL, False),
        "dppo_kl/is": ("dppo_kl", dict(loss_agg_mode="token-sum"), ref_dppo, DPPO_KL | dict(mode="token-sum"), True),
        "sapo": ("sapo", dict(SAPO), ref_sapo, SAPO, False),
        "sapo/is": ("sapo", dict(SAPO, loss_agg_mode="token-sum"), ref_sapo, SAPO, True),  # mode is not used
        "dro": ("dro", dict(dro_beta=DRO_BETA), ref_dro, dict(beta=DRO_BETA), False),
        "dro/is": ("dro", dict(dro_beta=DRO_BETA), ref_dro, dict(beta=DRO_BETA), True),
        "bypass_mode": ("bypass_mode", {}, ref_bypass, dict(rc={}, vanilla=ref_vanilla), False),
        "bypass_mode/reinforce": (
            "bypass_mode",
            dict(
                rollout_correction=algos.RolloutCorrectionConfig(**BYPASS_REINFORCE), loss_agg_mode="seq-mean-token-sum"
            ),
            ref_bypass,
            dict(rc=BYPASS_REINFORCE, vanilla=ref_vanilla, mode="seq-mean-token-sum"),
            False,
        ),
    }
)
COMMON = dict(clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=CLIP_C)
PPO_METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")  # every loss reports them (0: no such notion)


def _loss(name, inp, log_prob):
    mode, kwargs, _, _, use_w = CASES[name]
    return algos.compute_policy_loss(
        inp["old_log_prob"],
        log_prob,
        inp["advantages"],
        inp["response_mask"],
        loss_mode=mode,
        rollout_is_weights=inp["w"] if use_w else None,
        **COMMON,
        **kwargs,
    )


@jax.jit
def all_losses(inp):
    """Each case's loss and its PPO metrics (bypass mode's rollout_corr/* are tested in
    test_algos_rollout_correction; left out, they are not compiled here)."""
    out = {name: _loss(name, inp, inp["log_prob"]) for name in CASES}
    return {name: (loss, {k: metrics[k] for k in PPO_METRICS}) for name, (loss, metrics) in out.items()}


@jax.jit
def all_grads(inp):
    return {name: jax.grad(lambda lp, n=name: _loss(n, inp, lp)[0])(inp["log_prob"]) for name in CASES}


def reference(name, inp, frozen=None):
    _, _, ref, ref_kwargs, use_w = CASES[name]
    return ref(
        inp["old_log_prob"],
        inp["log_prob"],
        inp["advantages"],
        inp["response_mask"],
        w=inp["w"] if use_w else None,
        frozen=frozen,
        **ref_kwargs,
    )


# --------------------------------------------------------------------------- parity


def test_inputs_cover_every_clip_region():
    inp = make_inputs()
    m = inp["response_mask"] > 0
    rho, a = np.exp(inp["log_prob"] - inp["old_log_prob"])[m], inp["advantages"][m]
    for region in (rho < 1 - EPS_LOW, (rho > 1 - EPS_LOW) & (rho < 1 + EPS_HIGH), rho > 1 + EPS_HIGH, rho > CLIP_C):
        assert (region & (a > 0)).any() and (region & (a < 0)).any()
    assert (inp["response_mask"].sum(-1) == 0).any()  # a fully masked row


def test_losses_match_reference(dtype):
    inp = cast(make_inputs(), dtype)
    out = all_losses({k: jnp.asarray(v) for k, v in inp.items()})
    ref_inp = cast(inp, np.float64)
    for name in CASES:
        loss, metrics = out[name]
        ref_loss, ref_metrics = reference(name, ref_inp)
        assert loss.dtype == dtype, name
        np.testing.assert_allclose(float(loss), ref_loss, rtol=0, atol=TOL[dtype], err_msg=name)
        for key in PPO_METRICS:
            val = ref_metrics[key]
            np.testing.assert_allclose(float(metrics[key]), val, rtol=0, atol=TOL[dtype], err_msg=f"{name} {key}")
    # the clip metrics are not trivial on these inputs
    assert 0 < float(out["vanilla/token-mean"][1]["pg_clipfrac"]) < 1
    assert 0 < float(out["vanilla/token-mean"][1]["pg_clipfrac_lower"]) < 1
    _, cand = clip_cov_selection(
        *(ref_inp[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask")), *CLIP_COV.values()
    )
    assert 1 < cand.sum()  # clip_cov picks among several candidates


def test_grad_matches_finite_differences():
    """jax.grad == central differences of the reference's surrogate (sg parts frozen)."""
    with jax.enable_x64(True):
        inp = make_inputs(1)
        grads = all_grads({k: jnp.asarray(v) for k, v in inp.items()})
        h = 1e-6
        for name in CASES:
            fd = np.zeros_like(inp["log_prob"])
            for idx in np.ndindex(fd.shape):
                plus, minus = dict(inp), dict(inp)
                plus["log_prob"] = inp["log_prob"].copy()
                minus["log_prob"] = inp["log_prob"].copy()
                plus["log_prob"][idx] += h
                minus["log_prob"][idx] -= h
                fd[idx] = (
                    reference(name, plus, frozen=inp["log_prob"])[0] - reference(name, minus, frozen=inp["log_prob"])[0]
                ) / (2 * h)
            np.testing.assert_allclose(np.asarray(grads[name]), fd, rtol=1e-6, atol=1e-8, err_msg=name)
            if name.startswith("vanilla/"):  # masked tokens get no gradient
                assert np.all(np.asarray(grads[name])[inp["response_mask"] == 0] == 0)


def test_grad_matches_finite_differences_of_jax_value():
    """For losses without a stop-gradient, jax.grad == central differences of the jitted loss."""
    names = ["vanilla/is", "gpg", "geo_mean/is", "kl_cov", "clip_cov"]
    with jax.enable_x64(True):
        inp = {k: jnp.asarray(v) for k, v in make_inputs(2).items()}
        grads = all_grads(inp)
        h = 1e-6
        n = inp["log_prob"].size
        eye = jnp.eye(n).reshape((n,) + inp["log_prob"].shape)
        perturbed = jnp.concatenate([inp["log_prob"][None] + h * eye, inp["log_prob"][None] - h * eye])

        @jax.jit
        def losses_at(lp_batch):
            return jax.vmap(lambda lp: {k: _loss(k, inp, lp)[0] for k in names})(lp_batch)

        vals = losses_at(perturbed)
        for name in names:
            fd = ((vals[name][:n] - vals[name][n:]) / (2 * h)).reshape(inp["log_prob"].shape)
            np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(fd), rtol=1e-6, atol=1e-8, err_msg=name)


def test_stop_gradient_losses_differ_from_their_value_gradient():
    """gspo / cispo gradients are *not* the derivative of the value (that is the point)."""
    with jax.enable_x64(True):
        inp = make_inputs(1)
        grads = all_grads({k: jnp.asarray(v) for k, v in inp.items()})
        h = 1e-6
        rho = np.exp(inp["log_prob"] - inp["old_log_prob"])
        inside = (inp["response_mask"] > 0) & (rho > 1 - EPS_LOW) & (rho < 1 + EPS_HIGH)
        idx = tuple(np.argwhere(inside)[0])  # a token whose ratio is not clipped
        for name in ("gspo", "cispo"):
            plus, minus = dict(inp), dict(inp)
            plus["log_prob"] = inp["log_prob"].copy()
            minus["log_prob"] = inp["log_prob"].copy()
            plus["log_prob"][idx] += h
            minus["log_prob"][idx] -= h
            fd_value = (reference(name, plus)[0] - reference(name, minus)[0]) / (2 * h)
            assert abs(float(grads[name][idx]) - fd_value) > 1e-4, name


# --------------------------------------------------------------------------- every loss x every mode

# registered name -> (its options, its reference): the losses with non-default options
MATRIX = {
    "vanilla": ({}, ref_vanilla),
    "gspo": ({}, ref_gspo),
    "gpg": ({}, ref_gpg),
    "cispo": ({}, ref_cispo),
    "clip_cov": (CLIP_COV, ref_clip_cov),
    "kl_cov": (KL_COV, ref_kl_cov),
    "geo_mean": ({}, ref_geo_mean),
    "dppo_tv": ({}, functools.partial(ref_dppo, **DPPO_TV)),
    "dppo_kl": ({}, functools.partial(ref_dppo, **DPPO_KL)),
    "sapo": (SAPO, functools.partial(ref_sapo, **SAPO)),
    "dro": (dict(dro_beta=DRO_BETA), functools.partial(ref_dro, beta=DRO_BETA)),
    "bypass_mode": ({}, functools.partial(ref_bypass, rc={}, vanilla=ref_vanilla)),
}


def random_inputs(seed):
    """Random shapes; a ragged mask with a full row, an empty row and holes; old token
    probabilities over (0.02, 0.98); log-ratios ~ N(0, 0.5), a fifth of them shifted by +2
    and a fifth by -1.5, with log_prob < 0; advantages of both signs and some exact zeros; IS weights in
    (0.3, 2)."""
    rng = np.random.default_rng(seed)
    b, t = rng.integers(3, 9), rng.integers(2, 10)
    lengths = rng.integers(0, t + 1, size=b)
    lengths[0], lengths[-1] = t, 0
    m = (np.arange(t)[None] < lengths[:, None]).astype(np.float64)
    m[1:-1][rng.random((b - 2, t)) < 0.2] = 0.0
    old = np.log(rng.uniform(0.02, 0.98, (b, t)))
    shift = rng.choice([0.0, 0.0, 0.0, 2.0, -1.5], size=(b, t))
    lp = np.minimum(old + rng.normal(0, 0.5, (b, t)) + shift, -1e-4)
    a = rng.normal(size=(b, t)) * (rng.random((b, t)) > 0.15)
    return dict(old_log_prob=old, log_prob=lp, advantages=a, response_mask=m, w=rng.uniform(0.3, 2.0, (b, t)))


@functools.partial(jax.jit, static_argnames="with_is")
def every_loss_and_mode(old, lp, a, m, w, with_is):
    """Every registered loss x every loss_agg_mode on one input, without IS weights and (with
    ``with_is``, bypass_mode aside) with them: one compiled program per input shape."""
    out = {}
    for name, (options, _) in MATRIX.items():
        for mode in MODES:
            for weights in (None, w) if with_is and name != "bypass_mode" else (None,):
                out[name, mode, weights is not None] = algos.compute_policy_loss(
                    old, lp, a, m, loss_mode=name, loss_agg_mode=mode, rollout_is_weights=weights, **COMMON, **options
                )
    return out


def test_every_registered_loss_under_every_agg_mode_matches_verl():
    """Every registered loss (verl 0.9.1's twelve) x every loss_agg_mode (with and without IS
    weights on one of the inputs), on random shapes and masks, against verl's formulas in
    float64: the loss and every metric verl reports (gspo honours the mode since verl 0.9.1; sapo and geo_mean
    ignore it, as verl)."""
    assert set(algos.policy_loss_names()) == set(MATRIX)
    with jax.enable_x64(True):
        for seed in range(3):
            inp = random_inputs(seed)
            args = [inp[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask")]
            out = every_loss_and_mode(*args, inp["w"], with_is=seed == 1)
            assert len(out) == len(MATRIX) * len(MODES) * (2 if seed == 1 else 1) - (len(MODES) if seed == 1 else 0)
            for (name, mode, use_w), (loss, metrics) in out.items():
                want, want_metrics = MATRIX[name][1](*args, w=inp["w"] if use_w else None, mode=mode)
                what = f"{name} {mode} seed={seed} is={use_w}"
                np.testing.assert_allclose(float(loss), want, rtol=0, atol=1e-10, err_msg=what)
                for key, val in want_metrics.items():
                    np.testing.assert_allclose(float(metrics[key]), val, rtol=0, atol=1e-10, err_msg=f"{what} {key}")


def test_dppo_trust_regions_and_gspo_modes_are_exercised():
    """On the matrix's inputs DPPO's trust regions reject tokens of both advantage signs and
    truncate ratios above clip_ratio_c, and gspo's loss differs between modes (it used to be
    seq-mean-token-mean whatever the mode)."""
    seen = set()
    for seed in range(3):
        old, lp, a, m, _ = random_inputs(seed).values()
        for opts in (DPPO_TV, DPPO_KL):
            for sign, sel in (("+", a > 0), ("-", a <= 0)):
                _, metrics = ref_dppo(old, lp, a, m * sel, **opts)
                seen |= {(opts["kind"], sign, k) for k in ("pg_clipfrac", "pg_clipfrac_lower") if metrics[k] > 0}
    assert {("tv", "+", "pg_clipfrac"), ("tv", "-", "pg_clipfrac"), ("kl", "+", "pg_clipfrac")} <= seen
    assert {("kl", "-", "pg_clipfrac"), ("tv", "-", "pg_clipfrac_lower"), ("kl", "-", "pg_clipfrac_lower")} <= seen
    with jax.enable_x64(True):
        args = list(random_inputs(0).values())[:4]
        losses = {m: float(algos.compute_policy_loss(*args, loss_mode="gspo", loss_agg_mode=m)[0]) for m in MODES}
        assert len({round(v, 12) for v in losses.values()}) == len(MODES)


# --------------------------------------------------------------------------- agg_loss


NORMS = dict(dp_size=4, batch_num_tokens=37, global_batch_size=11, loss_scale_factor=6)


@jax.jit
def all_aggs(loss, m):
    """Every mode, local and with given global normalisers (one compiled program)."""
    out = {mode: algos.agg_loss(loss, m, mode) for mode in MODES}
    out.update({mode + "/global": algos.agg_loss(loss, m, mode, **NORMS) for mode in MODES})
    out.update({mode + "/empty": algos.agg_loss(loss, jnp.zeros_like(m), mode) for mode in MODES})
    return out


def test_agg_loss_modes_and_normalisers(dtype):
    rng = np.random.default_rng(3)
    loss = rng.normal(size=(5, 4)).astype(dtype)
    m = (np.arange(4)[None] < np.array([4, 0, 2, 1, 3])[:, None]).astype(dtype)
    out = all_aggs(loss, m)
    for mode in MODES:
        want = r_agg(loss.astype(float), m.astype(float), mode)
        np.testing.assert_allclose(float(out[mode]), want, atol=TOL[dtype], rtol=0, err_msg=mode)
        want = r_agg(loss.astype(float), m.astype(float), mode, **NORMS)
        np.testing.assert_allclose(float(out[mode + "/global"]), want, atol=TOL[dtype], rtol=0, err_msg=mode)
        assert float(out[mode + "/empty"]) == 0.0  # an empty micro-batch contributes 0, not NaN


def test_agg_loss_errors():
    with pytest.raises(ValueError, match="token-mean"):
        algos.agg_loss(jnp.ones((2, 3)), jnp.ones((2, 3)), "mean")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        algos.agg_loss(jnp.ones((2, 3)), jnp.ones((2, 3)), "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        algos.agg_loss(jnp.ones((2, 3)), jnp.ones((2, 3)), "seq-mean-token-mean", dp_size=2)


# --------------------------------------------------------------------------- invariances


def test_masked_padding_and_permutation_change_nothing():
    with jax.enable_x64(True):
        inp = make_inputs(4)
        pad = 3
        rng = np.random.default_rng(1)
        padded = {k: np.concatenate([v, rng.normal(size=(v.shape[0], pad))], axis=1) for k, v in inp.items()}
        padded["response_mask"][:, -pad:] = 0
        padded["w"] = np.abs(padded["w"])
        perm = np.random.default_rng(2).permutation(inp["log_prob"].shape[0])
        permuted = {k: v[perm] for k, v in inp.items()}
        base = all_losses({k: jnp.asarray(v) for k, v in inp.items()})
        out_pad = all_losses({k: jnp.asarray(v) for k, v in padded.items()})
        out_perm = all_losses({k: jnp.asarray(v) for k, v in permuted.items()})
        for name in CASES:
            ref = float(base[name][0])
            if name != "vanilla/seq-mean-token-sum-norm":  # that one divides by the padded T
                np.testing.assert_allclose(float(out_pad[name][0]), ref, atol=1e-12, rtol=0, err_msg=name)
            if name != "clip_cov":  # its deterministic pick is the first candidates in row order
                np.testing.assert_allclose(float(out_perm[name][0]), ref, atol=1e-12, rtol=0, err_msg=name)
        # with a fixed loss_scale_factor the -norm mode is padding-invariant too
        norm = lambda d: algos.agg_loss(
            d["log_prob"], d["response_mask"], "seq-mean-token-sum-norm", loss_scale_factor=5
        )
        np.testing.assert_allclose(float(norm(padded)), float(norm(inp)), atol=1e-12)


def test_vmap_over_independent_batches():
    names = ["vanilla/is", "gspo", "gpg", "cispo", "clip_cov/all", "kl_cov/is", "geo_mean/is"]
    with jax.enable_x64(True):
        a, b = make_inputs(5), make_inputs(6)
        stacked = {k: jnp.stack([a[k], b[k]]) for k in a}
        out = jax.jit(jax.vmap(lambda inp: {n: _loss(n, inp, inp["log_prob"])[0] for n in names}))(stacked)
        for i, single in enumerate((a, b)):
            ref = all_losses({k: jnp.asarray(v) for k, v in single.items()})
            for name in names:
                np.testing.assert_allclose(float(out[name][i]), float(ref[name][0]), atol=1e-12, err_msg=name)


def test_clip_cov_random_subset():
    """With a key, clip_cov detaches a random subset of exactly min(k, #candidates) candidates,
    and the loss is the reference's with that subset (found as the candidates without gradient)."""
    with jax.enable_x64(True):
        inp = make_inputs()
        old, lp, a, m = (inp[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask"))
        _, cand = clip_cov_selection(old, lp, a, m, *CLIP_COV.values())
        k = max(int(np.floor(CLIP_COV["clip_cov_ratio"] * m.sum())), 1)
        assert k < cand.sum()

        @jax.jit
        def fn(key):
            def loss(lp_):
                return algos.compute_policy_loss(old, lp_, a, m, loss_mode="clip_cov", key=key, **COMMON, **CLIP_COV)

            (val, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(lp))
            return val, metrics, grad

        rho = np.exp(lp - old)
        per_token = np.maximum(-a * rho, -a * np.clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH))
        picks = set()
        for seed in range(5):
            val, metrics, grad = fn(jax.random.key(seed))
            detached = cand & (np.asarray(grad) == 0)
            assert detached.sum() == k
            np.testing.assert_allclose(float(metrics["pg_clipfrac"]), k / m.sum(), atol=1e-12)
            np.testing.assert_allclose(float(val), r_agg(per_token * (1 - detached), m, "token-mean"), atol=1e-12)
            picks.add(tuple(np.flatnonzero(detached)))
        assert len(picks) > 1  # different keys pick different subsets


# --------------------------------------------------------------------------- registry and dispatch


def test_unknown_loss_lists_valid_names():
    with pytest.raises(ValueError) as err:
        algos.compute_policy_loss(*[jnp.zeros((1, 2))] * 4, loss_mode="ppo2")
    for name in ("vanilla", "gspo", "gpg", "cispo", "clip_cov", "kl_cov", "geo_mean"):
        assert name in str(err.value)
    with pytest.raises(KeyError):
        algos.get_policy_loss_fn("ppo2")


def test_misspelt_mode_option_and_bad_dual_clip_raise():
    z = [jnp.zeros((1, 2))] * 4
    with pytest.raises(TypeError):
        algos.compute_policy_loss(*z, loss_mode="clip_cov", clip_cov_ration=0.1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.compute_policy_loss(*z, loss_mode="vanilla", clip_ratio_c=1.0)


def test_user_registered_loss():
    @algos.register_policy_loss("test_reinforce")
    def reinforce(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", baseline=0.0):
        loss = algos.agg_loss(-(advantages - baseline) * log_prob, response_mask, loss_agg_mode)
        return loss, {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0}

    try:
        with jax.enable_x64(True):
            inp = make_inputs()
            args = [inp[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask")]
            # common hyper-parameters it does not declare (the clip ratios) are dropped
            loss, _ = jax.jit(
                lambda *a: algos.compute_policy_loss(*a, loss_mode="test_reinforce", baseline=0.5, **COMMON)
            )(*args)
            want = r_agg(-(inp["advantages"] - 0.5) * inp["log_prob"], inp["response_mask"], "token-mean")
            np.testing.assert_allclose(float(loss), want, atol=1e-12)
            # but IS weights it cannot apply are an error, not silently ignored
            with pytest.raises(TypeError, match="rollout_is_weights"):
                algos.compute_policy_loss(*args, loss_mode="test_reinforce", rollout_is_weights=inp["w"])
            assert "test_reinforce" in algos.policy_loss_names()
    finally:
        algos.POLICY_LOSS_REGISTRY.unregister("test_reinforce")


def test_user_token_policy_loss_gets_the_shared_keywords_and_aggregation():
    @algos.register_policy_loss("test_token_reinforce")
    @algos.token_policy_loss("seq-mean-token-sum")
    def token_reinforce(columns: algos.PolicyLossColumns, *, baseline=0.0):
        old_log_prob, log_prob, advantages, response_mask = columns
        return -(advantages - baseline) * log_prob, dict(
            ppo_kl=algos.masked_mean(old_log_prob - log_prob, response_mask)
        )

    try:
        with jax.enable_x64(True):
            inp = make_inputs()
            args = [inp[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask")]
            m = inp["response_mask"]
            per_token = -(inp["advantages"] - 0.5) * inp["log_prob"]
            # the clip ratios it does not declare are dropped; the IS weights multiply the loss
            loss, metrics = algos.compute_policy_loss(
                *args, loss_mode="test_token_reinforce", baseline=0.5, rollout_is_weights=inp["w"], **COMMON
            )
            np.testing.assert_allclose(float(loss), r_agg(per_token * inp["w"], m, "token-mean"), atol=1e-12)
            np.testing.assert_allclose(float(metrics["ppo_kl"]), r_mean(inp["old_log_prob"] - inp["log_prob"], m))
            assert float(metrics["pg_clipfrac"]) == 0.0 and float(metrics["pg_clipfrac_lower"]) == 0.0
            # called directly: its own default aggregation (compute_policy_loss passes token-mean)
            loss, _ = token_reinforce(*args, baseline=0.5)
            np.testing.assert_allclose(float(loss), r_agg(per_token, m, "seq-mean-token-sum"), atol=1e-12)
            with pytest.raises(TypeError):
                token_reinforce(*args, basline=0.5)
    finally:
        algos.POLICY_LOSS_REGISTRY.unregister("test_token_reinforce")


def test_losses_over_columns_keep_verls_signature():
    """A loss written over `PolicyLossColumns` (and a `ClipRange`) is called as verl calls its
    losses: the four columns positionally or by name, ``clip_ratio_low/high`` as keywords."""
    for name in algos.policy_loss_names():
        params = list(inspect.signature(algos.get_policy_loss_fn(name)).parameters)
        assert params[:4] == list(algos.PolicyLossColumns._fields), name
    vanilla = inspect.signature(algos.compute_policy_loss_vanilla).parameters
    assert {k: vanilla[k].default for k in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")} == {
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0,
    }
    assert "clip" not in vanilla and "clip_ratio_c" not in inspect.signature(algos.compute_policy_loss_gspo).parameters
    with jax.enable_x64(True):
        inp = make_inputs()
        by_name = {k: inp[k] for k in algos.PolicyLossColumns._fields}
        by_position = list(by_name.values())
        clip = dict(clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH)
        for fn in (algos.compute_policy_loss_vanilla, algos.compute_policy_loss_geo_mean):
            want, _ = fn(*by_position, **clip)
            got, _ = fn(**by_name, **clip)
            assert float(got) == float(want)
        # the clip range's defaults are verl's: passing them changes nothing
        default, _ = algos.compute_policy_loss_cispo(*by_position)
        explicit, _ = algos.compute_policy_loss_cispo(*by_position, clip_ratio_low=0.2, clip_ratio_high=0.2)
        assert float(default) == float(explicit)
        with pytest.raises(TypeError):
            algos.compute_policy_loss_gspo(*by_position, clip_ratio_c=3.0)
        with pytest.raises(TypeError, match="clip_ratio_low/clip_ratio_high, not clip"):
            algos.compute_policy_loss_cispo(*by_position, clip=algos.ClipRange(0.1, 0.1))
    with pytest.raises(TypeError, match="PolicyLossColumns"):

        @algos.token_policy_loss()
        def four_columns(old_log_prob, log_prob, advantages, response_mask):
            return -advantages * log_prob, {}
