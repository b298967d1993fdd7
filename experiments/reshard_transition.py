"""The actor's train -> generate transition (HybridFlow §5.4, Table 2), measured.

For a Llama-style model (default: vocab 32000, hidden 768, 8 layers, 8 heads, MLP 2048:
106M parameters, fp32) on 8 simulated CPU devices, for every training layout
{fsdp=8, fsdp=4 x tp=2, fsdp=2 x tp=4, dp=2 x fsdp=2 x tp=2} and generation tp in {1, 2, 4}
(those dividing the weight-parallel degree), and for each
strategy -- naive (DeepSpeed-Chat: gather the whole model everywhere, then slice), vanilla
(HybridFlow-V: contiguous generation TP groups, gather within the training group), hybrid
(HybridFlow: strided TP groups, all-gather inside micro-DP groups) and, for reference,
hybrid compiled as one XLA program -- it reports, per device:

- bytes received, a *ring-algorithm model* (all-gather over g devices receives (g-1)/g of
  its output, ...) applied to the collectives of the compiled programs (their HLO: op,
  per-device output shape, replica groups), compile-only on abstract inputs; beside it the raw
  collective output bytes per device and the replica-group sizes;
- peak extra bytes: what the transition allocates on top of the training weights, from
  XLA's buffer assignment (``memory_analysis()``: outputs and scratch, in program order);
- redundancy: training weights outside the device's generation shard (from the layouts);
- live weight bytes per device *measured* while generating on the timed model (the bytes of
  ``jax.live_arrays()`` per device, from their shards): with the actor's zero-redundancy
  swap (training weights donated into the generation copy) and with the training copy kept;
- wall time of the transition on real arrays (``--time_hidden`` etc. pick the timed model;
  smaller by default to fit host memory: the naive strategy holds 8 full copies);
- Table 2's value beside each, and measured / Table 2.

XLA's "Involuntary full rematerialization" warning is captured from the compiler's stderr.
With the training ``dp=2`` layout, naive (DeepSpeed-Chat: ZeRO-3 over all devices, tpd = 8)
and vanilla (gather within the training model-parallel group, tp = 4) differ as in Table 2.

    python experiments/reshard_transition.py              # the table
    python experiments/reshard_transition.py --json       # the rows as JSON
    python experiments/reshard_transition.py --tiny       # a smoke test: tiny models, fsdp=8 to tp=2 only
"""

from __future__ import annotations

import os

# 8 simulated devices; on a loaded 2-core host a device thread can reach a big collective
# long after the others, so allow more than XLA's default 40 s at the rendezvous.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_cpu_collective_call_warn_stuck_timeout_seconds=120"
    " --xla_cpu_collective_call_terminate_timeout_seconds=900"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxflow.mesh import MeshSpec, hybrid_rules  # noqa: E402
from jaxflow.models import ModelConfig, init_model  # noqa: E402
from jaxflow.reshard import HybridEngine  # noqa: E402

LAYOUTS = ((1, 8, 1), (1, 4, 2), (1, 2, 4), (2, 2, 2))  # (dp, fsdp, tp)
GEN_TPS = (1, 2, 4)
STRATEGIES = (("naive", True), ("vanilla", True), ("hybrid", True), ("hybrid", False))


# --tiny: tiny models, one transition (training fsdp=8 to generation tp=2, every strategy): a
# smoke test of the script, seconds; flags given beside it still apply.
TINY = dict(
    vocab=256,
    hidden=64,
    intermediate=128,
    layers=1,
    heads=8,
    kv_heads=8,
    time_vocab=256,
    time_hidden=64,
    time_intermediate=128,
    time_layers=1,
    reps=1,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny models, fsdp=8 to tp=2 only: a smoke test")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--time_vocab", type=int, default=8192, help="the timed model (0 layers: no timing)")
    p.add_argument("--time_hidden", type=int, default=384)
    p.add_argument("--time_intermediate", type=int, default=1024)
    p.add_argument("--time_layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3, help="timed transitions (median)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--json_out", default="", help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    if args.tiny:
        p.set_defaults(**TINY)
        args = p.parse_args(argv)
    return args


def config(vocab, hidden, intermediate, layers, heads, kv_heads) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
    )


def random_state(cfg: ModelConfig, shardings, seed: int = 0):
    """Random weights created directly in the training layout (no host copy of the model)."""
    _, abstract = nnx.split(nnx.eval_shape(lambda: init_model(cfg)))
    leaves, treedef = jax.tree.flatten(abstract)
    shs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [
        jax.jit(lambda k, x=x: 0.02 * jax.random.normal(k, x.shape, x.dtype), out_shardings=s)(k)
        for k, x, s in zip(keys, leaves, shs)
    ]
    return jax.tree.unflatten(treedef, out)


def live_weight_bytes(shapes: set[tuple[int, ...]]) -> int:
    """Measured: bytes on the most loaded device of the live arrays with a weight's shape."""
    per_device: dict[int, int] = {}
    for x in jax.live_arrays():
        if not x.is_deleted() and tuple(x.shape) in shapes:
            for shard in x.addressable_shards:
                per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def measure_live(engine: HybridEngine, cfg: ModelConfig) -> tuple[int, int]:
    """``(swap, keep)``: live weight bytes per device during generation with the training
    weights donated into the generation copy (the actor's `generation_swap`), and with them
    kept alive beside it (`generation`). Real arrays; the state is freed afterwards."""
    _, abstract = nnx.split(nnx.eval_shape(lambda: init_model(cfg)))
    shapes = {tuple(x.shape) for x in jax.tree.leaves(abstract)}
    state = random_state(cfg, engine.train_shardings(abstract))
    with engine.generation(state):
        keep = live_weight_bytes(shapes)
    seen = []
    with engine.generation_swap(state, give_back=seen.append):
        swap = live_weight_bytes(shapes)
    for x in jax.tree.leaves(seen):
        x.delete()
    return swap, keep


def measure(args) -> list[dict]:
    cfg = config(args.vocab, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads)
    _, state = nnx.split(nnx.eval_shape(lambda: init_model(cfg)))
    timed_cfg = None
    if args.time_layers > 0:
        timed_cfg = config(
            args.time_vocab, args.time_hidden, args.time_intermediate, args.time_layers, args.heads, args.kv_heads
        )
    rows = []
    layouts, gen_tps = (((1, 8, 1),), (2,)) if args.tiny else (LAYOUTS, GEN_TPS)
    for dp, fsdp, tp in layouts:
        mesh = MeshSpec(dp=dp, fsdp=fsdp, tp=tp).build(jax.devices())
        train_rules, _ = hybrid_rules(cfg, fsdp * tp)
        for gen_tp in gen_tps:
            if (fsdp * tp) % gen_tp:
                continue
            for strategy, bucketed in STRATEGIES:
                engine = HybridEngine(mesh, train_rules, gen_tp, strategy, bucketed=bucketed)
                rep = engine.report(state)
                row = rep.to_dict()
                row.update(
                    layout=f"dp={dp},fsdp={fsdp},tp={tp}" if dp > 1 else f"fsdp={fsdp},tp={tp}",
                    label=strategy if bucketed else "hybrid (1 program)",
                )
                row["seconds"] = row["live_swap_bytes"] = row["live_keep_bytes"] = row["timed_model_bytes"] = None
                if timed_cfg is not None:
                    _, timed_abstract = nnx.split(nnx.eval_shape(lambda: init_model(timed_cfg)))
                    timed_state = random_state(timed_cfg, engine.train_shardings(timed_abstract))
                    row["seconds"] = engine.time(timed_state, args.reps)
                    row["timed_model_bytes"] = sum(x.nbytes for x in jax.tree.leaves(timed_state))
                    for x in jax.tree.leaves(timed_state):
                        x.delete()
                    if bucketed:
                        row["live_swap_bytes"], row["live_keep_bytes"] = measure_live(engine, timed_cfg)
                rows.append(row)
                print(f"  measured {row['layout']} tg={gen_tp} {row['label']}", file=sys.stderr, flush=True)
    return rows


def mb(x: float) -> str:
    return f"{x / 2**20:8.1f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:6.3f}" if b else ("   0/0" if a == 0 else "   inf")


def print_table(rows: list[dict], args) -> None:
    m = rows[0]["model_bytes"]
    print(
        f"model: vocab {args.vocab}, hidden {args.hidden}, mlp {args.intermediate}, {args.layers} layers, "
        f"{args.heads} heads ({args.kv_heads} kv), fp32: M = {mb(m).strip()} MiB; 8 simulated CPU devices"
    )
    if rows[0]["timed_model_bytes"]:
        print(
            f"timed on a {mb(rows[0]['timed_model_bytes']).strip()} MiB model (median of {args.reps}); "
            "MiB per device; T2 = HybridFlow Table 2"
        )
    head = (
        f"{'train layout':<20}{'tg':>3}  {'strategy':<19}{'recv*':>9}{'T2 comm':>9}{'ratio':>7}{'coll out':>9}"
        f"{'peak':>9}{'T2 peak':>9}{'ratio':>7}{'redund':>9}{'T2 red':>9}{'live sw':>9}{'live kp':>9}{'ms':>8}"
        f"  groups  remat"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        t2 = r["table2"]
        groups = r["gather_groups"]
        gtxt = f"{len(groups)}x{len(groups[0])}" if groups else "-"
        ms = f"{r['seconds'] * 1e3:8.1f}" if r["seconds"] is not None else f"{'-':>8}"
        live = [f"{mb(r[k]):>9}" if r[k] is not None else f"{'-':>9}" for k in ("live_swap_bytes", "live_keep_bytes")]
        print(
            f"{r['layout']:<20}{r['gen_tp']:>3}  {r['label']:<19}{mb(r['ring_received_bytes']):>9}"
            f"{mb(t2['comm_bytes']):>9}{ratio(r['ring_received_bytes'], t2['comm_bytes']):>7}"
            f"{mb(r['collective_output_bytes']):>9}"
            f"{mb(r['peak_extra_bytes']):>9}{mb(t2['peak_bytes']):>9}{ratio(r['peak_extra_bytes'], t2['peak_bytes']):>7}"
            f"{mb(r['redundancy_bytes']):>9}{mb(t2['redundancy_bytes']):>9}{live[0]}{live[1]}{ms}  {gtxt:<6}  "
            f"{'YES' if r['full_remat'] else 'no'}"
        )
    print(
        "recv*: bytes one device receives, a ring-algorithm model applied to the collectives of the compiled "
        "HLO (not a measured transfer); coll out: the raw output bytes of those collectives on one device; "
        "peak: allocated on top of the training weights (memory_analysis, in program order); redund: training "
        "weights outside the generation shard (from the layouts); live sw / live kp: MEASURED live weight bytes "
        "per device during generation on the timed model (jax.live_arrays), with the zero-redundancy swap "
        "(training weights donated) / with the training copy kept; groups: replica groups of the collectives "
        "(count x size)."
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = measure(args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
    else:
        print_table(rows, args)


if __name__ == "__main__":
    main()
