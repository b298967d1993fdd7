"""Remove padding: ``[prompt | response]`` rows packed into bins of real tokens (verl's
``use_remove_padding``), micro-batches formed by a token budget (``use_dynamic_bsz``), and
the data-parallel split balanced by tokens.

A padded row ``b`` holds ``p_b`` real prompt tokens (left padding) and ``r_b`` real response
tokens (right padding; ``response_mask`` must be a prefix run, as rollouts produce). Its
``L_b = p_b + r_b`` real tokens become one *segment* of a bin of ``C`` slots (``C`` = the
padded row length ``P + R``). Inside a bin, slot ``j`` of segment ``s`` starting at ``o_s``
carries position ``j - o_s`` (the position the padded path gives it, ``cumsum(mask) - 1``)
and attends to the slots ``i <= j`` of its own segment only, so every real token sees
exactly what it sees in the padded row and the logits agree.

The log-prob of response token ``t`` of row ``b`` is read at the slot before it::

    index[b, t] = bin_b * C + o_b + p_b - 1 + t
    log_probs[b, t] = log_softmax(logits_flat[index[b, t]] / T)[responses[b, t]]

so everything downstream (losses, advantages) keeps the ``[B, R]`` layout of the padded path.

Layout of a packed batch (`PackedLayout`): ``k`` micro-batches, each ``D * n`` bins of ``C``
slots and ``D * b`` rows (``D`` data-parallel ranks, rank ``d`` owning bins and rows of block
``d``). Rows are dealt to ranks balanced by tokens (`balanced_partitions`: equal row counts,
longest first to the lightest rank, so each rank computes about the same number of real
tokens in every pass: verl's ``balance_batch``, done per pass where the rows meet the ranks),
each rank's rows packed into bins first-fit by decreasing length, at most ``n`` bins per
micro-batch. Micro-batches hold at most ``budget // C`` bins per rank (a token budget per
device), or the bins of at most ``rows_per_micro`` rows per rank, or everything.

Shape buckets, so that a run whose lengths vary compiles a handful of programs, not one per
step: ``(k, n)`` come from `micro_grid` (``n`` a `bucket` value or the budget's ``budget //
C``, ``k`` a `bucket` value: a run visits a few values of ``k`` and, below one micro-batch,
of ``n``); the bins are spread over the micro-batches evenly by rows (`spread_bins`), so
``b = bucket(most rows in a micro-batch)`` stays near ``rows per rank / k``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence

import numpy as np

PACKED_KEYS = ("packed_ids", "packed_positions", "packed_segments", "packed_targets", "response_index")
# The padded row columns that `pack_inputs` turns into the packed model inputs.
MODEL_INPUT_KEYS = ("prompt_ids", "prompt_mask", "responses")


def bucket(n: int) -> int:
    """``n`` rounded up to three significant bits: 1..8, then 4 values per octave (10, 12, 14,
    16, 20, 24, 28, 32, 40, ...). Less than a fifth of a bucketed dimension is ever idle, and
    sizes 1..4096 map onto 44 values (a run whose sizes vary by +-30% visits a few)."""
    n = max(int(n), 1)
    step = 1 << max(n.bit_length() - 3, 0)
    return -(-n // step) * step


def real_lengths(prompt_mask: np.ndarray, response_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(p [B], r [B])``: real prompt and response tokens per row. Raises when a row's
    response mask is not a prefix run (holes cannot be packed as the padded path sees them)."""
    pm = np.asarray(prompt_mask) > 0
    rm = np.asarray(response_mask) > 0
    r = rm.sum(1)
    if not np.array_equal(rm, np.arange(rm.shape[1])[None, :] < r[:, None]):
        raise ValueError("remove padding needs right-padded responses (response_mask a prefix run per row)")
    p = pm.sum(1)
    if np.any((p == 0) & (r > 0)):
        raise ValueError("remove padding needs at least one prompt token per row with a response")
    return p.astype(np.int64), r.astype(np.int64)


def balanced_partitions(lengths: np.ndarray, parts: int) -> list[np.ndarray]:
    """``parts`` sets of row indices (each ascending) whose sizes differ by at most one and
    whose length sums are near equal: rows longest first, each to the lightest set that still
    has room (ties: fewer rows, then the lower set). The heaviest set exceeds the mean by at
    most one row's length."""
    lengths = np.asarray(lengths)
    if parts < 1:
        raise ValueError(f"balanced_partitions: {parts} parts")
    n = len(lengths)
    room = [n // parts + (d < n % parts) for d in range(parts)]
    heap = [(0, 0, d) for d in range(parts) if room[d]]
    heapq.heapify(heap)
    members: list[list[int]] = [[] for _ in range(parts)]
    for i in np.argsort(-lengths, kind="stable"):
        load, count, d = heapq.heappop(heap)
        members[d].append(int(i))
        if count + 1 < room[d]:
            heapq.heappush(heap, (load + int(lengths[i]), count + 1, d))
    return [np.asarray(sorted(m), np.int64) for m in members]


def micro_grid(bins: int, max_bins: int | None) -> tuple[int, int]:
    """``(k, n)``: ``k`` micro-batches of ``n`` bins per rank that hold ``bins`` bins. Under a
    budget of ``max_bins`` bins: ``(1, bucket(bins))`` while that fits the budget, ``(1,
    max_bins)`` while the bins do, else ``(bucket(ceil(bins / max_bins)), max_bins)``; so a
    run's shapes are a few buckets of ``k`` (less than a fifth of the micro-batches idle,
    plus the last one's rounding). Without a budget: ``(1, bucket(bins))``."""
    bins = max(int(bins), 1)
    if max_bins is None or bucket(bins) <= max_bins:
        return 1, bucket(bins)
    if bins <= max_bins:
        return 1, max_bins
    return bucket(math.ceil(bins / max_bins)), max_bins


def spread_bins(bins: list[list[int]], k: int, n: int) -> list[list[list[int]]]:
    """``bins`` dealt to ``k`` micro-batches of at most ``n`` bins each: the bins with the most
    rows first, each to the micro-batch with the fewest rows, so every micro-batch holds about
    ``rows / k`` rows and the row dimension ``b`` stays near that."""
    if len(bins) > k * n:
        raise ValueError(f"{len(bins)} bins do not fit {k} micro-batches of {n}")
    out: list[list[list[int]]] = [[] for _ in range(k)]
    load = [0] * k
    for q in sorted(range(len(bins)), key=lambda q: (-len(bins[q]), q)):
        j = min((j for j in range(k) if len(out[j]) < n), key=lambda j: (load[j], len(out[j]), j))
        out[j].append(bins[q])
        load[j] += len(bins[q])
    return out


def first_fit(rows: np.ndarray, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of row indices) of total length <= ``capacity``, first fit by decreasing
    length."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(rows.tolist(), key=lambda i: (-lengths[i], i)):
        for j, free in enumerate(room):
            if lengths[i] <= free:
                bins[j].append(i)
                room[j] -= int(lengths[i])
                break
        else:
            bins.append([i])
            room.append(capacity - int(lengths[i]))
    return bins


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where every padded row went (host arrays; see the module docstring).

    Attributes:
      rows: ``[k, D*b]`` the padded row held by each micro-batch row slot (-1: empty).
      bins: ``[k, D*n, C]`` the padded row of each slot's token (-1: empty slot).
      starts: ``[B]`` flat slot (within its micro-batch) of each row's first real token.
      micro: ``[B]`` the micro-batch of each row.
      prompt_len, response_len: ``[B]`` real tokens ``p`` and ``r``.
      capacity: ``C``; ``ranks``: ``D``.
    """

    rows: np.ndarray
    bins: np.ndarray
    starts: np.ndarray
    micro: np.ndarray
    prompt_len: np.ndarray
    response_len: np.ndarray
    capacity: int
    ranks: int

    @property
    def num_micro(self) -> int:
        return self.rows.shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(k, n, b)``: micro-batches, bins and rows per rank per micro-batch (the shape
        bucket: one compiled program per distinct value)."""
        k, N, _ = self.bins.shape
        return k, N // self.ranks, self.rows.shape[1] // self.ranks

    def real_tokens(self) -> int:
        return int((self.prompt_len + self.response_len).sum())

    def slots(self) -> int:
        return int(self.bins.size)

    def rank_tokens(self) -> np.ndarray:
        """``[D]`` real tokens each data-parallel rank computes, over all micro-batches."""
        k, N, C = self.bins.shape
        return (self.bins.reshape(k, self.ranks, N // self.ranks, C) >= 0).sum(axis=(0, 2, 3))


def plan_packing(
    prompt_mask: np.ndarray,
    response_mask: np.ndarray,
    *,
    ranks: int = 1,
    max_token_len: int | None = None,
    rows_per_micro: int | None = None,
) -> PackedLayout:
    """A `PackedLayout` for the rows: dealt to ``ranks`` balanced by tokens, packed into bins
    of ``C = P + R`` slots, grouped into micro-batches of at most ``max_token_len // C`` bins
    per rank (a token budget per device), or of the bins of at most ``rows_per_micro`` rows
    per rank, or one; every dimension bucketed (see the module docstring)."""
    P, R = prompt_mask.shape[1], response_mask.shape[1]
    C = P + R
    p, r = real_lengths(prompt_mask, response_mask)
    lengths = p + r
    if max_token_len is not None and max_token_len < C:
        raise ValueError(f"max_token_len {max_token_len} is shorter than one padded row (P + R = {C} tokens)")
    if rows_per_micro is not None and rows_per_micro < 1:
        raise ValueError(f"rows_per_micro must be >= 1, got {rows_per_micro}")
    dealt = balanced_partitions(lengths, ranks)
    if rows_per_micro is not None and max_token_len is None:
        # k is fixed by the (balanced, equal) rows per rank; n buckets the bins of a group
        k = max(1, max(math.ceil(len(rows) / rows_per_micro) for rows in dealt))
        micro_bins = [
            [first_fit(rows[j * rows_per_micro : (j + 1) * rows_per_micro], lengths, C) for j in range(k)]
            for rows in dealt
        ]
        n = bucket(max(len(bins) for groups in micro_bins for bins in groups))
    else:
        per_rank = [first_fit(rows, lengths, C) for rows in dealt]
        k, n = micro_grid(max(len(bins) for bins in per_rank), None if max_token_len is None else max_token_len // C)
        micro_bins = [spread_bins(bins, k, n) for bins in per_rank]
    b = bucket(max(sum(len(x) for x in micro_bins[d][j]) for d in range(ranks) for j in range(k)))
    rows_out = np.full((k, ranks * b), -1, np.int64)
    slots = np.full((k, ranks * n, C), -1, np.int64)
    starts = np.zeros(len(lengths), np.int64)
    micro = np.zeros(len(lengths), np.int64)
    for d in range(ranks):
        for j in range(k):
            members = []
            for q, members_q in enumerate(micro_bins[d][j]):
                offset = 0
                for i in members_q:
                    slots[j, d * n + q, offset : offset + lengths[i]] = i
                    starts[i], micro[i] = (d * n + q) * C + offset, j
                    offset += int(lengths[i])
                    members.append(i)
            rows_out[j, d * b : d * b + len(members)] = sorted(members)
    return PackedLayout(rows_out, slots, starts, micro, p, r, C, ranks)


def pack_inputs(
    layout: PackedLayout, prompt_ids: np.ndarray, prompt_mask: np.ndarray, responses: np.ndarray
) -> dict[str, np.ndarray]:
    """The packed model inputs and the response read-out (all int32, host):

    ``packed_ids``, ``packed_positions``, ``packed_segments`` (1-based row within its bin,
    0 = empty) and ``packed_targets`` (the next token of the same segment, 0 where none):
    ``[k, D*n, C]``; ``response_index``: ``[k, D*b, R]``, the flat slot (within the
    micro-batch) predicting each response token (0 on padding and empty rows)."""
    k, N, C = layout.bins.shape
    R = responses.shape[1]
    P = prompt_ids.shape[1]
    ids = np.zeros((k, N * C), np.int32)
    pos = np.zeros((k, N * C), np.int32)
    seg = np.zeros((k, N * C), np.int32)
    tgt = np.zeros((k, N * C), np.int32)
    pm = np.asarray(prompt_mask) > 0
    for i in range(len(layout.starts)):
        p, r, s, j = layout.prompt_len[i], layout.response_len[i], layout.starts[i], layout.micro[i]
        tokens = np.concatenate([np.asarray(prompt_ids[i])[pm[i]], np.asarray(responses[i, :r])]).astype(np.int32)
        L = p + r
        ids[j, s : s + L] = tokens
        pos[j, s : s + L] = np.arange(L)
        seg[j, s : s + L] = 1 + (s % C)  # unique per segment within its bin (its start slot)
        tgt[j, s : s + L - 1] = tokens[1:]
    index = np.zeros((k, layout.rows.shape[1], R), np.int32)
    for j in range(k):
        for q, i in enumerate(layout.rows[j]):
            if i >= 0:
                r = layout.response_len[i]
                index[j, q, :r] = layout.starts[i] + layout.prompt_len[i] - 1 + np.arange(r)
    del P
    shape = (k, N, C)
    return {
        "packed_ids": ids.reshape(shape),
        "packed_positions": pos.reshape(shape),
        "packed_segments": seg.reshape(shape),
        "packed_targets": tgt.reshape(shape),
        "response_index": index,
    }


def gather_rows(layout: PackedLayout, columns: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Row-space columns ``[B, ...]`` laid out as ``[k, D*b, ...]`` (zeros on empty rows)."""
    out = {}
    rows = layout.rows
    for name, x in columns.items():
        x = np.asarray(x)
        y = x[np.maximum(rows, 0)]
        y[rows < 0] = 0
        out[name] = y
    return out


def scatter_rows(layout: PackedLayout, y: np.ndarray, num_rows: int) -> np.ndarray:
    """Inverse of `gather_rows` for one output ``[k, D*b, ...]`` -> ``[B, ...]``."""
    y = np.asarray(y)
    out = np.zeros((num_rows,) + y.shape[2:], y.dtype)
    valid = layout.rows >= 0
    out[layout.rows[valid]] = y[valid]
    return out


def pack(
    columns: Mapping[str, np.ndarray], *, ranks: int, max_token_len: int | None, rows_per_micro: int | None
) -> tuple[dict[str, np.ndarray], PackedLayout]:
    """Padded row columns (host ``[B, ...]``: ``prompt_ids``, ``prompt_mask``, ``responses``,
    ``response_mask`` and any others) packed without padding, and the layout: the model
    inputs of `pack_inputs` plus every other column laid out by `gather_rows`
    (`packed_columns` names them). The packer of the packed forwards and the train steps."""
    layout = plan_packing(
        columns["prompt_mask"],
        columns["response_mask"],
        ranks=ranks,
        max_token_len=max_token_len,
        rows_per_micro=rows_per_micro,
    )
    out = pack_inputs(layout, columns["prompt_ids"], columns["prompt_mask"], columns["responses"])
    out |= gather_rows(layout, {k: v for k, v in columns.items() if k not in MODEL_INPUT_KEYS})
    return out, layout


def packed_columns(columns: Sequence[str]) -> tuple[str, ...]:
    """The columns `pack` makes of the row columns ``columns`` (each ``[k, ...]``, rank 3)."""
    return (*(c for c in columns if c not in MODEL_INPUT_KEYS), *PACKED_KEYS)


def balance_metrics(layout: PackedLayout) -> dict[str, float]:
    """verl's ``balance_batch`` metrics of one packed pass: real tokens per data-parallel rank
    if the rows went to the ranks in contiguous blocks of the batch order (``min``, ``max``,
    ``minmax_diff``: what the ranks get without balancing) and as this layout deals them
    (``balanced_min``, ``balanced_max``; ``mean``)."""
    lengths = layout.prompt_len + layout.response_len
    before = np.asarray([x.sum() for x in np.array_split(lengths, layout.ranks)])
    after = layout.rank_tokens()
    return {
        "global_seqlen/min": float(before.min()),
        "global_seqlen/max": float(before.max()),
        "global_seqlen/minmax_diff": float(before.max() - before.min()),
        "global_seqlen/balanced_min": float(after.min()),
        "global_seqlen/balanced_max": float(after.max()),
        "global_seqlen/mean": float(after.mean()),
    }
