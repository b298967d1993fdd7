"""The RL loop: a single controller that runs an algorithm program (`jaxflow.algos.programs`)
over worker groups built from the experiment config, with validation, checkpoints, metrics
and the non-finite guard.

::

    trainer = RLTrainer(cfg)          # tokenizer, data, placement, workers, checkpoints, loggers
    history = trainer.fit()           # resume (trainer.resume_mode), train, validate, save, plot

Determinism: the rollout seed of step ``s`` is ``fold_in(trainer.seed, s)`` and the data order
a function of ``data.seed`` and the epoch, both restored from checkpoints, so a run resumed
from step ``k`` continues exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import jax
import numpy as np
from ml_collections import ConfigDict

from jaxflow.algos import batch_from_prompts
from jaxflow.algos.programs import AlgoState, get_algorithm, select_algorithm
from jaxflow.configs import ConfigError, build_placement, checkpoint_dir, critic_enabled, uses_reference
from jaxflow.configs.resolve import ray_config, ray_devices
from jaxflow.data.dataset import PromptDataLoader
from jaxflow.rewards import RewardScorer
from jaxflow.trainer.builders import (
    abstract_like,
    actor_config,
    build_dataset,
    build_tokenizer,
    critic_config,
    dataset_files,
    load_model,
    load_model_on,
    optimizer_steps,
    rollout_config,
)
from jaxflow.trainer.checkpoint import CheckpointManager, HostState
from jaxflow.trainer.guard import NonFiniteError, NonFiniteGuard
from jaxflow.trainer.metrics import MetricsLogger, scalar_metrics
from jaxflow.trainer.plot import plot_run
from jaxflow.workers import RuleRewardWorker, build_local_workers
from jaxflow.workers.ray_backend import WorkerGroupError, describe_hosts

log = logging.getLogger(__name__)

CONSOLE_KEYS = {
    "critic/score/mean": "score",
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


def _keep(*limits: int | None) -> int | None:
    """Actor and critic share each checkpoint: keep what the stricter limit asks."""
    given = [k for k in limits if k is not None]
    return min(given) if given else None


def _mean(value: Any) -> float:
    return float(np.mean(np.asarray(value, np.float64)))


class RLTrainer:
    """Everything one RL run needs, built from a validated experiment config."""

    def __init__(self, cfg: ConfigDict):
        self.cfg = cfg
        t = cfg.trainer
        self.run_dir = checkpoint_dir(cfg)
        os.makedirs(self.run_dir, exist_ok=True)
        self.tokenizer = build_tokenizer(cfg)
        train_files, val_files = dataset_files(cfg, self.run_dir)
        self.train_data = build_dataset(cfg, train_files, self.tokenizer)
        self.val_data = build_dataset(cfg, val_files, self.tokenizer)
        self.loader = PromptDataLoader(self.train_data, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                       seed=cfg.data.seed, drop_last=True)
        self.total_steps = t.total_training_steps or t.total_epochs * self.loader.steps_per_epoch

        self.backend = None
        if cfg.jaxflow.backend == "ray":  # Ray is imported only on this path
            from jaxflow.workers.ray_backend import RayBackend

            self.backend = RayBackend(ray_config(cfg))
            self.placement = build_placement(cfg, ray_devices(cfg))
        else:
            self.placement = build_placement(cfg)
        try:
            self.workers = self._build_workers()
        except BaseException:
            self.close()
            raise
        self.algorithm_name = select_algorithm(cfg)
        self.algorithm = get_algorithm(self.algorithm_name)
        self.algo_state = AlgoState.from_config(cfg)
        self.guard = NonFiniteGuard(cfg.jaxflow.trainer.max_nonfinite_steps)
        self._initial_host_state = (self.loader.state_dict(), self.algo_state.state_dict(), self.guard.state_dict())
        self.ckpt = CheckpointManager(
            self.run_dir, max_to_keep=_keep(t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep),
            save_interval_steps=t.save_freq if t.save_freq > 0 else 1 << 30,
            resume_mode=t.resume_mode, resume_path=t.resume_from_path,
            overwrite=t.resume_mode == "disable")

    # ------------------------------------------------------------------ construction

    def _build_workers(self):
        cfg, tok, p = self.cfg, self.tokenizer, self.placement
        opt_steps = optimizer_steps(cfg, cfg.trainer.total_training_steps or 1)

        def model(role: str, head: str) -> Any:
            """Local: the model on its mesh. Ray: a recipe each worker process runs on its mesh."""
            if self.backend is not None:
                return functools.partial(load_model_on, cfg, role, head, tok)
            phase = "train" if role in ("actor", "critic") else "infer"
            return load_model(cfg, role, head, tok, mesh=p.mesh(role, phase), rules=p.rules(role, phase))

        actor = model("actor", "lm")
        critic = model("critic", "value") if critic_enabled(cfg) else None
        reward_model = model("reward", "reward") if cfg.reward_model.enable else None
        cost_model = None
        if cfg.jaxflow.safe_rlhf.enable and cfg.jaxflow.safe_rlhf.cost_model_path:
            cost_model = model("cost", "reward")
        fn = cfg.custom_reward_function
        try:
            scorer = RewardScorer(custom_reward_path=fn.path, custom_reward_name=fn.name,
                                  timeout_s=cfg.jaxflow.reward.timeout_s)
        except (ImportError, AttributeError, TypeError) as e:  # the user's file, not jaxflow
            raise ConfigError("custom_reward_function", str(e)) from e
        build = build_local_workers if self.backend is None else self.backend.build_workers
        return build(
            p, actor=actor, ref=actor if uses_reference(cfg) else None, critic=critic,
            reward_model=reward_model, cost_model=cost_model, rule_reward=RuleRewardWorker(tok, scorer),
            actor_config=actor_config(cfg, opt_steps),
            critic_config=critic_config(cfg, opt_steps) if critic is not None else None,
            rollout=rollout_config(cfg, tok))

    def close(self) -> None:
        """Stops the worker processes of the Ray backend (nothing to do locally)."""
        if self.backend is not None:
            self.backend.shutdown()

    # ------------------------------------------------------------------ state

    def _train_states(self) -> dict[str, Any]:
        states = {"actor": self.workers.actor.get_train_state()[0]}
        if self.workers.critic is not None:
            states["critic"] = self.workers.critic.get_train_state()[0]
        return states

    def save(self, step: int, history: list[dict[str, float]]) -> None:
        host = HostState(data_loader=self.loader.state_dict(), metrics_tail=history[-5:],
                         extra={"step": step, "algo_state": self.algo_state.state_dict(),
                                "guard": self.guard.state_dict()})
        self.ckpt.save(step, self._train_states(), host, force=True)

    def resume(self) -> int:
        """Restore the latest checkpoint per ``trainer.resume_mode``; the step to start from."""
        targets = {name: abstract_like(state) for name, state in self._train_states().items()}
        restored = self.ckpt.resume(targets)
        if restored is None:
            return 0
        for name, state in restored.arrays.items():
            getattr(self.workers, name).set_train_state(state)
        self.loader.load_state_dict(restored.host.data_loader)
        self.algo_state.load_state_dict(restored.host.extra["algo_state"])
        self.guard.load_state_dict(restored.host.extra.get("guard", {}))
        print(f"resumed from {restored.path} at step {restored.step}", flush=True)
        return restored.step

    # ------------------------------------------------------------------ steps

    def train_step(self, step: int) -> dict[str, float]:
        """One iteration of the algorithm on the next prompt batch; verl-named metrics."""
        start = time.perf_counter()
        prompts = batch_from_prompts(next(self.loader))
        prompts.meta["step"] = step
        prompts.meta["update_actor"] = step > self.cfg.trainer.critic_warmup
        raw = self.algorithm(self.workers, prompts, self.cfg, self.algo_state)
        metrics = {k: _mean(v) for k, v in scalar_metrics(raw).items()} if raw else {}
        metrics.update({k: _mean(v) for k, v in raw.items() if k not in metrics and np.size(v)})
        elapsed = time.perf_counter() - start
        metrics["timing_s/step"] = elapsed
        n = self.cfg.actor_rollout_ref.rollout.n
        prompt_tokens = float(np.asarray(prompts["prompt_mask"]).sum()) * n
        response_tokens = metrics.get("response_length/mean", 0.0) * len(prompts) * n
        metrics["perf/total_num_tokens"] = prompt_tokens + response_tokens
        # verl's perf/throughput: tokens per second per device.
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / elapsed / self.cfg.jaxflow.num_devices
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.loader.epoch)
        return metrics

    def validate(self) -> dict[str, float]:
        """Greedy (``rollout.val_kwargs``) rollouts on the validation prompts: ``val/...``."""
        cfg = self.cfg
        size = cfg.data.val_batch_size or len(self.val_data)
        scores, lengths, by_source = [], [], {}
        params = rollout_config(cfg, self.tokenizer, validation=True)
        for start in range(0, len(self.val_data), size):
            idx = np.arange(start, min(start + size, len(self.val_data)))
            prompts = batch_from_prompts(self.val_data.batch(idx))
            prompts.meta["rollout"] = params
            out = self.workers.actor.generate(prompts)
            out |= self.workers.reward(out)
            mask = np.asarray(jax.device_get(out["response_mask"]))
            seq = (np.asarray(jax.device_get(out["token_level_scores"])) * (mask > 0)).sum(-1)
            scores.append(seq)
            lengths.append((mask > 0).sum(-1))
            for src, s in zip(out["data_source"], seq):
                by_source.setdefault(src, []).append(s)
            shown = sum(len(x) for x in scores) - len(seq)
            for i in range(max(0, min(len(seq), cfg.trainer.log_val_generations - shown))):
                print(f"[val] {out['raw_prompt'][i]!r} -> {out['response_text'][i]!r} "
                      f"(truth {out['ground_truth'][i]!r}, score {seq[i]:g})", flush=True)
        metrics = {"val/score/mean": float(np.concatenate(scores).mean()),
                   "val/response_length/mean": float(np.concatenate(lengths).mean())}
        for src, s in by_source.items():
            metrics[f"val/test_score/{src}"] = float(np.mean(s))
        return metrics

    # ------------------------------------------------------------------ the loop

    def fit(self) -> list[dict[str, float]]:
        """Train (resuming per ``trainer.resume_mode``), validate, save, plot. With the Ray
        backend and ``jaxflow.ray.max_restarts > 0``, a failed worker group (a process died, a
        call passed its deadline) stops every group, starts fresh processes and resumes from
        the last complete checkpoint (from the start if there is none yet)."""
        history: list[dict[str, float]] = []
        restarts = 0
        try:
            while True:
                try:
                    self._fit_attempt(history)
                    break
                except WorkerGroupError as e:
                    if restarts >= self.cfg.jaxflow.ray.max_restarts:
                        raise
                    restarts += 1
                    self._restart(e, restarts)
        finally:
            self.ckpt.close()
            self.close()
        if "jsonl" in self.cfg.trainer.logger:
            path = plot_run(self.run_dir)
            print(f"plot: {path}", flush=True)
        return history

    def _restart(self, error: Exception, restarts: int) -> None:
        step = self.ckpt.latest_step()
        where = "the start (no complete checkpoint yet)" if step is None else f"checkpoint step {step}"
        print(f"worker failure: {error}\nrestart {restarts}/{self.cfg.jaxflow.ray.max_restarts}: fresh worker "
              f"processes, resuming from {where}", flush=True)
        self.close()
        self.workers = self._build_workers()
        self.ckpt.resume_mode = "auto"
        if step is None:
            loader, algo, guard = self._initial_host_state
            self.loader.load_state_dict(loader)
            self.algo_state.load_state_dict(algo)
            self.guard.load_state_dict(guard)

    def _fit_attempt(self, history: list[dict[str, float]]) -> None:
        cfg, t = self.cfg, self.cfg.trainer
        start_step = self.resume()
        history[:] = [h for h in history if h["step"] <= start_step]
        logger = MetricsLogger(self.run_dir, backends=tuple(t.logger), project=t.project_name,
                               experiment=t.experiment_name, config=cfg.to_dict(), console_keys=CONSOLE_KEYS,
                               resume_step=start_step if start_step else None, total_steps=self.total_steps)
        if self.backend is None:
            where = f"{jax.devices()[0].platform} devices; run dir {self.run_dir}\n{self.placement.describe()}"
        else:
            where = f"devices; run dir {self.run_dir}\n{describe_hosts(self.placement, self.backend.config)}"
        print(f"jaxflow: {self.algorithm_name} ({cfg.algorithm.adv_estimator}) for {self.total_steps} steps on "
              f"{cfg.jaxflow.num_devices} {where}", flush=True)
        try:
            if start_step == 0 and t.val_before_train and t.test_freq > 0:
                val = self.validate()
                logger.log(val, 0)
                history.append({"step": 0, **val})
            for step in range(start_step + 1, self.total_steps + 1):
                metrics = self.train_step(step)
                last = step == self.total_steps
                if t.test_freq > 0 and (step % t.test_freq == 0 or last):
                    metrics.update(self.validate())
                try:
                    self.guard.check(metrics, step)
                except NonFiniteError:
                    logger.log(metrics, step)
                    raise
                logger.log(metrics, step)
                history.append({"step": step, **metrics})
                if t.save_freq > 0 and (step % t.save_freq == 0 or last):
                    self.save(step, history)
        finally:
            logger.close()
