"""The actor: rollouts (generation layout, through the 3D-HybridEngine), log-probs and the PPO
policy update (training layout).

Losses (one optimizer step per mini-batch, gradients accumulated over micro-batches)::

    L = pg_loss(old_log_probs, log_probs, advantages; loss_mode, clip ratios, loss_agg_mode)
        - entropy_coeff * agg(H(pi(. | s_t)))
        + kl_loss_coef * agg(kl(log_probs, ref_log_prob; kl_loss_type))    if use_kl_loss

``log_probs = log_softmax(logits / T)[response]`` on ``[prompt | response]`` (T: the training
rollouts' temperature, `RolloutConfig.temperature`, unless a call passes ``temperature``;
never read from the batch, whose ``meta`` is provenance only), ``agg`` is
`jaxflow.algos.agg_loss` with the mini-batch's normalisers. Metrics (verl's names):
``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``,
``actor/entropy``, ``actor/kl_loss`` and ``actor/kl_coef`` (with the KL loss),
``actor/grad_norm`` (before clipping), ``actor/lr``, ``actor/update_skipped`` (1 for a step
refused as non-finite: parameters and optimizer state unchanged), and a loss's own metrics
under their names (``bypass_mode``'s ``rollout_corr/*``; micro-batches weighted by their
share of the mini-batch's tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from jaxflow.algos import agg_loss, compute_policy_loss, kl_penalty, masked_sum
from jaxflow.data.batch import Batch
from jaxflow.mesh import MeshSpec, Role, Rules
from jaxflow.models.lora import LoRAConfig, merge_adapters
from jaxflow.reshard import HybridEngine
from jaxflow.sampling import (
    EngineOptions,
    PartialRollout,
    SamplingParams,
    generate_from_state,
    run_partial,
    start_partial,
    swap_weights,
)
from jaxflow.workers.base import ModelLike, num_micro_batches
from jaxflow.workers.forward import PROMPT_KEYS, ForwardConfig, log_probs_and_entropy, trained_tokens
from jaxflow.workers.group import DP_COMPUTE_REPEAT, DP_TRAIN
from jaxflow.workers.multi_turn import multi_turn_rollout
from jaxflow.workers.optim import OptimConfig
from jaxflow.workers.packing import balance_metrics
from jaxflow.workers.protocols import DP_COMPUTE, ONE_TO_ALL, register
from jaxflow.workers.reference import ReferenceWorker, log_probs_fn, log_probs_program
from jaxflow.workers.rollout_probe import METRIC as PROBE_METRIC
from jaxflow.workers.rollout_probe import RolloutProbe
from jaxflow.workers.trainable import TrainableWorker, UpdateLoopConfig, train_columns


def generation_dtype(cfg: Any) -> Any:
    """The dtype of the actor's generation copy: the model's compute dtype where it is
    narrower than its (master) weights' (bf16 generation from float32 masters on
    accelerators), else None (generation reads the weights as they are)."""
    compute, stored = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    return compute if jnp.issubdtype(compute, jnp.floating) and compute.itemsize < stored.itemsize else None


def cast_program(dtype: Any, shardings: Any):
    """A jitted copy of the weights in ``dtype`` with their shardings (each device casts its
    own shard). Named, so that a copy compiled ahead (`lowering.reshard_program`) is handed to it."""

    def cast_weights(params):
        return jax.tree.map(lambda x: x.astype(dtype), params)

    return jax.jit(cast_weights, out_shardings=shardings)


def merge_program(lora: LoRAConfig, dtype: Any, shardings: Any):
    """A jitted ``(base, adapters) -> merged``: the base weights with the LoRA update merged in,
    ``W + s A B``, in ``dtype`` (None: the base's), laid out by ``shardings`` (the base's: each
    device merges its own shard, `jaxflow.models.lora.merge_adapters`)."""
    return jax.jit(lambda base, adapters: merge_adapters(base, adapters, lora, dtype), out_shardings=shardings)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How the actor samples (verl's ``rollout``): the training rollouts' `SamplingParams`
    (``n`` responses per prompt, ``seed`` seeding the whole run: each call folds in its step)
    and the validation rollouts' (``rollout.val_kwargs``) side by side; ``max_num_seqs`` > 0
    decodes at most that many sequences per generation replica at once (the engine's decode
    slots: a finished sequence's slot is refilled); 0: the engine's default.
    ``max_total_tokens`` > 0: the KV-cache budget per generation replica in tokens (the page
    pool; sequences wait for pages when it runs short); 0: the engine's default.
    ``tokenizer`` (anything with ``decode(ids)``) gives the tokens' text for the stop strings
    of the sampling parameters (``SamplingParams.stop``). ``lora_merge``: with LoRA, the
    rollout reads the weights with the adapters merged in (a copy, `merge_program`) instead of
    running the adapter path. ``probe_tolerance`` > 0: after each weight sync the rollout's
    and the trainer's weights score a fixed probe and the run stops when they differ by more
    (`jaxflow.workers.rollout_probe`); 0: no probe. ``multi_turn``: each sample is a
    conversation with tools (a `jaxflow.agents.MultiTurn`, `jaxflow.workers.multi_turn`; needs
    ``tokenizer``); None: one response per sample."""

    train: SamplingParams = SamplingParams(max_new_tokens=32)
    val: SamplingParams = SamplingParams(max_new_tokens=32, greedy=True)
    max_num_seqs: int = 0
    max_total_tokens: int = 0
    tokenizer: Any = dataclasses.field(default=None, compare=False)
    lora_merge: bool = True
    probe_tolerance: float = 0.0
    multi_turn: Any = None

    @property
    def temperature(self) -> float:
        """T of the training rollouts, which their log-probs and the update use: the sampling
        temperature (1 for greedy rollouts, whose log-probs are the model's own)."""
        return 1.0 if self.train.greedy else float(self.train.temperature)

    def resolve(self, sampling: SamplingParams | str) -> SamplingParams:
        """``"train"``, ``"val"``, ``"greedy"`` (the training parameters, argmax, one response
        per prompt: verl's ``do_sample=False`` request) or explicit parameters."""
        if isinstance(sampling, SamplingParams):
            return sampling
        if sampling == "train":
            return self.train
        if sampling == "val":
            return self.val
        if sampling == "greedy":
            return dataclasses.replace(self.train, greedy=True, n=1)
        raise ValueError(f"sampling must be SamplingParams or one of 'train', 'val', 'greedy', got {sampling!r}")


@dataclasses.dataclass(frozen=True)
class RolloutRequest:
    """One rollout call's inputs to the engine (`rollout_request`): the prompts (with their
    ``uid``), the resolved sampling parameters, the call's key and the engine's keywords
    (`EngineOptions`, per-prompt ``max_new_tokens``, ``prompt_index``)."""

    prompts: Batch
    params: SamplingParams
    rng: jax.Array
    engine: dict[str, Any]

    def rows(self, columns: dict[str, Any]) -> Batch:
        """The rollout's rows: the prompts repeated ``n`` times (interleaved) with the sampled
        ``columns`` and the provenance ``meta["temperature"]``."""
        p = self.params
        return self.prompts.repeat(p.n, interleave=True).update(
            tensors=columns, meta={"temperature": 1.0 if p.greedy else float(p.temperature)}
        )


def rollout_request(
    rollout: RolloutConfig, prompts: Batch, sampling: SamplingParams | str, index: int, prompt_offset: int = 0
) -> RolloutRequest:
    """The sampling contract of `ActorWorker.generate`, whoever holds the weights (the actor,
    or a rollout pool on other devices, `jaxflow.trainer.rollouter`): the key is
    ``fold_in(key(seed), index)`` and prompt ``i`` is prompt ``prompt_offset + i`` of the
    call, so sample ``j``'s token ``t`` draws from ``fold_in(fold_in(key, (prompt_offset + i)
    * n + j), t)``; a ``uid`` column ``"<index>:<prompt>"`` is added when missing."""
    limits = np.asarray(jax.device_get(prompts["max_new_tokens"])) if "max_new_tokens" in prompts else None
    params = rollout.resolve(sampling)
    rng = jax.random.fold_in(jax.random.key(params.seed), index)
    prompt_index = prompt_offset + np.arange(len(prompts), dtype=np.int32)
    if "uid" not in prompts:  # deterministic, so resumed runs group samples exactly alike
        prompts = prompts.update(non_tensors={"uid": [f"{index}:{i}" for i in prompt_index]})
    options = EngineOptions(slots=rollout.max_num_seqs or None, kv_tokens=rollout.max_total_tokens or None)
    engine = dict(options=options, max_new_tokens=limits, prompt_index=prompt_index)
    return RolloutRequest(prompts, params, rng, engine)


def sample_columns(
    rollout: RolloutConfig, request: RolloutRequest, graphdef, gen_params, *, mesh: Mesh, rules: Rules
) -> tuple[dict[str, Any], dict[str, float]]:
    """The rollout's columns sampled from ``gen_params`` laid out on ``mesh`` by ``rules``:
    the engine's responses, or (``rollout.multi_turn``) the conversations' (each prompt's
    non-tensor columns start its environments), ready (the engine's time ends here); and the
    conversations' ``agent/*`` metrics (empty for single responses)."""
    prompts, params = request.prompts, request.params
    engine = dict(request.engine, mesh=mesh, rules=rules, rng=request.rng)
    ids = np.asarray(jax.device_get(prompts["prompt_ids"]))
    mask = np.asarray(jax.device_get(prompts["prompt_mask"]))
    if rollout.multi_turn is not None:
        if engine.pop("max_new_tokens") is not None:
            raise ValueError(
                "a multi-turn rollout takes no per-prompt max_new_tokens (its turns share the response length)"
            )
        samples = [{k: v[i] for k, v in prompts.non_tensors.items()} for i in range(len(prompts))]
        return multi_turn_rollout(
            rollout.multi_turn, rollout.tokenizer, graphdef, gen_params, ids, mask, params, **engine, samples=samples
        )
    tokenizer = rollout.tokenizer if params.stop else None
    out = generate_from_state(graphdef, gen_params, ids, mask, params, tokenizer=tokenizer, **engine)
    responses, response_mask, log_probs = jax.block_until_ready((out.responses, out.response_mask, out.log_probs))
    return {"responses": responses, "response_mask": response_mask, "rollout_log_probs": log_probs}, {}


@dataclasses.dataclass(frozen=True)
class ActorConfig(UpdateLoopConfig):
    """The policy update (verl's ``actor``). Batch sizes count responses.

    Attributes:
      ppo_mini_batch_size, ppo_micro_batch_size_per_device, ppo_epochs, shuffle, seed: the
        update loop (`UpdateLoopConfig`).
      loss_mode, clip_ratio_low/high/c, loss_agg_mode, loss_scale_factor: the policy loss
        (`jaxflow.algos.compute_policy_loss`); ``policy_loss_kwargs``: mode-specific options
        as ``(name, value)`` pairs (hashable, so the config keys the compiled step).
      entropy_coeff: weight of the entropy bonus.
      use_kl_loss, kl_loss_coef, kl_loss_type: KL-to-reference loss (GRPO style); needs the
        ``ref_log_prob`` column.
      log_prob_micro_batch_size_per_device: micro-batch of the log-prob forward (memory).
      log_prob_entropy: `ActorWorker.log_probs` also returns ``entropys``.
      use_remove_padding: log-prob and update forwards run over packed real tokens
        (`jaxflow.workers.packing`), same values as the padded rows.
      use_dynamic_bsz: (with remove padding) update micro-batches hold at most
        ``ppo_max_token_len_per_device`` tokens per device instead of a fixed row count;
        ``log_prob_use_dynamic_bsz`` / ``log_prob_max_token_len_per_device``: the same for
        the log-prob forward.
      log_balance: with remove padding, `update` also reports verl's ``global_seqlen/*``
        (``trainer.balance_batch``): real tokens per data-parallel rank of each step, as dealt
        (balanced, always) and as contiguous blocks would have given them.
      optim: optimizer and schedule (read when the worker is built).
    """

    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    policy_loss_kwargs: tuple[tuple[str, Any], ...] = ()
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    log_prob_micro_batch_size_per_device: int | None = None
    log_prob_entropy: bool = False
    use_remove_padding: bool = False
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_device: int = 16384
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_device: int = 16384
    log_balance: bool = False
    optim: OptimConfig = OptimConfig()

    def loss_key(self) -> tuple:
        """The fields the compiled train step depends on (besides the micro-batch count)."""
        return (
            self.loss_mode,
            self.clip_ratio_low,
            self.clip_ratio_high,
            self.clip_ratio_c,
            self.loss_agg_mode,
            self.loss_scale_factor,
            self.policy_loss_kwargs,
            self.entropy_coeff,
            self.use_kl_loss,
            self.kl_loss_coef,
            self.kl_loss_type,
        )

    @property
    def log_prob_forward(self) -> ForwardConfig:
        """How `ActorWorker.log_probs` runs."""
        return ForwardConfig(
            self.log_prob_micro_batch_size_per_device,
            self.use_remove_padding,
            self.log_prob_max_token_len_per_device if self.log_prob_use_dynamic_bsz else None,
        )

    SCALAR_NAMES = ("temperature",)  # the train step's scalars
    STEP_NAME = "actor_train_step"

    def loss_fn(self):
        """The train step's loss (`actor_loss`)."""
        return actor_loss(self)

    def update_keys(self, on_policy: bool = False) -> tuple[str, ...]:
        """The columns an update reads; ``on_policy``: without ``old_log_probs`` (they come
        from the update's own forward)."""
        keys = PROMPT_KEYS + self.loss_mask_keys() + (() if on_policy else ("old_log_probs",)) + ("advantages",)
        return keys + ("ref_log_prob",) if self.use_kl_loss else keys

    def is_on_policy(self, rows: int) -> bool:
        """One optimizer step per rollout of ``rows`` responses: the policy that sampled is
        the one the step differentiates, so ``old_log_probs = stop_gradient(log_probs)``."""
        return self.ppo_epochs == 1 and self.ppo_mini_batch_size == rows

    def train_columns(self, on_policy: bool = False) -> dict[str, int]:
        """The train step's columns and their ranks (`jaxflow.workers.trainable.train_columns`)."""
        return train_columns(self.update_keys(on_policy), self.use_remove_padding)


def actor_loss(cfg: ActorConfig):
    """The actor's ``loss_fn(model, micro, gbi, scalars) -> (loss, aux)`` for `make_train_step`
    (see the module docstring); ``aux`` values add up over micro-batches."""

    def loss_fn(model, micro, gbi, scalars):
        mask = trained_tokens(micro)
        log_prob, entropy = log_probs_and_entropy(model, micro, scalars["temperature"])
        # On-policy (no old_log_probs column): the sampling policy is this one, detached.
        old_log_prob = micro["old_log_probs"] if "old_log_probs" in micro else lax.stop_gradient(log_prob)
        pg_loss, pg = compute_policy_loss(
            old_log_prob,
            log_prob,
            micro["advantages"],
            mask,
            loss_mode=cfg.loss_mode,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.loss_agg_mode,
            global_batch_info=gbi,
            **dict(cfg.policy_loss_kwargs),
        )
        agg_kw = {k: gbi[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")}
        if cfg.entropy_coeff == 0:
            entropy = lax.stop_gradient(entropy)
        entropy_agg = agg_loss(entropy, mask, cfg.loss_agg_mode, **agg_kw)
        loss = pg_loss - cfg.entropy_coeff * entropy_agg
        # Local masked means -> shares of the mini-batch's masked mean (they add up).
        share = masked_sum(jnp.ones_like(log_prob), mask) / jnp.maximum(gbi["batch_num_tokens"], 1)
        # pg_clipfrac, pg_clipfrac_lower, ppo_kl, and a loss's own metrics (bypass_mode's rollout_corr/*)
        aux = {"pg_loss": pg_loss, "entropy": entropy_agg} | {k: v * share for k, v in pg.items()}
        if cfg.use_kl_loss:
            kl_loss = agg_loss(
                kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type), mask, cfg.loss_agg_mode, **agg_kw
            )
            loss = loss + cfg.kl_loss_coef * kl_loss
            aux["kl_loss"] = kl_loss
        return loss, aux

    return loss_fn


@dataclasses.dataclass(frozen=True, eq=False)
class PartialGeneration:
    """An actor's partial rollout (`ActorWorker.start_partial`): its ``prompts`` (with their
    ``uid``), the sampling layer's state (`jaxflow.sampling.PartialRollout`, holding no weights
    between calls) and the ``temperature`` its rows record."""

    prompts: Batch
    rollout: PartialRollout
    temperature: float

    @property
    def done(self) -> bool:
        """Every row has finished."""
        return self.rollout.done

    @property
    def version(self) -> int:
        """The policy version of the weights its last segment ran under."""
        return self.rollout.version


class RolloutSampling:
    """What a worker that samples rollouts adds to its role (`ActorWorker`, and the rollout
    pool's `jaxflow.workers.generation.GenerationWorker`): `generate`, `rollout_metrics`,
    `generation_seconds`. The worker calls `_start_sampling` when built and provides
    ``_generation_weights(stack) -> (graphdef, weights, mesh, rules)`` (what generation reads)
    and, for the rollout probe, the trainer's ``graphdef``, ``params``, ``mesh``, ``rules``."""

    def _start_sampling(self, rollout: RolloutConfig) -> None:
        self.rollout = rollout
        self._num_rollouts = 0
        self._gen_seconds: dict[str, float] = {}
        self._agent_metrics: dict[str, float] = {}
        self.probe = RolloutProbe(rollout.probe_tolerance) if rollout.probe_tolerance > 0 else None

    @register(DP_COMPUTE_REPEAT)
    def generate(
        self,
        prompts: Batch,
        *,
        sampling: SamplingParams | str = "train",
        step: int | None = None,
        prompt_offset: int = 0,
    ) -> Batch:
        """``n`` responses per prompt with ``sampling`` (`RolloutConfig.resolve`: the training
        or validation parameters, ``"greedy"``, or explicit `SamplingParams`). ``step``: the
        training step; the rollout key is ``fold_in(key(seed), step)``, so a resumed run
        samples what the uninterrupted run would have (None: this worker's call count).
        Prompt ``i`` is prompt ``prompt_offset + i`` of the step (a step may sample several
        prompt batches: DAPO's dynamic sampling), and its ``j``-th sample's token ``t`` draws
        from ``fold_in(fold_in(key, (prompt_offset + i) * n + j), t)``: the same tokens on
        any mesh, placement, backend or process count. Returns the prompts repeated ``n``
        times (interleaved, with a ``uid`` per prompt, ``"<step>:<prompt>"``: its samples
        share it) plus ``responses``, ``response_mask``, ``rollout_log_probs`` (the
        sampler's log-probs) and the provenance ``meta["temperature"]``. An optional integer
        column ``max_new_tokens`` [B] limits each prompt's responses (vLLM's per-request
        ``max_tokens``; at most the sampling parameters' ``max_new_tokens``). With
        ``rollout.multi_turn``, each sample is a conversation (`jaxflow.workers.multi_turn`): the
        rows also hold ``loss_mask`` (the model's own tokens) and `rollout_metrics` the
        ``agent/*`` counts."""
        request = self._request(prompts, sampling, step, prompt_offset)
        with contextlib.ExitStack() as stack:
            t0 = time.perf_counter()
            graphdef, gen_params, mesh, rules = self._generation_weights(stack)
            jax.block_until_ready(gen_params)
            t1 = time.perf_counter()
            columns, self._agent_metrics = sample_columns(
                self.rollout, request, graphdef, gen_params, mesh=mesh, rules=rules
            )
            t2 = time.perf_counter()
            rows = request.rows(columns)
            if self.probe is not None:  # the rollout's weights score the probe while they exist
                self.probe.capture(rows)
                rollout_probe = self.probe.log_probs("rollout", graphdef, gen_params, mesh, rules)
        if self.probe is not None:  # ... and the trainer's, given back
            self.probe.check(
                rollout_probe, self.probe.log_probs("trainer", self.graphdef, self.params, self.mesh, self.rules)
            )
        self._gen_seconds = {"reshard": t1 - t0, "engine": t2 - t1, "post": time.perf_counter() - t2}
        return rows

    def _request(
        self, prompts: Batch, sampling: SamplingParams | str, step: int | None, prompt_offset: int
    ) -> RolloutRequest:
        """`rollout_request` of `generate`'s arguments: the call's index is ``step``, or
        (None) this worker's call count."""
        index = step
        if index is None:
            index = self._num_rollouts
            self._num_rollouts += 1
        return rollout_request(self.rollout, prompts, sampling, index, prompt_offset)

    # ------------------------------------------------------------------ partial rollouts
    def start_partial(
        self,
        prompts: Batch,
        *,
        sampling: SamplingParams | str = "train",
        step: int | None = None,
        prompt_offset: int = 0,
        version: int = 0,
    ) -> PartialGeneration:
        """A rollout of ``prompts`` that a weight sync may interrupt (`jaxflow.sampling.partial`),
        nothing sampled yet: the same rows, keys and limits as `generate` with these arguments
        (so a partial rollout never interrupted, or resumed under the same weights, samples what
        `generate` samples), to be run by `run_partial` under this worker's weights of policy
        ``version`` and turned into rows by `finish_partial`. Not for multi-turn rollouts; the
        rollout probe does not run on it."""
        if self.rollout.multi_turn is not None:
            raise ValueError("partial rollouts sample one response per sample (no rollout.multi_turn)")
        request = self._request(prompts, sampling, step, prompt_offset)
        prompts, params = request.prompts, request.params
        ids = np.asarray(jax.device_get(prompts["prompt_ids"]))
        mask = np.asarray(jax.device_get(prompts["prompt_mask"]))
        tokenizer = self.rollout.tokenizer if params.stop else None
        rollout = start_partial(
            self.graphdef,
            self.params,
            ids,
            mask,
            params,
            version=version,
            rng=request.rng,
            tokenizer=tokenizer,
            **request.engine,
        )
        temperature = 1.0 if params.greedy else float(params.temperature)
        return PartialGeneration(prompts, dataclasses.replace(rollout, weights=None), temperature)

    def run_partial(
        self,
        partial: PartialGeneration,
        version: int,
        *,
        max_steps: int | None = None,
        until: Callable[[], bool] | None = None,
    ) -> PartialGeneration:
        """Sample the unfinished rows of ``partial`` under this worker's current weights, whose
        policy version is ``version`` (>= the rollout's: a newer one means the weights were
        synced since the last call, and the rows go on under them, `jaxflow.sampling.partial`),
        in segments of at most ``max_steps`` tokens per row, until every row has finished or
        ``until()`` (asked before each segment) is true; without ``until``, one segment
        (`jaxflow.sampling.run_partial`). The weights are released again on return."""
        with contextlib.ExitStack() as stack:
            t0 = time.perf_counter()
            graphdef, gen_params, mesh, rules = self._generation_weights(stack)
            jax.block_until_ready(gen_params)
            t1 = time.perf_counter()
            rollout = swap_weights(partial.rollout, gen_params, version, graphdef=graphdef, mesh=mesh, rules=rules)
            rollout = run_partial(rollout, max_steps=max_steps, until=until)
            t2 = time.perf_counter()
        self._gen_seconds = {"reshard": t1 - t0, "engine": t2 - t1, "post": time.perf_counter() - t2}
        return dataclasses.replace(partial, rollout=dataclasses.replace(rollout, weights=None))

    def finish_partial(self, partial: PartialGeneration) -> Batch:
        """The rows of a finished partial rollout: `generate`'s columns (the prompts repeated
        ``n`` times with their ``uid``, ``responses``, ``response_mask``,
        ``rollout_log_probs``, ``meta["temperature"]``) and ``token_versions`` (int32 [B * n,
        R]: the policy version that sampled each token; on padding its row's last)."""
        if not partial.done:
            raise ValueError(f"the partial rollout has {int((~partial.rollout.done_N).sum())} rows not finished")
        out = partial.rollout.output()
        columns = {
            "responses": out.responses,
            "response_mask": out.response_mask,
            "rollout_log_probs": out.log_probs,
            "token_versions": out.token_versions,
        }
        rows = partial.prompts.repeat(partial.rollout.params.n, interleave=True)
        return rows.update(tensors=columns, meta={"temperature": partial.temperature})

    @register(ONE_TO_ALL)
    def rollout_metrics(self) -> dict[str, float]:
        """The last rollout's metrics: the probe's ``rollout/probe_tv`` (the total variation
        between the rollout's and the trainer's next-token distributions on the fixed probe,
        `jaxflow.workers.rollout_probe`; absent without a probe) and, for multi-turn rollouts,
        the ``agent/*`` counts (turns, tool calls and their errors and timeouts, tokens by
        source, conversation lengths)."""
        probe = {} if self.probe is None or self.probe.last is None else {PROBE_METRIC: self.probe.last}
        return probe | self._agent_metrics

    @register(ONE_TO_ALL)
    def generation_seconds(self) -> dict[str, float]:
        """The last `generate` call's parts, wall-clock seconds on this worker: ``reshard``
        (the generation copy: cast and/or the hybrid engine's switch), ``engine`` (the
        rollout program, to its outputs' readiness), ``post`` (giving the weights back and
        assembling the rows)."""
        return dict(self._gen_seconds)


class ActorWorker(RolloutSampling, TrainableWorker):
    """Policy model: `generate`, `log_probs`, `update`.

    Args:
      model: the policy (``nnx.Module``, ``(graphdef, state)`` or a checkpoint directory).
      mesh: the training mesh (or a `MeshSpec`).
      rules: the training rules (for the hybrid engine, e.g. ``HYBRID_TRAIN_RULES``).
      config: the update; ``rollout``: the sampling.
      gen_tp: generation tensor parallelism; with it, generation runs in the 3D-HybridEngine's
        generation layout (`jaxflow.reshard.HybridEngine`, ``strategy``, ``gen_rules``).
        Without it, generation runs in the training layout.
      reference: with LoRA, `ref_log_probs` serves the reference policy (the base model: the
        adapters switched off, no second copy of the weights) with these `ReferenceWorker`
        settings (``temperature`` and its `ForwardConfig`, ``forward``).
    """

    role = Role.ACTOR

    def __init__(
        self,
        model: ModelLike,
        mesh: Mesh | MeshSpec | str,
        rules: Rules | str,
        config: ActorConfig = ActorConfig(),
        rollout: RolloutConfig = RolloutConfig(),
        *,
        gen_tp: int | None = None,
        gen_rules: Rules | str | None = None,
        strategy: str = "hybrid",
        reference: Mapping[str, Any] | None = None,
    ):
        super().__init__(model, mesh, rules, config)
        if reference is not None and self.frozen is None:
            raise ValueError("an actor serves the reference policy only with LoRA (its base model)")
        self._reference_settings = reference
        self._reference: Any = None
        self.engine = None
        if gen_tp is not None:
            self.engine = HybridEngine(self.mesh, self.rules, gen_tp, strategy=strategy, gen_rules=gen_rules)
        self._start_sampling(rollout)

    def generation_dtype(self) -> Any:
        """`generation_dtype` of this actor's model."""
        return generation_dtype(self.model_config)

    def _generation_weights(self, stack: contextlib.ExitStack) -> tuple[nnx.GraphDef, Any, Mesh, Rules]:
        """The graph and weights generation reads, with their mesh and rules. With LoRA and
        ``rollout.lora_merge``: the base graph and a copy of its weights with the adapters
        merged in (`merge_program`, in `generation_dtype`), resharded into the generation
        layout (the copy donated), dropped on exit. Otherwise the model's own graph (with LoRA,
        the adapter path) and, in the masters' dtype, the training weights themselves or (hybrid
        engine) the training weights donated into the generation layout and given back on exit;
        narrower (`generation_dtype`): a cast copy, resharded like the merged one. The masters
        stay untouched."""
        dtype = self.generation_dtype()
        if self.frozen is not None and self.rollout.lora_merge:
            merge = self._compiled(
                ("merge", dtype), lambda: merge_program(self.model_config.lora, dtype, self.frozen_shardings)
            )
            return self._to_generation(self.base_graphdef, merge(self.frozen, self.state.params))
        if dtype is None:
            if self.engine is None:
                return self.graphdef, self.params, self.mesh, self.rules
            gen = stack.enter_context(self.engine.generation_swap(self.params, self.replace_params))
            return self.graphdef, gen, self.engine.gen_mesh, self.engine.gen_rules
        cast = self._compiled(("cast", dtype.name), lambda: cast_program(dtype, self.param_shardings))
        return self._to_generation(self.graphdef, cast(self.params))

    def _to_generation(self, graphdef: nnx.GraphDef, copy: Any) -> tuple[nnx.GraphDef, Any, Mesh, Rules]:
        """A copy of the weights for generation, moved (donated) into the generation layout."""
        if self.engine is None:
            return graphdef, copy, self.mesh, self.rules
        return graphdef, self.engine.to_generation(copy, donate=True), self.engine.gen_mesh, self.engine.gen_rules

    # ------------------------------------------------------------------ log-probs
    @register(DP_COMPUTE)
    def log_probs(self, batch: Batch, *, temperature: float | None = None) -> Batch:
        """``old_log_probs`` [B, R] (0 on padding) of the responses under the current policy
        (and ``entropys`` with ``config.log_prob_entropy``) at ``temperature`` (None: the
        training rollouts', `RolloutConfig.temperature`)."""
        cfg = self.config
        scalars = {"temperature": np.float32(self.rollout.temperature if temperature is None else temperature)}
        fn = log_probs_fn(with_entropy=cfg.log_prob_entropy)
        return self.run_forward(batch, cfg.log_prob_forward, "old_log_probs", fn, scalars, self.log_probs_program)

    def log_probs_program(self, rows: int):
        """The jitted log-prob forward of ``rows`` responses (`log_probs_program`)."""
        k = num_micro_batches(rows, self.config.log_prob_forward.micro_batch_size_per_device, self.dp_size, "log_probs")
        return self._compiled(
            ("log_probs", k), lambda: log_probs_program(self.layout, k, with_entropy=self.config.log_prob_entropy)
        )

    @register(DP_COMPUTE)
    def ref_log_probs(self, batch: Batch, *, temperature: float | None = None) -> Batch:
        """``ref_log_prob`` [B, R]: the reference policy's log-probs, the reference being this
        actor's base model (LoRA with ``reference`` settings: the adapters switched off). A
        `ReferenceWorker` over the actor's own base weights, on its mesh: no copy."""
        if self._reference_settings is None:
            raise ValueError("this actor does not serve the reference policy (it needs LoRA and reference settings)")
        if self._reference is None:
            model = (self.base_graphdef, self.frozen)
            self._reference = ReferenceWorker(model, self.mesh, self.rules, **self._reference_settings)
        self._reference.replace_params(self.frozen)  # the base's current arrays (a rollout may have moved them)
        return self._reference.log_probs(batch, temperature=temperature)

    # ------------------------------------------------------------------ update
    @register(DP_TRAIN)
    def update(
        self, batch: Batch, *, step: int | None = None, temperature: float | None = None
    ) -> dict[str, np.ndarray]:
        """PPO epochs over shuffled mini-batches, one optimizer step each. Needs ``advantages``
        (and ``ref_log_prob`` with the KL loss) and ``old_log_probs``; without them an
        on-policy update (`ActorConfig.is_on_policy`) takes them from its own forward
        (detached), any other computes them first. ``step``: the training step, which seeds
        the shuffle (None: this worker's call count). ``temperature``: the log-probs' T (None:
        the training rollouts', `RolloutConfig.temperature`). Returns each metric's values, one
        per step; with remove padding and ``config.log_balance`` also verl's ``global_seqlen/*``
        balance metrics of each step's mini-batch (`jaxflow.workers.packing.balance_metrics`:
        real tokens per data-parallel rank as dealt, balanced, and as contiguous blocks would
        be)."""
        cfg = self.config
        temperature = self.rollout.temperature if temperature is None else temperature
        on_policy = "old_log_probs" not in batch and cfg.is_on_policy(len(batch))
        if "old_log_probs" not in batch and not on_policy and "response_mask" in batch:
            batch = batch | self.log_probs(batch, temperature=temperature).select(["old_log_probs"])
        host = self.host_columns(batch, cfg.update_keys(on_policy))
        scalars = {"temperature": np.float32(temperature)}
        out, layouts = self.update_epochs(host, scalars, step=step, on_policy=on_policy)
        balance = [balance_metrics(layout) for layout in layouts if layout is not None] if cfg.log_balance else []
        if balance:
            out |= {name: np.asarray([m[name] for m in balance]) for name in balance[0]}
        if cfg.use_kl_loss:
            out["actor/kl_coef"] = np.full(len(layouts), cfg.kl_loss_coef)
        return out

    def train_step(self, minibatch: Mapping[str, Any], temperature: float | None = None) -> dict[str, float]:
        """One optimizer step on one mini-batch (all rows, in order): the building block of
        `update`, for tests and custom loops. Rows must be a multiple of ``dp_size``."""
        t = self.rollout.temperature if temperature is None else temperature
        return self.step_on(minibatch, self.config.update_keys(), {"temperature": np.float32(t)})
