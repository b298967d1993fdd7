"""What the actor and the critic share: a `TrainState` on the role's mesh, and the PPO update
loop over it. Their differences are their losses (`jaxflow.workers.actor.actor_loss`,
`jaxflow.workers.critic.critic_loss`) and the columns those read.

An update is PPO epochs over shuffled mini-batches, one optimizer step each::

    host = the update's columns, whole on every process
    for idx in minibatch_indices(rows, ppo_mini_batch_size, ppo_epochs, shuffle, rng(seed, step)):
        state, metrics = train_step(state, place_minibatch(host, idx), scalars)

``place_minibatch`` puts padded rows on the mesh (rows over the data-parallel axes), or with
remove padding the packed micro-batches of `jaxflow.workers.packing.pack`; ``train_step`` is
the role's jitted program (`train_step_program`: `make_train_step` with the role's loss),
compiled once per micro-batch count and loss settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxflow.data.batch import Batch
from jaxflow.mesh import state_shardings
from jaxflow.models import peft_io, save_pretrained
from jaxflow.models.hf_io import host_array
from jaxflow.models.lora import LoRAConfig, join, split_trained
from jaxflow.workers.base import ModelLike, RoleLayout, RoleWorker, num_micro_batches
from jaxflow.workers.checkpoint_io import abstract_tree, restore_item, save_item
from jaxflow.workers.forward import LOSS_MASK
from jaxflow.workers.optim import make_optimizer
from jaxflow.workers.packing import PackedLayout, pack, packed_columns
from jaxflow.workers.protocols import ONE_TO_ALL, register
from jaxflow.workers.train_state import (
    TrainState,
    create_train_state,
    make_train_step,
    minibatch_indices,
    tree_all_finite,
)

_tree_all_finite = jax.jit(tree_all_finite)


@dataclasses.dataclass(frozen=True)
class UpdateLoopConfig:
    """The update loop's settings, the first fields of `ActorConfig` and `CriticConfig` (verl's
    names; batch sizes count responses).

    Attributes:
      ppo_mini_batch_size: responses per optimizer step; the rollout size must be a multiple.
      ppo_micro_batch_size_per_device: gradient-accumulation micro-batch, per data-parallel
        device (None: the whole mini-batch at once).
      ppo_epochs: passes over the rollout; ``shuffle``: a fresh permutation per pass.
      seed: with the training step, seeds the permutations (and fresh LoRA adapters, and
        their dropout).
      lora: train LoRA adapters (`jaxflow.models.lora`) instead of the weights, which stay
        frozen; None: train every weight.
      lora_adapter_path: a PEFT adapter directory the adapters start from (its config must
        be ``lora``); empty: fresh adapters.
      use_loss_mask: updates read a ``loss_mask`` column [B, R] and train only where it is 1
        (`jaxflow.workers.forward.trained_tokens`: multi-turn rollouts mask tool and
        environment tokens out of the losses, the KL, the entropy and the token counts).
    """

    ppo_mini_batch_size: int = 16
    ppo_micro_batch_size_per_device: int | None = None
    ppo_epochs: int = 1
    shuffle: bool = True
    seed: int = 0
    lora: LoRAConfig | None = None
    lora_adapter_path: str = ""
    use_loss_mask: bool = False

    def loss_mask_keys(self) -> tuple[str, ...]:
        """``("loss_mask",)`` when updates read one (`use_loss_mask`), else ``()``."""
        return (LOSS_MASK,) if self.use_loss_mask else ()


def train_columns(keys: tuple[str, ...], packed: bool) -> dict[str, int]:
    """A train step's input columns and their ranks, for the row columns ``keys``: padded
    ``[rows, length]``, or with remove padding the packed micro-batches of
    `jaxflow.workers.packing.pack` (all rank 3)."""
    if not packed:
        return {c: 2 for c in keys}
    return {c: 3 for c in packed_columns(keys)}


def train_step_program(
    layout: RoleLayout,
    tx: Any,
    schedule: Any,
    config: Any,
    state_shardings: Any,
    num_micro: int,
    *,
    on_policy: bool = False,
    frozen_shardings: Any = None,
):
    """A training role's jitted optimizer step (`make_train_step`) on a mini-batch: padded
    rows in ``num_micro`` micro-batches, or (``config.use_remove_padding``) packed
    micro-batches. ``config`` (an `ActorConfig` or `CriticConfig`) says what differs between
    the roles: the loss (``loss_fn()``), the row columns (``update_keys(on_policy)``; the
    actor's ``on_policy`` step reads no ``old_log_probs``), the scalars (``SCALAR_NAMES``)
    and the program's name (``STEP_NAME``); and ``loss_scale_factor``, ``lora``, ``seed``.
    ``frozen_shardings``: with LoRA, the base weights' (the step's fourth argument)."""
    packed = config.use_remove_padding
    lora = config.lora
    return make_train_step(
        layout.graphdef,
        tx,
        schedule,
        config.loss_fn(),
        mesh=layout.mesh,
        rules=layout.rules,
        state_shardings=state_shardings,
        batch_ndims=train_columns(config.update_keys(on_policy), packed),
        scalar_names=config.SCALAR_NAMES,
        num_micro=1 if packed else num_micro,
        loss_scale_factor=config.loss_scale_factor,
        presplit=packed,
        name=config.STEP_NAME,
        frozen_shardings=frozen_shardings,
        dropout_seed=config.seed if lora is not None and lora.dropout > 0 else None,
    )


class TrainableWorker(RoleWorker):
    """A role that trains (actor, critic): its parameters live in a `TrainState` (params,
    optimizer state, applied-step count) sharded on its mesh, the optimizer buffers like their
    parameters; `update_epochs` runs the PPO update loop.

    ``config`` (an `ActorConfig` or `CriticConfig`) gives the optimizer (``optim``), the
    loop's settings (`UpdateLoopConfig`; ``use_remove_padding``, ``use_dynamic_bsz``,
    ``ppo_max_token_len_per_device``), ``loss_key()`` (what the compiled step depends on) and
    what the step needs of its role (`train_step_program`). Subclasses name their ``role``
    (the metrics' prefix).

    With ``config.lora`` the model gets adapters (`jaxflow.models.peft_io.add_adapters`, or
    those of ``config.lora_adapter_path``): the `TrainState` holds the adapters and their
    optimizer state only (so do checkpoints), the base weights stay in ``frozen`` (never
    copied, never changed, in the dtype they were loaded in), ``params`` is both."""

    def __init__(self, model: ModelLike, mesh: Any, rules: Any, config: Any):
        self.config = config
        self.tx, self.schedule = make_optimizer(config.optim)
        self.frozen: Any = None  # the base weights under LoRA adapters, else None
        super().__init__(model, mesh, rules)
        self._num_updates = 0

    def _set_params(self, params: Any) -> None:
        lora = self.config.lora
        if lora is not None:
            self.graphdef, params = peft_io.add_adapters(
                self.graphdef, params, lora, self.config.seed, self.mesh, self.rules
            )
            if self.config.lora_adapter_path:
                params = peft_io.load_adapter(
                    self.config.lora_adapter_path, self.graphdef, params, self.mesh, self.rules
                )
            self.base_graphdef = peft_io.base_graphdef(self.graphdef, params)
            self.frozen, params = split_trained(params)
            self.frozen_shardings = state_shardings(self.frozen, self.rules, self.mesh)
        self.state, self.state_shardings = create_train_state(
            params, state_shardings(params, self.rules, self.mesh), self.tx, self.mesh
        )

    @property
    def params(self) -> Any:
        """The parameters: the trained ones, with LoRA joined to the frozen base (no copy)."""
        return self.state.params if self.frozen is None else join(self.frozen, self.state.params)

    @property
    def frozen_args(self) -> tuple[Any, ...]:
        """The train step's arguments after ``(state, batch, scalars)``: the frozen base under
        LoRA adapters, else none."""
        return () if self.frozen is None else (self.frozen,)

    def replace_params(self, params: Any) -> None:
        """Replaces the parameters (the whole model's, adapters included) in place, keeping the
        optimizer state (e.g. weights given back by the hybrid engine after a rollout)."""
        if self.frozen is not None:
            self.frozen, params = split_trained(params)
        self.state = dataclasses.replace(self.state, params=params)

    # ------------------------------------------------------------------ the update loop
    def metric_name(self, name: str) -> str:
        """``<role>/<name>``; a name with its own section (a loss's ``rollout_corr/kl``) as is
        (verl's names)."""
        return name if "/" in name else f"{self.role}/{name}"

    def build_train_step(self, num_micro: int, on_policy: bool) -> Any:
        """The role's jitted optimizer step (`train_step_program`; with LoRA the frozen base
        is its fourth argument)."""
        frozen_shardings = None if self.frozen is None else self.frozen_shardings
        return train_step_program(
            self.layout,
            self.tx,
            self.schedule,
            self.config,
            self.state_shardings,
            num_micro,
            on_policy=on_policy,
            frozen_shardings=frozen_shardings,
        )

    def train_program(self, mini_batch_rows: int, on_policy: bool = False):
        """The jitted optimizer step on a mini-batch of ``mini_batch_rows`` responses
        (`build_train_step`; remove padding: one program, the packed mini-batch carries its
        micro-batches)."""
        cfg = self.config
        k = 1
        if not cfg.use_remove_padding:
            k = num_micro_batches(
                mini_batch_rows, cfg.ppo_micro_batch_size_per_device, self.dp_size, f"{self.role} mini-batch"
            )
        return self._compiled(("update", k, on_policy, cfg.loss_key()), lambda: self.build_train_step(k, on_policy))

    def place_minibatch(
        self, host: Mapping[str, np.ndarray], idx: np.ndarray
    ) -> tuple[dict[str, jax.Array], PackedLayout | None]:
        """Rows ``idx`` of the host columns as the train step's input on the mesh: padded rows,
        or packed micro-batches (remove padding) and their layout."""
        cfg = self.config
        rows = {n: v[idx] for n, v in host.items()}
        if not cfg.use_remove_padding:
            return self.put(rows), None
        tensors, layout = pack(
            rows,
            ranks=self.dp_size,
            max_token_len=cfg.ppo_max_token_len_per_device if cfg.use_dynamic_bsz else None,
            rows_per_micro=cfg.ppo_micro_batch_size_per_device,
        )
        return self.put_presplit(tensors), layout

    def host_columns(self, batch: Batch | Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The columns ``keys`` as host arrays, whole on every process (mini-batches are drawn
        from them); a missing one is a `KeyError` naming it."""
        missing = [k for k in keys if k not in batch]
        if missing:
            have = batch.keys() if isinstance(batch, Batch) else sorted(batch)
            raise KeyError(f"{type(self).__name__}.update needs column(s) {missing}; the batch has {have}")
        return {k: host_array(batch[k]) for k in keys}

    def update_epochs(
        self, host: Mapping[str, np.ndarray], scalars: Mapping[str, Any], *, step: int | None, on_policy: bool = False
    ) -> tuple[dict[str, np.ndarray], list[PackedLayout | None]]:
        """PPO epochs over shuffled mini-batches of the host columns, one optimizer step each
        (see the module docstring). ``step`` seeds the shuffle (None: this worker's count of
        updates). Returns each metric's values, one per step, named by `metric_name`, and
        each step's packed layout (None for padded rows)."""
        cfg = self.config
        train_step = self.train_program(cfg.ppo_mini_batch_size, on_policy)
        index = step  # the training step (resumed runs shuffle alike)
        if index is None:
            index = self._num_updates
            self._num_updates += 1
        rng = np.random.default_rng([cfg.seed, index])
        rows = len(next(iter(host.values())))
        per_step, layouts = [], []
        for idx in minibatch_indices(rows, cfg.ppo_mini_batch_size, cfg.ppo_epochs, cfg.shuffle, rng):
            inputs, layout = self.place_minibatch(host, idx)
            self.state, metrics = train_step(self.state, inputs, scalars, *self.frozen_args)
            per_step.append(metrics)
            layouts.append(layout)
        per_step = jax.device_get(per_step)
        return {self.metric_name(name): np.asarray([m[name] for m in per_step]) for name in per_step[0]}, layouts

    def step_on(
        self, minibatch: Mapping[str, Any], keys: tuple[str, ...], scalars: Mapping[str, Any]
    ) -> dict[str, float]:
        """One optimizer step on one mini-batch (all rows, in order) of the columns ``keys``:
        the building block of the update, for tests and custom loops. Rows must be a multiple
        of ``dp_size``."""
        rows = np.shape(minibatch["response_mask"])[0]
        step = self.train_program(rows)
        inputs, _ = self.place_minibatch(self.host_columns(minibatch, keys), np.arange(rows))
        self.state, metrics = step(self.state, inputs, scalars, *self.frozen_args)
        return {self.metric_name(n): float(v) for n, v in jax.device_get(metrics).items()}

    # ------------------------------------------------------------------ its state
    @register(ONE_TO_ALL)
    def get_train_state(self) -> TrainState:
        """The `TrainState` (device arrays on this role's mesh; e.g. for a checkpoint)."""
        return self.state

    @register(ONE_TO_ALL)
    def set_train_state(self, state: TrainState) -> None:
        """Replaces the `TrainState` (e.g. from a checkpoint), placed in this role's layout."""
        self.state = jax.device_put(state, self.state_shardings)

    # A checkpoint is written and read here, where the state lives: in a multi-process world
    # every process writes and reads its own shards (`jaxflow.workers.checkpoint_io`), so the
    # controller that saves never holds the state.
    @register(ONE_TO_ALL)
    def abstract_train_state(self) -> TrainState:
        """The `TrainState`'s shapes and dtypes (no data): what a checkpoint is checked against."""
        return abstract_tree(self.state)

    @register(ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """Writes the model as the HF directory ``path`` (`RoleWorker.export_hf`); with LoRA the
        merged model (weights ``W + s A B``, `jaxflow.models.peft_io.merged_model`)."""
        if self.frozen is None:
            return super().export_hf(path)
        save_pretrained(peft_io.merged_model(self.graphdef, self.params), path)

    @register(ONE_TO_ALL)
    def export_adapter(self, path: str, base_model: str = "") -> None:
        """Writes the LoRA adapters as the PEFT directory ``path`` (``base_model``: where the
        base model lives, `jaxflow.models.peft_io.save_adapter`)."""
        peft_io.save_adapter(self.model_config, self.state.params, path, base_model)

    @register(ONE_TO_ALL)
    def params_finite(self) -> bool:
        """Whether no parameter holds NaN or Inf (reduced on the devices)."""
        return bool(_tree_all_finite(self.state.params))

    @register(ONE_TO_ALL)
    def save_train_state(self, path: str) -> None:
        """Writes the `TrainState` as the orbax item directory ``path``."""
        save_item(path, self.state)

    @register(ONE_TO_ALL)
    def restore_train_state(self, path: str) -> None:
        """Reads the `TrainState` from the orbax item directory ``path`` into this role's layout
        (whatever mesh it was saved from)."""
        self.state = restore_item(path, self.state)
