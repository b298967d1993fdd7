"""Issue 23's benchmark of the trainer modes ``sync``, ``one_step_off`` and ``async``: the
modes run on 8 simulated CPU devices (MEASURED) and the auto-mapper's simulator's predictions
for the paper's workloads (ANALYTIC: a model, nothing measured).

MEASURED (the local backend's modes, one after the other in this process, on 8 simulated CPU
devices placed as the config says (grpo_tiny: the auto-mapper's choice, actor 4 / ref 4, the
rollout on the actor's devices); ``--cpu_modes``): ``sync``, ``one_step_off``, ``async`` with
``max_staleness`` 1 and 2, each ``--cpu_steps`` training steps of ``--cpu_config`` (the default
task, its tiny Llama; the warm start included) from the same start and seed. Per mode: the wall
seconds per consumed sample (one response) in the steady-state steps (`measure_mode`: step 1
compiles and is reported apart), the seconds spent generating there (``timing_s/gen`` +
``timing_s/gen_ahead``), the idle fractions, the consumed tokens' largest staleness, and the
held-out score (``val/score/mean``, greedy) after the fixed number of samples (``--cpu_steps``
x prompts x n). Here the rollout and the update run on the same devices, one after the
other (`jaxflow.trainer.ahead`): the rollouter is idle while the trainer updates and the
trainer while the rollouter generates, so the two idle fractions add up to 1 by construction
(``rollout_idle = 1 - gen_s / wall_s``, ``trainer_idle = gen_s / wall_s``), and the modes
differ in what they learn from (stale rollouts), not in overlap.

MEASURED, ``--split`` (the issue's setting): the 8 simulated CPU devices split 4 (rollout pool,
``jaxflow.placement.rollout_devices=4``) / 4 (every training role, colocated), ``--split_config``
(ppo_tiny) with ``--split_response_length`` response tokens and long-tailed response lengths:
each prompt's ``max_new_tokens`` is ``min(R_max, X)`` with ``X`` lognormal of ``--sigma`` and
median ``R_max / --cap_over_median`` (the ANALYTIC part's assumption), drawn from a hash of
the prompt (the same for every mode), generated to that length (``rollout.ignore_eos``). The
rollouts generate on the pool in a thread while the update runs (`jaxflow.trainer.rollouter`),
the weights synced after each update. Per mode, over the same steady-state window: the wall
ms per consumed sample, the idle fractions as the trainer logs them
(``fully_async/trainer/idle_ratio``: waiting for rollouts; ``fully_async/rollouter/idle_ratio``:
nothing generating; step-time weighted), the weight sync's bytes and seconds per sync, and the
held-out score after the fixed number of samples. Both pools run on the same 2 CPU cores of
the machine, so the overlap shows in the idle fractions, not as speed.

ANALYTIC: per (config, device count) and mode: the predicted steady-state iteration time,
samples per second and speedup over ``sync``, the chosen split (rollout / training devices,
the rollout's layout, the training pools; idle hosts if the model leaves some), the weight
sync's bytes and seconds, the pools' idle fractions, and every assumption the numbers rest on
(:mod:`jaxflow.automap.async_schedule`'s docstring gives the formulas).

    python experiments/bench_async.py [--configs=ppo_7b,ppo_70b] [--devices=64,128]
        [--device_kind=a100-80g] [--mean_over_max=RHO | --sigma=1 --cap_over_median=4]
        [--max_staleness=1] [--concurrent] [--cpu_config=grpo_tiny] [--cpu_steps=50]
        [--cpu_modes=sync,one_step_off,async:1,async:2] [--no_cpu] [--smoke] [--json]
        [--split [--split_config=ppo_tiny] [--split_response_length=32]] [--no_analytic]

``--smoke``: ppo_7b on 16 devices (two hosts: one split), and ``async`` with
``max_staleness=2`` for 4 steps of a one-layer model without the warm start, 8 held-out
prompts: a smoke test of the script (each mode builds its own trainer, ~20 CPU-s); with
``--split``, the same on the 4 / 4 split (``--split_response_length`` 8).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxflow.mesh.devices import simulate_devices  # noqa: E402

simulate_devices(8)  # before JAX touches a device
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxflow import configs  # noqa: E402
from jaxflow.automap.async_schedule import MODES, Assumptions, LongTail, ModePlan, predict  # noqa: E402
from jaxflow.automap.profiles import get_profile  # noqa: E402
from jaxflow.automap.workload import Workload, workload_from_spec  # noqa: E402
from jaxflow.configs.overrides import with_values  # noqa: E402
from jaxflow.configs.prepare import prepare_run  # noqa: E402

# --smoke: a one-layer model, no warm start, 8 prompts x 4 responses per step, 8 held-out prompts.
SMOKE_CPU = {
    "jaxflow.sft.warm_start_steps": 0,
    "jaxflow.model.num_layers": 1,
    "jaxflow.model.hidden_size": 64,
    "jaxflow.model.intermediate_size": 128,
    "data.train_batch_size": 8,
    "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_device": 4,
    "critic.ppo_mini_batch_size": 4,  # --split's ppo_tiny
    "critic.ppo_micro_batch_size_per_device": 4,
    "jaxflow.data.num_val_examples": 8,
}


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


def split_values(args: argparse.Namespace) -> dict:
    """``--split``: the last 4 of the 8 devices as the rollout pool, the training roles
    colocated on the first 4, responses generated to their drawn lengths."""
    return {
        "jaxflow.placement.type": "colocated",
        "jaxflow.placement.rollout_devices": 4,
        "data.max_response_length": args.split_response_length,
        "actor_rollout_ref.rollout.ignore_eos": True,
    }


def long_tailed(to_batch, r_max: int, tail: LongTail):
    """``to_batch`` with a per-prompt ``max_new_tokens`` column ``min(R_max, X)``, ``X``
    lognormal (``tail.sigma``, median ``R_max / tail.cap_over_median``), at least 1, drawn from
    the CRC-32 of the batch's prompt ids (the same lengths for every mode)."""
    import zlib

    import numpy as np

    def with_lengths(items):
        batch = to_batch(items)
        ids = np.ascontiguousarray(np.asarray(batch["prompt_ids"]))
        rng = np.random.default_rng(zlib.crc32(ids.tobytes()))
        x = np.exp(np.log(r_max / tail.cap_over_median) + tail.sigma * rng.standard_normal(len(batch)))
        return batch.update(tensors={"max_new_tokens": np.clip(np.rint(x), 1, r_max).astype(np.int32)})

    return with_lengths


def cpu_config(name: str, steps: int, run_dir: str, smoke: bool, mode: str, max_staleness: int, extra: dict):
    """``name`` for ``steps`` training steps (its lr schedule over them) in ``run_dir``, in
    ``mode`` (with the ``extra`` values): no validation, checkpoints or loggers inside the steps."""
    values = {
        "trainer.total_training_steps": steps,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "trainer.save_freq": -1,
        "trainer.logger": [],
        "trainer.resume_mode": "disable",
        "trainer.default_local_dir": run_dir,
        "trainer.mode": mode,
        "trainer.max_staleness": max_staleness,
        **(SMOKE_CPU if smoke else {}),
        **extra,
    }
    cfg = with_values(configs.get_config(name), values)
    configs.validate(cfg)
    return cfg


def measure_mode(args: argparse.Namespace, mode: str, max_staleness: int, run_dir: str) -> dict:
    """One mode's run (MEASURED): ``args.cpu_steps`` steps, then the held-out score.

    The timed window is the steady state: steps ``2 .. N - a`` for ``N`` steps and ``a``
    rollouts generated ahead (0 for ``sync``), in each of which one rollout is generated and
    one consumed. Step 1 compiles (and generates the ``a`` rollouts ahead); the last ``a`` steps
    consume rollouts generated earlier and generate none."""
    from jaxflow.trainer.ahead import lookahead
    from jaxflow.trainer.rl import RLTrainer

    ahead = lookahead(mode, max_staleness) or 0
    if args.cpu_steps < ahead + 2:
        raise SystemExit(f"--cpu_steps={args.cpu_steps}: {mode} (s={max_staleness}) needs >= {ahead + 2} steps")
    name, extra = (args.split_config, split_values(args)) if args.split else (args.cpu_config, {})
    trainer = RLTrainer(cpu_config(name, args.cpu_steps, run_dir, args.smoke, mode, max_staleness, extra))
    try:
        if args.split:  # the long-tailed lengths, on every rollout the pool generates
            trainer.ahead.to_batch = long_tailed(trainer.ahead.to_batch, args.split_response_length, tail_of(args))
        rows = trainer.spec.rollout_rows  # responses consumed per step
        steps = [trainer.train_step(s) for s in range(1, args.cpu_steps + 1)]
        held_out = trainer.validate()["val/score/mean"]
    finally:
        trainer.close()
    window = steps[1 : len(steps) - ahead]
    wall_s = sum(m["timing_s/step"] for m in window)
    gen_s = sum(m.get("timing_s/gen", 0.0) + m.get("timing_s/gen_ahead", 0.0) for m in window)
    result = {
        "mode": mode,
        "max_staleness": max_staleness if mode == "async" else ahead,
        "steps": len(steps),
        "timed_steps": f"2..{len(steps) - ahead}",
        "first_step_s": steps[0]["timing_s/step"],
        "wall_s": wall_s,
        "wall_s_per_sample": wall_s / (rows * len(window)),
        "generate_s": gen_s,
        "rollout_idle_fraction": 1.0 - gen_s / wall_s,
        "trainer_idle_fraction": gen_s / wall_s,
        "max_token_staleness": max(m.get("fully_async/staleness/token_max", 0.0) for m in steps),
        "consumed_samples": rows * len(steps),
        "held_out_score": held_out,
    }
    return result | (split_measures(steps, window, wall_s) if args.split else {})


def split_measures(steps: list[dict], window: list[dict], wall_s: float) -> dict:
    """A pool run's idle fractions as the trainer logs them (step-time weighted over the
    window), its weight syncs (bytes and seconds per sync, over the run) and mean response
    length (the long tail's)."""
    syncs = [m for m in steps if m.get("weight_sync/bytes", 0.0) > 0]
    return {
        "rollout_idle_fraction": sum(m["fully_async/rollouter/idle_ratio"] * m["timing_s/step"] for m in window)
        / wall_s,
        "trainer_idle_fraction": sum(m["fully_async/trainer/idle_ratio"] * m["timing_s/step"] for m in window) / wall_s,
        "weight_syncs": len(syncs),
        "weight_sync_bytes": syncs[0]["weight_sync/bytes"] if syncs else 0.0,
        "weight_sync_s_mean": sum(m["timing_s/weight_sync"] for m in syncs) / max(1, len(syncs)),
        "response_length_mean": sum(m["response_length/mean"] for m in window) / len(window),
    }


def measure_cpu(args: argparse.Namespace, say) -> list[dict]:
    """The modes of ``--cpu_modes`` (MEASURED), each from the same start and seed."""
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for item in args.cpu_modes.split(","):
            mode, _, s = item.partition(":")
            r = measure_mode(args, mode, int(s or 0), os.path.join(tmp, item.replace(":", "_")))
            results.append(r)
            say(cpu_line(r))
    return results


def cpu_line(r: dict) -> str:
    name = r["mode"] + (f" s={r['max_staleness']}" if r["mode"] == "async" else "")
    line = (
        f"  {name:<13} {1e3 * r['wall_s_per_sample']:7.2f} ms/sample (steps {r['timed_steps']}: {r['wall_s']:.1f} s; "
        f"step 1 {r['first_step_s']:.1f} s)  idle: rollout {r['rollout_idle_fraction']:.0%}, trainer "
        f"{r['trainer_idle_fraction']:.0%}  staleness <= {r['max_token_staleness']:g}  "
        f"held-out {r['held_out_score']:.3f} after {r['consumed_samples']} samples"
    )
    if "weight_syncs" not in r:
        return line
    return (
        f"{line}\n{'':16}weight sync: {r['weight_sync_bytes'] / 1e6:.2f} MB, {1e3 * r['weight_sync_s_mean']:.0f} ms "
        f"per sync ({r['weight_syncs']} syncs); mean response length {r['response_length_mean']:.1f}"
    )


def tail_of(args: argparse.Namespace) -> LongTail:
    return LongTail(args.sigma, args.cap_over_median, args.mean_over_max)


def assumptions_of(args: argparse.Namespace) -> Assumptions:
    return Assumptions(long_tail=tail_of(args), max_staleness=args.max_staleness, concurrent=args.concurrent)


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
    p.add_argument("--cpu_config", default="grpo_tiny", help="the measured modes' config (its task and model)")
    p.add_argument("--cpu_steps", type=int, default=50, help="training steps per measured mode")
    p.add_argument("--cpu_modes", default="sync,one_step_off,async:1,async:2", help="mode[:max_staleness],...")
    p.add_argument("--no_cpu", action="store_true", help="the ANALYTIC part only")
    p.add_argument("--smoke", action="store_true", help="ppo_7b on 16 devices; the CPU modes 2 tiny steps each")
    p.add_argument("--json", action="store_true")
    p.add_argument("--split", action="store_true", help="the measured modes on the 4 (rollout) / 4 (train) split")
    p.add_argument("--split_config", default="ppo_tiny", help="--split: the measured modes' config")
    p.add_argument("--split_response_length", type=int, default=32, help="--split: R_max, the responses' cap")
    p.add_argument("--no_analytic", action="store_true", help="the MEASURED part only")
    args = p.parse_args(argv)
    if args.smoke:
        args.configs, args.devices, args.cpu_steps, args.cpu_modes = "ppo_7b", "16", 4, "async:2"
        args.split_response_length = 8 if args.split else args.split_response_length
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    measured = []
    if not args.no_cpu:
        say(cpu_header(args))
        # The trainers print (data sources, ...): with --json, to stderr, so stdout is the JSON alone.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            measured = measure_cpu(args, say)
        say(f"  load average {os.getloadavg()[0]:.1f} (the machine's cores are shared)")
    results = [] if args.no_analytic else analytic(args, say)
    if args.json:
        print(json.dumps({"measured": measured, "analytic": not args.no_analytic, "cases": results}, indent=2))
    return 0


def cpu_header(args: argparse.Namespace) -> str:
    if not args.split:
        return f"{args.cpu_config} on 8 simulated CPU devices, {args.cpu_steps} steps per mode (MEASURED):"
    return (
        f"{args.split_config} on 8 simulated CPU devices split 4 (rollout pool) / 4 (training), {args.cpu_steps} "
        f"steps per mode (MEASURED): {tail_of(args).text(1).split(', a batch')[0]}, R_max = "
        f"{args.split_response_length}. Both pools share this machine's {os.cpu_count()} CPU cores: the overlap "
        "shows in the idle fractions, it cannot show as speed here."
    )


def analytic(args: argparse.Namespace, say) -> list[dict]:
    """The simulator's predictions per (config, device count) (ANALYTIC)."""
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
    return results


if __name__ == "__main__":
    sys.exit(main())
