"""The rollout program of one generation replica: continuous batching over a fixed number of
decode slots with chunked prefill and prompt pages shared by the n samples, all inside one
compiled program (no host round trip, no recompilation as sequences come and go).

Rows. Row r is sample ``r % n`` of prompt ``r // n`` (verl's interleaved repeat). A row's
randomness is ``fold_in(fold_in(key, global row id), token index)``, so what a row samples does
not depend on its slot, on when it was admitted or had to wait, on the other rows, on the
size of the page pool, or on the mesh.

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

Each iteration of the ``while_loop``: prefill a group if one is due and fits, admit waiting
rows into free slots (in row order), give pages to rows that need one (or make them wait),
run the decoder on one token per slot (idle and waiting slots write to the trash page),
sample, record, retire the rows that hit their ``max_new_tokens``, an EOS id or a stop string
(`stops`). The loop ends when every row has finished.
"""

from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.mesh import constrain
from jaxflow.models import ModelConfig
from jaxflow.sampling.logits_processing import sample_tokens, token_log_probs
from jaxflow.sampling.paged import TRASH_PAGE, PagedKVCache, PoolLayout

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


def layout(static: Static, prompt_len: int) -> dict[str, int]:
    """Page counts of one replica: ``prompt_pages`` (Mp per prompt), ``table`` (M pages per
    sequence), ``num_pages`` and ``reserve`` (Rp, `reserve_pages`)."""
    T = static.page_size
    return dict(
        prompt_pages=-(-prompt_len // T),
        table=-(-(prompt_len + static.response_len) // T),
        num_pages=static.num_pages,
        reserve=reserve_pages(static.response_len, T),
    )


def rollout(
    model,
    prompt_ids_BxP,
    prompt_len_B,
    limits_N,
    row_offset,
    num_rows,
    rng,
    temperature,
    top_p,
    stop_tables,
    static: Static,
    pool_layout: PoolLayout,
    vocab_shards: int = 1,
):
    """One replica's rollout. ``prompt_ids_BxP`` right-padded (row i's tokens in columns
    [0, prompt_len_B[i])), ``limits_N`` each row's max_new_tokens (N = B * n), ``num_rows``
    the rows to generate (later rows are bucket padding), ``row_offset`` this replica's first
    global row id, ``stop_tables`` the `stops.StopStrings` arrays (token_class_V,
    next_state_SxC, hit_SxC; unused without ``static.use_stops``), ``vocab_shards`` the
    devices the logits' vocabulary is split over inside the replica (the sampler's blocks
    then tile the shards). Returns bucket-sized outputs and statistics (``peak_pages`` and
    ``waits``: slot-steps spent waiting for a page, both measured)."""
    cfg: ModelConfig = model.cfg
    B, P = prompt_ids_BxP.shape
    N, R, S, T, n = B * static.n, static.response_len, static.slots, static.page_size, static.n
    lay = layout(static, P)
    Mp, M, Rp = lay["prompt_pages"], lay["table"], lay["reserve"]
    F = lay["num_pages"] - 1  # every page but the trash page starts on the free stack
    per_layer = not cfg.scan_layers
    axis = pool_layout.page_axis + (0 if per_layer else 1)  # the pages axis of a pool array
    constrain_pools = _pool_constraint(pool_layout)
    pools = constrain_pools(PagedKVCache.zeros(cfg, lay["num_pages"], T, per_layer, pool_layout))

    def cache(pools, table, positions):
        return PagedKVCache(pools, table, positions, layout=pool_layout, sliding_window=cfg.sliding_window)

    Gr, C = static.prefill_rows, static.prefill_len
    chunks = -(-P // C)
    ids = jnp.pad(prompt_ids_BxP, ((0, 0), (0, chunks * C - P)))
    last_token_B = jnp.take_along_axis(prompt_ids_BxP, (prompt_len_B - 1)[:, None], axis=1)[:, 0]
    temperature = jnp.float32(1.0) if static.greedy else temperature
    eos = jnp.asarray(static.eos_token_ids or (-1,), jnp.int32)
    token_class_V, next_state_SxC, hit_SxC = stop_tables
    slot_ids = jnp.arange(S)
    V = cfg.vocab_size

    carry = dict(
        pools=pools,
        active=jnp.zeros(S, bool),
        row=jnp.zeros(S, jnp.int32),
        pos=jnp.zeros(S, jnp.int32),
        tok=jnp.zeros(S, jnp.int32),
        gen=jnp.zeros(S, jnp.int32),
        limit=jnp.zeros(S, jnp.int32),
        first_private=jnp.zeros(S, jnp.int32),
        table=jnp.zeros((S, M), jnp.int32),
        next_row=jnp.int32(0),
        stop_state=jnp.zeros(S, jnp.int32),
        prompt_table=jnp.zeros((B, Mp), jnp.int32),
        prefilled=jnp.int32(0),
        alive=jnp.zeros(B, bool),
        waiting=jnp.full(B, n, jnp.int32),  # samples of each prompt not finished yet
        free=1 + jnp.arange(F, dtype=jnp.int32),
        top=jnp.int32(F),
        steps=jnp.int32(0),
        peak_pages=jnp.int32(0),
        waits=jnp.int32(0),
        out_tok=jnp.full((N, R), static.pad_token_id, jnp.int32),
        out_logp=jnp.zeros((N, R), jnp.float32),
        lengths=jnp.zeros(N, jnp.int32),
    )
    if static.return_logits:
        carry["out_logits"] = jnp.zeros((N, R, V), jnp.float32)

    def prefill_group(c):
        """The next Gr prompts: Mp pages each from the free stack, then their first p_i - 1
        tokens written in chunks of C tokens."""
        first = c["prefilled"]
        pages_GxMp = jax.lax.dynamic_slice_in_dim(c["free"], c["top"] - Gr * Mp, Gr * Mp).reshape(Gr, Mp)
        table = jnp.pad(pages_GxMp, ((0, 0), (0, M - Mp)))
        rows = jax.lax.dynamic_slice_in_dim(ids, first, Gr, axis=0)
        plen_G = jax.lax.dynamic_slice_in_dim(prompt_len_B, first, Gr)

        def chunk(i, pools):
            tok_GxC = jax.lax.dynamic_slice_in_dim(rows, i * C, C, axis=1)
            pos_C = i * C + jnp.arange(C, dtype=jnp.int32)
            pos_GxC = jnp.where(pos_C[None, :] < plen_G[:, None] - 1, pos_C[None, :], -1)
            _, out = model.model(tok_GxC, None, pos_GxC, cache(pools, table, pos_GxC))
            return constrain_pools(out.pools)

        with jax.named_scope("prefill"):
            pools = jax.lax.fori_loop(0, chunks, chunk, c["pools"])
        return dict(
            c,
            pools=pools,
            prefilled=first + Gr,
            top=c["top"] - Gr * Mp,
            prompt_table=jax.lax.dynamic_update_slice_in_dim(c["prompt_table"], pages_GxMp, first, axis=0),
            alive=jax.lax.dynamic_update_slice_in_dim(c["alive"], jnp.ones(Gr, bool), first, axis=0),
        )

    def admit(c):
        # a new prefill group once every row of the prefilled prompts has a slot, if its pages
        # leave the priority row's reserve
        ready = jnp.minimum(c["prefilled"] * n, num_rows)
        wanted = jnp.any(~c["active"]) & (c["next_row"] >= ready) & (ready < num_rows) & (c["top"] - Gr * Mp >= Rp)
        c = jax.lax.cond(wanted, prefill_group, lambda c: c, c)
        ready = jnp.minimum(c["prefilled"] * n, num_rows)
        free_slot = ~c["active"]
        cand = c["next_row"] + jnp.cumsum(free_slot) - 1
        new = free_slot & (cand < ready)
        cand = jnp.clip(cand, 0, N - 1)
        b = cand // n
        p = prompt_len_B[b]
        j0 = (p - 1) // T
        prompt_rows = jnp.pad(c["prompt_table"][b], ((0, 0), (0, M - Mp)))
        shared = jnp.where(jnp.arange(M)[None, :] < j0[:, None], prompt_rows, TRASH_PAGE)
        return dict(
            c,
            active=c["active"] | new,
            row=jnp.where(new, cand, c["row"]),
            pos=jnp.where(new, p - 1, c["pos"]),
            tok=jnp.where(new, last_token_B[b], c["tok"]),
            gen=jnp.where(new, 0, c["gen"]),
            limit=jnp.where(new, limits_N[cand], c["limit"]),
            first_private=jnp.where(new, j0, c["first_private"]),
            table=jnp.where(new[:, None], shared, c["table"]),
            next_row=c["next_row"] + jnp.sum(new),
            stop_state=jnp.where(new, 0, c["stop_state"]),
        )

    def allocate(c):
        """A page for every active row whose next position starts one: the priority row (the
        lowest active row id) always, the others while Rp pages stay on the stack. Returns
        the rows that wait and those that got their first page (gen == 0)."""
        page_idx = c["pos"] // T
        cur = jnp.take_along_axis(c["table"], page_idx[:, None], axis=1)[:, 0]
        need = c["active"] & (cur == TRASH_PAGE)
        priority = c["active"] & (c["row"] == jnp.min(jnp.where(c["active"], c["row"], N)))
        others = need & ~priority
        rank = jnp.cumsum(others) - 1 + jnp.any(need & priority)  # the priority row takes the first page
        granted = (need & priority) | (others & (c["top"] - 1 - rank >= Rp))
        rank = jnp.where(priority, 0, rank)
        page = c["free"][jnp.clip(c["top"] - 1 - rank, 0, F - 1)]
        table = c["table"].at[slot_ids, page_idx].set(jnp.where(granted, page, cur))
        return need & ~granted, granted & (c["gen"] == 0), dict(c, table=table, top=c["top"] - jnp.sum(granted))

    def copy_prompt_tail(c, first):
        """The private copy of page j0 of each row's prompt (its tail tokens), when the row
        gets that page (its first)."""
        b = c["row"] // n
        j0 = c["first_private"]
        has_tail = first & ((prompt_len_B[b] - 1) % T != 0)
        src = jnp.where(has_tail, c["prompt_table"][b, jnp.minimum(j0, Mp - 1)], TRASH_PAGE)
        dst = jnp.where(has_tail, c["table"][slot_ids, jnp.minimum(j0, M - 1)], TRASH_PAGE)

        def copy(x):
            index = (slice(None),) * axis
            return x.at[index + (dst,)].set(x[index + (src,)])

        pools = jax.lax.cond(jnp.any(has_tail), lambda p: jax.tree.map(copy, p), lambda p: p, c["pools"])
        return dict(c, pools=constrain_pools(pools))

    def body(c):
        c = admit(c)
        wait, first, c = allocate(c)
        c = copy_prompt_tail(c, first)
        run = c["active"] & ~wait
        positions = jnp.where(run, c["pos"], -1)[:, None]
        hidden, kv = model.model(c["tok"][:, None], None, positions, cache(c["pools"], c["table"], positions))
        with jax.named_scope("lm_head"):
            logits_SxV = model.logits(hidden)[:, 0]
        with jax.named_scope("sample"):  # the scopes name the ops in profiles (experiments/bench_sampling.py)
            keys = jax.vmap(lambda r, j: jax.random.fold_in(jax.random.fold_in(rng, row_offset + r), j))(
                c["row"], c["gen"]
            )
            tok = sample_tokens(
                keys,
                logits_SxV,
                greedy=static.greedy,
                temperature=temperature,
                top_k=static.top_k,
                top_p=top_p,
                use_top_p=static.use_top_p,
                vocab_shards=vocab_shards,
            )
        with jax.named_scope("log_prob"):
            logp = token_log_probs(logits_SxV, tok, temperature)
        row_w = jnp.where(run, c["row"], N)  # idle and waiting slots write nowhere
        gen = c["gen"] + run
        stop = jnp.any(tok[:, None] == eos[None, :], axis=-1)
        stop_state = c["stop_state"]
        if static.use_stops:
            cls = token_class_V[tok]
            stop |= hit_SxC[stop_state, cls]
            stop_state = jnp.where(run, next_state_SxC[stop_state, cls], stop_state)
        done = run & ((gen >= c["limit"]) | stop)
        out = dict(
            c,
            pools=constrain_pools(kv.pools),
            tok=jnp.where(run, tok, c["tok"]),
            pos=c["pos"] + run,
            gen=gen,
            stop_state=stop_state,
            steps=c["steps"] + 1,
            waits=c["waits"] + jnp.sum(wait),
            out_tok=c["out_tok"].at[row_w, c["gen"]].set(tok, mode="drop"),
            out_logp=c["out_logp"].at[row_w, c["gen"]].set(logp, mode="drop"),
            lengths=c["lengths"].at[jnp.where(done, c["row"], N)].set(gen, mode="drop"),
            peak_pages=jnp.maximum(c["peak_pages"], F - c["top"]),
        )
        if static.return_logits:
            out["out_logits"] = c["out_logits"].at[row_w, c["gen"]].set(logits_SxV, mode="drop")
        # retire finished rows: their private pages go back on the free stack, and so do the
        # pages of a prompt whose last sample finished
        own = done[:, None] & (jnp.arange(M)[None, :] >= c["first_private"][:, None]) & (c["table"] != TRASH_PAGE)
        waiting = c["waiting"].at[jnp.where(done, c["row"] // n, B)].add(-1, mode="drop")
        released = c["alive"] & (waiting == 0)
        pages = jnp.concatenate([c["table"].reshape(-1), c["prompt_table"].reshape(-1)])
        give_back = jnp.concatenate([own.reshape(-1), jnp.repeat(released, Mp)])
        at = jnp.where(give_back, c["top"] + jnp.cumsum(give_back) - 1, F)
        out.update(
            free=c["free"].at[at].set(pages, mode="drop"),
            top=c["top"] + jnp.sum(give_back),
            table=jnp.where(done[:, None], TRASH_PAGE, c["table"]),
            active=c["active"] & ~done,
            waiting=waiting,
            alive=c["alive"] & ~released,
        )
        return out

    def cond(c):
        return (c["next_row"] < num_rows) | jnp.any(c["active"])

    c = jax.lax.while_loop(cond, body, carry)
    mask = (jnp.arange(R)[None, :] < c["lengths"][:, None]).astype(jnp.int32)
    out = dict(
        responses=c["out_tok"],
        response_mask=mask,
        log_probs=c["out_logp"],
        lengths=c["lengths"],
        num_steps=c["steps"],
        peak_pages=c["peak_pages"],
        waits=c["waits"],
    )
    if static.return_logits:
        out["logits"] = c["out_logits"]
    if static.return_cache:
        stacked = jax.tree.map(lambda *x: jnp.stack(x), *c["pools"]) if per_layer else c["pools"]
        out["k_pages"], out["v_pages"] = pool_layout.to_heads_major(stacked)
    return out


def _pool_constraint(pool_layout: PoolLayout):
    """Pins every pool array (per layer, or stacked with a leading ``layers``) by the layout's
    logical axes."""
    axes = pool_layout.logical_axes

    def pin(tree):
        return jax.tree.map(lambda x: constrain(x, ("layers",) * (x.ndim - len(axes)) + axes), tree)

    return pin


__all__ = [
    "DEFAULT_RESPONSE_SHARE",
    "Static",
    "layout",
    "no_wait_peak_pages",
    "pool_bounds",
    "pool_pages",
    "reserve_pages",
    "rollout",
]
