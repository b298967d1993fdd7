"""The critic: token values and the clipped value-loss update.

``values[b, t]`` is the value head's output at position ``P - 1 + t`` of ``[prompt |
response]`` (the state before response token ``t``), 0 on padding. The update minimises
`jaxflow.algos.compute_value_loss`::

    v_clip = clip(vpreds, values - eps_v, values + eps_v)
    L      = 0.5 agg(max((vpreds - R)^2, (v_clip - R)^2))

over PPO epochs of shuffled mini-batches (one optimizer step each, gradients accumulated over
micro-batches with the mini-batch's normalisers). Metrics: ``critic/vf_loss``,
``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm``, ``critic/lr``,
``critic/update_skipped``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxflow.algos import compute_value_loss, masked_sum
from jaxflow.data.batch import Batch
from jaxflow.mesh import MeshSpec, Role, Rules
from jaxflow.workers.base import ModelLike, RoleLayout, num_micro_batches, row_program
from jaxflow.workers.forward import PROMPT_KEYS, ForwardConfig, response_values, trained_tokens
from jaxflow.workers.group import DP_TRAIN
from jaxflow.workers.optim import OptimConfig
from jaxflow.workers.protocols import DP_COMPUTE, register
from jaxflow.workers.trainable import TrainableWorker, UpdateLoopConfig


@dataclasses.dataclass(frozen=True)
class CriticConfig(UpdateLoopConfig):
    """The value update (verl's ``critic``). Batch sizes count responses.

    Attributes:
      ppo_mini_batch_size, ppo_micro_batch_size_per_device, ppo_epochs, shuffle, seed: the
        update loop (`UpdateLoopConfig`).
      cliprange_value: ``eps_v``.
      loss_agg_mode, loss_scale_factor: aggregation of the value loss.
      forward_micro_batch_size_per_device: micro-batch of the `CriticWorker.values` forward.
      use_remove_padding: value and update forwards over packed real tokens
        (`jaxflow.workers.packing`); ``use_dynamic_bsz``: then micro-batches of at most
        ``ppo_max_token_len_per_device`` (update) / ``forward_max_token_len_per_device``
        (values) tokens per device instead of fixed row counts.
      optim: optimizer and schedule (read when the worker is built).
    """

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    forward_micro_batch_size_per_device: int | None = None
    use_remove_padding: bool = False
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_device: int = 32768
    forward_max_token_len_per_device: int = 32768
    optim: OptimConfig = OptimConfig(lr=1e-5)

    UPDATE_KEYS = PROMPT_KEYS + ("values", "returns")
    SCALAR_NAMES = ()  # the train step's scalars
    STEP_NAME = "critic_train_step"

    def loss_fn(self):
        """The train step's loss (`critic_loss`)."""
        return critic_loss(self)

    def update_keys(self, on_policy: bool = False) -> tuple[str, ...]:
        """`UPDATE_KEYS` and the loss mask when it has one (the critic reads no old log-probs:
        ``on_policy`` changes nothing)."""
        return self.UPDATE_KEYS + self.loss_mask_keys()

    def loss_key(self) -> tuple:
        """The fields the compiled train step depends on (besides the micro-batch count)."""
        return (self.cliprange_value, self.loss_agg_mode, self.loss_scale_factor)

    @property
    def values_forward(self) -> ForwardConfig:
        """How `CriticWorker.values` runs."""
        return ForwardConfig(
            self.forward_micro_batch_size_per_device,
            self.use_remove_padding,
            self.forward_max_token_len_per_device if self.use_dynamic_bsz else None,
        )


def critic_loss(cfg: CriticConfig):
    """The critic's ``loss_fn(model, micro, gbi, scalars) -> (loss, aux)`` for
    `make_train_step`; ``aux`` values add up over micro-batches."""

    def loss_fn(model, micro, gbi, scalars):
        mask = trained_tokens(micro)
        vpreds = response_values(model, micro)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds,
            micro["returns"],
            micro["values"],
            mask,
            cfg.cliprange_value,
            cfg.loss_agg_mode,
            **gbi,
        )
        total = jax.numpy.maximum(gbi["batch_num_tokens"], 1).astype(vpreds.dtype)
        share = masked_sum(jax.numpy.ones_like(vpreds), mask) / total
        aux = {
            "vf_loss": vf_loss,
            "vf_clipfrac": vf_clipfrac * share,
            "vpred_mean": masked_sum(vpreds, mask) / total,
        }
        return vf_loss, aux

    return loss_fn


def values_fn(model, t, _):
    """``{"values": [B, R]}`` from padded rows or a packed micro-batch."""
    return {"values": response_values(model, t)}


def values_program(layout: RoleLayout, num_micro: int):
    """``jit(params, tensors, {}) -> {"values": [B, R]}`` in ``num_micro`` micro-batches."""
    return row_program(layout, values_fn, num_micro, name="values")


class CriticWorker(TrainableWorker):
    """Value model: `values`, `update`.

    Args:
      model: a value model (``nnx.Module`` with the ``value`` head, ``(graphdef, state)``, or
        a checkpoint directory, loaded with ``head="value"``; an actor checkpoint gives a
        zero-initialised value head).
      mesh, rules: the critic's mesh and rules.
      config: the update.
    """

    role = Role.CRITIC

    def __init__(
        self, model: ModelLike, mesh: Mesh | MeshSpec | str, rules: Rules | str, config: CriticConfig = CriticConfig()
    ):
        super().__init__(model, mesh, rules, config)

    @register(DP_COMPUTE)
    def values(self, batch: Batch) -> Batch:
        """``values`` [B, R] of the responses (0 on padding)."""
        return self.run_forward(batch, self.config.values_forward, "values", values_fn, {}, self.values_program)

    def values_program(self, rows: int):
        """The jitted value forward of ``rows`` responses (`values_program`)."""
        k = num_micro_batches(
            rows, self.config.values_forward.micro_batch_size_per_device, self.dp_size, "critic values"
        )
        return self._compiled(("values", k), lambda: values_program(self.layout, k))

    @register(DP_TRAIN)
    def update(self, batch: Batch, *, step: int | None = None) -> dict[str, np.ndarray]:
        """PPO epochs of value updates; needs ``values`` (rollout-time) and ``returns``.
        ``step``: the training step, which seeds the shuffle (None: this worker's call count)."""
        host = self.host_columns(batch, self.config.update_keys())
        return self.update_epochs(host, {}, step=step)[0]

    def train_step(self, minibatch: Mapping[str, Any]) -> dict[str, float]:
        """One optimizer step on one mini-batch (all rows, in order)."""
        return self.step_on(minibatch, self.config.update_keys(), {})
