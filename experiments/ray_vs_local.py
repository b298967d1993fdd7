"""The Ray backend against the local backend through the CLI: same config, same seed, same
8-device meshes (local: 8 simulated devices in one process; Ray: hosts x devices_per_host
processes). Prints, per backend, the measured wall time per step (median and best over the
steps after the first, which compiles) and the largest relative difference of every metric
over the first steps.

    python experiments/ray_vs_local.py --config=ppo_tiny --steps=5 --placement=colocated
    python experiments/ray_vs_local.py --config=grpo_tiny --steps=5 --placement=split --json=out.json

Metrics are compared with ``|a - b| <= rtol * |a| + atol`` (rtol 1e-5; atol 1e-7 for values
that are differences of nearly equal numbers, e.g. a KL near 0); timing metrics are excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_PREFIXES = ("timing_s/", "perf/throughput", "perf/time")


def run(backend: str, args: argparse.Namespace, out_dir: str) -> tuple[list[dict], float]:
    overrides = [
        f"--config.jaxflow.backend={backend}", f"--config.trainer.total_training_steps={args.steps}",
        "--config.trainer.test_freq=-1", "--config.trainer.val_before_train=false",
        f"--config.trainer.default_local_dir={out_dir}", f"--config.jaxflow.placement.type={args.placement}",
        f"--config.jaxflow.ray.devices_per_host={args.devices_per_host}", *args.overrides,
    ]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jaxflow.run", f"--config={args.config}", *overrides], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{backend} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "step" in r and r.get("timing_s/step") is not None], wall


def compare(local: list[dict], ray: list[dict], rtol: float, atol: float) -> tuple[list, list[str]]:
    """``(largest relative differences as (rel, step, key, local, ray), mismatches)``."""
    diffs, bad = [], []
    for a, b in zip(local, ray):
        for k, va in a.items():
            if k.startswith(SKIP_PREFIXES) or not isinstance(va, (int, float)) or k not in b:
                continue
            vb = b[k]
            err = abs(va - vb)
            rel = err / max(abs(va), 1e-30)
            if err > rtol * abs(va) + atol:
                bad.append(f"step {a['step']} {k}: local {va!r} ray {vb!r} (rel {rel:.2e})")
            diffs.append((rel, a["step"], k, va, vb))
    return sorted(diffs, reverse=True), bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ppo_tiny")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--placement", default="colocated")
    p.add_argument("--devices_per_host", type=int, default=2)
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-7)
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="run directories go here (default: a new temporary directory)")
    p.add_argument("overrides", nargs="*", help="more --config.KEY=VALUE overrides for both runs")
    args = p.parse_args()
    load = os.getloadavg()[0]
    tmp = args.out or tempfile.mkdtemp(prefix="ray_vs_local_")
    results = {b: run(b, args, os.path.join(tmp, b)) for b in ("local", "ray")}
    local, ray = results["local"][0], results["ray"][0]
    diffs, bad = compare(local, ray, args.rtol, args.atol)
    report = {"config": args.config, "placement": args.placement, "steps": args.steps, "run_dirs": tmp,
              "load_avg_1min_at_start": load, "values_compared": len(diffs), "largest_rel_diffs": diffs[:5],
              "mismatches": bad}
    print(f"{args.config} ({args.placement}), {args.steps} steps, 1-min load average {load:.1f} at start (2 cores)")
    print(f"{'backend':8} {'step 1 s':>9} {'median s/step (2..)':>20} {'best s/step (2..)':>18} {'process wall s':>15}")
    for name, (rows, wall) in results.items():
        times = [r["timing_s/step"] for r in rows]
        rest = times[1:] or times
        report[name] = {"step_s": times, "median_step_s_after_first": float(np.median(rest)),
                        "best_step_s_after_first": float(np.min(rest)), "process_wall_s": wall}
        print(f"{name:8} {times[0]:9.2f} {np.median(rest):20.3f} {np.min(rest):18.3f} {wall:15.1f}")
    ratio = report["ray"]["median_step_s_after_first"] / report["local"]["median_step_s_after_first"]
    report["ray_over_local_median"] = ratio
    print(f"measured Ray/local time per step (median, steps 2..{args.steps}): {ratio:.1f}x")
    print(f"{len(diffs)} metric values over {len(local)} steps; mismatches (|a-b| > rtol|a| + atol, rtol "
          f"{args.rtol:g}, atol {args.atol:g}): {len(bad)}; largest relative differences:")
    for rel, step, key, va, vb in diffs[:5]:
        print(f"  step {step} {key}: local {va:.9g} ray {vb:.9g} (rel {rel:.2e}, abs {abs(va - vb):.2e})")
    for line in bad:
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
