"""What makes jaxflow fast on an accelerator, checked on CPU: the rollout loop's structure
(KV pages written in place, a bounded number of ops per layer, a scanned model's loop like an
unrolled one's, several decode steps per trip
of the loop giving the same samples), the generation copy in the compute dtype, the default
KV budget from device memory, ``auto`` dtypes per platform and role, and the LM head in chunks
of positions (== one chunk, values and gradients)."""

import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import jaxflow.workers.forward as forward
from jaxflow.configs.resolve import resolve_dtypes
from jaxflow.data.batch import Batch
from jaxflow.models import PRESETS, init_model
from jaxflow.sampling import EngineOptions, SamplingParams, engine_shape, generate, generate_from_state, lower_generate
from jaxflow.sampling.engine import memory_kv_tokens
from jaxflow.workers import ActorWorker, RolloutConfig
from tests.compile_events import CompileEvents

CFG = PRESETS["tiny_llama"]
ONE_LAYER = CFG.replace(num_layers=1)  # for claims that hold at any depth: layers compile separately
PARAMS = SamplingParams(max_new_tokens=24, n=2, temperature=1.0, eos_token_ids=(5, 9, 17), seed=1)


def _prompts(num=12, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 11, num)
    ids = np.zeros((num, 10), np.int32)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, 10 - n :] = rng.integers(20, CFG.vocab_size, n)
        mask[i, 10 - n :] = 1
    return ids, mask


@pytest.fixture(scope="module")
def model():
    return init_model(ONE_LAYER, "lm", seed=0)


# ---------------------------------------------------------------------- the decode loop's HLO

_TRIVIAL = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call"}


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, cur = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            cur = comps.setdefault(head.group(1), [])
        elif cur is not None and line.startswith("  ") and " = " in line:
            cur.append(line.strip())
    return comps


def _op(line: str) -> str:
    return re.search(r"= (?:\([^)]*\)|\S+) ([\w\-]+)\(", line).group(1)


def _kernel_ops(hlo: str) -> Counter:
    """Top-level ops (fused computations and reducers not counted) outside the trivial kinds:
    roughly what becomes a kernel."""
    comps = _computations(hlo)
    inner = {
        m.group(1)
        for lines in comps.values()
        for l in lines
        for m in re.finditer(r"(?:calls|to_apply)=%?([\w.\-]+)", l)
        if " while(" not in l and " conditional(" not in l
    }
    return Counter(
        _op(l) for name, lines in comps.items() if name not in inner for l in lines if _op(l) not in _TRIVIAL
    )


def _loop_computations(hlo: str) -> set[str]:
    """The bodies and conditions of every while loop, and what they call (transitively)."""
    comps = _computations(hlo)
    todo = [
        m.group(1)
        for lines in comps.values()
        for l in lines
        for m in re.finditer(r"(?:body|condition)=%?([\w.\-]+)", l)
    ]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += [
            m.group(1)
            for l in comps[name]
            for m in re.finditer(r"(?:calls|to_apply|body|condition|branch_computations=\{)%?([\w.\-]+)", l)
        ]
    return seen


@functools.cache
def _compiled_rollout(num_layers: int, scan_layers: bool = False) -> str:
    """The compiled rollout's HLO text for a tiny_llama of ``num_layers`` (compiled once per depth)."""
    cfg = CFG.replace(num_layers=num_layers, scan_layers=scan_layers)
    g, s = nnx.split(nnx.eval_shape(lambda: init_model(cfg, "lm")))
    ids, mask = _prompts()
    return lower_generate(g, s, ids, mask, PARAMS, options=EngineOptions(slots=8)).compile().as_text()


def test_pages_are_written_in_place():
    """Inside the rollout loop, no op makes a pool-sized array other than the scatters that
    write this step's keys/values (and the prompt tails) into the loop's own pool buffers: no
    copy of a pool, no select over a pool, nothing that would cost a pass over the whole pool
    per step."""
    hlo = _compiled_rollout(2)
    shape = engine_shape(CFG, 12, 10, PARAMS.max_new_tokens, n=2, slots=8)
    pool = f"f32[{CFG.num_kv_heads},{shape.pages},{shape.page_size},{CFG.head_dim}]"
    comps = _computations(hlo)
    pool_ops = Counter()
    for name in _loop_computations(hlo):
        for line in comps[name]:
            if re.search(rf"= {re.escape(pool)}\S* ", line):
                op = _op(line)
                pool_ops[
                    "scatter" if op == "scatter" or (op == "fusion" and "scatter" in line.split("=")[0]) else op
                ] += 1
    assert pool_ops["scatter"] >= 4 * CFG.num_layers  # k and v of every layer: decode + prompt tails (+ prefill)
    assert set(pool_ops) <= {"scatter", "parameter", "get-tuple-element", "bitcast"}, pool_ops


def test_scanned_model_decodes_like_an_unrolled_one():
    """A model with stacked (scanned) layers enters the rollout loop unstacked: the loop runs
    the same ops as an unrolled model's (no slice of a stacked weight and no stacked pool in
    any decode step; scanning there made the step 2.3x slower on an H200)."""

    def loop_ops(hlo):
        comps = _computations(hlo)
        return Counter(_op(line) for name in _loop_computations(hlo) for line in comps[name])

    assert loop_ops(_compiled_rollout(2, scan_layers=True)) == loop_ops(_compiled_rollout(2))


def test_ops_per_layer_are_bounded():
    """The top-level ops that one more decoder layer adds to the rollout program (its prefill
    and its decode step): a bound on the kernels of a step, which on GPU cost a launch each."""
    two, four = (sum(_kernel_ops(_compiled_rollout(n)).values()) for n in (2, 4))
    per_layer = (four - two) / 2
    assert per_layer <= 110, per_layer


# ---------------------------------------------------------------------- decode steps per trip


@pytest.mark.parametrize("steps_per_sync", [3])
def test_steps_per_sync_gives_the_same_samples(model, steps_per_sync):
    """Several decode steps per trip of the loop (no predicate read between them on GPU): the
    same tokens, log-probs and lengths as one step per trip, with prefill groups, slot refills
    (6 slots for 24 rows), early stops and a pool small enough that rows wait for pages."""
    ids, mask = _prompts()
    kw = dict(slots=6, page_size=4, kv_tokens=4 * 48)
    one = generate(model, ids, mask, PARAMS, options=EngineOptions(steps_per_sync=1, **kw))
    many = generate(model, ids, mask, PARAMS, options=EngineOptions(steps_per_sync=steps_per_sync, **kw))
    assert int(one.stats["waits"][0]) > 0 and len(set(np.asarray(one.lengths).tolist())) > 3
    assert many.stats["steps_per_sync"] == steps_per_sync
    for name in ("responses", "response_mask", "log_probs", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(many, name)), np.asarray(getattr(one, name)), err_msg=name)


# ---------------------------------------------------------------------- the generation copy


def test_generation_copy_in_compute_dtype():
    """float32 masters with bfloat16 compute: the actor generates from a bfloat16 copy (the
    same tokens and log-probs as a bfloat16 model), its masters stay float32 and untouched,
    and the rollout reports its parts."""
    cfg = ONE_LAYER.replace(dtype=jnp.bfloat16)
    model = init_model(cfg, "lm", seed=0)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2), ("fsdp",))
    params = RolloutConfig(train=PARAMS)
    actor = ActorWorker(model, mesh, "train", rollout=params)
    assert actor.generation_dtype() == jnp.bfloat16
    before = jax.device_get(actor.params)
    ids, mask = _prompts()
    out = actor.generate(Batch.from_dict({"prompt_ids": ids, "prompt_mask": mask}), step=3)
    graphdef, masters = nnx.split(model)
    low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), masters)
    rng = jax.random.fold_in(jax.random.key(PARAMS.seed), 3)
    want = generate_from_state(graphdef, low, ids, mask, PARAMS, mesh=actor.mesh, rules=actor.rules, rng=rng)
    np.testing.assert_array_equal(np.asarray(out["responses"]), np.asarray(want.responses))
    np.testing.assert_array_equal(np.asarray(out["rollout_log_probs"]), np.asarray(want.log_probs))
    after = jax.device_get(actor.params)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    parts = actor.generation_seconds()  # the worker's own (a group returns one per rank)
    assert set(parts) == {"reshard", "engine", "post"} and all(v >= 0 for v in parts.values())


# ---------------------------------------------------------------------- the KV budget


class _Device:
    def __init__(self, limit, used):
        self.stats = {"bytes_limit": limit, "bytes_in_use": used}

    def memory_stats(self):
        return self.stats


def test_kv_budget_from_device_memory():
    """On a device that reports its memory the default pool is the worst case when it fits in
    half the free memory, else the largest power of two pages that fits (if above the
    token-budget default); CPU devices report nothing and keep the default."""
    shape = engine_shape(CFG, 32, 64, 256, n=8, slots=256)
    page = shape.pool_bytes // shape.pages  # bytes per page, one device holding the whole pool
    worst = (shape.worst_case_pages - 1) * shape.page_size
    assert memory_kv_tokens(shape, 1, [_Device(10**12, 0)]) == worst
    fits = 3 * shape.pages  # room for 3x the default pool (within half the free memory)
    assert fits < shape.worst_case_pages
    tokens = memory_kv_tokens(shape, 1, [_Device(2 * fits * page + 10, 10), _Device(10**12, 0)])
    pages = 1 + tokens // shape.page_size
    assert pages & (pages - 1) == 0 and shape.pages < pages <= fits
    assert memory_kv_tokens(shape, 2, [_Device(fits * page, 0)]) == tokens  # kv heads over 2 devices: half per device
    assert memory_kv_tokens(shape, 1, [_Device(shape.pages * page, 0)]) is None  # less than the default
    assert memory_kv_tokens(shape, 1, jax.devices()[:1]) is None  # CPU


# ---------------------------------------------------------------------- auto dtypes


def test_reference_starts_from_the_actors_weights_in_its_own_dtype():
    """`as_role`: the reference of a run whose actor keeps float32 masters holds bfloat16 on an
    accelerator: the actor's values cast, under the reference's own graph (the one its programs
    were compiled ahead for); with the actor's dtype, the actor's own arrays (no copy)."""
    from jaxflow.configs.run_spec import ModelSpec
    from jaxflow.trainer.builders import as_role

    actor = nnx.split(init_model(ONE_LAYER, "lm", seed=0))
    bf16 = ONE_LAYER.replace(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    graphdef, params = as_role(actor, ModelSpec("ref", "lm", "", bf16, 0))
    assert nnx.merge(graphdef, params).cfg == bf16
    for want, got in zip(jax.tree.leaves(actor[1]), jax.tree.leaves(params), strict=True):
        assert got.dtype == jnp.bfloat16 and got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(jnp.bfloat16))
    assert as_role(actor, ModelSpec("ref", "lm", "", ONE_LAYER, 0)) is actor


def test_auto_dtypes_by_platform_and_role():
    assert resolve_dtypes("auto", "auto", "actor", "cpu") == ("float32", "float32")
    assert resolve_dtypes("auto", "auto", "ref", "cpu") == ("float32", "float32")
    for accelerator in ("gpu", "tpu"):
        for trained in ("actor", "critic"):
            assert resolve_dtypes("auto", "auto", trained, accelerator) == ("float32", "bfloat16")
        for frozen in ("ref", "reward", "cost"):
            assert resolve_dtypes("auto", "auto", frozen, accelerator) == ("bfloat16", "bfloat16")
    assert resolve_dtypes("float32", "float32", "ref", "gpu") == ("float32", "float32")  # explicit wins


# ---------------------------------------------------------------------- the LM head in chunks


def test_head_in_chunks_equals_one_chunk(model, monkeypatch):
    """Log-probs, entropies and their gradients through 4 chunks of positions == one chunk."""
    rng = np.random.default_rng(0)
    B, P, R = 4, 6, 16
    tensors = {
        "prompt_ids": rng.integers(4, CFG.vocab_size, (B, P)).astype(np.int32),
        "prompt_mask": np.ones((B, P), np.int32),
        "responses": rng.integers(4, CFG.vocab_size, (B, R)).astype(np.int32),
        "response_mask": (rng.random((B, R)) < 0.8).astype(np.int32),
    }
    w_lp, w_ent = rng.normal(size=(2, B, R)).astype(np.float32)
    graphdef, params = nnx.split(model)

    def objective(params):
        lp, ent = forward.log_probs_and_entropy(nnx.merge(graphdef, params), tensors, 0.7)
        return jnp.sum(lp * w_lp) + jnp.sum(ent * w_ent), (lp, ent)

    def run():
        return jax.jit(jax.value_and_grad(objective, has_aux=True))(params)

    (_, (lp1, ent1)), g1 = run()
    monkeypatch.setattr(forward, "LOGITS_CHUNK_BYTES", B * (R // 4) * CFG.vocab_size * 4)
    assert forward.position_chunks(B, R, CFG.vocab_size, forward.LOGITS_CHUNK_BYTES) == 4
    (_, (lp4, ent4)), g4 = run()
    np.testing.assert_allclose(np.asarray(lp4), np.asarray(lp1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent4), np.asarray(ent1), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- fused attention


def test_fused_attention_layout_and_mask():
    """The cuDNN path's layout and mask (through ``jax.nn.dot_product_attention``'s XLA
    implementation, which takes the same arguments) == jaxflow's attention on every real
    query: left padding, causality, grouped kv heads."""
    from jaxflow.models.decoder import dot_product_attention, fused_attention

    rng = np.random.default_rng(0)
    B, L, H, N, K = 3, 7, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, L, N, K)), jnp.float32) for _ in range(2))
    real = np.arange(L)[None, :] >= np.array([[0], [2], [5]])  # left padding of 0, 2, 5 tokens
    mask = jnp.asarray(np.tril(np.ones((L, L), bool))[None] & real[:, None, :])
    # each side one jitted program (eagerly, every op would compile on its own)
    want = jax.jit(
        lambda q, k, v, mask: dot_product_attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask)
    )(q, k, v, mask)
    got = jax.jit(lambda q, k, v, mask: fused_attention(q, k, v, mask, "xla"))(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.asarray(got)).all()


def test_cudnn_attention_where_it_applies():
    from jaxflow.configs.resolve import with_attention

    bf16 = CFG.replace(dtype=jnp.bfloat16)
    assert with_attention(bf16, "gpu").attention_impl == "cudnn"
    assert with_attention(bf16, "cpu").attention_impl == "xla"
    assert with_attention(bf16, "tpu").attention_impl == "xla"
    assert with_attention(CFG, "gpu").attention_impl == "xla"  # float32 compute
    with pytest.raises(ValueError, match="cudnn"):
        CFG.replace(attention_impl="cudnn")


# ---------------------------------------------------------------------- compiled ahead


# The CLI with the dtypes `auto` gives on an accelerator (float32 actor masters, bfloat16
# compute, a bfloat16 generation copy and a bfloat16 reference), on CPU.
AS_ACCELERATOR = """
import runpy, sys
import jaxflow.configs.resolve as resolve
auto = resolve.resolve_dtypes
resolve.resolve_dtypes = lambda param, compute, role, platform, frozen=False: auto(param, compute, role, "gpu", frozen)
runpy.run_module("jaxflow.run", run_name="__main__")
"""


@pytest.mark.slow
def test_programs_compiled_ahead_are_what_step_one_runs(tmp_path):
    """``jaxflow.trainer.compile_ahead=on`` through the CLI with an accelerator's dtypes, an HF
    checkpoint and an empty persistent cache: the step's programs compile concurrently before
    step 1 (the generation copy's cast among them, and no reshard program: one device), and
    step 1 runs those executables (`jaxflow.mesh.executables`): JAX lowers each of the step's
    programs once in the whole run and loads none back from the persistent cache. Without the
    hand-over step 1 lowered every program again and loaded it from the cache; with a
    float32 reference beside a plan for a bfloat16 one (the reference now reads the
    checkpoint in bfloat16), it compiled the reference again."""
    import os
    import subprocess
    import sys

    from jaxflow.models import save_pretrained

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    save_pretrained(init_model(PRESETS["tiny_qwen2"].replace(num_layers=1), "lm", seed=0), tmp_path / "hf")
    env = dict(
        os.environ,
        XLA_FLAGS="",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHONPATH=root,
        JAX_LOG_COMPILES="1",
    )
    cmd = [
        sys.executable,
        "-c",
        AS_ACCELERATOR,
        "--config=grpo_tiny",
        "--config.jaxflow.num_devices=1",
        f"--config.actor_rollout_ref.model.path={tmp_path / 'hf'}",
        "--config.jaxflow.sft.warm_start_steps=0",
        "--config.trainer.total_training_steps=1",
        "--config.trainer.val_before_train=False",
        "--config.trainer.test_freq=-1",
        "--config.data.train_batch_size=4",
        "--config.actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "--config.jaxflow.data.num_train_examples=16",
        "--config.jaxflow.data.num_val_examples=4",
        "--config.jaxflow.trainer.compile_ahead=on",
        f"--config.trainer.default_local_dir={tmp_path / 'run'}",
    ]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "actor float32 weights / bfloat16 compute (generation copy bfloat16); ref bfloat16 weights" in p.stdout
    ahead = re.search(r"compiled ahead: (\d+) programs in [^:]*: (.*)", p.stdout)
    assert ahead, p.stdout[-2000:]
    names = [part.rsplit(" ", 2)[0] for part in ahead.group(2).split(", ")]
    assert sorted(names) == ["actor/generate", "actor/reshard", "actor/train_step", "ref/log_probs"]
    lowered = re.findall(r"Compiling (jit\([\w<>]+\))", p.stderr)
    for program in ("jit(actor_train_step)", "jit(ref_log_prob)", "jit(_generate_program)", "jit(cast_weights)"):
        assert lowered.count(program) == 1, (program, lowered)
    assert not re.search(r"\(\d+ loaded from the persistent cache\)", p.stdout), p.stdout[-2000:]


def test_a_program_runs_the_executable_compiled_ahead_for_its_arguments():
    """`mesh.executables`: a program takes the pooled executable of its own name that accepts
    its arguments (compiled from another jit of the same function: nothing compiles at the
    call, the result is the jit's bit for bit, and the donated input is consumed as the jit
    would), keeps it, and calls its own jit for arguments the executable does not take (another
    shape). An executable of another program with the same arguments is never taken."""
    from jaxflow.mesh import executables

    def fn(x, y):
        return x @ y + 1.0

    def other_fn(x, y):  # the same arguments, another computation
        return x - y

    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.normal(size=(8, 8)), jnp.float32) for _ in range(2))
    want = np.asarray(jax.jit(fn)(x, y))  # the same program: equal bit for bit
    np.testing.assert_allclose(want, np.asarray(x, np.float64) @ np.asarray(y, np.float64) + 1.0, rtol=1e-5)
    executables.clear()
    ahead = [jax.jit(f, donate_argnums=0).lower(x, y) for f in (other_fn, fn)]
    executables.offer([(executables.lowered_name(low), low.compile()) for low in ahead])
    program = executables.ahead_of_time(jax.jit(fn, donate_argnums=0))
    x1, x2, x3, x_top = jnp.array(x), jnp.array(x), jnp.array(x), x[:4]  # donated copies; a smaller input
    want_top = np.asarray(jax.jit(fn)(x_top, y))
    try:
        with CompileEvents() as events:
            np.testing.assert_array_equal(np.asarray(program(x1, y)), want)
            np.testing.assert_array_equal(np.asarray(program(x2, y)), want)
        assert events.compiles == 0 and executables.pooled() == 1 and len(program.executables) == 1
        assert x1.is_deleted() and x2.is_deleted()  # donated, as to the jit
        np.testing.assert_array_equal(np.asarray(program(x_top, y)), want_top)  # its own jit
        assert len(program.executables) == 1
        other = executables.ahead_of_time(jax.jit(other_fn))
        np.testing.assert_array_equal(np.asarray(other(x3, y)), np.asarray(x) - np.asarray(y))
        assert len(other.executables) == 1 and executables.pooled() == 0  # its own, by name
        unnamed = executables.ahead_of_time(jax.jit(lambda x, y: x * y))  # an empty pool: its own jit
        np.testing.assert_array_equal(np.asarray(unnamed(x, y)), np.asarray(x) * np.asarray(y))
        assert unnamed.executables == []
    finally:
        executables.clear()
