"""LoRA rollouts: merging the adapters into the generation copy at each sync vs running the
adapter path in the engine, against the same model without adapters.

Each variant is an `ActorWorker` (the real rollout: `ActorWorker.generate`, the weight sync
then the engine) on one mesh of ``--devices`` devices (fsdp), with rank ``--rank`` adapters
on every projection (random B, so the update is not zero):

- ``merge``: the rollout reads ``W + s A B``, a copy made at each sync (`merge_program`);
- ``adapter``: the rollout reads the base weights and the adapters, and every projection of
  every decode step adds ``s (x A) B``;
- ``full``: no adapters (the weights themselves): the engine's speed without LoRA.

Reported per variant (``measured``: wall clock, median of ``--reps`` calls after a warm-up
call that compiles; the variants' calls alternate, so a machine whose load changes slows them
alike): ``sync_s`` (the weights made ready for the engine: the merge, or
nothing), ``engine_s`` (the rollout program), tokens per second of the whole call, and the
generation copy's bytes per device (``analytic``: shapes and shardings). The model is
Llama-shaped with random weights, float32 (CPU): hidden 512, 8 layers, 8 heads / 2 kv heads,
vocab 32000 (``--tiny``: a tiny model, a smoke test).

    python experiments/bench_lora_rollout.py
    python experiments/bench_lora_rollout.py --tiny --json   # a smoke test of the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

MODELS = {
    "default": dict(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=2
    ),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2),
}
# --tiny: the tiny model and a few short rollouts, one timed call each (seconds).
TINY = dict(model="tiny", prompts=4, n=2, prompt_len=8, max_new_tokens=8, reps=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="default")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default="merge,adapter,full")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test of the script")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if args.tiny:  # flags given beside it still apply
        p.set_defaults(**TINY)
        args = p.parse_args(argv)
    return args


def _actor(args, variant: str):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jaxflow.models as models
    from jaxflow.mesh import TRAIN_RULES
    from jaxflow.models.lora import LoRAConfig, join, split_adapters
    from jaxflow.sampling import SamplingParams
    from jaxflow.workers import ActorConfig, ActorWorker, RolloutConfig

    m = MODELS[args.model]
    cfg = models.ModelConfig(**m, head_dim=m["hidden_size"] // m["num_heads"], max_position_embeddings=4096)
    lora = None if variant == "full" else LoRAConfig(rank=args.rank, alpha=2.0 * args.rank)
    mesh = Mesh(np.array(jax.devices()[: args.devices]).reshape(1, args.devices, 1), ("dp", "fsdp", "tp"))
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, n=args.n, eos_token_ids=())
    actor = ActorWorker(
        models.init_model(cfg, seed=0),
        mesh,
        TRAIN_RULES,
        ActorConfig(lora=lora),
        RolloutConfig(train=sampling, lora_merge=variant == "merge"),
    )
    if lora is not None:  # a trained-looking adapter: B no longer zero
        base, adapters = split_adapters(actor.params)
        adapters = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), adapters)
        actor.replace_params(join(base, adapters))
    return actor


def _bytes_per_device(tree) -> int:
    import jax

    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def run_variants(args, variants: list[str]) -> list[dict]:
    """Each variant's timings; the variants' calls alternate (rep 1 of each, then rep 2, ...),
    so that a machine whose load changes over the run slows them alike."""
    import numpy as np

    from jaxflow.data.batch import Batch

    actors = {v: _actor(args, v) for v in variants}
    rng = np.random.default_rng(0)
    ids = rng.integers(3, MODELS[args.model]["vocab_size"], (args.prompts, args.prompt_len)).astype(np.int32)
    prompts = Batch({"prompt_ids": ids, "prompt_mask": np.ones_like(ids)})
    for actor in actors.values():
        actor.generate(prompts, step=0)  # compiles
    parts = {v: [] for v in variants}
    walls = {v: [] for v in variants}
    for rep in range(args.reps):
        for v, actor in actors.items():
            t0 = time.perf_counter()
            actor.generate(prompts, step=rep + 1)
            walls[v].append(time.perf_counter() - t0)
            parts[v].append(actor.generation_seconds())
    tokens = args.prompts * args.n * args.max_new_tokens
    return [
        dict(
            variant=v,
            sync_s=statistics.median(p["reshard"] for p in parts[v]),
            engine_s=statistics.median(p["engine"] for p in parts[v]),
            call_s=statistics.median(walls[v]),
            tokens_per_s=tokens / statistics.median(walls[v]),
            # the merged copy has the base's shapes and dtype
            generation_copy_bytes_per_device=_bytes_per_device(actors[v].frozen) if v == "merge" else 0,
        )
        for v in variants
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    results = run_variants(args, args.variants.split(","))
    device = jax.devices()[0].device_kind
    if args.json:
        print(json.dumps({"device": device, "devices": args.devices, "model": args.model, "results": results}))
        return 0
    print(
        f"LoRA rollouts on {args.devices} x {device} ({args.model} model, rank {args.rank}, {args.prompts} prompts x "
        f"n={args.n} x {args.max_new_tokens} new tokens; measured, median of {args.reps}):"
    )
    print(f"  {'variant':<8} {'sync s':>8} {'engine s':>9} {'call s':>8} {'tok/s':>8} {'copy MiB/dev':>13}")
    for r in results:
        print(
            f"  {r['variant']:<8} {r['sync_s']:8.3f} {r['engine_s']:9.3f} {r['call_s']:8.3f} {r['tokens_per_s']:8.0f} "
            f"{r['generation_copy_bytes_per_device'] / 2**20:13.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
