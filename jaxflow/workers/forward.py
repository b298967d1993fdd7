"""Forward passes of the roles over ``[prompt | response]`` rows, as pure functions.

A row is ``concat(prompt_ids, responses)`` with mask ``concat(prompt_mask, response_mask)``:
left padding, the prompt, the response, right padding. The models take positions from the
mask, so this row gives the same outputs on its real tokens as the unpadded sequence.

With prompt length ``P`` and response length ``R``, the logits at position ``P - 1 + t``
predict response token ``t``::

    log_probs[b, t] = log_softmax(logits[b, P - 1 + t] / T)[responses[b, t]]

the quantity the sampler reports for the tokens it draws (``jaxflow.sampling``) and the one
the actor trains on. The critic's value of token ``t`` is read at the same position ``P - 1
+ t`` (the state before token ``t`` is emitted), as in verl (``values[:, -R - 1 : -1]``).

Micro-batches. `split_micro` cuts a batch of ``M`` rows into ``k`` micro-batches of ``M /
k`` rows, micro-batch ``j`` holding rows ``j, j + k, j + 2k, ...``. When the batch is sharded
in blocks over ``D`` data-parallel devices and ``D * k`` divides ``M``, every micro-batch is
then spread evenly over all ``D`` devices without moving a byte (a reshape plus a transpose
of the unsharded axis). `merge_micro` is its inverse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.algos import compute_entropy_from_logits
from jaxflow.models import ordered

Array = jax.Array

PROMPT_KEYS = ("prompt_ids", "prompt_mask", "responses", "response_mask")
LOSS_MASK = "loss_mask"  # [B, R]: 1 on the response tokens that train (agentic rollouts: the model's own)


def trained_tokens(tensors: Mapping[str, Array]) -> Array:
    """The response tokens the losses (and their token counts) cover: ``response_mask``, times
    ``loss_mask`` where the batch has one (tool and environment tokens of a multi-turn rollout
    are attended to, but not trained)."""
    mask = tensors["response_mask"]
    return mask * tensors[LOSS_MASK].astype(mask.dtype) if LOSS_MASK in tensors else mask


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """How a role's forward over a whole rollout runs (the actor's and the reference's
    log-probs, the critic's values, the reward and cost models' scores;
    `jaxflow.workers.base.RoleWorker.run_forward`).

    Attributes:
      micro_batch_size_per_device: rows per data-parallel device per pass (memory; None: the
        whole batch at once).
      use_remove_padding: over packed real tokens (`jaxflow.workers.packing`), the same values
        as over the padded rows.
      max_token_len_per_device: with remove padding, micro-batches of at most this many tokens
        per device (verl's ``use_dynamic_bsz``); None: by rows.
    """

    micro_batch_size_per_device: int | None = None
    use_remove_padding: bool = False
    max_token_len_per_device: int | None = None


def full_sequence(tensors: Mapping[str, Array]) -> tuple[Array, Array, int]:
    """``(ids [B, P+R], mask [B, P+R], P)`` from the prompt and response columns."""
    prompt_ids, responses = tensors["prompt_ids"], tensors["responses"]
    ids = jnp.concatenate([prompt_ids.astype(jnp.int32), responses.astype(jnp.int32)], axis=1)
    mask = jnp.concatenate(
        [tensors["prompt_mask"].astype(jnp.int32), tensors["response_mask"].astype(jnp.int32)], axis=1
    )
    return ids, mask, prompt_ids.shape[1]


def response_hidden(model: Any, tensors: Mapping[str, Array]) -> Array:
    """A CausalLM's final hidden states at the positions that predict the response tokens:
    ``[B, R, D]``."""
    ids, mask, P = full_sequence(tensors)
    R = tensors["responses"].shape[1]
    hidden_BxLxD, _ = model.model(ids, mask)
    return jax.lax.slice_in_dim(hidden_BxLxD, P - 1, P - 1 + R, axis=1)


def token_log_probs(logits_BxRxV: Array, tokens_BxR: Array, batch_invariant: bool = False) -> Array:
    """``log_softmax(logits)[token]`` per position: ``[B, R]`` (``batch_invariant``: the
    normaliser's sum in index order, `jaxflow.models.ordered.logsumexp`)."""
    lse_BxR = ordered.logsumexp(logits_BxRxV, batch_invariant)
    picked_BxR = jnp.take_along_axis(logits_BxRxV, tokens_BxR.astype(jnp.int32)[..., None], axis=-1)[..., 0]
    return picked_BxR - lse_BxR


LOGITS_CHUNK_BYTES = 1 << 30  # float32 logits of one chunk of positions (`head_log_probs`)


def position_chunks(rows: int, positions: int, vocab: int, budget: int) -> int:
    """The fewest chunks k (a divisor of ``positions``) whose float32 logits ``[rows,
    positions / k, vocab]`` fit in ``budget`` bytes (one position per chunk at worst)."""
    for k in range(1, positions + 1):
        if positions % k == 0 and rows * (positions // k) * vocab * 4 <= budget:
            return k
    return positions


def head_log_probs(
    model: Any, hidden_BxLxD: Array, tokens_BxL: Array, temperature: Any, with_entropy: bool
) -> tuple[Array, Array | None]:
    """``log_softmax(head(hidden) / T)[token]`` and the entropies ``[B, L]`` through the LM
    head in chunks of positions (`position_chunks`), each chunk's logits recomputed in the
    backward pass (``jax.checkpoint``): float32 logits of a large vocabulary (152k rows for
    Qwen2.5) are never held for the whole micro-batch at once, forward or backward. One chunk
    is the plain computation."""
    B, L, _ = hidden_BxLxD.shape

    def chunk(h_BxCxD, t_BxC):
        logits = model.logits(h_BxCxD)
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
        if model.cfg.batch_invariant:  # as the engine computes it (`jaxflow.models.ordered`)
            logits = ordered.divide(logits, temperature)
        else:
            logits = logits / jnp.asarray(temperature, logits.dtype)
        lp = token_log_probs(logits, t_BxC, model.cfg.batch_invariant)
        return lp, (compute_entropy_from_logits(logits) if with_entropy else jnp.zeros_like(lp))

    k = position_chunks(B, L, model.cfg.vocab_size, LOGITS_CHUNK_BYTES)
    if k == 1:
        lp, ent = chunk(hidden_BxLxD, tokens_BxL)
    else:
        C = L // k
        h_KxBxCxD = jnp.swapaxes(hidden_BxLxD.reshape(B, k, C, -1), 0, 1)
        t_KxBxC = jnp.swapaxes(tokens_BxL.astype(jnp.int32).reshape(B, k, C), 0, 1)
        lp, ent = jax.lax.map(lambda xs: jax.checkpoint(chunk)(*xs), (h_KxBxCxD, t_KxBxC))
        lp, ent = (jnp.swapaxes(x, 0, 1).reshape(B, L) for x in (lp, ent))
    return lp, (ent if with_entropy else None)


def is_packed(tensors: Mapping[str, Array]) -> bool:
    """Whether ``tensors`` is a packed micro-batch (`jaxflow.workers.packing`)."""
    return "packed_ids" in tensors


def read_responses(x_NxC: Array, index_BxR: Array) -> Array:
    """``x[index]`` over the flattened packed slots: the per-token values of ``[B, R]``
    response positions (`jaxflow.workers.packing.pack_inputs`'s ``response_index``)."""
    return jnp.take(x_NxC.reshape(-1), index_BxR, axis=0)


def packed_outputs(model: Any, tensors: Mapping[str, Array]) -> Array:
    """The model's per-slot output over packed bins: hidden ``[N, C, D]`` for a CausalLM
    (its LM head is applied by the caller), values ``[N, C]`` for a ValueModel."""
    kw = dict(positions=tensors["packed_positions"], segment_ids=tensors["packed_segments"])
    if hasattr(model, "logits"):
        hidden_NxCxD, _ = model.model(
            tensors["packed_ids"], positions_BxL=kw["positions"], segment_ids_BxL=kw["segment_ids"]
        )
        return hidden_NxCxD
    return model(tensors["packed_ids"], **kw)


def log_probs_and_entropy(
    model: Any, tensors: Mapping[str, Array], temperature: Any, with_entropy: bool = True
) -> tuple[Array, Array | None]:
    """Response log-probs ``[B, R]`` and token entropies ``[B, R]`` (or None) at temperature T,
    from padded rows or from a packed micro-batch (same values on the real tokens); the LM
    head runs on the positions that predict responses only, in chunks (`head_log_probs`)."""
    if is_packed(tensors):
        index = tensors["response_index"]
        lp, ent = head_log_probs(
            model, packed_outputs(model, tensors), tensors["packed_targets"], temperature, with_entropy
        )
        return read_responses(lp, index), (read_responses(ent, index) if with_entropy else None)
    return head_log_probs(model, response_hidden(model, tensors), tensors["responses"], temperature, with_entropy)


def response_values(model: Any, tensors: Mapping[str, Array]) -> Array:
    """Critic values of the response tokens ``[B, R]`` (read at ``P - 1 + t``), 0 on padding;
    from padded rows or a packed micro-batch."""
    if is_packed(tensors):
        values_BxR = read_responses(packed_outputs(model, tensors), tensors["response_index"])
    else:
        ids, mask, P = full_sequence(tensors)
        R = tensors["responses"].shape[1]
        values_BxL = model(ids, attention_mask=mask)
        values_BxR = jax.lax.slice_in_dim(values_BxL, P - 1, P - 1 + R, axis=1)
    return values_BxR * tensors["response_mask"].astype(values_BxR.dtype)


def sequence_scores(model: Any, tensors: Mapping[str, Array]) -> Array:
    """A reward (or cost) model's score of each ``[prompt | response]`` row: ``[B]``, read at
    its last real token (from a packed micro-batch: the slot of its last response token, so
    rows without a response get an arbitrary value that `scores_on_last_token` drops)."""
    if is_packed(tensors):
        scores_NxC = model.token_scores(
            tensors["packed_ids"], positions=tensors["packed_positions"], segment_ids=tensors["packed_segments"]
        )
        own_BxR = read_responses(scores_NxC, tensors["response_index"] + 1)  # each token's own slot
        m = tensors["response_mask"] > 0
        last_B = jnp.max(jnp.where(m, jnp.arange(m.shape[1], dtype=jnp.int32)[None, :], 0), axis=1)
        return jnp.take_along_axis(own_BxR, last_B[:, None], axis=1)[:, 0]
    ids, mask, _ = full_sequence(tensors)
    return model(ids, attention_mask=mask)


def scores_on_last_token(scores_B: Array, response_mask_BxR: Array) -> Array:
    """``[B, R]``: each score on its row's last response token (zeros elsewhere; a row with no
    response token gets nothing), like `jaxflow.rewards.token_level_scores`."""
    m = response_mask_BxR.astype(jnp.int32)
    R = m.shape[1]
    last_B = jnp.max(jnp.where(m > 0, jnp.arange(R, dtype=jnp.int32)[None, :], -1), axis=1)
    onehot_BxR = (jnp.arange(R, dtype=jnp.int32)[None, :] == last_B[:, None]).astype(jnp.float32)
    return onehot_BxR * scores_B.astype(jnp.float32)[:, None]


def named(fn: Callable, name: str) -> Callable:
    """``fn`` renamed: `jax.jit` names its program after the function (XLA module
    ``jit_<name>``, profiles, the ``fun_name`` of ``jax.monitoring``'s compile events)."""
    fn.__name__ = fn.__qualname__ = name
    return fn


# ------------------------------------------------------------------ micro-batches


def _row_spec(batch_axes: Any, ndim: int, leading: int = 0) -> PartitionSpec:
    return PartitionSpec(*([None] * leading), batch_axes, *([None] * (ndim - 1)))


def split_micro(
    tensors: Mapping[str, Array], k: int, mesh: Mesh | None = None, batch_axes: Any = None
) -> dict[str, Array]:
    """``[M, ...] -> [k, M/k, ...]``; micro-batch ``j`` holds rows ``j, j+k, ...`` (see the
    module docstring). With a mesh, each micro-batch stays sharded over ``batch_axes``."""
    out = {}
    for name, x in tensors.items():
        M = x.shape[0]
        if M % k:
            raise ValueError(f"column {name!r}: {M} rows do not split into {k} micro-batches")
        y = jnp.swapaxes(x.reshape((M // k, k) + x.shape[1:]), 0, 1)
        if mesh is not None:
            y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, _row_spec(batch_axes, x.ndim, 1)))
        out[name] = y
    return out


def merge_micro(x: Array) -> Array:
    """Inverse of `split_micro` for one array: ``[k, M/k, ...] -> [M, ...]``."""
    k, b = x.shape[:2]
    return jnp.swapaxes(x, 0, 1).reshape((k * b,) + x.shape[2:])


def map_micro(
    fn: Callable[[dict[str, Array]], Any],
    tensors: Mapping[str, Array],
    k: int,
    mesh: Mesh | None = None,
    batch_axes: Any = None,
) -> Any:
    """``fn`` over ``k`` micro-batches one after the other (``lax.map``), outputs re-merged to
    the original row order; ``k == 1`` calls ``fn`` once on the whole batch."""
    if k == 1:
        return fn(dict(tensors))
    outs = jax.lax.map(fn, split_micro(tensors, k, mesh, batch_axes))
    return jax.tree.map(merge_micro, outs)
