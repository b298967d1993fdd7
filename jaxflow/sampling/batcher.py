"""The rollout program of one generation replica: continuous batching over a fixed number of
decode slots with chunked prefill and prompt pages shared by the n samples, all inside one
compiled program (no host round trip, no recompilation as sequences come and go).

Rows. Row r is sample ``j = r % n`` of prompt ``b = r // n`` (verl's interleaved repeat). A
row's randomness is ``fold_in(fold_in(key, prompt id * n + j), token index)`` (`row_keys`),
the prompt id being the caller's (``prompt_index_B``: e.g. the prompt's place in the training
step's stream of prompts), so what a row samples does not depend on its slot, on when it was
admitted or had to wait, on the other rows, on the replica it runs on, on the size of the page
pool, or on the mesh.

Pages (see `paged`). Page 0 is the trash page; every other page starts on a free stack.
Prompts are prefilled in groups of ``prefill_rows`` (in chunks of ``prefill_len`` tokens), a
group when a slot is free and every row of the earlier prompts has had one: each prompt takes
Mp = ceil(P / page_size) pages and holds its first p_i - 1 tokens there (the shared prefix)
until its last sample finishes. A row is admitted into a free slot with a page table whose
first ``j0 = (p_i - 1) // page_size`` entries are its prompt's pages (shared by the n
samples) and whose page j0 is a private copy of the prompt's page j0 (the prompt's tail
shares that page with the row's first tokens). The row's first decode input is the prompt's
last token, at position p_i - 1, so the first sampled token comes out of a decode step like
every other token. A row takes a page from the stack when its next position starts a page
and gives its pages back when it finishes; its slot is refilled in the next iteration.

The pool (`pool_pages`) is sized from a token budget, not for the worst case, so a row may
find no free page: it waits (its slot skips the step: nothing written, nothing sampled) until
one comes back. No deadlock: the active row with the lowest row id (the *priority* row) may
always take a page, because nobody else may take the stack below Rp = ceil(R / page_size) + 1
pages (the most one row ever holds privately) and a prefill group needs Rp pages left over.
When the priority row finishes it returns at least what it took below Rp, so the next one
finds Rp pages again; the priority row always decodes, so the rollout always ends.

The loop (`rollout`). Each trip (`iteration`) prefills every group that is due and fits,
each followed by the admission of its rows into free slots (in row order); then it runs
``steps_per_sync`` decode steps (`decode_step`) in a loop of known trip count: admit rows of
prefilled prompts into freed slots, give pages to rows that need one (or make them wait),
run the decoder on one token per slot (idle and waiting slots write to the trash page),
sample, record, retire the rows that hit their ``max_new_tokens``, an EOS id or a stop string
(`stops`). The loop ends when every row has finished. On GPU a ``while_loop`` predicate (and
a ``cond``'s) is read back by the host, which drains the device's queue: the decode steps
inside one trip have none, and a step past the end changes nothing, so ``steps_per_sync``
trades up to ``steps_per_sync - 1`` idle steps for that many fewer round trips. What a row
samples does not depend on it.

A session's call (`Static.keep_pages`, `session.KVSession`: multi-turn conversations, n = 1)
starts from a `Resume` instead of an empty pool: the pools of the session's earlier calls,
each prompt's cached length c_i and the pages that hold slots [0, c_i), and the free stack.
A prompt's group takes only the pages that its tokens [c_i, p_i - 1) start (`group_pages`)
and writes only those positions; its row owns all its prompt's pages (no private copy), and
when it finishes it keeps them (`keep`): its page table is returned for the conversation's
next call, and the pages stay off the free stack.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.mesh import constrain
from jaxflow.sampling.logits_processing import sample_tokens, token_log_probs
from jaxflow.sampling.paged import TRASH_PAGE, PagedKVCache, PoolLayout, dropped, scatter_unique

DEFAULT_RESPONSE_SHARE = 4  # the default pool holds 1 / 4 of every slot's response buffer


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything that shapes the compiled program besides array shapes."""

    greedy: bool
    top_k: int
    use_top_p: bool
    n: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    response_len: int  # R, the response buffer
    slots: int  # decode slots per replica
    page_size: int
    num_pages: int  # the pool of one replica, trash page included (`pool_pages`)
    prefill_rows: int  # prompts per prefill chunk
    prefill_len: int  # tokens per prefill chunk
    return_logits: bool
    return_cache: bool = False
    use_stops: bool = False  # match stop strings (`stops.StopStrings` tables are arguments)
    kernel: str = "jax"  # the attention kernel (`paged.choose_kernel`)
    pages_per_block: int = 8  # KV pages per block of the attention kernel
    steps_per_sync: int = 1  # decode steps per trip of the rollout loop (`iteration`)
    keep_pages: bool = False  # a session's call: resume from `Resume`, keep the rows' pages


def reserve_pages(response_len: int, page_size: int) -> int:
    """Rp: the most pages one row holds privately (its response pages and the private copy
    of its prompt's last page)."""
    return -(-response_len // page_size) + 1


def pool_bounds(
    prompts: int, prompt_len: int, response_len: int, slots: int, prefill_rows: int, page_size: int
) -> tuple[int, int]:
    """(fewest, most) useful pages of one replica's pool, trash page included. Fewest: one
    prefill group's prompts and one row's Rp pages (below that the rollout cannot start).
    Most: the worst case, in which no row ever waits: the prompts that can be alive at once
    (one per slot plus a prefill group), every slot's Rp pages and the priority reserve
    (Rp pages that then always stay free)."""
    Mp, Rp = -(-prompt_len // page_size), reserve_pages(response_len, page_size)
    least = 1 + min(prompts, prefill_rows) * Mp + Rp
    most = 1 + min(prompts, slots + prefill_rows) * Mp + (slots + 1) * Rp
    return least, max(least, most)


def pool_pages(
    prompts: int,
    prompt_len: int,
    response_len: int,
    slots: int,
    prefill_rows: int,
    page_size: int,
    kv_tokens: int | None = None,
) -> int:
    """The pool of one replica, trash page included, for a budget of ``kv_tokens`` cached
    tokens (rounded up to pages; more than the worst case is never allocated; less than
    the fewest pages that can run the rollout is an error). Default (None): the prompts that
    can be alive at once and 1 / `DEFAULT_RESPONSE_SHARE` of every slot's response buffer
    (RL responses are long-tailed: most stop far below the limit; when the pool runs short,
    rows wait, and what they sample does not change)."""
    least, most = pool_bounds(prompts, prompt_len, response_len, slots, prefill_rows, page_size)
    T = page_size
    if kv_tokens is None:
        share = -(-response_len // (T * DEFAULT_RESPONSE_SHARE)) + 1
        want = 1 + min(prompts, slots + prefill_rows) * -(-prompt_len // T) + slots * share
    else:
        want = 1 + -(-kv_tokens // T)
        if want < least:
            raise ValueError(
                f"kv_tokens={kv_tokens} is below the smallest pool of this rollout, "
                f"{(least - 1) * T} tokens (a prefill group of {min(prompts, prefill_rows)} prompts of "
                f"{prompt_len} tokens and one response of {response_len}, in pages of {T})"
            )
    return min(max(want, least), most)


def no_wait_peak_pages(
    prompt_len_B: np.ndarray, lengths_N: np.ndarray, n: int, slots: int, prefill_rows: int, page_size: int
) -> int:
    """Pages in use at the peak of `rollout`'s schedule for one replica whose rows run
    exactly ``lengths_N`` tokens (the first N = len(lengths_N) rows; later prompts of the
    bucket are padding) and never wait (a host model, for rollouts whose rows can only stop
    at their limits): rows take free slots in row order; the prompts of a prefill group
    hold Mp pages each from the first step of the group's first row to the last step of
    their own last row (padding prompts: to the end); a row holds page_index(position) - j0
    + 1 private pages, its position running from p - 1 to p - 2 + length. Trash page
    excluded."""
    T, N, B = page_size, len(lengths_N), len(prompt_len_B)
    plen_N = np.repeat(prompt_len_B[: N // n], n)
    start = np.zeros(N, np.int64)
    free_at = [0] * min(slots, N)  # the step each slot frees up (a heap)
    for r in range(N):
        start[r] = heapq.heappop(free_at)
        heapq.heappush(free_at, int(start[r] + lengths_N[r]))
    end = start + lengths_N  # the first step after the row
    times, deltas = [], []
    for r in range(N):  # +1 at every step a row starts a private page, minus all of them at its end
        first = plen_N[r] - 1
        crossings = np.arange(first // T, (first + lengths_N[r] - 1) // T + 1)
        times += [start[r] + np.maximum(crossings * T - first, 0), [end[r]]]
        deltas += [np.ones(len(crossings), np.int64), [-len(crossings)]]
    Mp = -(-int(prompt_len_B.max()) // T)
    prompt_end = np.full(B, end.max() + 1)
    prompt_end[: N // n] = end.reshape(N // n, n).max(axis=1)
    for g in range(0, N // n, prefill_rows):  # groups that hold a real prompt
        held = np.arange(g, min(g + prefill_rows, B))
        times += [np.full(len(held), start[g * n]), prompt_end[held]]
        deltas += [np.full(len(held), Mp), np.full(len(held), -Mp)]
    t, d = np.concatenate(times), np.concatenate(deltas)
    order = np.lexsort((d, t))  # at one step, what is given back comes first
    return int(np.max(np.cumsum(d[order])))


class Carry(NamedTuple):
    """The rollout loop's state (one replica). ``_S`` per decode slot, ``_B`` per prompt,
    ``_N`` per row; ``pools``: the page pools of every layer (`PagedKVCache.pools`)."""

    pools: Any
    active_S: jax.Array  # the slot holds a row that has not finished
    row_S: jax.Array  # its row id
    pos_S: jax.Array  # position (== cache slot) of its next input token
    tok_S: jax.Array  # its next input token
    gen_S: jax.Array  # tokens it has generated (`Rollout.generated_N` before this call included)
    limit_S: jax.Array  # its max_new_tokens
    first_private_S: jax.Array  # j0: its first page that is not its prompt's
    table_SxM: jax.Array  # its page table
    stop_state_S: jax.Array  # its state in the stop-string automaton
    next_row: jax.Array  # the next row to admit
    prompt_table_BxMp: jax.Array  # each prompt's pages
    prefilled: jax.Array  # prompts prefilled so far
    alive_B: jax.Array  # the prompt's pages are held
    waiting_B: jax.Array  # samples of the prompt not finished yet
    free_F: jax.Array  # the free-page stack (entries [0, top) are free)
    top: jax.Array
    steps: jax.Array  # decode steps in which some slot ran
    peak_pages: jax.Array
    waits: jax.Array  # slot-steps in which an active row waited for a page
    out_tok_NxR: jax.Array
    out_logp_NxR: jax.Array
    lengths_N: jax.Array
    prefill_tokens_B: jax.Array  # prompt tokens the model ran on (prefill chunks and first inputs)
    out_logits_NxRxV: Any = None  # debug output (`Static.return_logits`)
    out_table_NxM: Any = None  # each finished row's page table (`Static.keep_pages`)


class Resume(NamedTuple):
    """What a session's call (`Static.keep_pages`) starts from: the page ``pools`` of its earlier
    calls, each prompt's ``start_B`` tokens already in the cache (slots [0, start)) and the
    pages ``held_BxMp`` that hold them (table entries [0, ceil(start / page_size)), the trash
    page after), and the free-page stack ``free_F`` (entries [0, top) free: every page no
    conversation of the session holds)."""

    pools: Any
    start_B: jax.Array
    held_BxMp: jax.Array
    free_F: jax.Array
    top: jax.Array


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One replica's rollout inputs, closed over by the loop's steps (all traced in one
    program): the model, the right-padded prompts (chunk-padded ``ids_BxCP``: row i's tokens
    from position ``start_B[i]`` on, in columns [0, prompt_len_B[i] - start_B[i])), each row's
    limit, the sampler's settings and the sizes derived from ``static``. ``start_B`` is 0 but
    in a session's call (``resume``, `Static.keep_pages`), where the tokens before it are in the
    pages ``resume.held_BxMp`` already. ``generated_N`` is 0 but in a resumed partial rollout
    (`jaxflow.sampling.partial`, n = 1): the tokens each row sampled before this call, the last
    ``generated_N`` tokens of its prompt; its first token here is its token ``generated_N``
    (its key, output column and count against its limit), its stop-string state
    ``stop_state_N`` after them."""

    model: Any
    static: Static
    pool_layout: PoolLayout
    vocab_shards: int
    prompt_len: int  # P, the prompt bucket (a session's: the tokens its page tables hold)
    ids_BxCP: jax.Array
    prompt_len_B: jax.Array
    start_B: jax.Array
    last_token_B: jax.Array
    limits_N: jax.Array
    generated_N: jax.Array
    stop_state_N: jax.Array
    prompt_index_B: jax.Array
    num_rows: jax.Array
    rng: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    eos_E: jax.Array
    stop_tables: tuple
    resume: Resume | None = None

    @property
    def B(self) -> int:
        return self.prompt_len_B.shape[0]

    @property
    def N(self) -> int:
        return self.B * self.static.n

    @property
    def prompt_pages(self) -> int:  # Mp
        return -(-self.prompt_len // self.static.page_size)

    @property
    def table_pages(self) -> int:  # M (a session's conversations never pass its tables' Mp pages)
        if self.static.keep_pages:
            return self.prompt_pages
        return -(-(self.prompt_len + self.static.response_len) // self.static.page_size)

    @property
    def reserve(self) -> int:  # Rp
        return reserve_pages(self.static.response_len, self.static.page_size)

    @property
    def free_pages(self) -> int:  # F: every page but the trash page
        return self.static.num_pages - 1

    def cache(self, pools, table, positions) -> PagedKVCache:
        return PagedKVCache(
            pools,
            table,
            positions,
            layout=self.pool_layout,
            sliding_window=self.model.cfg.sliding_window,
            pages_per_block=self.static.pages_per_block,
        )


def initial_carry(ro: Rollout) -> Carry:
    """Empty slots, every page on the free stack (a session's call: its pools and the pages no
    conversation holds), outputs at the pad id."""
    st, cfg = ro.static, ro.model.cfg
    S, M, N, R = st.slots, ro.table_pages, ro.N, st.response_len
    zeros_S = jnp.zeros(S, jnp.int32)
    if ro.resume is None:
        pools = PagedKVCache.zeros(cfg, st.num_pages, st.page_size, ro.pool_layout)
        free_F, top = 1 + jnp.arange(ro.free_pages, dtype=jnp.int32), jnp.int32(ro.free_pages)
    else:
        pools, free_F, top = ro.resume.pools, ro.resume.free_F, ro.resume.top
    return Carry(
        pools=_pool_constraint(ro.pool_layout)(pools),
        active_S=jnp.zeros(S, bool),
        row_S=zeros_S,
        pos_S=zeros_S,
        tok_S=zeros_S,
        gen_S=zeros_S,
        limit_S=zeros_S,
        first_private_S=zeros_S,
        table_SxM=jnp.zeros((S, M), jnp.int32),
        stop_state_S=zeros_S,
        next_row=jnp.int32(0),
        prompt_table_BxMp=jnp.zeros((ro.B, ro.prompt_pages), jnp.int32),
        prefilled=jnp.int32(0),
        alive_B=jnp.zeros(ro.B, bool),
        waiting_B=jnp.full(ro.B, st.n, jnp.int32),
        free_F=free_F,
        top=top,
        steps=jnp.int32(0),
        peak_pages=jnp.int32(0),
        waits=jnp.int32(0),
        out_tok_NxR=jnp.full((N, R), st.pad_token_id, jnp.int32),
        out_logp_NxR=jnp.zeros((N, R), jnp.float32),
        lengths_N=jnp.zeros(N, jnp.int32),
        prefill_tokens_B=jnp.zeros(ro.B, jnp.int32),
        out_logits_NxRxV=jnp.zeros((N, R, cfg.vocab_size), jnp.float32) if st.return_logits else None,
        out_table_NxM=jnp.zeros((N, M), jnp.int32) if st.keep_pages else None,
    )


def _ready_rows(ro: Rollout, c: Carry) -> jax.Array:
    """Rows whose prompt is prefilled."""
    return jnp.minimum(c.prefilled * ro.static.n, ro.num_rows)


def prefill_due(ro: Rollout, c: Carry) -> jax.Array:
    """A new prefill group is due once every row of the prefilled prompts has had a slot, a
    slot is free, rows remain, and its pages leave the priority row's reserve."""
    ready = _ready_rows(ro, c)
    fits = c.top - group_pages(ro, c)[1] >= ro.reserve
    return jnp.any(~c.active_S) & (c.next_row >= ready) & (ready < ro.num_rows) & fits


def group_pages(ro: Rollout, c: Carry) -> tuple[jax.Array, jax.Array]:
    """The next group's prompt tables [Gr, Mp] and the pages they take off the free stack: Mp
    each; a session's call (`Resume`) takes only the pages its new tokens start, the prompt
    keeping the pages it holds (entries j with ceil(start / T) <= j < ceil((p - 1) / T) are
    new)."""
    st = ro.static
    Gr, Mp, T = st.prefill_rows, ro.prompt_pages, st.page_size
    if ro.resume is None:
        return jax.lax.dynamic_slice_in_dim(c.free_F, c.top - Gr * Mp, Gr * Mp).reshape(Gr, Mp), Gr * Mp
    start_G = jax.lax.dynamic_slice_in_dim(ro.start_B, c.prefilled, Gr)
    plen_G = jax.lax.dynamic_slice_in_dim(ro.prompt_len_B, c.prefilled, Gr)
    held_GxMp = jax.lax.dynamic_slice_in_dim(ro.resume.held_BxMp, c.prefilled, Gr, axis=0)
    col_Mp = jnp.arange(Mp)[None, :]
    new_GxMp = (col_Mp >= -(-start_G // T)[:, None]) & (col_Mp < -(-(plen_G - 1) // T)[:, None])
    rank_GxMp = (jnp.cumsum(new_GxMp.reshape(-1)) - 1).reshape(Gr, Mp)
    page_GxMp = c.free_F[jnp.clip(c.top - 1 - rank_GxMp, 0, ro.free_pages - 1)]
    return jnp.where(new_GxMp, page_GxMp, held_GxMp), jnp.sum(new_GxMp, dtype=jnp.int32)


def prefill_group(ro: Rollout, c: Carry) -> Carry:
    """The next Gr prompts: their pages (`group_pages`), then their tokens at positions
    [start, p_i - 1) written in chunks of C tokens (counted in ``prefill_tokens_B``)."""
    st = ro.static
    Gr, C, Mp, M = st.prefill_rows, st.prefill_len, ro.prompt_pages, ro.table_pages
    first = c.prefilled
    pages_GxMp, taken = group_pages(ro, c)
    table_GxM = jnp.pad(pages_GxMp, ((0, 0), (0, M - Mp)))
    rows_GxCP = jax.lax.dynamic_slice_in_dim(ro.ids_BxCP, first, Gr, axis=0)
    plen_G = jax.lax.dynamic_slice_in_dim(ro.prompt_len_B, first, Gr)
    start_G = jax.lax.dynamic_slice_in_dim(ro.start_B, first, Gr)
    real_G = (first + jnp.arange(Gr)) * st.n < ro.num_rows  # the caller's prompts, not bucket padding
    pin = _pool_constraint(ro.pool_layout)

    def chunk(i, carry):
        pools, written_G = carry
        tok_GxC = jax.lax.dynamic_slice_in_dim(rows_GxCP, i * C, C, axis=1)
        pos_GxC = start_G[:, None] + i * C + jnp.arange(C, dtype=jnp.int32)[None, :]
        pos_GxC = jnp.where(pos_GxC < plen_G[:, None] - 1, pos_GxC, -1)
        _, out = ro.model.model(tok_GxC, None, pos_GxC, ro.cache(pools, table_GxM, pos_GxC))
        return pin(out.pools), written_G + jnp.sum(pos_GxC >= 0, axis=1, dtype=jnp.int32)

    with jax.named_scope("prefill"):
        written_G = jnp.zeros(Gr, jnp.int32)
        pools, written_G = jax.lax.fori_loop(0, ro.ids_BxCP.shape[1] // C, chunk, (c.pools, written_G))
    return c._replace(
        pools=pools,
        prefilled=first + Gr,
        top=c.top - taken,
        prompt_table_BxMp=jax.lax.dynamic_update_slice_in_dim(c.prompt_table_BxMp, pages_GxMp, first, axis=0),
        alive_B=jax.lax.dynamic_update_slice_in_dim(c.alive_B, jnp.ones(Gr, bool), first, axis=0),
        prefill_tokens_B=jax.lax.dynamic_update_slice_in_dim(
            c.prefill_tokens_B, jnp.where(real_G, written_G, 0), first, axis=0
        ),
    )


def admit(ro: Rollout, c: Carry) -> Carry:
    """Waiting rows of prefilled prompts into free slots, in row order: each starts at its
    prompt's last token with the prompt's first j0 pages shared (a session's row, n = 1, owns
    all its prompt's pages: no private copy)."""
    st = ro.static
    T, n, M, Mp = st.page_size, st.n, ro.table_pages, ro.prompt_pages
    free_slot_S = ~c.active_S
    cand_S = c.next_row + jnp.cumsum(free_slot_S) - 1
    new_S = free_slot_S & (cand_S < _ready_rows(ro, c))
    cand_S = jnp.clip(cand_S, 0, ro.N - 1)
    b_S = cand_S // n
    p_S = ro.prompt_len_B[b_S]
    j0_S = (p_S - 1) // T
    prompt_rows_SxM = jnp.pad(c.prompt_table_BxMp[b_S], ((0, 0), (0, M - Mp)))
    shared_SxM = jnp.where(jnp.arange(M)[None, :] < j0_S[:, None], prompt_rows_SxM, TRASH_PAGE)
    if st.keep_pages:
        shared_SxM, j0_S = prompt_rows_SxM, jnp.zeros_like(j0_S)
    return c._replace(
        active_S=c.active_S | new_S,
        row_S=jnp.where(new_S, cand_S, c.row_S),
        pos_S=jnp.where(new_S, p_S - 1, c.pos_S),
        tok_S=jnp.where(new_S, ro.last_token_B[b_S], c.tok_S),
        gen_S=jnp.where(new_S, ro.generated_N[cand_S], c.gen_S),
        limit_S=jnp.where(new_S, ro.limits_N[cand_S], c.limit_S),
        first_private_S=jnp.where(new_S, j0_S, c.first_private_S),
        table_SxM=jnp.where(new_S[:, None], shared_SxM, c.table_SxM),
        next_row=c.next_row + jnp.sum(new_S),
        stop_state_S=jnp.where(new_S, ro.stop_state_N[cand_S], c.stop_state_S),
    )


def allocate(ro: Rollout, c: Carry) -> tuple[jax.Array, jax.Array, Carry]:
    """A page for every active row whose next position starts one: the priority row (the
    lowest active row id) always, the others while Rp pages stay on the stack. Returns the
    rows that wait, those that got their first page (gen == 0), and the carry."""
    T, F, Rp = ro.static.page_size, ro.free_pages, ro.reserve
    page_idx_S = c.pos_S // T
    cur_S = jnp.take_along_axis(c.table_SxM, page_idx_S[:, None], axis=1)[:, 0]
    need_S = c.active_S & (cur_S == TRASH_PAGE)
    priority_S = c.active_S & (c.row_S == jnp.min(jnp.where(c.active_S, c.row_S, ro.N)))
    others_S = need_S & ~priority_S
    rank_S = jnp.cumsum(others_S) - 1 + jnp.any(need_S & priority_S)  # the priority row takes the first page
    granted_S = (need_S & priority_S) | (others_S & (c.top - 1 - rank_S >= Rp))
    rank_S = jnp.where(priority_S, 0, rank_S)
    page_S = c.free_F[jnp.clip(c.top - 1 - rank_S, 0, F - 1)]
    slots = jnp.arange(ro.static.slots)
    table = scatter_unique(c.table_SxM, (slots, page_idx_S), jnp.where(granted_S, page_S, cur_S))
    first_S = granted_S & (c.gen_S == ro.generated_N[c.row_S])  # its first step in this call
    return need_S & ~granted_S, first_S, c._replace(table_SxM=table, top=c.top - jnp.sum(granted_S))


def copy_prompt_tails(ro: Rollout, c: Carry, first_S: jax.Array) -> Carry:
    """The private copy of page j0 of each row's prompt (its tail tokens) when the row gets
    that page (its first). Unconditional (the other slots' copies are dropped): a ``cond``
    would cost a device-to-host round trip per step on GPU."""
    n, T, Mp, M = ro.static.n, ro.static.page_size, ro.prompt_pages, ro.table_pages
    b_S = c.row_S // n
    j0_S = c.first_private_S
    has_tail_S = first_S & ((ro.prompt_len_B[b_S] - 1) % T != 0)
    src_S = jnp.where(has_tail_S, c.prompt_table_BxMp[b_S, jnp.minimum(j0_S, Mp - 1)], TRASH_PAGE)
    dst_S = c.table_SxM[jnp.arange(ro.static.slots), jnp.minimum(j0_S, M - 1)]
    dst_S = jnp.where(has_tail_S, dst_S, dropped(dst_S.shape, ro.static.num_pages))  # the others write nothing
    index = (slice(None),) * ro.pool_layout.page_axis

    def copy(x):
        return scatter_unique(x, index + (dst_S,), x[index + (src_S,)])

    return c._replace(pools=_pool_constraint(ro.pool_layout)(jax.tree.map(copy, c.pools)))


def sample_step(ro: Rollout, c: Carry, run_S: jax.Array):
    """The decoder on one token per slot (slots not in ``run_S`` write to the trash page),
    then the sampled tokens [S], their log-probs [S], the logits [S, V] and the new pools."""
    st = ro.static
    positions_Sx1 = jnp.where(run_S, c.pos_S, -1)[:, None]
    hidden, kv = ro.model.model(c.tok_S[:, None], None, positions_Sx1, ro.cache(c.pools, c.table_SxM, positions_Sx1))
    with jax.named_scope("lm_head"):
        logits_SxV = ro.model.logits(hidden)[:, 0]
    temperature = jnp.float32(1.0) if st.greedy else ro.temperature
    with jax.named_scope("sample"):  # the scopes name the ops in profiles (experiments/bench_sampling.py)
        keys_S = row_keys(ro.rng, ro.prompt_index_B, st.n, c.row_S, c.gen_S)
        tok_S = sample_tokens(
            keys_S,
            logits_SxV,
            greedy=st.greedy,
            temperature=temperature,
            top_k=st.top_k,
            top_p=ro.top_p,
            use_top_p=st.use_top_p,
            vocab_shards=ro.vocab_shards,
        )
    with jax.named_scope("log_prob"):
        logp_S = token_log_probs(logits_SxV, tok_S, temperature, ro.model.cfg.batch_invariant)
    return tok_S, logp_S, logits_SxV, _pool_constraint(ro.pool_layout)(kv.pools)


def row_keys(rng: jax.Array, prompt_index_B: jax.Array, n: int, row_S: jax.Array, token_S: jax.Array) -> jax.Array:
    """The PRNG key of token ``token_S`` of each row ``row_S`` (sample ``j = row % n`` of prompt
    ``row // n``): ``fold_in(fold_in(rng, prompt_index_B[row // n] * n + j), token)``. The
    sample's id ``prompt id * n + j`` is the row a caller would get by repeating each prompt
    ``n`` times with ``n = 1``, so sharing a prompt's pages between its samples changes no draw."""

    def key(row, token):
        sample = prompt_index_B[row // n] * n + row % n
        return jax.random.fold_in(jax.random.fold_in(rng, sample), token)

    return jax.vmap(key)(row_S, token_S)


def record(ro: Rollout, c: Carry, run_S, wait_S, tok_S, logp_S, logits_SxV, pools) -> tuple[jax.Array, Carry]:
    """This step's tokens into the outputs and the slots advanced; returns the rows that
    finished (their limit, an EOS id or a stop string)."""
    N = ro.N
    row_w_S = jnp.where(run_S, c.row_S, dropped(run_S.shape, N))  # idle and waiting slots write nowhere
    gen_S = c.gen_S + run_S
    stop_S = jnp.any(tok_S[:, None] == ro.eos_E[None, :], axis=-1)
    stop_state_S = c.stop_state_S
    if ro.static.use_stops:
        token_class_V, next_state_SxC, hit_SxC = ro.stop_tables
        cls_S = token_class_V[tok_S]
        stop_S |= hit_SxC[stop_state_S, cls_S]
        stop_state_S = jnp.where(run_S, next_state_SxC[stop_state_S, cls_S], stop_state_S)
    done_S = run_S & ((gen_S >= c.limit_S) | stop_S)
    logits = c.out_logits_NxRxV
    if logits is not None:
        logits = scatter_unique(logits, (row_w_S, c.gen_S), logits_SxV)
    return done_S, c._replace(
        pools=pools,
        tok_S=jnp.where(run_S, tok_S, c.tok_S),
        pos_S=c.pos_S + run_S,
        gen_S=gen_S,
        stop_state_S=stop_state_S,
        steps=c.steps + jnp.any(run_S),
        waits=c.waits + jnp.sum(wait_S),
        out_tok_NxR=scatter_unique(c.out_tok_NxR, (row_w_S, c.gen_S), tok_S),
        out_logp_NxR=scatter_unique(c.out_logp_NxR, (row_w_S, c.gen_S), logp_S),
        lengths_N=scatter_unique(c.lengths_N, (jnp.where(done_S, c.row_S, dropped(done_S.shape, N)),), gen_S),
        peak_pages=jnp.maximum(c.peak_pages, ro.free_pages - c.top),
        out_logits_NxRxV=logits,
    )


def retire(ro: Rollout, c: Carry, done_S: jax.Array) -> Carry:
    """Finished rows free their slots; their private pages go back on the free stack, and so
    do the pages of a prompt whose last sample finished."""
    n, B, M, Mp, F = ro.static.n, ro.B, ro.table_pages, ro.prompt_pages, ro.free_pages
    own_SxM = done_S[:, None] & (jnp.arange(M)[None, :] >= c.first_private_S[:, None]) & (c.table_SxM != TRASH_PAGE)
    waiting_B = c.waiting_B.at[jnp.where(done_S, c.row_S // n, B)].add(-1, mode="drop")
    released_B = c.alive_B & (waiting_B == 0)
    pages = jnp.concatenate([c.table_SxM.reshape(-1), c.prompt_table_BxMp.reshape(-1)])
    give_back = jnp.concatenate([own_SxM.reshape(-1), jnp.repeat(released_B, Mp)])
    at = jnp.where(give_back, c.top + jnp.cumsum(give_back) - 1, dropped(give_back.shape, F))
    return c._replace(
        free_F=scatter_unique(c.free_F, (at,), pages),
        top=c.top + jnp.sum(give_back),
        table_SxM=jnp.where(done_S[:, None], TRASH_PAGE, c.table_SxM),
        active_S=c.active_S & ~done_S,
        waiting_B=waiting_B,
        alive_B=c.alive_B & ~released_B,
    )


def keep(ro: Rollout, c: Carry, done_S: jax.Array) -> Carry:
    """`retire` in a session's call (`Static.keep_pages`): finished rows free their slots and
    leave their page tables in ``out_table_NxM``, their pages held for the conversation's next
    call."""
    rows_S = jnp.where(done_S, c.row_S, dropped(done_S.shape, ro.N))
    return c._replace(
        out_table_NxM=scatter_unique(c.out_table_NxM, (rows_S,), c.table_SxM),
        table_SxM=jnp.where(done_S[:, None], TRASH_PAGE, c.table_SxM),
        active_S=c.active_S & ~done_S,
    )


def decode_step(ro: Rollout, c: Carry) -> Carry:
    """One token for every active row that gets its page: admit, allocate, copy prompt
    tails, decode and sample, record, retire (or `keep`). With nothing left to do it changes
    nothing but the trash page (so the loop may run it past the end)."""
    c = admit(ro, c)
    wait_S, first_S, c = allocate(ro, c)
    if not ro.static.keep_pages:  # a session's rows own their prompts' pages: nothing to copy
        c = copy_prompt_tails(ro, c, first_S)
    run_S = c.active_S & ~wait_S
    tok_S, logp_S, logits_SxV, pools = sample_step(ro, c, run_S)
    done_S, c = record(ro, c, run_S, wait_S, tok_S, logp_S, logits_SxV, pools)
    return keep(ro, c, done_S) if ro.static.keep_pages else retire(ro, c, done_S)


def work_left(ro: Rollout, c: Carry) -> jax.Array:
    return (c.next_row < ro.num_rows) | jnp.any(c.active_S)


def iteration(ro: Rollout, c: Carry) -> Carry:
    """One trip of the rollout loop: every prefill group that is due (each followed by the
    admission of its rows), then ``static.steps_per_sync`` decode steps in a loop of known
    trip count (no predicate read back by the host between them)."""
    c = jax.lax.while_loop(lambda c: prefill_due(ro, c), lambda c: admit(ro, prefill_group(ro, c)), c)
    return jax.lax.fori_loop(0, ro.static.steps_per_sync, lambda _, c: decode_step(ro, c), c)


def rollout(
    model,
    prompt_ids_BxP,
    prompt_len_B,
    limits_N,
    generated_N,
    stop_state_N,
    prompt_index_B,
    num_rows,
    rng,
    temperature,
    top_p,
    stop_tables,
    static: Static,
    pool_layout: PoolLayout,
    vocab_shards: int = 1,
    resume: Resume | None = None,
):
    """One replica's rollout. ``prompt_ids_BxP`` right-padded (row i's tokens in columns
    [0, prompt_len_B[i])), ``limits_N`` each row's max_new_tokens (N = B * n), ``generated_N``
    and ``stop_state_N`` its tokens sampled before this call and its stop-string state after
    them (`Rollout`; zeros but in a resumed partial rollout), ``prompt_index_B``
    each prompt's id (seeds its samples: `row_keys`), ``num_rows`` the rows to generate (later
    rows are bucket padding), ``stop_tables`` the `stops.StopStrings` arrays (token_class_V,
    next_state_SxC, hit_SxC; unused without ``static.use_stops``), ``vocab_shards`` the
    devices the logits' vocabulary is split over inside the replica (the sampler's blocks
    then tile the shards). ``resume`` (a session's call, ``static.keep_pages``, n = 1): the
    pools and the pages of the tokens cached by earlier calls; ``prompt_ids_BxP`` then holds
    each prompt's tokens from ``resume.start_B`` on (its length ``prompt_len_B`` counts all).
    Returns bucket-sized outputs and statistics (``peak_pages`` and ``waits``: slot-steps
    spent waiting for a page, both measured; ``prefill_tokens`` [B]: the prompt tokens the
    model ran on, the prefill chunks' (measured) and each row's first decode input, its
    prompt's last token); a session's call also its ``pools`` and each row's page table
    ``tables`` [N, M]."""
    B, P = prompt_ids_BxP.shape
    C = static.prefill_len
    start_B = jnp.zeros(B, jnp.int32) if resume is None else resume.start_B
    ro = Rollout(
        model=model,
        static=static,
        pool_layout=pool_layout,
        vocab_shards=vocab_shards,
        prompt_len=P if resume is None else resume.held_BxMp.shape[1] * static.page_size,
        ids_BxCP=jnp.pad(prompt_ids_BxP, ((0, 0), (0, -(-P // C) * C - P))),
        prompt_len_B=prompt_len_B,
        start_B=start_B,
        last_token_B=jnp.take_along_axis(prompt_ids_BxP, (prompt_len_B - start_B - 1)[:, None], axis=1)[:, 0],
        limits_N=limits_N,
        generated_N=generated_N,
        stop_state_N=stop_state_N,
        prompt_index_B=prompt_index_B,
        num_rows=num_rows,
        rng=rng,
        temperature=temperature,
        top_p=top_p,
        eos_E=jnp.asarray(static.eos_token_ids or (-1,), jnp.int32),
        stop_tables=stop_tables,
        resume=resume,
    )
    c = jax.lax.while_loop(lambda c: work_left(ro, c), lambda c: iteration(ro, c), initial_carry(ro))
    out = dict(
        responses=c.out_tok_NxR,
        response_mask=(jnp.arange(static.response_len)[None, :] < c.lengths_N[:, None]).astype(jnp.int32),
        log_probs=c.out_logp_NxR,
        lengths=c.lengths_N,
        num_steps=c.steps,
        peak_pages=c.peak_pages,
        waits=c.waits,
        # every row of the caller's is admitted once: its first decode input is its prompt's last token
        prefill_tokens=c.prefill_tokens_B + static.n * (jnp.arange(B) * static.n < num_rows),
    )
    if static.return_logits:
        out["logits"] = c.out_logits_NxRxV
    if static.return_cache:
        stacked = jax.tree.map(lambda *x: jnp.stack(x), *c.pools)
        out["k_pages"], out["v_pages"] = pool_layout.to_heads_major(stacked)
    if static.keep_pages:
        out["pools"], out["tables"] = c.pools, c.out_table_NxM
    return out


def _pool_constraint(pool_layout: PoolLayout):
    """Pins every layer's pool arrays by the layout's logical axes."""
    axes = pool_layout.logical_axes

    def pin(tree):
        return jax.tree.map(lambda x: constrain(x, axes), tree)

    return pin


__all__ = [
    "DEFAULT_RESPONSE_SHARE",
    "Static",
    "Carry",
    "Resume",
    "Rollout",
    "decode_step",
    "group_pages",
    "keep",
    "iteration",
    "no_wait_peak_pages",
    "pool_bounds",
    "pool_pages",
    "reserve_pages",
    "rollout",
    "row_keys",
]
