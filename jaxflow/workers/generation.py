"""A generation-only role: the actor's rollouts on a rollout pool's own devices.

A rollout pool (a run's ``rollout_devices``) generates with a copy of the actor's weights that
the trainer streams to it after each update (`jaxflow.workers.ray.RayRolloutPool`); the pool
never trains. `GenerationWorker` is that copy and the actor's sampling
(`jaxflow.workers.actor.RolloutSampling`: `generate`, `rollout_metrics`, `generation_seconds`,
the same contract and columns as `ActorWorker.generate`), on the pool's mesh in the
generation layout (tensor parallelism ``tp``, replicas over the rest of the pool) and in the
actor's generation dtype: no optimizer state, no training copy, no hybrid-engine switch.

Its weights start as zeros in that layout (`placeholder_weights`: each device makes only its
shard; reading the actor's checkpoint would be wasted, the first sync replaces them) and are
replaced whole by each sync (``replace_params``, the stream's target side).

Partial rollouts (``trainer.partial_rollout``) on a Ray pool: the rollout's state
(`jaxflow.workers.actor.PartialGeneration`) stays in the pool's processes, under a key (the
step), and the driver holds only the key. `partial_start`, `partial_run` (one segment),
`partial_finish` are registered ``ONE_TO_ALL``: every process of the pool's world makes the same
call (the engine runs one program over the world), and what comes back is process 0's. Between
calls the parked state holds no weights (``rollout.weights`` is None), so a sync that replaces
them in between frees the old copy and the next segment runs under the new one.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxflow.data.batch import Batch
from jaxflow.mesh import MeshSpec, Role, Rules, get_rules, state_shardings
from jaxflow.models import ModelConfig, init_model
from jaxflow.workers.actor import PartialGeneration, RolloutConfig, RolloutSampling
from jaxflow.workers.base import RoleWorker, resolve_mesh
from jaxflow.workers.protocols import ONE_TO_ALL, register


def placeholder_weights(config: ModelConfig, head: str, dtype: Any, mesh: Mesh, rules: Rules) -> tuple[Any, Any]:
    """``(graphdef, zeros)``: the model of ``config`` with every weight zero in ``dtype``, laid
    out by ``rules`` on ``mesh``; one jitted program whose outputs are the shards, so no device
    (and not the host) ever holds a whole weight that the layout splits."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: init_model(config, head=head)))
    shardings = state_shardings(abstract, rules, mesh)
    zeros = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, dtype), abstract), out_shardings=shardings)
    return graphdef, zeros()


class GenerationWorker(RolloutSampling, RoleWorker):
    """The actor's sampling on a rollout pool (module docstring).

    Args:
      model: the actor's `ModelConfig` (the weights are placeholders until the first sync).
      mesh: the pool's generation mesh (a `MeshSpec` text such as ``"dp=-1,tp=2"`` is built over
        the process's world).
      rules: the actor's generation rules (``Placement.rules("actor", "generate")``).
      rollout: the actor's `RolloutConfig`. Its rollout probe compares the rollout's weights
        with the trainer's in one worker; a pool holds only the rollout's, so a probe is refused.
      dtype: the weights' dtype (the actor's generation dtype, e.g. ``"bfloat16"``).
    """

    role = Role.ACTOR

    def __init__(
        self,
        model: ModelConfig,
        mesh: Mesh | MeshSpec | str,
        rules: Rules | str,
        rollout: RolloutConfig = RolloutConfig(),
        *,
        dtype: Any = "float32",
    ):
        if rollout.probe_tolerance > 0:
            raise ValueError(
                "a rollout pool holds no trainer weights to compare its own with: the rollout probe "
                "(probe_tolerance > 0) runs only where the actor generates on its own devices"
            )
        mesh, rules = resolve_mesh(mesh), get_rules(rules)
        super().__init__(placeholder_weights(model, self.role.head, jnp.dtype(dtype), mesh, rules), mesh, rules)
        self._start_sampling(rollout)
        self._partials: dict[int, PartialGeneration] = {}  # the partial rollouts parked here, by step

    def _generation_weights(self, stack: contextlib.ExitStack) -> tuple[nnx.GraphDef, Any, Mesh, Rules]:
        """The pool's own weights as they are: already in the generation layout and dtype."""
        return self.graphdef, self.params, self.mesh, self.rules

    # ------------------------------------------------------------------ partial rollouts, by key
    @register(ONE_TO_ALL)
    def partial_start(self, prompts: Batch, *, step: int, version: int) -> bool:
        """Parks a fresh partial rollout of ``prompts`` under key ``step`` (`start_partial` with
        ``sampling="train"``: `generate`'s rows and keys for ``step``), replacing any parked
        under it (a rollout the trainer discarded). Returns whether it is done (no row to run)."""
        self._partials[step] = self.start_partial(prompts, sampling="train", step=step, version=version)
        return self._partials[step].done

    @register(ONE_TO_ALL)
    def partial_run(self, step: int, version: int, *, max_steps: int | None) -> bool:
        """One segment (at most ``max_steps`` tokens per row; None: to the end) of the rollout
        parked under ``step``, under this worker's current weights as policy ``version``;
        returns whether every row has finished. The state parked again holds no weights."""
        self._partials[step] = self.run_partial(self._parked(step), version, max_steps=max_steps)
        return self._partials[step].done

    @register(ONE_TO_ALL)
    def partial_finish(self, step: int) -> Batch:
        """The rows of the finished rollout parked under ``step`` (`finish_partial`: `generate`'s
        columns and ``token_versions``), forgotten here."""
        rows = self.finish_partial(self._parked(step))
        del self._partials[step]
        return rows

    @register(ONE_TO_ALL)
    def partial_parked(self) -> dict[int, bool]:
        """The partial rollouts parked here: key -> whether its state holds weights (never)."""
        return {step: partial.rollout.weights is not None for step, partial in sorted(self._partials.items())}

    def _parked(self, step: int) -> PartialGeneration:
        if step not in self._partials:
            raise KeyError(f"no partial rollout of step {step} is parked here (parked: {sorted(self._partials)})")
        return self._partials[step]
