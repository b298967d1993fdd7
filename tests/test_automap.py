"""The auto-mapper: enumeration, layouts' divisibility and memory, simulator monotonicity, the
CLI's JSON, and the compile check."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math

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
from jaxflow.automap.verify import apply_plan, compile_check
from jaxflow.automap.workload import workload_from_config
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


def _qwen_cfg():
    """grpo_tiny on a Qwen2.5-0.5B-shaped actor (14 heads, 2 kv heads, hidden 896), 1 layer."""
    return _cfg("grpo_tiny", **{"jaxflow.model.preset": "qwen2_5_0_5b", "jaxflow.model.vocab_size": 0,
                                "jaxflow.model.hidden_size": 0, "jaxflow.model.intermediate_size": 0,
                                "jaxflow.model.num_heads": 0, "jaxflow.model.num_kv_heads": 0,
                                "jaxflow.model.num_layers": 1})


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
        p = Placement.from_groups([("g", 8, ("actor",))], jax.devices()[:8],
                                  meshes={"actor": f"dp={lay.dp},fsdp={lay.fsdp},tp={lay.tp}"},
                                  gen_tp={"actor": lay.gen_tp}, models={"actor": mc})
        shardings = state_shardings(state, p.rules("actor"), p.mesh("actor"))  # raises if anything does not divide
        # The analytic bytes per device equal the real shardings' largest shard.
        real = sum(int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
                   for s, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(state)))
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
    fast = dataclasses.replace(A100, flops=2 * A100.flops, intra_bw=2 * A100.intra_bw, inter_bw=2 * A100.inter_bw,
                               hbm_bw=2 * A100.hbm_bw)
    for fn in (train_time, infer_time):
        assert fn(w, rl16, fast).seconds < fn(w, rl16, A100).seconds
    actor = role_layout(w, "actor", Layout(1, 8, 2, 2))
    assert generate_time(w, actor, fast).seconds < generate_time(w, actor, A100).seconds
    # Longer responses: longer generation and training.
    longer = dataclasses.replace(w, response_len=2 * w.response_len)
    actor_l = role_layout(longer, "actor", Layout(1, 8, 2, 2))
    assert generate_time(longer, actor_l, A100).seconds > generate_time(w, actor, A100).seconds
    assert train_time(longer, role_layout(longer, "critic", Layout(1, 16, 1)), A100).seconds > \
        train_time(w, rl16, A100).seconds
    # Crossing hosts costs more than staying inside one: fsdp=16 spans two hosts of 8.
    one_host = dataclasses.replace(A100, devices_per_host=16)
    assert train_time(w, rl16, one_host).comm < train_time(w, rl16, A100).comm


def test_search_is_no_worse_than_any_given_plan():
    w = workload_from_config(configs.get_config("ppo_7b"))
    best = Mapper(w, 16, A100).search(top=1)[0]
    hand = evaluate(w, A100, [(("actor", "ref"), 8, {"actor": Layout(1, 4, 2, 2), "ref": Layout(1, 8, 1)}),
                              (("critic", "reward"), 8, {"critic": Layout(1, 4, 2), "reward": Layout(1, 8, 1)})])
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
    cfg = apply_plan(configs.get_config("ppo_7b"), _plan_from(d["best"]), 16)
    configs.validate(cfg)


def _plan_from(d):
    """A stand-in with the ``overrides`` method apply_plan reads."""

    class _P:
        def overrides(self, n):
            return {k: tuple(v) if isinstance(v, list) else v for k, v in d["overrides"].items()}

    return _P()


def test_compile_check_rejects_a_plan_that_cannot_fit():
    cfg = _cfg("grpo_tiny")
    w = workload_from_config(cfg)
    plan = Mapper(w, 8, get_profile("cpu")).search(top=1)[0]
    ok = compile_check(cfg, plan, 8, get_profile("cpu"), programs=("ref/log_probs",))
    assert ok["fits"] and ok["rejected"] is None and ok["programs"][0]["compiled_peak_gib"] > 0
    tiny = dataclasses.replace(get_profile("cpu"), memory_gib=1e-6)
    bad = compile_check(cfg, plan, 8, tiny, programs=("ref/log_probs",))
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

    mc = PRESETS["tiny_llama"].replace(hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=8, intermediate_size=96,
                                       vocab_size=64)
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
