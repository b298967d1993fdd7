"""The auto-mapper's predictions against the real runner: a tiny PPO config on 8 simulated CPU
devices, run under at least 8 distinct plans (placements and layouts), each timed per
iteration with the real RL trainer (measured) and predicted by the calibrated ``cpu``
profile (analytic). Prints the table, Spearman's rank correlation between predicted and
measured, and how far the mapper's own choice is from the fastest measured plan.

Plans are timed in rounds (every plan runs ``--iters`` iterations per round, plans
alternating), after one warm-up iteration that compiles; a plan's time is the median over
all its timed iterations. The machine's load average is printed with the results.

    python -m jaxflow.automap.calibrate                     # fit the cpu profile first
    python experiments/automap_validation.py [--rounds=3] [--iters=2] [--json]
    python experiments/automap_validation.py --tiny     # a smoke test: --plans=1 --rounds=1 --iters=1, one layer

``--plans=K`` times only the first K of the hand-written plans (plus the mapper's choice when
it is not among them); acceptance 1 needs all of them (at least 8 distinct plans).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_cpu_collective_call_warn_stuck_timeout_seconds=120"
    " --xla_cpu_collective_call_terminate_timeout_seconds=900"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxflow import configs  # noqa: E402
from jaxflow.automap.auto import describe  # noqa: E402
from jaxflow.automap.layouts import Layout  # noqa: E402
from jaxflow.automap.profiles import get_profile  # noqa: E402
from jaxflow.automap.search import Mapper, evaluate  # noqa: E402
from jaxflow.automap.workload import workload_from_spec  # noqa: E402
from jaxflow.configs.overrides import with_values  # noqa: E402
from jaxflow.configs.prepare import prepare_run  # noqa: E402

L = Layout
# name -> pools as (roles, devices, {role: Layout(dp, fsdp, tp[, gen_tp])}), in device order.
PLANS = {
    "colocated fsdp8": [
        (("actor", "ref", "critic"), 8, {"actor": L(1, 8, 1, 1), "ref": L(1, 8, 1), "critic": L(1, 8, 1)})
    ],
    "colocated fsdp4xtp2": [
        (("actor", "ref", "critic"), 8, {"actor": L(1, 4, 2, 2), "ref": L(1, 4, 2), "critic": L(1, 4, 2)})
    ],
    "colocated actor tp8, others fsdp2xtp4": [
        (("actor", "ref", "critic"), 8, {"actor": L(1, 1, 8, 8), "ref": L(1, 2, 4), "critic": L(1, 2, 4)})
    ],
    "colocated dp8": [
        (("actor", "ref", "critic"), 8, {"actor": L(8, 1, 1, 1), "ref": L(8, 1, 1), "critic": L(8, 1, 1)})
    ],
    "colocated fsdp8 gen_tp8": [
        (("actor", "ref", "critic"), 8, {"actor": L(1, 8, 1, 8), "ref": L(1, 8, 1), "critic": L(1, 8, 1)})
    ],
    "split actor+ref 4 / critic 4": [
        (("actor", "ref"), 4, {"actor": L(1, 4, 1, 1), "ref": L(1, 4, 1)}),
        (("critic",), 4, {"critic": L(1, 4, 1)}),
    ],
    "split actor+ref 4 / critic 4, tp2": [
        (("actor", "ref"), 4, {"actor": L(1, 2, 2, 2), "ref": L(1, 2, 2)}),
        (("critic",), 4, {"critic": L(1, 2, 2)}),
    ],
    "split actor 4 / ref+critic 4": [
        (("actor",), 4, {"actor": L(1, 4, 1, 1)}),
        (("ref", "critic"), 4, {"ref": L(4, 1, 1), "critic": L(2, 2, 1)}),
    ],
    "standalone actor 4 / ref 2 / critic 2": [
        (("actor",), 4, {"actor": L(1, 4, 1, 1)}),
        (("ref",), 2, {"ref": L(2, 1, 1)}),
        (("critic",), 2, {"critic": L(1, 2, 1)}),
    ],
    "split actor+critic 4 / ref 4, tp4": [
        (("actor", "critic"), 4, {"actor": L(1, 1, 4, 4), "critic": L(1, 1, 4)}),
        (("ref",), 4, {"ref": L(1, 1, 4)}),
    ],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="ppo_tiny")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=2, help="timed iterations per plan per round")
    p.add_argument("--profile", default="cpu", help="device kind or profile .json (default: the calibrated cpu)")
    p.add_argument("--plans", type=int, default=len(PLANS), help="time the first K hand-written plans")
    p.add_argument("--json", action="store_true")
    p.add_argument("--tiny", action="store_true", help="one plan (and the mapper's), one step, one layer: a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        p.set_defaults(plans=1, rounds=1, iters=1)
        args = p.parse_args(argv)
    return args


def base_config(name: str, run_dir: str, tiny: bool = False):
    cfg = configs.get_config(name)
    with cfg.unlocked():
        if tiny:
            cfg.jaxflow.model.num_layers = 1
        cfg.trainer.total_training_steps = 10_000
        cfg.trainer.test_freq = -1
        cfg.trainer.val_before_train = False
        cfg.trainer.save_freq = -1
        cfg.trainer.logger = []
        cfg.trainer.resume_mode = "disable"
        cfg.trainer.default_local_dir = run_dir
        cfg.jaxflow.sft.warm_start_steps = 0
    return cfg


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties get their mean rank)."""

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def time_plans(cfg0, plans: dict, args: argparse.Namespace, tmp: str, say) -> tuple[dict, list]:
    """Build one RL trainer per plan (a warm-up step compiles), then time ``args.iters``
    iterations per plan per round, plans alternating (measured)."""
    from jaxflow.trainer.rl import RLTrainer

    trainers = {}
    for name, plan in plans.items():
        cfg = with_values(cfg0, plan.overrides(8))
        with cfg.unlocked():
            cfg.trainer.default_local_dir = os.path.join(tmp, str(len(trainers)))
        configs.validate(cfg)
        t0 = time.perf_counter()
        trainers[name] = RLTrainer(cfg)
        trainers[name].train_step(1)  # compiles
        say(f"  built and warmed up {name!r} in {time.perf_counter() - t0:.1f} s")
    times: dict[str, list[float]] = {n: [] for n in plans}
    steps = {n: 1 for n in plans}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, tr in trainers.items():
            for _ in range(args.iters):
                steps[name] += 1
                times[name].append(tr.train_step(steps[name])["timing_s/step"])
        loads.append(os.getloadavg()[0])
        say(f"  round {r + 1}/{args.rounds} done (load {loads[-1]:.1f})")
    return times, loads


def main(argv=None) -> int:
    args = parse_args(argv)
    prof = get_profile(args.profile)
    with tempfile.TemporaryDirectory(prefix="automap_validation_") as tmp:
        return _validate(args, prof, tmp)


def _validate(args: argparse.Namespace, prof, tmp: str) -> int:
    """Plans, timing and the report; the trainers' run directories are under ``tmp``."""
    cfg0 = base_config(args.config, tmp, args.tiny)
    w = workload_from_spec(prepare_run(cfg0, with_placement=False, with_datasets=False).spec)
    chosen = Mapper(w, 8, prof).search(top=1)[0]
    plans = {name: evaluate(w, prof, pools) for name, pools in list(PLANS.items())[: args.plans]}
    chosen_name = next((n for n, p in plans.items() if p.key() == chosen.key()), None)
    if chosen_name is None:
        chosen_name = "auto-mapper's choice"
        plans[chosen_name] = chosen
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    say(f"profile {prof.name} ({prof.source}); mapper's choice: {chosen_name}: {describe(chosen)}")
    # The trainers print (data sources, ...): with --json, to stderr, so stdout is the JSON alone.
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with quiet:
        times, loads = time_plans(cfg0, plans, args, tmp, say)
    rows = []
    for name, plan in plans.items():
        rows.append(
            {
                "plan": name,
                "predicted_s": plan.iteration_s,
                "measured_median_s": statistics.median(times[name]),
                "measured_best_s": min(times[name]),
                "measured_all_s": times[name],
                "pools": plan.to_dict(8)["pools"],
            }
        )
    pred = [r["predicted_s"] for r in rows]
    meas = [r["measured_median_s"] for r in rows]
    rho = spearman(pred, meas) if len(rows) > 1 else float("nan")  # one plan: no ranking
    fastest = min(rows, key=lambda r: r["measured_median_s"])
    mine = next(r for r in rows if r["plan"] == chosen_name)
    gap = mine["measured_median_s"] / fastest["measured_median_s"] - 1
    result = {
        "config": args.config,
        "profile": prof.to_dict(),
        "rows": rows,
        "spearman": rho,
        "chosen": chosen_name,
        "chosen_plan": describe(chosen),
        "fastest_measured": fastest["plan"],
        "chosen_vs_fastest": gap,
        "load_average": loads,
        "rounds": args.rounds,
        "iters_per_round": args.iters,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"\n{'plan':<40} {'predicted s':>12} {'measured s (median)':>20} {'best':>8}")
    for r in sorted(rows, key=lambda r: r["measured_median_s"]):
        mark = "  <- mapper's choice" if r["plan"] == chosen_name else ""
        print(
            f"{r['plan']:<40} {r['predicted_s']:12.3f} {r['measured_median_s']:20.3f} {r['measured_best_s']:8.3f}{mark}"
        )
    print(f"Spearman rank correlation (predicted analytic vs measured median): {rho:.3f} over {len(rows)} plans")
    print(f"mapper's choice {chosen_name!r}: {100 * gap:+.1f}% vs the fastest measured ({fastest['plan']!r})")
    print(f"load average during the runs: {', '.join(f'{x:.1f}' for x in loads)} (2 cores shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
