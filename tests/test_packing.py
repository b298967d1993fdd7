"""Remove padding, token-budget micro-batches, DP balancing and the on-policy shortcut: each
equal to the padded path it replaces (logits, log-probs, losses, gradients, updates)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxflow.models as models
from jaxflow.algos import global_batch_info
from jaxflow.programs.balance import balance_batch, balanced_partitions
from jaxflow.data.batch import Batch
from jaxflow.mesh import MeshSpec
from jaxflow.workers import (ActorConfig, ActorWorker, CriticConfig, CriticWorker, OptimConfig, ReferenceWorker,
                             RewardModelWorker, RolloutConfig)
from jaxflow.workers.actor import actor_loss
from jaxflow.workers.forward import packed_outputs, read_responses
from jaxflow.workers.packing import bucket, pack_inputs, pack_minibatch, plan_packing

CFG = models.get_preset("tiny_llama", vocab_size=64, num_layers=1)
P, R = 6, 10


def make_batch(seed: int, rows: int = 8, long_tail: bool = False) -> Batch:
    """Left-padded prompts of 1..P tokens, right-padded responses of 0..R tokens."""
    rng = np.random.default_rng(seed)
    p = rng.integers(1, P + 1, rows)
    r = np.minimum(rng.geometric(0.25, rows), R) if long_tail else rng.integers(0, R + 1, rows)
    r[0] = R
    pm = (np.arange(P)[None] >= P - p[:, None]).astype(np.int32)
    rm = (np.arange(R)[None] < r[:, None]).astype(np.int32)
    return Batch.from_dict({
        "prompt_ids": (rng.integers(4, 64, (rows, P)) * pm).astype(np.int32), "prompt_mask": pm,
        "responses": (rng.integers(4, 64, (rows, R)) * rm).astype(np.int32), "response_mask": rm,
        "advantages": (rng.normal(size=(rows, R)) * rm).astype(np.float32),
        "ref_log_prob": ((rng.normal(size=(rows, R)) * 0.1 - 4) * rm).astype(np.float32),
        "old_log_probs": ((rng.normal(size=(rows, R)) * 0.1 - 4) * rm).astype(np.float32),
    })


def mesh(spec: str):
    """A mesh over the first devices it needs."""
    parsed = MeshSpec.parse(spec)
    return parsed.build(jax.devices()[:int(np.prod(list(parsed.as_dict().values())))])


def host(batch: Batch) -> dict[str, np.ndarray]:
    return {k: np.asarray(batch[k]) for k in batch.keys()}


@pytest.fixture(scope="module")
def model():
    return models.init_model(CFG, "lm", seed=0)


# ------------------------------------------------------------------ layout (NumPy only)


@pytest.mark.parametrize("ranks,budget,rows_per_micro", [(1, None, None), (2, 32, None), (2, None, 3)])
def test_plan_places_every_real_token_once(ranks, budget, rows_per_micro):
    b = host(make_batch(1, rows=12))
    layout = plan_packing(b["prompt_mask"], b["response_mask"], ranks=ranks, max_token_len=budget,
                          rows_per_micro=rows_per_micro)
    t = pack_inputs(layout, b["prompt_ids"], b["prompt_mask"], b["responses"])
    k, N, C = t["packed_ids"].shape
    assert C == P + R and N % ranks == 0 and layout.rows.shape[1] % ranks == 0
    if budget is not None:  # every micro-batch within the token budget per rank
        assert (N // ranks) * C <= budget
    for i in range(12):
        real = np.concatenate([b["prompt_ids"][i][b["prompt_mask"][i] > 0], b["responses"][i][b["response_mask"][i] > 0]])
        j, s = layout.micro[i], layout.starts[i]
        flat_ids, flat_pos = t["packed_ids"][j].reshape(-1), t["packed_positions"][j].reshape(-1)
        np.testing.assert_array_equal(flat_ids[s:s + len(real)], real)
        np.testing.assert_array_equal(flat_pos[s:s + len(real)], np.arange(len(real)))
        seg = t["packed_segments"][j].reshape(-1)
        assert len(set(seg[s:s + len(real)])) == 1 and seg[s] > 0 and s // C == (s + len(real) - 1) // C
        # the slot predicting response token u holds target responses[u]
        q = list(layout.rows[j]).index(i)
        r = b["response_mask"][i].sum()
        idx = t["response_index"][j, q, :r]
        np.testing.assert_array_equal(t["packed_targets"][j].reshape(-1)[idx], b["responses"][i, :r])
    # each segment is contiguous and ids / segments agree on empty slots
    assert np.all((t["packed_segments"] == 0) == (layout.bins < 0))
    assert sorted(layout.rows[layout.rows >= 0].tolist()) == list(range(12))


def test_bucket_sizes():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 25, 33)] == [1, 2, 3, 4, 6, 6, 8, 12, 16, 24, 32, 48]
    assert len({bucket(n) for n in range(1, 4097)}) <= 24


def test_bad_response_mask_is_refused():
    b = host(make_batch(0))
    b["response_mask"][1, 0] = 0  # a hole at the start
    b["response_mask"][1, 1] = 1
    with pytest.raises(ValueError, match="right-padded responses"):
        plan_packing(b["prompt_mask"], b["response_mask"])


# ------------------------------------------------------------------ model / loss equivalence


def test_packed_logits_equal_padded(model):
    b = host(make_batch(2))
    layout = plan_packing(b["prompt_mask"], b["response_mask"])
    t = pack_inputs(layout, b["prompt_ids"], b["prompt_mask"], b["responses"])
    micro = jax.tree.map(lambda x: jnp.asarray(x[0]), t)
    packed_NxCxV = nnx.jit(lambda m, t: m.logits(packed_outputs(m, t)))(model, micro)
    ids = np.concatenate([b["prompt_ids"], b["responses"]], 1)
    mask = np.concatenate([b["prompt_mask"], b["response_mask"]], 1)
    padded_BxLxV = nnx.jit(lambda m, i, a: m(i, attention_mask=a))(model, jnp.asarray(ids), jnp.asarray(mask))
    checked = 0
    for i in range(len(ids)):
        real = np.flatnonzero(mask[i])
        s = layout.starts[i]
        got = np.asarray(packed_NxCxV).reshape(-1, CFG.vocab_size)[s:s + len(real)]
        np.testing.assert_allclose(got, np.asarray(padded_BxLxV[i, real]), atol=1e-5, rtol=1e-5)
        checked += len(real)
    assert checked == int(mask.sum())
    # the read-out picks the logits predicting each response token
    lp = read_responses(jnp.arange(packed_NxCxV.shape[0] * packed_NxCxV.shape[1]).reshape(packed_NxCxV.shape[:2]),
                        jnp.asarray(t["response_index"][0]))
    assert lp.shape == (layout.rows.shape[1], R)


@pytest.mark.parametrize("budget,agg", [(32, "token-mean"), (None, "seq-mean-token-mean")])
def test_packed_loss_and_gradients_equal_padded(model, budget, agg):
    """One packed micro-batch, or several under a token budget, with the mini-batch's
    normalisers: loss, metrics and gradients equal the padded whole-batch ones (1e-5)."""
    b = host(make_batch(3, rows=8))
    cfg = ActorConfig(use_kl_loss=True, entropy_coeff=0.01, loss_agg_mode=agg)
    loss_fn = actor_loss(cfg)
    graphdef, params = nnx.split(model)
    scalars = {"temperature": jnp.float32(0.7)}
    keys = cfg.update_keys()

    def total(params, micros):
        gbi = global_batch_info(jnp.asarray(b["response_mask"]))
        out = [loss_fn(nnx.merge(graphdef, params), m, gbi, scalars) for m in micros]
        return sum(o[0] for o in out), jax.tree.map(lambda *x: sum(x), *[o[1] for o in out])

    padded = [{k: jnp.asarray(b[k]) for k in keys}]
    packed_np = pack_minibatch({k: b[k] for k in keys}, ranks=1, max_token_len=budget, rows_per_micro=None)
    k = packed_np["packed_ids"].shape[0]
    assert (k > 1) == (budget is not None)
    packed = [{n: jnp.asarray(v[j]) for n, v in packed_np.items()} for j in range(k)]
    grad = jax.jit(jax.value_and_grad(total, has_aux=True))
    (l0, a0), g0 = grad(params, padded)
    (l1, a1), g1 = grad(params, packed)
    np.testing.assert_allclose(float(l1), float(l0), atol=1e-5, rtol=1e-5)
    for name in a0:
        np.testing.assert_allclose(float(a1[name]), float(a0[name]), atol=1e-5, rtol=1e-5, err_msg=name)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ workers on a dp mesh


@pytest.fixture(scope="module")
def actors(model):
    base = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_device=2, use_kl_loss=True,
                       optim=OptimConfig(lr=1e-3))
    dyn = dataclasses.replace(base, use_remove_padding=True, use_dynamic_bsz=True, ppo_max_token_len_per_device=32,
                              log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_device=32)
    return {name: (lambda c=c: ActorWorker(model, mesh("dp=2,fsdp=2"), "train", c, RolloutConfig()))
            for name, c in {"padded": base, "packed": dyn}.items()}


def test_actor_packed_dynamic_update_equals_padded(actors):
    """Log-probs and one optimizer step on a dp=2 x fsdp=2 mesh: padded fixed micro-batches
    vs packed token-budget micro-batches; the on-policy shortcut (no old_log_probs column)
    equals passing the log-probs of a separate pass."""
    batch = make_batch(4)
    params, metrics = {}, {}
    for name in ("padded", "packed"):
        actor = actors[name]()
        lp = actor.log_probs(batch)["old_log_probs"]
        if name == "padded":
            lp_padded = np.asarray(lp)
        else:
            np.testing.assert_allclose(np.asarray(lp), lp_padded, atol=1e-5)
        metrics[name] = actor.update(batch.update(tensors={"old_log_probs": lp}))
        params[name] = jax.device_get(actor.params)
        if name == "packed":  # on-policy shortcut: same loss and step without the column
            shortcut = actors[name]()
            m = shortcut.update(batch.select([k for k in batch.keys() if k != "old_log_probs"]))
            for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl"):
                np.testing.assert_allclose(m[key], metrics[name][key], atol=1e-5, err_msg=key)
            for x, y in zip(jax.tree.leaves(jax.device_get(shortcut.params)), jax.tree.leaves(params[name])):
                np.testing.assert_allclose(x, y, atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        np.testing.assert_allclose(metrics["packed"][key], metrics["padded"][key], atol=1e-5, rtol=1e-5, err_msg=key)
    for x, y in zip(jax.tree.leaves(params["packed"]), jax.tree.leaves(params["padded"])):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_packed_forwards_compile_per_bucket_not_per_step(model):
    """A reference, a critic and a reward model over batches of long-tailed, varying lengths: values equal
    the padded path and the packed forward compiles a handful of programs."""
    ref = ReferenceWorker(model, mesh("dp=2"), "train", use_remove_padding=True, max_token_len_per_device=48)
    ref_padded = ReferenceWorker(model, mesh("dp=2"), "train")
    critic_model = models.init_model(CFG, "value", seed=1)
    critic = CriticWorker(critic_model, mesh("dp=2"), "train", CriticConfig(
        use_remove_padding=True, use_dynamic_bsz=True, forward_max_token_len_per_device=48))
    critic_padded = CriticWorker(critic_model, mesh("dp=2"), "train")
    reward_model = models.init_model(CFG, "reward", seed=2)
    rm = RewardModelWorker(reward_model, mesh("dp=2"), "train", use_remove_padding=True)
    rm_padded = RewardModelWorker(reward_model, mesh("dp=2"), "train")
    shapes = set()
    for seed in range(6):
        batch = make_batch(10 + seed, rows=8, long_tail=True)
        np.testing.assert_allclose(np.asarray(ref.log_probs(batch)["ref_log_prob"]),
                                   np.asarray(ref_padded.log_probs(batch)["ref_log_prob"]), atol=1e-5)
        if seed < 2:
            np.testing.assert_allclose(np.asarray(critic.values(batch)["values"]),
                                       np.asarray(critic_padded.values(batch)["values"]), atol=1e-5)
            np.testing.assert_allclose(np.asarray(rm.scores(batch)["token_level_scores"]),
                                       np.asarray(rm_padded.scores(batch)["token_level_scores"]), atol=1e-5)
        b = host(batch)
        layout = plan_packing(b["prompt_mask"], b["response_mask"], ranks=2, max_token_len=48)
        shapes.add((layout.bins.shape, layout.rows.shape))
    compiled = ref._programs[("packed", "log_probs")]._cache_size()
    assert compiled == len(shapes) <= 4, (compiled, shapes)


# ------------------------------------------------------------------ DP balancing


def test_balance_batch_equalises_tokens_and_logs_verl_metrics():
    batch = make_batch(5, rows=16, long_tail=True)
    lengths = np.asarray(batch["prompt_mask"]).sum(1) + np.asarray(batch["response_mask"]).sum(1)
    balanced, metrics = balance_batch(batch, 4)
    new_lengths = np.asarray(balanced["prompt_mask"]).sum(1) + np.asarray(balanced["response_mask"]).sum(1)
    blocks = new_lengths.reshape(4, 4).sum(1)
    assert blocks.max() - blocks.min() <= lengths.max()
    assert blocks.max() - blocks.min() <= np.ptp(lengths.reshape(4, 4).sum(1))
    assert metrics["global_seqlen/balanced_max"] == blocks.max() and metrics["global_seqlen/balanced_min"] == blocks.min()
    assert metrics["global_seqlen/max"] == lengths.reshape(4, 4).sum(1).max()
    assert metrics["global_seqlen/mean"] == lengths.sum() / 4
    # the same rows, reordered
    order = np.lexsort(np.asarray(balanced["responses"]).T)
    np.testing.assert_array_equal(np.asarray(balanced["responses"])[order],
                                  np.asarray(batch["responses"])[np.lexsort(np.asarray(batch["responses"]).T)])
    with pytest.raises(ValueError, match="equal data-parallel blocks"):
        balanced_partitions(lengths, 3)
