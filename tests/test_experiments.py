"""Every script in experiments/ runs as documented, at its smallest setting (``--tiny`` or the
smallest documented flags), in a fresh process as a user runs it: the exit status is 0 and the
JSON it prints holds the parts it promises, consistent with the workload it was given.
(``bench_accelerator.py`` has its own test; ``ray_vs_local.py`` runs in tests/test_ray_backend.py,
whose Ray restart checks share its runs; ``colab_tpu.ipynb`` is tests/test_notebook.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_env import child_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TESTED_ELSEWHERE = {"bench_accelerator.py", "ray_vs_local.py"}


def run_script(script: str, *args: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), *args],
        cwd=ROOT,
        env=child_env(PYTHONPATH=str(ROOT), **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} {' '.join(args)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def run_json(script: str, *args: str, **env: str):
    return json.loads(run_script(script, *args, "--json", **env).stdout)


def test_automap_paper():
    (case,) = run_json("automap_paper.py", "--configs=ppo_7b", "--devices=16", "--no_verify")
    assert (case["config"], case["devices"]) == ("ppo_7b", 16)
    assert sum(pool["devices"] for pool in case["best"]["pools"]) == 16
    assert {r for pool in case["best"]["pools"] for r in pool["roles"]} == {"actor", "ref", "critic", "reward"}
    assert case["checks"] == {"search_under_bound": True}
    assert case["concurrent"]["predicted_iteration_s"] > 0


def test_bench_async():
    out = run_json("bench_async.py", "--smoke")
    (measured,) = out["measured"]  # async, max_staleness 2, 4 steps of a one-layer grpo_tiny
    assert (measured["mode"], measured["max_staleness"], measured["steps"]) == ("async", 2, 4)
    assert measured["max_token_staleness"] == 2.0 and measured["timed_steps"] == "2..2"
    assert measured["consumed_samples"] == 4 * 8 * 4 and 0.0 <= measured["held_out_score"] <= 1.0
    assert measured["wall_s_per_sample"] == measured["wall_s"] / 32 > 0
    assert 0 < measured["trainer_idle_fraction"] == measured["generate_s"] / measured["wall_s"] < 1
    assert measured["rollout_idle_fraction"] + measured["trainer_idle_fraction"] == pytest.approx(1.0, abs=1e-12)
    (case,) = out["cases"]  # ppo_7b on 16 devices: one split, 8 / 8
    assert (case["config"], case["devices"], case["device_kind"]) == ("ppo_7b", 16, "a100-80g")
    assert case["assumptions"][0].startswith("ANALYTIC") and any("rho = 0.351" in a for a in case["assumptions"])
    modes = case["modes"]
    assert list(modes) == ["sync", "one_step_off", "async"] and modes["sync"]["speedup_over_sync"] == 1.0
    for mode in ("one_step_off", "async"):
        m = modes[mode]
        assert (m["rollout_devices"], m["training_devices"]) == (8, 8)
        assert m["speedup_over_sync"] == modes["sync"]["predicted_iteration_s"] / m["predicted_iteration_s"]
        assert m["weight_sync"]["bytes_per_receiver"] > 0 and m["weight_sync"]["seconds"] > 0
    assert modes["async"]["predicted_iteration_s"] <= modes["one_step_off"]["predicted_iteration_s"]


def test_bench_async_split():
    """The issue's 4 (rollout) / 4 (train) split, smallest setting: async s=2, 4 steps of a one-layer
    ppo_tiny on the pool with long-tailed lengths (R_max 8); the trainer's idle fractions and syncs."""
    out = run_json("bench_async.py", "--smoke", "--split", "--no_analytic")
    (measured,) = out["measured"]
    assert (measured["mode"], measured["max_staleness"], measured["steps"]) == ("async", 2, 4)
    assert measured["max_token_staleness"] == 2.0 and out["cases"] == [] and not out["analytic"]
    assert 0 <= measured["trainer_idle_fraction"] <= 1 and 0 <= measured["rollout_idle_fraction"] <= 1
    assert measured["weight_syncs"] == 2 and measured["weight_sync_bytes"] > 0  # steps 1 and 2 generate
    assert 1 <= measured["response_length_mean"] < 8  # the long tail under the cap, to its drawn lengths


def test_automap_qwen():
    result = run_json("automap_qwen.py", "--tiny", "--models=qwen2_5_0_5b")
    run = result["qwen2_5_0_5b"]
    assert run["returncode"] == 0, run["tail"]
    assert run["mesh_keys_given"] == [] and len(run["auto_mapper"]) >= 1  # the mapper chose the layout
    assert len(run["steps"]) == 1 and run["steps"][0].lstrip().startswith("step 1 ")


def test_automap_validation(tmp_path):
    result = run_json("automap_validation.py", "--tiny", TMPDIR=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # the trainers' run directories are removed
    plans = [row["plan"] for row in result["rows"]]
    assert plans[0] == "colocated fsdp8" and result["chosen"] in plans and len(plans) <= 2
    for row in result["rows"]:
        assert len(row["measured_all_s"]) == 1 and row["predicted_s"] > 0  # one round of one iteration
        assert sum(pool["devices"] for pool in row["pools"]) == 8
    assert result["fastest_measured"] in plans


def test_bench_rl_step():
    result = run_json("bench_rl_step.py", "--tiny", "--rounds=1", "--steps=1", "--systems=jaxflow_ppo")
    ppo = result["jaxflow_ppo"]
    assert ppo["n_steps"] == 1
    assert {"gen", "values", "adv", "update_critic", "update_actor", "step"} <= set(ppo["phases"])
    assert ppo["train_gflop_analytic"] > 0 and ppo["train_step_device_s"] > 0
    longtail = run_json("bench_rl_step.py", "--tiny", "--longtail", "--rounds=1", "--steps=1")
    assert {"packed/both_s", "speedup_log_prob_plus_update"} <= set(longtail)
    assert longtail["workload"] == result["workload"]  # the same tiny sizes


def test_bench_lora_rollout():
    result = run_json("bench_lora_rollout.py", "--tiny")
    assert result["model"] == "tiny" and [r["variant"] for r in result["results"]] == ["merge", "adapter", "full"]
    by = {r["variant"]: r for r in result["results"]}
    assert all(r["engine_s"] > 0 and r["tokens_per_s"] > 0 for r in by.values())
    # Only merging makes a generation copy: the base's projections, float32, on one device.
    assert by["merge"]["generation_copy_bytes_per_device"] > 0 == by["adapter"]["generation_copy_bytes_per_device"]


def test_bench_rollout():
    # The old static engine needs a git worktree of commit 8a519cb: not created by a test.
    result = run_json("bench_rollout.py", "--tiny", "--engines=jaxflow,transformers")
    workload = result["workload"]
    assert (workload["prompts"], workload["max_new_tokens"]) == (4, 32)
    assert set(result["engines"]) == {"jaxflow", "transformers (1 threads)"}
    jaxflow = result["engines"]["jaxflow"]
    assert jaxflow["decode_step"][0]["steps"] == {"4": 4, "12": 12}  # --step_tokens 4,12
    kv = result["kv_memory"]  # the pool's peak in use fits in what it allocated
    assert 0 < kv["jaxflow_peak_in_use_bytes"] <= kv["jaxflow_allocated_bytes"] == jaxflow["stats"]["kv_pool_bytes"]


def test_bench_sampling():
    result = run_json("bench_sampling.py", "--tiny")
    assert result["workload"]["new_tokens"] == 8 and result["workload"]["layers"] == 1
    assert result["jaxflow"]["tokens_per_s"] > 0 and result["transformers"]["torch_threads"] == 1
    assert result["ratio"] == result["jaxflow"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    decode = run_json("bench_sampling.py", "--tiny", "--decode_step")
    assert decode["workload"]["short"] == 4 and decode["workload"]["long"] == 8
    for mode in ("greedy", "sample T=1"):
        assert len(decode[mode]["step_ms_rounds"]) == 1  # --rounds 1
        assert decode[mode]["profile"]["thread_s_per_step"]  # the profile found the rollout's ops


def test_profile_update():
    result = run_json("profile_update.py", "--tiny", "--layers=1", "--reps=1")
    assert result["workload"]["layers"] == 1 and result["packing"] == "off"
    categories = result["categories"]  # every op of the step in one category: the shares add up
    assert sum(c["seconds"] for c in categories) == pytest.approx(result["op_seconds_total"])
    assert sum(c["share"] for c in categories) == pytest.approx(1.0)
    assert {"mlp", "attention core", "lm head + log-softmax"} <= {c["category"] for c in categories if c["matmul"]}


def test_reshard_transition():
    rows = run_json("reshard_transition.py", "--tiny")
    assert [(r["layout"], r["gen_tp"]) for r in rows] == [("fsdp=8,tp=1", 2)] * 4
    by = {r["label"]: r for r in rows}
    assert set(by) == {"naive", "vanilla", "hybrid", "hybrid (1 program)"}
    # HybridFlow's claim, at any size: the hybrid transition receives and allocates no more than naive
    assert by["hybrid"]["ring_received_bytes"] <= by["naive"]["ring_received_bytes"]
    assert by["hybrid"]["peak_extra_bytes"] <= by["naive"]["peak_extra_bytes"]
    assert all(r["seconds"] > 0 and r["live_swap_bytes"] <= r["live_keep_bytes"] for r in rows if r["live_swap_bytes"])


def test_every_experiment_has_a_smoke_test():
    tested = {name.removeprefix("test_") + ".py" for name in globals() if name.startswith("test_")}
    scripts = {p.name for p in (ROOT / "experiments").glob("*.py")} - TESTED_ELSEWHERE
    assert scripts <= tested, f"no smoke test in {__file__} for {sorted(scripts - tested)}"
