"""Acceptance 3 of the auto-mapper: Qwen-shaped HF checkpoints run ``grpo_tiny`` on 8 simulated
devices with no mesh keys given (``jaxflow.placement.type=auto``, the default).

Two checkpoints with random weights, written by HF transformers' ``save_pretrained`` (bf16,
``--layers`` decoder layers, embeddings tied as Qwen ships them):

- ``qwen2_5_0_5b``: Qwen2.5-0.5B's widths: hidden 896, 14 heads, 2 kv heads (head_dim 64),
  MLP 4864, vocab 151,936 (14 heads do not divide 8 devices: the mapper must find a layout);
- ``qwen3_0_6b``: Qwen3-0.6B's widths: hidden 1024, 16 heads, 8 kv heads, head_dim 128, MLP
  3072, vocab 151,936, q/k norms.

Each runs ``python -m jaxflow.run --config=grpo_tiny`` in a fresh process with the checkpoint
as ``actor_rollout_ref.model.path``, the built-in character tokenizer (100 ids, inside the
model's vocabulary), no supervised warm start, ``--steps`` RL steps and a smaller batch
(``--prompts`` x ``--n`` responses; batch sizes are not mesh keys) so that a 152k-row LM head
runs in minutes on a CPU. Prints, per model, the auto-mapper's choice (from the run's log),
each step's line and the exit status; ``--json`` prints them as one object.

``--tiny`` keeps each model's head counts (what the mapper must place) and divides its widths
by head_dim / 8, with a vocabulary of 512: a smoke test of the script, one step, seconds.

    python experiments/automap_qwen.py [--layers=1] [--steps=3] [--prompts=8] [--n=4] [--json]
    python experiments/automap_qwen.py --tiny [--models=qwen2_5_0_5b]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

SHAPES = {
    "qwen2_5_0_5b": (
        "qwen2",
        dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6),
    ),
    "qwen3_0_6b": (
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            rope_theta=1e6,
        ),
    ),
}


VOCAB, TINY_VOCAB = 151936, 512


def tiny_shape(shape: dict) -> dict:
    """``shape`` with its head counts and every width divided by head_dim / 8."""
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    scale = head_dim // 8
    widths = ("hidden_size", "intermediate_size") + (("head_dim",) if "head_dim" in shape else ())
    return dict(shape, **{k: shape[k] // scale for k in widths})


def save_checkpoint(name: str, layers: int, out: str, tiny: bool = False) -> str:
    """A random-weight HF checkpoint of ``name``'s shape at ``layers`` layers (bf16)."""
    import torch
    import transformers

    family, shape = SHAPES[name]
    shape = tiny_shape(shape) if tiny else shape
    config_cls = transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config
    model_cls = transformers.Qwen2ForCausalLM if family == "qwen2" else transformers.Qwen3ForCausalLM
    config = config_cls(
        vocab_size=TINY_VOCAB if tiny else VOCAB,
        num_hidden_layers=layers,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        torch_dtype="bfloat16",
        **shape,
    )
    torch.manual_seed(0)
    model = model_cls(config).to(torch.bfloat16)
    path = os.path.join(out, name)
    model.save_pretrained(path)
    return path


def run(path: str, args: argparse.Namespace, run_dir: str) -> dict:
    keys = {
        "actor_rollout_ref.model.path": path,
        "jaxflow.data.tokenizer": "char",
        "jaxflow.sft.warm_start_steps": 0,
        "jaxflow.model.dtype": "bfloat16",
        "jaxflow.model.compute_dtype": "bfloat16",
        "trainer.total_training_steps": args.steps,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "trainer.save_freq": -1,
        "trainer.logger": "console",
        "trainer.default_local_dir": run_dir,
        "data.train_batch_size": args.prompts,
        "actor_rollout_ref.rollout.n": args.n,
        "actor_rollout_ref.actor.ppo_mini_batch_size": args.prompts,
    }
    cmd = [sys.executable, "-m", "jaxflow.run", "--config=grpo_tiny"] + [f"--config.{k}={v}" for k, v in keys.items()]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = (proc.stdout + proc.stderr).splitlines()
    return {
        "returncode": proc.returncode,
        "wall_s": time.perf_counter() - t0,
        "mesh_keys_given": [k for k in keys if k.startswith("jaxflow.mesh") or k.startswith("jaxflow.placement")],
        "auto_mapper": [line for line in lines if "auto-mapper" in line],
        "steps": [line for line in lines if re.match(r"\s*step \d+ ", line)],  # not the summary's "step time"
        "tail": lines[-15:],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--json", action="store_true")
    p.add_argument("--tiny", action="store_true", help="the head counts at tiny widths, one step: a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        p.set_defaults(steps=1, n=2)
        args = p.parse_args(argv)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    results = {}
    with tempfile.TemporaryDirectory(prefix="automap_qwen_") as tmp:
        for name in args.models.split(","):
            t0 = time.perf_counter()
            path = save_checkpoint(name, args.layers, tmp, args.tiny)
            say(f"{name}: saved by transformers at {args.layers} layer(s) in {time.perf_counter() - t0:.0f} s")
            r = results[name] = run(path, args, os.path.join(tmp, f"run_{name}"))
            for line in r["auto_mapper"] + r["steps"]:
                say(f"  {line.strip()}")
            say(
                f"  exit {r['returncode']} after {r['wall_s']:.0f} s (measured, load {os.getloadavg()[0]:.1f}); "
                f"mesh / placement keys given: {r['mesh_keys_given'] or 'none'}"
            )
            if r["returncode"] != 0:
                say("\n".join("    " + line for line in r["tail"]))
    if args.json:
        print(json.dumps(results, indent=2))
    return 0 if all(r["returncode"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
