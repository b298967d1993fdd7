"""A paged KV cache and attention over it, in the layouts of the paged-attention kernels that ship
in the jax wheel, with a pure-JAX attention for every other case.

Pages. A sequence owns a row of the page table [max_pages] (page ids); its token at position t
sits in page ``table[t // page_size]`` at offset ``t % page_size`` (position == cache slot, as
the kernels assume: a sequence's keys are slots [0, length)). Page 0 is the trash page: rows
and tokens that must not write anything (idle decode slots, prefill padding) write there, and
no live table entry points at it, so what it holds is never read.

Layouts (`PoolLayout`, one per attention kernel, chosen once per program):

- ``"jax"`` and ``"gpu"``: per layer a key pool and a value pool [kv_heads, pages, page_size,
  head_dim], the layout of ``jax.experimental.pallas.ops.gpu.paged_attention``. ``"gpu"``
  decodes (one query per sequence, no sliding window) with that Triton kernel; prefill
  chunks use the pure-JAX `paged_attention` on the same pools.
- ``"tpu"``: per layer one pool [pages, page_size, 2 * kv_heads, head_dim] with keys and
  values interleaved (key head h at 2h, value head h at 2h + 1), the layout of
  ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, which does prefill chunks and
  decode steps alike.

Converting one layout into the other would copy the whole pool at every step, so the pools are
allocated in the kernel's layout and only the write (a scatter of this call's keys/values) and
the attention call differ. `choose_kernel` picks ``"gpu"`` / ``"tpu"`` by platform when the
kernel supports the model (GPU: no sliding window; TPU: head_dim a multiple of 128, which its
Mosaic lowering needs) and the mesh leaves head_dim whole; ``"jax"`` everywhere else (CPU
included). With kv heads split over mesh axes (tp), the kernel runs per shard under
``shard_map`` over those axes.

`paged_attention` is the pure-JAX attention over the ``"jax"`` layout (any backend). It reads
pages in blocks of ``pages_per_block`` with an online softmax, for as many blocks as the
longest query position needs (a dynamic trip count): the work follows the tokens alive, not
the table's capacity.

``"ordered"`` (a ``batch_invariant`` model's: the train-rollout agreement mode) keeps the
``"jax"`` layout and attends with `ordered_paged_attention`: the trainer's own order-stable
attention over every slot of each row's page table, so the rollout's logits are a full
forward's bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxflow.models import ModelConfig
from jaxflow.models.decoder import ordered_attention

TRASH_PAGE = 0
KERNELS = ("jax", "gpu", "tpu", "ordered")
# Thread blocks the GPU decode kernel aims for: 4 per SM of an H100/H200 (132 SMs). Fewer leave
# SMs idle; more only shrink the key blocks each one reads (measured on an H200, 256 rows x 24
# pages: 12 splits of 2 pages 36 us per layer, see docs/PERFORMANCE.md).
GPU_THREAD_BLOCKS = 512
_MASKED = float(jnp.finfo(jnp.float32).min)


def choose_kernel(cfg: ModelConfig, platform: str, head_dim_split: bool = False) -> str:
    """The attention kernel for ``platform`` (``jax.devices()[0].platform``): the pallas kernel
    of the platform where it supports the model, else the pure-JAX attention."""
    if head_dim_split:  # a kernel needs each head's whole dot product on one device
        return "jax"
    if platform == "gpu" and cfg.sliding_window is None and cfg.head_dim % 16 == 0:
        return "gpu"
    if platform == "tpu" and cfg.head_dim % 128 == 0:
        return "tpu"
    return "jax"


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """How one layer's pages are held for ``kernel`` (see the module docstring). A layer's pool
    is ``(k, v)`` for ``"jax"`` / ``"gpu"`` and one interleaved array for ``"tpu"``.

    ``kv_axes``/``mesh``: the mesh axes the kv heads are split over and the mesh to run a
    pallas kernel per shard on (``shard_map``); empty / None when unsplit. ``interpret`` runs
    the pallas kernel in interpret mode (set off its platform: the GPU kernel on CPU, for
    tests)."""

    kernel: str = "jax"
    kv_axes: tuple[str, ...] = ()
    mesh: Any = None
    interpret: bool = False

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"attention kernel must be one of {KERNELS}, got {self.kernel!r}")

    @property
    def page_axis(self) -> int:
        """The pages dimension of one layer's array(s)."""
        return 0 if self.kernel == "tpu" else 1

    @property
    def logical_axes(self) -> tuple[str | None, ...]:
        """Logical names of one layer's array(s) (pinned with `jaxflow.mesh.constrain`)."""
        if self.kernel == "tpu":
            return (None, None, "kv_heads", "head_dim")
        return ("kv_heads", None, None, "head_dim")

    def page_size(self, pool) -> int:
        """Tokens per page of a pool (any leading dims)."""
        return jax.tree.leaves(pool)[0].shape[-3 if self.kernel == "tpu" else -2]

    def zeros(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype=None):
        """One layer's zeroed pool."""
        N, K, dtype = cfg.num_kv_heads, cfg.head_dim, dtype or cfg.dtype
        if self.kernel == "tpu":
            return jnp.zeros((num_pages, page_size, 2 * N, K), dtype)
        shape = (N, num_pages, page_size, K)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def to_heads_major(self, pool) -> tuple[jax.Array, jax.Array]:
        """(k, v) [..., kv_heads, pages, page_size, head_dim] of a pool (any leading dims)."""
        if self.kernel != "tpu":
            return pool
        kv = jnp.moveaxis(pool, -2, -4)  # [..., 2N, pages, T, K]
        return kv[..., 0::2, :, :, :], kv[..., 1::2, :, :, :]

    def from_heads_major(self, k, v):
        """The pool holding keys ``k`` and values ``v`` [kv_heads, pages, page_size, head_dim]."""
        if self.kernel != "tpu":
            return k, v
        N, pages, T, K = k.shape
        return jnp.stack([k, v], axis=1).reshape(2 * N, pages, T, K).transpose(1, 2, 0, 3)

    def write(self, pool, page_BxL, offset_BxL, k_BxLxNxK, v_BxLxNxK):
        """The pool with this call's keys/values at (page, offset), in place. Tokens addressed
        to the trash page write nothing (`scatter_unique`): every write left is to a distinct
        slot, so the scatter runs without atomics or serialisation."""
        pages = jax.tree.leaves(pool)[0].shape[self.page_axis]
        page_BxL = jnp.where(page_BxL == TRASH_PAGE, dropped(page_BxL.shape, pages), page_BxL)
        if self.kernel == "tpu":
            B, L, N, K = k_BxLxNxK.shape
            kv = jnp.stack([k_BxLxNxK, v_BxLxNxK], axis=-2).reshape(B, L, 2 * N, K)
            return scatter_unique(pool, (page_BxL, offset_BxL), kv.astype(pool.dtype))
        k_pages, v_pages = pool
        index = (slice(None), page_BxL, offset_BxL)
        k_pages = scatter_unique(k_pages, index, k_BxLxNxK.transpose(2, 0, 1, 3).astype(k_pages.dtype))
        v_pages = scatter_unique(v_pages, index, v_BxLxNxK.transpose(2, 0, 1, 3).astype(v_pages.dtype))
        return k_pages, v_pages

    def attend(self, q_BxLxHxK, pool, page_table_BxM, positions_BxL, *, sliding_window, pages_per_block):
        """Attention of this call's queries over the pool (keys already written)."""
        if self.kernel == "tpu":
            fn, specs = _tpu_attention, (PartitionSpec(None, None, self.kv_axes or None, None),)
            args = (pool,)
        elif self.kernel == "gpu" and q_BxLxHxK.shape[1] == 1 and sliding_window is None:
            fn, args = _gpu_decode_attention, pool
            specs = (PartitionSpec(self.kv_axes or None, None, None, None),) * 2
        elif self.kernel == "ordered":
            return ordered_paged_attention(
                q_BxLxHxK, *pool, page_table_BxM, positions_BxL, sliding_window=sliding_window
            )
        else:
            return paged_attention(
                q_BxLxHxK,
                *pool,
                page_table_BxM,
                positions_BxL,
                sliding_window=sliding_window,
                pages_per_block=pages_per_block,
            )
        fn = functools.partial(fn, sliding_window=sliding_window, interpret=self.interpret)
        if self.kernel == "gpu":
            fn = functools.partial(fn, pages_per_block=pages_per_block)
        if not self.kv_axes:
            return fn(q_BxLxHxK, *args, page_table_BxM, positions_BxL)
        heads = PartitionSpec(None, None, self.kv_axes, None)
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=(heads, *specs, PartitionSpec(), PartitionSpec()),
            out_specs=heads,
            axis_names=set(self.kv_axes),
            check_vma=False,
        )(q_BxLxHxK, *args, page_table_BxM, positions_BxL)


def gpu_partition(pages: int, rows: int, kv_heads: int, pages_per_block: int) -> tuple[int, int, int]:
    """``(k_splits, pages_per_compute_block, table_pages)`` of the GPU decode kernel for page
    tables of ``pages`` columns: the kernel runs a thread block per (row, kv head, split), each
    reading its split's pages ``pages_per_compute_block`` at a time with an online softmax.
    Splits double until the blocks reach `GPU_THREAD_BLOCKS` (or one page per split), so each
    block reads as many pages per iteration as it may (up to ``pages_per_block``); the table
    is padded to ``table_pages`` = splits x a multiple of the compute block (the kernel reads
    no page past a row's length)."""
    k_splits = 1
    while rows * kv_heads * k_splits < GPU_THREAD_BLOCKS and 2 * k_splits <= pages:
        k_splits *= 2
    per_split = -(-pages // k_splits)
    per_block = max(1, min(pages_per_block, per_split))
    per_split = -(-per_split // per_block) * per_block
    return k_splits, per_block, k_splits * per_split


def _gpu_decode_attention(
    q_BxLxHxK, k_pages, v_pages, page_table_BxM, positions_BxL, *, sliding_window, pages_per_block, interpret
):
    """One query per sequence through ``pallas.ops.gpu.paged_attention``: the kernel does not
    scale the scores, so q carries 1/sqrt(K); it attends to slots [0, length) with length =
    position + 1 (0 for idle rows, whose output is 0). Its table is split and blocked as
    `gpu_partition` says."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel

    del sliding_window  # not supported by the kernel; `PoolLayout.attend` routes those models elsewhere
    B, _, _, K = q_BxLxHxK.shape
    M = page_table_BxM.shape[1]
    k_splits, per_block, table_pages = gpu_partition(M, B, k_pages.shape[0], pages_per_block)
    table = jnp.pad(page_table_BxM.astype(jnp.int32), ((0, 0), (0, table_pages - M)), constant_values=TRASH_PAGE)
    q_BxHxK = (q_BxLxHxK[:, 0].astype(jnp.float32) * K**-0.5).astype(k_pages.dtype)
    lengths_B = (positions_BxL[:, 0] + 1).astype(jnp.int32)
    out = gpu_kernel.paged_attention(
        q_BxHxK,
        k_pages,
        v_pages,
        table,
        lengths_B,
        k_splits=k_splits,
        pages_per_compute_block=per_block,
        interpret=interpret,
    )
    return out[:, None].astype(q_BxLxHxK.dtype)


def ragged_arguments(page_table_BxM, positions_BxL):
    """The ragged kernel's sequence description of one call: every row is a sequence whose L
    queries are its last L tokens, ``kv_lens`` = first position + L (rows without a real
    token, position -1 throughout, read L slots of their table and are ignored), query
    offsets ``cu_q_lens`` = [0, L, 2L, ...], all B rows live. A row's real tokens are a
    prefix of its L, at consecutive positions (decode steps and prefill chunks are)."""
    B, L = positions_BxL.shape
    first_B = jnp.where(positions_BxL[:, 0] >= 0, positions_BxL[:, 0], 0)
    kv_lens_B = (first_B + L).astype(jnp.int32)
    cu_q_lens = (jnp.arange(B + 1) * L).astype(jnp.int32)
    return kv_lens_B, page_table_BxM.astype(jnp.int32), cu_q_lens, jnp.array([B], jnp.int32)


def _tpu_attention(q_BxLxHxK, kv_pages, page_table_BxM, positions_BxL, *, sliding_window, interpret):
    """``pallas.ops.tpu.ragged_paged_attention`` over the interleaved pool (`ragged_arguments`)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ragged_paged_attention,
    )

    del interpret  # the kernel has no interpret switch; it runs on TPU only
    B, L, H, K = q_BxLxHxK.shape
    out = ragged_paged_attention(
        q_BxLxHxK.reshape(B * L, H, K).astype(kv_pages.dtype),
        kv_pages,
        *ragged_arguments(page_table_BxM, positions_BxL),
        sm_scale=K**-0.5,
        sliding_window=sliding_window,
    )
    return out.reshape(B, L, H, K).astype(q_BxLxHxK.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """Page pools of every layer plus what one model call needs to write and read them.

    ``pools``: a tuple of one pool (`PoolLayout`) per layer. ``page_table_BxM`` (int32): the
    pages of each of the B sequences of this call; ``positions_BxL`` (int32): the position
    (== slot) of each of the L new tokens, -1 for tokens that write nothing and whose output
    is ignored. New keys are written before attending, so token t sees slots [0, t] of its
    row (and the sliding window, if any).
    """

    pools: Any
    page_table_BxM: jax.Array
    positions_BxL: jax.Array
    layout: PoolLayout = dataclasses.field(default=PoolLayout(), metadata=dict(static=True))
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    pages_per_block: int = dataclasses.field(default=8, metadata=dict(static=True))

    @staticmethod
    def zeros(cfg: ModelConfig, num_pages: int, page_size: int, layout: PoolLayout = PoolLayout(), dtype=None):
        """Zeroed pools, one per layer (also for a scanned model: `Decoder` runs a cached
        forward layer by layer, so each layer's pool is its own buffer, written in place)."""
        return tuple(layout.zeros(cfg, num_pages, page_size, dtype) for _ in range(cfg.num_layers))

    def replace_pools(self, pools) -> PagedKVCache:
        return dataclasses.replace(self, pools=pools)

    def attend(self, q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, pool):
        """Write this call's keys/values into one layer's pool, then attend over the pages."""
        with jax.named_scope("paged_attention"):
            page_BxL, offset_BxL = slot_address(self.page_table_BxM, self.positions_BxL, self.layout.page_size(pool))
            pool = self.layout.write(pool, page_BxL, offset_BxL, k_BxLxNxK, v_BxLxNxK)
            out = self.layout.attend(
                q_BxLxHxK,
                pool,
                self.page_table_BxM,
                self.positions_BxL,
                sliding_window=self.sliding_window,
                pages_per_block=self.pages_per_block,
            )
        return out, pool


def dropped(shape: tuple[int, ...], size: int) -> jax.Array:
    """Distinct out-of-bounds indices (``size``, ``size + 1``, ...) of ``shape``: writes that
    `scatter_unique` drops."""
    return size + jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)


def scatter_unique(x: jax.Array, index: tuple, values: jax.Array) -> jax.Array:
    """``x.at[index].set(values)`` for indices that are all distinct, out-of-bounds ones
    dropped (`dropped`). XLA:GPU serialises a scatter whose indices may repeat (every update
    to one place must land in order): measured on an H100, the rollout's scatters of idle slots
    onto the trash page took most of a decode step."""
    return x.at[index].set(values, mode="drop", unique_indices=True)


def slot_address(page_table_BxM: jax.Array, positions_BxL: jax.Array, page_size: int):
    """(page, offset) of each position; -1 positions go to the trash page."""
    valid = positions_BxL >= 0
    pos = jnp.maximum(positions_BxL, 0)
    page = jnp.take_along_axis(page_table_BxM, pos // page_size, axis=1)
    return jnp.where(valid, page, TRASH_PAGE), jnp.where(valid, pos % page_size, 0)


def paged_attention(
    q_BxLxHxK,
    k_pages_NxPxTxK,
    v_pages_NxPxTxK,
    page_table_BxM,
    positions_BxL,
    *,
    sliding_window: int | None = None,
    pages_per_block: int = 8,
) -> jax.Array:
    """softmax(q k / sqrt(K) + mask) v over each row's pages; query t of row b sees slots
    j <= positions[b, t] (and positions[b, t] - j < sliding_window). Grouped-query: query
    head h reads kv head h // (H / N). Rows with position -1 return zeros.

    The slots are read in blocks of ``pages_per_block`` pages (T = page_size slots each),
    ``ceil((max position + 1) / (pages_per_block * T))`` blocks in all, with the running
    max m, normaliser l and accumulator a of the online softmax:
    m' = max(m, max_j s_j), l' = l e^{m - m'} + sum_j e^{s_j - m'}, a' = a e^{m - m'} + sum_j e^{s_j - m'} v_j.
    """
    q_BxLxHxK, k_pages_NxPxTxK, v_pages_NxPxTxK = (
        jnp.asarray(x) for x in (q_BxLxHxK, k_pages_NxPxTxK, v_pages_NxPxTxK)
    )
    B, L, H, K = q_BxLxHxK.shape
    N, _, T, _ = k_pages_NxPxTxK.shape
    G = H // N
    M = page_table_BxM.shape[1]
    blocks = -(-M // pages_per_block)
    table = jnp.pad(page_table_BxM, ((0, 0), (0, blocks * pages_per_block - M)), constant_values=TRASH_PAGE)
    W = pages_per_block * T
    # rows (G, L) of one product per (kv head, sequence)
    q_NxBxRxK = (
        q_BxLxHxK.reshape(B, L, N, G, K).transpose(2, 0, 3, 1, 4).reshape(N, B, G * L, K).astype(jnp.float32)
        * (K**-0.5)
    ).astype(k_pages_NxPxTxK.dtype)
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

    init = (
        jnp.full((N, B, G * L), _MASKED, jnp.float32),
        jnp.zeros((N, B, G * L), jnp.float32),
        jnp.zeros((N, B, G * L, K), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, jnp.minimum(needed, blocks), block, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(N, B, G, L, K).transpose(1, 3, 0, 2, 4).reshape(B, L, H, K).astype(q_BxLxHxK.dtype)


def ordered_paged_attention(
    q_BxLxHxK, k_pages_NxPxTxK, v_pages_NxPxTxK, page_table_BxM, positions_BxL, *, sliding_window: int | None = None
) -> jax.Array:
    """`paged_attention`'s result computed as a ``batch_invariant`` model computes attention in
    a forward: each row's pages gathered into keys and values over all
    ``S = M * page_size`` slots of its table, then `jaxflow.models.decoder.ordered_attention`
    under the mask slot <= position (and position - slot < sliding_window). Its sums run in
    index order and masked slots add exact zeros, so a decode step's logits are the full
    forward's bit for bit (where `paged_attention`'s online softmax and XLA's tiled products
    differ by a few float32 spacings). Cost: every query reads every slot of the table, and
    the attention's sums are sequential."""
    N, _, T, K = k_pages_NxPxTxK.shape
    B, M = page_table_BxM.shape
    k_BxNxKxS = k_pages_NxPxTxK[:, page_table_BxM].reshape(N, B, M * T, K).transpose(1, 0, 3, 2)
    v_BxNxSxK = v_pages_NxPxTxK[:, page_table_BxM].reshape(N, B, M * T, K).transpose(1, 0, 2, 3)
    slot_S = jnp.arange(M * T, dtype=jnp.int32)
    visible_BxLxS = slot_S[None, None, :] <= positions_BxL[:, :, None]
    if sliding_window is not None:
        visible_BxLxS &= positions_BxL[:, :, None] - slot_S[None, None, :] < sliding_window
    out = ordered_attention(q_BxLxHxK, k_BxNxKxS, v_BxNxSxK, visible_BxLxS)
    return jnp.where((positions_BxL >= 0)[:, :, None, None], out, 0).astype(q_BxLxHxK.dtype)


__all__ = [
    "KERNELS",
    "TRASH_PAGE",
    "PagedKVCache",
    "PoolLayout",
    "choose_kernel",
    "ordered_paged_attention",
    "paged_attention",
    "ragged_arguments",
    "dropped",
    "scatter_unique",
    "slot_address",
]
