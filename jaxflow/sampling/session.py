"""Conversations whose KV pages stay in the engine between calls (multi-turn rollouts).

A `KVSession` owns one page pool (`paged`) for up to ``conversations`` conversations of at
most ``max_len`` tokens each. A call (`KVSession.generate`) samples one turn of each
conversation it is given (token ids: the whole conversation so far) through the engine's
rollout program in its session mode (`batcher.Static.keep_pages`): a conversation that
continues one of the previous call's resumes from that call's pages and runs the model only on
the tokens appended since, then decodes; its pages are kept for the next call.

Which cache a conversation continues. The previous call's conversations are kept in their
order, each with the tokens whose keys and values its pages hold: the conversation itself and
every sampled token but the last (never fed back, so never written). A call walks them in
order and gives conversation j the first one not yet taken that is a prefix of it (so the
caller's order of conversations, e.g. the agent loop's, finds each one's own cache in one
pass; equal prefixes hold equal keys and values, so either serves). A conversation that finds
none is prefilled from its first token. Every cache not continued is dropped, its pages freed:
a conversation that ended (or was left out) gives its pages back at the next call, and
`KVSession.release` gives back all of them.

What a call prefills. Conversation j with c_j tokens cached and p_j tokens now writes positions
[c_j, p_j - 1) in prefill chunks and feeds token p_j - 1 to its first decode step, so
``stats["prefill_tokens"][j] == p_j - c_j``: after a turn and a tool turn of u tokens, 1 + u
(the turn's last sampled token and the tool turn), not p_j.

Pages. The pool holds every conversation at its longest: ``1 + conversations * ceil(max_len /
page_size)`` pages plus the priority row's reserve (`batcher.reserve_pages`), so no row ever
waits for a page and no call can run short (a call whose conversation and limit pass
``max_len`` is refused). That is the rollout's KV at its longest, more than `engine.generate`'s
budgeted pool: the price of keeping every conversation between its turns. Page tables are ``ceil(max_len / page_size)`` pages wide whatever the
call, so the program's shapes follow only the conversations (bucketed to a power of two) and
the new tokens (a power of two >= 16): a multi-turn rollout compiles once per (batch bucket,
new-token bucket) (the first call, whose new tokens are whole prompts, may have its own).

Numerics. A resumed conversation's cached keys and values were written by decode steps (one
token per slot), where a re-prefill writes them in prefill chunks: a turn samples what a
re-prefill of the whole conversation samples (same keys per row and token, `batcher.row_keys`)
as far as the model gives a token's projections the same floats in either shape. A
``batch_invariant`` model does (its sums run in index order: a decode step is a forward bit
for bit); otherwise XLA's products may round a row differently by the matrices' shapes, a few
float32 ulps in the log-probs (tests/test_agent_tools.py: the same tokens, log-probs within 8
ulps).

Meshes. With a ``mesh`` (the weights on it in any layout, e.g. the actor's generation
weights) a call runs the engine's program as one replica spanning the mesh, under the
replica's rules (`engine._replica_rules`): the pools split over kv heads as the rules split
the model's attention (tp), replicated over the ``batch`` (data-parallel) axes, every
conversation on every data-parallel group. What a conversation samples is what
`engine.generate_from_state` samples on that mesh (the same keys; the vocabulary split over
tp the same way).

Limits: one replica (the conversations are not split over the mesh's data-parallel groups:
each group runs all of them, and holds the whole pool), ``n = 1`` (one row per
conversation), no debug outputs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxflow.mesh import GENERATE_RULES, sharding_rules
from jaxflow.sampling.batcher import Resume, _pool_constraint, reserve_pages
from jaxflow.sampling.engine import (
    PROMPT_BUCKET_MIN,
    EngineOptions,
    GenerateOutput,
    SamplingParams,
    _config_of,
    _eos_ids,
    _generate_program,
    _prompt_index,
    _replica_rules,
    _row_limits,
    _stop_tables,
    bucket_size,
    engine_shape,
    engine_stats,
    static_settings,
)
from jaxflow.sampling.paged import TRASH_PAGE, PagedKVCache, PoolLayout
from jaxflow.sampling.stops import StopStrings


@dataclasses.dataclass(frozen=True)
class _Cached:
    """One conversation's cache: ``tokens`` whose keys and values sit in ``pages`` (token t in
    page ``pages[t // page_size]``)."""

    tokens: np.ndarray
    pages: np.ndarray


def _resumed_rollout(pools, held, *args, graphdef, static, mesh, rules):
    """`engine._generate_program` of a session's call: ``args`` as there (one replica),
    ``held`` the rest of its `batcher.Resume` (start_B, held_BxMp, free_F, top)."""
    return _generate_program(*args, Resume(pools, *held), graphdef=graphdef, static=static, mesh=mesh, rules=rules)


@functools.lru_cache(maxsize=32)
def _session_program(graphdef, static, mesh, rules):
    """The rollout program of a session's call, the page pools donated (updated in place)."""
    fn = functools.partial(_resumed_rollout, graphdef=graphdef, static=static, mesh=mesh, rules=rules)
    return jax.jit(fn, donate_argnums=0)


def _zero_pools(cfg, num_pages: int, page_size: int, kernel: str, mesh, rules):
    """A session's zeroed pools (`PagedKVCache.zeros`); with a ``mesh``, made in place on it
    as the program pins them (`batcher`: the layout's logical axes under the replica's rules,
    e.g. split over kv heads with tp, replicated over the data-parallel axes)."""
    if mesh is None:
        return PagedKVCache.zeros(cfg, num_pages, page_size, PoolLayout(kernel))
    return _placed_zeros(cfg, num_pages, page_size, kernel, mesh, rules)()


@functools.lru_cache(maxsize=8)
def _placed_zeros(cfg, num_pages: int, page_size: int, kernel: str, mesh, rules):
    """`_zero_pools`' program on a mesh (one per pool shape: a session per rollout reuses it)."""
    layout = PoolLayout(kernel)

    def zeros():
        with sharding_rules(_replica_rules(rules), mesh):
            return _pool_constraint(layout)(PagedKVCache.zeros(cfg, num_pages, page_size, layout))

    return jax.jit(zeros)


class KVSession:
    """A page pool and the conversations cached in it (see the module docstring).

    ``graphdef`` / ``state``: ``nnx.split`` of a `CausalLM` (``state`` in any layout on
    ``mesh``, e.g. the actor's generation weights; the pools live on that mesh, ``rules``
    as for `engine.generate_from_state`); ``params``: how every call samples (``n`` must be 1;
    ``max_new_tokens`` bounds each call's turn); ``conversations`` / ``max_len``: the most
    conversations one call may hold and the most tokens one may reach (prompt, turns and the
    turn being sampled); ``options``: as for `engine.generate` (slots, page size, attention,
    steps per sync); ``tokenizer`` / ``stop_strings``: for ``params.stop``."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        state: nnx.State,
        params: SamplingParams,
        *,
        conversations: int,
        max_len: int,
        options: EngineOptions = EngineOptions(),
        tokenizer: Any = None,
        stop_strings: StopStrings | None = None,
        mesh: Mesh | None = None,
        rules=GENERATE_RULES,
    ):
        if params.n != 1:
            raise ValueError(f"a KVSession samples one row per conversation (n = 1), got n={params.n}")
        if options.return_logits or options.return_cache:
            raise ValueError("a KVSession has no debug outputs (return_logits, return_cache)")
        if conversations < 1 or max_len < 2:
            raise ValueError(f"conversations must be >= 1 and max_len >= 2, got {conversations}, {max_len}")
        self.graphdef, self.state, self.mesh = graphdef, state, mesh
        self.cfg = _config_of(graphdef, state)
        self.params, self.options, self.rules = params, options, tuple(rules)
        self.conversations, self.max_len = conversations, max_len
        if params.stop and stop_strings is None:
            if tokenizer is None:
                raise ValueError("SamplingParams.stop needs a tokenizer (KVSession(..., tokenizer=...))")
            stop_strings = StopStrings.build(params.stop, tokenizer, self.cfg.vocab_size)
        self.stop_tables = _stop_tables(params, stop_strings, self.cfg.vocab_size)
        self.eos = _eos_ids(params, self.cfg)
        self.pad = params.pad_token_id if params.pad_token_id is not None else (self.cfg.pad_token_id or 0)
        T = options.page_size
        self.table_pages = -(-max_len // T)  # Mp: the pages of one conversation at its longest
        self.response_len = bucket_size(params.max_new_tokens, minimum=16)
        self.num_pages = 1 + conversations * self.table_pages + reserve_pages(self.response_len, T)
        self.cached: list[_Cached] = []  # the previous call's conversations, in its order
        self.pools = None  # allocated at the first call (in the layout of its attention kernel)

    @property
    def pages_held(self) -> int:
        """Pages the cached conversations hold (the trash page not counted)."""
        return sum(len(c.pages) for c in self.cached)

    def release(self) -> None:
        """Drop every conversation's cache: all pages free (the pool itself is kept)."""
        self.cached = []

    def generate(
        self, conversations: Sequence[Sequence[int]], max_new_tokens=None, *, rng=None, prompt_index=None
    ) -> GenerateOutput:
        """One turn of each conversation (token ids: the whole conversation so far), as
        `engine.generate` samples it from the left-padded conversations with the same
        ``max_new_tokens`` (an int, or one limit per conversation), ``rng`` and
        ``prompt_index``, without running the model again on the cached prefixes (module
        docstring). Each conversation and its limit must fit in ``max_len``."""
        convs = [np.asarray(c, np.int32).reshape(-1) for c in conversations]
        limits = _row_limits(self.params, max_new_tokens, len(convs))
        self._check(convs, limits)
        resumed = self._match(convs)
        static, args = self._arguments(convs, resumed, limits, rng, prompt_index)
        try:
            out = _session_program(self.graphdef, static, self.mesh, self.rules)(*args)
        except Exception:
            self.pools = None  # donated to the failed call
            raise
        self.pools = out.pop("pools")
        B, cols = len(convs), self.params.max_new_tokens
        lengths, responses = np.asarray(out["lengths"][:B]), np.asarray(out["responses"][:B])
        tables = np.asarray(out["tables"][:B])
        self.cached = [self._cache_of(c, responses[b, : lengths[b] - 1], tables[b]) for b, c in enumerate(convs)]
        stats = engine_stats(static, 1, self.num_pages) | dict(
            peak_pages=out["peak_pages"],
            waits=out["waits"],
            prefill_tokens=out["prefill_tokens"][:B],
            pages_held=self.pages_held,
        )
        return GenerateOutput(
            responses=out["responses"][:B, :cols],
            response_mask=out["response_mask"][:B, :cols],
            log_probs=out["log_probs"][:B, :cols],
            lengths=out["lengths"][:B],
            num_steps=out["num_steps"],
            stats=stats,
        )

    def _check(self, convs: list[np.ndarray], limits_B: np.ndarray) -> None:
        if not 1 <= len(convs) <= self.conversations:
            raise ValueError(f"a call holds 1 to {self.conversations} conversations, got {len(convs)}")
        lengths_B = np.asarray([len(c) for c in convs])
        if lengths_B.min() < 1:
            raise ValueError("every conversation needs at least one token")
        too_long = np.flatnonzero(lengths_B + limits_B > self.max_len)
        if too_long.size:
            b = int(too_long[0])
            raise ValueError(
                f"conversation {b} ({lengths_B[b]} tokens and a limit of {limits_B[b]}) passes the session's "
                f"max_len={self.max_len}"
            )

    def _match(self, convs: list[np.ndarray]) -> list[_Cached | None]:
        """Each conversation's cache: the first of the previous call's not yet taken (after the
        last one taken) that is a prefix of it, or None. Every other cache is dropped."""
        found, at = [], 0
        for conv in convs:
            hit = None
            for k in range(at, len(self.cached)):
                c = self.cached[k]
                if len(c.tokens) < len(conv) and np.array_equal(conv[: len(c.tokens)], c.tokens):
                    hit, at = c, k + 1
                    break
            found.append(hit)
        self.cached = []
        return found

    def _arguments(self, convs, resumed, limits_B, rng, prompt_index) -> tuple[Any, tuple]:
        """The call's `batcher.Static` and program arguments: the new tokens right-padded to a
        power of two >= 16 columns, the conversations to a power of two rows (padding rows:
        one token, never admitted, no pages), each one's cached length and pages, the free
        stack (every page no resumed conversation holds)."""
        B, T, Mp = len(convs), self.options.page_size, self.table_pages
        Bb = bucket_size(B)
        start_B = np.zeros(Bb, np.int32)
        start_B[:B] = [0 if c is None else len(c.tokens) for c in resumed]
        new = [conv[s:] for conv, s in zip(convs, start_B)]
        Pn = bucket_size(max(len(x) for x in new), minimum=PROMPT_BUCKET_MIN)
        ids_BxP = np.full((Bb, Pn), self.pad, np.int32)
        held_BxMp = np.full((Bb, Mp), TRASH_PAGE, np.int32)
        plen_B, limit_B = np.ones(Bb, np.int32), np.ones(Bb, np.int32)
        for b, (conv, x, c) in enumerate(zip(convs, new, resumed)):
            ids_BxP[b, : len(x)], plen_B[b], limit_B[b] = x, len(conv), limits_B[b]
            if c is not None:
                held_BxMp[b, : len(c.pages)] = c.pages
        index = _prompt_index(prompt_index, B, 1)
        index_B = np.concatenate([index, int(index.max()) + 1 + np.arange(Bb - B)]).astype(np.int32)
        free = np.setdiff1d(np.arange(1, self.num_pages, dtype=np.int32), held_BxMp[held_BxMp != TRASH_PAGE])
        free_F = np.zeros(self.num_pages - 1, np.int32)
        free_F[: len(free)] = free
        shape = engine_shape(
            self.cfg, Bb, Pn, self.params.max_new_tokens, slots=self.options.slots, page_size=T, kv_tokens=None
        )
        static = static_settings(
            self.cfg, self.params, shape, self.options, self.eos, int(self.pad), self.mesh, self.rules
        )
        static = dataclasses.replace(static, keep_pages=True, num_pages=self.num_pages)
        if self.pools is None:
            self.pools = _zero_pools(self.cfg, self.num_pages, T, static.kernel, self.mesh, self.rules)
        held = (start_B, held_BxMp, free_F, np.int32(len(free)))
        if rng is None:
            rng = jax.random.key(self.params.seed)
        elif not jax.numpy.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)
        zeros_B = np.zeros(Bb, np.int32)  # nothing sampled before (`engine._Rows`)
        rows = [x[None] for x in (ids_BxP, plen_B, limit_B, zeros_B, zeros_B, index_B)]  # one replica
        temperature, top_p = np.float32(self.params.temperature), np.float32(self.params.top_p)
        num_rows = np.asarray([B], np.int32)
        return static, (self.pools, held, self.state, *rows, num_rows, rng, temperature, top_p, self.stop_tables)

    def _cache_of(self, conv: np.ndarray, fed_back: np.ndarray, table_M: np.ndarray) -> _Cached:
        """A conversation's cache after a call: its tokens and every sampled token but the last
        (``fed_back``), in the first ceil(length / page_size) pages of its table."""
        tokens = np.concatenate([conv, fed_back.astype(np.int32)])
        pages = -(-len(tokens) // self.options.page_size)
        if (table_M[:pages] == TRASH_PAGE).any() or (table_M[pages:] != TRASH_PAGE).any():
            raise RuntimeError(f"the engine's page table {table_M.tolist()} does not hold {len(tokens)} tokens")
        return _Cached(tokens, table_M[:pages].copy())


__all__ = ["KVSession"]
