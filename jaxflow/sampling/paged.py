"""A paged KV cache and attention over it, in the layout of the paged-attention kernels that ship
with jax (``jax.experimental.pallas.ops.{gpu,tpu}.paged_attention``).

Per layer, keys and values live in pools of pages, ``k_pages`` / ``v_pages``
[kv_heads, num_pages, page_size, head_dim]. A sequence owns a row of the page table
[max_pages] (page ids); its token at position t sits in page ``table[t // page_size]`` at
offset ``t % page_size`` (position == cache slot, as the kernels assume: a sequence's keys
are slots [0, length)). Page 0 is the trash page: rows and tokens that must not write
anything (idle decode slots, prefill padding) write there, and no live table entry points
at it, so what it holds is never read.

`paged_attention` is the pure-JAX attention over that layout (any backend). It reads pages in
blocks of ``pages_per_block`` with an online softmax, for as many blocks as the longest query
position needs (a dynamic trip count): the work follows the tokens alive, not the table's
capacity.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxflow.models import ModelConfig

TRASH_PAGE = 0
_MASKED = float(jnp.finfo(jnp.float32).min)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """Page pools of every layer plus what one model call needs to write and read them.

    ``k``/``v``: stacked [layers, kv_heads, num_pages, page_size, head_dim] or a tuple of one
    pool per layer. ``page_table_BxM`` (int32): the pages of each of the B sequences of this
    call; ``positions_BxL`` (int32): the position (== slot) of each of the L new tokens, -1
    for tokens that write nothing and whose output is ignored. New keys are written before
    attending, so token t sees slots [0, t] of its row (and the sliding window, if any).
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    page_table_BxM: jax.Array
    positions_BxL: jax.Array
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    pages_per_block: int = dataclasses.field(default=8, metadata=dict(static=True))

    @classmethod
    def pools(cls, cfg: ModelConfig, num_pages: int, page_size: int, per_layer: bool, dtype=None):
        """Zeroed (k, v) pools, stacked or one per layer."""
        shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        dtype = dtype or cfg.dtype
        if per_layer:
            return (tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                    tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))
        return jnp.zeros((cfg.num_layers,) + shape, dtype), jnp.zeros((cfg.num_layers,) + shape, dtype)

    def replace_kv(self, k, v) -> PagedKVCache:
        return dataclasses.replace(self, k=k, v=v)

    def attend(self, q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, kv_layer):
        """Write this call's keys/values into one layer's pools, then attend over the pages."""
        k_pages, v_pages = kv_layer
        page_BxL, offset_BxL = slot_address(self.page_table_BxM, self.positions_BxL, k_pages.shape[2])
        k_pages = k_pages.at[:, page_BxL, offset_BxL].set(k_BxLxNxK.transpose(2, 0, 1, 3).astype(k_pages.dtype))
        v_pages = v_pages.at[:, page_BxL, offset_BxL].set(v_BxLxNxK.transpose(2, 0, 1, 3).astype(v_pages.dtype))
        out = paged_attention(q_BxLxHxK, k_pages, v_pages, self.page_table_BxM, self.positions_BxL,
                              sliding_window=self.sliding_window, pages_per_block=self.pages_per_block)
        return out, (k_pages, v_pages)


def slot_address(page_table_BxM: jax.Array, positions_BxL: jax.Array, page_size: int):
    """(page, offset) of each position; -1 positions go to the trash page."""
    valid = positions_BxL >= 0
    pos = jnp.maximum(positions_BxL, 0)
    page = jnp.take_along_axis(page_table_BxM, pos // page_size, axis=1)
    return jnp.where(valid, page, TRASH_PAGE), jnp.where(valid, pos % page_size, 0)


def paged_attention(q_BxLxHxK, k_pages_NxPxTxK, v_pages_NxPxTxK, page_table_BxM, positions_BxL, *,
                    sliding_window: int | None = None, pages_per_block: int = 8) -> jax.Array:
    """softmax(q k / sqrt(K) + mask) v over each row's pages; query t of row b sees slots
    j <= positions[b, t] (and positions[b, t] - j < sliding_window). Grouped-query: query
    head h reads kv head h // (H / N). Rows with position -1 return zeros.

    The slots are read in blocks of ``pages_per_block`` pages (T = page_size slots each),
    ``ceil((max position + 1) / (pages_per_block * T))`` blocks in all, with the running
    max m, normaliser l and accumulator a of the online softmax:
    m' = max(m, max_j s_j), l' = l e^{m - m'} + sum_j e^{s_j - m'}, a' = a e^{m - m'} + sum_j e^{s_j - m'} v_j.
    """
    q_BxLxHxK, k_pages_NxPxTxK, v_pages_NxPxTxK = (jnp.asarray(x) for x in (q_BxLxHxK, k_pages_NxPxTxK, v_pages_NxPxTxK))
    B, L, H, K = q_BxLxHxK.shape
    N, _, T, _ = k_pages_NxPxTxK.shape
    G = H // N
    M = page_table_BxM.shape[1]
    blocks = -(-M // pages_per_block)
    table = jnp.pad(page_table_BxM, ((0, 0), (0, blocks * pages_per_block - M)), constant_values=TRASH_PAGE)
    W = pages_per_block * T
    # rows (G, L) of one product per (kv head, sequence)
    q_NxBxRxK = (q_BxLxHxK.reshape(B, L, N, G, K).transpose(2, 0, 3, 1, 4).reshape(N, B, G * L, K)
                 .astype(jnp.float32) * (K ** -0.5)).astype(k_pages_NxPxTxK.dtype)
    qpos_BxGL = jnp.broadcast_to(positions_BxL[:, None, :], (B, G, L)).reshape(B, G * L)
    needed = (jnp.max(positions_BxL) + W) // W  # blocks that hold any visible slot

    def block(i, carry):
        m, l, acc = carry
        pages_BxP = jax.lax.dynamic_slice_in_dim(table, i * pages_per_block, pages_per_block, axis=1)
        k_NxBxWxK = k_pages_NxPxTxK[:, pages_BxP].reshape(N, B, W, K)
        v_NxBxWxK = v_pages_NxPxTxK[:, pages_BxP].reshape(N, B, W, K)
        s = jnp.einsum("NBRK,NBWK->NBRW", q_NxBxRxK, k_NxBxWxK, preferred_element_type=jnp.float32)
        slot_W = i * W + jnp.arange(W)
        visible = slot_W[None, None, :] <= qpos_BxGL[:, :, None]
        if sliding_window is not None:
            visible &= qpos_BxGL[:, :, None] - slot_W[None, None, :] < sliding_window
        s = jnp.where(visible[None], s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(visible[None], jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        l = l * scale + jnp.sum(p, axis=-1)
        pv = jnp.einsum("NBRW,NBWK->NBRK", p.astype(v_NxBxWxK.dtype), v_NxBxWxK, preferred_element_type=jnp.float32)
        return m_new, l, acc * scale[..., None] + pv

    init = (jnp.full((N, B, G * L), _MASKED, jnp.float32), jnp.zeros((N, B, G * L), jnp.float32),
            jnp.zeros((N, B, G * L, K), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, jnp.minimum(needed, blocks), block, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(N, B, G, L, K).transpose(1, 3, 0, 2, 4).reshape(B, L, H, K).astype(q_BxLxHxK.dtype)


__all__ = ["TRASH_PAGE", "PagedKVCache", "paged_attention", "slot_address"]
