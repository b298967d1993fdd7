"""The rollout program of one generation replica: continuous batching over a fixed number of
decode slots with chunked prefill and prompt pages shared by the n samples, all inside one
compiled program (no host round trip, no recompilation as sequences come and go).

Rows. Row r is sample ``r % n`` of prompt ``r // n`` (verl's interleaved repeat). A row's
randomness is ``fold_in(fold_in(key, global row id), token index)``, so what a row samples does
not depend on its slot, on when it was admitted, on the other rows, or on the mesh.

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

Each iteration of the ``while_loop``: prefill a group if one is due, admit waiting rows into
free slots (in row order), give pages to rows that need one, run the decoder on one token per
slot (idle slots write to the trash page), sample, record, retire the rows that hit their
``max_new_tokens`` or an EOS id. The loop ends when every row has finished.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxflow.mesh import constrain
from jaxflow.models import ModelConfig
from jaxflow.sampling.logits_processing import sample_tokens, token_log_probs
from jaxflow.sampling.paged import TRASH_PAGE, PagedKVCache


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
    prefill_rows: int  # prompts per prefill chunk
    prefill_len: int  # tokens per prefill chunk
    return_logits: bool
    return_cache: bool = False


def layout(static: Static, prompts: int, prompt_len: int) -> dict[str, int]:
    """Page counts of one replica: ``prompt_pages`` (Mp per prompt), ``table`` (M pages per
    sequence) and ``num_pages`` (`pool_pages`)."""
    T = static.page_size
    return dict(prompt_pages=-(-prompt_len // T), table=-(-(prompt_len + static.response_len) // T),
                num_pages=pool_pages(prompts, prompt_len, static.response_len, static.slots, static.prefill_rows, T))


def pool_pages(prompts: int, prompt_len: int, response_len: int, slots: int, prefill_rows: int, page_size: int) -> int:
    """The pool of one replica, trash page included: the pages of the prompts that can be
    alive at once (one per slot plus a prefill group, ceil(P / page_size) each) and every
    slot's response pages (ceil(R / page_size), plus the private copy of its prompt's last
    page). A prefill group is only started once every row of the earlier prompts has a
    slot, so the pool never runs out."""
    T = page_size
    alive_prompts = min(prompts, slots + prefill_rows)
    return 1 + alive_prompts * -(-prompt_len // T) + slots * (-(-response_len // T) + 1)


def rollout(model, prompt_ids_BxP, prompt_len_B, limits_N, row_offset, num_rows, rng, temperature, top_p,
            static: Static):
    """One replica's rollout. ``prompt_ids_BxP`` right-padded (row i's tokens in columns
    [0, prompt_len_B[i])), ``limits_N`` each row's max_new_tokens (N = B * n), ``num_rows``
    the rows to generate (later rows are bucket padding), ``row_offset`` this replica's first
    global row id. Returns bucket-sized outputs and statistics."""
    cfg: ModelConfig = model.cfg
    B, P = prompt_ids_BxP.shape
    N, R, S, T, n = B * static.n, static.response_len, static.slots, static.page_size, static.n
    lay = layout(static, B, P)
    Mp, M = lay["prompt_pages"], lay["table"]
    F = lay["num_pages"] - 1  # every page but the trash page starts on the free stack
    per_layer = not cfg.scan_layers
    k_pool, v_pool = _constrain_pools(PagedKVCache.pools(cfg, lay["num_pages"], T, per_layer))

    def cache(k, v, table, positions):
        return PagedKVCache(k, v, table, positions, sliding_window=cfg.sliding_window)

    Gr, C = static.prefill_rows, static.prefill_len
    chunks = -(-P // C)
    ids = jnp.pad(prompt_ids_BxP, ((0, 0), (0, chunks * C - P)))
    last_token_B = jnp.take_along_axis(prompt_ids_BxP, (prompt_len_B - 1)[:, None], axis=1)[:, 0]
    temperature = jnp.float32(1.0) if static.greedy else temperature
    eos = jnp.asarray(static.eos_token_ids or (-1,), jnp.int32)
    slot_ids = jnp.arange(S)
    V = cfg.vocab_size

    carry = dict(
        k=k_pool, v=v_pool, active=jnp.zeros(S, bool), row=jnp.zeros(S, jnp.int32), pos=jnp.zeros(S, jnp.int32),
        tok=jnp.zeros(S, jnp.int32), gen=jnp.zeros(S, jnp.int32), limit=jnp.zeros(S, jnp.int32),
        first_private=jnp.zeros(S, jnp.int32), table=jnp.zeros((S, M), jnp.int32), next_row=jnp.int32(0),
        prompt_table=jnp.zeros((B, Mp), jnp.int32), prefilled=jnp.int32(0), alive=jnp.zeros(B, bool),
        waiting=jnp.full(B, n, jnp.int32),  # samples of each prompt not finished yet
        free=1 + jnp.arange(F, dtype=jnp.int32), top=jnp.int32(F), steps=jnp.int32(0), peak_pages=jnp.int32(0),
        out_tok=jnp.full((N, R), static.pad_token_id, jnp.int32), out_logp=jnp.zeros((N, R), jnp.float32),
        lengths=jnp.zeros(N, jnp.int32))
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
            _, out = model.model(tok_GxC, None, pos_GxC, cache(*pools, table, pos_GxC))
            return _constrain_pools((out.k, out.v))

        k, v = jax.lax.fori_loop(0, chunks, chunk, (c["k"], c["v"]))
        return dict(c, k=k, v=v, prefilled=first + Gr, top=c["top"] - Gr * Mp,
                    prompt_table=jax.lax.dynamic_update_slice_in_dim(c["prompt_table"], pages_GxMp, first, axis=0),
                    alive=jax.lax.dynamic_update_slice_in_dim(c["alive"], jnp.ones(Gr, bool), first, axis=0))

    def admit(c):
        # a new prefill group once every row of the prefilled prompts has a slot
        ready = jnp.minimum(c["prefilled"] * n, num_rows)
        wanted = jnp.any(~c["active"]) & (c["next_row"] >= ready) & (ready < num_rows)
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
        return new, b, j0, dict(
            c, active=c["active"] | new, row=jnp.where(new, cand, c["row"]), pos=jnp.where(new, p - 1, c["pos"]),
            tok=jnp.where(new, last_token_B[b], c["tok"]), gen=jnp.where(new, 0, c["gen"]),
            limit=jnp.where(new, limits_N[cand], c["limit"]), first_private=jnp.where(new, j0, c["first_private"]),
            table=jnp.where(new[:, None], shared, c["table"]), next_row=c["next_row"] + jnp.sum(new))

    def allocate(c):
        page_idx = c["pos"] // T
        cur = jnp.take_along_axis(c["table"], page_idx[:, None], axis=1)[:, 0]
        need = c["active"] & (cur == TRASH_PAGE)
        k = jnp.cumsum(need) - 1
        page = c["free"][jnp.clip(c["top"] - 1 - k, 0, F - 1)]
        table = c["table"].at[slot_ids, page_idx].set(jnp.where(need, page, cur))
        return dict(c, table=table, top=c["top"] - jnp.sum(need))

    def copy_prompt_tail(c, new, b, j0):
        """The private copy of page j0 of each admitted row's prompt (its tail tokens)."""
        has_tail = new & (j0 < Mp) & ((prompt_len_B[b] - 1) % T != 0)
        src = jnp.where(has_tail, c["prompt_table"][b, jnp.minimum(j0, Mp - 1)], TRASH_PAGE)
        dst = jnp.where(has_tail, c["table"][slot_ids, jnp.minimum(j0, M - 1)], TRASH_PAGE)
        def copy(pool):  # [N, pages, T, K] or [layers, N, pages, T, K]
            return pool.at[:, dst].set(pool[:, src]) if per_layer else pool.at[:, :, dst].set(pool[:, :, src])

        def copy_all(kv):
            return jax.tree.map(copy, kv)

        k, v = _constrain_pools(jax.lax.cond(jnp.any(has_tail), copy_all, lambda kv: kv, (c["k"], c["v"])))
        return dict(c, k=k, v=v)

    def body(c):
        new, b, j0, c = admit(c)
        c = allocate(c)
        c = copy_prompt_tail(c, new, b, j0)
        active = c["active"]
        positions = jnp.where(active, c["pos"], -1)[:, None]
        hidden, kv = model.model(c["tok"][:, None], None, positions, cache(c["k"], c["v"], c["table"], positions))
        logits_SxV = model.logits(hidden)[:, 0]
        keys = jax.vmap(lambda r, j: jax.random.fold_in(jax.random.fold_in(rng, row_offset + r), j))(c["row"], c["gen"])
        tok = sample_tokens(keys, logits_SxV, greedy=static.greedy, temperature=temperature, top_k=static.top_k,
                            top_p=top_p, use_top_p=static.use_top_p)
        logp = token_log_probs(logits_SxV, tok, temperature)
        row_w = jnp.where(active, c["row"], N)  # idle slots write nowhere
        gen = c["gen"] + active
        done = active & ((gen >= c["limit"]) | jnp.any(tok[:, None] == eos[None, :], axis=-1))
        out = dict(
            c, k=_constrain_pools(kv.k), v=_constrain_pools(kv.v), tok=tok, pos=c["pos"] + 1, gen=gen, steps=c["steps"] + 1,
            out_tok=c["out_tok"].at[row_w, c["gen"]].set(tok, mode="drop"),
            out_logp=c["out_logp"].at[row_w, c["gen"]].set(logp, mode="drop"),
            lengths=c["lengths"].at[jnp.where(done, c["row"], N)].set(gen, mode="drop"),
            peak_pages=jnp.maximum(c["peak_pages"], F - c["top"]))
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
        out.update(free=c["free"].at[at].set(pages, mode="drop"), top=c["top"] + jnp.sum(give_back),
                   table=jnp.where(done[:, None], TRASH_PAGE, c["table"]), active=active & ~done, waiting=waiting,
                   alive=c["alive"] & ~released)
        return out

    def cond(c):
        return (c["next_row"] < num_rows) | jnp.any(c["active"])

    c = jax.lax.while_loop(cond, body, carry)
    mask = (jnp.arange(R)[None, :] < c["lengths"][:, None]).astype(jnp.int32)
    out = dict(responses=c["out_tok"], response_mask=mask, log_probs=c["out_logp"], lengths=c["lengths"],
               num_steps=c["steps"], peak_pages=c["peak_pages"])
    if static.return_logits:
        out["logits"] = c["out_logits"]
    if static.return_cache:
        stack = (lambda pools: jnp.stack(pools)) if per_layer else (lambda pool: pool)
        out["k_pages"], out["v_pages"] = stack(c["k"]), stack(c["v"])
    return out


POOL_AXES = ("kv_heads", None, None, "head_dim")  # [kv_heads, pages, page_size, head_dim]


def _constrain_pools(tree):
    """Pin every pool (per layer, or stacked with a leading ``layers``) by `POOL_AXES`."""
    return jax.tree.map(lambda x: constrain(x, ("layers",) * (x.ndim - 4) + POOL_AXES), tree)


__all__ = ["POOL_AXES", "Static", "layout", "pool_pages", "rollout"]
