"""The actor's rollout as conversations (``actor_rollout_ref.rollout.multi_turn.enable``): each
sample alternates model turns, sampled by the engine on the generation weights of the call,
and tool turns, until it answers without a tool call, a turn limit or the response length.

The loop itself is ``RolloutConfig.multi_turn`` (`jaxflow.agents.MultiTurn`, built by the run's
description; this package does not import it). Here its model turns are sampled by
`jaxflow.sampling.EngineTurns` (the agent loop's sampler too): the live conversations in one
engine call per turn, each one's KV pages kept in the engine between its turns on the
generation weights' mesh (`jaxflow.sampling.session.KVSession`, one replica spanning the mesh),
so a turn runs the model only on the tokens appended since the conversation's last turn (its
last sampled token and the tool or environment turn), not on the whole conversation again.
Row ``r`` of a call (sample ``j`` of prompt ``b``, ``r = b * n + j`` as in single-turn rollouts) draws its turn
``k`` from ``fold_in(fold_in(key_k, prompt id * n + j), token)`` with ``key_0 = key`` (the
single-turn rollout's: a conversation whose first turn calls no tool samples the single-turn
rollout's tokens) and ``key_k = fold_in(key, k)`` after; what a conversation samples does
not depend on which others are still going, nor on whether its KV pages were kept.

The rows come back as a single-turn rollout's columns (``responses``, ``response_mask``,
``rollout_log_probs``: 0 on tool tokens) plus ``loss_mask`` (1 on the model's own tokens: the
update, the KL and the entropy train on those only, `UpdateLoopConfig.use_loss_mask`), with an
environment its turn-level rewards (``token_rewards``, added to the reward's
``token_level_scores``: `jaxflow.iterations.steps.reward`), and the loop's ``agent/*`` metrics."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxflow.mesh import GENERATE_RULES, Rules, data_parallel_size
from jaxflow.sampling import EngineTurns, SamplingParams


def keeps_kv_pages(reuse_kv: bool, mesh: Mesh | None, rules: Rules) -> bool:
    """Whether the turns keep their KV pages (`EngineTurns` ``reuse_kv``): asked for, and the
    generation mesh is one replica. The session runs every conversation on every
    data-parallel replica (`jaxflow.sampling.session`), so over several replicas it repeats
    their work (measured, grpo_tool_tiny on 4 simulated CPU replicas, median engine time per
    rollout: 3.7 s with the session on a quiet machine, 1.3 s re-prefilling with the
    conversations split over them with the machine busy)."""
    return reuse_kv and (mesh is None or data_parallel_size(rules, mesh) == 1)


def multi_turn_rollout(
    multi_turn: Any,
    tokenizer: Any,
    graphdef: Any,
    gen_params: Any,
    ids_BxL: np.ndarray,
    mask_BxL: np.ndarray,
    params: SamplingParams,
    rng: jax.Array,
    prompt_index: np.ndarray,
    samples: list[dict[str, Any]] | None = None,
    **engine: Any,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """``params.n`` conversations per prompt (interleaved), their model turns sampled by
    `jaxflow.sampling.EngineTurns` with ``engine`` (``mesh``, ``rules``, ``options``, ...;
    the KV pages kept between turns where `keeps_kv_pages`); returns the
    ``[B * n, R]`` columns and the ``agent/*`` metrics. ``prompt_index`` [B]: the prompts'
    ids (`ActorWorker.generate`); ``samples``: each prompt's row (its non-tensor columns),
    which starts its conversations' environments. With an environment the columns hold its
    rewards too (``token_rewards``: each on the last token of the turn it answered). The
    metrics add ``agent/prefill_tokens/sum``: the conversation tokens the model ran on before
    sampling, over every turn (with the KV pages kept: each prompt, then what each turn
    appended; without: every conversation whole, every turn)."""
    if tokenizer is None:
        raise ValueError("a multi-turn rollout needs the run's tokenizer (RolloutConfig.tokenizer)")
    n = params.n
    prompts = [row[m > 0].tolist() for row, m in zip(ids_BxL, mask_BxL) for _ in range(n)]
    row_ids = np.repeat(np.asarray(prompt_index, np.int64) * n, n) + np.tile(np.arange(n), len(ids_BxL))
    one = dataclasses.replace(params, n=1)
    reuse_kv = keeps_kv_pages(multi_turn.reuse_kv, engine.get("mesh"), engine.get("rules", GENERATE_RULES))
    sample = EngineTurns(
        graphdef, gen_params, one, reuse_kv=reuse_kv, tokenizer=tokenizer, rng=rng, row_ids=row_ids, **engine
    )
    pad = params.pad_token_id if params.pad_token_id is not None else 0
    rows = None if samples is None else [s for s in samples for _ in range(n)]
    out = multi_turn.rollout(prompts, sample, tokenizer, pad, samples=rows)
    columns = {
        "responses": out.responses,
        "response_mask": out.response_mask,
        "rollout_log_probs": out.rollout_log_probs,
        "loss_mask": out.loss_mask,
    }
    if multi_turn.environment is not None:
        columns["token_rewards"] = out.token_rewards
    prefilled = sum(int(np.sum(stats["prefill_tokens"])) for stats in sample.stats)
    return columns, out.metrics() | {"agent/prefill_tokens/sum": float(prefilled)}
