"""The 3D-HybridEngine on 8 simulated devices: the train -> generate switch is bit-exact and
leaves the training weights alone, greedy generation in the generation layout equals the
unsharded model's, and the compiled transition's communication and memory meet HybridFlow's
Table 2 (measured from the HLO and XLA's buffer assignment, never from the formula)."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxflow.mesh import (
    GENERATE_RULES,
    HYBRID_GENERATE_RULES,
    HYBRID_GENERATE_RULES_KV_HEAD_DIM,
    HYBRID_TRAIN_RULES,
    HYBRID_TRAIN_RULES_KV_HEAD_DIM,
    TRAIN_RULES,
    MeshSpec,
    hybrid_rules,
    logical_axes_tree,
    logical_to_spec,
)
from jaxflow.models import ModelConfig, init_model
from jaxflow.reshard import HybridEngine, containment_violations, derive_generation_rules, hlo, table2
from jaxflow.sampling import SamplingParams, generate_from_state
from tests.child_env import child_env
from tests.compile_events import CompileEvents
from tests.host_states import random_state

CFG = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=8
)
GQA = CFG.replace(num_kv_heads=2)
LAYOUTS = [(8, 1), (4, 2), (2, 4)]  # (fsdp, tp) of the training mesh, as in the experiment


def abstract_state(cfg: ModelConfig):
    return nnx.split(nnx.eval_shape(lambda: init_model(cfg)))[1]


def engine_for(cfg, fsdp, tp, gen_tp, strategy="hybrid", dp=1):
    mesh = MeshSpec(dp=dp, fsdp=fsdp, tp=tp).build(jax.devices())
    train_rules, _ = hybrid_rules(cfg, fsdp * tp)
    return HybridEngine(mesh, train_rules, gen_tp, strategy)


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


# --- rules and errors -------------------------------------------------------------------


def test_generation_rules_follow_the_training_rules():
    mesh = MeshSpec(fsdp=4, tp=2).build(jax.devices())
    assert derive_generation_rules(HYBRID_TRAIN_RULES, mesh) == HYBRID_GENERATE_RULES
    assert derive_generation_rules(HYBRID_TRAIN_RULES_KV_HEAD_DIM, mesh) == HYBRID_GENERATE_RULES_KV_HEAD_DIM
    classic = dict(derive_generation_rules(TRAIN_RULES, mesh))
    assert {k: v for k, v in classic.items() if k != "batch"} == {k: v for k, v in GENERATE_RULES if k != "batch"}


def test_engine_errors():
    mesh = MeshSpec(fsdp=4, tp=2).build(jax.devices())
    with pytest.raises(ValueError, match="unknown strategy 'zero'"):
        HybridEngine(mesh, HYBRID_TRAIN_RULES, 2, strategy="zero")
    with pytest.raises(ValueError, match="generation tp=3 must divide"):
        HybridEngine(mesh, HYBRID_TRAIN_RULES, 3)
    with pytest.raises(ValueError, match="generation tp=4 must divide .*tp=2 = 2"):
        HybridEngine(mesh, TRAIN_RULES, 4)  # classic rules: only tp splits the heads
    with pytest.raises(ValueError, match="split 'heads' over none of the mesh axes"):
        HybridEngine(Mesh(np.array(jax.devices()), ("dp",)), TRAIN_RULES, 1)


def test_table2_formulas():
    M = 800.0
    assert table2("naive", M, 8, 2) == table2("vanilla", M, 8, 2)  # d = 1
    assert table2("naive", M, 4, 2, dp=2).comm_bytes == 700.0
    t = table2("hybrid", M, 8, 2)
    assert (t.comm_bytes, t.peak_bytes, t.redundancy_bytes) == (300.0, 400.0, 0.0)
    with pytest.raises(ValueError):
        table2("hybrid", M, 8, 3)


# --- acceptance 4: bit-exact round trip, training weights untouched ----------------------


@pytest.mark.parametrize(
    "cfg, fsdp, tp, gen_tp, strategy, dp",
    [
        (CFG, 4, 2, 2, "hybrid", 1),
        (GQA, 2, 4, 4, "hybrid", 1),
        (CFG, 2, 2, 2, "hybrid", 2),  # training dp=2: a 'replica' axis in generation
        (GQA, 4, 2, 2, "naive", 1),
    ],
)
def test_round_trip_is_bit_exact_and_training_weights_untouched(cfg, fsdp, tp, gen_tp, strategy, dp):
    engine = engine_for(cfg, fsdp, tp, gen_tp, strategy, dp)
    host = random_state(cfg, seed=fsdp * 10 + tp)
    train = jax.device_put(host, engine.train_shardings(host))
    train_sh = jax.tree.leaves(engine.train_shardings(host), is_leaf=lambda x: isinstance(x, NamedSharding))
    names = jax.tree.leaves(logical_axes_tree(host), is_leaf=lambda x: isinstance(x, tuple))

    gen = engine.to_generation(train)
    gen_leaves = jax.tree.leaves(gen)
    for axes, x, g in zip(names, jax.tree.leaves(host), gen_leaves):
        expected = NamedSharding(engine.gen_mesh, logical_to_spec(axes, engine.gen_rules, engine.gen_mesh))
        assert g.sharding.spec == expected.spec and g.sharding.mesh == engine.gen_mesh
        np.testing.assert_array_equal(bits(g), bits(x))  # host copy: every bit
        for shard in g.addressable_shards:  # each device holds its slice of the full array
            np.testing.assert_array_equal(bits(shard.data), bits(x[shard.index]))
    if strategy == "hybrid":  # every training shard lies inside its generation shard
        assert containment_violations(jax.tree.leaves(host), train_sh, [g.sharding for g in gen_leaves]) == []
    else:
        assert containment_violations(jax.tree.leaves(host), train_sh, [g.sharding for g in gen_leaves])

    back = engine.to_training(gen)
    for x, t, b, s in zip(jax.tree.leaves(host), jax.tree.leaves(train), jax.tree.leaves(back), train_sh):
        np.testing.assert_array_equal(bits(b), bits(x))
        assert b.sharding == s
        # The training weights: alive, same sharding, same bits.
        assert not t.is_deleted() and t.sharding == s
        np.testing.assert_array_equal(bits(t), bits(x))

    with engine.generation(train) as g2:
        assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(jax.tree.leaves(g2), gen_leaves))
    assert all(x.is_deleted() for x in jax.tree.leaves(g2))
    assert not any(t.is_deleted() for t in jax.tree.leaves(train))


def test_reverse_transition_is_local_under_hybrid():
    engine = engine_for(GQA, 2, 4, 2)
    report = engine.report(abstract_state(GQA), reverse=True)
    assert report.collectives == {} and report.ring_received_bytes == 0


# --- acceptance 4: greedy generation in the generation layout ----------------------------


def test_greedy_generation_in_generation_layout_equals_unsharded():
    # GQA with 2 kv heads on 8 devices: k/v (and the KV cache) split over head_dim.
    cfg, fsdp, tp, gen_tp = GQA, 2, 4, 2
    engine = engine_for(cfg, fsdp, tp, gen_tp)
    assert engine.gen_rules == HYBRID_GENERATE_RULES_KV_HEAD_DIM
    graphdef = nnx.split(nnx.eval_shape(lambda: init_model(cfg)))[0]
    host = random_state(cfg, seed=7)
    train = jax.device_put(host, engine.train_shardings(host))
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, (4, 6)).astype(np.int32)
    mask = np.ones_like(prompts)
    mask[1, :2] = mask[3, :3] = 0  # left padding
    params = SamplingParams(max_new_tokens=5, greedy=True, eos_token_ids=())

    ref = generate_from_state(graphdef, jax.tree.map(jax.numpy.asarray, host), prompts, mask, params)
    with engine.generation(train) as gen:
        out = generate_from_state(graphdef, gen, prompts, mask, params, mesh=engine.gen_mesh, rules=engine.gen_rules)
        np.testing.assert_array_equal(np.asarray(out.responses), np.asarray(ref.responses))
        np.testing.assert_allclose(np.asarray(out.log_probs), np.asarray(ref.log_probs), atol=1e-5)
    for x, t in zip(jax.tree.leaves(host), jax.tree.leaves(train)):  # untouched by generation
        assert not t.is_deleted()
        np.testing.assert_array_equal(bits(t), bits(x))


# --- acceptance 5: measured comm and memory vs Table 2 -----------------------------------


@pytest.mark.parametrize("fsdp, tp", LAYOUTS)
def test_hybrid_meets_table2_and_naive_does_not(fsdp, tp):
    state = abstract_state(GQA)
    for gen_tp in (1, 2, 4):
        hybrid = engine_for(GQA, fsdp, tp, gen_tp).report(state)
        naive = engine_for(GQA, fsdp, tp, gen_tp, "naive").report(state)
        want = hybrid.table2
        # Bytes received per device: within 5% of (tp - tgpg) / (tgpg tp) M.
        assert abs(hybrid.ring_received_bytes - want.comm_bytes) <= 0.05 * want.comm_bytes, (gen_tp, hybrid)
        # Peak extra memory: the generation copy and nothing else, i.e. M / tgpg.
        assert hybrid.peak_extra_bytes <= hybrid.gen_shard_bytes, (gen_tp, hybrid)
        assert hybrid.gen_shard_bytes == pytest.approx(want.peak_bytes, rel=0.01)  # + replicated norms
        # Only all-gathers, only inside micro-DP groups (consecutive devices), nothing whole.
        assert set(hybrid.collectives) == {"all-gather"}
        assert hybrid.gather_groups == sorted(engine_for(GQA, fsdp, tp, gen_tp).micro_dp_groups)
        assert all(g == list(range(g[0], g[0] + len(g))) for g in hybrid.gather_groups)
        assert not hybrid.full_remat and hybrid.whole_weights == []
        largest_leaf = max(
            int(np.prod(s.shard_shape(x.shape))) * 4
            for x, s in zip(
                jax.tree.leaves(state),
                jax.tree.leaves(
                    engine_for(GQA, fsdp, tp, gen_tp).gen_shardings(state),
                    is_leaf=lambda x: isinstance(x, NamedSharding),
                ),
            )
        )
        assert hybrid.largest_buffer_bytes <= largest_leaf
        # Naive, beside it: gathers the whole model on every device.
        assert naive.ring_received_bytes >= hybrid.ring_received_bytes
        assert naive.ring_received_bytes == pytest.approx(naive.table2.comm_bytes, rel=0.05)
        assert naive.peak_extra_bytes >= naive.model_bytes
        if gen_tp > 1:
            assert naive.whole_weights  # the gathered copies are visible in its HLO
        assert naive.peak_extra_bytes > hybrid.peak_extra_bytes
        if gen_tp > 1:
            assert naive.ring_received_bytes > 1.5 * hybrid.ring_received_bytes


def test_vanilla_grouping_gathers_within_the_training_group():
    report = engine_for(CFG, 2, 4, 2, "vanilla").report(abstract_state(CFG))
    assert report.gen_mesh == {"dp": 4, "tp": 2}
    assert report.ring_received_bytes == pytest.approx(report.table2.comm_bytes, rel=0.05)
    assert report.peak_extra_bytes >= report.model_bytes


def test_training_dp_separates_naive_from_vanilla():
    """dp=2 x fsdp=2 x tp=2 (t*p = 4, d = 2), generation tp 2: DeepSpeed-Chat (ZeRO-3 over all
    8 devices) gathers (tpd-1)/tpd M, HybridFlow-V (tp-1)/tp M within the training group,
    HybridFlow (tp-tg)/(tg tp) M within micro-DP groups; ring model of the compiled HLO."""
    state = abstract_state(CFG)
    reports = {s: engine_for(CFG, 2, 2, 2, s, dp=2).report(state) for s in ("naive", "vanilla", "hybrid")}
    M = reports["hybrid"].model_bytes
    for s, want in (("naive", 7 / 8), ("vanilla", 3 / 4), ("hybrid", 1 / 4)):
        r = reports[s]
        assert r.table2.comm_bytes == pytest.approx(want * M)
        assert r.ring_received_bytes == pytest.approx(r.table2.comm_bytes, rel=0.05), s
        assert r.collective_output_bytes >= r.ring_received_bytes
    assert reports["naive"].group_sizes == [8] and reports["vanilla"].group_sizes == [4]
    assert reports["hybrid"].group_sizes == [2] and reports["hybrid"].redundancy_bytes == 0
    assert reports["naive"].train_shard_bytes < reports["vanilla"].train_shard_bytes  # ZeRO-3: M / 8


# --- the measuring tools themselves ------------------------------------------------------


REMAT_PROGRAM = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxflow.reshard import hlo
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
s1, s2 = NamedSharding(mesh, P("y", None, "x")), NamedSharding(mesh, P(None, ("x", "y"), None))
f = lambda a, b, c: c + jax.lax.with_sharding_constraint(a + b, s2)
x = jax.ShapeDtypeStruct((16, 16, 16), np.float32)
with hlo.capture_stderr() as log:
    jax.jit(f, in_shardings=(s1, s1, s2), out_shardings=s2).lower(x, x, x).compile()
print(hlo.REMAT_MARKER in "".join(log))
"""


def test_full_rematerialisation_is_detected():
    """openxla/xla#15207: a reshard XLA can only do by replicating the whole tensor, and
    `hlo.capture_stderr` catches XLA's warning. In a fresh process without the persistent cache:
    XLA warns only while it compiles, and the warning's state is the process's (in a worker that
    compiled other programs first, or loaded this one from the cache, it did not show)."""
    import os
    import subprocess
    import sys

    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_ENABLE_COMPILATION_CACHE="false")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-c", REMAT_PROGRAM], env=dict(env, PYTHONPATH=root), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "True", run.stdout[-500:]


def test_hlo_collective_parsing():
    text = """HloModule m, num_partitions=8
ENTRY %main {
  %a = f32[4,8]{1,0} all-gather(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %b = (f32[2,16]{1,0}, bf16[4]{0}) all-gather(%p, %q), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  %c = f32[8]{0} all-reduce(%p), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add
  ROOT %d = f32[16]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}
}"""
    colls = hlo.parse_collectives(text)
    assert [c.op for c in colls] == ["all-gather", "all-gather", "all-reduce", "collective-permute"]
    assert colls[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and colls[0].out_bytes == 128
    assert colls[1].out_bytes == 136 and colls[1].group_size == 2
    assert colls[2].groups[0] == (0, 4)
    received = hlo.received_per_device(colls, 8)
    assert received[0] == 128 * 3 / 4 + 136 / 2 + 2 * 32 / 2 + 64
    assert received[2] == 128 * 3 / 4 + 136 / 2 + 2 * 32 / 2
    groups = hlo._parse_groups("replica_groups=mesh['a'=8,'b'=8,'c'=16] {'a':(2)4,'b':(2)4}", 1024)
    assert len(groups) == 64 and groups[0][:5] == [0, 16, 32, 48, 128]
    # The device order given separately: mesh of (4, 1, 2) over devices iota([2, 4]).T
    # = [0, 4, 1, 5, 2, 6, 3, 7]; groups along axis_0.
    groups = hlo._parse_groups(
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}", 8
    )
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_same_layouts_move_nothing_and_compile_nothing():
    """Training and generation layouts alike (one device): the transition is a copy of each
    weight under the generation sharding, no program to compile (none compiled ahead either),
    bit for bit, the input freed only when donated."""
    mesh = MeshSpec(dp=1, fsdp=1, tp=1).build(jax.devices()[:1])
    engine = HybridEngine(mesh, hybrid_rules(CFG, 1)[0], 1)
    host = random_state(CFG, seed=3)
    train = jax.device_put(host, engine.train_shardings(host))
    assert engine.lowered(abstract_state(CFG)) == []
    with CompileEvents() as events:
        gen = engine.to_generation(train)
        back = engine.to_training(gen, donate=True)
    assert events.compiles == 0
    for x, g, t, b in zip(*(jax.tree.leaves(s) for s in (host, gen, train, back))):
        assert g.sharding.mesh == engine.gen_mesh and b.sharding.mesh == engine.train_mesh
        assert g.is_deleted() and not t.is_deleted()
        np.testing.assert_array_equal(bits(b), bits(x))
        np.testing.assert_array_equal(bits(t), bits(x))
