"""Partial rollouts: a rollout that a weight sync can interrupt and that resumes under the new
weights (verl's fully-async ``partial_rollout``, issue 23 item 3).

The API, for an overlapped rollouter::

    p = start_partial(graphdef, weights, prompt_ids, prompt_mask, params, version=v)  # nothing sampled yet
    p = run_partial(p, max_steps=k, until=new_weights_arrived)   # segments of <= k tokens per row
    p = swap_weights(p, new_weights, v + 1)                       # the rows not finished go on under them
    p = run_partial(p)                                            # (or resume_partial(p, new_weights, v + 1))
    out = p.output()     # responses, response_mask, log_probs, lengths, token_versions [B * n, R]

State (`PartialRollout`, host arrays, immutable: each call returns a new one). Row ``r = i * n +
j`` is sample ``j`` of prompt ``i`` (as `engine.generate_from_state`); for each row its tokens so
far ``responses_NxR[r, :lengths_N[r]]``, their rollout log-probs (``log_softmax(logits / T)`` of
the weights that sampled them), the policy version of those weights per token
(``versions_NxR``, int32) and whether it has finished (``done_N``: its ``max_new_tokens``, an
EOS id, or a stop string). A finished row is never run again.

Segments. `run_partial` runs the engine on the unfinished rows, each for at most ``max_steps``
more tokens (None: to its end), checking ``until()`` before each segment. The first segment of
a fresh rollout is the engine's ordinary call (the n samples of a prompt share its pages);
every later one is a *resumed* call (``generated=``, n = 1): each unfinished row's prompt is its
prompt followed by its tokens so far, re-prefilled with the weights of that segment, and its
sampling goes on from token ``lengths_N[r]``. Re-prefilling is what keeps a sequence on one
policy per token: the KV pages of the old weights would mix two policies in one token's
attention (the keys and values of the earlier tokens would be the old weights' while the new
token's query is the new weights'). The price is one prefill of prompt + tokens so far per row
per segment (a sync every k tokens costs about what one re-prefill of the sequence costs).

Determinism. Token ``t`` of sample ``j`` of prompt ``i`` draws from
``fold_in(fold_in(rng, prompt_index[i] * n + j), t)`` (`batcher.row_keys`) in every segment:
the resumed call's row is prompt ``prompt_index[i] * n + j`` of a call with n = 1, and its
token count starts at ``lengths_N[r]``, its stop-string state after its earlier tokens
(`stops.scan_tokens`) and its limit counting them. So a rollout interrupted and resumed with
the *same* weights samples the uninterrupted rollout's tokens, as far as a re-prefill gives
the cached keys and values the same floats as the decode steps that wrote them: bit for bit
for a ``batch_invariant`` model; otherwise the log-probs may differ by a few float32 ulps
(XLA's products round by the matrices' shapes; `session` says the same of multi-turn turns),
and a token would change only if its sampling draw fell within those ulps of a boundary
(tests/test_partial_rollouts.py measures the bound it asserts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxflow.mesh import GENERATE_RULES
from jaxflow.sampling.engine import (
    EngineOptions,
    SamplingParams,
    _config_of,
    _eos_ids,
    _left_padded_on_host,
    _prompt_index,
    _row_limits,
    _stop_strings,
    _stop_tables,
    generate_from_state,
)
from jaxflow.sampling.stops import StopStrings, scan_tokens


@dataclasses.dataclass(frozen=True)
class PartialOutput:
    """A partial rollout's rows (see `engine.GenerateOutput`): ``responses`` int32 [B * n, R]
    (R = ``max_new_tokens``, the pad id past each row's length), ``response_mask`` int32,
    ``log_probs`` float32 (0 on padding), ``lengths`` int32 [B * n], ``token_versions`` int32
    [B * n, R]: the policy version of the weights that sampled each token (on padding: the
    version of the row's last token, or the current one for a row with none yet)."""

    responses: np.ndarray
    response_mask: np.ndarray
    log_probs: np.ndarray
    lengths: np.ndarray
    token_versions: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class PartialRollout:
    """The state of a partial rollout (module docstring): the sampling settings, the weights
    it runs under now (``graphdef``, ``weights`` on ``engine["mesh"]``; None between an actor's
    calls) and their ``version``, and per row (``_N``, B * n rows) its tokens, log-probs,
    versions, length and whether it has finished. ``segments``: engine calls so far."""

    graphdef: Any
    weights: Any
    version: int
    params: SamplingParams
    prompt_ids_BxL: np.ndarray
    prompt_mask_BxL: np.ndarray
    prompt_index_B: np.ndarray
    limits_N: np.ndarray
    rng: Any
    engine: dict
    pad: int
    eos: tuple[int, ...]
    stop_tables: tuple
    responses_NxR: np.ndarray
    log_probs_NxR: np.ndarray
    versions_NxR: np.ndarray
    lengths_N: np.ndarray
    done_N: np.ndarray
    segments: int = 0

    @property
    def done(self) -> bool:
        """Every row has finished."""
        return bool(self.done_N.all())

    def output(self) -> PartialOutput:
        """The rows as they stand (finished or not)."""
        R = self.params.max_new_tokens
        valid_NxR = np.arange(R)[None, :] < self.lengths_N[:, None]
        last_N = np.where(
            self.lengths_N > 0,
            self.versions_NxR[np.arange(len(self.lengths_N)), np.maximum(self.lengths_N - 1, 0)],
            self.version,
        )
        return PartialOutput(
            responses=np.where(valid_NxR, self.responses_NxR, self.pad).astype(np.int32),
            response_mask=valid_NxR.astype(np.int32),
            log_probs=np.where(valid_NxR, self.log_probs_NxR, 0.0).astype(np.float32),
            lengths=self.lengths_N.copy(),
            token_versions=np.where(valid_NxR, self.versions_NxR, last_N[:, None]).astype(np.int32),
        )


def start_partial(
    graphdef,
    weights,
    prompt_ids,
    prompt_mask,
    params: SamplingParams,
    *,
    version: int = 0,
    rng: jax.Array | None = None,
    prompt_index=None,
    max_new_tokens=None,
    mesh=None,
    rules=GENERATE_RULES,
    options: EngineOptions = EngineOptions(),
    tokenizer: Any = None,
    stop_strings: StopStrings | None = None,
) -> PartialRollout:
    """A partial rollout of ``params.n`` responses per left-padded prompt [B, L], nothing
    sampled yet, to run under ``weights`` (``nnx.split`` of a `CausalLM`: ``graphdef`` and its
    state, on ``mesh`` with ``rules``) of policy ``version``. The keywords are
    `engine.generate_from_state`'s (``rng``, ``prompt_index``, ``max_new_tokens`` (an int, [B]
    or [B * n]), ``options``, ``tokenizer`` / ``stop_strings`` for ``params.stop``)."""
    cfg = _config_of(graphdef, weights)
    stop_strings = _stop_strings(params, tokenizer, stop_strings, cfg.vocab_size, "start_partial")
    ids, mask = _left_padded_on_host(prompt_ids, prompt_mask)
    B, N, R = len(ids), len(ids) * params.n, params.max_new_tokens
    if rng is None:
        rng = jax.random.key(params.seed)
    elif not jax.numpy.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    return PartialRollout(
        graphdef=graphdef,
        weights=weights,
        version=int(version),
        params=params,
        prompt_ids_BxL=ids,
        prompt_mask_BxL=mask,
        prompt_index_B=_prompt_index(prompt_index, B, params.n),
        limits_N=_row_limits(params, max_new_tokens, B),
        rng=rng,
        engine=dict(mesh=mesh, rules=rules, options=options, stop_strings=stop_strings),
        pad=int(params.pad_token_id if params.pad_token_id is not None else (cfg.pad_token_id or 0)),
        eos=_eos_ids(params, cfg),
        stop_tables=_stop_tables(params, stop_strings, cfg.vocab_size),
        responses_NxR=np.zeros((N, R), np.int32),
        log_probs_NxR=np.zeros((N, R), np.float32),
        versions_NxR=np.zeros((N, R), np.int32),
        lengths_N=np.zeros(N, np.int32),
        done_N=np.zeros(N, bool),
    )


def swap_weights(p: PartialRollout, weights, version: int, *, graphdef=None, **engine) -> PartialRollout:
    """The rollout to go on under ``weights`` of policy ``version`` (>= the current one): its
    tokens so far keep theirs; ``graphdef`` (None: the same) and ``mesh`` / ``rules`` /
    ``options`` (``engine``; unnamed: the same) say where the new weights live. Nothing runs
    (no KV of the old weights is kept: the next segment re-prefills)."""
    if int(version) < p.version:
        raise ValueError(f"policy versions only grow: the rollout is at version {p.version}, got {version}")
    unknown = set(engine) - {"mesh", "rules", "options"}
    if unknown:
        raise TypeError(f"swap_weights takes mesh, rules and options, got {sorted(unknown)}")
    return dataclasses.replace(
        p,
        graphdef=p.graphdef if graphdef is None else graphdef,
        weights=weights,
        version=int(version),
        engine=dict(p.engine, **engine),
    )


def run_partial(
    p: PartialRollout, *, max_steps: int | None = None, until: Callable[[], bool] | None = None
) -> PartialRollout:
    """Sample the unfinished rows under the rollout's weights, in segments of at most
    ``max_steps`` tokens per row (None: to their ends). Without ``until``: one segment. With
    it: segments until every row has finished or ``until()`` (asked before each segment)
    returns true, e.g. when new weights have arrived. The new tokens record the rollout's
    version."""
    if p.weights is None:
        raise ValueError("the partial rollout holds no weights: swap_weights(p, weights, version) first")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps must be >= 1 (or None: to the end), got {max_steps}")
    while not p.done:
        if until is not None and until():
            break
        p = _segment(p, max_steps)
        if until is None:
            break
    return p


def resume_partial(p: PartialRollout, weights, version: int, **run) -> PartialRollout:
    """`run_partial` (with ``run``'s ``max_steps`` / ``until``) under new ``weights`` of policy
    ``version`` (`swap_weights`, same graph and mesh)."""
    return run_partial(swap_weights(p, weights, version), **run)


def _segment(p: PartialRollout, max_steps: int | None) -> PartialRollout:
    """One engine call over the unfinished rows: each samples until its limit, an EOS id, a stop
    string, or ``max_steps`` more tokens."""
    n = p.params.n
    rows_U = np.flatnonzero(~p.done_N)
    generated_U = p.lengths_N[rows_U]
    limits_U = p.limits_N[rows_U]
    if max_steps is not None:
        limits_U = np.minimum(limits_U, generated_U + max_steps)
    call = dict(rng=p.rng, max_new_tokens=limits_U, **p.engine)
    if not p.lengths_N.any():  # a fresh rollout: the engine's ordinary call, prompt pages shared by the n samples
        out = generate_from_state(
            p.graphdef, p.weights, p.prompt_ids_BxL, p.prompt_mask_BxL, p.params, prompt_index=p.prompt_index_B, **call
        )
    else:  # each row as a prompt of its own (n = 1): prompt + its tokens so far, re-prefilled
        ids, mask = _continued(p, rows_U)
        index_U = p.prompt_index_B[rows_U // n] * n + rows_U % n
        one = dataclasses.replace(p.params, n=1)
        out = generate_from_state(
            p.graphdef, p.weights, ids, mask, one, prompt_index=index_U, generated=generated_U, **call
        )
    return _merged(p, rows_U, generated_U, limits_U, out)


def _continued(p: PartialRollout, rows_U: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's prompt followed by its tokens so far, left-padded [U, L + longest]."""
    n, L = p.params.n, p.prompt_ids_BxL.shape[1]
    width = L + int(p.lengths_N[rows_U].max())
    ids = np.full((len(rows_U), width), p.pad, np.int32)
    mask = np.zeros((len(rows_U), width), np.int32)
    for u, r in enumerate(rows_U):
        prompt = p.prompt_ids_BxL[r // n][p.prompt_mask_BxL[r // n].astype(bool)]
        seq = np.concatenate([prompt, p.responses_NxR[r, : p.lengths_N[r]]])
        ids[u, width - len(seq) :], mask[u, width - len(seq) :] = seq, 1
    return ids, mask


def _merged(p: PartialRollout, rows_U, generated_U, limits_U, out) -> PartialRollout:
    """The segment's tokens (columns [generated, length) of each row) into the state, under the
    rollout's version; a row has finished at its limit, or when it stopped before the segment's
    limit or on it with an EOS id or a stop string."""
    lengths_U = np.asarray(out.lengths)
    cols = np.arange(p.params.max_new_tokens)[None, :]
    new_UxR = (cols >= generated_U[:, None]) & (cols < lengths_U[:, None])
    responses, log_probs, versions = p.responses_NxR.copy(), p.log_probs_NxR.copy(), p.versions_NxR.copy()
    responses[rows_U] = np.where(new_UxR, np.asarray(out.responses), responses[rows_U])
    log_probs[rows_U] = np.where(new_UxR, np.asarray(out.log_probs), log_probs[rows_U])
    versions[rows_U] = np.where(new_UxR, p.version, versions[rows_U])
    lengths = p.lengths_N.copy()
    lengths[rows_U] = lengths_U
    done = p.done_N.copy()
    for u, r in enumerate(rows_U):
        done[r] = (
            lengths_U[u] >= p.limits_N[r] or lengths_U[u] < limits_U[u] or _stopped(p, responses[r, : lengths_U[u]])
        )
    return dataclasses.replace(
        p,
        responses_NxR=responses,
        log_probs_NxR=log_probs,
        versions_NxR=versions,
        lengths_N=lengths,
        done_N=done,
        segments=p.segments + 1,
    )


def _stopped(p: PartialRollout, tokens: np.ndarray) -> bool:
    """The row's last token is an EOS id or completes a stop string."""
    if len(tokens) and int(tokens[-1]) in p.eos:
        return True
    return bool(p.params.stop) and scan_tokens(tokens, p.stop_tables)[1]


__all__ = ["PartialOutput", "PartialRollout", "resume_partial", "run_partial", "start_partial", "swap_weights"]
