"""Supervised warm start (``jaxflow.job=sft``, the ``sft_tiny`` config): the actor learns a
built-in task's demonstrations, then an HF checkpoint (+ tokenizer) is written that the RL
configs start from (``actor_rollout_ref.model.path``).

The loss is the token-mean negative log-likelihood of the response tokens (answer + EOS)
given the prompt, over the same ``[prompt | response]`` rows and the same jitted train step
(micro-batched, sharded over the actor's training mesh) as the policy update::

    L = - sum_{b,t} m_bt log pi(y_bt | x_b, y_b<t) / sum_{b,t} m_bt
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.configs.prepare import PreparedRun, builtin_task
from jaxflow.configs.run_spec import RunSpec, SFTSpec, start_actor_from
from jaxflow.data.dataset import tokenize_sft_examples
from jaxflow.mesh import data_parallel_size, state_shardings
from jaxflow.models import init_model
from jaxflow.sampling import SamplingParams, generate_from_state
from jaxflow.trainer.builders import load_model
from jaxflow.trainer.checkpoint import all_finite
from jaxflow.trainer.guard import NonFiniteError
from jaxflow.trainer.hf_export import check_export_target, write_hf
from jaxflow.trainer.metrics import JSONL_NAME, MetricsLogger
from jaxflow.trainer.outputs import RunDirLock, set_aside_previous_outputs
from jaxflow.trainer.summary import run_summary
from jaxflow.workers import OptimConfig, create_train_state, make_optimizer, make_train_step
from jaxflow.workers.base import num_micro_batches
from jaxflow.workers.forward import PROMPT_KEYS, log_probs_and_entropy

WARM_START_DIR = "sft_warm_start"  # an RL run's supervised warm start, in its run directory


def sft_loss(model, micro, gbi, scalars):
    """Token-mean NLL with the mini-batch's token count, so micro-batches add up exactly."""
    log_probs, _ = log_probs_and_entropy(model, micro, 1.0, with_entropy=False)
    m = micro["response_mask"].astype(jnp.float32)
    nll = -jnp.sum(log_probs * m) / gbi["batch_num_tokens"]
    return nll, {"loss": nll}


def greedy_accuracy(graphdef, params, task, tokenizer, spec: RunSpec, n: int = 256, seed: int = 0) -> float:
    """Exact-match accuracy of greedy answers on ``n`` test-split problems."""
    rows = task.make_sft_examples(n, seed=seed, split="test")
    data = tokenize_sft_examples(rows, tokenizer, spec.prompt_length, spec.response_length)
    out = generate_from_state(
        graphdef,
        params,
        data["prompt_ids"],
        data["prompt_mask"],
        SamplingParams(
            max_new_tokens=spec.response_length,
            greedy=True,
            eos_token_ids=(tokenizer.eos_token_id,),
            pad_token_id=tokenizer.pad_token_id,
        ),
    )
    responses, mask = np.asarray(out.responses), np.asarray(out.response_mask)
    texts = tokenizer.batch_decode([r[m > 0].tolist() for r, m in zip(responses, mask)], skip_special_tokens=True)
    return float(np.mean([t.strip() == row["response"] for t, row in zip(texts, rows)]))


def sft_run_dir(output_dir: str) -> str:
    """Where an sft job writing ``output_dir`` logs: ``<output_dir>_run`` beside it."""
    return os.path.join(os.path.dirname(os.path.abspath(output_dir)), f"{os.path.basename(output_dir)}_run")


def run_sft(prepared: PreparedRun, record: Any = None) -> tuple[dict[str, float], nnx.GraphDef, Any]:
    """Train, log (``sft/loss``, ``sft/val_accuracy``; ``record``: the config written beside the
    logs), write the HF checkpoint (+ tokenizer), print a summary. Returns the final metrics
    and the trained ``(graphdef, params)``, still on the actor's training mesh (the RL warm
    start takes them over in memory).

    Nothing of the user's is lost: ``output_dir`` is checked before training (a new or empty
    directory, or an earlier jaxflow export, see `check_export_target`) and replaced only by
    finite weights; a step whose update was refused (NaN/Inf loss or gradient, or weights that
    would overflow, e.g. ``lr=1e39``) stops the job (``NonFiniteError``) with ``output_dir``
    untouched. The log directory (``<output_dir>_run``) is locked for the job's lifetime, and an
    earlier job's logs there are moved aside (``previous-<time>/``)."""
    started = time.perf_counter()
    output_dir = prepared.spec.sft.output_dir
    check_export_target(output_dir)
    run_dir = sft_run_dir(output_dir)
    with RunDirLock(run_dir):
        set_aside_previous_outputs(run_dir)
        return _train_sft(prepared, record, run_dir, started)


def _refused(step: int, metrics: dict[str, float], s: SFTSpec) -> NonFiniteError:
    return NonFiniteError(
        f"sft step {step}: the update was refused (loss {metrics['sft/loss']:.4g}, gradient norm "
        f"{metrics['sft/grad_norm']:.4g}, learning rate {s.lr:g}: not finite, or weights that would "
        f"overflow); no weights were written, {os.path.abspath(s.output_dir)} is unchanged. Lower "
        "jaxflow.sft.lr or check the data"
    )


def _sft_step(step_fn: Any, state: Any, batch: dict[str, np.ndarray]) -> tuple[Any, dict[str, float]]:
    """One optimizer step and its metrics (``timing_s/step`` measured)."""
    start = time.perf_counter()
    state, out = step_fn(state, batch, {})
    out = jax.device_get(out)
    metrics = {f"sft/{k}": float(out[k]) for k in ("loss", "grad_norm", "lr", "update_skipped")}
    metrics["timing_s/step"] = time.perf_counter() - start
    return state, metrics


def _train_sft(
    prepared: PreparedRun, record: Any, run_dir: str, started: float
) -> tuple[dict[str, float], nnx.GraphDef, Any]:
    spec, tokenizer = prepared.spec, prepared.tokenizer
    s, t = spec.sft, spec.trainer
    task = builtin_task(spec.data)
    rows = task.make_sft_examples(spec.data.num_train_examples, seed=spec.data.seed, split="train")
    data = tokenize_sft_examples(rows, tokenizer, spec.prompt_length, spec.response_length)
    graphdef, state, step_fn = _sft_state_and_step(spec)
    logger = MetricsLogger(
        run_dir,
        backends=tuple(t.logger),
        project=t.project_name,
        experiment=t.experiment_name,
        config=record,
        console_keys={"sft/loss": "loss", "sft/val_accuracy": "val_acc", "timing_s/step": "step_s"},
        total_steps=s.steps,
    )
    rng = np.random.default_rng(spec.seed)
    history: list[dict[str, float]] = []
    metrics: dict[str, float] = {}
    try:
        for step in range(1, s.steps + 1):
            idx = rng.choice(len(rows), size=s.batch_size, replace=False)
            state, metrics = _sft_step(step_fn, state, {key: data[key][idx] for key in PROMPT_KEYS})
            if metrics["sft/update_skipped"] > 0:
                logger.log(metrics, step)
                raise _refused(step, metrics, s)
            if s.test_freq > 0 and (step % s.test_freq == 0 or step == s.steps):
                metrics["sft/val_accuracy"] = greedy_accuracy(graphdef, state.params, task, tokenizer, spec)
            logger.log(metrics, step)
            history.append({"step": step, **metrics})
    finally:
        logger.close()
    if not all_finite(state.params):  # the train step keeps the old weights unless the new ones are finite
        raise NonFiniteError(f"sft: the trained weights hold NaN or Inf; {s.output_dir} is unchanged")
    out_dir = write_hf(graphdef, state.params, tokenizer, s.output_dir)
    outputs = {"HF export": str(out_dir), "metrics": os.path.join(run_dir, JSONL_NAME) if "jsonl" in t.logger else None}
    summary = run_summary(
        history,
        wall_s=time.perf_counter() - started,
        outputs=outputs,
        train=("training loss", "sft/loss"),
        val=("held-out accuracy", "sft/val_accuracy"),
    )
    print("sft " + summary, flush=True)
    return metrics, graphdef, state.params


def _sft_state_and_step(spec: RunSpec) -> tuple[nnx.GraphDef, Any, Any]:
    """``(graphdef, train state, jitted step)`` of the supervised run ``spec``: the actor on
    its training mesh (a Ray run's too, over this process's devices: its placement stands in
    for hosts), AdamW at ``jaxflow.sft.lr``, `sft_loss` micro-batched."""
    s = spec.sft
    placement = spec.placement
    if spec.trainer.backend == "ray":
        placement = placement.on(jax.devices()[: spec.num_devices])
    mesh, rules = placement.mesh("actor", "train"), placement.rules("actor", "train")
    graphdef, params = load_model(spec.models["actor"], mesh, rules)
    tx, schedule = make_optimizer(
        OptimConfig(lr=s.lr, weight_decay=s.weight_decay, lr_warmup_steps=s.warmup_steps, grad_clip=1.0)
    )
    state, shardings = create_train_state(params, state_shardings(params, rules, mesh), tx, mesh)
    k = num_micro_batches(s.batch_size, s.micro_batch_size_per_device, data_parallel_size(rules, mesh), "sft batch")
    step_fn = make_train_step(
        graphdef,
        tx,
        schedule,
        sft_loss,
        mesh=mesh,
        rules=rules,
        state_shardings=shardings,
        batch_ndims={key: 2 for key in PROMPT_KEYS},
        num_micro=k,
    )
    return graphdef, state, step_fn


def warm_start(
    prepared: PreparedRun, record: Any = None, *, resuming: bool = False
) -> tuple[RunSpec, tuple[nnx.GraphDef, Any] | None]:
    """``(RL run, actor weights)`` after ``jaxflow.sft.warm_start_steps`` supervised steps (0
    when the actor has weights of its own): SFT runs first on the run's placement and RL
    starts from its weights, handed over in memory (``RLTrainer(cfg, actor_params=...)``);
    its HF checkpoint is still written to ``<run dir>/sft_warm_start``, and the returned run's
    actor (and the roles that follow its weights: the reference) names it
    (`jaxflow.configs.run_spec.start_actor_from`). A run that ``resuming`` from its
    checkpoints reads that directory back instead of training again (weights ``None``: the
    role builders load it); SFT runs again only if it is gone. ``record``: the config the
    warm start's logs record (the run's). Without a warm start: ``(prepared.spec, None)``."""
    spec = prepared.spec
    steps = spec.sft.warm_start_steps
    if steps <= 0:
        return spec, None
    out = os.path.abspath(os.path.join(spec.trainer.run_dir, WARM_START_DIR))
    rl_spec = start_actor_from(spec, out)
    if resuming and os.path.isfile(os.path.join(out, "config.json")):
        print(f"jaxflow: resuming; the reference policy is the supervised warm start in {out}", flush=True)
        return rl_spec, None
    sft = dataclasses.replace(spec.sft, steps=steps, output_dir=out)
    actor = spec.models["actor"]
    # Every weight trains (RL's LoRA adapters, if any, start on top of them), in the plain
    # arithmetic: the agreement mode's batch-invariant sums concern the RL actor and its rollout.
    sft_model = actor.config.replace(lora=None, batch_invariant=False)
    models = {**spec.models, "actor": dataclasses.replace(actor, config=sft_model)}
    print(f"jaxflow: supervised warm start ({steps} steps on {spec.data.builtin_task}) -> {out}", flush=True)
    _, graphdef, params = run_sft(
        dataclasses.replace(prepared, spec=dataclasses.replace(spec, sft=sft, models=models)), record
    )
    if actor.config.batch_invariant:  # the same parameters in the RL actor's (batch-invariant) graph
        rl_model = actor.config.replace(lora=None)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: init_model(rl_model, head=actor.head, seed=actor.seed)))
    return rl_spec, (graphdef, params)
