"""Rollout correction (IS weights, rejection sampling, off-policy diagnostics) and the
``bypass_mode`` loss against verl 0.9.1's formulas (`tests.verl_reference`), in float64 on
random shapes and masks, every metric under verl's ``rollout_corr/*`` names."""

import jax
import numpy as np
import pytest

import jaxflow.algos as algos
from tests.test_algos_losses import COMMON, MODES, random_inputs, ref_vanilla
from tests.verl_reference import ref_bypass, ref_rollout_correction

# Every IS level and threshold kind, batch normalisation, every rejection criterion (k1 with
# explicit and implied lower bounds, one shared and per-option thresholds), both loss types.
CONFIGS = [
    dict(),
    dict(rollout_is="token", rollout_is_threshold=1.5, loss_type="reinforce"),
    dict(rollout_is="sequence", rollout_is_threshold="3.0", rollout_is_batch_normalize=True, loss_type="reinforce"),
    dict(
        rollout_is="token",
        rollout_is_threshold="0.6_1.8",
        rollout_is_batch_normalize=True,
        rollout_rs="token_k1,seq_mean_k3",
        rollout_rs_threshold="0.3_3.0,1.0",
    ),
    dict(
        rollout_is="sequence",
        rollout_is_threshold="0.2_5.0",
        loss_type="reinforce",
        rollout_rs="seq_sum_k1,seq_max_k2,token_k2,seq_mean_k1,token_k3,seq_sum_k2,seq_sum_k3,seq_mean_k2,seq_max_k3",
        rollout_rs_threshold="6.0",
    ),
    dict(rollout_rs="token_k3, seq_max_k3, token_k3", rollout_rs_threshold="1.0,3.0"),
]


def _close(got, want, what):
    np.testing.assert_allclose(float(got), float(want), rtol=0, atol=1e-10, err_msg=what)


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_bypass_mode_matches_verl_every_mode_and_metric(index):
    rc = CONFIGS[index]
    with jax.enable_x64(True):
        for seed in (10, 13):  # each config rejects some, not all, tokens of these
            inp = random_inputs(seed)
            args = [inp[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask")]
            for mode in MODES:
                loss, metrics = algos.compute_policy_loss(
                    *args,
                    loss_mode="bypass_mode",
                    loss_agg_mode=mode,
                    rollout_correction=algos.RolloutCorrectionConfig(**rc),
                    **COMMON,
                )
                want, want_metrics = ref_bypass(*args, mode=mode, rc=rc, vanilla=ref_vanilla)
                what = f"{rc} {mode} seed={seed}"
                _close(loss, want, what)
                corr = {k for k in metrics if k.startswith("rollout_corr/")}
                assert corr == {k for k in want_metrics if k.startswith("rollout_corr/")}, what
                for key, val in want_metrics.items():
                    _close(metrics[key], val, f"{what} {key}")


def test_rejection_and_weights_are_not_trivial():
    """On these inputs the corrections act: rejected tokens and sequences, truncated and
    IcePop-zeroed weights, a batch-normalisation factor != 1."""
    with jax.enable_x64(True):
        inp = random_inputs(10)
        train, rollout, m = inp["log_prob"], inp["old_log_prob"], inp["response_mask"]
        weights, mask, metrics = algos.compute_rollout_correction_and_rejection_mask(train, rollout, m, **CONFIGS[3])
        _, want_mask, _ = ref_rollout_correction(train, rollout, m, CONFIGS[3])
        np.testing.assert_array_equal(np.asarray(mask), want_mask)
        assert 0 < float(metrics["rollout_corr/rollout_rs_masked_fraction"]) < 0.9
        assert 0 < float(metrics["rollout_corr/rollout_rs_seq_masked_fraction"]) < 1
        assert 0 < float(metrics["rollout_corr/rollout_is_oob_ratio"]) < 1
        assert abs(float(metrics["rollout_corr/rollout_is_batch_norm_factor"]) - 1) > 1e-3
        assert np.all(np.asarray(weights)[m == 0] == 0)


def test_bypass_weights_carry_no_gradient():
    """bypass_mode's reinforce gradient is -A w m / N with the weights held fixed (they are
    computed from sg(log_prob), as verl's no_grad)."""
    rc = dict(rollout_is="token", rollout_is_threshold=1.5, loss_type="reinforce")
    with jax.enable_x64(True):
        old, lp, a, m, _ = random_inputs(12).values()
        grad = jax.grad(
            lambda x: algos.compute_policy_loss(
                old, x, a, m, loss_mode="bypass_mode", rollout_correction=algos.RolloutCorrectionConfig(**rc)
            )[0]
        )(lp)
        weights, mask, _ = ref_rollout_correction(lp, old, m, rc)
        np.testing.assert_allclose(np.asarray(grad), -a * weights * mask / mask.sum(), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "rc, match",
    [
        (dict(loss_type="ppo"), "loss_type"),
        (dict(rollout_is="tokens"), "rollout_is"),
        (dict(rollout_is="token", rollout_is_threshold="2_1"), "lower bound exceeds"),
        (dict(rollout_is="token", rollout_is_threshold="-1"), "positive"),
        (dict(rollout_rs="token_k4", rollout_rs_threshold="1"), "token_k4"),
        (dict(rollout_rs="token_k2"), "rollout_rs_threshold must be provided"),
        (dict(rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="1,2,3"), "one per rollout_rs option"),
        (dict(rollout_rs="seq_sum_k2", rollout_rs_threshold="0.5_2"), "single upper bound"),
    ],
)
def test_bad_rollout_correction_raises_naming_it(rc, match):
    z = np.zeros((2, 3))
    with pytest.raises(ValueError, match=match):
        algos.compute_policy_loss(
            z, z, z, np.ones((2, 3)), loss_mode="bypass_mode", rollout_correction=algos.RolloutCorrectionConfig(**rc)
        )


def test_rollout_correction_from_a_mapping_and_unknown_keys():
    """verl-style dicts are accepted; a misspelt key is an error, not ignored."""
    with jax.enable_x64(True):
        old, lp, a, m, _ = random_inputs(13).values()
        rc = dict(rollout_is="token", loss_type="reinforce")
        as_dict = algos.compute_policy_loss(old, lp, a, m, loss_mode="bypass_mode", rollout_correction=rc)
        typed = algos.compute_policy_loss(
            old, lp, a, m, loss_mode="bypass_mode", rollout_correction=algos.RolloutCorrectionConfig(**rc)
        )
        _close(as_dict[0], typed[0], "mapping vs dataclass")
        with pytest.raises(TypeError, match="rollout_is_treshold"):
            algos.compute_policy_loss(
                old, lp, a, m, loss_mode="bypass_mode", rollout_correction={"rollout_is_treshold": 2}
            )


def test_a_micro_batch_without_response_tokens_adds_nothing():
    """verl raises on an empty mask; a jitted micro-batch cannot: its loss and every
    rollout_corr metric are 0 (finite), so its token share (0) adds nothing."""
    rc = algos.RolloutCorrectionConfig(**CONFIGS[4])
    old, lp, a, m, _ = random_inputs(10).values()
    loss, metrics = jax.jit(lambda *x: algos.compute_policy_loss(*x, loss_mode="bypass_mode", rollout_correction=rc))(
        old, lp, a, np.zeros_like(m)
    )
    assert float(loss) == 0.0
    corr = {k: float(v) for k, v in metrics.items() if k.startswith("rollout_corr/")}
    assert len(corr) > 50 and all(v == 0.0 for v in corr.values()), corr
