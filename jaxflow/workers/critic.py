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
from jaxflow.mesh import MeshSpec, Rules
from jaxflow.workers.base import (
    ModelLike,
    RoleLayout,
    TrainableWorker,
    host_array,
    num_micro_batches,
    packed_forward,
    row_program,
)
from jaxflow.workers.forward import PROMPT_KEYS, response_values
from jaxflow.workers.group import DP_TRAIN
from jaxflow.workers.optim import OptimConfig, make_optimizer
from jaxflow.workers.packing import PACKED_KEYS, PackedLayout, pack_minibatch
from jaxflow.workers.protocols import DP_COMPUTE, register
from jaxflow.workers.train_state import make_train_step, minibatch_indices


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """The value update (verl's ``critic``). Batch sizes count responses.

    Attributes:
      ppo_mini_batch_size, ppo_micro_batch_size_per_device, ppo_epochs, shuffle, seed: as
        for the actor.
      cliprange_value: ``eps_v``.
      loss_agg_mode, loss_scale_factor: aggregation of the value loss.
      forward_micro_batch_size_per_device: micro-batch of the `CriticWorker.values` forward.
      use_remove_padding: value and update forwards over packed real tokens
        (`jaxflow.workers.packing`); ``use_dynamic_bsz``: then micro-batches of at most
        ``ppo_max_token_len_per_device`` (update) / ``forward_max_token_len_per_device``
        (values) tokens per device instead of fixed row counts.
      optim: optimizer and schedule (read when the worker is built).
    """

    ppo_mini_batch_size: int = 16
    ppo_micro_batch_size_per_device: int | None = None
    ppo_epochs: int = 1
    shuffle: bool = True
    seed: int = 0
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


def critic_loss(cfg: CriticConfig):
    """The critic's ``loss_fn(model, micro, gbi, scalars) -> (loss, aux)`` for
    `make_train_step`; ``aux`` values add up over micro-batches."""

    def loss_fn(model, micro, gbi, scalars):
        mask = micro["response_mask"]
        vpreds = response_values(model, micro)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds,
            micro["returns"],
            micro["values"],
            mask,
            cfg.cliprange_value,
            cfg.loss_agg_mode,
            dp_size=1,
            batch_num_tokens=gbi["batch_num_tokens"],
            global_batch_size=gbi["global_batch_size"],
            loss_scale_factor=gbi["loss_scale_factor"],
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


def critic_train_step(
    layout: RoleLayout, tx: Any, schedule: Any, config: CriticConfig, state_shardings: Any, num_micro: int
):
    """The critic's jitted optimizer step (`make_train_step` with `critic_loss`) on a
    mini-batch of the columns ``CriticConfig.UPDATE_KEYS`` (all ``[rows, length]``), or with
    remove padding packed micro-batches (`jaxflow.workers.packing.pack_minibatch`)."""
    packed = config.use_remove_padding
    rows = [c for c in CriticConfig.UPDATE_KEYS if c not in ("prompt_ids", "prompt_mask", "responses")]
    ndims = {c: 3 for c in (*rows, *PACKED_KEYS)} if packed else {c: 2 for c in CriticConfig.UPDATE_KEYS}
    return make_train_step(
        layout.graphdef,
        tx,
        schedule,
        critic_loss(config),
        mesh=layout.mesh,
        rules=layout.rules,
        state_shardings=state_shardings,
        batch_ndims=ndims,
        num_micro=1 if packed else num_micro,
        loss_scale_factor=config.loss_scale_factor,
        presplit=packed,
        name="critic_train_step",
    )


class CriticWorker(TrainableWorker):
    """Value model: `values`, `update`.

    Args:
      model: a value model (``nnx.Module`` with the ``value`` head, ``(graphdef, state)``, or
        a checkpoint directory, loaded with ``head="value"``; an actor checkpoint gives a
        zero-initialised value head).
      mesh, rules: the critic's mesh and rules.
      config: the update.
    """

    head = "value"

    def __init__(
        self, model: ModelLike, mesh: Mesh | MeshSpec | str, rules: Rules | str, config: CriticConfig = CriticConfig()
    ):
        self.config = config
        self.tx, self.schedule = make_optimizer(config.optim)
        super().__init__(model, mesh, rules)
        self._num_updates = 0

    @register(DP_COMPUTE)
    def values(self, batch: Batch) -> Batch:
        """``values`` [B, R] of the responses (0 on padding)."""
        cfg = self.config
        if cfg.use_remove_padding:
            return packed_forward(
                self,
                "values",
                batch,
                values_fn,
                {},
                max_token_len=cfg.forward_max_token_len_per_device if cfg.use_dynamic_bsz else None,
                rows_per_micro=cfg.forward_micro_batch_size_per_device,
            )
        tensors = self.put(batch, PROMPT_KEYS)
        return Batch(self.values_program(len(batch))(self.params, tensors, {}))

    def values_program(self, rows: int):
        """The jitted value forward of ``rows`` responses (`values_program`)."""
        k = num_micro_batches(rows, self.config.forward_micro_batch_size_per_device, self.dp_size, "critic values")
        return self._compiled(("values", k), lambda: values_program(self.layout, k))

    def train_program(self, mini_batch_rows: int):
        """The jitted optimizer step on a mini-batch of ``mini_batch_rows`` responses
        (`critic_train_step`)."""
        cfg = self.config
        k = (
            1
            if cfg.use_remove_padding
            else num_micro_batches(
                mini_batch_rows, cfg.ppo_micro_batch_size_per_device, self.dp_size, "critic mini-batch"
            )
        )
        loss_key = (cfg.cliprange_value, cfg.loss_agg_mode, cfg.loss_scale_factor)
        return self._compiled(
            ("update", k, loss_key),
            lambda: critic_train_step(self.layout, self.tx, self.schedule, cfg, self.state_shardings, k),
        )

    @register(DP_TRAIN)
    def update(self, batch: Batch, *, step: int | None = None) -> dict[str, np.ndarray]:
        """PPO epochs of value updates; needs ``values`` (rollout-time) and ``returns``.
        ``step``: the training step, which seeds the shuffle (None: this worker's call count)."""
        cfg = self.config
        keys = CriticConfig.UPDATE_KEYS
        missing = [k for k in keys if k not in batch]
        if missing:
            raise KeyError(f"CriticWorker.update needs column(s) {missing}; the batch has {batch.keys()}")
        host = {k: host_array(batch[k]) for k in keys}  # whole on every process: mini-batches are drawn from it
        train_step = self.train_program(cfg.ppo_mini_batch_size)
        index = step  # the training step (resumed runs shuffle alike)
        if index is None:
            index = self._num_updates
            self._num_updates += 1
        rng = np.random.default_rng([cfg.seed, index])
        per_step = []
        for idx in minibatch_indices(len(batch), cfg.ppo_mini_batch_size, cfg.ppo_epochs, cfg.shuffle, rng):
            self.state, metrics = train_step(self.state, self.place_minibatch(host, idx)[0], {})
            per_step.append(metrics)
        per_step = jax.device_get(per_step)
        return {f"critic/{name}": np.asarray([m[name] for m in per_step]) for name in per_step[0]}

    def place_minibatch(
        self, host: Mapping[str, np.ndarray], idx: np.ndarray
    ) -> tuple[dict[str, jax.Array], PackedLayout | None]:
        """Rows ``idx`` of the host columns as the train step's input on the mesh: padded rows,
        or packed micro-batches (remove padding) and their layout."""
        cfg = self.config
        rows = {n: v[idx] for n, v in host.items()}
        if not cfg.use_remove_padding:
            return self.put(rows), None
        tensors, layout = pack_minibatch(
            rows,
            ranks=self.dp_size,
            max_token_len=cfg.ppo_max_token_len_per_device if cfg.use_dynamic_bsz else None,
            rows_per_micro=cfg.ppo_micro_batch_size_per_device,
        )
        return self.put_presplit(tensors), layout

    def train_step(self, minibatch: Mapping[str, Any]) -> dict[str, float]:
        """One optimizer step on one mini-batch (all rows, in order)."""
        keys = CriticConfig.UPDATE_KEYS
        rows = np.shape(minibatch["response_mask"])[0]
        step = self.train_program(rows)
        host = {k: host_array(minibatch[k]) for k in keys}
        self.state, metrics = step(self.state, self.place_minibatch(host, np.arange(rows))[0], {})
        return {f"critic/{n}": float(v) for n, v in jax.device_get(metrics).items()}
