"""The reference policy: frozen log-probs for the KL penalty / KL loss."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxflow.data.batch import Batch
from jaxflow.mesh import MeshSpec, Role, Rules
from jaxflow.workers.base import ModelLike, RoleLayout, RoleWorker, num_micro_batches, row_program
from jaxflow.workers.forward import ForwardConfig, log_probs_and_entropy
from jaxflow.workers.protocols import DP_COMPUTE, register


def log_probs_fn(output_key: str = "old_log_probs", with_entropy: bool = False):
    """``fn(model, tensors, {"temperature": T}) -> {output_key: [B, R]}`` (and ``entropys``):
    ``log_softmax(logits / T)`` of the responses, 0 on padding, from padded rows or a packed
    micro-batch."""

    def fn(model, t, scalars):
        lp, ent = log_probs_and_entropy(model, t, scalars["temperature"], with_entropy=with_entropy)
        m = t["response_mask"] > 0
        out = {output_key: jnp.where(m, lp, 0.0)}
        if with_entropy:
            out["entropys"] = jnp.where(m, ent, 0.0)
        return out

    return fn


def log_probs_program(
    layout: RoleLayout, num_micro: int, *, output_key: str = "old_log_probs", with_entropy: bool = False
):
    """`log_probs_fn` over padded rows in ``num_micro`` micro-batches (`row_program`): the
    actor's old log-probs and the reference's ``ref_log_prob``."""
    return row_program(layout, log_probs_fn(output_key, with_entropy), num_micro, name=output_key)


class ReferenceWorker(RoleWorker):
    """Frozen policy: `log_probs` -> ``ref_log_prob``.

    Args:
      model: the reference policy (usually the actor's initial checkpoint).
      mesh, rules: its mesh and (inference) rules.
      temperature: T of the log-probs (the training rollouts', `RolloutConfig.temperature`)
        unless a call passes its own.
      forward: how the log-prob forward runs (micro-batches, remove padding, token budget).
    """

    role = Role.REF

    def __init__(
        self,
        model: ModelLike,
        mesh: Mesh | MeshSpec | str,
        rules: Rules | str,
        *,
        temperature: float = 1.0,
        forward: ForwardConfig = ForwardConfig(),
    ):
        super().__init__(model, mesh, rules)
        self.temperature = temperature
        self.forward = forward

    @register(DP_COMPUTE)
    def log_probs(self, batch: Batch, *, temperature: float | None = None) -> Batch:
        """``ref_log_prob`` [B, R] (0 on padding): ``log_softmax(logits / T)`` of the responses
        under the reference policy, T = ``temperature`` (None: the worker's)."""
        scalars = {"temperature": np.float32(self.temperature if temperature is None else temperature)}
        fn = log_probs_fn("ref_log_prob")
        return self.run_forward(batch, self.forward, "ref_log_prob", fn, scalars, self.log_probs_program)

    def log_probs_program(self, rows: int):
        """The jitted reference log-prob forward of ``rows`` responses (`log_probs_program`)."""
        k = num_micro_batches(rows, self.forward.micro_batch_size_per_device, self.dp_size, "ref log_probs")
        return self._compiled(("log_probs", k), lambda: log_probs_program(self.layout, k, output_key="ref_log_prob"))
