"""Model turns of multi-turn conversations over the rollout engine: the one turn sampler of the
actor's multi-turn rollouts (`jaxflow.workers.multi_turn`) and of the agent loop
(`jaxflow.agents.engine_turns`).

`EngineTurns` is called with the conversations still going (token ids: each whole conversation
so far), each one's token budget and each one's index, and returns per conversation the turn's
new tokens and their log-probs. It samples each call (turn ``k`` = the ``k``-th call, from 0)
in one engine call:

- ``reuse_kv`` (the default): through a `session.KVSession` on the generation weights' mesh,
  which keeps each conversation's KV pages between turns and runs the model only on the tokens
  appended since its last turn (``stats[k]["prefill_tokens"][j]``: the last sampled token and
  the tool or observation turn, not the whole conversation). The session is sized at the first
  call (its conversations, each up to its length plus its budget: the budget is what is left
  of the response, so later turns fit) and made again when a call does not fit it.
- otherwise: `engine.generate_from_state` on the left-padded conversations (every turn
  prefills every conversation from its first token).

Keys. Conversation ``i`` (the caller's index) draws its turn ``k``'s token ``t`` from
``fold_in(fold_in(key_k, row_ids[i]), t)`` (`batcher.row_keys`) with ``key_0 = rng`` and
``key_k = fold_in(rng, k)`` after: turn 0 is the single-turn rollout's draw for row
``row_ids[i]``, later turns draw fresh keys, and what a conversation samples does not depend
on which others are still going. Both paths draw the same keys, so they sample the same tokens
(bit for bit for a ``batch_invariant`` model; else as far as the model's projections round
alike in decode and prefill shapes: `session`'s Numerics).

Meshes. With a ``mesh`` the session runs as one replica spanning it (`session.KVSession`): the
pools split over kv heads like the weights (tp), replicated over the data-parallel axes, every
conversation on every data-parallel group (correct, but those groups repeat one another's work:
a conversation's turns are not split across replicas, and the session's pool holds every
conversation at its longest, on every device of a group); `generate_from_state` splits the
conversations over the replicas but prefills every turn again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxflow.mesh import GENERATE_RULES
from jaxflow.sampling.engine import (
    EngineOptions,
    GenerateOutput,
    SamplingParams,
    _config_of,
    generate_from_state,
    left_pad,
)
from jaxflow.sampling.session import KVSession
from jaxflow.sampling.stops import StopStrings


class EngineTurns:
    """The turn sampler (module docstring) for ``graphdef`` / ``state`` (``nnx.split`` of a
    `CausalLM`, ``state`` on ``mesh`` in any layout) with ``params`` (``n = 1``;
    ``max_new_tokens``: the most one turn samples, each conversation's budget cuts it further;
    a turn ends at an EOS id or a stop string). ``rng``: ``key_0`` (default: the key of
    ``params.seed``); ``row_ids``: each conversation index's row id (default: the index);
    ``options`` / ``tokenizer`` / ``stop_strings`` / ``rules``: as for
    `engine.generate_from_state`. ``stats``: what the engine reported for each call
    (`GenerateOutput.stats`); ``session``: the `KVSession` between the calls (None after
    ``release``)."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        state: nnx.State,
        params: SamplingParams,
        *,
        reuse_kv: bool = True,
        mesh: Mesh | None = None,
        rules=GENERATE_RULES,
        options: EngineOptions = EngineOptions(),
        tokenizer: Any = None,
        stop_strings: StopStrings | None = None,
        rng: jax.Array | None = None,
        row_ids: Sequence[int] | None = None,
    ):
        if params.n != 1:
            raise ValueError(f"a turn samples one row per conversation (n = 1), got n={params.n}")
        if params.stop and stop_strings is None:
            if tokenizer is None:
                raise ValueError("SamplingParams.stop needs a tokenizer (EngineTurns(..., tokenizer=...))")
            stop_strings = StopStrings.build(params.stop, tokenizer, _config_of(graphdef, state).vocab_size)
        self.graphdef, self.state, self.params, self.reuse_kv = graphdef, state, params, reuse_kv
        self.engine = dict(mesh=mesh, rules=tuple(rules), options=options, stop_strings=stop_strings)
        self.rng = jax.random.key(params.seed) if rng is None else rng
        self.row_ids = None if row_ids is None else np.asarray(row_ids, np.int64)
        self.session: KVSession | None = None
        self.stats: list[dict[str, Any]] = []

    def __call__(
        self, conversations: list[list[int]], budgets: list[int], rows: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        turn = len(self.stats)
        limits = np.minimum(np.asarray(budgets), self.params.max_new_tokens).astype(np.int32)
        index = np.asarray(rows, np.int64) if self.row_ids is None else self.row_ids[np.asarray(rows)]
        call = dict(
            rng=jax.random.fold_in(self.rng, turn) if turn else self.rng,
            max_new_tokens=limits,
            prompt_index=index.astype(np.int32),
        )
        if self.reuse_kv:
            out = self._session(conversations, budgets).generate(conversations, **call)
        else:
            ids, mask = left_pad(conversations)
            out = generate_from_state(self.graphdef, self.state, ids, mask, self.params, **call, **self.engine)
        self.stats.append(out.stats)
        return _turns(out, len(conversations))

    def _session(self, conversations: list[list[int]], budgets: list[int]) -> KVSession:
        """The session, made again (sized for this call) when the call does not fit it."""
        need = max(len(c) + b for c, b in zip(conversations, budgets))  # budgets >= the limits
        s = self.session
        if s is None or len(conversations) > s.conversations or need > s.max_len:
            self.release()
            s = self.session = KVSession(
                self.graphdef, self.state, self.params, conversations=len(conversations), max_len=need, **self.engine
            )
        return s

    def release(self) -> None:
        """Give back every conversation's pages and the page pool."""
        self.session = None


def _turns(out: GenerateOutput, B: int) -> list[tuple[list[int], list[float]]]:
    """Each conversation's new tokens and their log-probs (its first ``lengths[b]`` columns)."""
    lengths = np.asarray(out.lengths)
    responses, log_probs = np.asarray(out.responses), np.asarray(out.log_probs)
    return [(responses[b, : lengths[b]].tolist(), log_probs[b, : lengths[b]].tolist()) for b in range(B)]


__all__ = ["EngineTurns"]
