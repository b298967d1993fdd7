"""The dry run: the plan and ahead-of-time compiled memory of every program of an RL step, on a
simulated mesh, without allocating a model or a batch."""

import io
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxflow.configs import active_roles, load_config
from jaxflow.configs.prepare import prepare_run
from jaxflow.mesh.devices import FakeDevice
from jaxflow.plan.dry_run import DEFAULT_PROGRAMS, OPTIONAL_PROGRAMS, dry_run

ALL_PROGRAMS = DEFAULT_PROGRAMS + OPTIONAL_PROGRAMS
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """ppo_tiny (actor, ref, critic colocated on the test's 8 devices), every program."""
    cfg = load_config("ppo_tiny", ["jaxflow.placement.type=colocated"])
    path = tmp_path_factory.mktemp("dry_run") / "plan.json"
    before = {id(a) for a in jax.live_arrays()}
    text = io.StringIO()
    report = dry_run(prepare_run(cfg).spec, out=text, json_path=str(path), programs=ALL_PROGRAMS)
    leaked = [a for a in jax.live_arrays() if id(a) not in before]
    return cfg, report, text.getvalue(), path, leaked


def test_plan_names_every_role_and_compiles_every_program(tiny):
    cfg, report, text, _, leaked = tiny
    roles = active_roles(cfg)
    assert [r.role for r in report.roles] == list(roles) == ["actor", "ref", "critic"]
    assert [p.roles for p in report.pools] == [["actor", "ref", "critic"]]
    for role in roles:
        assert f"\n  {role} " in text
    assert report.role("actor").meshes == {"train": {"dp": 1, "fsdp": 4, "tp": 2}, "generate": {"tp": 2, "dp": 4}}
    expected = [p for p in ALL_PROGRAMS if p.split("/")[0] in roles and p != "actor/generate_greedy"]  # ReMax's only
    assert sorted(p.name for p in report.programs) == sorted(expected)
    for p in report.programs:
        assert p.name in text
        assert p.argument_bytes > 0 and p.peak_bytes > 0, p
        assert (p.output_bytes if p.name == "actor/reshard" else p.temp_bytes) > 0, p
        assert p.total_bytes == p.peak_bytes + p.resident_bytes and p.fits
    assert report.fits and "everything fits" in text
    assert report.program("actor/train_step").mesh == {"dp": 1, "fsdp": 4, "tp": 2}
    assert report.program("actor/generate").mesh == {"tp": 2, "dp": 4}
    # Nothing was left allocated (no weights, optimizer state or batch were ever placed).
    assert sum(a.nbytes for a in leaked) == 0, [a.shape for a in leaked]


def test_compiled_argument_bytes_match_the_analytic_count(tiny):
    cfg, report, _, _, _ = tiny
    for p in report.programs:
        assert p.argument_bytes == pytest.approx(p.analytic_argument_bytes, rel=0.03), p.name
    # Parameters per device from XLA's argument sizes vs the parameter count.
    P, R = cfg.data.max_prompt_length, cfg.data.max_response_length
    rows = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    ref = report.role("ref")  # fsdp=8 over all 8 devices, float32
    batch = 2 * rows * (P + R) * 4 // 8
    assert report.program("ref/log_probs").argument_bytes - batch == pytest.approx(ref.num_params * 4 / 8, rel=0.03)
    assert ref.param_bytes == pytest.approx(ref.num_params * 4 / 8, rel=0.03)
    actor = report.role("actor")  # params + two float32 Adam moments, all split 8 ways (fsdp*tp)
    train = report.program("actor/train_step")
    assert train.argument_bytes - train.alias_bytes < 0.05 * train.argument_bytes  # the state is donated
    assert train.argument_bytes == pytest.approx(actor.num_params * 4 * 3 / 8, rel=0.03)
    # the optimizer state as created: two moments like the params, and two int32 counts (Adam's, the schedule's)
    assert actor.optimizer_bytes == 2 * actor.param_bytes + 2 * 4


def test_kv_cache_and_generation_layout(tiny):
    cfg, report, _, _, _ = tiny
    actor = report.role("actor")
    m, n = actor.model, cfg.actor_rollout_ref.rollout.n
    gen_tp, gen_dp = 2, 4
    prompts = cfg.data.train_batch_size // gen_dp  # per generation replica, one call
    slots = prompts * n  # max_num_seqs=0: a slot per row (at most DEFAULT_SLOTS)
    # the engine's page pool per replica (16-token pages; P=8 -> 16 and R=4 -> 16 slots: one
    # page each): trash + the prompts alive at once (at most slots + a prefill group of 8)
    # + per slot its response page and the private copy of its prompt's last page
    pages = 1 + min(prompts, slots + 8) * 1 + slots * (1 + 1)
    # pages x page size x layers x (k, v) x kv_heads / tp x head_dim x float32
    want = pages * 16 * m["num_layers"] * 2 * m["num_kv_heads"] // gen_tp * m["head_dim"] * 4
    assert actor.kv_cache_bytes == want
    assert actor.generate_param_bytes == pytest.approx(actor.num_params * 4 / gen_tp, rel=0.03)
    gen = report.program("actor/generate")
    assert gen.argument_bytes == pytest.approx(actor.generate_param_bytes, rel=0.03)
    assert gen.temp_bytes >= actor.kv_cache_bytes
    # While the actor generates, its training weights are donated into the generation copy
    # (HybridEngine.generation_swap, measured in test_zero_redundancy): only its optimizer
    # state and the other roles' state stay resident beside the program.
    assert gen.resident_bytes == actor.optimizer_bytes + sum(
        r.param_bytes + r.optimizer_bytes for r in report.roles if r.role != "actor"
    )
    assert actor.transient_bytes()["generate"] == (
        actor.generate_param_bytes - actor.param_bytes + actor.kv_cache_bytes + actor.activation_bytes["generate"]
    )


def test_json_report(tiny):
    _, report, _, path, _ = tiny
    data = json.loads(path.read_text())
    assert data == json.loads(report.to_json())
    assert data["config"] == "ppo_tiny" and data["num_devices"] == 8 and data["fits"] is True
    assert [p["name"] for p in data["programs"]] == [p.name for p in report.programs]
    assert {
        "argument_bytes",
        "output_bytes",
        "alias_bytes",
        "temp_bytes",
        "generated_code_bytes",
        "peak_bytes",
        "fits",
    } <= set(data["programs"][0])


def test_over_budget_is_reported():
    cfg = load_config("ppo_tiny", ["jaxflow.dry_run.device_memory_gib=0.001", "jaxflow.placement.type=colocated"])
    text = io.StringIO()
    report = dry_run(prepare_run(cfg).spec, out=text, programs=["ref/log_probs"])
    assert not report.fits and not report.program("ref/log_probs").fits
    assert not report.pools[0].fits
    assert "DOES NOT FIT: ref/log_probs, pool global" in text.getvalue()


def test_needs_the_configured_device_count():
    cfg = load_config("ppo_7b")  # 16 devices; this process has 8
    spec = prepare_run(cfg, devices=[FakeDevice(i) for i in range(16)], with_datasets=False).spec  # placed on stand-ins
    with pytest.raises(RuntimeError, match="xla_force_host_platform_device_count=16"):
        dry_run(spec, out=None)


def test_paper_config_in_a_subprocess(tmp_path):
    """ppo_7b on 16 simulated devices through the CLI: every program compiles, the host never
    holds a model (one llama2_7b in bf16 is 13 GB; four are planned)."""
    path = tmp_path / "ppo_7b.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxflow.run", "--config=ppo_7b", "--dry_run", f"--json={path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "ppo_7b on 16 cpu devices" in out and "placement split" in out
    assert "pool actor    devices 0-7" in out and "pool critic   devices 8-15" in out
    data = json.loads(path.read_text())
    assert [r["role"] for r in data["roles"]] == ["actor", "ref", "critic", "reward"]
    assert [p["name"] for p in data["programs"]] == [
        p for p in DEFAULT_PROGRAMS if not p.startswith("cost") and p != "actor/generate_greedy"
    ]  # ReMax's only
    for p in data["programs"]:
        assert p["name"] in out
        assert p["temp_bytes"] > 0 or p["name"] == "actor/reshard"
        assert p["argument_bytes"] == pytest.approx(p["analytic_argument_bytes"], rel=0.03), p["name"]
    actor = next(r for r in data["roles"] if r["role"] == "actor")
    assert actor["num_params"] > 6.5e9 and actor["model"]["num_layers"] == 32
    assert actor["param_bytes"] == pytest.approx(actor["num_params"] * 2 / 8, rel=0.03)  # bf16 over fsdp*tp = 8
    # per generation replica (1024 prompts / dp 4): 32 decode slots (max_num_seqs), 16-token pages;
    # the engine's default budget: trash + 40 prompts alive (32 slots + a prefill group of 8) x 1024/16
    # pages + 32 slots x (a quarter of the 1024-token response: 16 pages, + the private copy of the
    # prompt's last page), x 16 tokens x 32 layers x k,v x 32/2 heads x 128 x bf16
    assert actor["kv_cache_bytes"] == (1 + 40 * 64 + 32 * 17) * 16 * 32 * 2 * 16 * 128 * 2
    model_bytes = actor["num_params"] * jnp.dtype(jnp.bfloat16).itemsize
    assert data["max_rss_bytes"] < min(3 * 2**30, model_bytes / 4)
    assert math.isfinite(data["wall_seconds"])
