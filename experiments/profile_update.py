"""Where the actor's update spends its time: the compiled train step of the
``bench_rl_step.py`` workload, profiled op by op (``jax.profiler``) on the CPU backend.

Every XLA CPU op of the step (a thunk, named like its HLO instruction) is put in a
category by the JAX operation it came from (the HLO ``op_name``), else by its output size:
the matmuls of the MLP, of the attention projections, of the attention core (``q k`` and
``p v``), of the LM head, and the non-matmul work beside each (elementwise, layout copies,
reductions: the attention's mask and softmax by their ``tokens x heads x length`` size), the
optimizer and finiteness check, the rest. For each category: measured seconds (summed op durations of
one step, best of ``--reps`` traced steps) and share; for the matmul categories also their
analytic FLOPs over those seconds, against a 2048^3 fp32 matmul timed in the same process.
Beside it: the step's device time (wall clock of the compiled step, inputs on the device)
and the host work of one update outside it (packing and ``device_put`` of the mini-batch).

    python experiments/profile_update.py                  # the bench workload, padded rows
    python experiments/profile_update.py --packing on     # packed, token-budget micro-batches
    python experiments/profile_update.py --tiny --layers 1

CPU only: on other backends the trace's events are kernels, not HLO instructions.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_rl_step import FULL, TINY, Workload, matmul_gflops  # noqa: E402  (after the path)

# (category, substrings of the op_name that place an op in it), first match wins
CATEGORIES = (
    ("optimizer + finite check", ("adam", "scale_by", "apply_updates", "isfinite", "clip_by_global_norm")),
    ("attention core", ("BNMK,BNKS", "BNMS,BNSK", "masked_softmax")),
    ("attention projections + rope", ("TD,DHK", "TD,DNK", "THK,HKD", "rope")),
    ("mlp", ("TD,DF", "TF,FD", "silu")),
    ("lm head + log-softmax", ("TD,DV", "TD,VD", "logsumexp", "log_softmax", "take_along_axis", "entropy")),
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--packing", choices=("on", "off"), default="off")
    p.add_argument("--tiny", action="store_true", help="bench_rl_step's tiny sizes")
    p.add_argument("--rows", type=int, default=0, help="responses per mini-batch (default: the workload's)")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (default: the workload's)")
    p.add_argument("--reps", type=int, default=2, help="traced steps (the fastest is reported)")
    p.add_argument("--top", type=int, default=0, help="also list the N most expensive ops of each category")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def analytic_flops(wl: Workload, rows: int) -> dict[str, float]:
    """Matmul FLOPs of one forward + backward (3 x forward) per matmul category."""
    L, head_dim = wl.prompt_len + wl.response_len, wl.hidden // wl.heads
    tokens = rows * L
    return {
        "mlp": 3 * wl.layers * tokens * 2 * 3 * wl.hidden * wl.mlp,
        "attention projections + rope": 3
        * wl.layers
        * tokens
        * 2
        * wl.hidden
        * (2 * wl.heads + 2 * wl.kv_heads)
        * head_dim,
        "attention core": 3 * wl.layers * tokens * 2 * 2 * L * wl.heads * head_dim,
        "lm head + log-softmax": 3 * rows * wl.response_len * 2 * wl.hidden * wl.vocab,
    }


DESCRIPTIONS: dict[str, str] = {}


def hlo_ops(hlo_text: str, sizes: dict[int, str]) -> dict[str, tuple[str, bool]]:
    """HLO instruction name -> (category, is_matmul) of the compiled module: by the JAX
    operation it came from (`CATEGORIES`), else by its output size (``sizes``: element
    count -> category; e.g. ``tokens x heads x length`` is the attention's scores). Also
    fills `DESCRIPTIONS` (name -> op_name and output shape) for ``--top``."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]\S* ([\w\-]+)\(.*$", hlo_text, re.M):
        found = re.search(r'op_name="([^"]*)"', m.group(0))
        op_name = found.group(1) if found else ""
        matmul = m.group(3) in ("dot", "convolution") or "dot_general" in op_name
        elements = 1
        for d in filter(None, m.group(2).split(",")):
            elements *= int(d)
        cat = next((name for name, keys in CATEGORIES if any(k in op_name for k in keys)), sizes.get(elements, "other"))
        out[m.group(1)] = (cat, matmul)
        DESCRIPTIONS[m.group(1)] = f"{op_name[-70:]} [{m.group(2)}]"
    return out


def op_seconds(trace_dir: str, ops: dict[str, tuple[str, bool]]) -> tuple[collections.Counter, collections.Counter]:
    """Summed durations of the trace's events named like an HLO instruction, per (category,
    matmul or not), and per instruction."""
    path = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")))[-1]
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    out: collections.Counter = collections.Counter()
    per_op: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in ops:
            out[ops[e["name"]]] += e.get("dur", 0) / 1e6
            per_op[e["name"]] += e.get("dur", 0) / 1e6
    return out, per_op


def main(argv=None) -> None:
    args = parse_args(argv)
    wl = TINY if args.tiny else FULL
    wl = dataclasses.replace(wl, layers=args.layers or wl.layers)
    rows = args.rows or wl.rows

    import jax
    import numpy as np

    import jaxflow.models as models
    from jaxflow.workers import ActorConfig, ActorWorker, OptimConfig, RolloutConfig

    cfg = models.get_preset(
        "tiny_llama",
        vocab_size=wl.vocab,
        hidden_size=wl.hidden,
        intermediate_size=wl.mlp,
        num_layers=wl.layers,
        num_heads=wl.heads,
        num_kv_heads=wl.kv_heads,
        head_dim=wl.hidden // wl.heads,
    )
    extra = {"use_remove_padding": True, "use_dynamic_bsz": True} if args.packing == "on" else {}
    config = ActorConfig(
        ppo_mini_batch_size=rows, use_kl_loss=True, kl_loss_coef=0.04, optim=OptimConfig(lr=1e-6), **extra
    )
    actor = ActorWorker(models.init_model(cfg, "lm", seed=0), "fsdp=1", "train", config, RolloutConfig())
    rng = np.random.default_rng(0)
    P, R = wl.prompt_len, wl.response_len
    host = {
        "prompt_ids": rng.integers(4, wl.vocab, (rows, P)).astype(np.int32),
        "prompt_mask": np.ones((rows, P), np.int32),
        "responses": rng.integers(4, wl.vocab, (rows, R)).astype(np.int32),
        "response_mask": np.ones((rows, R), np.int32),
        "advantages": rng.normal(size=(rows, R)).astype(np.float32),
        "ref_log_prob": np.full((rows, R), -np.log(wl.vocab), np.float32),
    }
    host = {k: host[k] for k in config.update_keys(on_policy=True)}
    step = actor.train_program(rows, on_policy=True)
    scalars = {"temperature": np.float32(1.0)}
    inputs, _ = actor.place_minibatch(host, np.arange(rows))
    tokens, L = rows * (P + R), P + R  # packed: as many slots (full responses fill one bin each)
    sizes = {
        tokens * wl.heads * L: "attention core",
        tokens * wl.mlp: "mlp",
        tokens * wl.hidden: "hidden-size activations",
    }
    ops = hlo_ops(step.lower(actor.state, inputs, scalars).compile().as_text(), sizes)
    actor.state, m = step(actor.state, inputs, scalars)  # compile + warm up
    jax.block_until_ready(m)

    host_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        placed, _ = actor.place_minibatch(host, np.arange(rows))
        jax.block_until_ready(placed)
        host_s.append(time.perf_counter() - t0)
    matmul = matmul_gflops()
    best, best_ops, device_s = None, None, []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
            t0 = time.perf_counter()
            actor.state, m = step(actor.state, inputs, scalars)
            jax.block_until_ready(m)
            device_s.append(time.perf_counter() - t0)
            jax.profiler.stop_trace()
            seconds, per_op = op_seconds(trace_dir, ops)
        if best is None or sum(seconds.values()) < sum(best.values()):
            best, best_ops = seconds, per_op
    flops = analytic_flops(wl, rows)
    total = sum(best.values())
    table = []
    for (cat, is_matmul), s in best.most_common():
        row = {"category": cat, "matmul": is_matmul, "seconds": s, "share": s / total}
        if is_matmul and cat in flops:
            row["gflops"] = flops[cat] / s / 1e9
            row["fraction_of_matmul_peak"] = row["gflops"] / matmul
        if args.top:
            row["top_ops"] = [(DESCRIPTIONS[n], t) for n, t in best_ops.most_common() if ops[n] == (cat, is_matmul)][
                : args.top
            ]
        table.append(row)
    result = {
        "workload": dataclasses.asdict(wl) | {"rows": rows},
        "packing": args.packing,
        "train_step_device_s": min(device_s),
        "host_place_minibatch_s": min(host_s),
        "op_seconds_total": total,
        "matmul_gflops": matmul,
        "train_gflops_device": sum(flops.values()) / min(device_s) / 1e9,
        "load": os.getloadavg()[0],
        "categories": table,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(
        f"actor train step, {rows} rows x {P}+{R} tokens, {wl.layers} layers, packing {args.packing}; "
        f"load average {result['load']:.1f} on {os.cpu_count()} cores (seconds measured, FLOPs analytic)"
    )
    print(
        f"device time {min(device_s):.3f} s ({result['train_gflops_device']:.1f} GFLOP/s; fp32 2048^3 matmul "
        f"{matmul:.1f} GFLOP/s, {100 * result['train_gflops_device'] / matmul:.0f}%); host packing + device_put "
        f"of the mini-batch {min(host_s) * 1e3:.1f} ms; op time summed {total:.3f} s"
    )
    print(f"{'category':<32}{'kind':>12}{'seconds':>10}{'share':>8}{'GFLOP/s':>10}{'of peak':>9}")
    for row in table:
        extra = f"{row['gflops']:>10.1f}{100 * row['fraction_of_matmul_peak']:>8.0f}%" if "gflops" in row else ""
        print(
            f"{row['category']:<32}{'matmul' if row['matmul'] else 'other':>12}{row['seconds']:>10.3f}"
            f"{100 * row['share']:>7.1f}%{extra}"
        )
        for what, t in row.get("top_ops", []):
            print(f"    {100 * t / total:5.1f}%  {what}")


if __name__ == "__main__":
    main()
