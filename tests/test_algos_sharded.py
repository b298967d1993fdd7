"""Data-parallel shards and gradient-accumulation micro-batches on 8 simulated CPU devices.

With the mini-batch's global normalisers (total valid tokens / sequences), the losses of the
micro-batches of every shard sum (dp_size=1) or average (dp_size=n_shards) exactly to the
full-batch loss, and so do their gradients. The pure functions also run unchanged on arrays
sharded over a mesh, including groups whose samples sit on different devices.
"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxflow.algos as algos

N_DEV, MICRO = 8, 2  # 8 shards x 2 micro-batches of 2 rows
B, T = 32, 7
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# every aggregation mode with the PPO loss, plus the other losses that aggregate with agg_loss
COMBOS = tuple(("vanilla", am) for am in MODES) + (
    ("cispo", "seq-mean-token-mean"),
    ("gpg", "seq-mean-token-sum-norm"),
    ("gspo", "token-mean"),  # gspo always aggregates seq-mean-token-mean
)
# verl's convention (loss x dp_size, replicas averaged) checked on a token- and a seq-level mode
DP_COMBOS = (("vanilla", "token-mean"), ("vanilla", "seq-mean-token-mean"))


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices()
    assert len(devices) == N_DEV, "tests/conftest.py must give 8 simulated CPU devices"
    return Mesh(np.array(devices), ("dp",))


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, T + 1, size=B)
    lengths[[3, 17]] = 0  # fully masked rows
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
    old = rng.normal(-1.5, 0.5, size=(B, T))
    return dict(
        old_log_prob=old,
        log_prob=old + rng.normal(0, 0.3, size=(B, T)),
        advantages=rng.normal(size=(B, T)),
        response_mask=mask,
        token_level_rewards=rng.normal(size=(B, T)),
        values=rng.normal(size=(B, T)),
        group_ids=rng.permutation(np.repeat(np.arange(B // 4) * 13 - 5, 4)),  # groups span shards
    )


def policy_loss(batch, log_prob, loss_mode, agg_mode, info=None):
    return algos.compute_policy_loss(
        batch["old_log_prob"],
        log_prob,
        batch["advantages"],
        batch["response_mask"],
        loss_mode=loss_mode,
        loss_agg_mode=agg_mode,
        global_batch_info=info,
    )[0]


def full_batch(batch):
    """Reference: every (loss mode, agg mode) on the whole batch, and the gradients."""
    out = {}
    for lm, am in COMBOS:
        f = lambda lp, lm=lm, am=am: policy_loss(batch, lp, lm, am)
        out[lm, am] = jax.value_and_grad(f)(batch["log_prob"])
    return out


def sharded_accumulated(mesh):
    """Each device: local normaliser counts -> psum -> micro-batch losses with the global
    normalisers -> accumulate (sum) -> psum (dp_size=1) or pmean (dp_size=8) over 'dp'."""

    def per_device(local):
        out = per_device_dp(local, 1, COMBOS)
        out.update(per_device_dp(local, N_DEV, DP_COMBOS))
        return out

    def per_device_dp(local, dp_size, combos):
        reduce = (lambda x: jax.lax.psum(x, "dp")) if dp_size == 1 else (lambda x: jax.lax.pmean(x, "dp"))
        info = algos.global_batch_info(local["response_mask"], dp_size=dp_size)
        info["batch_num_tokens"] = jax.lax.psum(info["batch_num_tokens"], "dp")
        info["global_batch_size"] = jax.lax.psum(info["global_batch_size"], "dp")
        micro = jax.tree.map(lambda x: x.reshape((MICRO, -1) + x.shape[1:]), local)
        out = {}
        for lm, am in combos:

            def accumulated(lp_micro, lm=lm, am=am):
                total = 0.0
                for i in range(MICRO):  # gradient accumulation over micro-batches
                    mb = jax.tree.map(lambda x: x[i], micro)
                    total = total + policy_loss(mb, lp_micro[i], lm, am, info)
                return total

            loss, grad = jax.value_and_grad(accumulated)(micro["log_prob"])
            out[dp_size, lm, am] = (reduce(loss), grad.reshape(local["log_prob"].shape))
        return out

    spec = {k: P("dp") for k in ("old_log_prob", "log_prob", "advantages", "response_mask")}
    out_specs = {(1, *c): (P(), P("dp")) for c in COMBOS} | {(N_DEV, *c): (P(), P("dp")) for c in DP_COMBOS}
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,), out_specs=out_specs))


def test_micro_batches_and_shards_equal_full_batch(mesh):
    batch = make_batch()
    cols = {k: batch[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask")}
    ref = jax.jit(full_batch)(cols)
    sharded_in = jax.device_put(cols, NamedSharding(mesh, P("dp")))
    out = sharded_accumulated(mesh)(sharded_in)
    for (dp_size, *combo), (loss, grad) in out.items():
        key = tuple(combo)
        ref_loss, ref_grad = ref[key]
        np.testing.assert_allclose(float(loss), float(ref_loss), atol=1e-10, rtol=0, err_msg=str(key))
        # each shard's gradient of its accumulated loss is its slice of the full-batch gradient
        # (times dp_size: verl's convention, undone by the optimiser's mean over replicas)
        np.testing.assert_allclose(
            np.asarray(grad) / dp_size, np.asarray(ref_grad), atol=1e-10, rtol=0, err_msg=str(key)
        )
        assert grad.sharding.spec == P("dp")


def test_local_normalisers_do_not_add_up(mesh):
    """The legacy behaviour (each micro-batch normalised by its own count) is not the
    full-batch loss: the global normaliser is what makes the test above meaningful."""
    batch = make_batch(1)
    cols = {k: batch[k] for k in ("old_log_prob", "log_prob", "advantages", "response_mask")}
    loss = jax.jit(lambda c: policy_loss(c, c["log_prob"], "vanilla", "token-mean"))
    full = loss(cols)
    chunks = [jax.tree.map(lambda x, i=i: x[i * 4 : (i + 1) * 4], cols) for i in range(B // 4)]
    local_mean = np.mean([float(loss(c)) for c in chunks])
    assert abs(local_mean - float(full)) > 1e-3


def test_estimators_and_losses_run_on_sharded_arrays(mesh):
    """jit over batch-sharded inputs gives the unsharded values; groups span devices."""
    batch = make_batch(2)
    sharding = NamedSharding(mesh, P("dp"))
    placed = jax.device_put(batch, sharding)
    assert placed["response_mask"].sharding.spec == P("dp")
    assert len(placed["response_mask"].addressable_shards) == N_DEV

    @jax.jit
    def step(b):
        grpo, _ = algos.compute_grpo_outcome_advantage(b["token_level_rewards"], b["response_mask"], b["group_ids"])
        gae, ret = algos.compute_gae_advantage_return(
            b["token_level_rewards"], b["values"], b["response_mask"], 0.99, 0.95
        )
        loss, metrics = algos.compute_policy_loss(b["old_log_prob"], b["log_prob"], grpo, b["response_mask"])
        vf, _ = algos.compute_value_loss(b["values"] + 0.1, ret, b["values"], b["response_mask"], 0.2)
        return dict(grpo=grpo, gae=gae, loss=loss, clipfrac=metrics["pg_clipfrac"], vf=vf)

    sharded = step(placed)
    local = step(jax.device_put(batch, jax.devices()[0]))
    for k in local:
        np.testing.assert_allclose(np.asarray(sharded[k]), np.asarray(local[k]), atol=1e-10, rtol=0, err_msg=k)
    assert sharded["grpo"].sharding.is_equivalent_to(sharding, 2)  # stays batch-sharded
