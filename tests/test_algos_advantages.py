"""Advantage estimators against NumPy references written here from the formulas of issue 3.

Each reference is a plain loop over samples/time in float64. JAX runs in float64 (x64 mode,
tolerance 1e-10) and float32 (1e-5). Edge cases live in the shared batch: a group of one,
a fully masked row, a zero-variance group, a mask with a hole (GAE skips it), ragged lengths.
"""

import functools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflow.algos as algos
from tests.verl_reference import ref_gdpo, ref_otb, ref_tir_otb

TOL = {np.float64: 1e-10, np.float32: 1e-5}
GAMMA, LAM = 0.97, 0.9

# --------------------------------------------------------------------------- data


def make_batch(seed=0, b=8, t=6):
    """Ragged batch. Groups: 7 -> rows 0-2, -3 -> rows 3-4 (row 3 fully masked), 42 -> row 5
    (a group of one), 5 -> rows 6-7 (zero variance: both score exactly 0.5)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([t, t - 1, 3, 0, 1, t, 2, 4])[:b]
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    mask[0, 2] = 0.0  # a hole: an observation token inside the response
    rewards = rng.normal(size=(b, t))  # garbage on padding on purpose: it must be ignored
    rewards[6:8] = 0.0
    rewards[6, 0] = 0.5
    rewards[7, 3] = 0.5
    values = rng.normal(size=(b, t))
    group_ids = np.array([7, 7, 7, -3, -3, 42, 5, 5])[:b]
    baselines = rng.normal(size=(b,))
    return dict(
        token_level_rewards=rewards,
        values=values,
        response_mask=mask,
        group_ids=group_ids,
        reward_baselines=baselines,
    )


def cast(batch, dtype):
    return {k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in batch.items()}


@pytest.fixture(params=[np.float64, np.float32], ids=["f64", "f32"])
def dtype(request):
    with jax.enable_x64(request.param is np.float64):
        yield request.param


# --------------------------------------------------------------------------- NumPy references


def r_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def r_whiten(x, m):
    mean = r_mean(x, m)
    n = m.sum()
    var = r_mean((x - mean) ** 2, m) * n / (n - 1)
    return (x - mean) / np.sqrt(var + 1e-8)


def r_scores(r, m):
    return np.array([sum(r[i, t] * m[i, t] for t in range(r.shape[1])) for i in range(r.shape[0])])


def r_groups(g):
    groups = defaultdict(list)
    for i, gi in enumerate(g):
        groups[int(gi)].append(i)
    return groups


def r_mean_std(s, g):
    """Per-sample (mean_g, std_g, n_g); groups of one: mean 0, std 1."""
    mean, std, n = np.zeros_like(s), np.ones_like(s), np.zeros_like(s)
    for idx in r_groups(g).values():
        vals = s[idx]
        n[idx] = len(idx)
        if len(idx) > 1:
            mean[idx] = vals.mean()
            std[idx] = vals.std(ddof=1)
    return mean, std, n


def ref_gae(r, v, m, gamma, lam):
    b, t_len = r.shape
    adv = np.zeros_like(r)
    for i in range(b):
        v_next = a_next = 0.0
        for t in reversed(range(t_len)):
            delta = r[i, t] + gamma * v_next - v[i, t]
            a_hat = delta + gamma * lam * a_next
            v_next = m[i, t] * v[i, t] + (1 - m[i, t]) * v_next
            a_next = m[i, t] * a_hat + (1 - m[i, t]) * a_next
            adv[i, t] = a_next
    return r_whiten(adv, m), adv + v


def ref_grpo(r, m, g, eps=1e-6, norm=True):
    s = r_scores(r, m)
    mean, std, _ = r_mean_std(s, g)
    a = (s - mean) / (std + eps) if norm else s - mean
    return a[:, None] * m


def ref_passk(r, m, g, eps=1e-6, norm=True):
    s = r_scores(r, m)
    a = np.zeros_like(s)
    for idx in r_groups(g).values():
        vals = s[idx]
        order = np.argsort(-vals, kind="stable")
        gap = vals[order[0]] - vals[order[1]]
        if norm:
            gap = gap / (vals.std(ddof=1) + eps)
        a[idx[order[0]]] = gap
    return a[:, None] * m


def ref_rloo(r, m, g):
    s = r_scores(r, m)
    a = s.copy()
    for idx in r_groups(g).values():
        n = len(idx)
        if n > 1:
            for i in idx:
                a[i] = s[i] - sum(s[j] for j in idx if j != i) / (n - 1)
    return a[:, None] * m


def ref_rfpp(r, m, gamma):
    b, t_len = r.shape
    g = np.zeros_like(r)
    for i in range(b):
        running = 0.0
        for t in reversed(range(t_len)):
            running = r[i, t] + gamma * running
            g[i, t] = running
            running = running * m[i, t]
    return r_whiten(g, m) * m, g


def ref_rfpp_baseline(r, m, g):
    s = r_scores(r, m)
    mean, _, _ = r_mean_std(s, g)
    a = (s - mean)[:, None] * m
    a = r_whiten(a, m) * m
    return a


def ref_remax(r, b, m):
    bsz, t_len = r.shape
    ret = np.zeros_like(r)
    for i in range(bsz):
        for t in range(t_len):
            ret[i, t] = sum(r[i, u] * m[i, u] for u in range(t, t_len))
    return ret - b[:, None] * m, ret


def ref_opo(r, m, g):
    s = r_scores(r, m)
    lengths = m.sum(-1)
    a = s.copy()
    for idx in r_groups(g).values():
        if len(idx) > 1:
            a[idx] = s[idx] - (lengths[idx] * s[idx]).sum() / lengths[idx].sum()
    return a[:, None] * m


def ref_gpg(r, m, g, f_norm=1.0):
    s = r_scores(r, m)
    alpha = len(s) / max(1, np.count_nonzero(s))
    mean, _, _ = r_mean_std(s, g)
    return (alpha * (s - mean) / f_norm)[:, None] * m


# name -> (reference on a float64 batch -> (adv, ret), extra params)
REFERENCES = {
    "gae": lambda d: ref_gae(d["token_level_rewards"], d["values"], d["response_mask"], GAMMA, LAM),
    "grpo": lambda d: (ref_grpo(d["token_level_rewards"], d["response_mask"], d["group_ids"]),) * 2,
    "rloo": lambda d: (ref_rloo(d["token_level_rewards"], d["response_mask"], d["group_ids"]),) * 2,
    "reinforce_plus_plus": lambda d: ref_rfpp(d["token_level_rewards"], d["response_mask"], GAMMA),
    "reinforce_plus_plus_baseline": lambda d: (
        (ref_rfpp_baseline(d["token_level_rewards"], d["response_mask"], d["group_ids"]),) * 2
    ),
    "remax": lambda d: ref_remax(d["token_level_rewards"], d["reward_baselines"], d["response_mask"]),
    "opo": lambda d: (ref_opo(d["token_level_rewards"], d["response_mask"], d["group_ids"]),) * 2,
    "gpg": lambda d: (ref_gpg(d["token_level_rewards"], d["response_mask"], d["group_ids"]),) * 2,
}
PARAMS = dict(gamma=GAMMA, lam=LAM, epsilon=1e-6, norm_adv_by_std_in_grpo=True, f_norm=1.0)
NAMES = sorted(REFERENCES) + ["grpo_passk"]
PASSK_IDS = np.array([7, 7, 7, -3, -3, 1, 1, 1])  # pass@k needs >= 2 samples per group


@jax.jit
def _all_estimators(cols, params):
    """Every built-in estimator, each fed all columns and params through the registry."""
    return {name: algos.get_adv_estimator_fn(name)(**cols, **params) for name in NAMES}


def run_all(batch, **overrides):
    """One compiled program per (shape, dtype) runs every estimator: keeps the tests fast."""
    cols = {k: jnp.asarray(v) for k, v in batch.items()}
    out = _all_estimators(cols, dict(PARAMS, **overrides))
    return {k: (np.asarray(a), np.asarray(r)) for k, (a, r) in out.items()}


def run(name, batch, **overrides):
    return run_all(batch, **overrides)[name]


def batch_as_f64(batch, dtype):
    """The inputs the JAX run saw (rounded to ``dtype``), widened to float64 for the reference."""
    return cast(cast(batch, dtype), np.float64)


# --------------------------------------------------------------------------- parity


def test_matches_reference(dtype):
    batch = cast(make_batch(), dtype)
    out = run_all(batch)
    ref_batch = batch_as_f64(batch, dtype)
    for name, ref in REFERENCES.items():
        adv, ret = out[name]
        ref_adv, ref_ret = ref(ref_batch)
        assert adv.dtype == dtype and ret.dtype == dtype, name
        np.testing.assert_allclose(adv, ref_adv, rtol=0, atol=TOL[dtype], err_msg=name)
        np.testing.assert_allclose(ret, ref_ret, rtol=0, atol=TOL[dtype], err_msg=name)


def test_grpo_variants_and_edges(dtype):
    batch = cast(make_batch(1), dtype)
    ref = batch_as_f64(batch, dtype)
    r, m, g = ref["token_level_rewards"], ref["response_mask"], ref["group_ids"]
    for norm in (True, False):
        for eps in (1e-6, 0.1):
            adv, ret = run("grpo", batch, norm_adv_by_std_in_grpo=norm, epsilon=eps)
            np.testing.assert_allclose(adv, ref_grpo(r, m, g, eps, norm), atol=TOL[dtype], rtol=0)
            np.testing.assert_array_equal(adv, ret)
    adv = run("grpo", batch)[0]
    s = r_scores(r, m)
    assert np.all(adv[3] == 0)  # fully masked row
    assert np.all(adv[6:8] == 0)  # zero-variance group: exactly 0, no eps blow-up
    np.testing.assert_allclose(adv[5], s[5] / (1 + 1e-6) * m[5], atol=TOL[dtype], rtol=0)  # singleton
    a_seq = (adv[:3] * m[:3]).sum(-1) / m[:3].sum(-1)  # group 7 is centred
    np.testing.assert_allclose(a_seq.mean(), 0, atol=10 * TOL[dtype])


def test_passk(dtype):
    batch = cast(dict(make_batch(2), group_ids=PASSK_IDS), dtype)
    ref = batch_as_f64(batch, dtype)
    for norm in (True, False):
        adv, ret = run("grpo_passk", batch, norm_adv_by_std_in_grpo=norm)
        want = ref_passk(ref["token_level_rewards"], ref["response_mask"], ref["group_ids"], norm=norm)
        np.testing.assert_allclose(adv, want, atol=TOL[dtype], rtol=0)
        np.testing.assert_array_equal(adv, ret)
        assert (np.abs(adv).sum(-1) > 0).sum() <= 3  # at most one credited per group


def test_passk_needs_two_per_group():
    batch = make_batch()
    with pytest.raises(ValueError, match="at least 2"):
        algos.compute_grpo_passk_outcome_advantage(
            batch["token_level_rewards"], batch["response_mask"], batch["group_ids"]
        )
    # under jit the check cannot run; the singleton gets 0 instead of a NaN/inf
    adv, _ = run("grpo_passk", batch)
    assert np.all(np.isfinite(adv)) and np.all(adv[5] == 0)


def test_gpg_f_norm_and_rloo_singleton(dtype):
    batch = cast(make_batch(3), dtype)
    ref = batch_as_f64(batch, dtype)
    r, m, g = ref["token_level_rewards"], ref["response_mask"], ref["group_ids"]
    out = run_all(batch, f_norm=2.5)
    np.testing.assert_allclose(out["gpg"][0], ref_gpg(r, m, g, 2.5), atol=TOL[dtype], rtol=0)
    np.testing.assert_allclose(out["rloo"][0][5], r_scores(r, m)[5] * m[5], atol=TOL[dtype], rtol=0)


def test_gae_skips_masked_hole():
    """A masked token inside the response neither bootstraps nor breaks the recursion."""
    with jax.enable_x64(True):
        b = make_batch()
        r, v = b["token_level_rewards"], b["values"]
        _, ret = run("gae", b)
        a = ret - v  # un-whitened advantages
        # at the token before the hole, the next value is the one after the hole
        delta1 = r[0, 1] + GAMMA * v[0, 3] - v[0, 1]
        np.testing.assert_allclose(a[0, 1], delta1 + GAMMA * LAM * a[0, 3], atol=1e-12)
        np.testing.assert_allclose(a[0, 2], a[0, 3], atol=1e-12)  # the hole stores the carry


# --------------------------------------------------------------------------- invariances


@pytest.mark.parametrize("ids", ["groups", "passk_groups"])
def test_masked_padding_changes_nothing(ids):
    with jax.enable_x64(True):
        batch = make_batch(4)
        if ids == "passk_groups":
            batch["group_ids"] = PASSK_IDS
        out = run_all(batch)
        pad = 3
        rng = np.random.default_rng(9)
        padded = dict(batch)
        for k in ("token_level_rewards", "values"):  # garbage under the padding
            padded[k] = np.concatenate([batch[k], rng.normal(size=(8, pad))], axis=1)
        padded["response_mask"] = np.concatenate([batch["response_mask"], np.zeros((8, pad))], axis=1)
        out_p = run_all(padded)
        for name in NAMES if ids == "passk_groups" else sorted(REFERENCES):
            (adv, ret), (adv_p, ret_p) = out[name], out_p[name]
            np.testing.assert_allclose(adv_p[:, :-pad], adv, atol=1e-12, rtol=0, err_msg=name)
            # returns on the original positions are unchanged (padding may hold any value)
            np.testing.assert_allclose(ret_p[:, :-pad], ret, atol=1e-12, rtol=0, err_msg=name)


@pytest.mark.parametrize("ids", ["groups", "passk_groups"])
def test_permuting_samples_permutes_outputs(ids):
    with jax.enable_x64(True):
        batch = make_batch(5)
        if ids == "passk_groups":
            batch["group_ids"] = PASSK_IDS
        out = run_all(batch)
        perm = np.random.default_rng(0).permutation(8)
        out_p = run_all({k: v[perm] for k, v in batch.items()})
        for name in NAMES if ids == "passk_groups" else sorted(REFERENCES):
            (adv, ret), (adv_p, ret_p) = out[name], out_p[name]
            np.testing.assert_allclose(adv_p, adv[perm], atol=1e-12, rtol=0, err_msg=name)
            np.testing.assert_allclose(ret_p, ret[perm], atol=1e-12, rtol=0, err_msg=name)


def test_group_ids_are_arbitrary_ints():
    """Relabelling the groups (any ints, any order) changes nothing."""
    with jax.enable_x64(True):
        batch = make_batch(6)
        relabel = {7: 1_000_003, -3: 0, 42: -17, 5: 2}
        other = dict(batch, group_ids=np.array([relabel[int(g)] for g in batch["group_ids"]]))
        out, out_o = run_all(batch), run_all(other)
        for name in sorted(REFERENCES):
            np.testing.assert_array_equal(out[name][0], out_o[name][0], err_msg=name)


def test_vmap_over_independent_batches():
    """vmap over a leading axis of independent batches (each estimator's kind of primitive:
    scans, sort-based grouping, segment max/min, cumulative sums)."""
    names = ("gae", "grpo", "grpo_passk", "opo", "reinforce_plus_plus_baseline", "remax")
    with jax.enable_x64(True):
        b1, b2 = make_batch(7), make_batch(8)
        b2["group_ids"] = b2["group_ids"][::-1].copy()
        stacked = {k: jnp.stack([b1[k], b2[k]]) for k in b1}

        def some(cols):
            return {n: algos.get_adv_estimator_fn(n)(**cols, **PARAMS) for n in names}

        out = jax.jit(jax.vmap(some))(stacked)
        for i, b in enumerate((b1, b2)):
            ref = run_all(b)
            for name in names:
                np.testing.assert_allclose(out[name][0][i], ref[name][0], atol=1e-12, rtol=0, err_msg=name)
                np.testing.assert_allclose(out[name][1][i], ref[name][1], atol=1e-12, rtol=0, err_msg=name)


# --------------------------------------------------------------------------- verl 0.9.1: gdpo, OTB


def random_groups_batch(seed, holes=False):
    """Random shape; groups of 1..4 samples in shuffled order (singletons included); ragged
    right-padded masks with an empty response, or (``holes``) masks with masked tool-output
    tokens inside; outcome rewards on each response's last token plus some on others; old
    log-probs, sum_pi_squared in [p^2, 1] and IS weights."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5, size=rng.integers(3, 6))
    group_ids = rng.permutation(np.repeat(rng.permutation(100)[: len(sizes)], sizes))
    b, t = len(group_ids), int(rng.integers(3, 9))
    lengths = rng.integers(0, t + 1, size=b)
    lengths[rng.integers(b)] = 0
    m = (np.arange(t)[None] < lengths[:, None]).astype(np.float64)
    if holes:
        m[rng.random((b, t)) < 0.25] = 0.0
    r = rng.normal(size=(b, t)) * (rng.random((b, t)) < 0.3)
    for i in range(b):
        if m[i].any():
            r[i, np.flatnonzero(m[i])[-1]] += rng.normal()
    p_old = rng.uniform(0.02, 0.98, (b, t))
    return dict(
        token_level_rewards=r * m,
        response_mask=m,
        group_ids=group_ids,
        old_log_probs=np.log(p_old),
        sum_pi_squared=p_old**2 + rng.uniform(0, 1 - p_old**2),
        rollout_is_weights=rng.uniform(0.5, 1.5, (b, t)),
        gdpo_scores=rng.normal(size=(3, b)) * rng.choice([1.0, 10.0], size=(3, 1)),
    )


GDPO_WEIGHTS = ((1, None), (2, (0.3, 1.7)), (3, (1.0, 0.5, 2.0)))  # (K reward dimensions, their weights)


@jax.jit
def gdpo_all(batch):
    """GDPO with every (K, weights) of ``GDPO_WEIGHTS`` x norm_adv_by_std_in_grpo, and GDPO
    without named scores: one compiled program per batch shape."""
    fn = algos.get_adv_estimator_fn("gdpo")
    out = {
        (k, norm): fn(
            **dict(batch, gdpo_scores=batch["gdpo_scores"][:k]), gdpo_reward_weights=w, norm_adv_by_std_in_grpo=norm
        )
        for k, w in GDPO_WEIGHTS
        for norm in (True, False)
    }
    return out, fn(**{k: v for k, v in batch.items() if k != "gdpo_scores"})


def test_gdpo_matches_verl():
    """Per-dimension GRPO, weighted sum, masked whitening (verl 0.9.1), with 1-3 named reward
    dimensions, weights or none, with and without the std, and the one-dimension fallback on
    token_level_rewards: float64 on three random batches, float32 on one."""
    for seed, dtype in ((0, np.float64), (1, np.float64), (2, np.float64), (3, np.float32)):
        with jax.enable_x64(dtype is np.float64):
            batch = cast(random_groups_batch(seed), dtype)
            ref = batch_as_f64(batch, dtype)
            m, g = ref["response_mask"], ref["group_ids"]
            out, unnamed = gdpo_all(batch)
            for k, weights in GDPO_WEIGHTS:
                for norm in (True, False):
                    adv, ret = out[k, norm]
                    want, _ = ref_gdpo(ref["gdpo_scores"][:k], weights or (1.0,) * k, m, g, norm=norm)
                    what = f"seed={seed} K={k} norm={norm}"
                    assert adv.dtype == dtype, what
                    np.testing.assert_allclose(np.asarray(adv), want, atol=TOL[dtype], rtol=0, err_msg=what)
                    np.testing.assert_array_equal(np.asarray(adv), np.asarray(ret))
            adv, _ = unnamed  # no named scores: the summed token rewards are the one dimension
            want, _ = ref_gdpo(r_scores(ref["token_level_rewards"], m)[None], (1.0,), m, g)
            np.testing.assert_allclose(np.asarray(adv), want, atol=TOL[dtype], rtol=0)


def test_gdpo_normalises_each_dimension_before_adding():
    """A dimension's scale does not matter to GDPO (each is normalised in its group first),
    while it dominates GRPO on the summed reward."""
    with jax.enable_x64(True):
        batch = random_groups_batch(7)
        scores = batch["gdpo_scores"][:2]
        louder = scores * np.array([[100.0], [1.0]])
        gdpo = algos.get_adv_estimator_fn("gdpo")
        np.testing.assert_allclose(
            np.asarray(gdpo(**dict(batch, gdpo_scores=louder))[0]),
            np.asarray(gdpo(**dict(batch, gdpo_scores=scores))[0]),
            atol=1e-6,  # the groups' epsilon=1e-6 is not scaled
        )
        m = batch["response_mask"]
        summed = [
            ref_grpo(np.eye(m.shape[1])[[-1] * len(m)] * s.sum(0)[:, None], np.ones_like(m), batch["group_ids"])
            for s in (scores, louder)
        ]
        assert np.abs(summed[0] - summed[1]).max() > 0.1


def test_gdpo_rejects_mismatched_inputs():
    batch = random_groups_batch(0)
    fn = algos.get_adv_estimator_fn("gdpo")
    with pytest.raises(ValueError, match="2 weights for 3 reward dimensions"):
        fn(**batch, gdpo_reward_weights=(1.0, 2.0))
    with pytest.raises(ValueError, match=r"\[K, B\]"):
        fn(**dict(batch, gdpo_scores=batch["gdpo_scores"][:, :-1]))


@functools.partial(jax.jit, static_argnames="name")
def otb_all(batch, name):
    """One OTB variant with and without the zero tail x with and without IS weights: one
    compiled program per batch shape."""
    fn = algos.get_adv_estimator_fn(name)
    return {
        (zero_tail, use_w): fn(
            **dict(batch, rollout_is_weights=batch["rollout_is_weights"] if use_w else None), handle_zero_tail=zero_tail
        )
        for zero_tail in (True, False)
        for use_w in (False, True)
    }


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_matches_verl(name):
    """Both OTB variants (verl 0.9.1), with and without the zero tail and IS weights, on
    right-padded masks and on masks with holes (where they differ): float64 on four random
    batches, float32 on one."""
    ref_fn = {"optimal_token_baseline": ref_otb, "tir_optimal_token_baseline": ref_tir_otb}[name]
    zero_tails = 0
    for seed, dtype in ((0, np.float64), (1, np.float64), (2, np.float64), (3, np.float64), (1, np.float32)):
        with jax.enable_x64(dtype is np.float64):
            batch = cast(random_groups_batch(seed, holes=seed % 2 == 1), dtype)
            ref = batch_as_f64(batch, dtype)
            cols = [
                ref[k] for k in ("token_level_rewards", "response_mask", "group_ids", "old_log_probs", "sum_pi_squared")
            ]
            out = otb_all(batch, name)
            for (zero_tail, use_w), (adv, ret) in out.items():
                want_adv, want_ret = ref_fn(*cols, ref["rollout_is_weights"] if use_w else None, zero_tail)
                what = f"seed={seed} {dtype.__name__} zero_tail={zero_tail} is={use_w}"
                assert adv.dtype == dtype, what
                np.testing.assert_allclose(np.asarray(adv), want_adv, atol=TOL[dtype], rtol=0, err_msg=what)
                np.testing.assert_allclose(np.asarray(ret), want_ret, atol=TOL[dtype], rtol=0, err_msg=what)
            zero_tails += int(np.abs(np.asarray(out[True, True][0]) - np.asarray(out[False, True][0])).max() > 0)
    assert zero_tails >= 3  # the zero tail changes the advantages on most of these batches


@jax.jit
def both_otb(batch):
    return tuple(
        algos.get_adv_estimator_fn(n)(**batch) for n in ("optimal_token_baseline", "tir_optimal_token_baseline")
    )


def test_tir_otb_is_otb_when_responses_are_contiguous():
    """Without holes and empty responses, aligning by generated-token index is aligning by
    position: the two variants agree."""
    with jax.enable_x64(True):
        for seed in range(2):
            batch = random_groups_batch(seed)
            keep = batch["response_mask"].sum(-1) > 0
            batch = {k: (v[:, keep] if k == "gdpo_scores" else v[keep]) for k, v in batch.items()}
            a, b = both_otb(batch)
            np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), atol=1e-12)
            np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), atol=1e-12)


# --------------------------------------------------------------------------- registry


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError) as err:
        algos.get_adv_estimator_fn("ppo_magic")
    msg = str(err.value)
    assert "ppo_magic" in msg
    for name in ("gae", "grpo", "rloo", "remax", "opo", "gpg", "grpo_passk"):
        assert name in msg
    with pytest.raises(KeyError):  # also a KeyError, for dict-style callers
        algos.get_adv_estimator_fn("ppo_magic")


def test_user_registered_estimator_dispatches_by_column():
    @algos.register_adv_est("test_mean_baseline")
    def mean_baseline(token_level_rewards, response_mask, scale=1.0):
        s = algos.masked_sum(token_level_rewards, response_mask, axis=-1)
        a = scale * (s - s.mean())[:, None] * response_mask
        return a, a

    try:
        assert "test_mean_baseline" in algos.advantage_estimator_names()
        with jax.enable_x64(True):
            batch = make_batch()
            fn = jax.jit(algos.get_adv_estimator_fn("test_mean_baseline"))
            adv, _ = fn(**batch, **PARAMS, scale=2.0)  # values, group_ids, gamma... are ignored
            s = r_scores(batch["token_level_rewards"], batch["response_mask"])
            np.testing.assert_allclose(
                np.asarray(adv), 2.0 * (s - s.mean())[:, None] * batch["response_mask"], atol=1e-12
            )
        with pytest.raises(ValueError, match="already registered"):
            algos.register_adv_est("test_mean_baseline")(lambda **kw: None)
    finally:
        algos.ADV_ESTIMATOR_REGISTRY.unregister("test_mean_baseline")


def test_missing_column_is_an_error():
    with pytest.raises(TypeError, match="group_ids"):
        algos.get_adv_estimator_fn("grpo")(token_level_rewards=jnp.zeros((2, 3)), response_mask=jnp.ones((2, 3)))


def test_whiten_matches_reference():
    with jax.enable_x64(True):
        b = make_batch(10)
        x, m = b["values"], b["response_mask"]
        w = np.asarray(jax.jit(algos.masked_whiten)(x, m))
        np.testing.assert_allclose(w, r_whiten(x, m), atol=1e-10)
        # the definition: unit unbiased variance over the masked tokens
        w = w[m > 0]
        np.testing.assert_allclose(w.std(ddof=1), 1.0, atol=1e-6)


def test_bool_and_int_masks_and_int_rewards():
    """Masks may be bool/int and outcome rewards integers; results match the float inputs."""
    with jax.enable_x64(True):
        batch = make_batch(11)
        batch["response_mask"][0, 2] = 1.0  # (no hole: int rewards below are per-row)
        batch["token_level_rewards"] = np.round(batch["token_level_rewards"] * 3)
        fns = {n: algos.get_adv_estimator_fn(n) for n in ("gae", "grpo")}
        run_some = jax.jit(lambda cols: {n: f(**cols, **PARAMS) for n, f in fns.items()})
        want = run_some(batch)
        other = dict(
            batch,
            response_mask=batch["response_mask"].astype(bool),
            token_level_rewards=batch["token_level_rewards"].astype(np.int32),
        )
        got = run_some(other)
        for n in fns:
            np.testing.assert_allclose(np.asarray(got[n][0]), np.asarray(want[n][0]), atol=1e-12, err_msg=n)
            np.testing.assert_allclose(np.asarray(got[n][1]), np.asarray(want[n][1]), atol=1e-12, err_msg=n)
