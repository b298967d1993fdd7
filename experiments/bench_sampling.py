"""Rollout throughput: jaxflow's compiled decode loop vs HF transformers ``generate``; and the
decode step alone, greedy vs sampling, with a profile of where its time goes.

One fixed workload on random weights (Llama-style by default: hidden 512, 8 layers, 8 heads,
2 kv heads, vocab 32000; batch 32, prompt 64, exactly 128 new tokens with EOS ignored),
fp32 on CPU for both. The same checkpoint (written once with jaxflow's ``save_pretrained``)
is loaded by jaxflow and by transformers (torch CPU). Each engine runs in its own child
process, one after the other, so that neither's thread pools disturb the other. jaxflow's
compile time is reported separately: its throughput is the median of ``--reps`` warm calls;
transformers gets one short warm-up call before its timed calls. ``--hf_threads 1,0`` (the
default) times transformers once per torch thread count (0: torch's default) and the ratio
uses the fastest.

``--decode_step``: in one process, greedy and T=1 sampling alternated ``--rounds`` times, the
decode step's own time (`decode_step_seconds`: two rollouts of the same program whose rows
run exactly ``--short`` and ``--new_tokens`` tokens; the difference over the difference in
decode steps, so prefill, admission and the call overhead cancel out), then a profile of one
rollout per mode (`profile_decode_step`: XLA:CPU thunk times from ``jax.profiler``, mapped to
the named scopes of their HLO ops: sample, log_prob, lm_head, paged_attention, the layers'
projections and MLP, scheduling). All measured.

    python experiments/bench_sampling.py                   # the default workload
    python experiments/bench_sampling.py --batch 8 --new_tokens 32 --json
    python experiments/bench_sampling.py --decode_step --rounds 3
    python experiments/bench_sampling.py --tiny [--decode_step]   # a smoke test of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxflow.models import ModelConfig, from_pretrained, init_model, save_pretrained  # noqa: E402
from jaxflow.sampling import EngineOptions, SamplingParams, generate  # noqa: E402

# --tiny: every size small (a smoke test of the script, seconds); flags given beside it still apply.
TINY = dict(
    batch=2,
    prompt_len=8,
    new_tokens=8,
    short=4,
    hidden=64,
    intermediate=128,
    layers=1,
    heads=4,
    kv_heads=2,
    vocab=256,
    reps=1,
    hf_threads="1",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test of the script")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--greedy", action="store_true", help="greedy instead of sampling at temperature 1")
    p.add_argument("--reps", type=int, default=3, help="timed jaxflow calls (median reported)")
    p.add_argument("--hf_reps", type=int, default=1, help="timed transformers calls (median reported)")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument(
        "--hf_threads",
        default="1,0",
        help="comma-separated torch thread counts to time transformers with (0: torch's default)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate the engines this many times and keep each one's best run (for a noisy, shared machine)",
    )
    p.add_argument(
        "--decode_step",
        action="store_true",
        help="time and profile the decode step alone, greedy vs T=1 (one process, no transformers)",
    )
    p.add_argument("--short", type=int, default=32, help="--decode_step: tokens of the short rollout")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    # Internal: run one engine on an existing checkpoint and print its JSON result.
    p.add_argument("--_worker", choices=("jaxflow", "transformers"), help=argparse.SUPPRESS)
    p.add_argument("--_checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--_threads", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        p.set_defaults(**TINY)
        args = p.parse_args(argv)
    return args


class _CompileTimer:
    """Sums XLA backend compile time while active."""

    def __init__(self):
        self.seconds = 0.0

    def _listener(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.seconds += duration

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def bench_jaxflow(path: str, ids: np.ndarray, mask: np.ndarray, args) -> dict:
    model = from_pretrained(path, dtype=jnp.float32)
    params = SamplingParams(
        max_new_tokens=args.new_tokens, greedy=args.greedy, temperature=1.0, eos_token_ids=(), seed=0
    )
    with _CompileTimer() as compile_timer:
        t0 = time.perf_counter()
        out = generate(model, ids, mask, params)
        out.responses.block_until_ready()
        first = time.perf_counter() - t0
    lengths = np.asarray(out.lengths)  # EOS ignored: every row runs exactly new_tokens tokens
    assert (lengths == args.new_tokens).all(), lengths
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        out = generate(model, ids, mask, params)
        out.responses.block_until_ready()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return dict(
        seconds=seconds,
        tokens_per_s=ids.shape[0] * args.new_tokens / seconds,
        first_call_s=first,
        compile_s=compile_timer.seconds,
        times=times,
    )


def bench_hf(path: str, ids: np.ndarray, mask: np.ndarray, args) -> dict:
    import torch
    import transformers

    if args._threads:
        torch.set_num_threads(args._threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    input_ids, attention_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def run(new_tokens):
        with torch.inference_mode():
            kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if not args.greedy else dict(do_sample=False)
            return model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                **kw,
            )

    run(4)  # warm-up
    times = []
    for _ in range(args.hf_reps):
        t0 = time.perf_counter()
        out = run(args.new_tokens)
        times.append(time.perf_counter() - t0)
    assert out.shape == (ids.shape[0], ids.shape[1] + args.new_tokens), out.shape
    seconds = statistics.median(times)
    return dict(
        seconds=seconds,
        tokens_per_s=ids.shape[0] * args.new_tokens / seconds,
        times=times,
        torch_threads=torch.get_num_threads(),
        attn_implementation=model.config._attn_implementation,
    )


def decode_step_seconds(
    model,
    ids: np.ndarray,
    mask: np.ndarray,
    params: SamplingParams,
    *,
    short: int,
    long: int,
    reps: int,
    options: EngineOptions = EngineOptions(),
) -> dict:
    """Measured: the decode step's own wall time. Two rollouts of one program (same buckets
    and page pool) whose rows all run exactly ``short`` and ``long`` tokens (``params`` must
    have no EOS ids): step = (median t_long - median t_short) / (steps_long - steps_short),
    steps counted by the engine, calls alternated after a warm-up of each. Prefill,
    admission and the per-call overhead are in both and cancel out; the step's mean cache
    length is about prompt + (short + long) / 2."""
    if params.eos_token_ids != () or params.stop:
        raise ValueError("decode_step_seconds needs rows that run exactly to their limits (eos_token_ids=())")
    rows = ids.shape[0] * params.n

    def run(length: int, opts: EngineOptions = options):
        out = generate(model, ids, mask, params, max_new_tokens=np.full(rows, length, np.int32), options=opts)
        out.responses.block_until_ready()
        return out

    pool = run(long).stats  # the long rollout's pool serves both (one program)
    same_pool = dataclasses.replace(options, kv_tokens=(pool["pages_per_replica"] - 1) * pool["page_size"])
    steps = {length: int(run(length, same_pool).num_steps) for length in (short, long)}
    times: dict[int, list[float]] = {short: [], long: []}
    for _ in range(reps):
        for length in (short, long):
            t0 = time.perf_counter()
            run(length, same_pool)
            times[length].append(time.perf_counter() - t0)
    step = (statistics.median(times[long]) - statistics.median(times[short])) / (steps[long] - steps[short])
    return dict(
        step_s=step,
        steps=steps,
        times={str(k): v for k, v in times.items()},
        slots=pool["slots"],
        waits=int(np.sum(pool["waits"])),
    )


_SCOPES = (
    ("prefill", "/prefill/"),
    ("sample", "/sample/"),
    ("log_prob", "/log_prob/"),
    ("lm_head", "/lm_head/"),
    ("paged_attention", "/paged_attention/"),
)
_LAYER_EINSUMS = ("BLD,DHK", "BLD,DNK", "BLHK,HKD", "BLD,DF", "BLF,FD")


def _part(op_name: str) -> str:
    """The part of the rollout an HLO op belongs to, from its op_name (named scopes, einsums)."""
    for part, scope in _SCOPES:
        if scope in op_name:
            return part
    if any(e in op_name for e in _LAYER_EINSUMS):
        return "layers: projections and MLP"
    return (
        "layers: norms, rope, residual"
        if "/while/body/" in op_name and "rms" in op_name.lower()
        else ("scheduling and other")
    )


def profile_decode_step(
    model,
    ids: np.ndarray,
    mask: np.ndarray,
    params: SamplingParams,
    length: int,
    options: EngineOptions = EngineOptions(),
) -> dict:
    """Measured: XLA:CPU thread time per decode step by part, from a ``jax.profiler`` trace of
    one rollout whose rows run ``length`` tokens. Each thunk event is named after its HLO
    instruction; the compiled HLO of the same program gives that instruction's op_name (the
    named scopes of `jaxflow.sampling.batcher`). Thread time: the sum over XLA's worker
    threads, which run in parallel, so it exceeds wall time."""
    import glob
    import re

    from flax import nnx

    from jaxflow.sampling import lower_generate

    rows = ids.shape[0] * params.n
    limits = np.full(rows, length, np.int32)
    graphdef, state = nnx.split(model)
    hlo = lower_generate(graphdef, state, ids, mask, params, max_new_tokens=limits, options=options).compile().as_text()
    op_of = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = \S+ (\w[\w-]*)\(", line)
        if m and m.group(2) not in ("while", "conditional", "call", "parameter", "get-tuple-element", "tuple"):
            name = re.search(r'op_name="([^"]*)"', line)
            op_of[m.group(1)] = name.group(1) if name else ""
    out = generate(model, ids, mask, params, max_new_tokens=limits, options=options)  # compiled already: warm
    out.responses.block_until_ready()
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        out = generate(model, ids, mask, params, max_new_tokens=limits, options=options)
        out.responses.block_until_ready()
        jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    ops: dict[str, int] = {}
    for op_name in op_of.values():
        ops[_part(op_name)] = ops.get(_part(op_name), 0) + 1
    parts: dict[str, float] = {}
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in op_of:
                    part = _part(op_of[event.name])
                    parts[part] = parts.get(part, 0.0) + event.duration_ns * 1e-9
    steps = int(out.num_steps)
    return dict(
        steps=steps,
        thread_s_per_step={k: v / steps for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        hlo_ops=ops,
    )


def bench_decode_step(args) -> dict:
    """Greedy vs T=1 sampling in this process: `decode_step_seconds` and
    `profile_decode_step` per mode, alternated over ``--rounds``."""
    cfg = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096,
    )
    model = init_model(cfg, seed=0)
    ids, mask = _prompts(args)
    modes = {
        "greedy": SamplingParams(max_new_tokens=args.new_tokens, greedy=True, eos_token_ids=()),
        "sample T=1": SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, eos_token_ids=(), seed=0),
    }
    steps: dict[str, list[dict]] = {m: [] for m in modes}
    profiles: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):  # the order flips every round, so that neither mode always goes first
        for name in list(modes)[:: -1 if r % 2 else 1]:
            steps[name].append(
                decode_step_seconds(
                    model, ids, mask, modes[name], short=args.short, long=args.new_tokens, reps=args.reps
                )
            )
            profiles[name].append(profile_decode_step(model, ids, mask, modes[name], args.new_tokens))
    result = {
        name: dict(
            step_ms_rounds=[r["step_s"] * 1e3 for r in rs],
            step_ms_median=statistics.median(r["step_s"] for r in rs) * 1e3,
            slots=rs[-1]["slots"],
            waits=rs[-1]["waits"],
        )
        for name, rs in steps.items()
    }
    for name, ps in profiles.items():  # the least time of each part over the rounds (the least disturbed)
        parts = {k for p in ps for k in p["thread_s_per_step"]}
        result[name]["profile"] = dict(
            ps[-1], thread_s_per_step={k: min(p["thread_s_per_step"].get(k, 0.0) for p in ps) for k in parts}
        )
    result["ratio_greedy_over_sample_step_time"] = (
        result["greedy"]["step_ms_median"] / result["sample T=1"]["step_ms_median"]
    )
    return result


def _prompts(args) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, args.vocab, size=(args.batch, args.prompt_len)).astype(np.int32)
    return ids, np.ones_like(ids)


def _run_worker(engine: str, checkpoint: str, argv: list[str], threads: int = 0) -> dict:
    """Run one engine in a fresh Python process and return its JSON result."""
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
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{engine} benchmark failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.decode_step:
        result = dict(
            workload=dict(
                batch=args.batch,
                prompt_len=args.prompt_len,
                short=args.short,
                long=args.new_tokens,
                hidden=args.hidden,
                layers=args.layers,
                vocab=args.vocab,
                dtype="float32",
                backend=jax.default_backend(),
                cpu_count=os.cpu_count(),
                load_avg=os.getloadavg(),
            ),
            **bench_decode_step(args),
        )
        if args.json:
            print(json.dumps(result, indent=2))
            return result
        print(f"workload: {result['workload']}")
        print("decode step alone (measured: rollouts of --short vs --new_tokens tokens, the difference per step)")
        for name in ("greedy", "sample T=1"):
            r = result[name]
            print(
                f"  {name:<11} median {r['step_ms_median']:8.2f} ms/step   rounds "
                + ", ".join(f"{x:.2f}" for x in r["step_ms_rounds"])
                + f"   ({r['slots']} slots)"
            )
        print(f"  greedy / sample step time: {result['ratio_greedy_over_sample_step_time']:.3f}")
        print("profile (measured: XLA:CPU thread ms per decode step, summed over worker threads)")
        parts = list(result["greedy"]["profile"]["thread_s_per_step"])
        parts += [p for p in result["sample T=1"]["profile"]["thread_s_per_step"] if p not in parts]
        print(f"  {'part':<32}{'greedy':>10}{'sample T=1':>12}   HLO ops (greedy, sample T=1)")
        for part in parts:
            g, t = (result[m]["profile"]["thread_s_per_step"].get(part, 0.0) * 1e3 for m in ("greedy", "sample T=1"))
            n = [result[m]["profile"]["hlo_ops"].get(part, 0) for m in ("greedy", "sample T=1")]
            print(f"  {part:<32}{g:>10.3f}{t:>12.3f}   {n[0]}, {n[1]}")
        return result
    if args._worker:  # child process: one engine, one JSON line
        ids, mask = _prompts(args)
        bench = bench_jaxflow if args._worker == "jaxflow" else bench_hf
        print(json.dumps(bench(args._checkpoint, ids, mask, args)))
        return {}
    cfg = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096,
    )
    passthrough = [a for a in argv if a != "--json"]
    threads = [] if args.skip_hf else [int(t) for t in args.hf_threads.split(",")]
    jaxflow_runs: list[dict] = []
    hf_runs: dict[int, list[dict]] = {t: [] for t in threads}
    with tempfile.TemporaryDirectory() as path:
        save_pretrained(init_model(cfg, seed=0), path)
        for _ in range(args.rounds):
            jaxflow_runs.append(_run_worker("jaxflow", path, passthrough))
            for t in threads:
                hf_runs[t].append(_run_worker("transformers", path, passthrough, t))

    def best(runs):
        return dict(max(runs, key=lambda r: r["tokens_per_s"]), rounds_tokens_per_s=[r["tokens_per_s"] for r in runs])

    result = dict(
        workload=dict(
            batch=args.batch,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            hidden=args.hidden,
            intermediate=args.intermediate,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            vocab=args.vocab,
            mode="greedy" if args.greedy else "sample T=1",
            dtype="float32",
            cpu_count=os.cpu_count(),
            backend=jax.default_backend(),
            rounds=args.rounds,
        ),
        jaxflow=best(jaxflow_runs),
    )
    if threads:
        result["transformers_runs"] = [best(runs) for runs in hf_runs.values()]
        result["transformers"] = max(result["transformers_runs"], key=lambda r: r["tokens_per_s"])
        result["ratio"] = result["jaxflow"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"workload: {result['workload']}")
        print(f"{'engine':<28}{'tokens/s':>12}{'seconds':>10}   tokens/s of every round")
        named = [("jaxflow", result["jaxflow"])] + [
            (f"transformers ({run['torch_threads']} threads)", run) for run in result.get("transformers_runs", [])
        ]
        for name, run in named:
            rounds = ", ".join(f"{x:.1f}" for x in run["rounds_tokens_per_s"])
            print(f"{name:<28}{run['tokens_per_s']:>12.1f}{run['seconds']:>10.2f}   {rounds}")
        jf = result["jaxflow"]
        print(f"jaxflow compile: {jf['compile_s']:.2f} s (first call {jf['first_call_s']:.2f} s)")
        if "ratio" in result:
            print(f"ratio jaxflow / fastest transformers: {result['ratio']:.2f}x")
    return result


if __name__ == "__main__":
    main()
