"""jaxflow on whatever backend is present, against the hardware and against transformers/torch:

    python experiments/bench_accelerator.py                 # GPU/TPU: the Qwen2.5-0.5B-shaped workload
    python experiments/bench_accelerator.py --tiny          # CPU: every phase at toy size, in about a minute
    python experiments/bench_accelerator.py --json out.json --phases engine,train

Phases (``--phases``, in this order; the subprocess phases run before this process touches the
accelerator, so each has the device to itself):

- ``checkpoint``: a random model of the workload's shape written as an HF checkpoint (bf16).
- ``hf``: transformers ``generate`` (sdpa, bf16, sampling at T=1) on the engine's rows.
- ``torch_train``: the HF model's train step in torch (sdpa, fused AdamW, the GRPO loss + KL).
- ``rl``: GRPO through ``python -m jaxflow.run`` (grpo_tiny with that checkpoint, 32 prompts x 8
  samples, 256-token responses, no warm start): seconds per phase of the last steps, the time
  to the first step and the compile seconds per program, from an empty compilation cache
  (``cold``) and again with the cache the first run left (``warm``); ``--rl_variants`` adds
  runs with other settings (``scan_layers``, cuBLAS-only gemms).
- ``xla_flags`` (only when named): the engine with XLA:GPU command buffers off / with loops.
- ``ceilings``: the device's measured copy bandwidth (bytes read + written; through ``jnp``
  and through torch) and bf16 matmul rate.
- ``engine``: `jaxflow.sampling.generate` alone, 256 prompts x (128 -> 256 new), T=1, bf16,
  and the RL run's rows (32 x 8, its prompt length, 256 new) for the gen-phase ratio;
  ``--engine_variants`` adds runs with other `EngineOptions`.
- ``profile``: a traced engine call: kernels per decode step, device-busy share, top kernels.
- ``train``: the actor's train step (float32 masters, bf16 compute, GRPO loss + KL), 16 rows x
  (128 + 384): seconds, analytic TFLOP/s, MFU against the peak (``--peak``) and against the
  measured matmul rate; ``--train_variants`` adds runs with other model settings.
- ``wide``: the same engine and train step at Qwen2.5-7B width (``--wide_layers`` of its layers).

Every figure is labelled: ``measured`` (wall clock, medians of ``--reps`` after a warm-up call),
``analytic`` (a model: FLOPs from the shapes, bytes over the measured bandwidth). Results are
printed as JSON lines as each phase ends, then a table; ``--json`` writes them all.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

FULL = dict(
    preset="qwen2_5_0_5b",
    layers=None,  # the preset's
    engine=dict(B=256, P=128, R=256),
    train=dict(rows=16, P=128, R=384),
    rl=dict(prompts=32, n=8, R=256, steps=3, micro=32),
    wide=dict(preset="qwen2_5_7b", B=128, P=128, R=128, rows=8, tP=128, tR=384),
)
TINY = dict(
    preset="tiny_qwen2",
    layers=1,  # every phase's claim holds at any depth; each layer compiles on its own
    engine=dict(B=4, n=2, P=10, R=8),  # the RL run's rows: one engine program serves both
    train=dict(rows=4, P=8, R=8),
    rl=dict(prompts=4, n=2, R=8, steps=2, micro=4),
    wide=dict(preset="tiny_llama", B=4, P=8, R=8, rows=2, tP=8, tR=8),
)
PHASES = ("checkpoint", "hf", "torch_train", "rl", "xla_flags", "ceilings", "engine", "profile", "train", "wide")
OPT_IN = ("xla_flags",)  # explorations, not in the default run (the whole default: < 5 min on one GPU)
TINY_SKIPS = ("xla_flags", "wide")  # GPU flags; the wide model is the train and engine phases again
ENGINE_VARIANTS = {  # EngineOptions
    "steps_per_sync_1": dict(steps_per_sync=1),
    "attention_jax": dict(attention="jax"),
    "pages_per_block_2": dict(pages_per_block=2),
    "pages_per_block_4": dict(pages_per_block=4),
    "pages_per_block_16": dict(pages_per_block=16),
}
TRAIN_VARIANTS = {  # ModelConfig fields besides the run's defaults
    "xla": dict(attention_impl="xla"),
    "scan_layers": dict(scan_layers=True),
}
SCAN = "--config.jaxflow.model.scan_layers=true"
RL_VARIANTS = {  # the ``rl`` phase's CLI runs: (more flags, more XLA_FLAGS)
    "default": ([], ""),
    "scan_layers": ([SCAN], ""),
    "scan_layers_cublas": ([SCAN], "--xla_gpu_enable_triton_gemm=false"),
    "cublas": ([], "--xla_gpu_enable_triton_gemm=false"),
}
# XLA:GPU command buffers (CUDA graphs): off, and with loops and conditionals inside them
XLA_FLAG_VARIANTS = {
    "command_buffers_off": "--xla_gpu_enable_command_buffer=",
    "command_buffers_with_loops": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
}


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _timed(fn, reps):
    """(first call seconds, [seconds of ``reps`` more calls]); ``fn`` blocks until done."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, times


# ---------------------------------------------------------------------- analytic models


def model_numbers(cfg) -> dict:
    """Parameter counts of a `ModelConfig` (matmul weights per token, embedding, head)."""
    D, F, H, N, K, Lyr, V = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.num_layers,
        cfg.vocab_size,
    )
    layer = D * (H + 2 * N) * K + H * K * D + 3 * D * F
    return dict(
        layer_matmul=layer,
        matmul=Lyr * layer,
        embed=V * D,
        head=V * D,
        total=Lyr * (layer + 2 * D) + V * D * (1 if cfg.tie_word_embeddings else 2) + D,
    )


def train_flops(cfg, rows, P, R) -> float:
    """Analytic FLOPs of one train step: 3 x (forward) with forward = 2 x matmul params per token
    over P + R tokens, causal attention 2 x 2 x L^2/2 x H x K per layer, the LM head on the R
    response positions."""
    m = model_numbers(cfg)
    L = P + R
    fwd = 2 * m["matmul"] * L + cfg.num_layers * 2 * 2 * (L * L / 2) * cfg.num_heads * cfg.head_dim + 2 * m["head"] * R
    return 3 * rows * fwd


def decode_bytes_per_step(cfg, rows, mean_cached, dtype_bytes=2) -> float:
    """Analytic bytes one decode step must read: every weight once (matmuls, the head; the
    embedding rows are a gather) and the keys and values of ``rows`` sequences at
    ``mean_cached`` cached tokens."""
    m = model_numbers(cfg)
    weights = (m["matmul"] + m["head"]) * dtype_bytes
    kv = rows * mean_cached * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    return weights + kv


# ---------------------------------------------------------------------- subprocess phases


def _sub(phase: str, payload: dict, timeout: float, env: dict | None = None) -> dict:
    """Runs ``--worker phase`` in a fresh process; its last stdout line is its JSON result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", phase, "--payload", json.dumps(payload)]
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}", "tail": (p.stdout + p.stderr)[-2000:]}
    return json.loads(lines[-1])


def worker_checkpoint(a: dict) -> dict:
    """A random model of the preset's shape, saved in bf16 as an HF checkpoint (on CPU)."""
    import jax.numpy as jnp

    from jaxflow.models import PRESETS, save_pretrained

    cfg = PRESETS[a["preset"]].replace(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    if a["layers"]:
        cfg = cfg.replace(num_layers=a["layers"])
    t0 = time.perf_counter()
    save_pretrained(init_random(cfg), a["path"])
    return {"path": a["path"], "seconds": time.perf_counter() - t0}


def _torch_device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def worker_hf(a: dict) -> dict:
    """transformers ``generate`` on the engine's rows: sampling at T = 1, every row to R tokens."""
    import numpy as np
    import torch
    import transformers

    dev = _torch_device()
    hf = transformers.AutoModelForCausalLM.from_pretrained(a["path"], dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to(dev).eval()
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.integers(3, hf.config.vocab_size - 1, (a["B"], a["P"])), device=dev)

    def run(n):
        with torch.inference_mode():
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=None,
                pad_token_id=0,
            )
        if dev == "cuda":
            torch.cuda.synchronize()
        return out

    run(4)
    _, times = _timed(lambda: run(a["R"]), a["reps"])
    return {"device": dev, "seconds": times, "tok_s": a["B"] * a["R"] / _median(times)}


def worker_torch_train(a: dict) -> dict:
    """The HF model's GRPO step in torch: sdpa attention, bf16 weights, fused AdamW."""
    import numpy as np
    import torch
    import transformers

    dev = _torch_device()
    hf = transformers.AutoModelForCausalLM.from_pretrained(a["path"], dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to(dev).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=dev == "cuda")
    rng = np.random.default_rng(0)
    rows, P, R, V = a["rows"], a["P"], a["R"], hf.config.vocab_size
    x = torch.tensor(rng.integers(4, V - 10, (rows, P + R)), device=dev)
    tgt = x[:, P:]
    adv = torch.tensor(rng.normal(size=(rows, R)), dtype=torch.float32, device=dev)
    ref = torch.full((rows, R), -float(np.log(V)), device=dev)

    def step():
        logits = hf(x).logits[:, P - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, tgt[..., None])[..., 0]
        ratio = torch.exp(lp - lp.detach())
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        ((-(adv * ratio) + 0.001 * kl).mean()).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()

    first, times = _timed(step, a["reps"])
    return {"device": dev, "first_s": first, "seconds": times}


def worker_torch(a: dict) -> dict:
    """``hf`` and/or ``torch_train`` (the keys of ``a``: their payloads) in one process: torch
    and transformers imported once."""
    return {name: WORKERS[name](payload) for name, payload in a.items()}


def worker_rl(a: dict) -> dict:
    """GRPO through the CLI; per-phase seconds from metrics.jsonl, compile seconds from the
    summary."""
    with tempfile.TemporaryDirectory(prefix="jaxflow_rl_") as run_dir:
        return _rl_run(a, run_dir)


def _rl_run(a: dict, run_dir: str) -> dict:
    """`worker_rl` in the run directory ``run_dir`` (removed afterwards)."""
    r = a["rl"]
    cmd = [
        sys.executable,
        "-m",
        "jaxflow.run",
        "--config=grpo_tiny",
        "--config.jaxflow.num_devices=1",
        f"--config.actor_rollout_ref.model.path={a['path']}",
        "--config.jaxflow.sft.warm_start_steps=0",
        f"--config.trainer.total_training_steps={r['steps']}",
        f"--config.data.max_response_length={r['R']}",
        f"--config.data.train_batch_size={r['prompts']}",
        f"--config.actor_rollout_ref.rollout.n={r['n']}",
        f"--config.actor_rollout_ref.actor.ppo_mini_batch_size={r['prompts']}",  # prompts: one on-policy step
        f"--config.actor_rollout_ref.actor.ppo_micro_batch_size_per_device={r['micro']}",
        f"--config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_device={r['micro']}",
        f"--config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_device={r['micro']}",
        "--config.trainer.val_before_train=False",
        "--config.trainer.test_freq=-1",
        f"--config.trainer.default_local_dir={run_dir}",
        *a.get("flags", []),
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=run_dir)
    wall = time.perf_counter() - t0
    out = {"rc": p.returncode, "wall_s": wall}
    try:
        rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    except OSError:
        return dict(out, error="no metrics", tail=(p.stdout + p.stderr)[-3000:])
    keep = ("timing_s/", "perf/", "response_length/mean")
    out["steps"] = [{k: v for k, v in m.items() if k.startswith(keep)} for m in rows]
    out["compile"] = next((x.strip() for x in p.stdout.splitlines() if "compiled " in x and " programs in " in x), None)
    out["plan"] = [x for x in p.stdout.splitlines() if x.startswith(("jaxflow:", "dtypes"))][:3]
    return out


def worker_engine(a: dict) -> dict:
    """The engine alone in a fresh process (whose ``XLA_FLAGS`` the caller sets)."""
    out = engine_run(_bf16_model(a["preset"], a["layers"]), a["B"], a["P"], a["R"], a["reps"])
    return {k: out[k] for k in ("tok_s", "ms_per_step", "first_call_s", "steps")}


WORKERS = {
    "checkpoint": worker_checkpoint,
    "engine": worker_engine,
    "hf": worker_hf,
    "torch_train": worker_torch_train,
    "torch": worker_torch,
    "rl": worker_rl,
}


# ---------------------------------------------------------------------- in-process phases


def _torch_copy_rate(n: int) -> float | None:
    """Measured: torch's device-to-device copy of ``n`` bf16 elements (bytes read + written),
    a second reading of the bandwidth; None without torch or a CUDA device."""
    import jax

    if jax.default_backend() != "gpu":
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    buffers = [torch.ones(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")]

    def copy():
        buffers[1].copy_(buffers[0])
        torch.cuda.synchronize()

    _, t = _timed(copy, 10)
    buffers.clear()
    torch.cuda.empty_cache()
    return 2 * n * 2 / _median(t)


def ceilings(tiny: bool) -> dict:
    """Measured: device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate."""
    import jax
    import jax.numpy as jnp

    n = (1 << 22) if tiny else (1 << 29)  # bf16 elements: 8 MiB / 1 GiB
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda x: x + 1)
    _, t = _timed(lambda: copy(x).block_until_ready(), 10)
    m = 512 if tiny else 8192
    a = jax.random.normal(jax.random.key(0), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    _, tm = _timed(lambda: mm(a).block_until_ready(), 10)
    return {
        "copy_bytes_per_s": 2 * n * 2 / _median(t),
        "torch_copy_bytes_per_s": _torch_copy_rate(n),
        "matmul_flop_per_s": 2 * m**3 / _median(tm),
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.default_backend(),
    }


def _bf16_model(preset: str, num_layers: int | None = None):
    import jax.numpy as jnp

    from jaxflow.models import PRESETS

    cfg = PRESETS[preset].replace(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    if num_layers:
        cfg = cfg.replace(num_layers=num_layers)
    return init_random(cfg)


def init_random(cfg):
    """A random model of ``cfg`` (HF's init: N(0, 0.02) weights, unit norms): on an
    accelerator `init_model` as one compiled program; on CPU drawn by NumPy, which compiles
    nothing (the compiled init takes ~3 s for a one-layer toy model there, eager ~5 s)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxflow.models import init_model

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: init_model(cfg, "lm", seed=0)))
    if jax.default_backend() != "cpu":
        return nnx.merge(graphdef, jax.jit(lambda: nnx.split(init_model(cfg, "lm", seed=0))[1])())
    rng = np.random.default_rng(0)

    def draw(path, x):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray((0.02 * rng.standard_normal(x.shape, np.float32)).astype(x.dtype))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, abstract))


def engine_call(model, B, P, R, n=1, **kw):
    """A function that runs `generate` of B prompts x n samples, P prompt tokens -> R new
    (every row to R: no EOS), a new seed per call, and returns its output when done."""
    import numpy as np

    from jaxflow.sampling import EngineOptions, SamplingParams, generate

    rng = np.random.default_rng(0)
    ids = rng.integers(3, model.cfg.vocab_size - 1, (B, P)).astype(np.int32)
    mask = np.ones_like(ids)
    seeds = iter(range(1000))

    def call():
        params = SamplingParams(max_new_tokens=R, n=n, temperature=1.0, eos_token_ids=(), seed=next(seeds))
        out = generate(model, ids, mask, params, options=EngineOptions(**kw))
        out.responses.block_until_ready()
        return out

    return call


def engine_run(model, B, P, R, reps, n=1, **kw) -> dict:
    """``engine_call``'s first call and ``reps`` timed calls (medians over those)."""
    call = engine_call(model, B, P, R, n, **kw)
    first, times = _timed(call, reps)
    out = call()
    steps = int(out.num_steps)
    stats = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in out.stats.items()}
    return {
        "rows": B * n,
        "R": R,
        "first_call_s": first,
        "seconds": times,
        "tok_s": B * n * R / _median(times),
        "steps": steps,
        "ms_per_step": _median(times) / steps * 1e3,
        "stats": stats,
    }


def engine(a, sizes, ceil, rl_rows) -> dict:
    e = sizes["engine"]
    model = _bf16_model(sizes["preset"], sizes["layers"])
    n = e.get("n", 1)
    res = {"default": engine_run(model, e["B"], e["P"], e["R"], a.reps, n=n)}
    for name in filter(None, a.engine_variants.split(",")):
        res[name] = engine_run(model, e["B"], e["P"], e["R"], a.reps, n=n, **ENGINE_VARIANTS[name])
    if rl_rows == dict(prompts=e["B"], n=n, P=e["P"], R=e["R"]):
        res["rl_rows"] = res["default"]
    elif rl_rows:
        res["rl_rows"] = engine_run(model, rl_rows["prompts"], rl_rows["P"], rl_rows["R"], a.reps, n=rl_rows["n"])
    mean_cached = e["P"] + e["R"] / 2
    if ceil:
        bound_s = decode_bytes_per_step(model.cfg, e["B"] * n, mean_cached) / ceil["copy_bytes_per_s"]
        res["hbm_bound_ms_per_step_analytic"] = bound_s * 1e3
        res["fraction_of_hbm_bound"] = bound_s * 1e3 / res["default"]["ms_per_step"]
    return res


def device_trace(call, top: int = 25) -> dict:
    """``call()`` traced by `jax.profiler`: wall seconds, device kernels, the share of the wall
    time some kernel ran (busy), and the ``top`` kernels by summed device seconds."""
    import jax

    with tempfile.TemporaryDirectory() as td:
        jax.profiler.start_trace(td, create_perfetto_trace=True)
        t0 = time.perf_counter()
        call()
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        paths = sorted(glob.glob(os.path.join(td, "**", "perfetto_trace.json.gz"), recursive=True))
        with gzip.open(paths[-1]) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {p for p, n in names.items() if any(s in n.lower() for s in ("gpu", "tpu", "/device:"))}
    spans, by_name, counts, args = [], {}, {}, {}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("pid") in device and ev.get("dur"):
            spans.append((ev["ts"], ev["ts"] + ev["dur"]))
            by_name[ev["name"]] = by_name.get(ev["name"], 0.0) + ev["dur"] / 1e6
            counts[ev["name"]] = counts.get(ev["name"], 0) + 1
            args.setdefault(ev["name"], ev.get("args", {}))
    spans.sort()
    busy, start, end = 0.0, None, None
    for s, t in spans:
        if end is None or s > end:
            busy += 0 if end is None else end - start
            start, end = s, t
        else:
            end = max(end, t)
    busy += 0 if end is None else end - start
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "wall_s": wall,
        "device_events": len(spans),
        "device_s": sum(by_name.values()),
        "busy_share": busy / 1e6 / wall if spans else None,
        "top_kernels_s": [(k[:100], counts[k], round(v, 5)) for k, v in ranked],
        "top_kernel_args": {k[:100]: {a: str(x)[:200] for a, x in args[k].items()} for k, _ in ranked[:12]},
        "processes": sorted(set(names.values()))[:10],
    }


def _dump(text: str, path: str | None) -> None:
    if path:
        with gzip.open(path, "wt") as f:
            f.write(text)


def profile(sizes, dump_dir: str | None = None) -> dict:
    """One traced engine call: device kernels per decode step, busy share, top kernels (and
    the compiled program's HLO into ``dump_dir``, whose fusion names the kernels carry)."""
    import numpy as np
    from flax import nnx

    from jaxflow.sampling import SamplingParams, lower_generate

    e = sizes["engine"]
    model = _bf16_model(sizes["preset"], sizes["layers"])
    R = min(e["R"], 64)
    call = engine_call(model, e["B"], e["P"], R, e.get("n", 1))
    call()
    if dump_dir:
        ids = np.ones((e["B"], e["P"]), np.int32)
        params = SamplingParams(max_new_tokens=R, temperature=1.0, eos_token_ids=())
        hlo = lower_generate(*nnx.split(model), ids, ids, params).compile().as_text()
        _dump(hlo, os.path.join(dump_dir, "engine_hlo.txt.gz"))
    out = []
    trace = device_trace(lambda: out.append(call()))
    steps = int(out[0].num_steps)  # decode steps; the prefill's kernels count in too
    return dict(trace, R=R, steps=steps, kernels_per_step=trace["device_events"] / steps)


def train(preset, rows, P, R, reps, peak, ceil, num_layers=None, variant=None, profiled=False, dump_dir=None) -> dict:
    """The actor's train step: float32 masters, bf16 compute (the accelerator default), GRPO
    loss with the KL loss, one mini-batch of ``rows``; ``variant`` names `TRAIN_VARIANTS`' model
    fields to change."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflow.configs.resolve import with_attention
    from jaxflow.models import PRESETS
    from jaxflow.workers import ActorConfig, ActorWorker, OptimConfig, RolloutConfig

    cfg = PRESETS[preset].replace(param_dtype=jnp.float32, dtype=jnp.bfloat16)
    if num_layers:
        cfg = cfg.replace(num_layers=num_layers)
    cfg = with_attention(cfg, jax.default_backend())  # what a run resolves
    if variant:
        cfg = cfg.replace(**TRAIN_VARIANTS[variant])
    model = init_random(cfg)
    V = cfg.vocab_size
    rng = np.random.default_rng(0)
    host = {
        "prompt_ids": rng.integers(4, V - 10, (rows, P)).astype(np.int32),
        "prompt_mask": np.ones((rows, P), np.int32),
        "responses": rng.integers(4, V - 10, (rows, R)).astype(np.int32),
        "response_mask": np.ones((rows, R), np.int32),
        "advantages": rng.normal(size=(rows, R)).astype(np.float32),
        "ref_log_prob": np.full((rows, R), -np.log(V), np.float32),
    }
    config = ActorConfig(ppo_mini_batch_size=rows, use_kl_loss=True, kl_loss_coef=0.001, optim=OptimConfig(lr=1e-6))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    actor = ActorWorker(model, mesh, "train", config, RolloutConfig())
    del model
    host = {k: host[k] for k in config.update_keys(on_policy=True)}
    step = actor.train_program(rows, on_policy=True)
    inputs, _ = actor.place_minibatch(host, np.arange(rows))
    scalars = {"temperature": np.float32(1.0)}

    def call():
        actor.state, m = step(actor.state, inputs, scalars)
        jax.block_until_ready(m)

    first, times = _timed(call, reps)
    flops = train_flops(cfg, rows, P, R)
    trace = device_trace(call) if profiled else None
    if profiled and dump_dir:
        with contextlib.suppress(Exception):
            _dump(
                step.lower(actor.state, inputs, scalars).compile().as_text(), os.path.join(dump_dir, "train_hlo.txt.gz")
            )
    res = {
        "attention_impl": cfg.attention_impl,
        "scan_layers": cfg.scan_layers,
        "rows": rows,
        "P": P,
        "R": R,
        "first_call_s": first,
        "seconds": times,
        "analytic_tflop": flops / 1e12,
        "tflop_per_s": flops / _median(times) / 1e12,
        "mfu_vs_peak": flops / _median(times) / peak,
    }
    if ceil:
        res["mfu_vs_measured_matmul"] = flops / _median(times) / ceil["matmul_flop_per_s"]
    if trace:
        res["profile"] = trace
    with contextlib.suppress(Exception):
        res["peak_bytes_in_use"] = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
    res["first_step_metrics"] = {
        k: float(v) for k, v in jax.device_get(first_metrics(actor, step, inputs, scalars)).items()
    }
    return res


def first_metrics(actor, step, inputs, scalars):
    """The step's metrics on the state it has now (for comparing attention implementations),
    with the timed calls' inputs (another scalar type would compile the step again)."""
    _, m = step(actor.state, inputs, scalars)
    return m


def wide(a, sizes, ceil) -> dict:
    w = sizes["wide"]
    layers = a.wide_layers if not a.tiny else None
    model = _bf16_model(w["preset"], layers)
    res = {"preset": w["preset"], "layers": model.cfg.num_layers}
    res["engine"] = engine_run(model, w["B"], w["P"], w["R"], a.reps)
    if ceil:
        bound = decode_bytes_per_step(model.cfg, w["B"], w["P"] + w["R"] / 2) / ceil["copy_bytes_per_s"]
        res["hbm_bound_ms_per_step_analytic"] = bound * 1e3
        res["fraction_of_hbm_bound"] = bound * 1e3 / res["engine"]["ms_per_step"]
    del model
    res["train"] = train(w["preset"], w["rows"], w["tP"], w["tR"], a.reps, a.peak, ceil, layers)
    return res


# ---------------------------------------------------------------------- driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU, about a minute)")
    ap.add_argument(
        "--phases",
        default=None,
        help=f"comma list of {PHASES} (default: all but {OPT_IN}; --tiny: all but {TINY_SKIPS})",
    )
    ap.add_argument("--reps", type=int, default=None, help="timed calls after the warm-up (default: 3; --tiny: 1)")
    ap.add_argument("--peak", type=float, default=989e12, help="dense bf16 FLOP/s of the device (H100/H200 SXM)")
    ap.add_argument("--wide_layers", type=int, default=12)
    ap.add_argument(
        "--engine_variants",
        default="",
        help=f"comma list of {sorted(ENGINE_VARIANTS)}: more engine runs (default: none)",
    )
    ap.add_argument(
        "--train_variants",
        default="",
        help=f"comma list of {sorted(TRAIN_VARIANTS)}: more train-step runs (default: none)",
    )
    ap.add_argument(
        "--rl_variants", default="default", help=f"comma list of {sorted(RL_VARIANTS)}: a cold and a warm run of each"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--dump_hlo", default=None, help="folder for the profiled programs' compiled HLO (gzip)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--payload", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(WORKERS[a.worker](json.loads(a.payload)), default=str))
        return 0
    sizes = TINY if a.tiny else FULL
    if a.reps is None:
        a.reps = 1 if a.tiny else 3
    if a.phases is None:
        a.phases = ",".join(p for p in PHASES if p not in (TINY_SKIPS if a.tiny else OPT_IN))
    phases = [p for p in a.phases.split(",") if p]
    for flag, given, known in (
        ("--phases", phases, PHASES),
        ("--train_variants", a.train_variants.split(","), TRAIN_VARIANTS),
        ("--rl_variants", a.rl_variants.split(","), RL_VARIANTS),
    ):
        unknown = set(filter(None, given)) - set(known)
        if unknown:
            ap.error(f"unknown {flag} {sorted(unknown)}; choose from {sorted(known)}")
    results: dict = {"sizes": sizes, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t_start = time.perf_counter()

    def record(name, fn):
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - one phase's failure is reported, the others still run
            results[name] = {"error": f"{type(e).__name__}: {e}"[:1500], "traceback": traceback.format_exc()[-2500:]}
        results[name + "_wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({name: results[name]}, default=str)[:4000], flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1, default=str)

    ckpt = os.path.join(tempfile.gettempdir(), f"jaxflow_bench_{sizes['preset']}_layers{sizes['layers'] or 'all'}")
    wants_ckpt = {"hf", "torch_train", "rl"} & set(phases)
    if "checkpoint" in phases or (wants_ckpt and not os.path.exists(os.path.join(ckpt, "config.json"))):
        record(
            "checkpoint",
            lambda: _sub(
                "checkpoint",
                {"preset": sizes["preset"], "layers": sizes["layers"], "path": ckpt},
                600,
                {"JAX_PLATFORMS": "cpu"},
            ),
        )
    e, t = sizes["engine"], sizes["train"]
    torch_at = {"hf": dict(path=ckpt, reps=a.reps, **e), "torch_train": dict(path=ckpt, reps=a.reps, **t)}
    torch_at = {name: payload for name, payload in torch_at.items() if name in phases}
    if torch_at:
        t0 = time.perf_counter()
        both = _sub("torch", torch_at, 1800)
        results["torch_wall_s"] = round(time.perf_counter() - t0, 1)
        for name in torch_at:  # a failed process: its error for each phase
            record(name, lambda name=name: both.get(name, both))
    if "rl" in phases:
        for variant in filter(None, a.rl_variants.split(",")):
            flags, xla_flags = RL_VARIANTS[variant]
            rl_at = dict(path=ckpt, rl=sizes["rl"], flags=flags)
            suffix = "" if variant == "default" else f"_{variant}"
            with tempfile.TemporaryDirectory(prefix="jaxflow_cache_") as cache:  # cold, then warm
                env = {"JAX_COMPILATION_CACHE_DIR": cache}
                if xla_flags:
                    env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip()
                record("rl_cold" + suffix, lambda: _sub("rl", rl_at, 1800, env))
                record("rl_warm" + suffix, lambda: _sub("rl", rl_at, 1800, env))
    if "xla_flags" in phases:
        for name, flags in XLA_FLAG_VARIANTS.items():
            env = {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()}
            record(
                f"engine_{name}",
                lambda env=env: _sub(
                    "engine", dict(preset=sizes["preset"], layers=sizes["layers"], reps=a.reps, **e), 600, env
                ),
            )
    ceil = None
    if "ceilings" in phases:
        record("ceilings", lambda: ceilings(a.tiny))
        ceil = results["ceilings"] if "error" not in results["ceilings"] else None
    if "engine" in phases:
        rl = sizes["rl"]
        rl_rows = dict(
            prompts=rl["prompts"], n=rl["n"], P=10, R=rl["R"]
        )  # the RL run's rows (its prompts: 9-10 tokens)
        record("engine", lambda: engine(a, sizes, ceil, rl_rows))
    if "profile" in phases:
        record("profile", lambda: profile(sizes, a.dump_hlo))
    if "train" in phases:
        train_at = dict(preset=sizes["preset"], rows=t["rows"], P=t["P"], R=t["R"], reps=a.reps, peak=a.peak)
        train_at.update(ceil=ceil, num_layers=sizes["layers"])
        record("train", lambda: train(**train_at, profiled=True, dump_dir=a.dump_hlo))
        for variant in filter(None, a.train_variants.split(",")):
            record(f"train_{variant}", lambda variant=variant: train(**train_at, variant=variant))
    if "wide" in phases:
        record("wide", lambda: wide(a, sizes, ceil))
    results["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    print(summary_table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


def _get(d, *path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def summary_table(r: dict) -> str:
    """The headline numbers (measured unless labelled analytic)."""
    rows = []

    def add(label, value, fmt="{:.3g}"):
        rows.append(f"  {label:<58} {'-' if value is None else fmt.format(value)}")

    add("device", _get(r, "ceilings", "device"), "{}")
    add("copy bandwidth GB/s (measured)", (_get(r, "ceilings", "copy_bytes_per_s") or 0) / 1e9 or None)
    add("copy bandwidth GB/s, torch (measured)", (_get(r, "ceilings", "torch_copy_bytes_per_s") or 0) / 1e9 or None)
    add("bf16 matmul TFLOP/s (measured)", (_get(r, "ceilings", "matmul_flop_per_s") or 0) / 1e12 or None)
    add("engine tok/s", _get(r, "engine", "default", "tok_s"), "{:,.0f}")
    add("engine ms per decode step", _get(r, "engine", "default", "ms_per_step"))
    add("engine HBM bound ms per step (analytic)", _get(r, "engine", "hbm_bound_ms_per_step_analytic"))
    add("engine share of the HBM bound", _get(r, "engine", "fraction_of_hbm_bound"), "{:.1%}")
    for name in ENGINE_VARIANTS:
        if _get(r, "engine", name):
            add(f"engine tok/s, {name}", _get(r, "engine", name, "tok_s"), "{:,.0f}")
    for name in XLA_FLAG_VARIANTS:
        add(f"engine tok/s, {name}", _get(r, f"engine_{name}", "tok_s"), "{:,.0f}")
    add("transformers generate tok/s", _get(r, "hf", "tok_s"), "{:,.0f}")
    if _get(r, "hf", "tok_s") and _get(r, "engine", "default", "tok_s"):
        add("engine / transformers", r["engine"]["default"]["tok_s"] / r["hf"]["tok_s"], "{:.2f}x")
    add("decode kernels per step (profile)", _get(r, "profile", "kernels_per_step"), "{:.0f}")
    add("device busy share during decode (profile)", _get(r, "profile", "busy_share"), "{:.1%}")
    add("train step s", _median(_get(r, "train", "seconds") or []))
    add("train MFU vs peak (analytic FLOPs / measured s)", _get(r, "train", "mfu_vs_peak"), "{:.1%}")
    add("train attention", _get(r, "train", "attention_impl"), "{}")
    add("train first call s (compile + run)", _get(r, "train", "first_call_s"))
    for name in TRAIN_VARIANTS:
        if _get(r, f"train_{name}"):
            add(f"train step s, {name}", _median(_get(r, f"train_{name}", "seconds") or []))
            add(f"train MFU vs peak, {name}", _get(r, f"train_{name}", "mfu_vs_peak"), "{:.1%}")
            add(f"train first call s (compile + run), {name}", _get(r, f"train_{name}", "first_call_s"))
    torch_s = _median(_get(r, "torch_train", "seconds") or [])
    if torch_s == torch_s and _get(r, "train", "seconds"):
        add("torch step s / jaxflow step s", torch_s / _median(r["train"]["seconds"]), "{:.2f}x")
    runs = [k for k in r if k.startswith(("rl_cold", "rl_warm")) and not k.endswith("_wall_s")]
    for run in runs:
        steps = _get(r, run, "steps") or []
        if steps:
            last = steps[-1]
            add(f"{run}: first step after start s", steps[0].get("perf/time_to_first_step_s"))
            add(f"{run}: last step s (gen / ref / update_actor)", last.get("timing_s/step"))
            add(f"{run}:   gen s", last.get("timing_s/gen"))
            add(f"{run}:   gen engine s", last.get("timing_s/gen_engine"))
    rl = _get(r, "rl_warm", "steps") or _get(r, "rl_cold", "steps")
    alone = _get(r, "engine", "rl_rows", "seconds")
    if rl and alone:
        add("RL gen phase: engine alone s / gen s", _median(alone) / rl[-1]["timing_s/gen"], "{:.2f}x")
    add("wide engine share of the HBM bound", _get(r, "wide", "fraction_of_hbm_bound"), "{:.1%}")
    add("wide train MFU vs peak", _get(r, "wide", "train", "mfu_vs_peak"), "{:.1%}")
    add("total wall s", r.get("total_wall_s"))
    return "bench_accelerator:\n" + "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
