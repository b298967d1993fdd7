"""The rollout probe: proof that the rollout samples from the policy being trained.

After each weight sync (the generation copy: LoRA adapters merged in, a cast, the hybrid
engine's reshard), the rollout's weights and the trainer's score one fixed probe sequence,
each with its own graph, layout and dtype. Per probe position ``t`` the two next-token
distributions ``p_t`` (rollout) and ``q_t`` (trainer) are compared by their total variation
distance::

    tv = max_t  1/2 sum_v |p_t(v) - q_t(v)|          (0: identical, 1: disjoint)

which dtype noise moves by a little (bf16 generation against float32 training: about 1e-2)
and a rollout that never received the trained adapters by as much as training moved the
policy. Above the tolerance the run stops (`RolloutMismatchError`, one line). The probe is
the first ``PROBE_TOKENS`` response tokens of the first row of the worker's first rollout,
after its prompt: a sequence of the task, where training changes the policy most.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxflow.data.batch import Batch
from jaxflow.mesh import Rules, state_shardings
from jaxflow.models.hf_io import host_array
from jaxflow.workers.base import RoleLayout, row_program
from jaxflow.workers.forward import PROMPT_KEYS, response_hidden

PROBE_TOKENS = 16
METRIC = "rollout/probe_tv"


class RolloutMismatchError(RuntimeError):
    """The rollout's weights do not give the trainer's policy (see the module docstring)."""


def probe_fn(model: Any, tensors: dict, scalars: dict) -> dict[str, jax.Array]:
    """``log_softmax(logits)`` ``[B, R, V]`` at the positions that predict the response tokens."""
    logits = model.logits(response_hidden(model, tensors))
    return {"probe_log_probs": jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), -1)}


def total_variation(log_p_RxV: np.ndarray, log_q_RxV: np.ndarray, mask_R: np.ndarray) -> float:
    """``max_t 1/2 sum_v |p_t(v) - q_t(v)|`` over the positions where ``mask_R`` holds."""
    tv_R = 0.5 * np.abs(np.exp(log_p_RxV.astype(np.float64)) - np.exp(log_q_RxV.astype(np.float64))).sum(-1)
    return float(np.max(np.where(mask_R > 0, tv_R, 0.0), initial=0.0))


class RolloutProbe:
    """Scores the probe with a set of weights (`log_probs`) and compares two scorings
    (`check`); ``tolerance``: the largest total variation allowed."""

    def __init__(self, tolerance: float):
        self.tolerance = tolerance
        self.tensors: dict[str, np.ndarray] | None = None
        self._programs: dict[Any, Any] = {}
        self.last: float | None = None

    def capture(self, rows: Batch) -> None:
        """Takes the probe from a rollout's first row (once: the probe stays fixed)."""
        if self.tensors is not None:
            return
        row = {k: host_array(rows[k])[:1] for k in PROMPT_KEYS}
        row["responses"], row["response_mask"] = (
            row["responses"][:, :PROBE_TOKENS],
            row["response_mask"][:, :PROBE_TOKENS],
        )
        self.tensors = row

    def log_probs(self, name: str, graphdef: nnx.GraphDef, params: Any, mesh: Mesh, rules: Rules) -> np.ndarray:
        """The probe's next-token log-probabilities ``[R, V]`` under ``params`` in their layout
        (``name`` and the graph key the compiled program: the trainer's layout, the rollout's)."""
        key = (name, graphdef)
        if key not in self._programs:
            layout = RoleLayout(graphdef, mesh, rules, state_shardings(params, rules, mesh))
            self._programs[key] = (row_program(layout, probe_fn, 1, name="rollout_probe"), layout.dp_size)
        program, dp = self._programs[key]
        rows = {k: np.repeat(v, dp, axis=0) for k, v in self.tensors.items()}  # one row per data-parallel rank
        return host_array(program(params, rows, {})["probe_log_probs"])[0]

    def check(self, rollout_RxV: np.ndarray, trainer_RxV: np.ndarray) -> float:
        """The total variation between the rollout's and the trainer's scoring; raises
        `RolloutMismatchError` above the tolerance."""
        tv = total_variation(rollout_RxV, trainer_RxV, self.tensors["response_mask"][0])
        self.last = tv
        if not math.isfinite(tv) or tv > self.tolerance:
            raise RolloutMismatchError(
                f"the rollout's next-token distributions on the probe differ from the trainer's by {tv:.3g} "
                f"(total variation, max over {PROBE_TOKENS} positions) > jaxflow.rollout_probe.tolerance="
                f"{self.tolerance:g}: the rollout does not sample the policy being trained (weights not synced?)"
            )
        return tv
