"""The RL loop: a single controller that runs an algorithm's iteration (`jaxflow.iterations`) over
worker groups built from the run's typed description (`jaxflow.configs.run_spec`), with
validation, checkpoints, metrics and the non-finite guard.

::

    trainer = RLTrainer(cfg)          # the prepared run (spec, tokenizer, prompts), placement,
                                      # warm start, workers, checkpoints, loggers
    history = trainer.fit()           # resume (trainer.resume_mode), train, validate, save, plot,
                                      # export the actor (<run_dir>/hf_actor), print a summary

Determinism: the rollout seed of step ``s`` is ``fold_in(trainer.seed, s)`` and the data order
a function of ``data.seed`` and the epoch, both restored from checkpoints, so a run resumed
from step ``k`` continues exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from ml_collections import ConfigDict

from jaxflow.automap import AutoPlacement
from jaxflow.configs import ConfigError
from jaxflow.configs.overrides import with_values
from jaxflow.configs.prepare import PreparedRun, prepare_run
from jaxflow.configs.resolve import SHAPE_KEYS
from jaxflow.configs.run_spec import RewardSpec, RunSpec, TrainerSpec
from jaxflow.iterations import batch_from_prompts, select_algorithm
from jaxflow.iterations.ppo import PPO_FAMILY
from jaxflow.mesh import Role
from jaxflow.plan.lowering import run_algorithm
from jaxflow.rewards import RewardFunctionError, RewardScorer
from jaxflow.trainer import interrupt
from jaxflow.trainer.ahead import GenerateAhead, lookahead
from jaxflow.trainer.builders import (
    as_role,
    as_role_recipe,
    cut_prompts_warning,
    describe_source,
    load_model,
    place_run,
    ray_config,
    train_loader,
)
from jaxflow.trainer.checkpoint import CheckpointManager, ExperimentMismatchError, HostState, ItemIO
from jaxflow.trainer.compile_ahead import cache_enabled, compile_ahead
from jaxflow.trainer.compile_ahead import describe as describe_compile_ahead
from jaxflow.trainer.compile_log import CompileLog
from jaxflow.trainer.guard import NonFiniteError, NonFiniteGuard
from jaxflow.trainer.hf_export import HF_DIR, base_pointer, check_export_target, write_hf_with
from jaxflow.trainer.metrics import JSONL_NAME, TENSORBOARD_DIR, MetricsLogger, ProgressBar, read_jsonl, scalar_metrics
from jaxflow.trainer.outputs import absolute_paths, check_run_config_target, set_aside_previous_outputs
from jaxflow.trainer.plot import plot_run
from jaxflow.trainer.rollouter import LocalRolloutPool, Rollouter, RolloutError
from jaxflow.trainer.sft import warm_start
from jaxflow.trainer.summary import run_summary
from jaxflow.workers import RuleRewardWorker, build_local_workers
from jaxflow.workers.ray import WorkerGroupError, describe_hosts

log = logging.getLogger(__name__)

CONSOLE_KEYS = {
    "critic/score/mean": "score",
    "reward/num_errors": "reward_errors",
    "reward/num_timeouts": "reward_timeouts",
    "val/score/mean": "val_score",
    "actor/reward_kl_penalty": "kl",
    "actor/ppo_kl": "ppo_kl",
    "actor/pg_loss": "pg_loss",
    "critic/vf_loss": "vf_loss",
    "actor/entropy": "entropy",
    "response_length/mean": "resp_len",
    "timing_s/step": "step_s",
    "perf/throughput": "tok/s",
}


def describe_dtypes(spec: RunSpec) -> str:
    """``dtypes: actor float32 weights / bfloat16 compute (generation copy bfloat16); ref ...``:
    what ``auto`` resolved to (`jaxflow.configs.resolve.resolve_dtypes`)."""
    parts = []
    for role, m in spec.models.items():
        if m.config is None:
            continue
        weights, compute = np.dtype(m.config.param_dtype).name, np.dtype(m.config.dtype).name
        text = f"{role} {weights} weights / {compute} compute"
        if role == "actor" and np.dtype(m.config.dtype).itemsize < np.dtype(m.config.param_dtype).itemsize:
            text += f" (generation copy {compute})"
        parts.append(text)
    return "dtypes: " + "; ".join(parts)


def _mean(value: Any) -> float:
    return float(np.mean(np.asarray(value, np.float64)))


MODEL_SHAPE = ("model_type", *SHAPE_KEYS)


def experiment_record(spec: RunSpec) -> dict[str, str]:
    """What identifies an RL experiment's checkpoints (recorded in each, compared on resume):
    the algorithm and advantage estimator, the task (the built-in task, or the training files'
    names), the roles, and each model's shape, one line each."""
    files = [os.path.basename(f) for f in spec.data.train_files]
    record = {
        "algorithm": f"{select_algorithm(spec.algorithm)} ({spec.algorithm.algorithm.adv_estimator})",
        "task": ", ".join(files) if files else f"built-in {spec.data.builtin_task}",
        "roles": ", ".join(spec.roles),
    }
    for role, m in spec.models.items():
        if role != "ref":  # the actor's model
            shape = "unknown" if m.config is None else " ".join(f"{k}={getattr(m.config, k)}" for k in MODEL_SHAPE)
            record[f"{role} model"] = shape
    # Checkpoints of adapters (and a critic's value head) mean something on their base only.
    for role, conf in (("actor", spec.actor), ("critic", spec.critic)):
        lora = None if conf is None else conf.lora
        if lora is not None:
            record[f"{role} LoRA"] = f"rank={lora.rank} alpha={lora.alpha:g} targets={','.join(lora.targets)}"
    if spec.actor.lora is not None:
        record["actor base"] = base_pointer(spec)
    return record


def worker_failure(error: BaseException) -> WorkerGroupError | None:
    """The worker group's failure behind ``error``: itself, or the rollouter's failed call to
    the rollout pool's group (a `RolloutError` caused by it); None for any other error."""
    if isinstance(error, WorkerGroupError):
        return error
    cause = error.__cause__
    return cause if isinstance(error, RolloutError) and isinstance(cause, WorkerGroupError) else None


class RLTrainer:
    """Everything one RL run needs, built from a validated experiment config."""

    def __init__(self, cfg: ConfigDict, *, actor_params: Any = None):
        """``actor_params``: initial actor (and reference) weights as ``(graphdef, params)``;
        default: the configured model, after the supervised warm start when one is configured
        (``jaxflow.sft.warm_start_steps``; its weights are handed over in memory).

        The config is read once (`prepare_run`: the typed description, the tokenizer, the
        prompts). What the user gave is checked before anything is trained or built: the run
        directory (a fresh run refuses one that holds checkpoints), the reward function, the
        data. Then the auto-mapper places a run of ``placement.type=auto`` (`place_run`), the
        warm start runs (skipped when the run resumes and its output is on disk) and the
        workers are built. The run directory is locked from here to the end of ``fit`` (one run
        per directory), and a fresh run moves an earlier run's outputs there aside
        (``previous-<time>/``)."""
        self._started = time.perf_counter()  # the summary's wall time: the whole run, build included
        self._first_step_at: float | None = None
        self.compiles = CompileLog().__enter__()  # compile seconds per program, for the summary
        self.ckpt: CheckpointManager | None = None
        self.backend = None
        self.auto: AutoPlacement | None = None  # the auto-mapper's choice (placement.type=auto)
        self.ahead: GenerateAhead | None = None  # rollouts generated ahead (trainer.mode, a rollout pool)
        try:
            self._setup(cfg, actor_params)
        except BaseException:  # a refused or failed start leaves the directory unlocked
            if self.ckpt is not None:
                self.ckpt.close()
            self.close()
            raise

    def _setup(self, cfg: ConfigDict, actor_params: Any) -> None:
        prepared = prepare_run(cfg)  # spec (placed unless auto), tokenizer, prompts
        self._check_mode(prepared.spec)
        t = prepared.spec.trainer
        self.run_dir = t.run_dir
        os.makedirs(self.run_dir, exist_ok=True)
        # First, before anything is built or written: the directory's lock (another run there is
        # refused); a fresh run refuses a directory that holds checkpoints (it never deletes them),
        # and a resume refuses another experiment's.
        self.ckpt = self._open_checkpoints(t, experiment_record(prepared.spec))
        # Then the user's reward function, imported in a worker under a time limit: a file that
        # hangs or fails at import, or a wrong signature, stops the run before anything is built.
        self.scorer = self._build_scorer(prepared.spec.reward)
        self.tokenizer = prepared.tokenizer
        self._load_prompts(prepared)
        resuming = self.ckpt.resume_dir() is not None
        if resuming:  # it goes on with the outputs in the directory: they must be ours
            check_run_config_target(self.run_dir)
            check_export_target(os.path.join(self.run_dir, HF_DIR))
        else:  # an earlier run's outputs are kept, moved aside
            set_aside_previous_outputs(self.run_dir)
        # placement auto: the auto-mapper's pools and meshes (the run records the keys that pin them)
        spec, self.auto, self.run_config = place_run(prepared, cfg)
        if actor_params is None:
            spec, actor_params = warm_start(
                dataclasses.replace(prepared, spec=spec), self.run_config, resuming=resuming
            )
            if spec.models["actor"].path != prepared.spec.models["actor"].path:  # the warm start's checkpoint
                self.run_config = with_values(
                    self.run_config, {"actor_rollout_ref.model.path": spec.models["actor"].path}
                )
            if t.backend == "ray":  # the workers read the warm start's HF directory, each process only its shards
                actor_params = None
        self.ckpt.run_config = absolute_paths(
            self.run_config.to_dict()
        )  # each step records the config it was saved with
        if t.backend == "ray":  # Ray is imported only on this path
            from jaxflow.workers.ray import RayBackend

            self.backend = RayBackend(ray_config(spec))
            print(f"jaxflow: {self.backend.cluster}", flush=True)
        self.spec: RunSpec = spec
        self.algorithm = run_algorithm(spec)  # its iteration, and what it runs on
        self.algorithm_name = self.algorithm.name
        self.loader = train_loader(spec, self.train_data)
        self.total_steps = spec.training_steps
        self.completed_steps = 0  # steps trained (or restored)
        self.placement = spec.placement
        # Kept for restarts only (the Ray backend rebuilds its groups from them).
        self._restart_actor_params = actor_params if self.backend is not None else None
        self.workers = self._build_workers(actor_params)
        self.ahead = self._generate_ahead(prepared.devices)
        self.algo_state = self.algorithm.state.initial(spec.algorithm)
        self.guard = NonFiniteGuard(spec.trainer.max_nonfinite_steps)
        self._initial_host_state = (self.loader.state_dict(), self.algo_state.state_dict(), self.guard.state_dict())
        if spec.trainer.compile_ahead and self.backend is None and cache_enabled():
            t0 = time.perf_counter()
            seconds = compile_ahead(spec)
            print(describe_compile_ahead(seconds, time.perf_counter() - t0), flush=True)

    # ------------------------------------------------------------------ construction

    def _generate_ahead(self, devices: Any) -> GenerateAhead | None:
        """``trainer.mode`` one_step_off / async, or a rollout pool (``jaxflow.placement.
        rollout_devices``: the last devices, generating on a `Rollouter`'s thread; in ``sync``
        mode each step's rollout right before its update): the rollouts generated ahead; None
        for a synchronous run on the actor's devices. The pool is a `LocalRolloutPool` of the
        actor's worker, or on Ray a `jaxflow.workers.ray.RayRolloutPool`: a worker group of
        the last hosts, fed from the actor's group (the rollouter's thread makes its calls)."""
        spec = self.spec
        ahead = lookahead(spec.trainer.mode, spec.trainer.max_staleness)
        pool_devices = spec.mapping.rollout_devices
        if not pool_devices:
            return None if ahead is None else GenerateAhead(ahead, self.total_steps, self.loader, batch_from_prompts)
        if self.backend is None:
            devices = tuple(devices)[spec.num_devices - pool_devices : spec.num_devices]
            pool = LocalRolloutPool(self.workers.actor.worker, devices, self.placement.roles["actor"].gen_tp)
            where = f"devices {[d.id for d in devices]}"
        else:
            from jaxflow.workers.ray import RayRolloutPool

            pool = RayRolloutPool.from_spec(spec, self.backend, self.workers.actor, devices=pool_devices)
            where = f"its own worker group {pool.name!r}: the last {pool.num_hosts} host(s), {pool_devices} devices"
        print(f"rollout pool: the actor generates on {where}", flush=True)
        partial = spec.trainer.partial_rollout and bool(ahead)  # without rollouts ahead none is in flight at a sync
        rollouter = Rollouter(pool, partial_segment=spec.trainer.partial_rollout_segment if partial else None)
        return GenerateAhead(ahead or 0, self.total_steps, self.loader, batch_from_prompts, rollouter=rollouter)

    @staticmethod
    def _check_mode(spec: RunSpec) -> None:
        """``trainer.mode`` one_step_off / async, or a rollout pool: refuses, before anything is
        built, what the rollouts generated ahead (`jaxflow.trainer.ahead`) cannot run yet."""
        t = spec.trainer
        if lookahead(t.mode, t.max_staleness) is None and not spec.mapping.rollout_devices:
            return
        name = select_algorithm(spec.algorithm)
        if name not in PPO_FAMILY or spec.algorithm.algorithm.filter_groups.enable:
            what = "a rollout pool" if t.mode == "sync" else t.mode
            raise ConfigError(
                "jaxflow.placement.rollout_devices" if t.mode == "sync" else "trainer.mode",
                f"{what} runs the {', '.join(PPO_FAMILY)} iteration without algorithm.filter_groups "
                f"(this run: {name}): its rollout is one generate call per step",
            )

    def _open_checkpoints(self, t: TrainerSpec, experiment: dict[str, str]) -> CheckpointManager:
        """The run directory's checkpoints, locked for this run; a fresh run in a directory that
        holds checkpoints, or a resume of another experiment's, is a `ConfigError`."""
        try:
            return CheckpointManager(
                self.run_dir,
                max_to_keep=t.max_ckpt_to_keep,
                save_interval_steps=t.save_freq if t.save_freq > 0 else 1 << 30,
                resume_mode=t.resume_mode,
                resume_path=t.resume_from_path,
                experiment=experiment,
                other_experiment_ok=t.resume_other_experiment,
            )
        except ExperimentMismatchError as e:
            key = "trainer.resume_from_path" if t.resume_mode == "resume_path" else "trainer.default_local_dir"
            raise ConfigError(
                key,
                f"{e}. Give this run another {key}, or set jaxflow.trainer.resume_other_experiment=true to resume "
                "it anyway",
            ) from e
        except FileExistsError as e:
            raise ConfigError(
                "trainer.resume_mode",
                f"is 'disable' (a fresh run) but {self.run_dir} already holds "
                f"checkpoints (steps {CheckpointManager(self.run_dir, read_only=True).all_steps()}); "
                "nothing was deleted. Continue them with trainer.resume_mode=auto, or set "
                "trainer.default_local_dir to another directory",
            ) from e

    def _load_prompts(self, prepared: PreparedRun) -> None:
        """The training and validation prompts, checked against the reward function, and the
        start-up lines that say what the run reads: the custom reward function, each split's
        source and how many prompts were cut (loudly when many were)."""
        reward = prepared.spec.reward
        if reward.custom_reward_path:
            print(
                f"reward: custom function {reward.custom_reward_name}() from {reward.custom_reward_path} "
                "(custom_reward_function)",
                flush=True,
            )
        train, val = prepared.sources
        self.train_data, self.val_data = prepared.train_data, prepared.val_data
        if not reward.custom_reward_path:  # the built-in scorers compare one string or number
            for dataset in (self.train_data, self.val_data):
                dataset.check_ground_truths(
                    (str, int, float),
                    "the built-in reward functions compare the answer "
                    "with one string or number; fix the data or use a custom reward function "
                    "(custom_reward_function.path)",
                )
        print(
            f"data: train = {describe_source(train, self.train_data)}; "
            f"validation = {describe_source(val, self.val_data)}",
            flush=True,
        )
        for split, dataset in (("training", self.train_data), ("validation", self.val_data)):
            warning = cut_prompts_warning(split, dataset)
            if warning:
                log.warning("%s", warning)

    @staticmethod
    def _build_scorer(r: RewardSpec) -> RewardScorer:
        try:
            return RewardScorer(**dataclasses.asdict(r))
        except (RewardFunctionError, ImportError, AttributeError, TypeError) as e:  # the user's file, not jaxflow
            raise ConfigError("custom_reward_function", str(e)) from e

    def _build_workers(self, actor_params: Any = None):
        spec, p = self.spec, self.placement

        def model(role: str) -> Any:
            """Local: the model on its mesh. Ray: a recipe ``(mesh, rules) -> model`` that each
            worker process runs on its own mesh."""
            if self.backend is not None:
                return functools.partial(load_model, spec.models[role])
            phase = "train" if Role(role).trains else "infer"
            return load_model(spec.models[role], p.mesh(role, phase), p.rules(role, phase))

        actor = model("actor") if actor_params is None else actor_params
        ref = self._reference(actor, model, given=actor_params is not None) if "ref" in spec.roles else None
        build = build_local_workers if self.backend is None else self.backend.build_workers
        return build(
            p,
            actor=actor,
            ref=ref,
            critic=model("critic") if "critic" in spec.roles else None,
            reward_model=model("reward") if "reward" in spec.roles else None,
            cost_model=model("cost") if "cost" in spec.roles else None,
            rule_reward=RuleRewardWorker(self.tokenizer, self.scorer, overlong=spec.overlong),
            settings=spec.role_settings,
        )

    def _reference(self, actor: Any, model: Callable[[str], Any], given: bool) -> Any:
        """The reference's weights, those the actor starts from: the actor's own (arrays, or
        recipe) in the actor's dtype; in another dtype (bfloat16 beside float32 masters on an
        accelerator) read in that dtype from the actor's checkpoint (``model("ref")``: each
        process its own shards, no float32 copy), or, for a preset or weights ``given`` to the
        trainer (a warm start's), the actor's cast (`as_role`)."""
        ref, mine = self.spec.models["ref"], self.spec.models["actor"]
        if ref.config is None or mine.config is None or ref.config.param_dtype == mine.config.param_dtype:
            return actor
        if not ref.is_preset and not given:
            return model("ref")
        if callable(actor):
            return functools.partial(as_role_recipe, actor, ref)
        return as_role(actor, ref)

    def close(self) -> None:
        """Stops the rollouter's thread (a rollout pool's), the worker processes of the Ray
        backend and the Ray instance it started, and the compile log."""
        if self.ahead is not None:
            self.ahead.close()
        self.compiles.__exit__()
        if self.backend is not None:
            self.backend.close()

    # ------------------------------------------------------------------ state

    def _checkpoint_items(self) -> dict[str, ItemIO]:
        """Each train state as a checkpoint item that its worker group writes and reads (on the
        Ray backend every process its own shards): the controller never holds a train state."""
        groups = {"actor": self.workers.actor}
        if self.workers.critic is not None:
            groups["critic"] = self.workers.critic
        return {
            name: ItemIO(
                write=group.save_train_state,
                read=group.restore_train_state,
                abstract=group.abstract_train_state()[0],
                not_damage=(WorkerGroupError,),
            )
            for name, group in groups.items()
        }

    def save(self, step: int, history: list[dict[str, float]]) -> None:
        """Checkpoint ``step``; refuses (``NonFiniteError``) train states holding NaN or Inf, so a
        non-finite state never replaces, or prunes, a good checkpoint."""
        states = self._checkpoint_items()
        groups = {"actor": self.workers.actor, "critic": self.workers.critic}
        bad = [name for name in states if not groups[name].params_finite()[0]]
        if bad:
            raise NonFiniteError(
                f"step {step}: the {' and '.join(bad)} parameters hold NaN or Inf; not saving them "
                f"(latest good checkpoint: step {self.ckpt.latest_step()})"
            )
        host = HostState(
            # with rollouts generated ahead: the position before the first one pending (generated again on resume)
            data_loader=self.loader.state_dict() if self.ahead is None else self.ahead.loader_state(),
            metrics_tail=history[-5:],
            extra={
                "step": step,
                "policy_version": self.policy_version,  # the actor's updates so far: what a resumed rollout records
                "algo_state": self.algo_state.state_dict(),
                "guard": self.guard.state_dict(),
            },
        )
        self.ckpt.save(step, states, host, force=True)
        if self.spec.trainer.save_hf:
            self.export_actor(self.ckpt.step_dir(step) / HF_DIR)

    def export_actor(self, out_dir: str | os.PathLike) -> str:
        """The actor as an HF directory with the tokenizer (with LoRA: its adapters as a PEFT
        adapter directory, pointing at the base), written by the actor's workers from their
        sharded params (on the Ray backend this process never holds them)."""
        if self.spec.actor.lora is None:
            return str(write_hf_with(self.workers.actor.export_hf, self.tokenizer, out_dir))
        write = functools.partial(self.workers.actor.export_adapter, base_model=base_pointer(self.spec))
        return str(write_hf_with(write, self.tokenizer, out_dir))

    def resume(self) -> int:
        """Restore the latest checkpoint per ``trainer.resume_mode``; the step to start from."""
        restored = self.ckpt.resume(self._checkpoint_items())  # the groups read their states in place
        if restored is None:
            return 0
        self.loader.load_state_dict(restored.host.data_loader)
        self.algo_state.load_state_dict(restored.host.extra["algo_state"])
        self.guard.load_state_dict(restored.host.extra.get("guard", {}))
        self.completed_steps = restored.step
        print(f"resumed from {restored.path} at step {restored.step}", flush=True)
        return restored.step

    # ------------------------------------------------------------------ steps

    @property
    def policy_version(self) -> int:
        """The actor's updates so far: one per completed step after ``trainer.critic_warmup``."""
        return max(0, self.completed_steps - self.spec.critic_warmup)

    def train_step(self, step: int) -> dict[str, float]:
        """One iteration of the algorithm on the next prompt batch; verl-named metrics."""
        start = time.perf_counter()
        workers, ahead_metrics = self.workers, {}
        if self.ahead is None:
            prompts = batch_from_prompts(next(self.loader))
        else:  # this step's rollout, generated ahead (now or at an earlier step)
            prompts, workers, ahead_metrics = self.ahead.step(step, self.workers, self.policy_version)
        more = {}
        if self.spec.algorithm.algorithm.filter_groups.enable:  # DAPO's dynamic sampling reads on
            more["next_prompts"] = lambda: batch_from_prompts(next(self.loader))
        update_actor = step > self.spec.critic_warmup
        raw = self.algorithm(
            workers, prompts, self.spec.algorithm, self.algo_state, step=step, update_actor=update_actor, **more
        )
        self.completed_steps = step
        metrics = {k: _mean(v) for k, v in scalar_metrics(raw).items()} if raw else {}
        metrics.update({k: _mean(v) for k, v in raw.items() if k not in metrics and np.size(v)})
        metrics.update(ahead_metrics)
        elapsed = time.perf_counter() - start
        metrics["timing_s/step"] = elapsed
        if self.ahead is not None:  # the trainer's and the rollouter's idle fractions
            metrics.update(self.ahead.idle_ratios(start, start + elapsed))
        n = self.spec.n
        prompt_tokens = float(np.asarray(prompts["prompt_mask"]).sum()) * n
        response_tokens = metrics.get("response_length/mean", 0.0) * len(prompts) * n
        metrics["perf/total_num_tokens"] = prompt_tokens + response_tokens
        # verl's perf/throughput: tokens per second per device.
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / elapsed / self.spec.num_devices
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.loader.epoch)
        if self._first_step_at is None:  # this process's first step: build, warm start and compiles included
            self._first_step_at = time.perf_counter()
            metrics["perf/time_to_first_step_s"] = self._first_step_at - self._started
        return metrics

    def validate(self) -> dict[str, float]:
        """Greedy (``rollout.val_kwargs``) rollouts on the validation prompts: ``val/...``."""
        t = self.spec.trainer
        size = self.spec.data.val_batch_size or len(self.val_data)
        scores, lengths, by_source, calls = [], [], {}, []
        progress = ProgressBar(len(self.val_data), desc="validate", unit="prompt", leave=False)
        for start in range(0, len(self.val_data), size):
            idx = np.arange(start, min(start + size, len(self.val_data)))
            prompts = batch_from_prompts(self.val_data.batch(idx))
            out = self.workers.actor.generate(prompts, sampling="val")
            out |= self.workers.reward(out)
            if self.spec.rollout.multi_turn is not None:  # share of conversations that called a tool
                calls.append((self.workers.actor.rollout_metrics()[0]["agent/tool_call_rate"], len(out)))
            mask = np.asarray(jax.device_get(out["response_mask"]))
            seq = (np.asarray(jax.device_get(out["token_level_scores"])) * (mask > 0)).sum(-1)
            scores.append(seq)
            lengths.append((mask > 0).sum(-1))
            for src, s in zip(out["data_source"], seq):
                by_source.setdefault(src, []).append(s)
            shown = sum(len(x) for x in scores) - len(seq)
            for i in range(max(0, min(len(seq), t.log_val_generations - shown))):
                progress.write(
                    f"[val] {out['raw_prompt'][i]!r} -> {out['response_text'][i]!r} "
                    f"(truth {out['ground_truth'][i]!r}, score {seq[i]:g})",
                    file=sys.stdout,
                )
            progress.update_to(start + len(seq))
        progress.close()
        metrics = {
            "val/score/mean": float(np.concatenate(scores).mean()),
            "val/response_length/mean": float(np.concatenate(lengths).mean()),
        }
        for src, s in by_source.items():
            metrics[f"val/test_score/{src}"] = float(np.mean(s))
        if calls:
            rates, sizes = np.array(calls).T
            metrics["val/agent/tool_call_rate"] = float(rates @ sizes / sizes.sum())
        return metrics

    # ------------------------------------------------------------------ the loop

    def fit(self) -> list[dict[str, float]]:
        """Train (resuming per ``trainer.resume_mode``), validate, save, plot, export the actor
        (``<run_dir>/hf_actor``) and print a summary. With the Ray
        backend and ``jaxflow.ray.max_restarts > 0``, a failed worker group (a process died, a
        call passed its deadline; the rollout pool's group too, whose calls the rollouter
        makes) stops every group, starts fresh processes and resumes from the last complete
        checkpoint (from the start if there is none yet)."""
        history: list[dict[str, float]] = []
        restarts = 0
        try:
            while True:
                try:
                    self._fit_attempt(history)
                    break
                except (WorkerGroupError, RolloutError) as e:
                    failure = worker_failure(e)
                    if failure is None:
                        raise
                    if restarts >= self.spec.trainer.max_restarts:
                        if failure is e:
                            raise
                        raise failure from e  # the pool group's own error, not the rollouter's wrapper
                    restarts += 1
                    self._restart(failure, restarts)
            hf_dir = self.export_actor(os.path.join(self.run_dir, HF_DIR))  # while the workers live
        finally:
            self.ckpt.close()
            self.close()
        t = self.spec.trainer
        outputs = {
            "metrics": None,
            "plot": None,
            "tensorboard": None,
            "checkpoints": str(self.run_dir) if t.save_freq > 0 else None,
            "HF export": hf_dir,
        }
        if "jsonl" in t.logger:
            outputs["metrics"] = os.path.join(self.run_dir, JSONL_NAME)
            outputs["plot"] = str(plot_run(self.run_dir))
        if "tensorboard" in t.logger:
            outputs["tensorboard"] = os.path.join(self.run_dir, TENSORBOARD_DIR)
        logged = read_jsonl(outputs["metrics"]) if outputs["metrics"] else history  # earlier steps of a resumed run
        predicted = (
            None
            if self.auto is None
            else (f"auto-mapper, {self.auto.profile.name} profile", self.auto.predicted_step_s)
        )
        print(
            run_summary(logged, wall_s=time.perf_counter() - self._started, outputs=outputs, predicted=predicted),
            flush=True,
        )
        first = (
            ""
            if self._first_step_at is None
            else f"first step done {self._first_step_at - self._started:.1f} s after start; "
        )
        print(f"  {first}{self.compiles.summary()}", flush=True)
        return history

    def _restart(self, error: Exception, restarts: int) -> None:
        step = self.ckpt.latest_step()
        where = "the start (no complete checkpoint yet)" if step is None else f"checkpoint step {step}"
        log.warning(
            "worker failure: %s; restart %d/%d: fresh worker processes, resuming from %s",
            error,
            restarts,
            self.spec.trainer.max_restarts,
            where,
        )
        if self.backend is not None:
            self.backend.shutdown()  # the groups; the cluster stays
        self.workers = self._build_workers(self._restart_actor_params)
        self.ckpt.resume_mode = "auto"
        if self.ahead is not None:  # the loader rewinds to before them: they are generated again
            self.ahead.discard_pending()
            if self.backend is not None and self.ahead.rollouter is not None:
                # the pool's fresh group, fed from the actor's new one; the next step syncs it
                self.ahead.rollouter.pool.rejoin(self.workers.actor)
        if step is None:
            loader, algo, guard = self._initial_host_state
            self.loader.load_state_dict(loader)
            self.algo_state.load_state_dict(algo)
            self.guard.load_state_dict(guard)
            self.completed_steps = 0  # the policy version the first rollout records

    def _fit_attempt(self, history: list[dict[str, float]]) -> None:
        t = self.spec.trainer
        start_step = self.resume()
        history[:] = [h for h in history if h["step"] <= start_step]
        logger = MetricsLogger(
            self.run_dir,
            backends=tuple(t.logger),
            project=t.project_name,
            experiment=t.experiment_name,
            config=self.run_config.to_dict(),
            console_keys=CONSOLE_KEYS,
            resume_step=start_step if start_step else None,
            total_steps=self.total_steps,
        )
        if self.backend is None:
            where = f"{jax.devices()[0].platform} devices; run dir {self.run_dir}\n{self.placement.describe()}"
        else:
            where = f"devices; run dir {self.run_dir}\n{describe_hosts(self.placement, self.backend.config)}"
        print(
            f"jaxflow: {self.algorithm_name} ({self.spec.algorithm.algorithm.adv_estimator}) for {self.total_steps} "
            f"steps on {self.spec.num_devices} {where}\n{describe_dtypes(self.spec)}",
            flush=True,
        )
        try:
            if start_step == 0 and t.val_before_train and t.test_freq > 0:
                val = self.validate()
                logger.log(val, 0)
                history.append({"step": 0, **val})
            for step in range(start_step + 1, self.total_steps + 1):
                interrupt.check()
                metrics = self.train_step(step)
                last = step == self.total_steps
                if t.test_freq > 0 and (step % t.test_freq == 0 or last):
                    metrics.update(self.validate())
                try:
                    healthy = self.guard.check(metrics, step)
                except NonFiniteError:
                    logger.log(metrics, step)
                    raise
                logger.log(metrics, step)
                history.append({"step": step, **metrics})
                if t.save_freq > 0 and (step % t.save_freq == 0 or last):
                    if healthy:
                        self.save(step, history)
                        interrupt.check()
                    else:  # nothing saved, so nothing pruned: the last good checkpoint stays the latest
                        print(
                            f"step {step}: not saving a checkpoint after a refused update (latest good "
                            f"checkpoint: step {self.ckpt.latest_step()})",
                            flush=True,
                        )
        finally:
            logger.close()
