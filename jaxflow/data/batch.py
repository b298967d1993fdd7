"""`Batch`: the container that moves between roles (verl's DataProto).

A `Batch` holds three things:

* ``tensors``: numeric columns (NumPy or jax arrays), all with the same leading batch
  dimension B. These are what jit-compiled programs consume (``batch.tensors`` is a plain
  dict, hence a pytree).
* ``non_tensors``: host-side NumPy columns with the same leading dimension B, usually
  ``dtype=object`` (strings, dicts, ragged lists): ``data_source``, ``ground_truth``, raw
  prompt text, ``uid`` (the group id shared by the n responses of one prompt).
* ``meta``: provenance that is not per sample (e.g. the rollout's ``temperature``); what a
  worker computes is decided by its arguments, never by ``meta``.

Column conventions. Names follow verl where one exists so that verl users recognise them:

==========================  ===============  ===============================================
column                      shape            meaning
==========================  ===============  ===============================================
``prompt_ids``              int32[B, Lp]     prompt tokens, LEFT-padded to the prompt length
                                             Lp (the last column is the last prompt token)
``prompt_mask``             int32[B, Lp]     1 on real prompt tokens, 0 on left padding
``responses``               int32[B, Lr]     generated tokens, RIGHT-padded to the response
                                             length Lr
``response_mask``           int32[B, Lr]     1 on generated tokens (up to and including EOS)
``old_log_probs``           float32[B, Lr]   log-probs of ``responses`` under the rollout policy
``ref_log_prob``            float32[B, Lr]   log-probs under the reference policy
``values``                  float32[B, Lr]   critic values
``token_level_scores``      float32[B, Lr]   reward-model / rule scores (usually on the last token)
``token_level_rewards``     float32[B, Lr]   scores after the KL penalty
``advantages``              float32[B, Lr]   advantage estimates
``returns``                 float32[B, Lr]   value targets
==========================  ===============  ===============================================

So ``concatenate([prompt_ids, responses], axis=1)`` is the full sequence with all padding
at the two ends.

Semantics. Every operation returns a new `Batch` (arrays are shared, never copied unless
rows are gathered), except `Batch.pop`, which removes columns from ``self`` like verl's.
``a | b`` merges two batches; a key present in both must hold equal values. ``a |= b``
rebinds ``a`` to ``a | b`` (the old object is not mutated). Row selection (`__getitem__`
with a slice or an index array, `repeat`, `permute`, `pad_to_multiple`) applies to tensors
and non-tensors alike and copies ``meta``.

`Batch` is deliberately not a pytree: its object columns cannot be traced. Pass
``batch.tensors`` (a dict of arrays) to jitted functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = np.ndarray | jax.Array
ShardingLike = jax.sharding.Sharding | Callable[[str, Array], jax.sharding.Sharding]

# Column names (see the table above).
PROMPT_IDS = "prompt_ids"
PROMPT_MASK = "prompt_mask"
RESPONSES = "responses"
RESPONSE_MASK = "response_mask"
OLD_LOG_PROBS = "old_log_probs"
REF_LOG_PROB = "ref_log_prob"
VALUES = "values"
TOKEN_LEVEL_SCORES = "token_level_scores"
TOKEN_LEVEL_REWARDS = "token_level_rewards"
ADVANTAGES = "advantages"
RETURNS = "returns"

_NUMERIC_KINDS = "biufc"


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def _host(x: Any) -> Any:
    return np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else x


def values_equal(a: Any, b: Any) -> bool:
    """Equality used by union/concat conflict checks and `assert_batch_equal`.

    Arrays are equal when shape, dtype and contents match (NaN == NaN for floats); object
    arrays are compared element by element with the same rule; other values with ``==``.
    """
    if a is b:
        return True
    if _is_array(a) or _is_array(b):
        if not (_is_array(a) and _is_array(b)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        a, b = _host(a), _host(b)
        if a.dtype == object:
            return all(values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  (objects whose == is not a truth value)
        return False


def _describe(x: Any) -> str:
    if _is_array(x):
        where = "jax" if isinstance(x, jax.Array) else "numpy"
        return f"{x.dtype}{list(x.shape)} ({where})"
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_tensor(key: str, value: Any) -> Array:
    if _is_array(value):
        return value
    try:
        arr = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"tensor column {key!r} is ragged ({e}); pad it or put it in non_tensors") from e
    if arr.dtype.kind not in _NUMERIC_KINDS:
        raise TypeError(f"tensor column {key!r} is not numeric (dtype {arr.dtype}); put it in non_tensors")
    return arr


def _as_non_tensor(key: str, value: Any) -> np.ndarray:
    """Lists become numeric arrays when they are numeric, else 1-D object arrays."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, jax.Array):
        return np.asarray(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"non-tensor column {key!r} must be a sequence with one entry per row, got "
            f"{type(value).__name__}; batch-level values go in meta"
        )
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged: keep one object per row
        arr = None
    if arr is not None and arr.dtype.kind in _NUMERIC_KINDS and arr.ndim >= 1:
        return arr
    items = list(value)
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):  # element-wise so nested lists stay whole objects
        out[i] = item
    return out


def _pick(d: Mapping[str, Any], keys: str | Iterable[str] | None, kind: str) -> dict[str, Any]:
    if keys is None:
        return dict(d)
    keys = [keys] if isinstance(keys, str) else list(keys)
    missing = [k for k in keys if k not in d]
    if missing:
        raise KeyError(f"{kind} key(s) {missing} not in batch; available: {list(d)}")
    return {k: d[k] for k in keys}


def _merge(a: Mapping[str, Any], b: Mapping[str, Any], kind: str) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if k in out:
            if not values_equal(out[k], v):
                raise ValueError(
                    f"conflict on {kind} key {k!r}: both batches hold it with different "
                    f"values ({_describe(out[k])} vs {_describe(v)}); pop or rename one first"
                )
        else:
            out[k] = v
    return out


def _concat_column(key: str, parts: list[Any]) -> Array:
    first = parts[0]
    for i, p in enumerate(parts[1:], start=1):
        if p.dtype != first.dtype or p.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"cannot concatenate column {key!r}: batch {i} has {_describe(p)} but batch 0 has {_describe(first)}"
            )
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=0)
    if all(isinstance(p, jax.Array) for p in parts) and len({p.sharding for p in parts}) == 1:
        return jnp.concatenate(parts, axis=0)
    # Mixed host/device or differently placed arrays: meet on the host.
    return np.concatenate([_host(p) for p in parts], axis=0)


@dataclasses.dataclass(eq=False, repr=False)
class Batch:
    """Named columns sharing a leading batch dimension; see the module docstring."""

    tensors: dict[str, Array] = dataclasses.field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    __iter__ = None  # rows are not iterable; use keys(), or b[i:j] for row ranges.

    def __post_init__(self) -> None:
        self.tensors = dict(self.tensors)
        self.non_tensors = dict(self.non_tensors)
        self.meta = dict(self.meta)
        self._validate()

    def _validate(self) -> None:
        for k, v in self.tensors.items():
            if not isinstance(k, str):
                raise TypeError(f"column names must be str, got {k!r}")
            if not _is_array(v):
                raise TypeError(
                    f"tensor column {k!r} must be a numpy or jax array, got "
                    f"{type(v).__name__}; Batch.from_dict converts lists"
                )
            if v.dtype == object:
                raise TypeError(f"tensor column {k!r} has dtype object; put it in non_tensors")
        for k, v in self.non_tensors.items():
            if not isinstance(k, str):
                raise TypeError(f"column names must be str, got {k!r}")
            if not isinstance(v, np.ndarray):
                raise TypeError(
                    f"non-tensor column {k!r} must be a host numpy array, got "
                    f"{type(v).__name__}; Batch.from_dict converts lists"
                )
        both = set(self.tensors) & set(self.non_tensors)
        if both:
            raise ValueError(f"column(s) {sorted(both)} are both tensors and non_tensors")
        ref = None
        for k, v in [*self.tensors.items(), *self.non_tensors.items()]:
            if v.ndim == 0:
                raise ValueError(
                    f"column {k!r} is a scalar; per-sample columns need a leading batch "
                    "dimension (batch-level values go in meta)"
                )
            if ref is None:
                ref = (k, v.shape[0])
            elif v.shape[0] != ref[1]:
                raise ValueError(
                    f"column {k!r} has leading dimension {v.shape[0]} but column {ref[0]!r} "
                    f"has {ref[1]}; all columns of a Batch share the batch dimension"
                )

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, Any] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Builds a Batch, converting lists: tensors to numeric numpy arrays, non-tensors to
        numeric arrays when numeric and otherwise to 1-D object arrays (one object per row)."""
        return cls(
            tensors={k: _as_tensor(k, v) for k, v in (tensors or {}).items()},
            non_tensors={k: _as_non_tensor(k, v) for k, v in (non_tensors or {}).items()},
            meta=dict(meta or {}),
        )

    def copy(self) -> Batch:
        """Shallow copy: new dicts, same arrays."""
        return Batch(self.tensors, self.non_tensors, self.meta)

    def update(
        self,
        tensors: Mapping[str, Any] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        """A new Batch with the given columns/meta added or overwritten (union refuses to
        overwrite; use this to replace a column with a new value)."""
        new = Batch.from_dict(tensors, non_tensors, meta)
        return Batch(
            {**self.tensors, **new.tensors},
            {**self.non_tensors, **new.non_tensors},
            {**self.meta, **new.meta},
        )

    # ------------------------------------------------------------------- access
    def _size(self) -> int | None:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.non_tensors.values():
            return v.shape[0]
        return None

    def __len__(self) -> int:
        n = self._size()
        return 0 if n is None else n

    def keys(self) -> list[str]:
        """Column names: tensors first, then non-tensors (meta keys are in ``meta``)."""
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, item: Any) -> Any:
        """``b["col"]``: a column. ``b[i:j]``, ``b[int_array]``, ``b[bool_mask]``: a Batch of
        those rows. A bare int is refused (use ``b[i:i+1]``) so that a row never silently
        loses its batch dimension."""
        if isinstance(item, str):
            if item in self.tensors:
                return self.tensors[item]
            if item in self.non_tensors:
                return self.non_tensors[item]
            raise KeyError(f"no column {item!r}; columns: {self.keys()}")
        if isinstance(item, slice):
            return self._map_rows(lambda v: v[item])
        if isinstance(item, (int, np.integer)):
            raise TypeError(f"b[{item}]: index rows with a slice b[i:i+1] or an index array")
        return self._take(self._normalize_index(item))

    def _normalize_index(self, item: Any) -> np.ndarray:
        idx = np.asarray(_host(item))
        n = len(self)
        if idx.size == 0 and idx.dtype.kind not in "bi":
            idx = idx.astype(np.int64)
        if idx.ndim != 1:
            raise IndexError(f"row index must be 1-D, got shape {idx.shape}")
        if idx.dtype == bool:
            if idx.shape[0] != n:
                raise IndexError(f"boolean mask of length {idx.shape[0]} for a batch of {n}")
            return np.flatnonzero(idx)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"row index must be integer or boolean, got dtype {idx.dtype}")
        if idx.size and (idx.min() < -n or idx.max() >= n):
            # Checked here because jax clamps out-of-range gathers silently.
            raise IndexError(f"row index out of range for a batch of {n}: {idx.min()}..{idx.max()}")
        return idx % n if n else idx

    def _map_rows(self, fn: Callable[[Any], Any]) -> Batch:
        return Batch(
            {k: fn(v) for k, v in self.tensors.items()},
            {k: fn(v) for k, v in self.non_tensors.items()},
            self.meta,
        )

    def _take(self, idx: np.ndarray) -> Batch:
        return self._map_rows(lambda v: v[idx])

    # ----------------------------------------------------------- column ops
    def select(
        self,
        tensor_keys: str | Iterable[str] | None = None,
        non_tensor_keys: str | Iterable[str] | None = None,
        meta_keys: str | Iterable[str] | None = None,
    ) -> Batch:
        """A Batch with only the named keys; ``None`` keeps all keys of that kind (as verl)."""
        return Batch(
            _pick(self.tensors, tensor_keys, "tensor"),
            _pick(self.non_tensors, non_tensor_keys, "non-tensor"),
            _pick(self.meta, meta_keys, "meta"),
        )

    def pop(
        self,
        tensor_keys: str | Iterable[str] | None = None,
        non_tensor_keys: str | Iterable[str] | None = None,
        meta_keys: str | Iterable[str] | None = None,
    ) -> Batch:
        """Removes the named keys from ``self`` and returns them as a Batch. ``None`` pops
        nothing of that kind (as verl). All keys are checked before anything is removed."""
        picked = [
            _pick(d, [] if keys is None else keys, kind)
            for d, keys, kind in (
                (self.tensors, tensor_keys, "tensor"),
                (self.non_tensors, non_tensor_keys, "non-tensor"),
                (self.meta, meta_keys, "meta"),
            )
        ]
        for d, p in zip((self.tensors, self.non_tensors, self.meta), picked):
            for k in p:
                del d[k]
        return Batch(*picked)

    def rename(self, mapping: Mapping[str, str]) -> Batch:
        """A Batch with columns renamed ``old -> new`` (tensors and non-tensors)."""
        missing = [k for k in mapping if k not in self]
        if missing:
            raise KeyError(f"cannot rename {missing}: not columns; columns: {self.keys()}")
        names = [mapping.get(k, k) for k in self.keys()]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rename {dict(mapping)} gives several columns the name(s) {dup}")
        tensors = {mapping.get(k, k): v for k, v in self.tensors.items()}
        non_tensors = {mapping.get(k, k): v for k, v in self.non_tensors.items()}
        return Batch(tensors, non_tensors, self.meta)

    def union(self, other: Batch) -> Batch:
        """Merges columns and meta. Shared keys must hold equal values; sizes must match."""
        if not isinstance(other, Batch):
            raise TypeError(f"cannot union a Batch with {type(other).__name__}")
        n, m = self._size(), other._size()
        if n is not None and m is not None and n != m:
            raise ValueError(f"cannot union batches of different sizes: {n} rows vs {m} rows")
        return Batch(
            _merge(self.tensors, other.tensors, "tensor"),
            _merge(self.non_tensors, other.non_tensors, "non-tensor"),
            _merge(self.meta, other.meta, "meta"),
        )

    def __or__(self, other: Any) -> Batch:
        if not isinstance(other, Batch):
            return NotImplemented
        return self.union(other)

    # -------------------------------------------------------------- row ops
    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: interleaved ``[a, a, b, b]`` (verl's rollout.n) or tiled
        ``[a, b, a, b]``."""
        if n < 1:
            raise ValueError(f"repeat count must be >= 1, got {n}")
        rows = np.arange(len(self))
        return self._take(np.repeat(rows, n) if interleave else np.tile(rows, n))

    def chunk(self, k: int) -> list[Batch]:
        """``k`` equal consecutive chunks; the size must be divisible by ``k``."""
        n = len(self)
        if k < 1:
            raise ValueError(f"number of chunks must be >= 1, got {k}")
        if n % k:
            raise ValueError(
                f"cannot chunk a batch of {n} rows into {k} equal chunks ({n} is not "
                f"divisible by {k}); pad it first with pad_to_multiple({k})"
            )
        s = n // k
        return [self[i * s : (i + 1) * s] for i in range(k)]

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of ``size`` rows; the last one may be shorter."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self[i : i + size] for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Concatenates along the batch dimension. All batches must have the same column
        names; meta is merged (a key in several batches must hold equal values).

        Device arrays that share a sharding are concatenated on device; otherwise the
        column is concatenated on the host."""
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if set(b.tensors) != set(first.tensors):
                raise ValueError(
                    f"batch {i} has tensor keys {sorted(b.tensors)} but batch 0 has {sorted(first.tensors)}"
                )
            if set(b.non_tensors) != set(first.non_tensors):
                raise ValueError(
                    f"batch {i} has non-tensor keys {sorted(b.non_tensors)} but batch 0 has {sorted(first.non_tensors)}"
                )
        meta: dict[str, Any] = {}
        for b in batches:
            meta = _merge(meta, b.meta, "meta")
        return Batch(
            {k: _concat_column(k, [b.tensors[k] for b in batches]) for k in first.tensors},
            {k: _concat_column(k, [b.non_tensors[k] for b in batches]) for k in first.non_tensors},
            meta,
        )

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Pads to a multiple of ``k`` rows by appending copies of the first rows (cycling
        when more padding than rows is needed), like verl's pad_dataproto_to_divisor.
        Returns ``(padded, pad_size)``; `unpad(pad_size)` undoes it."""
        if k < 1:
            raise ValueError(f"pad multiple must be >= 1, got {k}")
        n = len(self)
        pad = (-n) % k
        if pad == 0:
            return self.copy(), 0
        return self._take(np.concatenate([np.arange(n), np.arange(pad) % n])), pad

    def unpad(self, pad_size: int) -> Batch:
        """Drops the last ``pad_size`` rows (added by `pad_to_multiple`)."""
        n = len(self)
        if not 0 <= pad_size <= n:
            raise ValueError(f"pad_size must be in [0, {n}] for a batch of {n}, got {pad_size}")
        return self[: n - pad_size] if pad_size else self.copy()

    def permute(self, idx: Any) -> Batch:
        """Reorders rows: row ``i`` of the result is row ``idx[i]`` of ``self``."""
        idx = np.asarray(_host(idx))
        if idx.shape != (len(self),) or not np.array_equal(np.sort(idx), np.arange(len(self))):
            raise ValueError(f"permute needs a permutation of range({len(self)}), got {idx}")
        return self._take(idx)

    def shuffle(self, seed: int | np.random.Generator) -> Batch:
        """Rows in a random order, drawn on the host: the same seed gives the same order."""
        return self.permute(np.random.default_rng(seed).permutation(len(self)))

    # ------------------------------------------------------------ placement
    def to_host(self) -> Batch:
        """All tensors as numpy arrays."""
        return Batch({k: _host(v) for k, v in self.tensors.items()}, self.non_tensors, self.meta)

    def to_device(self, sharding: ShardingLike | None = None) -> Batch:
        """Places every tensor with ``jax.device_put``. ``sharding`` is one
        ``jax.sharding.Sharding`` for all tensors, or a callable ``(name, array) ->
        Sharding`` per column, or None for the default device. Non-tensors stay on host."""
        out = {}
        for k, v in self.tensors.items():
            if sharding is None or isinstance(sharding, jax.sharding.Sharding):
                s = sharding
            else:
                s = sharding(k, v)
            try:
                out[k] = jax.device_put(v, s)
            except ValueError as e:
                raise ValueError(f"cannot place tensor column {k!r} ({_describe(v)}): {e}") from e
        return Batch(out, self.non_tensors, self.meta)

    # -------------------------------------------------------------- testing
    def equals(self, other: Batch) -> bool:
        """Same keys and equal values everywhere (see `values_equal`)."""
        try:
            assert_batch_equal(self, other)
        except AssertionError:
            return False
        return True

    def __repr__(self) -> str:
        def cols(d: Mapping[str, Any]) -> str:
            return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in d.items()) + "}"

        return (
            f"Batch(len={len(self)}, tensors={cols(self.tensors)}, "
            f"non_tensors={cols(self.non_tensors)}, meta={cols(self.meta)})"
        )


def assert_batch_equal(a: Batch, b: Batch) -> None:
    """Raises AssertionError naming the first key where ``a`` and ``b`` differ."""
    for kind, da, db in (
        ("tensor", a.tensors, b.tensors),
        ("non-tensor", a.non_tensors, b.non_tensors),
        ("meta", a.meta, b.meta),
    ):
        if set(da) != set(db):
            raise AssertionError(f"{kind} keys differ: {sorted(da)} vs {sorted(db)}")
        for k in da:
            if not values_equal(da[k], db[k]):
                raise AssertionError(
                    f"{kind} {k!r} differs: {_describe(da[k])} vs {_describe(db[k])}\n{da[k]!r}\nvs\n{db[k]!r}"
                )
