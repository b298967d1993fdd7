"""Optimizers of the training roles: AdamW with gradient clipping by global norm and a linear
warmup followed by a constant or cosine learning rate (verl's ``actor.optim`` /
``critic.optim``).

Schedule, with ``W`` warmup steps, ``T`` total steps, peak ``lr`` and ``r = min_lr_ratio``::

    lr(s) = lr * s / W                                            s < W   (linear warmup from 0)
    lr(s) = lr                                                    constant
    lr(s) = lr * (r + (1 - r) * (1 + cos(pi * (s - W) / (T - W))) / 2)   cosine, s >= W

``s`` counts applied optimizer steps (a refused non-finite update does not count). As in
verl, the very first step of a warmup runs at ``lr * 0``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW + clipping + schedule (field names as verl's ``optim`` section).

    Attributes:
      lr: peak learning rate.
      weight_decay: decoupled weight decay (AdamW), applied to every parameter as verl does.
      betas: Adam's ``(b1, b2)``.
      eps: Adam's epsilon.
      grad_clip: maximum global gradient norm; ``None`` or ``<= 0`` disables clipping.
      lr_warmup_steps: linear warmup length; negative: ``lr_warmup_steps_ratio`` of
        ``total_training_steps``.
      lr_warmup_steps_ratio: see ``lr_warmup_steps``.
      warmup_style: ``"constant"`` or ``"cosine"`` after the warmup.
      min_lr_ratio: the cosine schedule's floor, as a fraction of ``lr``.
      total_training_steps: optimizer steps of the whole run (needed by ``cosine`` and by a
        warmup ratio).
      state_dtype: dtype of Adam's moments (gradients are cast to it before Adam), e.g.
        float32 moments for bfloat16 parameters; None keeps the gradients' dtype.
    """

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    warmup_style: str = "constant"
    min_lr_ratio: float = 0.0
    total_training_steps: int | None = None
    state_dtype: str | None = "float32"

    def __post_init__(self):
        if self.warmup_style not in ("constant", "cosine"):
            raise ValueError(f"warmup_style must be 'constant' or 'cosine', got {self.warmup_style!r}")
        if self.warmup_style == "cosine" and not self.total_training_steps:
            raise ValueError("a cosine schedule needs total_training_steps")
        if self.lr_warmup_steps < 0 and self.lr_warmup_steps_ratio > 0 and not self.total_training_steps:
            raise ValueError("a warmup ratio (lr_warmup_steps < 0) needs total_training_steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @property
    def num_warmup_steps(self) -> int:
        if self.lr_warmup_steps >= 0:
            return int(self.lr_warmup_steps)
        return int(self.lr_warmup_steps_ratio * (self.total_training_steps or 0))


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """The learning rate as a function of the applied-step count (see the module docstring)."""
    warmup = cfg.num_warmup_steps
    if cfg.warmup_style == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        decay_steps = max(1, cfg.total_training_steps - warmup)
        after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    if warmup <= 0:
        return after
    # join_schedules hands `after` the steps counted from the end of the warmup.
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def make_optimizer(cfg: OptimConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(tx, schedule)``: clip-by-global-norm then AdamW driven by :func:`make_schedule`."""
    schedule = make_schedule(cfg)
    adamw = optax.adamw(
        learning_rate=schedule,
        b1=cfg.betas[0],
        b2=cfg.betas[1],
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
    chain = []
    if cfg.grad_clip is not None and cfg.grad_clip > 0:
        chain.append(optax.clip_by_global_norm(cfg.grad_clip))
    if cfg.state_dtype is not None:
        dtype = jnp.dtype(cfg.state_dtype)
        chain.append(optax.stateless(lambda updates, params=None: _cast_floats(updates, dtype)))
        adamw = _init_in_dtype(adamw, dtype)
    chain.append(adamw)
    return (chain[0] if len(chain) == 1 else optax.chain(*chain)), schedule


def _cast_floats(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _init_in_dtype(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """``tx`` whose state is created from the parameters cast to ``dtype``: Adam's moments
    are ``dtype`` from the first step (not only after it), so the jitted train step sees the
    same state types at every call and compiles once."""
    return optax.GradientTransformation(lambda params: tx.init(_cast_floats(params, dtype)), tx.update)
