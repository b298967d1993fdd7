"""NumPy float64 references for the algorithms verl 0.9.1 added (``verl/trainer/ppo/core_algos.py``
and ``rollout_corr_helper.py``), written here from verl's formulas step by step, with verl's
loops and reductions (per-group Python loops, boolean selections) rather than jaxflow's
segment sums, so that they check the vectorised JAX code independently.

Losses take ``(old, lp, a, m, w=None, mode=..., frozen=None, **options)``: ``frozen`` is the
value of ``sg(log_prob)`` (the stop-gradient parts) for finite-difference gradient checks, and
they return ``(loss, metrics)`` with verl's metric names less the ``actor/`` prefix.
"""

import math
from collections import defaultdict

import numpy as np

# --------------------------------------------------------------------------- shared


def r_mean(x, m, axis=None):
    """verl_F.masked_mean."""
    return (np.where(m != 0, x, 0) * m).sum(axis=axis) / (m.sum(axis=axis) + 1e-8)


def r_sum(x, m, axis=None):
    return (np.where(m != 0, x, 0) * m).sum(axis=axis)


def r_agg(loss, m, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    """verl's agg_loss."""
    if mode == "token-mean":
        n = m.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss * m).sum() / n * dp_size
    if mode == "token-sum":
        return (loss * m).sum() * dp_size
    per_seq_tokens = m.sum(-1)
    seq = (loss * m).sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / (per_seq_tokens + 1e-8)
    n_seq = (per_seq_tokens > 0).sum() if global_batch_size is None else global_batch_size
    out = seq[per_seq_tokens > 0].sum() / n_seq * dp_size
    if mode == "seq-mean-token-sum-norm":
        out = out / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return out


def _frozen(lp, frozen):
    return lp if frozen is None else frozen


def _weighted(loss, w):
    return loss if w is None else loss * w


# --------------------------------------------------------------------------- policy losses


def ref_dppo(old, lp, a, m, w=None, mode="token-mean", frozen=None, *, kind, low, high, c):
    """compute_policy_loss_dppo_tv / _kl."""
    lp0 = _frozen(lp, frozen)
    neg_kl = np.clip(lp0 - old, -20.0, 20.0)
    ratio = np.exp(neg_kl)
    truncated = np.minimum(ratio, c)
    p, p_old = np.exp(lp0), np.exp(old)
    if kind == "tv":
        valid = np.where(a > 0, (p - p_old) <= high, (p - p_old) >= -low)
    else:
        binary_kl = p_old * (old - lp0) + (1 - p_old) * np.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        valid = np.where(a > 0, (binary_kl <= high) | (p <= p_old), (binary_kl <= low) | (p >= p_old))
    valid = valid.astype(np.float64)
    loss = _weighted(-a * truncated * lp * valid, w)
    metrics = dict(
        pg_clipfrac=r_mean(1.0 - valid, m),
        pg_clipfrac_lower=r_mean((ratio > c).astype(np.float64) * valid, m),
        ppo_kl=r_mean(-np.clip(lp - old, -20.0, 20.0), m),
    )
    return r_agg(loss, m, mode), metrics


def ref_sapo(old, lp, a, m, w=None, mode=None, frozen=None, *, tau_pos, tau_neg):
    """compute_policy_loss_sapo: always seq-mean-token-mean."""
    neg_kl = np.clip(lp - old, -20.0, 20.0)
    tau = np.where(a > 0, tau_pos, tau_neg)
    gates = 1.0 / (1.0 + np.exp(-tau * (np.exp(neg_kl) - 1.0))) * (4.0 / tau)
    loss = _weighted(-gates * a, w)
    return r_agg(loss, m, "seq-mean-token-mean"), dict(
        pg_clipfrac=0.0, pg_clipfrac_lower=0.0, ppo_kl=r_mean(-neg_kl, m)
    )


def ref_dro(old, lp, a, m, w=None, mode="token-mean", frozen=None, *, beta):
    """compute_policy_loss_dro."""
    log_ratio = lp - old
    loss = _weighted(-(lp * a - 0.5 * beta * log_ratio**2), w)
    return r_agg(loss, m, mode), dict(pg_clipfrac=0.0, pg_clipfrac_lower=0.0, ppo_kl=r_mean(-log_ratio, m))


def ref_reinforce(rollout_lp, lp, a, m, w=None, mode="token-mean"):
    """compute_policy_loss_reinforce."""
    loss = -a * lp if w is None else -a * lp * w
    return r_agg(loss, m, mode), dict(pg_clipfrac=0.0, pg_clipfrac_lower=0.0, ppo_kl=r_mean(-(lp - rollout_lp), m))


# --------------------------------------------------------------------------- rollout correction

SAFETY = 20.0


def ref_is_threshold(spec):
    text = str(spec)
    if "_" in text:
        lo, up = text.split("_", 1)
        return float(up), float(lo)
    return float(text), None


def ref_is_weights(log_ratio, m, level, threshold, batch_normalize):
    """compute_rollout_correction_weights + compute_is_metrics."""
    upper, lower = ref_is_threshold(threshold)
    icepop = lower is not None
    if level == "token":
        lr_metrics = log_ratio
        raw = np.exp(np.clip(log_ratio, -SAFETY, SAFETY))
    else:
        lr_metrics = r_sum(log_ratio, m, axis=-1)[:, None]
        raw = np.broadcast_to(np.exp(np.clip(lr_metrics, -SAFETY, SAFETY)), log_ratio.shape)
    raw = raw * m
    if icepop:
        weights = np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    else:
        weights = np.minimum(raw, upper)
    lower_eff = 1.0 / upper if lower is None else lower
    mt = {}
    valid_tok = m != 0
    if level == "sequence":
        mt["rollout_is_max"] = math.exp(min(lr_metrics.max(), SAFETY))
        mt["rollout_is_min"] = math.exp(lr_metrics.min())
        mt["rollout_is_mean"] = r_mean(weights, m)
        mt["rollout_is_ratio_fraction_high"] = (lr_metrics > math.log(upper)).mean()
        mt["rollout_is_ratio_fraction_low"] = (lr_metrics < math.log(lower_eff)).mean()
    else:
        mt["rollout_is_mean"] = r_mean(weights, m)
        mt["rollout_is_ratio_fraction_high"] = r_mean((raw > upper).astype(float), m)
        mt["rollout_is_ratio_fraction_low"] = r_mean((raw < lower_eff).astype(float), m)
        mt["rollout_is_max"] = weights[valid_tok].max()
        mt["rollout_is_min"] = weights[valid_tok].min()
    clamped = np.clip(weights, 0.0, upper)
    if m.sum() > 1:
        mc = r_mean(clamped, m)
        mt["rollout_is_std"] = math.sqrt(max(r_mean(clamped**2, m) - mc**2, 0.0))
    else:
        mt["rollout_is_std"] = 0.0
    normalized = clamped / (r_mean(clamped, m) + 1e-8)
    mt["rollout_is_eff_sample_size"] = 1.0 / r_mean(normalized**2, m)
    seq_mean = r_mean(weights, m, axis=-1)
    mt["rollout_is_seq_mean"] = seq_mean.mean()
    mt["rollout_is_seq_std"] = seq_mean.std(ddof=1) if seq_mean.size > 1 else 0.0
    mt["rollout_is_seq_max"] = seq_mean.max()
    mt["rollout_is_seq_min"] = seq_mean.min()
    mt["rollout_is_seq_max_deviation"] = np.abs(seq_mean - 1.0).max()
    raw_seq_mean = r_mean(raw, m, axis=-1)
    mt["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).mean()
    mt["rollout_is_seq_fraction_low"] = (raw_seq_mean < lower_eff).mean()
    if icepop:
        mt["rollout_is_oob_ratio"] = r_mean(((raw < lower) | (raw > upper)).astype(float), m)
    if batch_normalize:
        if level == "token":
            mean = r_mean(weights, m)
        else:
            seq_valid = (m.sum(-1) > 0).astype(float)
            mean = (r_mean(weights, m, axis=-1) * seq_valid).sum() / max(seq_valid.sum(), 1e-8)
        if mean > 1e-8:
            weights = weights / mean
            mt["rollout_is_batch_norm_factor"] = mean
        else:
            mt["rollout_is_batch_norm_factor"] = 1.0
    return weights, mt


def _rs_thresholds(options, spec):
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    parts = parts * len(options) if len(parts) == 1 else parts
    out = {}
    for opt, text in zip(options, parts):
        if opt.endswith("k1"):
            lo, up = text.split("_", 1) if "_" in text else (str(1.0 / float(text)), text)
            out[opt] = (float(lo), float(up))
        else:
            out[opt] = (None, float(text))
    return out


def _rs_metrics(opt, stat, m, seq_valid, seq_stat, upper, lower, apply_lower):
    """compute_rs_metrics."""
    p = f"rollout_rs_{opt}"
    tok = m != 0
    seq_values = r_mean(stat, m, axis=-1) if seq_stat is None else seq_stat
    sv = seq_values[seq_valid]
    out = {f"{p}_mean": r_mean(stat, m)}
    if seq_stat is not None:
        out[f"{p}_max"], out[f"{p}_min"] = sv.max(), sv.min()
        out[f"{p}_fraction_high"] = (sv > upper).mean()
        out[f"{p}_fraction_low"] = (sv < lower).mean() if apply_lower else 0.0
    else:
        out[f"{p}_max"], out[f"{p}_min"] = stat[tok].max(), stat[tok].min()
        out[f"{p}_fraction_high"] = r_mean((stat > upper).astype(float), m)
        out[f"{p}_fraction_low"] = r_mean((stat < lower).astype(float), m) if apply_lower else 0.0
    if m.sum() > 1:
        s = np.clip(stat, lower if apply_lower else 0.0, upper)
        mc = r_mean(s, m)
        out[f"{p}_std"] = math.sqrt(max(r_mean(s**2, m) - mc**2, 0.0))
    else:
        out[f"{p}_std"] = 0.0
    out[f"{p}_seq_mean"] = sv.mean()
    out[f"{p}_seq_std"] = sv.std(ddof=1) if sv.size > 1 else 0.0
    out[f"{p}_seq_max"], out[f"{p}_seq_min"] = sv.max(), sv.min()
    out[f"{p}_seq_max_deviation"] = np.abs(sv).max()
    out[f"{p}_seq_fraction_high"] = (sv > upper).mean()
    if apply_lower:
        out[f"{p}_seq_fraction_low"] = (sv < lower).mean()
    return out


def ref_rejection(log_ratio, m, rollout_rs, threshold):
    """compute_rollout_rejection_mask."""
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    thresholds = _rs_thresholds(options, threshold)
    lr = np.clip(log_ratio, -SAFETY, SAFETY)
    k = {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1.0 - lr}
    tok = m != 0
    seq_valid = m.sum(-1) > 0
    combined = np.ones_like(m)
    mt = {}
    for opt in options:
        lower, upper = thresholds[opt]
        is_k1 = opt.endswith("k1")
        if is_k1:
            lower, upper = math.log(lower), math.log(upper)
        kind = k[opt[-2:]]
        if opt.startswith("token"):
            stat, seq_stat = kind, None
        else:
            if opt.startswith("seq_sum"):
                seq_stat = r_sum(kind, m, axis=-1)
            elif opt.startswith("seq_mean"):
                seq_stat = r_mean(kind, m, axis=-1)
            else:
                seq_stat = np.array([row[t].max() if t.any() else 0.0 for row, t in zip(kind, tok)])
            stat = np.broadcast_to(seq_stat[:, None], m.shape)
        keep = stat <= upper
        if is_k1:
            keep = keep & (stat >= lower)
        combined = combined * keep
        mt.update(_rs_metrics(opt, stat, m, seq_valid, seq_stat, upper, lower if is_k1 else 0.0, is_k1))
        mt[f"rollout_rs_{opt}_masked_fraction"] = r_mean(1.0 - keep, m)
        seq_keep = np.all(keep | ~tok, axis=-1)
        mt[f"rollout_rs_{opt}_seq_masked_fraction"] = (
            (~seq_keep & seq_valid).sum() / seq_valid.sum() if seq_valid.any() else 0.0
        )
    mt["rollout_rs_masked_fraction"] = r_mean(1.0 - combined, m)
    mt["rollout_rs_seq_masked_fraction"] = np.any(~((combined > 0.5) & tok) & tok, axis=-1).mean()
    return m * combined, mt


def ref_offpolicy(train_lp, rollout_lp, m):
    """compute_offpolicy_metrics."""
    tm, rm = r_mean(train_lp, m, axis=-1), r_mean(rollout_lp, m, axis=-1)
    lr = train_lp - rollout_lp
    diff = rm - tm
    return {
        "training_ppl": np.exp(-tm).mean(),
        "training_log_ppl": (-tm).mean(),
        "kl": r_mean(rollout_lp - train_lp, m),
        "k3_kl": r_mean(np.exp(lr) - lr - 1, m),
        "rollout_ppl": np.exp(-rm).mean(),
        "rollout_log_ppl": (-rm).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": np.abs(diff).mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": np.exp(diff).mean(),
        "chi2_token": r_mean(np.exp(np.clip(lr, -SAFETY, SAFETY)) ** 2, m) - 1.0,
        "chi2_seq": np.exp(2.0 * np.clip(r_sum(lr, m, axis=-1), -SAFETY, SAFETY)).mean() - 1.0,
    }


def ref_rollout_correction(train_lp, rollout_lp, m, rc):
    """compute_rollout_correction_and_rejection_mask: (weights or None, mask, metrics)."""
    log_ratio = train_lp - rollout_lp
    mt, weights, mask = {}, None, m
    if rc.get("rollout_is") is not None:
        weights, is_mt = ref_is_weights(
            log_ratio, m, rc["rollout_is"], rc.get("rollout_is_threshold", 2.0), rc.get("rollout_is_batch_normalize")
        )
        mt.update(is_mt)
    if rc.get("rollout_rs") is not None:
        mask, rs_mt = ref_rejection(log_ratio, m, rc["rollout_rs"], rc["rollout_rs_threshold"])
        mt.update(rs_mt)
    mt.update(ref_offpolicy(train_lp, rollout_lp, m))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in mt.items()}


def ref_bypass(old, lp, a, m, w=None, mode="token-mean", frozen=None, *, rc, vanilla):
    """compute_policy_loss_bypass_mode (``vanilla``: the PPO reference, ``(old, lp, a, m,
    mode=...) -> (loss, metrics)``)."""
    weights, mask, corr = ref_rollout_correction(_frozen(lp, frozen), old, m, rc)
    if rc.get("loss_type", "ppo_clip") == "reinforce":
        loss, metrics = ref_reinforce(old, lp, a, mask, weights, mode)
    else:
        loss, metrics = vanilla(old, lp, a, mask, mode=mode)
    return loss, {**metrics, **corr}


# --------------------------------------------------------------------------- advantages


def _groups(index):
    groups = defaultdict(list)
    for i, g in enumerate(index):
        groups[int(g)].append(i)
    return groups


def ref_grpo_scores(scores, index, eps=1e-6, norm=True):
    """compute_grpo_outcome_advantage's per-sequence part (torch.std is unbiased)."""
    out = scores.copy()
    for idx in _groups(index).values():
        vals = scores[idx]
        mean, std = (0.0, 1.0) if len(idx) == 1 else (vals.mean(), vals.std(ddof=1))
        out[idx] = (vals - mean) / (std + eps) if norm else vals - mean
    return out


def r_whiten(x, m):
    mean = r_mean(x, m)
    n = m.sum()
    var = r_mean((x - mean) ** 2, m) * n / (n - 1)
    return (x - mean) / np.sqrt(var + 1e-8)


def ref_gdpo(scores_KxB, weights, m, index, eps=1e-6, norm=True):
    """compute_gdpo_outcome_advantage: GRPO per dimension, weighted sum, masked whitening."""
    total = np.zeros_like(m)
    for k, scores in enumerate(scores_KxB):
        total = total + weights[k] * (ref_grpo_scores(scores, index, eps, norm)[:, None] * m)
    adv = r_whiten(total, m) * m
    return adv, adv


def _path_variance(old_lp, sum_pi_squared, m, is_weights):
    w = 1 - 2 * np.exp(old_lp) + sum_pi_squared
    if is_weights is not None:
        w = w * is_weights**2
    return np.cumsum(w * m, axis=-1)


def _reward_to_go(r, m):
    return np.flip(np.cumsum(np.flip(r * m, -1), -1), -1)


def _zero_tail(baselines, row_of, lengths):
    """Zeroes the unique longest member's baseline from the second-longest length on."""
    order = np.sort(lengths)
    longest = np.flatnonzero(lengths == order[-1])
    if len(longest) == 1 and order[-1] > order[-2]:
        baselines[row_of[longest[0]], int(order[-2]) :] = 0.0


def ref_otb(r, m, index, old_lp, sum_pi_squared, is_weights=None, handle_zero_tail=True, eps=1e-8):
    """compute_optimal_token_baseline_advantage."""
    returns = _reward_to_go(r, m)
    w_cum = _path_variance(old_lp, sum_pi_squared, m, is_weights)
    baselines = np.zeros_like(returns)
    for rows in _groups(index).values():
        if len(rows) == 1:
            continue
        g, w, mg = returns[rows], w_cum[rows], m[rows]
        baselines[rows] = (g * w * mg).sum(0) / ((w * mg).sum(0) + eps)
        if handle_zero_tail:
            _zero_tail(baselines, rows, mg.sum(-1))
    return (returns - baselines) * m, returns


def ref_tir_otb(r, m, index, old_lp, sum_pi_squared, is_weights=None, handle_zero_tail=True, eps=1e-8):
    """compute_multi_turn_optimal_token_baseline_advantage: by generated-token index."""
    returns = _reward_to_go(r, m)
    w_cum = _path_variance(old_lp, sum_pi_squared, m, is_weights)
    lengths = m.sum(-1).astype(int)
    width = max(int(lengths.max()), 1)
    w_k, g_k = np.zeros((len(m), width)), np.zeros((len(m), width))
    for i, n in enumerate(lengths):
        w_k[i, :n] = w_cum[i, m[i] != 0]
        g_k[i, :n] = returns[i, m[i] != 0]
    baselines = np.zeros_like(g_k)
    members = [i for i in range(len(m)) if lengths[i] > 0]
    for rows in _groups(np.asarray(index)[members]).values():
        rows = [members[j] for j in rows]
        if len(rows) == 1:
            continue
        baselines[rows] = (g_k[rows] * w_k[rows]).sum(0) / (w_k[rows].sum(0) + eps)
        if handle_zero_tail:
            _zero_tail(baselines, rows, lengths[rows])
    adv = np.zeros_like(returns)
    for i, n in enumerate(lengths):
        adv[i, m[i] != 0] = (g_k[i] - baselines[i])[:n]
    return adv * m, returns
