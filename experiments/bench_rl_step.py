"""One RL step, jaxflow vs TRL's ``GRPOTrainer``, per phase, on one CPU device.

The workload (both systems, fp32, random weights, the same 64-token prompts):

* policy: Llama-shaped, hidden 512, MLP 1408, 8 layers, 8 heads, 2 kv heads, vocab 256
  (jaxflow's character tokenizer, written once as a ``tokenizer.json`` for TRL);
* 8 prompts x 4 samples, prompt 64 tokens, responses of exactly 128 tokens (jaxflow:
  ``rollout.ignore_eos``; TRL: ``min_new_tokens``), temperature 1;
* GRPO with a reference model and a KL loss of 0.04 (k3 / ``low_var_kl``), one optimizer
  step per rollout (the mini-batch is the whole batch); jaxflow's PPO (GAE, a critic of the
  same shape) is timed beside it;
* reward: the fraction of ``a`` characters in the response (host side, both systems).

Each system runs in its own child process, the systems alternating ``--rounds`` times (the
machine is shared: report median and best). In every child the first ``--warmup`` steps
(compiles, allocator warm-up) are dropped and the next ``--steps`` are timed.

Phases (seconds per step, measured): ``gen`` (rollout), ``old_log_prob`` (a separate
old-log-prob pass; none with the on-policy shortcut), ``ref``, ``values`` (PPO), ``reward``,
``adv``, ``update_critic``, ``update_actor``, ``step`` (the whole step). For TRL the same
phases are read by wrapping its generation, reference forward and ``training_step``.

FLOP/s of the actor update (``train_gflops``): the analytic FLOPs of one forward and backward
(3 x the forward's matmul FLOPs, attention included, over every token of the
``[prompt | response]`` rows) divided by the measured ``update_actor`` seconds, against
``matmul_gflops``: a 2048^3 fp32 matmul timed in the same child right before its steps.

``--longtail`` instead times jaxflow's log-prob and update phases on one synthetic batch
whose response lengths are drawn from a long-tailed distribution (median about a quarter of
the cap), padded path vs packed path with token-budget micro-batches, alternating.

    python experiments/bench_rl_step.py --rounds 3          # GRPO + PPO vs TRL, a table
    python experiments/bench_rl_step.py --longtail --json   # packing speed-up
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HIDDEN, MLP, LAYERS, HEADS, KV_HEADS, VOCAB = 512, 1408, 8, 8, 2, 256
PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN = 8, 4, 64, 128
KL_COEF, LR = 0.04, 1e-6
PHASES = ("gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic", "update_actor", "step")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="alternations of the systems")
    p.add_argument("--steps", type=int, default=3, help="timed steps per child")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per child")
    p.add_argument("--systems", default="jaxflow_grpo,jaxflow_ppo,trl_grpo",
                   help="comma-separated: jaxflow_grpo, jaxflow_ppo, trl_grpo, before_grpo, before_ppo")
    p.add_argument("--packing", choices=("on", "off"), default="on",
                   help="jaxflow: remove padding / dynamic micro-batches (off: the padded path)")
    p.add_argument("--before_tree", default="",
                   help="a checkout to time as before_grpo / before_ppo (this script copied into it, padded path)")
    p.add_argument("--longtail", action="store_true", help="packed vs padded log-prob + update, long-tailed lengths")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    p.add_argument("--_dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------ analytic FLOPs


def forward_flops(rows: int, length: int, logit_positions: int) -> float:
    """Analytic matmul FLOPs of one forward over ``rows`` x ``length`` tokens (attention
    scores and values over all ``length`` keys, as computed), LM head on ``logit_positions``
    per row."""
    head_dim, tokens = HIDDEN // HEADS, rows * length
    attn_proj = 2 * HIDDEN * (2 * HEADS * head_dim + 2 * KV_HEADS * head_dim)
    mlp = 2 * 3 * HIDDEN * MLP
    attn_scores = 2 * 2 * length * HEADS * head_dim
    per_layer = tokens * (attn_proj + mlp + attn_scores)
    return LAYERS * per_layer + rows * logit_positions * 2 * HIDDEN * VOCAB


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
    return 2 * n ** 3 / best / 1e9


# ------------------------------------------------------------------------ shared workload


def prompt_texts() -> list[str]:
    """``PROMPTS`` prompts of exactly ``PROMPT_LEN`` tokens: ``<bos>`` + random letters."""
    import numpy as np

    rng = np.random.default_rng(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    return ["<bos>" + "".join(rng.choice(list(letters), PROMPT_LEN - 1)) for _ in range(PROMPTS)]


def reward_of_text(text: str) -> float:
    return text.count("a") / max(len(text), 1)


# ------------------------------------------------------------------------ jaxflow


def jaxflow_child(algo: str, steps: int, warmup: int, packing: bool) -> dict:
    import jax
    import numpy as np

    import jaxflow.algos as algos
    import jaxflow.models as models
    import jaxflow.programs as programs
    from jaxflow.data.batch import Batch
    from jaxflow.data.char_tokenizer import CharTokenizer
    from jaxflow.sampling import SamplingParams
    from jaxflow.workers import (ActorConfig, ActorWorker, CriticConfig, CriticWorker, LocalWorkerGroup,
                                 OptimConfig, ReferenceWorker, RolloutConfig, Workers)

    tok = CharTokenizer()
    cfg = models.get_preset("tiny_llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
                            num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rows = PROMPTS * SAMPLES
    extra = {"use_remove_padding": True, "use_dynamic_bsz": True} if packing else {}
    actor_cfg = ActorConfig(ppo_mini_batch_size=rows, use_kl_loss=algo == "grpo", kl_loss_coef=KL_COEF,
                            kl_loss_type="low_var_kl", optim=OptimConfig(lr=LR), **extra)
    rollout = RolloutConfig(train=SamplingParams(n=SAMPLES, max_new_tokens=RESPONSE_LEN, eos_token_ids=(),
                                                 pad_token_id=tok.pad_token_id))
    policy = models.init_model(cfg, "lm", seed=0)
    mesh, rules = "fsdp=1", "train"
    w = Workers(actor=LocalWorkerGroup(ActorWorker, name="actor", model=policy, mesh=mesh, rules=rules,
                                       config=actor_cfg, rollout=rollout))
    if algo == "grpo":
        w.ref = LocalWorkerGroup(ReferenceWorker, name="ref", model=policy, mesh=mesh, rules=rules, **(
            {"use_remove_padding": True} if packing else {}))
    else:
        critic_extra = {"use_remove_padding": True, "use_dynamic_bsz": True} if packing else {}
        w.critic = LocalWorkerGroup(CriticWorker, name="critic", model=models.init_model(cfg, "value", seed=1),
                                    mesh=mesh, rules=rules,
                                    config=CriticConfig(ppo_mini_batch_size=rows, optim=OptimConfig(lr=LR),
                                                        **critic_extra))
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
    ids = np.array([tok.encode(t, add_special_tokens=False) for t in prompt_texts()], np.int32)
    assert ids.shape == (PROMPTS, PROMPT_LEN), ids.shape
    prompts = programs.batch_from_prompts({"prompt_ids": ids, "prompt_mask": np.ones_like(ids)})
    settings = algos.AlgorithmSettings(algos.AlgorithmConfig(adv_estimator=algo if algo == "grpo" else "gae"))
    matmul = matmul_gflops()
    timings = []
    for step in range(warmup + steps):
        metrics = programs.ppo_iteration(w, prompts, settings, step=step)
        if step >= warmup:
            timings.append({k[len("timing_s/"):]: float(v) for k, v in metrics.items() if k.startswith("timing_s/")})
    train_flops = 3 * forward_flops(rows, PROMPT_LEN + RESPONSE_LEN, RESPONSE_LEN)
    return {"timings": timings, "matmul_gflops": matmul, "train_gflop": train_flops / 1e9}


# ------------------------------------------------------------------------ TRL


def trl_child(steps: int, warmup: int, workdir: str) -> dict:
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
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model_dir = os.path.join(workdir, "trl_model")  # TRL builds its reference model from a path
    transformers.LlamaForCausalLM(config).float().save_pretrained(model_dir)
    texts = prompt_texts()
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) == PROMPT_LEN for t in texts)
    dataset = Dataset.from_dict({"prompt": texts * (warmup + steps)})

    def reward(completions, **_):
        return [reward_of_text(c) for c in completions]

    args = GRPOConfig(
        output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=PROMPTS * SAMPLES,
        num_generations=SAMPLES, max_completion_length=RESPONSE_LEN, beta=KL_COEF, learning_rate=LR,
        temperature=1.0, generation_kwargs={"min_new_tokens": RESPONSE_LEN}, max_steps=warmup + steps,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, shuffle_dataset=False,
        loss_type="dapo", disable_dropout=True, model_init_kwargs={"dtype": torch.float32})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
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
        "ref", trainer._get_per_token_logps_and_entropies, when=lambda m, *a, **k: m is trainer.ref_model)
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
    lengths = None
    return {"timings": timings[warmup:], "torch_threads": torch.get_num_threads(), "lengths": lengths}


# ------------------------------------------------------------------------ long-tailed lengths


def longtail_child(steps: int, warmup: int) -> dict:
    """Log-probs + one update of the actor on one batch (``PROMPTS x SAMPLES`` rows, full
    prompts, response lengths ~ lognormal with median ``RESPONSE_LEN / 4``, capped at
    ``RESPONSE_LEN``): the padded path vs remove padding + dynamic micro-batches, alternating
    within this process, ``warmup`` rounds dropped."""
    import dataclasses

    import jax
    import numpy as np

    import jaxflow.models as models
    from jaxflow.data.batch import Batch
    from jaxflow.workers import ActorConfig, ActorWorker, OptimConfig, RolloutConfig
    from jaxflow.workers.packing import plan_packing

    cfg = models.get_preset("tiny_llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
                            num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HIDDEN // HEADS)
    rows = PROMPTS * SAMPLES
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(RESPONSE_LEN / 4), 1.0, rows)), 1, RESPONSE_LEN).astype(int)
    rm = (np.arange(RESPONSE_LEN)[None] < lengths[:, None]).astype(np.int32)
    batch = Batch.from_dict({
        "prompt_ids": rng.integers(4, VOCAB, (rows, PROMPT_LEN)).astype(np.int32),
        "prompt_mask": np.ones((rows, PROMPT_LEN), np.int32),
        "responses": (rng.integers(4, VOCAB, (rows, RESPONSE_LEN)) * rm).astype(np.int32), "response_mask": rm,
        "advantages": (rng.normal(size=(rows, RESPONSE_LEN)) * rm).astype(np.float32),
        "ref_log_prob": (-5.5 * rm).astype(np.float32),
    })
    base = ActorConfig(ppo_mini_batch_size=rows, use_kl_loss=True, kl_loss_coef=KL_COEF, optim=OptimConfig(lr=LR))
    configs = {"padded": base, "packed": dataclasses.replace(
        base, use_remove_padding=True, use_dynamic_bsz=True, log_prob_use_dynamic_bsz=True)}
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
    layout = plan_packing(np.asarray(batch["prompt_mask"]), rm, max_token_len=16384)
    return {"times": times, "response_lengths": {"median": float(np.median(lengths)), "mean": float(lengths.mean()),
                                                 "max": int(lengths.max()), "cap": RESPONSE_LEN},
            "slots": {"padded": rows * (PROMPT_LEN + RESPONSE_LEN), "packed": layout.slots(),
                      "real_tokens": layout.real_tokens()}}


# ------------------------------------------------------------------------ driver


def run_child(system: str, args: argparse.Namespace, workdir: str) -> dict:
    script, packing, child = os.path.abspath(__file__), args.packing, system
    if system.startswith("before_"):  # the same workload on another checkout (e.g. main before a change)
        script, packing, child = os.path.join(args.before_tree, "experiments", "bench_rl_step.py"), "off", \
            "jaxflow_" + system[len("before_"):]
    cmd = [sys.executable, script, "--_child", child, "--_dir", workdir,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--packing", packing]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(script)))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{system} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(results: dict[str, list[dict]]) -> dict:
    summary = {}
    for system, runs in results.items():
        steps = [t for r in runs for t in r["timings"]]
        phases = {}
        for name in PHASES:
            vals = [t.get(name, 0.0) for t in steps]
            if any(vals):
                phases[name] = {"median": statistics.median(vals), "best": min(vals)}
        s = {"phases": phases, "n_steps": len(steps)}
        if "matmul_gflops" in runs[0]:
            mm = [r["matmul_gflops"] for r in runs]
            upd = [t["update_actor"] for t in steps]
            gflop = runs[0]["train_gflop"]
            s.update(matmul_gflops={"median": statistics.median(mm), "best": max(mm)},
                     train_gflops={"median": gflop / statistics.median(upd), "best": gflop / min(upd)},
                     train_gflop_analytic=gflop)
            s["train_fraction_of_matmul"] = s["train_gflops"]["median"] / s["matmul_gflops"]["median"]
        summary[system] = s
    if "trl_grpo" in summary:
        trl = summary["trl_grpo"]["phases"]["step"]
        for system in summary:
            if system != "trl_grpo":
                me = summary[system]["phases"]["step"]
                summary[system]["speedup_vs_trl"] = {"median": trl["median"] / me["median"],
                                                     "best": trl["best"] / me["best"]}
    return summary


def summarise_longtail(runs: list[dict]) -> dict:
    """Median / best seconds of log-prob + update per path, and the packed speed-up."""
    out = {"response_lengths": runs[0]["response_lengths"], "slots": runs[0]["slots"]}
    for name in ("padded", "packed"):
        for phase in ("log_prob", "update", "both"):
            vals = [t[phase] for r in runs for t in r["times"][name]]
            out[f"{name}/{phase}_s"] = {"median": statistics.median(vals), "best": min(vals)}
    out["speedup_log_prob_plus_update"] = {
        k: out["padded/both_s"][k] / out["packed/both_s"][k] for k in ("median", "best")}
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
        if "speedup_vs_trl" in x:
            print(f"{s}: {x['speedup_vs_trl']['median']:.2f}x TRL's step (median), {x['speedup_vs_trl']['best']:.2f}x (best)")
        if "train_gflops" in x:
            print(f"{s}: update_actor {x['train_gflops']['median']:.0f} GFLOP/s (analytic FLOPs / measured s) vs "
                  f"{x['matmul_gflops']['median']:.0f} GFLOP/s fp32 matmul in the same run "
                  f"({100 * x['train_fraction_of_matmul']:.0f}%)")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._child:
        if args._child == "trl_grpo":
            result = trl_child(args.steps, args.warmup, args._dir)
        elif args._child == "longtail":
            result = longtail_child(args.steps, args.warmup)
        else:
            result = jaxflow_child(args._child.split("_")[1], args.steps, args.warmup, args.packing == "on")
        print(json.dumps(result))
        return
    load_before = os.getloadavg()
    systems = ["longtail"] if args.longtail else args.systems.split(",")
    results: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for system in systems:
                results[system].append(run_child(system, args, workdir))
                # each child's raw result as it lands (a long run on a loaded machine keeps its partial data)
                print(f"round {r + 1}: {system} {json.dumps(results[system][-1])}", file=sys.stderr, flush=True)
    load = f"loadavg before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    if args.longtail:
        summary = summarise_longtail(results["longtail"])
        summary["load"] = load
        print(json.dumps(summary, indent=1) if args.json else "\n".join(
            f"{k}: {v}" for k, v in summary.items()))
        return
    summary = summarise(results)
    summary["load"] = load
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print_table({k: v for k, v in summary.items() if k != "load"}, load)


if __name__ == "__main__":
    main()
