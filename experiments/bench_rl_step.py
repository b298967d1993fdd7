"""One RL step, jaxflow vs TRL's ``GRPOTrainer``, per phase, on one CPU device.

The workload (both systems, fp32, random weights, the same 64-token prompts):

* policy: Llama-shaped, hidden 512, MLP 1408, 8 layers, 8 heads, 2 kv heads, vocab 256
  (jaxflow's character tokenizer, written once as a ``tokenizer.json`` for TRL);
* 8 prompts x 4 samples, prompt 64 tokens, responses of exactly 128 tokens (jaxflow:
  ``rollout.ignore_eos``; TRL: ``min_new_tokens``), temperature 1;
* GRPO with a reference model and a KL loss of 0.04 (k3 / ``low_var_kl``), one optimizer
  step per rollout (the mini-batch is the whole batch, so jaxflow's update takes the old
  log-probs from its own forward);
* reward: the fraction of ``a`` characters in the response (host side, both systems).

jaxflow's PPO (GAE, a critic of the same shape) is timed beside it. TRL runs GRPO only, so
PPO's step time is printed on its own, never as a ratio to TRL's GRPO.

Each system runs in its own child process, the systems alternating ``--rounds`` times (the
machine is shared: report median and best). In every child the first ``--warmup`` steps
(compiles, allocator warm-up) are dropped and the next ``--steps`` are timed.

Phases (seconds per step, measured): ``gen`` (rollout), ``old_log_prob`` (a separate
old-log-prob pass; none with the on-policy shortcut), ``ref``, ``values`` (PPO), ``reward``,
``adv``, ``update_critic``, ``update_actor``, ``step`` (the whole step). For TRL the same
phases are read by wrapping its generation, reward, reference forward and
``training_step``: private methods of ``GRPOTrainer`` (`TRL_HOOKS`); a TRL without them is
refused with one line naming the missing ones and the installed version.

FLOP/s of the actor update, two ways: the analytic FLOPs of one forward and backward (3 x the
forward's matmul FLOPs, attention included, over every token of the ``[prompt | response]``
rows) divided by (a) the measured device time of the compiled train step alone
(``train_step_device_s``: inputs already on the device, best of 3 runs after the timed steps)
and (b) the ``update_actor`` phase (wall clock: host packing, transfers and the step),
against ``matmul_gflops``: a 2048^3 fp32 matmul timed in the same child right before its
steps.

``--longtail`` instead times jaxflow's log-prob and update phases together on one synthetic
batch whose response lengths are drawn from a long-tailed distribution (lognormal, median a
quarter of the cap), the padded path vs remove padding + token-budget micro-batches,
alternating in one process, and prints the speed-up.

``--tiny`` shrinks every size (a smoke test of the script, seconds per system).

    python experiments/bench_rl_step.py --rounds 3          # GRPO + PPO vs TRL, a table
    python experiments/bench_rl_step.py --longtail --json   # packing speed-up
    python experiments/bench_rl_step.py --tiny --rounds 1 --steps 1 --systems jaxflow_grpo,jaxflow_ppo
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


@dataclasses.dataclass(frozen=True)
class Workload:
    """The model and batch shapes both systems run."""

    hidden: int = 512
    mlp: int = 1408
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 256
    prompts: int = 8
    samples: int = 4
    prompt_len: int = 64
    response_len: int = 128

    @property
    def rows(self) -> int:
        return self.prompts * self.samples


FULL = Workload()
TINY = Workload(hidden=64, mlp=128, layers=2, heads=4, kv_heads=2, prompts=2, samples=2, prompt_len=8, response_len=16)
KL_COEF, LR = 0.04, 1e-6
PHASES = ("gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic", "update_actor", "step")
# GRPOTrainer's private methods the TRL child wraps to time its phases, and the first
# parameter each must take (the reference-forward hook tells the reference model by it).
TRL_HOOKS = {
    "_generate": None,
    "_calculate_rewards": None,
    "_generate_and_score_completions": None,
    "_get_per_token_logps_and_entropies": "model",
    "training_step": "model",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="alternations of the systems")
    p.add_argument("--steps", type=int, default=3, help="timed steps per child")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per child")
    p.add_argument(
        "--systems",
        default="jaxflow_grpo,jaxflow_ppo,trl_grpo",
        help="comma-separated: jaxflow_grpo, jaxflow_ppo, trl_grpo, before_grpo, before_ppo",
    )
    p.add_argument(
        "--packing",
        choices=("on", "off"),
        default="on",
        help="jaxflow: remove padding / dynamic micro-batches (off: the padded path)",
    )
    p.add_argument(
        "--before_tree",
        default="",
        help="a checkout to time as before_grpo / before_ppo (this script copied into it, padded path)",
    )
    p.add_argument("--longtail", action="store_true", help="packed vs padded log-prob + update, long-tailed lengths")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test of the script")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    p.add_argument("--_dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------ analytic FLOPs


def forward_flops(wl: Workload, rows: int, length: int, logit_positions: int) -> float:
    """Analytic matmul FLOPs of one forward over ``rows`` x ``length`` tokens (attention
    scores and values over all ``length`` keys, as computed), LM head on ``logit_positions``
    per row."""
    head_dim, tokens = wl.hidden // wl.heads, rows * length
    attn_proj = 2 * wl.hidden * (2 * wl.heads * head_dim + 2 * wl.kv_heads * head_dim)
    mlp = 2 * 3 * wl.hidden * wl.mlp
    attn_scores = 2 * 2 * length * wl.heads * head_dim
    per_layer = tokens * (attn_proj + mlp + attn_scores)
    return wl.layers * per_layer + rows * logit_positions * 2 * wl.hidden * wl.vocab


def matmul_gflops(reps: int = 5, n: int = 2048) -> float:
    """Measured fp32 ``n x n @ n x n`` throughput (best of ``reps``), GFLOP/s."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


# ------------------------------------------------------------------------ shared workload


def prompt_texts(wl: Workload) -> list[str]:
    """``wl.prompts`` prompts of exactly ``wl.prompt_len`` tokens: ``<bos>`` + random letters."""
    import numpy as np

    rng = np.random.default_rng(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    return ["<bos>" + "".join(rng.choice(list(letters), wl.prompt_len - 1)) for _ in range(wl.prompts)]


def reward_of_text(text: str) -> float:
    return text.count("a") / max(len(text), 1)


# ------------------------------------------------------------------------ jaxflow


def jaxflow_child(algo: str, steps: int, warmup: int, packing: bool, wl: Workload) -> dict:
    import jax
    import numpy as np

    import jaxflow.algos as algos
    import jaxflow.iterations as iterations
    import jaxflow.models as models
    from jaxflow.data.batch import Batch
    from jaxflow.data.char_tokenizer import CharTokenizer
    from jaxflow.iterations.ppo import needs_old_log_probs
    from jaxflow.sampling import SamplingParams
    from jaxflow.workers import (
        ActorConfig,
        ActorWorker,
        CriticConfig,
        CriticWorker,
        LocalWorkerGroup,
        OptimConfig,
        ReferenceWorker,
        RolloutConfig,
        Workers,
    )

    tok = CharTokenizer()
    cfg = models.get_preset(
        "tiny_llama",
        vocab_size=wl.vocab,
        hidden_size=wl.hidden,
        intermediate_size=wl.mlp,
        num_layers=wl.layers,
        num_heads=wl.heads,
        num_kv_heads=wl.kv_heads,
        head_dim=wl.hidden // wl.heads,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    rows = wl.rows
    extra = {"use_remove_padding": True, "use_dynamic_bsz": True} if packing else {}
    actor_cfg = ActorConfig(
        ppo_mini_batch_size=rows,
        use_kl_loss=algo == "grpo",
        kl_loss_coef=KL_COEF,
        kl_loss_type="low_var_kl",
        optim=OptimConfig(lr=LR),
        **extra,
    )
    rollout = RolloutConfig(
        train=SamplingParams(
            n=wl.samples, max_new_tokens=wl.response_len, eos_token_ids=(), pad_token_id=tok.pad_token_id
        )
    )
    policy = models.init_model(cfg, "lm", seed=0)
    mesh, rules = "fsdp=1", "train"
    w = Workers(
        actor=LocalWorkerGroup(
            ActorWorker, name="actor", model=policy, mesh=mesh, rules=rules, config=actor_cfg, rollout=rollout
        )
    )
    if algo == "grpo":
        w.ref = LocalWorkerGroup(
            ReferenceWorker,
            name="ref",
            model=policy,
            mesh=mesh,
            rules=rules,
            **({"use_remove_padding": True} if packing else {}),
        )
    else:
        w.critic = LocalWorkerGroup(
            CriticWorker,
            name="critic",
            model=models.init_model(cfg, "value", seed=1),
            mesh=mesh,
            rules=rules,
            config=CriticConfig(ppo_mini_batch_size=rows, optim=OptimConfig(lr=LR), **extra),
        )
    a_id = tok.encode("a", add_special_tokens=False)[0]

    def reward(batch: Batch) -> Batch:
        resp = np.asarray(jax.device_get(batch["responses"]))
        mask = np.asarray(jax.device_get(batch["response_mask"]))
        score = ((resp == a_id) & (mask > 0)).sum(1) / np.maximum(mask.sum(1), 1)
        last = np.maximum(mask.sum(1) - 1, 0)
        scores = np.zeros(mask.shape, np.float32)
        scores[np.arange(len(mask)), last] = score
        return Batch.from_dict({"token_level_scores": scores})

    w.reward = reward
    ids = np.array([tok.encode(t, add_special_tokens=False) for t in prompt_texts(wl)], np.int32)
    assert ids.shape == (wl.prompts, wl.prompt_len), ids.shape
    prompts = iterations.batch_from_prompts({"prompt_ids": ids, "prompt_mask": np.ones_like(ids)})
    algo_cfg = algos.AlgorithmConfig(adv_estimator=algo if algo == "grpo" else "gae")
    settings = algos.AlgorithmSettings(algo_cfg)
    matmul = matmul_gflops()
    timings = []
    for step in range(warmup + steps):
        metrics = iterations.ppo_iteration(w, prompts, settings, step=step)
        if step >= warmup:
            timings.append({k[len("timing_s/") :]: float(v) for k, v in metrics.items() if k.startswith("timing_s/")})
    on_policy = not needs_old_log_probs(algo_cfg)
    device_s = train_step_device_seconds(w.actor.worker, wl, on_policy=on_policy)
    train_flops = 3 * forward_flops(wl, rows, wl.prompt_len + wl.response_len, wl.response_len)
    return {
        "timings": timings,
        "matmul_gflops": matmul,
        "train_gflop": train_flops / 1e9,
        "train_step_device_s": device_s,
    }


def train_step_device_seconds(actor, wl: Workload, *, on_policy: bool, reps: int = 3) -> float:
    """Best of ``reps`` runs of the actor's compiled train step on one mini-batch of the
    workload's shape (full prompts and responses, as the rollouts with ``ignore_eos``), its
    inputs placed on the device beforehand: the step's device time, no host work."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    rows, P, R = wl.rows, wl.prompt_len, wl.response_len
    host = {
        "prompt_ids": rng.integers(4, wl.vocab, (rows, P)).astype(np.int32),
        "prompt_mask": np.ones((rows, P), np.int32),
        "responses": rng.integers(4, wl.vocab, (rows, R)).astype(np.int32),
        "response_mask": np.ones((rows, R), np.int32),
        "advantages": rng.normal(size=(rows, R)).astype(np.float32),
        "old_log_probs": np.full((rows, R), -np.log(wl.vocab), np.float32),
        "ref_log_prob": np.full((rows, R), -np.log(wl.vocab), np.float32),
    }
    keys = actor.config.update_keys(on_policy)
    inputs, _ = actor.place_minibatch({k: host[k] for k in keys}, np.arange(rows))
    step = actor.train_program(rows, on_policy)
    scalars = {"temperature": np.float32(1.0)}
    seconds = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        actor.state, metrics = step(actor.state, inputs, scalars)
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - t0)
    return min(seconds[1:])  # the first run may still compile (this mini-batch's shape bucket)


# ------------------------------------------------------------------------ TRL


def check_trl():
    """The installed TRL's ``GRPOTrainer``, once every method `TRL_HOOKS` wraps is there and
    takes the expected first parameter; otherwise one clear error naming what is missing."""
    try:
        import trl
        from trl import GRPOTrainer
    except ImportError as e:
        raise SystemExit(
            f"bench_rl_step: trl_grpo needs TRL, in the `bench` extra (pip install -e '.[bench]'): {e}"
        ) from e
    problems = []
    for name, first in TRL_HOOKS.items():
        fn = getattr(GRPOTrainer, name, None)
        if not callable(fn):
            problems.append(f"{name} is missing")
            continue
        params = [q for q in inspect.signature(fn).parameters if q != "self"]
        if first is not None and (not params or params[0] != first):
            problems.append(f"{name}'s first parameter is {params[:1]}, not {first!r}")
    if problems:
        raise SystemExit(
            f"bench_rl_step: TRL {trl.__version__}'s GRPOTrainer does not have the private methods this "
            f"benchmark times its phases with ({'; '.join(problems)}); install a TRL that does (the "
            f"`bench` extra) or update TRL_HOOKS and trl_child"
        )
    return trl.__version__


def trl_child(steps: int, warmup: int, workdir: str, wl: Workload) -> dict:
    trl_version = check_trl()
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from jaxflow.data.char_tokenizer import CharTokenizer

    tok_dir = os.path.join(workdir, "tokenizer")
    CharTokenizer().save_pretrained(tok_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    tokenizer.padding_side = "left"
    config = transformers.LlamaConfig(
        vocab_size=wl.vocab,
        hidden_size=wl.hidden,
        intermediate_size=wl.mlp,
        num_hidden_layers=wl.layers,
        num_attention_heads=wl.heads,
        num_key_value_heads=wl.kv_heads,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model_dir = os.path.join(workdir, "trl_model")  # TRL builds its reference model from a path
    transformers.LlamaForCausalLM(config).float().save_pretrained(model_dir)
    texts = prompt_texts(wl)
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) == wl.prompt_len for t in texts)
    dataset = Dataset.from_dict({"prompt": texts * (warmup + steps)})

    def reward(completions, **_):
        return [reward_of_text(c) for c in completions]

    args = GRPOConfig(
        output_dir=os.path.join(workdir, "out"),
        per_device_train_batch_size=wl.rows,
        num_generations=wl.samples,
        max_completion_length=wl.response_len,
        beta=KL_COEF,
        learning_rate=LR,
        temperature=1.0,
        generation_kwargs={"min_new_tokens": wl.response_len},
        max_steps=warmup + steps,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        shuffle_dataset=False,
        loss_type="dapo",
        disable_dropout=True,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    current: dict[str, float] = {}
    timings: list[dict[str, float]] = []

    def timed(name, fn, when=lambda *a, **k: True):
        def wrapper(*args, **kwargs):
            if not when(*args, **kwargs):
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[name] = current.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    trainer._generate = timed("gen", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "ref", trainer._get_per_token_logps_and_entropies, when=lambda m, *a, **k: m is trainer.ref_model
    )
    score = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = timed("rollout", score)
    step_fn = trainer.training_step

    def training_step(*args, **kwargs):
        current.clear()
        t0 = time.perf_counter()
        out = step_fn(*args, **kwargs)
        total = time.perf_counter() - t0
        phases = dict(current)
        phases["update_actor"] = total - phases.get("rollout", 0.0)
        phases["old_log_prob"] = phases.pop("rollout", 0.0) - sum(phases.get(k, 0.0) for k in ("gen", "ref", "reward"))
        phases["step"] = total
        timings.append(phases)
        return out

    trainer.training_step = training_step
    trainer.train()
    return {"timings": timings[warmup:], "torch_threads": torch.get_num_threads(), "trl_version": trl_version}


# ------------------------------------------------------------------------ long-tailed lengths


def longtail_child(steps: int, warmup: int, wl: Workload) -> dict:
    """Log-probs + one update of the actor on one batch (``wl.rows`` rows, full prompts,
    response lengths ~ lognormal with median ``wl.response_len / 4``, capped at
    ``wl.response_len``): the padded path vs remove padding + dynamic micro-batches,
    alternating within this process, ``warmup`` rounds dropped."""
    import dataclasses

    import jax
    import numpy as np

    import jaxflow.models as models
    from jaxflow.data.batch import Batch
    from jaxflow.workers import ActorConfig, ActorWorker, OptimConfig, RolloutConfig
    from jaxflow.workers.packing import plan_packing

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
    rows, P, R = wl.rows, wl.prompt_len, wl.response_len
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(R / 4), 1.0, rows)), 1, R).astype(int)
    rm = (np.arange(R)[None] < lengths[:, None]).astype(np.int32)
    batch = Batch.from_dict(
        {
            "prompt_ids": rng.integers(4, wl.vocab, (rows, P)).astype(np.int32),
            "prompt_mask": np.ones((rows, P), np.int32),
            "responses": (rng.integers(4, wl.vocab, (rows, R)) * rm).astype(np.int32),
            "response_mask": rm,
            "advantages": (rng.normal(size=(rows, R)) * rm).astype(np.float32),
            "ref_log_prob": (-np.log(wl.vocab) * rm).astype(np.float32),
        }
    )
    base = ActorConfig(ppo_mini_batch_size=rows, use_kl_loss=True, kl_loss_coef=KL_COEF, optim=OptimConfig(lr=LR))
    configs = {
        "padded": base,
        "packed": dataclasses.replace(
            base, use_remove_padding=True, use_dynamic_bsz=True, log_prob_use_dynamic_bsz=True
        ),
    }
    model = models.init_model(cfg, "lm", seed=0)
    actors = {name: ActorWorker(model, "fsdp=1", "train", c, RolloutConfig()) for name, c in configs.items()}
    times: dict[str, list[dict]] = {name: [] for name in actors}
    for round_ in range(warmup + steps):
        for name, actor in actors.items():
            t0 = time.perf_counter()
            lp = actor.log_probs(batch)
            jax.block_until_ready(lp["old_log_probs"])
            t1 = time.perf_counter()
            actor.update(batch | lp)
            t2 = time.perf_counter()
            if round_ >= warmup:
                times[name].append({"log_prob": t1 - t0, "update": t2 - t1, "both": t2 - t0})
    layout = plan_packing(np.asarray(batch["prompt_mask"]), rm, max_token_len=base.ppo_max_token_len_per_device)
    return {
        "times": times,
        "response_lengths": {
            "median": float(np.median(lengths)),
            "mean": float(lengths.mean()),
            "max": int(lengths.max()),
            "cap": R,
        },
        "slots": {"padded": rows * (P + R), "packed": layout.slots(), "real_tokens": layout.real_tokens()},
    }


# ------------------------------------------------------------------------ driver


def run_child(system: str, args: argparse.Namespace, workdir: str) -> dict:
    script, packing, child = os.path.abspath(__file__), args.packing, system
    if system.startswith("before_"):  # the same workload on another checkout (e.g. main before a change)
        script, packing, child = (
            os.path.join(args.before_tree, "experiments", "bench_rl_step.py"),
            "off",
            "jaxflow_" + system[len("before_") :],
        )
    cmd = [
        sys.executable,
        script,
        "--_child",
        child,
        "--_dir",
        workdir,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--packing",
        packing,
    ] + (["--tiny"] if args.tiny else [])
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(script)))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{system} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(results: dict[str, list[dict]]) -> dict:
    """Median / best per phase; for jaxflow the update's FLOP/s (device time of the train step,
    and the update phase's wall clock) against the same-run matmul; GRPO systems' speed-up
    over TRL's GRPO (PPO gets none: TRL has no PPO here)."""
    summary = {}
    for system, runs in results.items():
        steps = [t for r in runs for t in r["timings"]]
        phases = {}
        for name in PHASES:
            vals = [t.get(name, 0.0) for t in steps]
            if any(vals):
                phases[name] = {"median": statistics.median(vals), "best": min(vals)}
        s = {"phases": phases, "n_steps": len(steps)}
        if "trl_version" in runs[0]:
            s["trl_version"] = runs[0]["trl_version"]
        if "matmul_gflops" in runs[0]:
            mm = statistics.median(r["matmul_gflops"] for r in runs)
            gflop = runs[0]["train_gflop"]
            device = statistics.median(r["train_step_device_s"] for r in runs)
            wall = phases["update_actor"]["median"]
            s.update(
                matmul_gflops=mm,
                train_gflop_analytic=gflop,
                train_step_device_s=device,
                train_gflops_device=gflop / device,
                train_gflops_update_wall=gflop / wall,
                train_fraction_of_matmul_device=gflop / device / mm,
                train_fraction_of_matmul_update_wall=gflop / wall / mm,
            )
        summary[system] = s
    if "trl_grpo" in summary:
        trl = summary["trl_grpo"]["phases"]["step"]
        for system in summary:
            if system.endswith("_grpo") and system != "trl_grpo":
                me = summary[system]["phases"]["step"]
                summary[system]["speedup_vs_trl_grpo"] = {
                    "median": trl["median"] / me["median"],
                    "best": trl["best"] / me["best"],
                }
    return summary


def summarise_longtail(runs: list[dict]) -> dict:
    """Median / best seconds of log-prob, update and both per path, and the packed speed-up
    of log-prob + update together (medians over all rounds of one process, alternating)."""
    out = {"response_lengths": runs[0]["response_lengths"], "slots": runs[0]["slots"]}
    for name in ("padded", "packed"):
        for phase in ("log_prob", "update", "both"):
            vals = [t[phase] for r in runs for t in r["times"][name]]
            out[f"{name}/{phase}_s"] = {"median": statistics.median(vals), "best": min(vals)}
    out["speedup_log_prob_plus_update"] = {
        k: out["padded/both_s"][k] / out["packed/both_s"][k] for k in ("median", "best")
    }
    return out


def print_table(summary: dict, load: str) -> None:
    systems = list(summary)
    print(f"seconds per step, measured (median / best over steps of all rounds); load: {load}")
    print(f"{'phase':<15}" + "".join(f"{s:>22}" for s in systems))
    for name in PHASES:
        cells = []
        for s in systems:
            p = summary[s]["phases"].get(name)
            cells.append(f"{p['median']:.2f} / {p['best']:.2f}" if p else "-")
        print(f"{name:<15}" + "".join(f"{c:>22}" for c in cells))
    for s in systems:
        x = summary[s]
        if "speedup_vs_trl_grpo" in x:
            v = x["speedup_vs_trl_grpo"]
            print(
                f"{s}: {v['median']:.2f}x TRL {summary['trl_grpo'].get('trl_version', '')} GRPO's step (median), "
                f"{v['best']:.2f}x (best)"
            )
        elif s.endswith("_ppo"):
            print(
                f"{s}: {x['phases']['step']['median']:.2f} s per PPO step (median; actor + critic; TRL runs GRPO "
                f"only, so no ratio)"
            )
        if "train_gflops_device" in x:
            print(
                f"{s}: actor train step {x['train_gflops_device']:.0f} GFLOP/s on its device time "
                f"({x['train_step_device_s']:.2f} s; {100 * x['train_fraction_of_matmul_device']:.0f}% of the "
                f"{x['matmul_gflops']:.0f} GFLOP/s fp32 matmul in the same run), {x['train_gflops_update_wall']:.0f} "
                f"GFLOP/s on the update phase's wall clock ({100 * x['train_fraction_of_matmul_update_wall']:.0f}%; "
                f"host packing and transfers included); FLOPs analytic, seconds measured"
            )


def print_longtail(summary: dict, load: str) -> None:
    lengths, slots = summary["response_lengths"], summary["slots"]
    print(
        f"long-tailed responses (median {lengths['median']:.0f}, mean {lengths['mean']:.1f}, max {lengths['max']} "
        f"of cap {lengths['cap']}); slots computed: padded {slots['padded']}, packed {slots['packed']} "
        f"({slots['real_tokens']} real tokens); load: {load}"
    )
    print(f"{'seconds (median / best)':<26}{'log_prob':>18}{'update':>18}{'log_prob + update':>20}")
    for name in ("padded", "packed"):
        cells = [summary[f"{name}/{phase}_s"] for phase in ("log_prob", "update", "both")]
        print(f"{name:<26}" + "".join(f"{c['median']:>11.3f} / {c['best']:.3f}" for c in cells))
    v = summary["speedup_log_prob_plus_update"]
    print(
        f"packing + dynamic micro-batches vs padded, log-prob + update together: {v['median']:.2f}x (median), "
        f"{v['best']:.2f}x (best), measured in one process, alternating"
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    wl = TINY if args.tiny else FULL
    if args._child:
        if args._child == "trl_grpo":
            result = trl_child(args.steps, args.warmup, args._dir, wl)
        elif args._child == "longtail":
            result = longtail_child(args.steps, args.warmup, wl)
        else:
            result = jaxflow_child(args._child.split("_")[1], args.steps, args.warmup, args.packing == "on", wl)
        print(json.dumps(result))
        return
    systems = ["longtail"] if args.longtail else args.systems.split(",")
    if "trl_grpo" in systems:
        check_trl()  # one clear line before any child runs
    load_before = os.getloadavg()
    results: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for system in systems:
                results[system].append(run_child(system, args, workdir))
                # each child's raw result as it lands (a long run on a loaded machine keeps its partial data)
                print(f"round {r + 1}: {system} {json.dumps(results[system][-1])}", file=sys.stderr, flush=True)
    load = f"loadavg before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    summary = summarise_longtail(results["longtail"]) if args.longtail else summarise(results)
    if args.json:
        print(json.dumps(summary | {"load": load, "workload": dataclasses.asdict(wl)}, indent=1))
    elif args.longtail:
        print_longtail(summary, load)
    else:
        print_table(summary, load)


if __name__ == "__main__":
    main()
