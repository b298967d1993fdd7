"""Remove padding, token-budget micro-batches, DP balancing, shape buckets and the on-policy
shortcut: each equal to the padded path it replaces (logits, log-probs, losses, gradients,
updates), each observed where the worker does it."""

import dataclasses

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxflow.models as models
import jaxflow.workers.base as base_module
from jaxflow.algos import global_batch_info
from jaxflow.data.batch import Batch
from jaxflow.mesh import MeshSpec
from jaxflow.workers import (
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    OptimConfig,
    ReferenceWorker,
    RewardModelWorker,
    RolloutConfig,
)
from jaxflow.workers.actor import actor_loss
from jaxflow.workers.forward import ForwardConfig, packed_outputs, read_responses
from jaxflow.workers.packing import balanced_partitions, bucket, micro_grid, pack, pack_inputs, plan_packing

CFG = models.get_preset("tiny_llama", vocab_size=64, num_layers=1)
P, R = 6, 10


def make_batch(seed: int, rows: int = 8, tail: float | None = None) -> Batch:
    """Left-padded prompts of 1..P tokens, right-padded responses of 0..R tokens (uniform, or
    long-tailed: geometric with success probability ``tail``); row 0's response is full."""
    rng = np.random.default_rng(seed)
    p = rng.integers(1, P + 1, rows)
    r = np.minimum(rng.geometric(tail, rows), R) if tail else rng.integers(0, R + 1, rows)
    r[0] = R
    pm = (np.arange(P)[None] >= P - p[:, None]).astype(np.int32)
    rm = (np.arange(R)[None] < r[:, None]).astype(np.int32)
    return Batch.from_dict(
        {
            "prompt_ids": (rng.integers(4, 64, (rows, P)) * pm).astype(np.int32),
            "prompt_mask": pm,
            "responses": (rng.integers(4, 64, (rows, R)) * rm).astype(np.int32),
            "response_mask": rm,
            "advantages": (rng.normal(size=(rows, R)) * rm).astype(np.float32),
            "ref_log_prob": ((rng.normal(size=(rows, R)) * 0.1 - 4) * rm).astype(np.float32),
            "old_log_probs": ((rng.normal(size=(rows, R)) * 0.1 - 4) * rm).astype(np.float32),
            "values": (rng.normal(size=(rows, R)) * rm).astype(np.float32),
            "returns": (rng.normal(size=(rows, R)) * rm).astype(np.float32),
        }
    )


def mesh(spec: str):
    """A mesh over the first devices it needs."""
    parsed = MeshSpec.parse(spec)
    return parsed.build(jax.devices()[: int(np.prod(list(parsed.as_dict().values())))])


def host(batch: Batch) -> dict[str, np.ndarray]:
    return {k: np.asarray(batch[k]) for k in batch.keys()}


class CompileCounter:
    """XLA compilations per program name, read from JAX's public compile events."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.counts: dict[str, int] = {}

    def _listener(self, event, duration, **kwargs):
        if event == self.EVENT:
            name = str(kwargs.get("fun_name", "?"))
            self.counts[name] = self.counts.get(name, 0) + 1

    def of(self, name: str) -> int:
        """Compiles of the program named ``name`` (the event calls it ``jit(<name>)``)."""
        return self.counts.get(f"jit({name})", 0)

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def init_model(kind: str, seed: int) -> nnx.Module:
    """A random model of ``CFG`` with the ``kind`` head, initialised in one compiled program
    (eagerly, every initialiser op compiles on its own)."""
    return nnx.jit(lambda: models.init_model(CFG, kind, seed=seed))()


@pytest.fixture(scope="module")
def model():
    """The policy, initialised eagerly: its weights are the ones the tolerances below were
    measured with. A compiled initialiser gives about a third of them one float32 spacing
    apart, and ``test_tool_tokens_train_nothing_and_leave_the_token_mean``'s packed and padded
    parameters then differ by 1.6e-5 in one entry (measured): Adam's first step, ~lr x
    sign(g), turns the rounding of a gradient entry near 0 into a parameter difference."""
    return models.init_model(CFG, "lm", seed=0)


@pytest.fixture(scope="module")
def value_model():
    """The critic's value model (workers copy a model's arrays; none changes it)."""
    return init_model("value", seed=1)


# ------------------------------------------------------------------ layout (NumPy only)


@pytest.mark.parametrize("ranks,budget,rows_per_micro", [(1, None, None), (2, 32, None), (2, None, 3)])
def test_plan_places_every_real_token_once(ranks, budget, rows_per_micro):
    b = host(make_batch(1, rows=12))
    layout = plan_packing(
        b["prompt_mask"], b["response_mask"], ranks=ranks, max_token_len=budget, rows_per_micro=rows_per_micro
    )
    t = pack_inputs(layout, b["prompt_ids"], b["prompt_mask"], b["responses"])
    k, N, C = t["packed_ids"].shape
    assert C == P + R and N % ranks == 0 and layout.rows.shape[1] % ranks == 0
    assert all(x == bucket(x) for x in layout.shape[:2] if x != (budget or 0) // C)
    if budget is not None:  # every micro-batch within the token budget per rank
        assert (N // ranks) * C <= budget
    for i in range(12):
        real = np.concatenate(
            [b["prompt_ids"][i][b["prompt_mask"][i] > 0], b["responses"][i][b["response_mask"][i] > 0]]
        )
        j, s = layout.micro[i], layout.starts[i]
        flat_ids, flat_pos = t["packed_ids"][j].reshape(-1), t["packed_positions"][j].reshape(-1)
        np.testing.assert_array_equal(flat_ids[s : s + len(real)], real)
        np.testing.assert_array_equal(flat_pos[s : s + len(real)], np.arange(len(real)))
        seg = t["packed_segments"][j].reshape(-1)
        assert len(set(seg[s : s + len(real)])) == 1 and seg[s] > 0 and s // C == (s + len(real) - 1) // C
        # the row sits in the row block of the rank that holds its bin
        q = list(layout.rows[j]).index(i)
        assert q // (layout.rows.shape[1] // ranks) == (s // C) // (N // ranks)
        # the slot predicting response token u holds target responses[u]
        r = b["response_mask"][i].sum()
        idx = t["response_index"][j, q, :r]
        np.testing.assert_array_equal(t["packed_targets"][j].reshape(-1)[idx], b["responses"][i, :r])
    assert np.all((t["packed_segments"] == 0) == (layout.bins < 0))
    assert sorted(layout.rows[layout.rows >= 0].tolist()) == list(range(12))


def test_bucket_sizes_and_micro_grid():
    assert [bucket(n) for n in (1, 2, 7, 8, 9, 11, 13, 16, 17, 21, 33, 100)] == [
        1,
        2,
        7,
        8,
        10,
        12,
        14,
        16,
        20,
        24,
        40,
        112,
    ]
    assert len({bucket(n) for n in range(1, 4097)}) == 44
    assert all(bucket(n) >= n and bucket(n) - n < bucket(n) / 5 for n in range(1, 5000))
    # (k, n): buckets (n may be the budget's bins), holding the bins, within the budget
    for max_bins in (1, 3, 5, 16):
        for bins in range(1, 200):
            k, n = micro_grid(bins, max_bins)
            assert k * n >= bins and n <= max_bins and k == bucket(k) and n in (bucket(n), max_bins)
            assert k * n <= 1.25 * (bins + max_bins)  # under a fifth idle, plus the last micro-batch's rounding
        # a run whose bins vary by +-30% lands on a handful of shapes
        assert len({micro_grid(bins, max_bins) for bins in range(70, 131)}) <= 5
    assert micro_grid(9, None) == (1, 10)


def test_balanced_partitions():
    rng = np.random.default_rng(0)
    for n, parts in ((16, 4), (13, 4), (8, 8), (3, 4)):
        lengths = rng.integers(1, 100, n)
        sets = balanced_partitions(lengths, parts)
        assert sorted(np.concatenate(sets).tolist()) == list(range(n))
        sizes = [len(s) for s in sets]
        assert max(sizes) - min(sizes) <= 1
        loads = [lengths[s].sum() for s in sets]
        if n >= parts:
            assert max(loads) - min(loads) <= lengths.max()


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
        got = np.asarray(packed_NxCxV).reshape(-1, CFG.vocab_size)[s : s + len(real)]
        np.testing.assert_allclose(got, np.asarray(padded_BxLxV[i, real]), atol=1e-5, rtol=1e-5)
        checked += len(real)
    assert checked == int(mask.sum())
    # the read-out picks the logits predicting each response token
    lp = read_responses(
        jnp.arange(packed_NxCxV.shape[0] * packed_NxCxV.shape[1]).reshape(packed_NxCxV.shape[:2]),
        jnp.asarray(t["response_index"][0]),
    )
    assert lp.shape == (layout.rows.shape[1], R)


def loss_and_grads(model, dtype, budget, agg):
    """Padded (one micro-batch) and packed (one, or several under a token budget) losses,
    metrics and gradients of the actor loss with the mini-batch's normalisers, computed in
    ``dtype`` (a float64 model is float64 end to end)."""
    b = host(make_batch(3, rows=8))
    b = {k: v.astype(dtype) if v.dtype == np.float32 else v for k, v in b.items()}
    cfg = ActorConfig(use_kl_loss=True, entropy_coeff=0.01, loss_agg_mode=agg)
    loss_fn = actor_loss(cfg)
    graphdef, params = nnx.split(model)
    if dtype == np.float64:
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: models.init_model(CFG.replace(param_dtype=dtype, dtype=dtype))))
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    scalars = {"temperature": jnp.asarray(0.7, dtype)}
    keys = cfg.update_keys()

    def total(params, micros):
        gbi = global_batch_info(jnp.asarray(b["response_mask"]))
        out = [loss_fn(nnx.merge(graphdef, params), m, gbi, scalars) for m in micros]
        return sum(o[0] for o in out), jax.tree.map(lambda *x: sum(x), *[o[1] for o in out])

    padded = [{k: jnp.asarray(b[k]) for k in keys}]
    packed_np, layout = pack({k: b[k] for k in keys}, ranks=1, max_token_len=budget, rows_per_micro=None)
    assert (layout.num_micro > 1) == (budget is not None)
    packed = [{n: jnp.asarray(v[j]) for n, v in packed_np.items()} for j in range(layout.num_micro)]
    grad = jax.jit(jax.value_and_grad(total, has_aux=True))
    return jax.device_get((grad(params, padded), grad(params, packed)))


@pytest.mark.parametrize("budget,agg", [(32, "token-mean"), (None, "seq-mean-token-mean")])
def test_packed_loss_and_gradients_equal_padded(model, budget, agg):
    """float32: loss and metrics to 1e-5 relative, every gradient tensor to 1e-5 of its own
    scale (max |g|). Not element-wise: a gradient entry is a sum over every token, and where
    that sum cancels (entries 1e4 x smaller than the tensor's largest) float32 rounding alone
    leaves relative errors up to ~1e-2 in EITHER path against the exact value (measured: the
    padded path vs float64 differs by up to 1e-2 element-wise, 6e-7 of scale), so two float32
    summation orders cannot agree to 1e-5 there. float64 (end to end: the model computes its
    norms, softmax and logits in its own dtype when wider than float32): element-wise 1e-9,
    which a masking or position difference would break."""
    ((l0, a0), g0), ((l1, a1), g1) = loss_and_grads(model, np.float32, budget, agg)
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-7)
    for name in a0:
        np.testing.assert_allclose(a1[name], a0[name], rtol=1e-5, atol=1e-7, err_msg=name)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        scale = np.abs(x).max()
        assert scale > 0 and np.abs(y - x).max() <= 1e-5 * scale, jax.tree_util.keystr(path)
    with jax.enable_x64(True):
        ((l0, a0), g0), ((l1, a1), g1) = loss_and_grads(model, np.float64, budget, agg)
    assert np.asarray(l0).dtype == np.float64
    np.testing.assert_allclose(l1, l0, rtol=1e-9, atol=0)
    for name in a0:
        np.testing.assert_allclose(a1[name], a0[name], rtol=1e-9, atol=1e-15, err_msg=name)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(y, x, rtol=1e-9, atol=1e-15, err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------ workers on a dp mesh


BASE = ActorConfig(
    ppo_mini_batch_size=8, ppo_micro_batch_size_per_device=2, use_kl_loss=True, optim=OptimConfig(lr=1e-3)
)
DYNAMIC = dataclasses.replace(
    BASE,
    use_remove_padding=True,
    use_dynamic_bsz=True,
    ppo_max_token_len_per_device=32,
    log_prob_use_dynamic_bsz=True,
    log_prob_max_token_len_per_device=32,
)


def test_actor_packed_dynamic_update_equals_padded(model):
    """Log-probs and one optimizer step on a dp=2 x fsdp=2 mesh: padded fixed micro-batches
    vs packed token-budget micro-batches."""
    batch = make_batch(4)
    params, metrics, lps = {}, {}, {}
    for name, config in {"padded": BASE, "packed": DYNAMIC}.items():
        actor = ActorWorker(model, mesh("dp=2,fsdp=2"), "train", config, RolloutConfig())
        lps[name] = np.asarray(actor.log_probs(batch)["old_log_probs"])
        metrics[name] = actor.update(batch.update(tensors={"old_log_probs": lps[name]}))
        params[name] = jax.device_get(actor.params)
    np.testing.assert_allclose(lps["packed"], lps["padded"], atol=1e-5, rtol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        np.testing.assert_allclose(metrics["packed"][key], metrics["padded"][key], atol=1e-5, rtol=1e-5, err_msg=key)
    for x, y in zip(jax.tree.leaves(params["packed"]), jax.tree.leaves(params["padded"])):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_on_policy_shortcut_runs_no_log_prob_program(model, monkeypatch):
    """An on-policy update without ``old_log_probs`` takes them from its own forward: no
    log-prob program runs (counted; without the shortcut the update would run it first), and
    losses, metrics and the step equal those of the update given the log-probs of a
    separate pass, from the same starting state."""
    calls = []
    packed_forward = base_module.packed_forward
    monkeypatch.setattr(
        base_module,
        "packed_forward",
        lambda worker, name, *a, **k: (calls.append(name), packed_forward(worker, name, *a, **k))[1],
    )
    # the batch and mesh of `test_actor_packed_dynamic_update_equals_padded`'s packed actor: its
    # log-prob and update programs, already in the persistent cache, are loaded, not compiled
    batch = make_batch(4).select(
        ["prompt_ids", "prompt_mask", "responses", "response_mask", "advantages", "ref_log_prob"]
    )
    actor = ActorWorker(model, mesh("dp=2,fsdp=2"), "train", DYNAMIC, RolloutConfig())
    start = jax.device_get(actor.state)
    lp = actor.log_probs(batch)
    assert calls == ["old_log_probs"]
    expected = actor.update(batch | lp)
    expected_params = jax.device_get(actor.params)
    actor.set_train_state(start)
    calls.clear()
    got = actor.update(batch)
    assert calls == []
    for key in (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/ppo_kl",
        "actor/pg_clipfrac",
        "actor/entropy",
    ):
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for x, y in zip(jax.tree.leaves(jax.device_get(actor.params)), jax.tree.leaves(expected_params)):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_critic_packed_dynamic_update_equals_padded(value_model):
    """The critic's values and one value update on dp=2: padded fixed micro-batches vs packed
    token-budget micro-batches (several of them)."""
    batch = make_batch(6)
    b = host(batch)
    assert plan_packing(b["prompt_mask"], b["response_mask"], ranks=2, max_token_len=32).num_micro > 1
    base = CriticConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_device=2, optim=OptimConfig(lr=1e-3))
    configs = {
        "padded": base,
        "packed": dataclasses.replace(
            base,
            use_remove_padding=True,
            use_dynamic_bsz=True,
            ppo_max_token_len_per_device=32,
            forward_max_token_len_per_device=32,
        ),
    }
    values, metrics, params = {}, {}, {}
    for name, config in configs.items():
        critic = CriticWorker(value_model, mesh("dp=2"), "train", config)
        metrics[name] = critic.update(batch)
        values[name] = np.asarray(critic.values(batch)["values"])  # after the step: the trained head is non-zero
        params[name] = jax.device_get(critic.params)
    assert np.abs(values["padded"]).max() > 1e-3
    np.testing.assert_allclose(values["packed"], values["padded"], atol=1e-5, rtol=1e-5)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        np.testing.assert_allclose(metrics["packed"][key], metrics["padded"][key], atol=1e-6, rtol=1e-5, err_msg=key)
    for x, y in zip(jax.tree.leaves(params["packed"]), jax.tree.leaves(params["padded"])):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_packed_programs_compile_once_per_shape_bucket(model, value_model):
    """Five steps of long-tailed, varying lengths through the packed programs (actor log-probs
    and update, reference, critic values, reward model, all under token budgets; the critic's
    update packs with the same plan): each program compiles once per shape bucket its calls
    fall into (counted from JAX's compile events), a handful, though the unbucketed shapes
    change nearly every step; and the reference and reward model match their padded paths."""
    dp = mesh("dp=2")
    actor = ActorWorker(
        model,
        dp,
        "train",
        dataclasses.replace(
            DYNAMIC, ppo_mini_batch_size=16, ppo_max_token_len_per_device=48, log_prob_max_token_len_per_device=48
        ),
        RolloutConfig(),
    )
    ref = ReferenceWorker(
        model, dp, "train", forward=ForwardConfig(use_remove_padding=True, max_token_len_per_device=48)
    )
    ref_padded = ReferenceWorker(model, dp, "train")
    critic = CriticWorker(
        value_model,
        dp,
        "train",
        CriticConfig(use_remove_padding=True, use_dynamic_bsz=True, forward_max_token_len_per_device=48),
    )
    reward_model = init_model("reward", seed=2)
    rm = RewardModelWorker(
        reward_model, dp, "train", forward=ForwardConfig(use_remove_padding=True, max_token_len_per_device=48)
    )
    rm_padded = RewardModelWorker(reward_model, dp, "train")
    programs = (
        "packed_old_log_probs",
        "actor_train_step",
        "packed_ref_log_prob",
        "packed_values",
        "packed_token_level_scores",
    )  # all under a budget of 48 tokens (3 bins) per device
    buckets, raw = set(), set()
    with CompileCounter() as compiles:
        for step, (seed, tail) in enumerate(((10, 0.6), (12, 0.3), (13, 0.2), (15, 0.15), (11, 0.1))):
            batch = make_batch(seed, rows=16, tail=tail)
            b = host(batch)
            layout = plan_packing(b["prompt_mask"], b["response_mask"], ranks=2, max_token_len=48)
            buckets.add(layout.shape)
            raw.add(int((layout.bins >= 0).any(axis=2).sum()))  # bins in use: the unbucketed size
            batch = batch.update(tensors={"old_log_probs": actor.log_probs(batch)["old_log_probs"]})
            actor.update(batch)
            ref_lp = ref.log_probs(batch)["ref_log_prob"]
            critic.values(batch)
            scores = rm.scores(batch)["token_level_scores"]
            if step < 2:  # the reference and the reward model (several micro-batches) equal their padded paths
                assert layout.num_micro > 1
                np.testing.assert_allclose(
                    np.asarray(ref_lp), np.asarray(ref_padded.log_probs(batch)["ref_log_prob"]), atol=1e-5, rtol=1e-5
                )
                np.testing.assert_allclose(
                    np.asarray(scores), np.asarray(rm_padded.scores(batch)["token_level_scores"]), atol=1e-5, rtol=1e-5
                )
    assert len(raw) == 4 and len(buckets) == 2, (raw, buckets)  # 4 bin counts, 2 shape buckets
    for name in programs:
        assert compiles.of(name) == len(buckets), (name, compiles.counts, buckets)


# ------------------------------------------------------------------ DP balancing


def test_every_rank_gets_balanced_tokens_in_log_prob_and_update(model, monkeypatch):
    """What the actor puts on each of its 4 data-parallel devices (read from the device
    shards of the packed inputs) holds about the same number of real tokens, in the log-prob
    pass and in every mini-batch of a shuffled two-epoch update, though the batch order's
    contiguous blocks are far apart; the update logs verl's ``global_seqlen/*`` of it."""
    actor = ActorWorker(
        model,
        mesh("dp=2,fsdp=2"),
        "train",
        dataclasses.replace(
            DYNAMIC,
            ppo_mini_batch_size=8,
            ppo_epochs=2,
            shuffle=True,
            ppo_micro_batch_size_per_device=None,
            log_balance=True,
        ),
        RolloutConfig(),
    )
    batch = make_batch(7, rows=16, tail=0.25)
    b = host(batch)
    lengths = b["prompt_mask"].sum(1) + b["response_mask"].sum(1)
    order = np.argsort(lengths, kind="stable")  # longest rows last: contiguous blocks are unbalanced
    batch, lengths = batch.permute(order), lengths[order]
    fed = []
    put_presplit = actor.put_presplit

    def spy(tensors):
        out = put_presplit(tensors)
        seg = out["packed_segments"]
        per_device = {s.device: int((np.asarray(s.data) > 0).sum()) for s in seg.addressable_shards}
        fed.append([per_device[d] for d in actor.mesh.devices.reshape(-1)])  # dp-major device order = rank order
        return out

    monkeypatch.setattr(actor, "put_presplit", spy)
    lp = actor.log_probs(batch)
    metrics = actor.update(batch.update(tensors={"old_log_probs": lp["old_log_probs"]}))
    assert len(fed) == 1 + 4  # the log-prob pass, then 2 epochs x 2 mini-batches
    assert sum(fed[0]) == lengths.sum()
    contiguous = [x.sum() for x in np.array_split(lengths, 4)]
    assert max(contiguous) - min(contiguous) > 2 * lengths.max()
    for tokens in fed:
        assert max(tokens) - min(tokens) <= lengths.max(), fed
    np.testing.assert_array_equal(metrics["global_seqlen/balanced_max"], [max(t) for t in fed[1:]])
    np.testing.assert_array_equal(metrics["global_seqlen/balanced_min"], [min(t) for t in fed[1:]])
    np.testing.assert_allclose(metrics["global_seqlen/mean"], [np.mean(t) for t in fed[1:]])


def _tool_span(batch: Batch) -> np.ndarray:
    """A ``loss_mask`` with tokens 2..4 of every response of 7 or more tokens masked (as a
    multi-turn rollout masks a tool's answer between two model turns)."""
    rm = np.asarray(batch["response_mask"])
    lm = rm.copy()
    long_rows = rm.sum(1) >= 7
    lm[np.ix_(long_rows, np.arange(2, 5))] = 0
    assert lm.sum() < rm.sum()
    return lm


def test_tool_tokens_train_nothing_and_leave_the_token_mean(model, value_model):
    """``use_loss_mask``: the tokens a ``loss_mask`` masks (inside responses, as tool answers)
    give no gradient (advantages and old log-probs changed there: the same parameters bit for
    bit, actor and critic) and leave the token-mean (the policy loss equals NumPy's mean over
    the trained tokens alone), padded and packed alike."""
    batch = make_batch(3, rows=8)
    lm = _tool_span(batch)
    rng = np.random.default_rng(5)
    noise = (rng.normal(size=lm.shape) * (1 - lm) * np.asarray(batch["response_mask"])).astype(np.float32)
    changed = batch.update(
        tensors={k: np.asarray(batch[k]) + noise for k in ("advantages", "old_log_probs", "values", "returns")}
    )
    # (Adam's first step is about lr x sign(g): a small lr keeps rounding-level differences of
    # the packed and padded gradients at rounding level in the parameters.)
    padded = ActorConfig(ppo_mini_batch_size=8, use_loss_mask=True, optim=OptimConfig(lr=1e-3))
    configs = {"padded": padded, "packed": dataclasses.replace(padded, use_remove_padding=True)}
    losses, params = {}, {}
    for name, config in configs.items():
        actor = ActorWorker(model, mesh("dp=2"), "train", config, RolloutConfig())
        start = jax.tree.map(jnp.copy, actor.state)
        old = actor.log_probs(batch)["old_log_probs"]  # the step's own policy: every ratio is 1
        runs = []
        for b in (batch, changed):
            actor.state = jax.tree.map(jnp.copy, start)
            b = b.update(tensors={"old_log_probs": np.asarray(old), "loss_mask": lm})
            runs.append((actor.train_step(b)["actor/pg_loss"], jax.device_get(actor.state.params)))
        for x, y in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1])):
            np.testing.assert_array_equal(x, y)
        losses[name], params[name] = runs[0]
    trained = np.asarray(batch["response_mask"]) * lm
    adv = np.asarray(batch["advantages"])
    want = -np.sum(adv * trained) / trained.sum()
    assert abs(want - (-np.sum(adv * batch["response_mask"]) / np.sum(batch["response_mask"]))) > 1e-3
    np.testing.assert_allclose(losses["padded"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses["packed"], want, rtol=1e-5, atol=1e-6)
    for x, y in zip(jax.tree.leaves(params["packed"]), jax.tree.leaves(params["padded"])):
        np.testing.assert_allclose(x, y, atol=1e-5)
    critic_config = CriticConfig(ppo_mini_batch_size=8, use_loss_mask=True, optim=OptimConfig(lr=1e-2))
    critic = CriticWorker(value_model, mesh("dp=2"), "train", critic_config)
    start = jax.tree.map(jnp.copy, critic.state)
    after = []
    for b in (batch, changed):
        critic.state = jax.tree.map(jnp.copy, start)
        critic.train_step(b.update(tensors={"loss_mask": lm}))
        after.append(jax.device_get(critic.state.params))
    for x, y in zip(jax.tree.leaves(after[0]), jax.tree.leaves(after[1])):
        np.testing.assert_array_equal(x, y)
