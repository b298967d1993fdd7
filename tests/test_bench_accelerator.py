"""`experiments/bench_accelerator.py --tiny` runs every phase it has on CPU (checkpoint,
transformers generate, the torch train step, GRPO through the CLI from a cold and a warm
compilation cache, the ceilings, the engine, the profile, the actor's train step) and reports
numbers that mean what they say."""

import json
import os
import subprocess
import sys

import pytest

from tests.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_accelerator_tiny(tmp_path):
    out, scratch = tmp_path / "bench.json", tmp_path / "tmp"
    scratch.mkdir()
    # conftest's fast compile, one device; the run's scratch directories in `scratch`
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, TMPDIR=str(scratch))
    p = subprocess.run(
        [sys.executable, "experiments/bench_accelerator.py", "--tiny", "--reps", "1", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(out.read_text())
    phases = ("checkpoint", "hf", "torch_train", "rl_cold", "rl_warm", "ceilings", "engine", "profile", "train")
    for name in phases:
        assert name in r and "error" not in r[name], (name, r.get(name))
    engine = r["engine"]["default"]
    assert engine["steps"] == engine["R"] and engine["tok_s"] > 0  # every row to R tokens, one step each
    assert r["engine"]["rl_rows"]["rows"] == r["sizes"]["rl"]["prompts"] * r["sizes"]["rl"]["n"]
    assert r["hf"]["tok_s"] > 0 and r["train"]["tflop_per_s"] > 0 and r["train"]["attention_impl"] == "xla"
    for run in ("rl_cold", "rl_warm"):
        steps = r[run]["steps"]
        assert r[run]["rc"] == 0 and len(steps) == r["sizes"]["rl"]["steps"]
        assert steps[0]["perf/time_to_first_step_s"] > 0
        parts = sum(steps[-1][f"timing_s/gen_{k}"] for k in ("reshard", "engine", "post"))
        assert 0 < parts <= steps[-1]["timing_s/gen"]  # the parts of gen, measured inside it
        assert r[run]["compile"].startswith("first step done")
    assert "bench_accelerator:" in p.stdout and "engine tok/s" in p.stdout
    # the RL runs' directories and their compilation cache are removed (the checkpoint, named
    # by its model, stays for the next run, as torch's inductor cache does)
    left = sorted(p.name for p in scratch.iterdir())
    assert os.path.basename(r["checkpoint"]["path"]) in left
    assert not [name for name in left if name.startswith(("jaxflow_rl_", "jaxflow_cache_"))], left
