"""Stop strings: cut each response after the token that completes the first stop string.

Matching runs on the host on the decoded text (``tokenizer.decode(ids)``), as vLLM does,
because a string can span several tokens and a token can hold several characters. For one
row with tokens t_1..t_n, the cut is the smallest k such that ``decode(t_1..t_k)`` contains a
stop string; decoded prefixes only grow as k grows, so k is found by bisection (O(log n)
decodes per row). The token that completes the stop string stays in the response (masked
in, like EOS); everything after it becomes padding (pad id, mask 0, log-prob 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


def stop_length(tokens: np.ndarray, stop: tuple[str, ...], tokenizer: Any) -> int:
    """The number of tokens to keep: the smallest k with a stop string in ``decode(tokens[:k])``,
    or ``len(tokens)`` when no stop string occurs."""

    def hit(k: int) -> bool:
        text = tokenizer.decode([int(t) for t in tokens[:k]])
        return any(s in text for s in stop)

    n = len(tokens)
    if n == 0 or not hit(n):
        return n
    lo, hi = 0, n  # hit(hi) holds, hit(lo) does not (the empty prefix holds no stop string)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hit(mid) else (mid, hi)
    return hi


def cut_at_stop_strings(out: Any, stop: tuple[str, ...], tokenizer: Any, pad_token_id: int) -> Any:
    """A `GenerateOutput` whose rows end at their first stop string (see the module docstring)."""
    responses, mask, log_probs, lengths = (np.array(jax.device_get(x)) for x in (
        out.responses, out.response_mask, out.log_probs, out.lengths))
    for row in range(responses.shape[0]):
        keep = stop_length(responses[row, :lengths[row]], stop, tokenizer)
        if keep < lengths[row]:
            responses[row, keep:] = pad_token_id
            mask[row, keep:] = 0
            log_probs[row, keep:] = 0.0
            lengths[row] = keep

    def like(new, old):
        return jax.device_put(new, old.sharding)

    return dataclasses.replace(out, responses=like(responses, out.responses), response_mask=like(mask, out.response_mask),
                               log_probs=like(log_probs, out.log_probs), lengths=like(lengths, out.lengths))


__all__ = ["cut_at_stop_strings", "stop_length"]
