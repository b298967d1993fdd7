"""``python -m jaxflow.automap.calibrate [--config=NAME] [--devices=8] [--repeats=5] [--out=PATH]``:
measure this machine and fit the ``cpu`` device profile the auto-mapper plans with (as ReaL
profiles per-layer costs before it searches).

Measured (medians of timed calls after a warm-up that compiles, on the simulated devices):

1. the host's matmul throughput with every device busy (``flops``) and its streaming
   bandwidth over a buffer far larger than the caches (``hbm_bw``);
2. all-reduces over 2, 4 and 8 devices at two sizes: a linear least-squares fit of the
   collective model (:class:`~jaxflow.automap.profiles.Protocol`, one protocol, one link
   domain) gives its base latency, per-step latency and bandwidth;
3. the stage programs the workers run, built by their own builders, at a few shapes
   (rows x prompt x response) on the config's actor model with every device in one FSDP
   mesh: the optimizer step (`jaxflow.workers.trainable.train_step_program`), the log-prob
   forward (`jaxflow.workers.reference.log_probs_program`) and the rollout engine
   (`jaxflow.sampling.generate_from_state`, in the 3D-HybridEngine's generation layout).

Fitted: the simulators (:mod:`jaxflow.automap.simulate`) predict each measured call from the
profile; a bounded non-linear least-squares fit of ``log(predicted / measured)`` over all
calls gives ``mfu`` (training and forward FLOPs), ``decode_mfu`` (decode steps, fitted
separately), ``hbm_eff`` (the fraction of the measured streaming bandwidth the passes
achieve, in (0, 1]), ``kernel_overhead_s`` and ``call_overhead_s``. The fit's residual per
call is printed, so a poor fit shows.

Writes the profile JSON (default :func:`jaxflow.automap.profiles.calibrated_path`), which
``--device_kind=cpu`` and ``jaxflow.placement.type=auto`` on CPU then use.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

# (rows, prompt_len, response_len) of the measured stage programs: the batch and the length vary.
SHAPES = ((16, 8, 8), (64, 8, 8), (16, 16, 32))
FIT_FIELDS = ("mfu", "decode_mfu", "hbm_eff", "kernel_overhead_s", "call_overhead_s")
FIT_BOUNDS = ((1e-3, 1.0), (1e-3, 1.0), (1e-3, 1.0), (0.0, 0.1), (0.0, 1.0))


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measured stage call: ``phase`` (train | infer | generate), its shape and the
    measured median seconds."""

    phase: str
    rows: int
    prompt_len: int
    response_len: int
    seconds: float


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sample_workload(base: Any, s: Sample) -> Any:
    """``base`` (a `Workload`) reshaped to one measured call: ``rows`` sequences of
    ``prompt_len + response_len`` tokens (generate: ``rows`` prompts, one response each),
    one mini-batch, one micro-batch."""
    return dataclasses.replace(
        base,
        prompts=s.rows,
        n=1,
        prompt_len=s.prompt_len,
        response_len=s.response_len,
        mini_batch_rows={"actor": s.rows},
        train_micro={"actor": None},
        epochs={"actor": 1},
        forward_micro={"actor": None},
        max_num_seqs=0,
    )


def cases(base: Any, samples: Sequence[Sample], devices: int) -> list[tuple[Any, Any, str]]:
    """``(workload, role layout, phase)`` of each sample on ``devices`` devices in one FSDP mesh."""
    from jaxflow.automap.layouts import Layout, role_layout

    out = []
    for s in samples:
        w = sample_workload(base, s)
        out.append((w, role_layout(w, "actor", Layout(1, devices, 1, 1)), s.phase))
    return out


def predict(prof: Any, calls: Sequence[tuple[Any, Any, str]]) -> list[float]:
    """The simulators' seconds for each of :func:`cases`."""
    from jaxflow.automap.simulate import stage_time

    return [stage_time(w, phase, rl, prof).seconds for w, rl, phase in calls]


def measure(
    spec: Any,
    devices: int,
    repeats: int = 5,
    shapes: Sequence[tuple[int, int, int]] = SHAPES,
    collective_bytes: Sequence[int] = (1 << 14, 1 << 22),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Times on this machine (see the module docstring): ``flops``, ``hbm_bw``,
    ``call_s`` (a trivial program), ``collectives`` ``[(k, bytes, seconds)]`` (all-reduces
    over 2, 4, 8 devices of ``collective_bytes``) and the stage ``samples`` at ``shapes``, on
    the actor of ``spec`` (a `RunSpec`, placed or not)."""
    import jax

    from jaxflow.automap.workload import workload_from_spec

    devs = jax.devices()[:devices]
    if len(devs) < devices:
        raise ValueError(f"calibrate needs {devices} devices, JAX has {len(devs)}")
    out = _device_rates(devs, repeats)
    log(
        f"  host {out['flops'] / 1e9:.1f} GFLOP/s, {out['hbm_bw'] / 1e9:.1f} GB/s streaming, one program call "
        f"{out['call_s'] * 1e3:.2f} ms (measured)"
    )
    out["collectives"] = _collective_times(devs, collective_bytes, repeats, out["call_s"])
    base = workload_from_spec(spec)
    samples = []
    for rows, P, R in shapes:
        samples += _stage_samples(spec.actor, base, devs, rows, P, R, repeats)
        log(
            "  "
            + ", ".join(f"{s.phase} {s.seconds * 1e3:.1f} ms" for s in samples[-3:])
            + f" ({rows} x {P}+{R} tokens; measured)"
        )
    out["samples"] = samples
    out["base"] = base
    return out


def _device_rates(devs: list, repeats: int) -> dict[str, float]:
    """Measured: matmul FLOP/s, streaming bytes/s (read + written) and one trivial program
    call's seconds, over ``devs`` split by rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as Ps

    devices = len(devs)
    mesh = Mesh(np.asarray(devs), ("d",))
    rows_sharding = NamedSharding(mesh, Ps("d"))
    m, k = 256 * devices, 512
    x = jax.device_put(jnp.ones((m, k), jnp.float32), rows_sharding)
    wgt = jax.device_put(jnp.ones((k, k), jnp.float32), NamedSharding(mesh, Ps()))
    mm = jax.jit(lambda a, b: a @ b)
    big = jax.device_put(jnp.ones((devices * (4 << 20),), jnp.float32), rows_sharding)  # 16 MiB per device
    ew = jax.jit(lambda a: a * 2.0 + 1.0)
    tiny = jax.device_put(jnp.ones((devices,), jnp.float32), rows_sharding)
    inc = jax.jit(lambda a: a + 1.0)
    return {
        "flops": 2 * m * k * k / _median_time(lambda: mm(x, wgt), repeats),
        "hbm_bw": 2 * big.size * 4 / _median_time(lambda: ew(big), repeats),
        "call_s": _median_time(lambda: inc(tiny), 3 * repeats),
    }


def _collective_times(devs: list, collective_bytes: Sequence[int], repeats: int, call_s: float) -> list:
    """Measured: ``[(k, bytes, seconds)]`` of an all-reduce over the first k = 2, 4, 8 devices,
    the cost of a trivial program call taken off."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as Ps

    out = []
    for g in (2, 4, 8):
        if g > len(devs):
            continue
        gmesh = Mesh(np.asarray(devs[:g]), ("d",))
        for nbytes in collective_bytes:
            elems = nbytes // 4
            a = jax.device_put(jnp.ones((g, elems), jnp.float32), NamedSharding(gmesh, Ps("d")))
            ar = jax.jit(
                lambda v: jnp.broadcast_to(v.sum(0, keepdims=True), v.shape),
                out_shardings=NamedSharding(gmesh, Ps("d")),
            )
            out.append((g, elems * 4, max(0.0, _median_time(lambda: ar(a), repeats) - call_s)))
    return out


def _stage_samples(actor: Any, base: Any, devs: list, rows: int, P: int, R: int, repeats: int) -> list[Sample]:
    """Measured: the forward, train step (the `ActorConfig` ``actor``) and generation of
    ``rows`` x (P + R) tokens on ``devs`` (fsdp over all), through the workers' own builders."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as Ps

    from jaxflow.automap.layouts import Layout, role_layout
    from jaxflow.mesh import MeshSpec, state_shardings
    from jaxflow.models import init_model
    from jaxflow.reshard import HybridEngine
    from jaxflow.sampling import SamplingParams, generate_from_state
    from jaxflow.workers.base import RoleLayout
    from jaxflow.workers.optim import make_optimizer
    from jaxflow.workers.reference import log_probs_program
    from jaxflow.workers.train_state import create_train_state
    from jaxflow.workers.trainable import train_step_program

    mc = base.models["actor"].config
    tx, schedule = make_optimizer(actor.optim)
    graphdef, params = nnx.split(init_model(mc, head="lm"))
    rl = role_layout(sample_workload(base, Sample("train", rows, P, R, 0.0)), "actor", Layout(1, len(devs), 1, 1))
    fmesh = MeshSpec(fsdp=len(devs)).build(devs, model=mc, rules=rl.rules)
    shardings = state_shardings(params, rl.rules, fmesh)
    layout = RoleLayout(graphdef, fmesh, rl.rules, shardings)
    batch_rows = NamedSharding(fmesh, Ps(layout.batch_axes))
    ones = {c: jnp.ones((rows, P if c.startswith("prompt") else R), jnp.int32) for c in PROMPT_COLUMNS}
    tensors = jax.device_put(ones, batch_rows)
    scalars = {"temperature": jnp.float32(1.0)}
    placed = jax.device_put(params, shardings)
    forward = log_probs_program(layout, 1)
    infer_s = _median_time(lambda: forward(placed, tensors, scalars), repeats)
    cols = {c: (rows, R) for c in actor.train_columns() if c not in ones}
    batch = dict(tensors, **jax.device_put({c: jnp.zeros(s, jnp.float32) for c, s in cols.items()}, batch_rows))
    state, state_sh = create_train_state(placed, shardings, tx, fmesh)
    step = train_step_program(layout, tx, schedule, actor, state_sh, 1)
    holder = [state]

    def train_call():
        holder[0], metrics = step(holder[0], batch, scalars)
        return metrics

    train_s = _median_time(train_call, repeats)
    engine = HybridEngine(fmesh, rl.rules, gen_tp=1)
    gen_params = jax.device_put(params, state_shardings(params, engine.gen_rules, engine.gen_mesh))
    prompts = np.ones((rows, P), np.int32)
    sp = SamplingParams(max_new_tokens=R, n=1, eos_token_ids=())

    def generate_call():
        return generate_from_state(
            graphdef, gen_params, prompts, prompts, sp, mesh=engine.gen_mesh, rules=engine.gen_rules
        ).responses

    return [
        Sample("infer", rows, P, R, infer_s),
        Sample("train", rows, P, R, train_s),
        Sample("generate", rows, P, R, _median_time(generate_call, repeats)),
    ]


PROMPT_COLUMNS = ("prompt_ids", "prompt_mask", "responses", "response_mask")


def fit_collectives(samples: Sequence[tuple[int, int, float]]) -> Any:
    """The one-protocol collective model fitted (linear least squares) to all-reduce times
    ``(k devices, bytes X, seconds)``: ``t = base + 2 (k-1) hop + 2 (k-1) / k X k / bw``
    (on a simulated host the ``k`` busy devices share ``bw``)."""
    import numpy as np

    from jaxflow.automap.profiles import Protocol

    A = np.array([[1.0, 2 * (k - 1), 2 * (k - 1) / k * x * k] for k, x, _ in samples])
    y = np.array([t for _, _, t in samples])
    (base, hop, inv_bw), *_ = np.linalg.lstsq(A, y, rcond=None)
    bw = 1.0 / inv_bw if inv_bw > 0 else math.inf
    return Protocol("host", max(0.0, float(base)), max(0.0, float(hop)), max(0.0, float(hop)), 1.0), bw


def fit_profile(m: dict[str, Any], devices: int, source: str, log: Callable[[str], None] = print) -> Any:
    """The ``cpu`` profile fitted to :func:`measure`'s times (see the module docstring)."""
    import numpy as np
    from scipy.optimize import least_squares

    from jaxflow.automap.profiles import DeviceProfile

    try:
        ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        ram_gib = 16.0
    protocol, link_bw = fit_collectives(m["collectives"])
    link_bw = min(link_bw, m["hbm_bw"])  # copies between simulated devices go through the host's memory
    prof = DeviceProfile(
        name="cpu",
        flops=m["flops"],
        hbm_bw=m["hbm_bw"],
        memory_gib=ram_gib / 2 / devices,
        intra_bw=link_bw,
        inter_bw=link_bw,
        devices_per_host=devices,
        hbm_eff=1.0,
        protocols=(protocol,),
        kernel_overhead_s=0.0,
        call_overhead_s=m["call_s"],
        shared_host=True,
        source=source,
    )
    samples = m["samples"]
    calls = cases(m["base"], samples, devices)
    measured = np.log([s.seconds for s in samples])

    def residuals(theta):
        p = dataclasses.replace(prof, **dict(zip(FIT_FIELDS, (float(t) for t in theta))))
        return np.log(predict(p, calls)) - measured

    lo, hi = (np.array(b) for b in zip(*FIT_BOUNDS))
    start = np.clip([0.5, 0.5, 1.0, 20e-6, m["call_s"]], lo, hi)
    fit = least_squares(residuals, start, bounds=(lo, hi), x_scale=np.maximum(start, 1e-6))
    fitted = dataclasses.replace(prof, **dict(zip(FIT_FIELDS, (float(t) for t in fit.x))))
    predicted = predict(fitted, calls)
    for s, p in zip(samples, predicted):
        log(
            f"    {s.phase:<8} {s.rows:>4} x {s.prompt_len}+{s.response_len}: measured {s.seconds * 1e3:8.2f} ms, "
            f"fitted model {p * 1e3:8.2f} ms"
        )
    log(
        "  fit: "
        + ", ".join(f"{f}={getattr(fitted, f):.3g}" for f in FIT_FIELDS)
        + f"; rms log error {float(np.sqrt(np.mean(fit.fun**2))):.3f}"
    )
    return fitted


def main(argv: list[str] | None = None) -> int:
    """The command line (run.py's: `jaxflow.run.load_command`)."""
    from jaxflow.automap.profiles import calibrated_path, save_profile
    from jaxflow.mesh import simulate_devices
    from jaxflow.run import load_command

    flags = ("--devices=", "--repeats=", "--out=")
    command = load_command(sys.argv[1:] if argv is None else argv, __doc__, flags, default="ppo_tiny")
    if isinstance(command, int):
        return command
    args = dict(a.removeprefix("--").split("=", 1) for a in command.rest)
    devices = int(args.get("devices", 8))
    simulate_devices(devices)  # before JAX starts
    spec = command.prepare(with_placement=False, with_datasets=False).spec
    load = os.getloadavg()[0]
    print(
        f"calibrating the cpu profile on {devices} simulated devices ({spec.name}'s model; load average {load:.1f})",
        flush=True,
    )
    m = measure(spec, devices, repeats=int(args.get("repeats", 5)))
    prof = fit_profile(m, devices, f"calibrated {time.strftime('%Y-%m-%d %H:%M')} (load {load:.1f})")
    path = args.get("out", calibrated_path())
    save_profile(prof, path)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
