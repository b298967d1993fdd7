"""LoRA RL: adapters equal the full-weight model with the merged delta, only adapters train (and
carry optimizer state), the reference is the base, the rollout probe catches a rollout that
never got the trained adapters, PEFT loads the export, a PEFT adapter is a starting point, the
planners count what LoRA saves.

References: the merged delta is computed here in NumPy from the adapters' arrays (``W + (alpha
/ r) A B`` over the flattened in / out features); PEFT and transformers (PyTorch) read the
export. Tolerances: float32 throughout; an adapted projection and its merged weight differ by
summation order only (~1e-7 relative on logits of order 1): 1e-5 (the issue's bound); PEFT's
logits against jaxflow's, two implementations: 1e-4 (the issue's bound).
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import jaxflow.models as models
from jaxflow.configs import load_config
from jaxflow.configs.prepare import prepare_run
from jaxflow.configs.run_spec import describe_run
from jaxflow.data.batch import Batch
from jaxflow.mesh import HYBRID_TRAIN_RULES, TRAIN_RULES
from jaxflow.mesh.devices import FakeDevice
from jaxflow.models import peft_io
from jaxflow.models.lora import LORA_TARGETS, LoRAConfig, join, parse_target_modules, split_adapters
from jaxflow.sampling import SamplingParams
from jaxflow.workers import ActorConfig, ActorWorker, ForwardConfig, OptimConfig, ReferenceWorker, RolloutConfig
from jaxflow.workers.rollout_probe import RolloutMismatchError
from tests.hf_reference import hf_logits, random_hf_model

CFG = models.get_preset("tiny_llama", vocab_size=128, num_kv_heads=4)
LORA = LoRAConfig(rank=4, alpha=8.0)
B, P, R = 8, 6, 8


def _mesh(shape):
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), ("dp", "fsdp", "tp"))


def _init(cfg, seed=0):
    """``(graphdef, params)`` of a random model, initialised in one compiled program (eagerly,
    every initialiser op compiles on its own)."""
    graphdef = nnx.split(nnx.eval_shape(lambda: models.init_model(cfg, seed=seed)))[0]
    return graphdef, jax.jit(lambda: nnx.state(models.init_model(cfg, seed=seed)))()


def _randomised(params, seed=1, std=0.05):
    """The adapters moved off zero (B = 0 would make every test trivially pass)."""
    base, adapters = split_adapters(params)
    rng = np.random.default_rng(seed)
    adapters = jax.tree.map(
        lambda x: jax.device_put(np.asarray(x) + std * rng.standard_normal(x.shape, np.float32), x.sharding), adapters
    )
    return join(base, adapters)


def _numpy_merged(params, lora):
    """``W + (alpha / r) A B`` for every adapted weight, in NumPy, as an ``nnx.State`` of the
    base model (the reference the adapted forward is held to)."""
    base, adapters = split_adapters(params)
    flat = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(base)}
    ad = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(adapters)}
    for path, a in ad.items():
        if path[-1] != "a":
            continue
        b = ad[(*path[:-1], "b")]
        target = (*path[:-2], path[-2].removesuffix("_lora"))
        w = flat[target]
        lead = a.ndim - 1 - (2 if target[-1] == "o_proj" else 1)  # a layers dimension when scanned
        r = a.shape[-1]
        a2 = a.reshape(*a.shape[:lead], -1, r).astype(np.float64)
        b2 = b.reshape(*b.shape[:lead], r, -1).astype(np.float64)
        flat[target] = (w + lora.alpha / lora.rank * (a2 @ b2).reshape(w.shape)).astype(w.dtype)
    return nnx.from_flat_state([(p, v.replace(jnp.asarray(flat[p]))) for p, v in nnx.to_flat_state(base)])


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, ids_BxL):
    """The model's logits, compiled once per graph (an eager forward dispatches op by op)."""
    return nnx.merge(graphdef, params)(ids_BxL)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    pm = (np.arange(P)[None] >= P - rng.integers(2, P + 1, B)[:, None]).astype(np.int32)
    rm = (np.arange(R)[None] < rng.integers(1, R + 1, B)[:, None]).astype(np.int32)
    return dict(
        prompt_ids=(rng.integers(4, CFG.vocab_size, (B, P)) * pm).astype(np.int32),
        prompt_mask=pm,
        responses=(rng.integers(4, CFG.vocab_size, (B, R)) * rm).astype(np.int32),
        response_mask=rm,
    )


# --- the adapters ---------------------------------------------------------------------------


def test_target_modules_and_config_errors():
    assert parse_target_modules("all-linear") == LORA_TARGETS
    assert parse_target_modules("v_proj, q_proj") == ("q_proj", "v_proj")
    assert parse_target_modules(["down_proj"]) == ("down_proj",)
    with pytest.raises(ValueError, match="unknown.*lm_head"):
        parse_target_modules("q_proj,lm_head")
    with pytest.raises(ValueError, match="rank"):
        LoRAConfig(rank=0, alpha=1.0)
    # Adapters are float32 over a bfloat16 base, sharded like their weight (rank replicated).
    state = nnx.state(nnx.eval_shape(lambda: models.init_model(CFG.replace(param_dtype=jnp.bfloat16, lora=LORA))))
    base, adapters = split_adapters(state)
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    q = adapters["model"]["layers"][0]["self_attn"]["q_proj_lora"]
    assert q["a"].get_metadata()["logical_axes"] == ("embed", None)
    assert q["b"].get_metadata()["logical_axes"] == (None, "heads", "head_dim")


@pytest.mark.parametrize("scan", [False, True])
def test_adapted_model_equals_the_full_weight_model_with_the_merged_delta(scan):
    cfg = CFG.replace(scan_layers=scan, lora=LORA)
    graphdef, params = _init(cfg, seed=2)
    base_graphdef = nnx.split(nnx.eval_shape(lambda: models.init_model(cfg.replace(lora=None))))[0]
    base = split_adapters(params)[0]
    ids = jnp.asarray(_batch()["responses"] % (CFG.vocab_size - 1)) + 1
    # B starts at zero: the adapted model is its base, exactly.
    np.testing.assert_array_equal(_logits(graphdef, params, ids), _logits(base_graphdef, base, ids))
    params = _randomised(params)
    adapted = _logits(graphdef, params, ids)
    merged = _logits(base_graphdef, _numpy_merged(params, LORA), ids)
    assert float(jnp.abs(adapted - _logits(base_graphdef, base, ids)).max()) > 1e-2  # the adapters matter
    np.testing.assert_allclose(adapted, merged, rtol=0, atol=1e-5)
    lp = jax.nn.log_softmax(adapted, -1)
    np.testing.assert_allclose(lp, jax.nn.log_softmax(merged, -1), rtol=0, atol=1e-5)
    # jaxflow's own merge (what the rollout reads) is the same model.
    own = nnx.state(peft_io.merged_model(graphdef, params))
    np.testing.assert_allclose(_logits(base_graphdef, own, ids), merged, rtol=0, atol=1e-5)


# --- the actor ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def actor():
    """A LoRA actor on 8 devices (dp=2 fsdp=2 tp=2) generating through the hybrid engine
    (gen tp=2), with the rollout probe, the merged rollout and the reference it serves."""
    config = ActorConfig(ppo_mini_batch_size=B, optim=OptimConfig(lr=3e-2, eps=1e-4), lora=LORA)
    rollout = RolloutConfig(train=SamplingParams(max_new_tokens=R, seed=3), probe_tolerance=1e-4)
    reference = dict(temperature=1.0, forward=ForwardConfig())
    w = ActorWorker(
        _init(CFG, seed=3),
        _mesh((2, 2, 2)),
        HYBRID_TRAIN_RULES,
        config,
        rollout,
        gen_tp=2,
        reference=reference,
    )
    return w, jax.device_get(w.frozen), jax.device_get(w.state)


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, CFG.vocab_size, (B, P)).astype(np.int32)
    return Batch({"prompt_ids": ids, "prompt_mask": np.ones_like(ids)})


def _steps(w, n, start=0):
    """``n`` rollout + update steps; the probe's value after each rollout."""
    probes = []
    for step in range(start, start + n):
        out = w.generate(_prompts(step), step=step)
        probes.append(w.rollout_metrics()["rollout/probe_tv"])
        adv = np.random.default_rng(step).normal(size=out["responses"].shape).astype(np.float32)
        w.update(out | Batch({"advantages": adv}), step=step)
    return probes


def test_only_the_adapters_train_and_carry_optimizer_state(actor):
    w, base0, state0 = actor
    step0 = int(w.state.step)  # (the module's actor: other tests may have stepped it first)
    _steps(w, 3)
    # The base is bit-identical (and is not part of the train state at all).
    for a, b in zip(jax.tree.leaves(base0), jax.tree.leaves(jax.device_get(w.frozen))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(w.state.step) == step0 + 3
    moved = [
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(state0.params), jax.tree.leaves(jax.device_get(w.state.params)))
    ]
    assert min(moved) > 0  # every adapter (A and B of every projection) was updated
    # The trained parameters are the adapters, exactly; Adam's moments exist for them alone.
    adapters = split_adapters(nnx.state(nnx.eval_shape(lambda: models.init_model(CFG.replace(lora=LORA)))))[1]
    n_adapters = sum(x.size for x in jax.tree.leaves(adapters))
    assert sum(x.size for x in jax.tree.leaves(w.state.params)) == n_adapters
    assert len(jax.tree.leaves(w.state.params)) == 2 * len(LORA_TARGETS) * CFG.num_layers
    floats = [x for x in jax.tree.leaves(w.state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert sum(x.size for x in floats) == 2 * n_adapters  # mu and nu
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(w.state.params) + floats)  # adapters, moments
    assert n_adapters < 0.1 * sum(x.size for x in jax.tree.leaves(w.frozen))


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_only(actor, tmp_path):
    """What orbax stored (read from the item's own metadata): the adapters, Adam's moments of
    them and the step counts, nothing of the base; the experiment record (which every
    checkpoint carries and a resume compares) points at the base. Restoring reads the state
    back into the actor's layout."""
    import orbax.checkpoint as ocp

    from jaxflow.trainer.rl import experiment_record

    w, _, _ = actor
    saved = jax.device_get(w.state)
    w.save_train_state(str(tmp_path / "actor"))
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        stored = dict(checkpointer.metadata(str(tmp_path / "actor")).item_metadata.tree)
    floats = {k: m for k, m in stored.items() if np.issubdtype(m.dtype, np.floating)}
    assert all("_lora__" in k for k in floats), sorted(k for k in floats if "_lora__" not in k)
    n_adapters = sum(x.size for x in jax.tree.leaves(w.state.params))
    assert sum(int(np.prod(m.shape)) for m in floats.values()) == 3 * n_adapters  # adapters, mu, nu
    assert all(m.shape == () for k, m in stored.items() if k not in floats)  # the step counts
    spec = prepare_run(load_config("grpo_tiny", ["actor_rollout_ref.model.lora_rank=8"]), with_datasets=False).spec
    record = experiment_record(spec)
    assert record["actor base"] == "preset (trainer.seed=0)" and record["actor LoRA"].startswith("rank=8 alpha=16 ")
    w.state = jax.tree.map(jnp.zeros_like, w.state)
    w.restore_train_state(str(tmp_path / "actor"))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(w.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_reference_is_the_base_served_by_the_actor(actor):
    w, base0, _ = actor
    _steps(w, 1, start=30)  # trained adapters, whichever tests ran before
    batch = Batch(_batch(1))
    ref = ReferenceWorker((w.base_graphdef, base0), _mesh((1, 1, 1)), TRAIN_RULES)  # a separate copy of the base
    np.testing.assert_allclose(
        w.ref_log_probs(batch)["ref_log_prob"], ref.log_probs(batch)["ref_log_prob"], rtol=0, atol=1e-5
    )
    # ... and not the trained policy (the adapters are on in the actor's own log-probs).
    diff = np.abs(np.asarray(w.log_probs(batch)["old_log_probs"]) - np.asarray(w.ref_log_probs(batch)["ref_log_prob"]))
    assert diff.max() > 1e-3


@pytest.mark.parametrize("merge", [True, False])
def test_the_probe_is_silent_while_the_rollout_gets_the_adapters(actor, merge):
    w, _, _ = actor
    w.rollout = dataclasses.replace(w.rollout, lora_merge=merge)
    try:
        probes = _steps(w, 2, start=10)
    finally:
        w.rollout = dataclasses.replace(w.rollout, lora_merge=True)
    assert max(probes) < 1e-5  # float32 on both sides: summation order only


def test_the_probe_stops_a_rollout_whose_adapter_sync_was_skipped(actor):
    """The rollout keeps merging the adapters it had at first (a sync that never delivers the
    trained ones: verl's disaggregated LoRA bug): after an update the probe fires, in one line."""
    w, _, _ = actor
    _steps(w, 1, start=20)  # the merge program exists
    key = next(k for k in w._programs if k[0] == "merge")
    merge, stale = w._programs[key], jax.tree.map(jnp.copy, w.state.params)
    w._programs[key] = lambda base, adapters: merge(base, stale)
    try:
        with pytest.raises(RolloutMismatchError) as info:
            _steps(w, 2, start=21)
    finally:
        w._programs[key] = merge
    message = str(info.value)
    assert "\n" not in message and "jaxflow.rollout_probe.tolerance" in message
    tv = float(message.split("differ from the trainer's by ")[1].split()[0])
    assert 1e-4 < tv <= 1.0


def test_a_mismatch_stops_the_cli_in_one_line(capsys):
    from jaxflow.run import report

    code = report(RolloutMismatchError("the rollout's next-token distributions differ ... by 0.3"), None)
    err = capsys.readouterr().err
    assert code == 3 and err.startswith("stopped: ") and err.count("\n") == 1


# --- PEFT -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_hf")
    random_hf_model("qwen2", num_key_value_heads=4).save_pretrained(root / "base")
    return root


def test_peft_loads_the_export_with_jaxflows_logits(hf_base):
    import transformers
    from peft import PeftModel

    mesh = _mesh((1, 2, 2))
    model = models.from_pretrained(hf_base / "base", mesh=mesh, rules=TRAIN_RULES, scan_layers=True)
    lora = LoRAConfig(rank=4, alpha=16.0, targets="q_proj,v_proj,o_proj,down_proj")
    graphdef, params = peft_io.add_adapters(*nnx.split(model), lora, 0, mesh, TRAIN_RULES)
    params = _randomised(params, std=0.1)
    out = peft_io.save_adapter(nnx.merge(graphdef, params).cfg, params, hf_base / "adapter", str(hf_base / "base"))
    config = json.loads((hf_base / "adapter" / peft_io.ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(hf_base / "base") and config["r"] == 4
    assert sorted(os.listdir(out)) == sorted([peft_io.ADAPTER_CONFIG, peft_io.ADAPTER_WEIGHTS])
    ids = np.random.RandomState(0).randint(1, 96, (2, 11))
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ours = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(ids), jnp.asarray(mask)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_base / "base", attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(hf, hf_base / "adapter").eval()
    real = mask > 0
    np.testing.assert_allclose(hf_logits(peft_model, ids, mask)[real], ours[real], rtol=0, atol=1e-4)
    # The adapter read back is the one written (a starting point for another run) ...
    fresh = peft_io.add_adapters(*nnx.split(model), lora, 7, mesh, TRAIN_RULES)
    loaded = peft_io.load_adapter(hf_base / "adapter", *fresh, mesh, TRAIN_RULES)
    for a, b in zip(jax.tree.leaves(split_adapters(loaded)[1]), jax.tree.leaves(split_adapters(params)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding
    # ... and the merged model is an HF checkpoint transformers loads, with the same logits.
    models.save_pretrained(peft_io.merged_model(graphdef, params), hf_base / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(hf_base / "merged", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(merged, ids, mask)[real], ours[real], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="LoRA adapters"):
        models.save_pretrained(nnx.merge(graphdef, params), hf_base / "refused")


def test_an_actor_starts_from_a_peft_adapter(hf_base):
    """``lora_adapter_path``: the actor's adapters are the directory's (an earlier run's, an
    SFT adapter); its train state starts from them with fresh optimizer moments."""
    lora, _ = peft_io.read_adapter_config(hf_base / "adapter")
    one = _mesh((1, 1, 1))
    base = nnx.split(models.from_pretrained(hf_base / "base"))  # the actor's layout: layers unscanned
    written = peft_io.load_adapter(
        hf_base / "adapter", *peft_io.add_adapters(*base, lora, 0, one, TRAIN_RULES), one, TRAIN_RULES
    )
    config = ActorConfig(ppo_mini_batch_size=B, lora=lora, lora_adapter_path=str(hf_base / "adapter"))
    w = ActorWorker(str(hf_base / "base"), _mesh((1, 2, 2)), TRAIN_RULES, config)
    for a, b in zip(jax.tree.leaves(w.state.params), jax.tree.leaves(split_adapters(written)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(w.state.step) == 0


# --- the run description and the planners --------------------------------------------------


def test_the_run_has_no_reference_role_and_the_actor_serves_it():
    cfg = load_config("grpo_tiny", ["actor_rollout_ref.model.lora_rank=8", "jaxflow.placement.type=colocated"])
    spec = describe_run(cfg, devices=[FakeDevice(i) for i in range(8)])
    assert tuple(spec.roles) == ("actor",) and spec.ref_in_actor and spec.role_settings.ref_in_actor
    # the reference's forward keeps its settings (actor_rollout_ref.ref) though it has no role
    assert spec.role_settings.ref == spec.actor_reference
    assert spec.actor.lora == LoRAConfig(rank=8, alpha=16.0) == spec.models["actor"].config.lora
    assert spec.rollout.probe_tolerance == cfg.jaxflow.rollout_probe.tolerance > 0
    full = describe_run(
        load_config("grpo_tiny", ["jaxflow.placement.type=colocated"]), devices=[FakeDevice(i) for i in range(8)]
    )
    assert tuple(full.roles) == ("actor", "ref") and not full.ref_in_actor
    assert (
        full.roles["ref"] == spec.actor_reference
    )  # the same forward, as a role of its own and full.rollout.probe_tolerance == 0


def test_a_lora_critic_trains_its_adapters_and_value_head_only():
    """``critic.model.lora_rank``: the critic's train state holds its adapters and its value
    head (which starts at zero and has no pretrained weights to keep) and Adam's moments of
    those alone; after three updates the base is bit-identical, every adapter and the head
    moved, and the critic's values are the merged full-weight value model's."""
    from jaxflow.workers import CriticConfig, CriticWorker

    config = CriticConfig(ppo_mini_batch_size=B, optim=OptimConfig(lr=3e-2, eps=1e-4), lora=LORA)
    graphdef = nnx.split(nnx.eval_shape(lambda: models.init_model(CFG, "value", seed=5)))[0]
    params = jax.jit(lambda: nnx.state(models.init_model(CFG, "value", seed=5)))()
    w = CriticWorker((graphdef, params), _mesh((2, 2, 2)), HYBRID_TRAIN_RULES, config)
    base0, state0 = jax.device_get(w.frozen), jax.device_get(w.state)
    rng = np.random.default_rng(0)
    for step in range(3):
        batch = Batch(_batch(step))
        values = rng.normal(size=(B, R)).astype(np.float32)
        w.update(batch | Batch({"values": values, "returns": values + rng.normal(size=(B, R)).astype(np.float32)}))
    for a, b in zip(jax.tree.leaves(base0), jax.tree.leaves(jax.device_get(w.frozen))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trained = dict(nnx.to_flat_state(w.state.params))
    heads = {path for path in trained if path[0] in ("score", "score_bias")}
    assert {path[0] for path in heads} == {"score", "score_bias"}
    assert len(trained) - len(heads) == 2 * len(LORA_TARGETS) * CFG.num_layers  # A and B of every projection
    before = dict(nnx.to_flat_state(state0.params))
    assert all(
        np.abs(np.asarray(trained[p].get_value()) - np.asarray(before[p].get_value())).max() > 0 for p in trained
    )
    floats = [x for x in jax.tree.leaves(w.state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert sum(x.size for x in floats) == 2 * sum(x.size for x in jax.tree.leaves(w.state.params))  # mu, nu
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(w.state.params) + floats)
    batch = Batch(_batch(7))
    merged = peft_io.merged_model(w.graphdef, jax.device_get(w.params))
    want = nnx.jit(lambda model, ids, mask: model(ids, mask))(  # compiled: an eager forward runs op by op
        merged,
        jnp.asarray(np.concatenate([batch["prompt_ids"], batch["responses"]], 1)),
        jnp.asarray(np.concatenate([batch["prompt_mask"], batch["response_mask"]], 1)),
    )
    got = np.asarray(w.values(batch)["values"])
    mask = batch["response_mask"] > 0
    assert np.abs(got[mask]).max() > 1e-3  # the trained head reads something
    np.testing.assert_allclose(got[mask], np.asarray(want)[:, P - 1 : -1][mask], rtol=1e-5, atol=1e-5)


def test_dry_run_plans_the_adapters_and_the_reference_on_the_actor():
    from jaxflow.plan.dry_run import compile_program, plan

    overrides = ["jaxflow.placement.type=colocated"]
    report, specs = plan(
        prepare_run(load_config("ppo_tiny", overrides + ["actor_rollout_ref.model.lora_rank=8"])).spec,
        ["actor/train_step", "ref/log_probs"],
    )
    full, _ = plan(prepare_run(load_config("ppo_tiny", overrides)).spec, [])
    actor, base = report.role("actor"), full.role("actor")
    assert [r.role for r in report.roles] == ["actor", "critic"]  # no reference role, no second copy
    m = actor.model  # rank r on every projection: r (in + out) parameters each
    per_layer = 2 * (m["hidden_size"] + m["num_heads"] * m["head_dim"])  # q, o
    per_layer += 2 * (m["hidden_size"] + m["num_kv_heads"] * m["head_dim"]) + 3 * (
        m["hidden_size"] + m["intermediate_size"]
    )
    n_adapters = 8 * m["num_layers"] * per_layer
    assert actor.num_params - base.num_params == n_adapters
    adapters = actor.param_bytes - base.param_bytes  # per device; float32 both: the base's bytes are the same
    assert 4 * n_adapters / 8 <= adapters < 4 * n_adapters  # sharded over at most the 8 devices
    assert actor.optimizer_bytes == 2 * adapters + 2 * 4  # two moments of the adapters, two int32 counts
    assert actor.gradient_bytes == adapters * (actor.gradient_bytes // adapters)
    assert report.pools[0].persistent_bytes < full.pools[0].persistent_bytes - base.param_bytes
    assert actor.generate_copy and not base.generate_copy  # the merged copy sits beside the base
    programs = {s.name: compile_program(report, s) for s in specs}
    assert programs["ref/log_probs"].role == "actor"
    train = programs["actor/train_step"]  # state (adapters, moments) + the frozen base + the batch
    assert train.argument_bytes == pytest.approx(train.analytic_argument_bytes, rel=0.03)
    assert train.alias_bytes == pytest.approx(adapters * 3 + 8, rel=0.05)  # only the train state is donated


def test_dry_run_plans_a_lora_critic():
    """``critic.model.lora_rank``: the plan's critic holds optimizer state for its adapters and
    value head only, and its compiled train step takes those (donated) and the frozen base as
    planned."""
    from jaxflow.plan.dry_run import compile_program, plan

    overrides = ["jaxflow.placement.type=colocated"]
    report, specs = plan(
        prepare_run(load_config("ppo_tiny", overrides + ["critic.model.lora_rank=8"])).spec, ["critic/train_step"]
    )
    full, _ = plan(prepare_run(load_config("ppo_tiny", overrides)).spec, [])
    critic, base = report.role("critic"), full.role("critic")
    m = critic.model
    per_layer = 2 * (m["hidden_size"] + m["num_heads"] * m["head_dim"])  # q, o
    per_layer += 2 * (m["hidden_size"] + m["num_kv_heads"] * m["head_dim"]) + 3 * (
        m["hidden_size"] + m["intermediate_size"]
    )
    n_adapters = 8 * m["num_layers"] * per_layer
    assert critic.num_params - base.num_params == n_adapters
    assert critic.optimizer_bytes < base.optimizer_bytes  # moments of the adapters and the head alone
    trained = (critic.optimizer_bytes - 2 * 4) // 2  # two moments, two int32 counts
    assert 4 * (n_adapters + m["hidden_size"] + 1) / 8 <= trained < 4 * (n_adapters + m["hidden_size"] + 1)
    train = compile_program(report, specs[0])
    assert train.argument_bytes == pytest.approx(train.analytic_argument_bytes, rel=0.03)
    assert train.alias_bytes == pytest.approx(trained * 3 + 8, rel=0.05)  # only the train state is donated
