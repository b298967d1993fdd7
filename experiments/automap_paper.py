"""The auto-mapper on the paper's workloads (HybridFlow §8: PPO with actor, critic, reference
and reward model of one size; A100-80G, 8 per host) at 16, 32, 64, 96 and 128 devices.

For every case, in a fresh process each:

1. ``python -m jaxflow.automap ... --json --verify=6``: the search (one stage at a time, as
   jaxflow's RL programs run) and the compile check of its best plan, the plan's programs
   lowered through the dry run's builders and compiled ahead of time on that many simulated
   devices; when the compiler rejects it, down the ranking (at most 6 plans that compile
   something new);
2. the same search with ``--concurrent`` (stages on disjoint pools overlapping, HybridFlow's
   driver), not compiled, with the memory scales the compile check of 1. learned: what the
   model would choose for such a driver.

Prints per case the search time (measured, this machine) against the 60 s bound and whether
it was cut short, the chosen placement (pools, devices, every role's meshes), the predicted
iteration time and its largest stages (analytic), the analytic memory per device, the
compiled programs' largest per-device total (compile-time) and the verdict; a case where no
plan fits says why. Checks: search under 60 s and not cut short, and the chosen plan compiles
and fits (or the mapper says clearly that nothing fits).

    python experiments/automap_paper.py [--configs=ppo_7b,ppo_70b] [--devices=16,128] [--no_verify] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIGS = ("ppo_7b", "ppo_13b", "ppo_34b", "ppo_70b")
DEVICES = (16, 32, 64, 96, 128)
TIME_BOUND_S = 60.0


def run_case(
    config: str, devices: int, device_kind: str, verify: bool, concurrent: bool, memory_scale: dict | None = None
) -> dict:
    cmd = (
        [
            sys.executable,
            "-m",
            "jaxflow.automap",
            f"--config={config}",
            f"--devices={devices}",
            f"--device_kind={device_kind}",
            "--devices_per_host=8",
            "--top=3",
            "--json",
            f"--time_limit_s={TIME_BOUND_S:g}",
        ]
        + (["--verify=6"] if verify else [])
        + (["--concurrent"] if concurrent else [])
    )
    if memory_scale:
        cmd.append("--memory_scale=" + ",".join(f"{p}:{f}" for p, f in memory_scale.items()))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        return {
            "config": config,
            "devices": devices,
            "error": (errors or proc.stderr.strip().splitlines()[-1:])[-1],
            "wall_s": wall,
        }
    d = json.loads(proc.stdout)
    d["wall_s"] = wall
    return d


def plan_text(b: dict) -> str:
    def mesh(m: dict) -> str:
        return ",".join(f"{a}{n}" for a, n in m.items() if n > 1) or "1"

    return " | ".join(
        f"{'+'.join(p['roles'])}:{p['devices']} ("
        + ", ".join(f"{r} " + "/".join(mesh(m) for m in ms.values()) for r, ms in p["meshes"].items())
        + ")"
        for p in b["pools"]
    )


def summary(d: dict, other: dict | None) -> tuple[str, dict]:
    if "error" in d:
        nothing = "no plan fits" in d["error"]
        checks = {"nothing_fits_said_clearly": nothing}
        return f"{d['config']:<8} {d['devices']:>4}  {d['error']}", checks
    b = d["best"]
    stages = sorted(b["predicted_stage_s"].items(), key=lambda kv: -kv[1]["seconds"])[:3]
    lines = [
        f"{d['config']:<8} {d['devices']:>4}  search {d['search_s']:5.1f} s (measured; bound {TIME_BOUND_S:g} s"
        f"{', CUT SHORT' if d['truncated'] else ''}), {d['search']['allocations_evaluated']} allocations",
        f"{'':14}one stage at a time: {b['predicted_iteration_s']:7.1f} s/iter (analytic), mem "
        f"{b['memory_gib']:5.1f} GiB/device (analytic): {plan_text(b)}",
        f"{'':14}largest stages (s, analytic): " + ", ".join(f"{n} {s['seconds']:.1f}" for n, s in stages),
    ]
    checks = {"search_under_bound": d["search_s"] < TIME_BOUND_S and not d["truncated"]}
    if "compiled" in b:
        c = b["compiled"]
        checks["compiles_and_fits"] = bool(c["fits"])
        lines.append(
            f"{'':14}compiled on {d['devices']} simulated devices: {'fits' if c['fits'] else 'DOES NOT FIT'}, "
            f"largest program {c['compiled_max_total_gib']:.1f} GiB per device (compile-time) vs "
            f"{c['estimated_max_pool_gib']:.1f} GiB (analytic), compile wall {c['wall_s']:.0f} s"
        )
        if d["memory_scale"]:
            lines.append(
                f"{'':14}the compile check rejected better-looking plans and scaled the estimated working "
                "memory to what XLA allocated: " + ", ".join(f"{ph} x{f:.2f}" for ph, f in d["memory_scale"].items())
            )
    if other is not None and "best" in other:
        o = other["best"]
        lines.append(
            f"{'':14}stages overlapping (a concurrent driver): {o['predicted_iteration_s']:7.1f} s/iter: {plan_text(o)}"
        )
    return "\n".join(lines), checks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--devices", default=",".join(map(str, DEVICES)))
    p.add_argument("--device_kind", default="a100-80g")
    p.add_argument("--no_verify", action="store_true", help="search only, no compile check")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = []
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    say(f"load average at start: {os.getloadavg()[0]:.1f}")
    failed = []
    for config in args.configs.split(","):
        for n in map(int, args.devices.split(",")):
            d = run_case(config, n, args.device_kind, not args.no_verify, concurrent=False)
            other = (
                run_case(config, n, args.device_kind, False, concurrent=True, memory_scale=d.get("memory_scale"))
                if "error" not in d
                else None
            )
            text, checks = summary(d, other)
            d["checks"] = checks
            if other is not None:
                d["concurrent"] = other.get("best", other)
            results.append(d)
            say(text)
            say(f"{'':14}checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))
            failed += [f"{config}@{n}: {k}" for k, v in checks.items() if not v]
    if args.json:
        print(json.dumps(results, indent=2))
    say(f"load average at end: {os.getloadavg()[0]:.1f}; " + (f"FAILED: {failed}" if failed else "all checks passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
