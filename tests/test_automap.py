"""The auto-mapper: enumeration, layouts' divisibility and memory, simulator monotonicity, the
CLI's JSON, and the compile check."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import shlex

import jax
import numpy as np
import pytest
from flax import nnx

from jaxflow import configs
from jaxflow.automap import __main__ as cli
from jaxflow.automap.layouts import Layout, feasible_layouts, role_layout
from jaxflow.automap.profiles import PROFILES, get_profile
from jaxflow.automap.search import Mapper, allocations, bell, evaluate, pool_sizes, set_partitions
from jaxflow.automap.simulate import generate_time, infer_time, train_time
from jaxflow.automap.verify import compile_check
from jaxflow.automap.workload import workload_from_spec
from jaxflow.configs.overrides import get_value, with_values
from jaxflow.configs.prepare import prepare_run
from jaxflow.mesh import Placement, state_shardings
from jaxflow.models import init_model

A100 = PROFILES["a100-80g"]


def _cfg(name: str, **keys):
    cfg = configs.get_config(name)
    with cfg.unlocked():
        for k, v in keys.items():
            node = cfg
            *parents, leaf = k.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = v
    return cfg


def _spec(cfg):
    """The run as the auto-mapper plans it: described without a placement or prompts."""
    return prepare_run(cfg, with_placement=False, with_datasets=False).spec


def workload_from_config(cfg):
    return workload_from_spec(_spec(cfg))


def _resolved(cfg, log=None):
    """The config a run of ``cfg`` records once placed (`place_run`: placement auto resolved)."""
    from jaxflow.trainer.builders import place_run

    return place_run(prepare_run(cfg, with_datasets=False), cfg, log=log)[2]


def _qwen_cfg():
    """grpo_tiny on a Qwen2.5-0.5B-shaped actor (14 heads, 2 kv heads, hidden 896), 1 layer."""
    return _cfg(
        "grpo_tiny",
        **{
            "jaxflow.model.preset": "qwen2_5_0_5b",
            "jaxflow.model.vocab_size": 0,
            "jaxflow.model.hidden_size": 0,
            "jaxflow.model.intermediate_size": 0,
            "jaxflow.model.num_heads": 0,
            "jaxflow.model.num_kv_heads": 0,
            "jaxflow.model.num_layers": 1,
        },
    )


@pytest.mark.parametrize("k", range(1, 6))
def test_placements_are_the_set_partitions(k):
    roles = ("actor", "ref", "critic", "reward", "cost")[:k]
    parts = list(set_partitions(roles))
    assert len(parts) == bell(k) == [1, 2, 5, 15, 52][k - 1]
    canon = {tuple(sorted(tuple(sorted(s)) for s in p)) for p in parts}
    assert len(canon) == len(parts)  # all distinct
    for p in parts:
        assert sorted(r for s in p for r in s) == sorted(roles)


def test_allocations_sum_to_the_cluster_and_respect_minimums():
    sizes = pool_sizes(32, 8)
    assert sizes == [1, 2, 4, 8, 16, 24, 32]
    allocs = list(allocations(32, [8, 2], sizes))
    assert allocs and all(sum(a) == 32 and a[0] >= 8 and a[1] >= 2 for a in allocs)
    assert (24, 8) in allocs and (8, 24) in allocs and (30, 2) not in allocs  # 30 is no pool size


def test_layouts_divide_the_qwen_shapes_and_build_real_shardings():
    w = workload_from_config(_qwen_cfg())
    mc = w.models["actor"].config
    assert (mc.num_heads, mc.num_kv_heads, mc.hidden_size) == (14, 2, 896)
    layouts = feasible_layouts(w, "actor", 8, 8)
    assert layouts, "the non-dividing heads must still fit some layout (embed split over fsdp)"
    assert all(14 % rl.layout.tp == 0 for rl in layouts)  # tp never splits 14 heads unevenly
    assert any(rl.layout.fsdp * rl.layout.tp == 8 for rl in layouts)  # all 8 devices shard the weights
    _, state = nnx.split(nnx.eval_shape(lambda: init_model(mc, head="lm")))
    for rl in layouts:
        lay = rl.layout
        p = Placement.from_groups(
            [("g", 8, ("actor",))],
            jax.devices()[:8],
            meshes={"actor": f"dp={lay.dp},fsdp={lay.fsdp},tp={lay.tp}"},
            gen_tp={"actor": lay.gen_tp},
            models={"actor": mc},
        )
        shardings = state_shardings(state, p.rules("actor"), p.mesh("actor"))  # raises if anything does not divide
        # The analytic bytes per device equal the real shardings' largest shard.
        real = sum(
            int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
            for s, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(state))
        )
        assert rl.plan.param_bytes == real
        assert dict(p.mesh("actor", "generate").shape) == rl.meshes["generate"]
    # A tp that does not divide 14 heads is never proposed.
    with pytest.raises(ValueError):
        role_layout(w, "actor", Layout(1, 2, 4, 4))


def test_memory_feasibility_no_plan_fits_a_70b_on_8_devices():
    w = workload_from_config(configs.get_config("ppo_70b"))
    with pytest.raises(ValueError, match="no plan fits"):
        Mapper(w, 8, A100).search()
    w = workload_from_config(configs.get_config("ppo_13b"))
    plans = Mapper(w, 32, A100).search(top=3)
    for plan in plans:
        assert all(p.peak_bytes <= A100.budget_bytes for p in plan.pools)
        assert sum(p.devices for p in plan.pools) == 32
    # Each pool's peak is what its roles keep plus their largest transient.
    pool = plans[0].pools[0]
    kept = sum(rl.persistent_bytes for rl in pool.layouts.values())
    assert pool.peak_bytes == kept + max(rl.peak_transient_bytes for rl in pool.layouts.values())


def test_simulators_are_monotone():
    w = workload_from_config(configs.get_config("ppo_13b"))
    rl16 = role_layout(w, "critic", Layout(1, 16, 1))
    rl32 = role_layout(w, "critic", Layout(1, 32, 1))
    # More devices: less compute per device, less memory per device.
    assert train_time(w, rl32, A100).compute < train_time(w, rl16, A100).compute
    assert rl32.plan.param_bytes < rl16.plan.param_bytes
    # Faster devices / links never make a stage slower.
    fast = dataclasses.replace(
        A100, flops=2 * A100.flops, intra_bw=2 * A100.intra_bw, inter_bw=2 * A100.inter_bw, hbm_bw=2 * A100.hbm_bw
    )
    for fn in (train_time, infer_time):
        assert fn(w, rl16, fast).seconds < fn(w, rl16, A100).seconds
    actor = role_layout(w, "actor", Layout(1, 8, 2, 2))
    assert generate_time(w, actor, fast).seconds < generate_time(w, actor, A100).seconds
    # Longer responses: longer generation and training.
    longer = dataclasses.replace(w, response_len=2 * w.response_len)
    actor_l = role_layout(longer, "actor", Layout(1, 8, 2, 2))
    assert generate_time(longer, actor_l, A100).seconds > generate_time(w, actor, A100).seconds
    assert (
        train_time(longer, role_layout(longer, "critic", Layout(1, 16, 1)), A100).seconds
        > train_time(w, rl16, A100).seconds
    )
    # Crossing hosts costs more than staying inside one: fsdp=16 spans two hosts of 8.
    one_host = dataclasses.replace(A100, devices_per_host=16)
    assert train_time(w, rl16, one_host).comm < train_time(w, rl16, A100).comm


def test_search_is_no_worse_than_any_given_plan():
    w = workload_from_config(configs.get_config("ppo_7b"))
    best = Mapper(w, 16, A100).search(top=1)[0]
    hand = evaluate(
        w,
        A100,
        [
            (("actor", "ref"), 8, {"actor": Layout(1, 4, 2, 2), "ref": Layout(1, 8, 1)}),
            (("critic", "reward"), 8, {"critic": Layout(1, 4, 2), "reward": Layout(1, 8, 1)}),
        ],
    )
    assert hand.fits and best.iteration_s <= hand.iteration_s


def test_cli_json_schema():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["--config=ppo_7b", "--devices=16", "--device_kind=a100-80g", "--top=3", "--json"])
    assert rc == 0
    d = json.loads(out.getvalue())
    assert {"best", "candidates", "search_s"} <= set(d)
    assert len(d["candidates"]) == 3 and d["candidates"][0] == d["best"]
    for plan in d["candidates"]:
        assert isinstance(plan["predicted_iteration_s"], float) and plan["predicted_iteration_s"] > 0
        assert isinstance(plan["memory_gib"], float) and 0 < plan["memory_gib"] <= 80
        roles = [r for p in plan["pools"] for r in p["roles"]]
        assert sorted(roles) == ["actor", "critic", "ref", "reward"]
        assert sum(p["devices"] for p in plan["pools"]) == 16
        for p in plan["pools"]:
            assert set(p) >= {"roles", "devices", "meshes"}
            for role in p["roles"]:
                m = p["meshes"][role]
                main = m["train"] if role in ("actor", "critic") else m["infer"]
                assert math.prod(main.values()) == p["devices"]
                if role == "actor":
                    assert math.prod(m["generate"].values()) == p["devices"]
    # The overrides reproduce a config that validates.
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in d["best"]["overrides"].items()}
    cfg = with_values(configs.get_config("ppo_7b"), overrides)
    configs.validate(cfg)


def test_compile_check_rejects_a_plan_that_cannot_fit():
    cfg = _cfg("grpo_tiny")
    w = workload_from_config(cfg)
    plan = Mapper(w, 8, get_profile("cpu")).search(top=1)[0]
    ok = compile_check(_spec(cfg), plan, 8, get_profile("cpu"), programs=("ref/log_probs",))
    assert ok["fits"] and ok["rejected"] is None and ok["programs"][0]["compiled_peak_gib"] > 0
    tiny = dataclasses.replace(get_profile("cpu"), memory_gib=1e-6)
    bad = compile_check(_spec(cfg), plan, 8, tiny, programs=("ref/log_probs",))
    assert not bad["fits"]
    assert bad["rejected"].startswith("ref/log_probs needs") and "GiB per device" in bad["rejected"]


def test_embed_rules_keep_the_hybrid_engine_zero_redundancy():
    """6 heads on fsdp=4 x tp=2: the *_embed rules (heads over tp, embed over fsdp) are
    picked, and every device's training shard lies inside its generation shard (so the
    3D-HybridEngine needs no redundant copy; the Qwen run in the e2e test moves real weights)."""
    from jaxflow.mesh import HYBRID_TRAIN_RULES_EMBED, MeshSpec, hybrid_rules
    from jaxflow.models import PRESETS
    from jaxflow.reshard import HybridEngine
    from jaxflow.reshard.engine import containment_violations, redundant_bytes

    mc = PRESETS["tiny_llama"].replace(
        hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=8, intermediate_size=96, vocab_size=64
    )
    rules, _ = hybrid_rules(mc, 8, tp=2)
    assert rules == HYBRID_TRAIN_RULES_EMBED
    mesh = MeshSpec(fsdp=4, tp=2).build(jax.devices()[:8], model=mc, rules=rules)
    _, state = nnx.split(nnx.eval_shape(lambda: init_model(mc, head="lm")))
    engine = HybridEngine(mesh, rules, gen_tp=2)
    assert dict(engine.gen_mesh.shape) == {"replica": 4, "tp": 2, "dp": 1}
    leaves = jax.tree.leaves(state)
    train = jax.tree.leaves(engine.train_shardings(state))
    gen = jax.tree.leaves(engine.gen_shardings(state))
    assert not containment_violations(leaves, train, gen)
    assert redundant_bytes(leaves, train, gen) == 0
    q = next(s for s, x in zip(train, leaves) if x.shape[-3:] == (48, 6, 8))  # q_proj [(layers,) D, H, K]
    assert tuple(q.spec)[-3:-1] == ("fsdp", "tp")


# Qwen2.5-0.5B as published; Qwen3-0.6B's widths (hidden 1024, 16 heads, 8 kv heads, MLP 3072)
# on the qwen3_8b preset (qk-norm); both at 1 layer.
QWEN_SHAPES = {
    "qwen2_5_0_5b": dict(hidden_size=0, intermediate_size=0, num_heads=0, num_kv_heads=0),
    "qwen3_8b": dict(hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8),
}


@pytest.mark.parametrize("preset", sorted(QWEN_SHAPES))
def test_auto_placement_needs_no_mesh_keys(preset):
    """grpo_tiny on Qwen-shaped models (1 layer), placement auto: the config validates
    without any mesh, the auto-mapper's choice validates and builds real meshes and shardings
    on the 8 devices."""
    from jaxflow.configs import build_placement

    shape = {f"jaxflow.model.{k}": v for k, v in QWEN_SHAPES[preset].items()}
    cfg = _cfg(
        "grpo_tiny",
        **{
            "jaxflow.model.preset": preset,
            "jaxflow.model.vocab_size": 0,
            **shape,
            "jaxflow.model.num_layers": 1,
            "jaxflow.placement.device_kind": "cpu",
        },
    )
    assert cfg.jaxflow.placement.type == "auto"
    configs.validate(cfg)
    with pytest.raises(configs.ConfigError, match="resolved at start-up"):
        build_placement(cfg)
    lines = []
    resolved = _resolved(cfg, log=lines.append)
    assert resolved.jaxflow.placement.type in ("colocated", "custom") and "auto-mapper" in lines[0]
    placement = build_placement(resolved)  # validated inside place_run; real devices here
    mc = configs.model_config(resolved, "actor")
    _, state = nnx.split(nnx.eval_shape(lambda: init_model(mc, head="lm")))
    for role in ("actor", "ref"):
        state_shardings(state, placement.rules(role, "infer"), placement.mesh(role))
    state_shardings(state, placement.rules("actor", "generate"), placement.mesh("actor", "generate"))
    assert _resolved(resolved) is resolved  # a resolved config is left alone


# --- the cost model, by hand -------------------------------------------------------------------

# NCCL's ring protocols as its tuner models them (NVIDIA/nccl src/graph/tuning.cc): base
# latency, latency per ring step over NVLink / the network, fraction of the bus bandwidth.
NCCL = {
    "LL": (3.6e-6, 0.47e-6, 2.7e-6, 0.25),
    "LL128": (10.0e-6, 1.9e-6, 4.0e-6, 0.92),
    "Simple": (8.4e-6, 3.4e-6, 9.6e-6, 1.0),
}


def _ring(kind, k, hosts, nbytes, intra=235e9, inter=22e9):
    """A ring collective over k devices on `hosts` hosts (A100: NVLink 235 GB/s, IB 22 GB/s)."""
    rounds = 2 if kind == "all_reduce" else 1
    steps, net = rounds * (k - 1), rounds * (hosts - 1)
    bw = inter if hosts > 1 else intra
    return min(
        base + (steps - net) * hop + net * net_hop + steps / k * nbytes / (frac * bw)
        for base, hop, net_hop, frac in NCCL.values()
    )


def test_collectives_latency_and_bandwidth_by_hand():
    from jaxflow.automap.simulate import collective, hosts_spanned

    assert [hosts_spanned(4, 2, 8), hosts_spanned(4, 4, 8), hosts_spanned(2, 8, 8), hosts_spanned(8, 16, 8)] == [
        1,
        2,
        2,
        8,
    ]
    X = 32 * 8192 * 2  # one decode step's activations of 32 sequences, D=8192, bf16: 512 KiB
    # Inside a host the small message takes NCCL's LL protocol: ~26 us, not 2 (8-1) x 10 us x 2.
    ll = 3.6e-6 + 14 * 0.47e-6 + 14 / 8 * X / (0.25 * 235e9)
    assert collective(A100, "all_reduce", 8, 1, X) == pytest.approx(ll, rel=1e-12)
    assert ll < 30e-6
    # A large gather takes Simple's full bandwidth.
    big = 1 << 30
    assert collective(A100, "all_gather", 8, 1, big) == pytest.approx(8.4e-6 + 7 * 3.4e-6 + 7 / 8 * big / 235e9)
    # 4 devices strided 8 apart: one per host, every step crosses the network.
    for kind in ("all_gather", "all_reduce"):
        assert collective(A100, kind, 4, 8, X) == pytest.approx(_ring(kind, 4, 4, X), rel=1e-12)
        assert collective(A100, kind, 4, 2, X) == pytest.approx(_ring(kind, 4, 1, X), rel=1e-12)


def _body_params(mc):
    """A Llama decoder's parameters by hand: per layer q, k, v, o, gate/up/down and two norms."""
    D, F, H, N, K = mc.hidden_size, mc.intermediate_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
    return mc.num_layers * (D * H * K + 2 * D * N * K + H * K * D + 3 * D * F + 2 * D) + D


def test_forward_flops_are_causal_and_heads_score_responses_only():
    from jaxflow.automap.simulate import pass_flops
    from jaxflow.automap.workload import role_model
    from jaxflow.models import PRESETS

    mc = PRESETS["tiny_llama"]
    rm = role_model("actor", "lm", mc)
    assert rm.body_params == _body_params(mc)
    rows, T, R = 3, 10, 4
    attention = 4 * mc.num_layers * mc.num_heads * mc.head_dim * rows * T * (T + 1) / 2  # query i sees i+1 keys
    lm_head = 2 * mc.vocab_size * mc.hidden_size * rows * R
    expect = 2 * _body_params(mc) * rows * T + attention + lm_head
    assert pass_flops(rm, rows, T, rows * R, 1) == pytest.approx(expect)
    assert pass_flops(rm, rows, T, rows * R, 2) == pytest.approx(expect / 2)


def test_decode_reads_the_multiplied_weights_not_the_embedding_table():
    from jaxflow.automap.workload import role_model

    w = workload_from_config(configs.get_config("ppo_7b"))  # llama2_7b in bf16
    untied = w.models["actor"]  # embedding and LM head: two V x D tables
    VD = 32000 * 4096
    assert untied.num_params == _body_params(untied.config) + 2 * VD
    assert untied.matmul_weight_bytes == (untied.num_params - VD) * 2  # the embedding is only looked up
    value = w.models["critic"]
    assert value.matmul_weight_bytes == (_body_params(value.config) + 4096) * 2
    tied = role_model("actor", "lm", _qwen_cfg_model())  # one table, multiplied as the LM head
    assert tied.matmul_weight_bytes == tied.num_params * tied.param_itemsize


def _qwen_cfg_model():
    return configs.model_config(_qwen_cfg(), "actor")


def test_generation_time_by_hand_with_strided_tp_groups_across_hosts():
    """fsdp=4 x tp=4 (16 devices, weight degree 16) generating with tp=4: the hybrid grouping
    makes micro-DP groups of 4 consecutive devices and tp groups strided 4 apart, which span
    two hosts of 8: the decode all-reduces cross InfiniBand."""
    w = workload_from_config(configs.get_config("ppo_7b"))
    rl = role_layout(w, "actor", Layout(1, 4, 4, 4))
    assert rl.weight_degree == 16 and dict(rl.gen_mesh.shape) == {"tp": 4, "dp": 4}
    mc, rm, e = w.models["actor"].config, w.models["actor"], rl.engine
    L, D, K, c = mc.num_layers, mc.hidden_size, mc.head_dim, 2
    P, R = e.prompt_len, w.response_len
    chunks = math.ceil(e.prompts / e.prefill_rows) * math.ceil(P / e.prefill_len)
    waves = math.ceil(e.rows / e.slots)
    b = e.rows / waves
    comm = chunks * L * 2 * _ring(
        "all_reduce", 4, 2, e.prefill_rows * e.prefill_len * D * c
    ) + waves * R * L * 2 * _ring("all_reduce", 4, 2, b * D * c)
    t = generate_time(w, rl, A100)
    assert t.comm == pytest.approx(comm, rel=1e-9)
    # Decode is memory-bound here: per step the multiplied weights / 4 and the KV cache / 4 (32
    # kv heads split over tp=4), the activations and the f32 logits, at 80% of 2.039 TB/s.
    S = P + (R + 1) / 2
    act = 2 * c * b * L * (4 * D + (3 * mc.intermediate_size + 2 * 32 * K + 2 * 32 * K) / 4)
    step = rm.matmul_weight_bytes / 4 + b * S * L * 2 * 32 * K * c / 4 + act + b * mc.vocab_size * 4
    prefill = chunks * rm.matmul_weight_bytes / 4 + 2 * c * e.prompts * P * L * (
        4 * D + (3 * mc.intermediate_size + 4 * 32 * K) / 4
    )
    assert t.memory == pytest.approx((prefill + waves * R * step) / (0.8 * 2.039e12), rel=1e-9)
    # On hosts of 16 the same groups stay on NVLink: cheaper.
    assert generate_time(w, rl, dataclasses.replace(A100, devices_per_host=16)).comm < t.comm / 3


def test_reshard_gathers_inside_contiguous_micro_dp_groups():
    """fsdp=8 x tp=2 on 16 devices, generation tp=2: micro-DP groups are 8 consecutive devices,
    one host, so the transition is one NVLink all-gather of W/2 (not a ring over fsdp*tp=16,
    which would cross hosts)."""
    from jaxflow.automap.simulate import reshard_time

    w = workload_from_config(configs.get_config("ppo_7b"))
    rl = role_layout(w, "actor", Layout(1, 8, 2, 2))
    W = w.models["actor"].weight_bytes
    t = reshard_time(w, rl, A100)
    assert t.comm == pytest.approx(_ring("all_gather", 8, 1, W / 2), rel=1e-12)
    assert t.comm < _ring("all_gather", 16, 2, W / 2) / 5


def test_small_per_device_batches_run_below_peak_and_spreading_is_not_free():
    from jaxflow.automap.simulate import pass_flops

    w = workload_from_config(configs.get_config("ppo_7b"))
    rm = w.models["ref"]

    def achieved(rows, n):
        wl = dataclasses.replace(
            w, prompts=rows, prompt_len=16, response_len=16, forward_micro={**w.forward_micro, "ref": None}
        )
        rl = role_layout(wl, "ref", Layout(n, 1, 1))
        t = infer_time(wl, rl, A100)
        return pass_flops(rm, rows / n, 32, rows / n * 16, 1) / (t.seconds * A100.flops), t

    mfus = [achieved(rows, 8)[0] for rows in (8, 64, 512, 4096)]
    assert mfus == sorted(mfus) and mfus[0] < 0.3 * A100.mfu and 0.9 * A100.mfu < mfus[-1] <= A100.mfu
    # One row per device: the weights' reads, the kernels and the call dominate; 8x the
    # devices for 8x the rows leaves the time per call the same, it does not shrink 8x.
    _, t8 = achieved(8, 8)
    _, t64 = achieved(64, 64)
    assert t64.seconds == pytest.approx(t8.seconds)
    layers = w.models["ref"].config.num_layers
    assert t8.overhead == pytest.approx((layers * 16 + 4) * 2e-6 + 5e-4)  # kernels + one program call


# --- the search ---------------------------------------------------------------------------------


def test_schedule_by_hand_serial_and_concurrent():
    """actor+ref on one pool, critic+reward on another; the dataflow's stages with given
    times. One at a time (jaxflow's programs) the iteration is their sum; concurrently the
    critic's forwards overlap the actor's, and the two updates overlap each other."""
    from jaxflow.automap.search import PoolChoice, schedule
    from jaxflow.automap.simulate import StageTime
    from jaxflow.automap.workload import dataflow

    secs = {
        "actor/reshard": 1,
        "actor/generate": 10,
        "actor/log_probs": 2,
        "ref/log_probs": 3,
        "critic/values": 4,
        "reward/scores": 5,
        "actor/train": 6,
        "critic/train": 7,
    }
    w = dataclasses.replace(
        workload_from_config(configs.get_config("ppo_7b")), stages=dataflow(("actor", "ref", "critic", "reward"))
    )
    pools = [
        PoolChoice(roles, 8, {}, {s: StageTime(secs[s]) for s in secs if s.split("/")[0] in roles}, 0)
        for roles in (("actor", "ref"), ("critic", "reward"))
    ]
    serial, spans = schedule(w, pools, concurrent=False)
    assert serial == sum(secs.values()) == 38
    assert spans["critic/values"] == (16, 20) and spans["critic/train"] == (31, 38)
    # actor pool: reshard 0-1, generate 1-11, log_probs 11-13, ref 13-16; critic pool: values
    # 11-15 (after generation), reward 15-20; updates after every forward: actor 20-26, critic 20-27.
    overlapped, spans = schedule(w, pools, concurrent=True)
    assert overlapped == 27
    assert spans["critic/values"] == (11, 15) and spans["reward/scores"] == (15, 20)
    assert spans["ref/log_probs"] == (13, 16) and spans["actor/train"] == (20, 26)
    assert spans["critic/train"] == (20, 27)


def test_layout_search_is_exact_against_brute_force():
    """best_pool (Pareto fronts + branch and bound) finds the same summed time as trying
    every combination of every feasible layout, at every pool size."""
    import itertools

    w = workload_from_config(configs.get_config("ppo_13b"))
    prof = dataclasses.replace(A100, memory_gib=40)  # tight: many combinations do not fit
    mapper = Mapper(w, 32, prof)
    roles = ("actor", "ref", "critic")
    for n in (16, 32):
        opts = [mapper.role_options(r, n) for r in roles]
        fits = [
            sum(o.seconds for o in combo)
            for combo in itertools.product(*opts)
            if sum(o.kept for o in combo) + max(o.transient for o in combo) <= prof.budget_bytes
        ]
        pool = mapper.best_pool(roles, n)
        if not fits:
            assert pool is None
            continue
        assert pool is not None
        assert sum(t.seconds for t in pool.stage_times.values()) == pytest.approx(min(fits))
    assert any(mapper.best_pool(roles, n) for n in (16, 32))


def test_search_caches_layouts_and_pools():
    w = workload_from_config(configs.get_config("ppo_7b"))
    mapper = Mapper(w, 16, A100)
    first = mapper.search(top=3)
    simulated = mapper.layouts_simulated
    assert simulated > 0 and mapper.role_options("actor", 8) is mapper.role_options("actor", 8)
    assert mapper.best_pool(("actor", "ref"), 8) is mapper.best_pool(("actor", "ref"), 8)
    again = mapper.search(top=3)
    assert mapper.layouts_simulated == simulated  # every (role, n, layout) was simulated once
    assert [p.key() for p in again] == [p.key() for p in first]


def test_time_bound_covers_the_whole_search_and_is_reported(monkeypatch):
    """A fake clock that advances one second per reading: the limit counts every step of the
    search (layout enumeration, pool search, allocations). Half the full search's readings cut
    it short: flagged in the mapper, the JSON and the text."""
    import jaxflow.automap.search as search_mod

    w = workload_from_config(configs.get_config("ppo_7b"))

    class Clock:
        t = 0.0

        def perf_counter(self):
            self.t += 1.0
            return self.t

    clock = Clock()
    monkeypatch.setattr(search_mod, "time", clock)
    full = Mapper(w, 16, A100)
    full.search(top=1, time_limit_s=1e9)
    readings = clock.t
    assert not full.truncated and full.placements_done == full.placements_total == 15
    with pytest.raises(ValueError, match="within the search's time limit"):
        Mapper(w, 16, A100).search(time_limit_s=3)  # cut short while simulating the first layouts
    cut = Mapper(w, 16, A100)
    plans = cut.search(top=1, time_limit_s=readings * 0.6)
    assert cut.truncated and plans and cut.placements_done < cut.placements_total
    for args in (["--json"], []):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert (
                cli.main(
                    ["--config=ppo_7b", "--devices=16", "--device_kind=a100-80g", f"--time_limit_s={readings * 0.6}"]
                    + args
                )
                == 0
            )
        if args:
            d = json.loads(out.getvalue())
            assert d["truncated"] is True and d["search"]["placements_explored"] < 15
        else:
            assert "WARNING: search cut short" in out.getvalue()


def test_tp_stays_inside_a_host():
    """n=16 with 8 per host: no layout the search simulates (the chosen ones included) has tp or
    generation tp above 8; with hosts of 4, above 4."""
    w = workload_from_config(configs.get_config("ppo_7b"))
    for per_host in (8, 4):
        mapper = Mapper(w, 16, dataclasses.replace(A100, devices_per_host=per_host))
        plan = mapper.search(top=1)[0]
        layouts = [o.layout.layout for opts in mapper._role_cache.values() for o in opts]
        assert any(lay.tp == per_host for lay in layouts)
        assert all(lay.tp <= per_host and (lay.gen_tp or 1) <= per_host for lay in layouts)
        assert all(rl.layout.tp <= per_host for pc in plan.pools for rl in pc.layouts.values())


def test_nothing_fits_is_said_clearly():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["--config=ppo_70b", "--devices=16", "--device_kind=a100-80g"])
    assert rc == 2 and out.getvalue() == ""
    msg = err.getvalue()
    assert msg.startswith("error: no plan fits ppo_70b on 16 a100-80g devices (72.0 GiB usable each")
    assert "actor needs" in msg and "critic needs" in msg and "all colocated they need at least" in msg
    together = float(msg.split("all colocated they need at least ")[1].split(" GiB")[0])
    assert together > 72.0


def test_roles_of_different_sizes():
    """A 13B actor (and reference) with a 70B critic and reward model (``preset:`` paths): each
    role is planned with its own model, and the plan reproduces a valid config."""
    cfg = _cfg(
        "ppo_13b",
        **{
            "critic.model.path": "preset:llama2_70b",
            "reward_model.model.path": "preset:llama2_70b",
            "jaxflow.num_devices": 64,
        },
    )
    w = workload_from_config(cfg)
    sizes = {r: m.num_params for r, m in w.models.items()}
    assert sizes["actor"] == sizes["ref"] and 12e9 < sizes["actor"] < 14e9
    assert sizes["critic"] == sizes["reward"] + 1 and 68e9 < sizes["critic"] < 70e9  # the value head's bias
    plan = Mapper(w, 64, A100).search(top=1)[0]
    for pc in plan.pools:
        assert pc.peak_bytes <= A100.budget_bytes
        for role, rl in pc.layouts.items():
            assert rl.plan.num_params == sizes[role]
    resolved = with_values(cfg, plan.overrides(64))
    configs.validate(resolved)
    assert configs.model_config(resolved, "critic").num_layers == 80
    assert configs.model_config(resolved, "actor").num_layers == 40


def test_a_plan_the_estimate_passes_but_the_compiler_rejects_falls_back_to_the_next():
    """All-dp layouts keep a whole model per device; the analytic pool peak (parameters,
    optimizer state, gradients, the activation estimate) is below what XLA's buffer assignment
    holds for the compiled train step (by ~10% here). With the device memory 5% above the
    estimate, the plan passes the estimate and the compiler rejects it; choose_verified then
    takes the next plan (FSDP over all 8), which compiles and fits."""
    from jaxflow.automap.verify import choose_verified

    cfg = _cfg("grpo_tiny")
    w = workload_from_config(cfg)
    cpu = dataclasses.replace(PROFILES["cpu"], usable=1.0)
    dp = evaluate(w, cpu, [(("actor", "ref"), 8, {"actor": Layout(8, 1, 1, 1), "ref": Layout(8, 1, 1)})])
    fsdp = evaluate(w, cpu, [(("actor", "ref"), 8, {"actor": Layout(1, 8, 1, 1), "ref": Layout(1, 8, 1)})])
    limit = dataclasses.replace(cpu, memory_gib=1.05 * dp.pools[0].peak_bytes / 2**30)
    assert dp.pools[0].peak_bytes <= limit.budget_bytes  # the estimate passes
    lines = []
    chosen = choose_verified(
        _spec(cfg), [dp, fsdp], 8, limit, attempts=2, log=lines.append, programs=("actor/train_step",)
    )
    assert chosen is fsdp and fsdp.compiled["fits"]
    assert not dp.compiled["fits"] and dp.compiled["rejected"].startswith("actor/train_step needs")
    assert "compiled plan 1: REJECTED" in lines[0] and "compiled plan 2: fits" in lines[1]
    with pytest.raises(ValueError, match="none of the 1 best plans fits"):
        choose_verified(_spec(cfg), [dp], 8, limit, attempts=1, programs=("actor/train_step",))


def test_calibrate_fits_a_profile_the_mapper_uses(tmp_path):
    """calibrate on a 1-layer model at one shape, one repeat: it times the workers' builders,
    fits the profile (the fit at least as close to the measurements as its starting point),
    writes it, and the auto-mapper plans with the file."""
    from jaxflow.automap import calibrate
    from jaxflow.automap.profiles import load_profile, save_profile

    cfg = _cfg(
        "ppo_tiny",
        **{
            "jaxflow.model.num_layers": 1,
            "jaxflow.model.hidden_size": 32,
            "jaxflow.model.intermediate_size": 64,
            "jaxflow.model.num_heads": 4,
            "jaxflow.model.num_kv_heads": 2,
        },
    )
    lines = []
    m = calibrate.measure(_spec(cfg), 8, repeats=1, shapes=((16, 8, 8),), collective_bytes=(1 << 16,), log=lines.append)
    assert [s.phase for s in m["samples"]] == ["infer", "train", "generate"]
    assert [(k, x) for k, x, _ in m["collectives"]] == [(2, 1 << 16), (4, 1 << 16), (8, 1 << 16)]
    assert all(s.seconds > 0 for s in m["samples"]) and m["flops"] > 0 and m["hbm_bw"] > 0
    prof = calibrate.fit_profile(m, 8, "test", log=lines.append)
    assert prof.shared_host and 0 < prof.hbm_eff <= 1 and 0 < prof.mfu <= 1 and 0 < prof.decode_mfu <= 1

    def rms(p):
        pred = calibrate.predict(p, calibrate.cases(m["base"], m["samples"], 8))
        return float(np.sqrt(np.mean([math.log(a / s.seconds) ** 2 for a, s in zip(pred, m["samples"])])))

    start = dataclasses.replace(
        prof, mfu=0.5, decode_mfu=0.5, hbm_eff=1.0, kernel_overhead_s=20e-6, call_overhead_s=m["call_s"]
    )
    assert rms(prof) <= rms(start) + 1e-9
    path = str(tmp_path / "cpu.json")
    save_profile(prof, path)
    assert load_profile(path) == prof
    logged = []
    resolved = _resolved(_cfg("ppo_tiny", **{"jaxflow.placement.device_kind": path}), log=logged.append)
    assert resolved.jaxflow.placement.type in ("colocated", "custom") and "cpu profile" in logged[0]


def test_memory_scale_from_the_compiler_changes_the_plan():
    """When the compiled rollout program holds 3x its estimated working memory (KV cache and
    activations; the generation copy of the weights is counted exactly), the search plans
    with that (compile-in-the-loop): the actor's generation layout changes and every pool's
    peak, with the scaled transient, still fits."""
    from jaxflow.automap.search import transient_parts
    from jaxflow.automap.verify import memory_correction

    w = workload_from_config(configs.get_config("ppo_7b"))
    mapper = Mapper(w, 16, A100)
    first = mapper.search(top=1)[0]
    rl = first.pool_of("actor").layouts["actor"]
    p = rl.plan
    gen_work = p.kv_cache_bytes + p.activation_bytes["generate"]
    # the training weights are donated into the generation copy
    assert transient_parts(rl)["generate"] == (p.generate_param_bytes - p.param_bytes, gen_work)
    assert sum(transient_parts(rl)["generate"]) == p.transient_bytes()["generate"]
    row = {"role": "actor", "phase": "generate", "compiled_peak_bytes": p.generate_param_bytes + 3 * gen_work}
    assert memory_correction(first, row) == ("generate", pytest.approx(3.0))
    train = {
        "role": "actor",
        "phase": "train",
        "compiled_peak_bytes": rl.persistent_bytes + p.gradient_bytes + 2 * p.activation_bytes["train"],
    }
    assert memory_correction(first, train) == ("train", pytest.approx(2.0))
    simulated = mapper.layouts_simulated
    mapper.scale_memory("generate", 3.0)
    second = mapper.search(top=1)[0]
    assert mapper.layouts_simulated == simulated  # times are kept, only memory is re-judged
    rl2 = second.pool_of("actor").layouts["actor"]
    assert rl2.layout != rl.layout
    for pc in second.pools:
        kept = sum(x.persistent_bytes for x in pc.layouts.values())
        worst = max(mapper.transient_bytes(x) for x in pc.layouts.values())
        assert pc.peak_bytes == kept + worst <= A100.budget_bytes
    p2 = rl2.plan
    assert (
        mapper.transient_bytes(rl2)
        >= p2.generate_param_bytes - p2.param_bytes + 3 * (p2.kv_cache_bytes + p2.activation_bytes["generate"]) - 1
    )
    assert second.iteration_s >= first.iteration_s


def test_ray_pools_take_whole_hosts():
    """On the Ray backend every pool is whole hosts (one process per host per group): the
    auto-mapper allocates only those."""

    assert pool_sizes(8, 2, whole_hosts=True) == [2, 4, 6, 8] and pool_sizes(8, 2) == [1, 2, 4, 6, 8]
    assert pool_sizes(4, 8, whole_hosts=True) == [1, 2, 4]  # below one host: the whole cluster's divisors
    cfg = _cfg(
        "ppo_tiny",
        **{"jaxflow.backend": "ray", "jaxflow.ray.devices_per_host": 4, "jaxflow.placement.device_kind": "cpu"},
    )
    resolved = _resolved(cfg)
    sizes = resolved.jaxflow.placement.pool_sizes or (8,)
    assert all(s % 4 == 0 for s in sizes) and sum(sizes) == 8


def test_cli_flags_are_checked_and_named_and_json_goes_to_its_path(tmp_path):
    """Found by trying: ``--devices=0`` and ``--devices=8 --devices_per_host=3`` said "no plan
    fits ... 0.0 GiB"; ``--devices=eight`` gave int()'s message without the flag; ``--json=PATH``
    printed the JSON and wrote nothing; the printed overrides were a shell syntax error."""

    def run(*args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["--config=ppo_tiny", *args])
        return code, out.getvalue(), err.getvalue()

    for args, message in (
        (["--devices=0"], "error: --devices=0: must be >= 1\n"),
        (["--devices=eight"], "error: --devices=eight: expected an integer\n"),
        (
            ["--devices=8", "--devices_per_host=3"],
            "error: --devices=8 is not a whole number of hosts of 3 devices (--devices_per_host)\n",
        ),
        (["--devices=8", "--time_limit_s=soon"], "error: --time_limit_s=soon: expected a number\n"),
        (
            ["--devices=8", "--memory_scale=generate"],
            "error: --memory_scale: 'generate' is not PHASE:FACTOR (e.g. generate:3.2)\n",
        ),
        (["--devices=8", "--json="], "error: --json= needs a path (or --json alone: the JSON on stdout)\n"),
    ):
        assert run(*args) == (2, "", message), args

    path = tmp_path / "plan.json"
    code, out, err = run(
        "--devices=8", "--device_kind=a100-80g", "--top=2", "--config.jaxflow.placement.type=auto", f"--json={path}"
    )
    assert code == 0 and err == "" and out.startswith("auto-mapper: ppo_tiny on 8 x a100-80g"), err
    assert out.rstrip().endswith(f"wrote {path}")
    d = json.loads(path.read_text())
    assert len(d["candidates"]) == 2 and d["best"] == d["candidates"][0]
    # Each overrides line, pasted after `python -m jaxflow.run` in a shell, gives the plan's config.
    lines = [line.split("overrides: ", 1)[1] for line in out.splitlines() if "overrides: " in line]
    assert len(lines) == 2
    for line, plan in zip(lines, d["candidates"]):
        name, overrides, rest = configs.parse_cli_args(["--config=ppo_tiny", *shlex.split(line)])
        assert rest == []
        cfg = configs.get_config(name)
        configs.apply_overrides(cfg, overrides)
        configs.validate(cfg)
        for key, value in plan["overrides"].items():
            got = get_value(cfg, key)
            assert (list(got) if isinstance(got, (tuple, list)) else got) == value, (key, got, value)
