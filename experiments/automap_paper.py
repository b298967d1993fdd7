"""The auto-mapper on the paper's workloads (HybridFlow §8: PPO with actor, critic, reference
and reward model of one size; A100-80G, 8 per host) at 16, 32, 64, 96 and 128 devices.

For every case it runs ``python -m jaxflow.automap ... --json`` (``--verify``: the chosen plan
compiled ahead of time on that many simulated devices) in a fresh process, and prints per
case: the search time (measured, this machine), the chosen placement (pools, devices, every
role's meshes), the predicted iteration time (analytic), the analytic memory per device and,
verified, the compiled programs' largest per-device total (compile-time) and the verdict.

    python experiments/automap_paper.py [--verify] [--configs=ppo_7b,ppo_70b] [--devices=16,128] [--json]
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


def run_case(config: str, devices: int, verify: bool, device_kind: str) -> dict:
    cmd = [sys.executable, "-m", "jaxflow.automap", f"--config={config}", f"--devices={devices}",
           f"--device_kind={device_kind}", "--devices_per_host=8", "--top=3", "--json"] + (["--verify"] if verify else [])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"config": config, "devices": devices, "error": proc.stderr.strip().splitlines()[-1:], "wall_s": wall}
    d = json.loads(proc.stdout)
    d["wall_s"] = wall
    return d


def summary(d: dict) -> str:
    if "error" in d:
        return f"{d['config']:<8} {d['devices']:>4}  error: {d['error']}"
    b = d["best"]
    pools = " | ".join(
        f"{'+'.join(p['roles'])}:{p['devices']} (" + ", ".join(
            f"{r} " + "/".join(",".join(f"{a[0]}{n}" for a, n in m.items() if n > 1) or "1" for m in ms.values())
            for r, ms in p["meshes"].items()) + ")" for p in b["pools"])
    line = (f"{d['config']:<8} {d['devices']:>4}  search {d['search_s']:5.1f} s  predicted "
            f"{b['predicted_iteration_s']:7.1f} s/iter  mem {b['memory_gib']:5.1f} GiB  {pools}")
    if "compiled" in b:
        c = b["compiled"]
        line += (f"\n{'':14}compiled: {'fits' if c['fits'] else 'DOES NOT FIT'}, largest program "
                 f"{c['compiled_max_total_gib']:.1f} GiB per device (compiled) vs {c['estimated_max_pool_gib']:.1f} "
                 f"GiB (analytic), compile wall {c['wall_s']:.0f} s")
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--devices", default=",".join(map(str, DEVICES)))
    p.add_argument("--device_kind", default="a100-80g")
    p.add_argument("--verify", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = []
    print(f"load average at start: {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    for config in args.configs.split(","):
        for n in map(int, args.devices.split(",")):
            d = run_case(config, n, args.verify, args.device_kind)
            results.append(d)
            print(summary(d), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    print(f"load average at end: {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
