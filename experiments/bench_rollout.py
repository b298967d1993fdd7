"""Rollout throughput on two workloads: jaxflow's engine vs HF transformers ``generate``, and vs
jaxflow's old static-batch engine (commit 8a519cb, the last one before the paged engine).

Workloads (random weights, fp32 on CPU, the same checkpoint for every engine; Llama-style model:
hidden 512, 8 layers, 8 heads, 2 kv heads, vocab 32000; ``--model tiny`` and ``--prompts`` /
``--max_new_tokens`` shrink everything for a smoke test):

- ``static``: 32 prompts x 64 tokens, exactly 128 new tokens per row (EOS ignored): the
  workload of ``bench_sampling.py``.
- ``rl``: 32 prompts x n=8 samples, prompt 64 tokens, responses up to 512 tokens. Each
  response's length is drawn once from a seeded log-normal (median 96, sigma 1, capped at 512)
  and enforced in every engine: jaxflow through the per-row ``max_new_tokens``, transformers
  through a logits processor that bans EOS before the row's length and forces it there (its
  tokens are counted up to that EOS). The old static engine cannot stop rows on their own;
  it decodes every row to the longest length and only the drawn lengths are counted.

Throughput is *useful* tokens (the drawn lengths, or 32 x 128) per second of wall time, the
median and the best of ``--reps`` timed calls after one full-length warm-up call, each engine in
its own child process; ``--rounds`` (default 3) alternates the engines; transformers runs once
per ``--hf_threads`` setting (default ``1,0``: one thread and torch's default) and the fastest
is compared. Compile time (XLA backend compile events) is reported separately.

KV memory: jaxflow's pool as allocated and its peak in use (measured by the engine), against
the static engine's cache (analytic: layers x rows x kv heads x (P + R) x head_dim x (k, v) x
4 bytes).

Roofline: this machine's memory bandwidth (a large array reduction) and fp32 matmul FLOP/s (at
the decode step's shape) are measured in the same run. jaxflow's decode step is timed alone
(`bench_sampling.decode_step_seconds`: rollouts whose rows run ``--step_tokens`` short and long,
the difference per decode step, measured) and compared with the analytic step time at its
batch (the decode slots) and mean cache length: max(bytes / bandwidth, FLOPs / FLOP/s).

The static engine's tree: ``--static_tree`` (default ``/tmp/jaxflow_static_8a519cb``) is created
when missing with ``git -C <this repo> worktree add <path> 8a519cb`` and must be at that commit.

    python experiments/bench_rollout.py --workload rl
    python experiments/bench_rollout.py --workload static --greedy --json
    python experiments/bench_rollout.py --workload rl --model tiny --prompts 4 --max_new_tokens 32 \
        --rounds 1 --reps 1 --hf_threads 1 --step_tokens 4,12          # smoke test
    python experiments/bench_rollout.py --tiny --engines jaxflow,transformers    # the same, shorter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WORKLOADS = {
    "static": dict(prompts=32, n=1, prompt_len=64, max_new_tokens=128, lengths="fixed", slots=0, step_tokens=(32, 128)),
    "rl": dict(
        prompts=32, n=8, prompt_len=64, max_new_tokens=512, lengths="lognormal", slots=64, step_tokens=(64, 192)
    ),
}
MODELS = {
    "default": dict(vocab=32000, hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=2),
    "tiny": dict(vocab=1000, hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2),
}
EOS = 2  # the checkpoint's EOS id (transformers forces it at a row's length)
STATIC_COMMIT = "8a519cb5f058b5c8d821f4675b0dcebbffd5e898"  # the last commit before the paged engine


# --tiny: the smoke test's settings; flags given beside it still apply.
TINY = dict(model="tiny", prompts=4, max_new_tokens=32, rounds=1, reps=1, hf_threads="1", step_tokens="4,12")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model, 4 prompts, 32 tokens, one call: a smoke test")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="rl")
    p.add_argument(
        "--engines",
        default="jaxflow,static,transformers",
        help="comma-separated: jaxflow (this tree), static (--static_tree), transformers",
    )
    p.add_argument(
        "--static_tree",
        default="/tmp/jaxflow_static_8a519cb",
        help="a worktree of the old static-batch engine at 8a519cb (created when missing)",
    )
    p.add_argument("--greedy", action="store_true", help="greedy instead of sampling at temperature 1")
    p.add_argument("--reps", type=int, default=3, help="timed calls per engine and round")
    p.add_argument("--rounds", type=int, default=3, help="alternate the engines this many times")
    p.add_argument("--hf_threads", default="1,0", help="torch thread counts to time (0: torch's default)")
    p.add_argument("--model", choices=sorted(MODELS), default="default", help="model size (tiny: smoke tests)")
    p.add_argument("--prompts", type=int, default=0, help="prompts of the workload (0: the workload's)")
    p.add_argument("--max_new_tokens", type=int, default=0, help="response cap of the workload (0: the workload's)")
    p.add_argument(
        "--step_tokens", default="", help="short,long row lengths of the decode-step timing (default: the workload's)"
    )
    p.add_argument(
        "--slots",
        type=int,
        default=0,
        help="jaxflow decode slots (0: the workload's: 64 for rl, the engine's default for static)",
    )
    p.add_argument("--page_size", type=int, default=0, help="jaxflow KV page size (0: the engine's default)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    p.add_argument("--_checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--_threads", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        p.set_defaults(**TINY)
        args = p.parse_args(argv)
    return args


def workload(args) -> dict:
    """The workload's settings with the command line's overrides."""
    w = dict(WORKLOADS[args.workload])
    if args.prompts:
        w["prompts"] = args.prompts
    if args.max_new_tokens:
        w["max_new_tokens"] = args.max_new_tokens
    if args.step_tokens:
        w["step_tokens"] = tuple(int(x) for x in args.step_tokens.split(","))
    short, long = w["step_tokens"]
    w["step_tokens"] = (min(short, w["max_new_tokens"]), min(long, w["max_new_tokens"]))
    return w


def workload_rows(args) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt ids and mask [prompts, P] and each response's length [prompts * n] (seeded)."""
    w = workload(args)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, MODELS[args.model]["vocab"], size=(w["prompts"], w["prompt_len"])).astype(np.int32)
    rows = w["prompts"] * w["n"]
    if w["lengths"] == "fixed":
        lengths = np.full(rows, w["max_new_tokens"], np.int32)
    else:
        draw = np.random.default_rng(1).lognormal(mean=np.log(96.0), sigma=1.0, size=rows)
        lengths = np.clip(np.round(draw), 1, w["max_new_tokens"]).astype(np.int32)
    return ids, np.ones_like(ids), lengths


class _CompileTimer:
    """Sums XLA backend compile time while active."""

    def __init__(self):
        self.seconds = 0.0

    def _listener(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.seconds += duration

    def __enter__(self):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._listener)


def _timed(call, reps: int) -> tuple[float, list[float], float]:
    with _CompileTimer() as timer:
        t0 = time.perf_counter()
        call()
        first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return first, times, timer.seconds


def static_cache_bytes(args) -> int:
    """The old static engine's cache (analytic): [layers, rows, kv_heads, P + R slots,
    head_dim] x (k, v) x float32, P and R its buckets (powers of two >= 16)."""
    w, m = workload(args), MODELS[args.model]
    slots = _bucket(w["prompt_len"]) + _bucket(w["max_new_tokens"])
    return 2 * m["layers"] * w["prompts"] * w["n"] * m["kv_heads"] * slots * (m["hidden"] // m["heads"]) * 4


def bench_jaxflow(path: str, args, per_row: bool) -> dict:
    """This tree's engine (``per_row``: per-row limits, the workload's slots, and the decode
    step timed alone) or the old static engine (no per-row limits)."""
    import jax
    import jax.numpy as jnp

    from jaxflow.models import from_pretrained
    from jaxflow.sampling import EngineOptions, SamplingParams, generate

    w = workload(args)
    ids, mask, lengths = workload_rows(args)
    model = from_pretrained(path, dtype=jnp.float32)
    params = SamplingParams(
        max_new_tokens=w["max_new_tokens"], greedy=args.greedy, temperature=1.0, n=w["n"], eos_token_ids=(), seed=0
    )
    engine = EngineOptions()
    if per_row:
        engine = EngineOptions(
            slots=(args.slots or w["slots"]) or None, page_size=args.page_size or EngineOptions().page_size
        )
    result = {}

    def call():
        out = generate(model, ids, mask, params, options=engine, max_new_tokens=lengths if per_row else None)
        jax.block_until_ready(out.responses)
        result["out"] = out

    first, times, compile_s = _timed(call, args.reps)
    out = result["out"]
    got = np.asarray(out.lengths)
    if per_row:
        assert (got == lengths).all(), "the engine did not enforce the per-row lengths"
    stats = {
        k: np.asarray(v).tolist() if hasattr(v, "shape") else v for k, v in (getattr(out, "stats", None) or {}).items()
    }
    useful = int(lengths.sum())
    res = dict(
        times=times,
        median_s=statistics.median(times),
        best_s=min(times),
        first_call_s=first,
        compile_s=compile_s,
        useful_tokens=useful,
        tokens_per_s=useful / statistics.median(times),
        best_tokens_per_s=useful / min(times),
        decoded_tokens=int(got.sum()),
        stats=stats,
    )
    if per_row:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_sampling import decode_step_seconds

        short, long = w["step_tokens"]
        res["decode_step"] = dict(
            decode_step_seconds(model, ids, mask, params, short=short, long=long, reps=args.reps, options=engine),
            mean_kv_tokens=w["prompt_len"] + (short + long) / 2,
        )
    return res


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _hf_lengths(responses: np.ndarray) -> np.ndarray:
    """Tokens each transformers row generated: up to and including its first EOS (every
    row ends with one, forced at its length; a sampled token 0 is a token like any other),
    or the whole width when it has none."""
    has_eos = (responses == EOS).any(axis=1)
    return np.where(has_eos, np.argmax(responses == EOS, axis=1) + 1, responses.shape[1])


def bench_hf(path: str, args) -> dict:
    import torch
    import transformers

    if args._threads:
        torch.set_num_threads(args._threads)
    w = workload(args)
    ids, mask, lengths = workload_rows(args)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    input_ids, attention_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
    P = ids.shape[1]
    limit = torch.tensor(lengths, dtype=torch.long)

    class ForceLength(transformers.LogitsProcessor):
        """Row r emits EOS exactly as its token number lengths[r] (and never before)."""

        def __call__(self, input_ids, scores):
            produced = input_ids.shape[1] - P  # tokens already generated
            at_end = (produced + 1 == limit)[:, None]
            eos_col = torch.zeros_like(scores, dtype=torch.bool)
            eos_col[:, EOS] = True
            scores = scores.masked_fill(eos_col & ~at_end, -float("inf"))
            return scores.masked_fill(at_end & ~eos_col, -float("inf"))

    fixed = w["lengths"] == "fixed"
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if not args.greedy else dict(do_sample=False)
    if fixed:
        kw.update(min_new_tokens=w["max_new_tokens"], eos_token_id=None)
    else:
        kw.update(logits_processor=transformers.LogitsProcessorList([ForceLength()]), eos_token_id=EOS)

    result = {}

    def call():
        with torch.inference_mode():
            result["out"] = model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=w["max_new_tokens"],
                num_return_sequences=w["n"],
                pad_token_id=0,
                **kw,
            )

    first, times, _ = _timed(call, args.reps)
    out = result["out"][:, P:].numpy()
    got = _hf_lengths(out) if not fixed else np.full(len(lengths), out.shape[1])
    assert (got == lengths).all(), (got[:8], lengths[:8])
    useful = int(lengths.sum())
    return dict(
        times=times,
        median_s=statistics.median(times),
        best_s=min(times),
        first_call_s=first,
        useful_tokens=useful,
        tokens_per_s=useful / statistics.median(times),
        best_tokens_per_s=useful / min(times),
        torch_threads=torch.get_num_threads(),
    )


def measure_machine(args) -> dict:
    """Measured in this run: memory bandwidth (reading a 512 MiB array) and fp32 matmul FLOP/s
    at the decode step's shape (the slots x hidden activations times every layer's MLP
    weights, read from DRAM like the decode step), best of 5 each, with XLA on this machine."""
    import jax
    import jax.numpy as jnp

    m, w = MODELS[args.model], workload(args)
    x = jnp.ones((128 * 1024 * 1024,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    bw = []
    for _ in range(5):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        bw.append(x.nbytes / (time.perf_counter() - t0))
    rows = args.slots or w["slots"] or w["prompts"] * w["n"]
    a = jnp.ones((rows, m["hidden"]), jnp.float32)
    b = jnp.ones((m["layers"], m["hidden"], m["intermediate"]), jnp.float32)
    mm = jax.jit(lambda a, b: jnp.einsum("bd,ldf->lbf", a, b))
    mm(a, b).block_until_ready()
    fl = []
    for _ in range(5):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        fl.append(2 * rows * m["hidden"] * m["intermediate"] * m["layers"] / (time.perf_counter() - t0))
    return dict(bandwidth_bytes_per_s=max(bw), matmul_flops_decode_shape=max(fl))


def roofline_step(args, machine: dict, batch: int, mean_kv_tokens: float) -> dict:
    """Analytic decode step time: one step of ``batch`` rows reads every weight once plus each
    row's KV cache (``mean_kv_tokens`` tokens) and does 2 FLOPs per weight per row (+ the
    attention's 4 * kv_tokens * H * K); step time = max(bytes / bandwidth, FLOPs / FLOP/s)
    with the bandwidth and FLOP/s measured in this run."""
    D, F, L, H, N, V = (
        MODELS[args.model][k] for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab")
    )
    K = D // H
    weights = L * (D * H * K * 2 + D * N * K * 2 + 3 * D * F) + V * D  # per layer + LM head (embedding: a gather)
    kv_bytes_per_token = 2 * L * N * K * 4
    step_bytes = 4 * weights + batch * mean_kv_tokens * kv_bytes_per_token
    step_flops = batch * (2 * weights + 4 * L * mean_kv_tokens * H * K)
    t = max(step_bytes / machine["bandwidth_bytes_per_s"], step_flops / machine["matmul_flops_decode_shape"])
    return dict(step_bytes=step_bytes, step_flops=step_flops, step_s=t, tokens_per_s=batch / t)


def static_tree(path: str) -> str:
    """The old static engine's worktree at `STATIC_COMMIT` (``git worktree add`` when missing)."""
    if not os.path.isdir(path):
        subprocess.run(
            ["git", "-C", REPO, "worktree", "add", "--detach", path, STATIC_COMMIT],
            check=True,
            capture_output=True,
            text=True,
        )
    head = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if head != STATIC_COMMIT:
        raise SystemExit(
            f"--static_tree {path} is at {head or 'no git commit'}, not {STATIC_COMMIT[:7]} (the last "
            "commit before the paged engine); remove it or name another path"
        )
    return path


def _run_worker(engine: str, checkpoint: str, argv: list[str], tree: str, threads: int = 0) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        *argv,
        "--_worker",
        engine,
        "--_checkpoint",
        checkpoint,
        "--_threads",
        str(threads),
    ]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{engine} benchmark failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _load_avg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _steal() -> tuple[int, int]:
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return cpu[7], sum(cpu)


def _summary(args, runs: dict[str, list[dict]], machine: dict, load: list[str], steal: float) -> dict:
    w = workload(args)
    _, _, lengths = workload_rows(args)
    summary = {}
    for name, rs in runs.items():
        tps = [r["useful_tokens"] / t for r in rs for t in r["times"]]
        summary[name] = dict(
            median_tokens_per_s=statistics.median(tps),
            best_tokens_per_s=max(tps),
            calls_tokens_per_s=tps,
            compile_s=[r.get("compile_s") for r in rs],
            first_call_s=[r["first_call_s"] for r in rs],
            stats=rs[-1].get("stats"),
        )
        if "decode_step" in rs[-1]:
            summary[name]["decode_step"] = [r["decode_step"] for r in rs]
    result = dict(
        workload=dict(
            w,
            name=args.workload,
            useful_tokens=int(lengths.sum()),
            mean_length=float(lengths.mean()),
            max_length=int(lengths.max()),
            mode="greedy" if args.greedy else "sample T=1",
            model=MODELS[args.model],
            dtype="float32",
        ),
        machine=dict(machine, load_avg_during=load, steal_fraction=steal, cpu_count=os.cpu_count()),
        engines=summary,
    )
    hf = [s for n, s in summary.items() if n.startswith("transformers")]
    if hf:
        best_hf = max(hf, key=lambda s: s["median_tokens_per_s"])
        result["transformers_fastest_median_tokens_per_s"] = best_hf["median_tokens_per_s"]
    if "jaxflow" in summary and "static" in summary:
        result["ratio_jaxflow_over_static_median"] = (
            summary["jaxflow"]["median_tokens_per_s"] / summary["static"]["median_tokens_per_s"]
        )
    if "jaxflow" in summary and hf:
        result["ratio_jaxflow_over_transformers_median"] = (
            summary["jaxflow"]["median_tokens_per_s"] / result["transformers_fastest_median_tokens_per_s"]
        )
        result["ratio_jaxflow_over_transformers_best"] = summary["jaxflow"]["best_tokens_per_s"] / max(
            s["best_tokens_per_s"] for s in hf
        )
    if "jaxflow" in summary:
        st = summary["jaxflow"]["stats"]
        static_bytes = static_cache_bytes(args)
        peak = st["peak_kv_bytes"]
        result["kv_memory"] = dict(
            jaxflow_allocated_bytes=st["kv_pool_bytes"],
            jaxflow_peak_in_use_bytes=peak,
            static_engine_bytes=static_bytes,
            label="jaxflow: allocated, and peak in use measured by the engine; "
            "static engine: analytic (its cache [layers, rows, kv_heads, P + R, head_dim] x (k, v) x fp32)",
            ratio_allocated_over_static=st["kv_pool_bytes"] / static_bytes,
            ratio_peak_over_static=peak / static_bytes,
        )
        steps = summary["jaxflow"]["decode_step"]
        step_s = statistics.median(d["step_s"] for d in steps)
        roof = roofline_step(args, machine, steps[-1]["slots"], steps[-1]["mean_kv_tokens"])
        result["roofline"] = dict(
            roof,
            batch=steps[-1]["slots"],
            mean_kv_tokens=steps[-1]["mean_kv_tokens"],
            measured_step_s=step_s,
            measured_step_s_rounds=[d["step_s"] for d in steps],
            share=roof["step_s"] / step_s,
            label="the decode step's own time (measured: rollouts of two lengths, the difference per step) vs the "
            "analytic step time from the bandwidth and FLOP/s measured in this run",
        )
    return result


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args._worker:
        if args._worker == "transformers":
            res = bench_hf(args._checkpoint, args)
        elif args._worker == "machine":
            res = measure_machine(args)
        else:
            res = bench_jaxflow(args._checkpoint, args, per_row=args._worker == "jaxflow")
        print(json.dumps(res))
        return {}
    sys.path.insert(0, REPO)
    from jaxflow.models import ModelConfig, init_model, save_pretrained

    engines = [e for e in args.engines.split(",") if e]
    trees = {"jaxflow": REPO, "transformers": REPO}
    if "static" in engines:
        trees["static"] = static_tree(args.static_tree)
    threads = [int(t) for t in args.hf_threads.split(",")]
    passthrough = [a for a in argv if a != "--json"]
    runs: dict[str, list[dict]] = {}
    load, steal0 = [], _steal()
    m = MODELS[args.model]
    cfg = ModelConfig(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["intermediate"],
        num_layers=m["layers"],
        num_heads=m["heads"],
        num_kv_heads=m["kv_heads"],
        head_dim=m["hidden"] // m["heads"],
        max_position_embeddings=4096,
        eos_token_id=EOS,
    )
    with tempfile.TemporaryDirectory() as path:
        save_pretrained(init_model(cfg, seed=0), path)
        machine = _run_worker("machine", path, passthrough, REPO)
        for _ in range(args.rounds):
            for engine in engines:
                for t in threads if engine == "transformers" else [0]:
                    name = f"transformers ({t or 'default'} threads)" if engine == "transformers" else engine
                    runs.setdefault(name, []).append(_run_worker(engine, path, passthrough, trees[engine], t))
                    load.append(_load_avg())
    steal1 = _steal()
    result = _summary(args, runs, machine, load, (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1]))
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(f"workload {args.workload}: {result['workload']}")
    print(
        f"machine (measured): {machine['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"{machine['matmul_flops_decode_shape'] / 1e9:.1f} GFLOP/s at the decode shape; load {load}; "
        f"steal {result['machine']['steal_fraction']:.1%}"
    )
    print(f"{'engine':<30}{'median tok/s':>14}{'best tok/s':>12}   compile s   every call")
    for name, s in result["engines"].items():
        calls = ", ".join(f"{x:.0f}" for x in s["calls_tokens_per_s"])
        comp = ",".join(f"{c:.1f}" for c in s["compile_s"] if c is not None)
        print(f"{name:<30}{s['median_tokens_per_s']:>14.1f}{s['best_tokens_per_s']:>12.1f}   {comp:>9}   {calls}")
    for k, v in result.items():
        if k.startswith("ratio"):
            print(f"{k}: {v:.3f}")
    if "kv_memory" in result:
        kv = result["kv_memory"]
        print(
            f"KV cache: jaxflow allocated {kv['jaxflow_allocated_bytes'] / 2**20:.1f} MiB, peak in use "
            f"{kv['jaxflow_peak_in_use_bytes'] / 2**20:.1f} MiB (measured); static engine "
            f"{kv['static_engine_bytes'] / 2**20:.1f} MiB (analytic); allocated / static "
            f"{kv['ratio_allocated_over_static']:.3f}, peak / static {kv['ratio_peak_over_static']:.3f}"
        )
    if "roofline" in result:
        r = result["roofline"]
        print(
            f"decode step: {r['measured_step_s'] * 1e3:.2f} ms measured at {r['batch']} slots, ~{r['mean_kv_tokens']:.0f} "
            f"cached tokens; roofline {r['step_s'] * 1e3:.2f} ms (analytic from the measured BW/FLOP/s): "
            f"share {r['share']:.1%}"
        )
    return result


if __name__ == "__main__":
    main()
