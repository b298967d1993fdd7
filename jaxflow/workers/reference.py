"""The reference policy: frozen log-probs for the KL penalty / KL loss."""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from jaxflow.data.batch import Batch
from jaxflow.mesh import MeshSpec, Rules
from jaxflow.workers.actor import log_probs_fn, log_probs_program
from jaxflow.workers.base import ModelLike, RoleWorker, num_micro_batches, packed_forward
from jaxflow.workers.forward import PROMPT_KEYS
from jaxflow.workers.protocols import DP_COMPUTE, register


class ReferenceWorker(RoleWorker):
    """Frozen policy: `log_probs` -> ``ref_log_prob``.

    Args:
      model: the reference policy (usually the actor's initial checkpoint).
      mesh, rules: its mesh and (inference) rules.
      temperature: T of the log-probs (the training rollouts', `RolloutConfig.temperature`)
        unless a call passes its own.
      micro_batch_size_per_device: micro-batch of the forward (memory).
      use_remove_padding: the forward runs over packed real tokens (`jaxflow.workers.packing`).
      max_token_len_per_device: with remove padding, micro-batches of at most this many
        tokens per device (verl's ``log_prob_use_dynamic_bsz``); None = by rows.
    """

    head = "lm"

    def __init__(
        self,
        model: ModelLike,
        mesh: Mesh | MeshSpec | str,
        rules: Rules | str,
        *,
        temperature: float = 1.0,
        micro_batch_size_per_device: int | None = None,
        use_remove_padding: bool = False,
        max_token_len_per_device: int | None = None,
    ):
        super().__init__(model, mesh, rules)
        self.temperature = temperature
        self.micro_batch_size_per_device = micro_batch_size_per_device
        self.use_remove_padding = use_remove_padding
        self.max_token_len_per_device = max_token_len_per_device

    @register(DP_COMPUTE)
    def log_probs(self, batch: Batch, *, temperature: float | None = None) -> Batch:
        """``ref_log_prob`` [B, R] (0 on padding): ``log_softmax(logits / T)`` of the responses
        under the reference policy, T = ``temperature`` (None: the worker's)."""
        temperature = np.float32(self.temperature if temperature is None else temperature)
        if self.use_remove_padding:
            return packed_forward(
                self,
                "ref_log_prob",
                batch,
                log_probs_fn("ref_log_prob"),
                {"temperature": temperature},
                max_token_len=self.max_token_len_per_device,
                rows_per_micro=self.micro_batch_size_per_device,
            )
        tensors = self.put(batch, PROMPT_KEYS)
        program = self.log_probs_program(len(batch))
        return Batch(program(self.params, tensors, {"temperature": temperature}))

    def log_probs_program(self, rows: int):
        """The jitted reference log-prob forward of ``rows`` responses (`log_probs_program`)."""
        k = num_micro_batches(rows, self.micro_batch_size_per_device, self.dp_size, "ref log_probs")
        return self._compiled(("log_probs", k), lambda: log_probs_program(self.layout, k, output_key="ref_log_prob"))
