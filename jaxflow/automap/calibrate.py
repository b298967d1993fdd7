"""``python -m jaxflow.automap.calibrate [--config=NAME] [--devices=8] [--out=PATH]``: measure
this machine and fit the ``cpu`` device profile the auto-mapper plans with (as ReaL profiles
per-layer costs before it searches).

Measured (medians of several timed calls after a warm-up, all on the simulated devices):

1. matmul throughput with every device busy (FLOP/s of the host) and an elementwise pass
   (bytes/s of the host);
2. all-reduces over 2, 4 and 8 devices at two sizes: a least-squares fit of the collective
   model ``2 (k-1) (latency + X / (k bw_dev))`` with ``bw_dev = bw / k`` (the host's bytes
   shared by the busy devices) gives ``latency_s`` and ``intra_bw``;
3. the cost of one program call (dispatch and synchronisation of a trivial program);
4. per-layer forward and forward+backward times of the config's decoder at 1 and 3 layers
   (the slope is one layer): their FLOPs over the time and the host's FLOP/s give ``mfu``;
5. decode: the real sampler at two response lengths; the slope is one step, and what the
   memory/compute model does not explain of it is ``step_overhead_s``.

Writes the profile JSON (default :func:`jaxflow.automap.profiles.calibrated_path`), which
``--device_kind=cpu`` and ``jaxflow.placement.type=auto`` on CPU then use.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _median_time(fn: Callable[[], Any], repeats: int = 7) -> float:
    import jax

    jax.block_until_ready(fn())  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(cfg: Any, devices: int, log: Callable[[str], None] = print) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as Ps

    from jaxflow.configs import model_config
    from jaxflow.mesh import GENERATE_RULES, MeshSpec, TRAIN_RULES, sharding_rules, state_shardings
    from jaxflow.models import init_model
    from jaxflow.sampling import SamplingParams, generate_from_state

    devs = jax.devices()[:devices]
    mesh = Mesh(np.asarray(devs), ("d",))
    rows = NamedSharding(mesh, Ps("d"))
    out: dict[str, float] = {}

    m, k = 256 * devices, 512
    x = jax.device_put(jnp.ones((m, k), jnp.float32), rows)
    wgt = jax.device_put(jnp.ones((k, k), jnp.float32), NamedSharding(mesh, Ps()))
    mm = jax.jit(lambda a, b: a @ b)
    out["host_flops"] = 2 * m * k * k / _median_time(lambda: mm(x, wgt))
    big = jax.device_put(jnp.ones((devices * (1 << 20),), jnp.float32), rows)
    ew = jax.jit(lambda a: a * 2.0 + 1.0)
    out["host_bw"] = 2 * big.size * 4 / _median_time(lambda: ew(big))
    tiny = jax.device_put(jnp.ones((devices,), jnp.float32), rows)
    inc = jax.jit(lambda a: a + 1.0)
    out["call_overhead_s"] = _median_time(lambda: inc(tiny), 15)
    log(f"  host {out['host_flops'] / 1e9:.1f} GFLOP/s, {out['host_bw'] / 1e9:.1f} GB/s, "
        f"call {out['call_overhead_s'] * 1e3:.2f} ms (measured)")

    # All-reduces: t = 2 (k-1) latency + 2 (k-1) X / bw  (X bytes per device; the host's bw shared).
    samples = []
    for g in (2, 4, 8):
        if g > devices:
            continue
        gmesh = Mesh(np.asarray(devs[:g]), ("d",))
        for elems in (4096, 1 << 20):
            a = jax.device_put(jnp.ones((g, elems), jnp.float32), NamedSharding(gmesh, Ps("d")))
            ar = jax.jit(lambda v: jnp.broadcast_to(v.sum(0, keepdims=True), v.shape),
                         out_shardings=NamedSharding(gmesh, Ps("d")))
            t = _median_time(lambda: ar(a)) - out["call_overhead_s"]
            samples.append((2 * (g - 1), 2 * (g - 1) * elems * 4, max(t, 0.0)))
    A = np.array([[s[0], s[1]] for s in samples])
    y = np.array([s[2] for s in samples])
    (latency, inv_bw), *_ = np.linalg.lstsq(A, y, rcond=None)
    out["latency_s"] = float(max(latency, 1e-6))
    out["intra_bw"] = float(1.0 / inv_bw) if inv_bw > 0 else out["host_bw"]
    log(f"  collectives: latency {out['latency_s'] * 1e6:.0f} us per step, {out['intra_bw'] / 1e9:.2f} GB/s "
        "(fit to measured all-reduces)")

    # Per-layer forward / backward of the config's decoder, rows over every device (fsdp).
    mc = model_config(cfg, "actor")
    T = cfg.data.max_prompt_length + cfg.data.max_response_length
    B = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    fmesh = MeshSpec(fsdp=devices).build(devs)
    per_layer = {}
    for L in (1, 3):
        lmc = mc.replace(num_layers=L)
        graphdef, state = nnx.split(init_model(lmc, head="lm"))
        state = jax.device_put(state, state_shardings(state, TRAIN_RULES, fmesh))
        ids = jax.device_put(jnp.ones((B, T), jnp.int32), NamedSharding(fmesh, Ps(("dp", "fsdp"))))

        def loss(st, ids=ids, graphdef=graphdef):
            with sharding_rules(TRAIN_RULES, fmesh):
                return nnx.merge(graphdef, st)(ids).astype(jnp.float32).mean()

        fwd, grad = jax.jit(loss), jax.jit(jax.grad(loss))
        per_layer[L] = (_median_time(lambda: fwd(state), 5), _median_time(lambda: grad(state), 5))
    fwd_layer = max(1e-9, (per_layer[3][0] - per_layer[1][0]) / 2)
    train_layer = max(1e-9, (per_layer[3][1] - per_layer[1][1]) / 2)
    layer_flops = B * T * (2 * (mc.hidden_size * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
                                + mc.num_heads * mc.head_dim * mc.hidden_size + 3 * mc.hidden_size * mc.intermediate_size)
                           + 4 * mc.num_heads * mc.head_dim * T)
    out["mfu"] = float(min(1.0, statistics.mean([layer_flops / fwd_layer, 3 * layer_flops / train_layer])
                           / out["host_flops"]))
    log(f"  one layer: forward {fwd_layer * 1e3:.2f} ms, forward+backward {train_layer * 1e3:.2f} ms (measured, "
        f"{B} x {T} tokens) -> mfu {out['mfu']:.2f}")

    # Decode steps of the real sampler (generation dp over every device).
    gmesh = MeshSpec(dp=devices).build(devs)
    graphdef, state = nnx.split(init_model(mc, head="lm"))
    state = jax.device_put(state, state_shardings(state, GENERATE_RULES, gmesh))
    P = cfg.data.max_prompt_length
    prompts = np.ones((cfg.data.train_batch_size, P), np.int32)
    times = {}
    for R in (4, 16):
        sp = SamplingParams(max_new_tokens=R, n=cfg.actor_rollout_ref.rollout.n, eos_token_ids=())
        times[R] = _median_time(lambda: generate_from_state(graphdef, state, prompts, prompts, sp, mesh=gmesh,
                                                            rules=GENERATE_RULES).responses, 5)
    step = max(1e-9, (times[16] - times[4]) / 12)
    rows_dev = B / devices
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    kv = rows_dev * (P + 10) * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4
    modelled = (weights + kv) * devices / out["host_bw"]
    # Small weights stay in cache: when streaming bandwidth over-explains the step, the
    # step's bytes go at the effective (cache) bandwidth instead and there is no fixed part.
    out["hbm_eff"] = float(max(1.0, modelled / step))
    out["step_overhead_s"] = float(max(0.0, step - modelled))
    out["decode_step_s"] = step
    log(f"  decode step {step * 1e3:.2f} ms ({B} sequences; measured): fixed overhead "
        f"{out['step_overhead_s'] * 1e3:.2f} ms, effective bandwidth x{out['hbm_eff']:.2f} of streaming")
    return out


def fit_profile(m: dict[str, float], devices: int, source: str) -> Any:
    from jaxflow.automap.profiles import DeviceProfile

    try:
        ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        ram_gib = 16.0
    return DeviceProfile(
        name="cpu", flops=m["host_flops"], hbm_bw=m["host_bw"], memory_gib=ram_gib / 2 / devices,
        intra_bw=m["intra_bw"], inter_bw=m["intra_bw"], devices_per_host=devices, mfu=m["mfu"], decode_mfu=m["mfu"],
        hbm_eff=m["hbm_eff"], latency_s=m["latency_s"], step_overhead_s=m["step_overhead_s"], usable=0.9, shared_host=True,
        call_overhead_s=m["call_overhead_s"], source=source)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = dict(a.removeprefix("--").split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    devices = int(args.get("devices", 8))
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    from jaxflow import configs
    from jaxflow.automap.profiles import calibrated_path, save_profile

    cfg = configs.get_config(args.get("config", "ppo_tiny"))
    load = os.getloadavg()[0]
    print(f"calibrating the cpu profile on {devices} simulated devices ({cfg.trainer.experiment_name}'s model; "
          f"load average {load:.1f})", flush=True)
    m = measure(cfg, devices)
    prof = fit_profile(m, devices, f"calibrated {time.strftime('%Y-%m-%d %H:%M')} (load {load:.1f})")
    path = args.get("out", calibrated_path())
    save_profile(prof, path)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
