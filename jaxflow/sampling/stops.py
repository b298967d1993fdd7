"""Stop strings, matched on the device while a row decodes.

A row stops after the token that completes the first occurrence of any stop string in its
response text (the token stays in the response, masked in, like EOS). The text of a response
is the concatenation of its tokens' texts, each token's text taken from the tokenizer in
context: ``decode([a, t])`` minus ``decode([a])`` for a plain anchor token ``a`` (so
SentencePiece's word-start spaces are kept), which equals ``decode(response)`` for
tokenizers that decode token by token (byte-level BPE, SentencePiece, the character
tokenizer). A stop string inside one multi-byte character split over byte tokens is not seen.

Matching is an Aho-Corasick automaton over the characters of the stop strings, lifted to
tokens once on the host: a state is the longest prefix of a stop string that the text ends
with; feeding token t's characters to state s gives ``next_state[s, class(t)]`` and
``hit[s, class(t)]`` (a stop string completed inside t). Tokens that act alike on every state
share a class: every token without a character of the stop strings sends every state to the
root, so the tables stay small ([states, classes], states <= total stop length + 1) while
``token_class`` has one entry per vocabulary id. On the device each decode slot carries its
state; one gather per step updates it (`StopStrings` tables are program arguments: another
set of stop strings of the same bucketed size reuses the compiled program).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

_ROOT = 0


def _automaton(strings: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Aho-Corasick over characters: ``delta`` [states, alphabet] (full transition function),
    ``out`` [states] (a stop string ends here, itself or through a suffix) and the alphabet."""
    alphabet = {ch: i for i, ch in enumerate(sorted({ch for s in strings for ch in s}))}
    goto: list[dict[str, int]] = [{}]
    out = [False]
    for s in strings:
        node = _ROOT
        for ch in s:
            if ch not in goto[node]:
                goto.append({})
                out.append(False)
                goto[node][ch] = len(goto) - 1
            node = goto[node][ch]
        out[node] = True
    delta = np.zeros((len(goto), len(alphabet)), np.int32)
    fail = [_ROOT] * len(goto)
    order = list(goto[_ROOT].values())  # breadth first: a node's fail link is shallower
    for ch, i in alphabet.items():
        delta[_ROOT, i] = goto[_ROOT].get(ch, _ROOT)
    while order:
        node = order.pop(0)
        out[node] = out[node] or out[fail[node]]
        for ch, i in alphabet.items():
            child = goto[node].get(ch)
            if child is None:
                delta[node, i] = delta[fail[node], i]
            else:
                fail[child] = _ROOT if node == _ROOT else int(delta[fail[node], i])
                delta[node, i] = child
                order.append(child)
    return delta, np.asarray(out), alphabet


def token_texts(tokenizer: Any, vocab_size: int) -> list[str]:
    """Each id's text in context (module docstring); ids the tokenizer cannot decode: ""."""

    def decode(ids):
        try:
            return tokenizer.decode(ids)
        except Exception:  # noqa: BLE001 - ids past the tokenizer's vocabulary (padded embeddings)
            return ""

    anchor = next((i for i in range(vocab_size) if decode([i]).isalnum()), None)
    if anchor is None:
        return [decode([t]) for t in range(vocab_size)]
    head = decode([anchor])
    texts = []
    for t in range(vocab_size):
        pair = decode([anchor, t])
        texts.append(pair[len(head) :] if pair.startswith(head) else decode([t]))
    return texts


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True, eq=False)
class StopStrings:
    """The device tables of a set of stop strings for one tokenizer (module docstring).

    ``token_class_V`` int32 [V]; ``next_state_SxC`` int32 and ``hit_SxC`` bool [states,
    classes], both padded to powers of two (padding is never reached). Build with `build`."""

    strings: tuple[str, ...]
    token_class_V: np.ndarray
    next_state_SxC: np.ndarray
    hit_SxC: np.ndarray

    @staticmethod
    def build(strings: tuple[str, ...] | str, tokenizer: Any, vocab_size: int) -> StopStrings:
        """The tables of ``strings`` for ``tokenizer`` (anything with ``decode(ids)``) over a
        model vocabulary of ``vocab_size`` ids; cached per (strings, tokenizer, size)."""
        strings = (strings,) if isinstance(strings, str) else tuple(strings)
        if not strings or any(not isinstance(s, str) or not s for s in strings):
            raise ValueError(f"stop strings must be non-empty strings, got {strings!r}")
        return _build(strings, tokenizer, vocab_size)


def scan_tokens(tokens, stop_tables: tuple) -> tuple[int, bool]:
    """The automaton run on the host over ``tokens`` (a row's response so far) with the
    tables ``(token_class_V, next_state_SxC, hit_SxC)``: the state after them and whether one
    of them completed a stop string (what the device's decode steps compute token by token)."""
    token_class_V, next_state_SxC, hit_SxC = stop_tables
    state, hit = _ROOT, False
    for token in np.asarray(tokens).reshape(-1):
        cls = token_class_V[token]
        state, hit = int(next_state_SxC[state, cls]), hit or bool(hit_SxC[state, cls])
    return state, hit


@functools.lru_cache(maxsize=16)
def _build(strings: tuple[str, ...], tokenizer: Any, vocab_size: int) -> StopStrings:
    delta, out, alphabet = _automaton(strings)
    states = delta.shape[0]
    texts = token_texts(tokenizer, vocab_size)
    # every token's effect on every state, computed for all tokens at once, one character
    # position at a time: [V, states] current states and hits
    width = max(len(t) for t in texts) if texts else 0
    chars = np.full((vocab_size, max(width, 1)), -2, np.int32)  # -2: past the token's end, -1: not in the alphabet
    for v, text in enumerate(texts):
        chars[v, : len(text)] = [alphabet.get(ch, -1) for ch in text]
    relevant = np.flatnonzero((chars >= 0).any(axis=1))
    state = np.broadcast_to(np.arange(states, dtype=np.int32), (len(relevant), states)).copy()
    hit = np.zeros_like(state, dtype=bool)
    for j in range(chars.shape[1]):
        c = chars[relevant, j][:, None]
        state = np.where(c == -2, state, np.where(c == -1, _ROOT, delta[state, np.maximum(c, 0)]))
        hit |= out[state] & (c >= 0)
    # classes: 0 = no stop character (every state -> root), 1 = empty text (no change), then
    # the distinct effects of the relevant tokens
    empty = np.array([len(t) == 0 for t in texts])
    behaviour = np.concatenate([state, hit], axis=1)
    unique, inverse = np.unique(behaviour, axis=0, return_inverse=True)
    token_class = np.where(empty, 1, 0).astype(np.int32)
    token_class[relevant] = 2 + inverse.reshape(-1)
    S, C = _bucket(states), _bucket(2 + len(unique))
    next_state = np.zeros((S, C), np.int32)
    hits = np.zeros((S, C), bool)
    next_state[:states, 1] = np.arange(states)
    next_state[:states, 2 : 2 + len(unique)] = unique[:, :states].T
    hits[:states, 2 : 2 + len(unique)] = unique[:, states:].T.astype(bool)
    return StopStrings(strings, token_class, next_state, hits)


__all__ = ["StopStrings", "scan_tokens", "token_texts"]
