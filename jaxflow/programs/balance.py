"""Data-parallel balancing of a rollout batch by tokens (verl's ``trainer.balance_batch``).

A batch of ``B`` rows is split over ``D`` data-parallel ranks in contiguous blocks of ``B /
D`` rows. `balance_batch` reorders the rows so that the blocks carry about the same number of
real tokens ``L_b = sum(prompt_mask_b) + sum(response_mask_b)``: rows are dealt longest
first, each to the block with the fewest tokens that still has room (equal row counts), so
the largest block exceeds the mean by at most one row's length. It logs verl's metrics::

    global_seqlen/min, /max, /minmax_diff   tokens per block before balancing
    global_seqlen/balanced_min, /balanced_max   after
    global_seqlen/mean                        the mean block

Reordering changes no row's values; group baselines (``uid``) travel with their rows.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxflow.data.batch import Batch


def sequence_lengths(batch: Batch) -> np.ndarray:
    """Real tokens ``[B]`` of each ``[prompt | response]`` row."""
    pm = np.asarray(jax.device_get(batch["prompt_mask"]))
    rm = np.asarray(jax.device_get(batch["response_mask"]))
    return (pm > 0).sum(1) + (rm > 0).sum(1)


def balanced_partitions(lengths: np.ndarray, parts: int) -> list[np.ndarray]:
    """``parts`` equal-size sets of row indices (ascending) with near-equal length sums:
    longest first, each to the lightest set that still has room."""
    n = len(lengths)
    if parts < 1 or n % parts:
        raise ValueError(f"balance_batch: {n} rows do not split into {parts} equal data-parallel blocks")
    size = n // parts
    load = np.zeros(parts, np.int64)
    members: list[list[int]] = [[] for _ in range(parts)]
    for i in np.argsort(-np.asarray(lengths), kind="stable"):
        open_parts = [d for d in range(parts) if len(members[d]) < size]
        d = min(open_parts, key=lambda d: (load[d], d))
        members[d].append(int(i))
        load[d] += lengths[i]
    return [np.asarray(sorted(m), np.int64) for m in members]


def seqlen_balance_metrics(lengths: np.ndarray, partitions: list[np.ndarray],
                           prefix: str = "global_seqlen") -> dict[str, float]:
    """verl's ``log_seqlen_unbalance``: block token sums before (contiguous blocks) and after
    (``partitions``) balancing."""
    parts = len(partitions)
    before = np.asarray(lengths).reshape(parts, -1).sum(1)
    after = np.asarray([lengths[p].sum() for p in partitions])
    return {f"{prefix}/min": float(before.min()), f"{prefix}/max": float(before.max()),
            f"{prefix}/minmax_diff": float(before.max() - before.min()),
            f"{prefix}/balanced_min": float(after.min()), f"{prefix}/balanced_max": float(after.max()),
            f"{prefix}/mean": float(after.mean())}


def balance_batch(batch: Batch, dp_size: int) -> tuple[Batch, dict[str, float]]:
    """``batch`` reordered so each of the ``dp_size`` contiguous blocks holds about the same
    number of tokens, and the balance metrics (see the module docstring)."""
    lengths = sequence_lengths(batch)
    partitions = balanced_partitions(lengths, dp_size)
    order = np.concatenate(partitions)
    return batch.permute(order), seqlen_balance_metrics(lengths, partitions)
