"""Issue 23's benchmark of the trainer modes ``sync``, ``one_step_off`` and ``async``: the
auto-mapper's simulator part (ANALYTIC: a model, nothing measured).

Per (config, device count) and mode: the predicted steady-state iteration time, samples per
second and speedup over ``sync``, the chosen split (rollout / training devices, the rollout's
layout, the training pools; idle hosts if the model leaves some), the weight sync's bytes and
seconds, the pools' idle fractions, and every assumption the numbers rest on
(:mod:`jaxflow.automap.async_schedule`'s docstring gives the formulas).

Not here yet: the issue's CPU runs of the modes (8 simulated devices split 4 / 4, ppo_tiny-sized
models, wall time per consumed sample, idle fractions, held-out score) need ``trainer.mode``
in the trainer, which does not exist yet; a later change adds them to this script.

    python experiments/bench_async.py [--configs=ppo_7b,ppo_70b] [--devices=64,128]
        [--device_kind=a100-80g] [--mean_over_max=RHO | --sigma=1 --cap_over_median=4]
        [--max_staleness=1] [--concurrent] [--smoke] [--json]

``--smoke``: ppo_7b on 16 devices (two hosts: one split), a few seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxflow import configs
from jaxflow.automap.async_schedule import MODES, Assumptions, LongTail, ModePlan, predict
from jaxflow.automap.profiles import get_profile
from jaxflow.automap.workload import Workload, workload_from_spec
from jaxflow.configs.prepare import prepare_run


def workload(name: str) -> Workload:
    """The config's workload as the auto-mapper plans it (no placement, no data)."""
    return workload_from_spec(prepare_run(configs.get_config(name), with_placement=False, with_datasets=False).spec)


def case(name: str, devices: int, device_kind: str, a: Assumptions) -> dict:
    w = workload(name)
    prof = get_profile(device_kind)
    t0 = time.perf_counter()
    plans = predict(w, devices, prof, a)
    sync_s = plans["sync"].iteration_s
    return {
        "config": name,
        "devices": devices,
        "device_kind": prof.name,
        "rows_per_iteration": w.rows,
        "search_s_measured": time.perf_counter() - t0,
        "assumptions": a.lines(w),
        "modes": {mode: plans[mode].to_dict(w, sync_s) if mode in plans else None for mode in MODES},
        "text": [mode_line(mode, plans.get(mode), w, sync_s) for mode in MODES],
    }


def mode_line(mode: str, p: ModePlan | None, w: Workload, sync_s: float) -> str:
    if p is None:
        return f"  {mode:<13} no split fits"
    d = p.to_dict(w, sync_s)
    head = (
        f"  {mode:<13} {d['predicted_iteration_s']:8.1f} s/iter  {d['samples_per_s']:7.2f} samples/s  "
        f"x{d['speedup_over_sync']:.2f} vs sync  (generate {d['generate_s']:.1f} s, rest {d['rest_s']:.1f} s)"
    )
    pools = " | ".join(f"{'+'.join(q['roles'])}:{q['devices']}" for q in d["training_pools"])
    if p.rollout is None:
        return f"{head}\n{'':16}plan: {pools}"
    s = d["weight_sync"]
    idle = f", {d['idle_devices']} devices idle" if d["idle_devices"] else ""
    return (
        f"{head}\n{'':16}split: rollout {d['rollout_devices']} ({d['rollout_layout']}, "
        f"{d['rollout_memory_gib']:.1f} GiB/device) / training {d['training_devices']} ({pools}){idle}\n"
        f"{'':16}weight sync: {s['model_bytes'] / 1e9:.2f} GB model, {s['bytes_per_receiver'] / 1e9:.2f} GB per "
        f"rollout device, {s['total_bytes'] / 1e9:.1f} GB across from {s['senders']} senders: {s['seconds']:.2f} s; "
        f"idle: rollout {d['rollout_idle_fraction']:.0%}, trainer {d['trainer_idle_fraction']:.0%}"
    )


def assumptions_of(args: argparse.Namespace) -> Assumptions:
    tail = LongTail(args.sigma, args.cap_over_median, args.mean_over_max)
    return Assumptions(long_tail=tail, max_staleness=args.max_staleness, concurrent=args.concurrent)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="ppo_7b,ppo_70b")
    p.add_argument("--devices", default="64,128")
    p.add_argument("--device_kind", default="a100-80g")
    p.add_argument("--mean_over_max", type=float, default=None, help="rho = E[L] / R_max (overrides the lognormal)")
    p.add_argument("--sigma", type=float, default=1.0, help="the response lengths' lognormal sigma")
    p.add_argument("--cap_over_median", type=float, default=4.0, help="R_max over the lengths' median")
    p.add_argument("--max_staleness", type=int, default=1)
    p.add_argument("--concurrent", action="store_true", help="stages on disjoint pools overlap (HybridFlow's driver)")
    p.add_argument("--smoke", action="store_true", help="ppo_7b on 16 devices only")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.configs, args.devices = "ppo_7b", "16"
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    a = assumptions_of(args)
    results = []
    for name in args.configs.split(","):
        for n in map(int, args.devices.split(",")):
            d = case(name, n, args.device_kind, a)
            if not results:
                say("assumptions:\n" + "\n".join(f"  - {line}" for line in d["assumptions"]))
            say(f"{name} on {n} x {d['device_kind']} ({d['rows_per_iteration']} responses per iteration; ANALYTIC):")
            say("\n".join(d.pop("text")))
            results.append(d)
    if args.json:
        print(json.dumps({"analytic": True, "cases": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
