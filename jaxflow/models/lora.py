"""LoRA adapters (Hu et al., arXiv 2106.09685) on the decoder's projections.

A projection ``y = x W`` (``W``: ``[in..., out...]``, e.g. ``q_proj`` ``[D, H, K]``, ``o_proj``
``[H, K, D]``) gains a low-rank update of rank ``r``::

    y = x W + s * (dropout(x) A) B          A: [in..., r],  B: [r, out...],  s = alpha / r

``A`` starts as PEFT's (Kaiming-uniform: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``), ``B`` at
zero, so an adapted model starts equal to its base. The merged weight ``W + s A B`` (over the
flattened in and out dimensions) gives the same outputs without the adapter path
(`merge_adapters`). Adapters are ``nnx.LoRAParam`` variables named ``<projection>_lora``
beside their projection (``model.layers.3.self_attn.q_proj_lora.a``); their ``logical_axes``
are the projection's, with ``None`` for the rank (replicated), so they shard like their
weight. They are float32 (``LoRAConfig.param_dtype``) whatever the base weights' dtype.

Dropout acts on the adapter's input during training only: inside `lora_dropout` (the train
step enters it with a key per micro-batch), elsewhere the adapters are deterministic.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# PEFT's names of the decoder's linear layers, and how many leading dimensions of jaxflow's
# weight are its input features (the rest are its output features).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_DIMS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}
ALL_LINEAR = "all-linear"
SUFFIX = "_lora"


def parse_target_modules(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"all-linear"`` (PEFT's: every projection of the decoder, not the LM head), or names
    (``"q_proj,v_proj"`` or a list) among `LORA_TARGETS`, in that order."""
    names = [value] if isinstance(value, str) else list(value)
    names = [n.strip() for part in names for n in str(part).split(",") if n.strip()]
    if names == [ALL_LINEAR]:
        return LORA_TARGETS
    unknown = sorted(set(names) - set(LORA_TARGETS))
    if unknown or not names:
        raise ValueError(
            f"target_modules {value!r}: {'unknown ' + str(unknown) if unknown else 'empty'}; use "
            f"{ALL_LINEAR!r} or names among {list(LORA_TARGETS)}"
        )
    return tuple(n for n in LORA_TARGETS if n in names)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Rank ``rank`` adapters scaled by ``alpha / rank`` on the projections ``targets``, with
    ``dropout`` on their input in training, stored in ``param_dtype``."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS
    dropout: float = 0.0
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.alpha}")
        object.__setattr__(self, "targets", parse_target_modules(self.targets))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        """``s = alpha / r`` (PEFT's scaling without rsLoRA)."""
        return self.alpha / self.rank


# --- dropout ---------------------------------------------------------------------------------

_DROPOUT_KEY: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxflow_lora_dropout_key", default=None)


@contextlib.contextmanager
def lora_dropout(key: jax.Array) -> Iterator[None]:
    """Within this context (at trace time) adapters drop their inputs at their config's rate,
    with masks drawn from ``key`` (folded with the layer, see `layer_scope`, and the
    projection); outside it they are deterministic (inference, rollouts)."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


@contextlib.contextmanager
def layer_scope(index: Any) -> Iterator[None]:
    """Folds the layer ``index`` (an int, or a traced one inside a layer scan) into the dropout
    key, so every layer draws its own masks; a no-op outside `lora_dropout`."""
    key = _DROPOUT_KEY.get()
    if key is None:
        yield
        return
    token = _DROPOUT_KEY.set(jax.random.fold_in(key, index))
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


# --- the adapter -----------------------------------------------------------------------------


class LoRA(nnx.Module):
    """The low-rank update of one projection (see the module docstring): ``__call__(x)`` maps
    ``x [B, L, in...]`` to ``s * (dropout(x) A) B`` ``[B, L, out...]``."""

    def __init__(self, name: str, weight: nnx.Param, cfg: LoRAConfig, rngs: nnx.Rngs):
        n_in = INPUT_DIMS[name]
        shape, axes = tuple(weight.get_value().shape), tuple(weight.get_metadata()["logical_axes"])
        self.in_shape, self.out_shape = shape[:n_in], shape[n_in:]
        self.scale, self.rate, self.salt = cfg.scale, cfg.dropout, LORA_TARGETS.index(name)
        bound = 1.0 / math.sqrt(math.prod(self.in_shape))
        a = jax.random.uniform(rngs.params(), (*self.in_shape, cfg.rank), cfg.param_dtype, -bound, bound)
        self.a = nnx.LoRAParam(a, logical_axes=(*axes[:n_in], None))
        self.b = nnx.LoRAParam(
            jnp.zeros((cfg.rank, *self.out_shape), cfg.param_dtype), logical_axes=(None, *axes[n_in:])
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        B, L = x.shape[:2]
        r = self.a.get_value().shape[-1]
        x_TxI = x.reshape(B * L, math.prod(self.in_shape))
        key = _DROPOUT_KEY.get()
        if key is not None and self.rate > 0:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.salt), 1.0 - self.rate, x_TxI.shape)
            x_TxI = jnp.where(keep, x_TxI / (1.0 - self.rate), 0).astype(x.dtype)
        h_TxR = x_TxI @ self.a[...].astype(x.dtype).reshape(-1, r)
        y_TxO = h_TxR @ self.b[...].astype(x.dtype).reshape(r, -1)
        return (self.scale * y_TxO).reshape(B, L, *self.out_shape)


def attach(module: nnx.Module, cfg: LoRAConfig | None, rngs: nnx.Rngs) -> None:
    """Gives ``module`` (an attention or MLP block) an adapter ``<name>_lora`` for each of its
    projections among ``cfg.targets`` (nothing without a config)."""
    if cfg is None:
        return
    for name in cfg.targets:
        weight = getattr(module, name, None)
        if weight is not None:
            setattr(module, name + SUFFIX, LoRA(name, weight, cfg, rngs))


def adapter_of(module: nnx.Module, name: str) -> LoRA | None:
    """The adapter of ``module``'s projection ``name``, or None."""
    return getattr(module, name + SUFFIX, None)


# --- states ----------------------------------------------------------------------------------


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """``(base, adapters)``: a model's state without its `LoRA` parameters, and those alone."""
    return nnx.split_state(state, nnx.Not(nnx.LoRAParam), nnx.LoRAParam)


# Heads that train beside the adapters (PEFT's ``modules_to_save``): a value model's, which
# starts at zero and has no pretrained weights to keep.
TRAINED_HEADS = ("score", "score_bias")
_TRAINED = nnx.Any(nnx.LoRAParam, *(nnx.PathContains(name) for name in TRAINED_HEADS))


def split_trained(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """``(frozen, trained)`` of an adapted model that trains: the base weights, and the
    adapters with a value model's head (`TRAINED_HEADS`; a language model has none)."""
    return nnx.split_state(state, nnx.Not(_TRAINED), _TRAINED)


def trained_mask(state: nnx.State) -> list[bool]:
    """Per leaf of ``state`` (in ``jax.tree.leaves`` order), whether an adapted model trains it
    (`split_trained`'s split); all False for a model without adapters."""
    flat = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if not any(isinstance(v, nnx.LoRAParam) for _, v in flat):
        return [False] * len(flat)
    return [isinstance(v, nnx.LoRAParam) or getattr(path[0], "key", None) in TRAINED_HEADS for path, v in flat]


def has_adapters(state: nnx.State) -> bool:
    return bool(jax.tree.leaves(nnx.filter_state(state, nnx.LoRAParam)))


def join(base: nnx.State, adapters: nnx.State) -> nnx.State:
    """The adapted model's whole state from its two parts (no array is copied)."""
    return nnx.merge_state(base, adapters)


def _pairs(adapters: nnx.State) -> dict[tuple, tuple[jax.Array, jax.Array]]:
    """``{path of the adapted weight: (A, B)}`` (paths as ``nnx.to_flat_state`` spells them)."""
    flat = dict(nnx.to_flat_state(adapters))
    out = {}
    for path, a in flat.items():
        if path[-1] == "a":
            owner, name = path[:-2], path[-2]
            out[(*owner, name[: -len(SUFFIX)])] = (a.get_value(), flat[(*path[:-1], "b")].get_value())
    return out


def delta(name: str, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``s A B`` of projection ``name`` in its weight's shape, in float32: A is ``[lead...,
    in..., r]``, B ``[lead..., r, out...]`` (``lead``: the ``layers`` dimension of stacked
    layers, or nothing)."""
    r = a.shape[-1]
    lead = a.shape[: a.ndim - 1 - INPUT_DIMS[name]]
    a_flat = a.reshape(*lead, -1, r).astype(jnp.float32)
    b_flat = b.reshape(*lead, r, -1).astype(jnp.float32)
    return (scale * (a_flat @ b_flat)).reshape(*a.shape[:-1], *b.shape[len(lead) + 1 :])


def merge_adapters(base: nnx.State, adapters: nnx.State, cfg: LoRAConfig, dtype: Any = None) -> nnx.State:
    """The base state with every adapted weight replaced by ``W + s A B`` (computed in float32,
    stored in ``dtype``; None: each weight's own), the other floating parameters cast to
    ``dtype``: the state of the model without adapters that computes what the adapted model
    does (`without_adapters`'s graph). Pure: jit it with the shardings wanted."""
    pairs = _pairs(adapters)

    def merged(path, v):
        w = v.get_value()
        out = dtype or w.dtype
        if path in pairs:
            a, b = pairs[path]
            w = (w.astype(jnp.float32) + delta(path[-1], a, b, cfg.scale)).astype(out)
        elif jnp.issubdtype(w.dtype, jnp.floating):
            w = w.astype(out)
        return v.replace(w)

    flat = [(path, merged(path, v)) for path, v in nnx.to_flat_state(base)]
    return nnx.from_flat_state(flat)


def without_adapters(model_config: Any) -> Any:
    """``model_config`` with ``lora=None``: the base model's (its graph has no adapters)."""
    return model_config.replace(lora=None)
