"""The Ray backend's rollout pool: the actor's generation on a worker group of its own (its own
hosts, its own `jax.distributed` world), fed by a `WeightStream` from the actor's training
group after each update.

::

    pool = RayRolloutPool.from_spec(spec, backend, workers.actor, devices=4)  # the run's last 4 devices
    pool.sync(version)                 # the actor's current weights -> the pool ({"weight_sync/bytes": ...})
    rows = pool.generate(prompts, step=k)   # = the actor's generate(prompts, sampling="train", step=k)
    pool.rollout_metrics(); pool.generation_seconds()
    h = pool.start_partial(prompts, step=k, version=v)   # trainer.partial_rollout: a handle (step, version, done)
    h = pool.run_partial(h, v, max_steps=16, until=sync_waits)   # one segment; a sync may come between two
    rows = pool.finish_partial(h)      # generate's rows plus token_versions
    pool.close()

The pool's group hosts one `jaxflow.workers.generation.GenerationWorker` per process: the
actor's sampling (the same `RolloutSampling.generate`, so the same columns and, by its
``fold_in`` key scheme, the same tokens as the actor generating on its own devices) over the
pool's mesh in the generation layout (``tp`` = the run's generation tp, replicas over the rest
of the pool) under the actor's generation rules, in the actor's generation dtype. It never
trains and holds no optimizer state: only the generation copy, which a sync replaces in place
(the stream's target frees the old copy before it receives the new one).

Partial rollouts (``trainer.partial_rollout``; the `jaxflow.trainer.rollouter.PartialRolloutPool`
calls). The rollout's state stays in the pool's processes (`GenerationWorker.partial_start` /
``partial_run`` / ``partial_finish``, kept under the step as key; it holds device arrays, and
no weights between calls); the driver holds a `PartialHandle` (step, version, done). Each
`run_partial` is one segment of at most ``max_steps`` tokens per row under the weights the pool
holds then; a sync between two segments replaces them and the next segment goes on under the
new ones. The rows come back, as `generate`'s, from process 0.

A sync is `WeightStream.sync` (each piece from the actor process that holds it to the pool
process that wants it, cast to the pool's dtype on the sender; never through the driver, a
file or one process holding the model). `sync` is never called while a `generate` of the same
pool is in flight (the rollouter orders them); both are calls of the driver, one at a time.

Faults. A sync or a generate that fails raises the backend's `WorkerGroupError`, naming the
group that failed (the stream's root cause: `jaxflow.workers.ray.streams`):

* the pool's group (``error.group == pool.name``; a process killed during a sync or a
  generate is a `WorkerDied`; during a sync, measured 0.6 s after the kill with the backend's
  `LOST_GRACE_S` watch that the cluster is still there cut to 0.5 s, about 5 s at its
  default of 5 s: tests/test_ray_rollout_pool.py): the pool's processes are stopped, the
  actor's group is intact (a stream has no collectives; every actor process came back).
  ``pool.restart(version)`` brings a fresh group, a fresh stream and a sync of the actor's
  current weights (4.5 s on CPU for the tiny model, most of it starting the process). The
  trainer (`jaxflow.trainer.rl.RLTrainer`) treats it as any group's failure: it restarts every
  group (``jaxflow.ray.max_restarts``), `rejoin`s the pool to the actor's new group, discards
  the pending rollouts and resumes from the last checkpoint, whose weights the next step syncs;
  a run whose restarts are spent ends with the error's one line.
* the actor's group (it died during a sync): the pool holds no weights (``version`` is -1);
  the trainer restarts its groups, the pool's included, the same way.

`version` is -1 until a sync succeeds, and again after a sync that failed: `generate` refuses
to run on weights that a failed sync left half-received.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxflow.data.batch import Batch
from jaxflow.workers.actor import generation_dtype
from jaxflow.workers.generation import GenerationWorker
from jaxflow.workers.ray.backend import RayBackend, RayWorkerGroup
from jaxflow.workers.ray.streams import BUCKET_BYTES, METRIC_PREFIX, WeightStream

POOL_NAME = "rollout"


@dataclasses.dataclass(frozen=True)
class PartialHandle:
    """The driver's handle on a partial rollout parked in a `RayRolloutPool`'s processes: its
    key ``step``, the policy ``version`` of its last segment's weights, and whether every row
    has finished (``done``)."""

    step: int
    version: int
    done: bool


class RayRolloutPool:
    """A rollout pool on Ray (module docstring): ``num_hosts`` processes of ``backend``'s hosts
    hosting ``worker_cls(model, mesh, rules, rollout, dtype=dtype)``, fed from ``actor`` (the
    actor's training group). `from_spec` builds one from a run's description.

    Attributes:
      version: the policy version of the weights it holds (-1 before the first sync, and after
        a failed one).
      group: the pool's `RayWorkerGroup`; ``stream``: its `WeightStream` from the actor.
      last_sync: the last sync's full metrics (`WeightStream.sync`: bytes, seconds, pieces,
        the model's bytes, the most a process held).
    """

    def __init__(
        self,
        backend: RayBackend,
        actor: RayWorkerGroup,
        *,
        num_hosts: int,
        model: Any,
        mesh: str,
        rules: Any,
        rollout: Any,
        dtype: str,
        name: str = POOL_NAME,
        bucket_bytes: int = BUCKET_BYTES,
        worker_cls: type = GenerationWorker,
    ):
        self.backend, self.actor, self.name, self.num_hosts = backend, actor, name, num_hosts
        self.worker_cls, self.bucket_bytes = worker_cls, bucket_bytes
        self.worker_kwargs = dict(model=model, mesh=mesh, rules=rules, rollout=rollout, dtype=dtype)
        self.version = -1
        self.last_sync: dict[str, float] = {}
        self.group, self.stream = self._start()

    @classmethod
    def from_spec(cls, spec: Any, backend: RayBackend, actor: RayWorkerGroup, *, devices: int, **options: Any):
        """The rollout pool of a run (``spec``: its `jaxflow.configs.RunSpec`) on its last
        ``devices`` devices (`pool_layout`), fed from ``actor`` (the actor's group).
        ``options``: the constructor's (``name``, ``bucket_bytes``, ``worker_cls``)."""
        return cls(backend, actor, **pool_layout(spec, devices, backend.config.devices_per_host), **options)

    def _start(self) -> tuple[RayWorkerGroup, WeightStream]:
        """A fresh group of the pool's processes, its worker built, and its stream from the actor."""
        processes = self.backend.process_group(self.name, self.num_hosts)
        try:
            group = self.backend.group(processes, self.worker_cls, name=self.name, **self.worker_kwargs)
            return group, WeightStream(self.actor, group, bucket_bytes=self.bucket_bytes)
        except BaseException:
            self._stop()
            raise

    def _stop(self) -> None:
        """Kills the pool's processes (if still running) and forgets them in the backend."""
        processes = self.backend.groups.pop(self.name, None)
        if processes is not None:
            processes.shutdown("rollout pool closed")

    def sync(self, version: int) -> dict[str, float]:
        """The actor's current training weights become the pool's (in its layout and dtype),
        as policy ``version``. Returns ``weight_sync/bytes`` (moved between the worlds) and
        ``timing_s/weight_sync`` (the driver's wall time, both groups done); the rest of the
        stream's metrics are in `last_sync`."""
        self.version = -1  # a sync that fails leaves the pool's weights half-received
        metrics = self.stream.sync()
        self.version, self.last_sync = version, metrics
        return {
            f"{METRIC_PREFIX}bytes": metrics[f"{METRIC_PREFIX}bytes"],
            "timing_s/weight_sync": metrics[f"{METRIC_PREFIX}seconds"],
        }

    def generate(self, prompts: Batch, *, step: int) -> Batch:
        """The actor's ``generate(prompts, sampling="train", step=step)`` on the pool's devices,
        with the weights of policy `version`."""
        self._check_weights()
        return self.group.generate(prompts, sampling="train", step=step)

    def start_partial(self, prompts: Batch, *, step: int, version: int) -> PartialHandle:
        """A partial rollout of ``prompts`` for ``step`` (the rows and keys of ``generate(prompts,
        step=step)``), nothing sampled yet, parked in the pool's processes under ``step``."""
        self._check_weights()
        (done,) = self.group.partial_start(prompts, step=step, version=version)
        return PartialHandle(step, version, done)

    def run_partial(
        self, partial: PartialHandle, version: int, *, max_steps: int | None, until: Callable[[], bool] | None = None
    ) -> PartialHandle:
        """One segment of ``partial`` (at most ``max_steps`` tokens per row; None: to its end)
        under the weights the pool holds, as policy ``version``; none when ``until()`` is true
        already (the rollouter asks again before the next call)."""
        self._check_weights()
        if partial.done or (until is not None and until()):
            return partial
        (done,) = self.group.partial_run(partial.step, version, max_steps=max_steps)
        return PartialHandle(partial.step, version, done)

    def finish_partial(self, partial: PartialHandle) -> Batch:
        """The rows of the finished ``partial`` (`generate`'s columns and ``token_versions``),
        from the pool's first process; the pool forgets it."""
        if not partial.done:
            raise ValueError(f"the partial rollout of step {partial.step} has rows not finished")
        return self.group.partial_finish(partial.step)[0]

    def _check_weights(self) -> None:
        if self.version < 0:
            raise RuntimeError(f"rollout pool {self.name!r} holds no weights: sync it first")

    def rollout_metrics(self) -> dict[str, float]:
        """The last rollout's own metrics (`ActorWorker.rollout_metrics`: multi-turn ``agent/*``)."""
        return self.group.rollout_metrics()[0]

    def generation_seconds(self) -> dict[str, float]:
        """The last `generate`'s parts (``reshard``: nothing to switch here, ``engine``,
        ``post``), each the slowest process's."""
        ranks = self.group.generation_seconds()
        return {k: max(r[k] for r in ranks) for k in ranks[0]} if ranks and ranks[0] else {}

    def restart(self, version: int, actor: RayWorkerGroup | None = None) -> dict[str, float]:
        """After a fault (module docstring): `rejoin` (a fresh group and stream, from ``actor``,
        the actor's group rebuilt by a restart; default the same), then syncs the actor's
        current weights as ``version``; `sync`'s metrics."""
        self.rejoin(actor)
        return self.sync(version)

    def rejoin(self, actor: RayWorkerGroup | None = None) -> None:
        """Stops what is left of the pool's group and starts a fresh one and a fresh stream
        from ``actor`` (default the same), holding no weights (``version`` -1) until the next
        sync: what a trainer's restart does, which restores a checkpoint before it syncs."""
        self._stop()
        self.version = -1
        if actor is not None:
            self.actor = actor
        self.group, self.stream = self._start()

    def close(self) -> None:
        """Stops the pool's processes (idempotent; `RayBackend.shutdown` stops them too)."""
        self._stop()
        self.version = -1


def pool_layout(spec: Any, devices: int, devices_per_host: int) -> dict[str, Any]:
    """Where and how a run's rollout pool generates (`RayRolloutPool`'s arguments), for ``spec``
    (a `jaxflow.configs.RunSpec`) and its last ``devices`` devices. On Ray a pool's devices are
    whole hosts of its own: ``devices / devices_per_host`` processes (their own bundles and
    world), while ``spec.placement`` (the actor's pool and every other) covers the first
    ``num_devices - devices``. The mesh is ``dp=-1,tp=<the actor's generation tp>`` (the
    generation tp, replicas over the rest), the rules the actor's generation rules, the dtype
    the actor's generation dtype (its masters' when that is not narrower). A ValueError says
    every reason a pool cannot be built."""
    placement, config = spec.placement, spec.models["actor"].config
    tp = placement.roles["actor"].gen_tp or 1
    placed = sum(pool.size for pool in placement.pools.values())
    problems = [
        (
            placed + devices != spec.num_devices,
            f"the placement's {placed} devices and the pool's {devices} are not the run's {spec.num_devices}",
        ),
        (devices < 1 or devices % devices_per_host, f"{devices} devices are not whole hosts of {devices_per_host}"),
        (devices % tp, f"the generation tp={tp} does not divide {devices} devices"),
        (config is None, "the actor's model shape is unknown (a checkpoint without config.json)"),
        (
            config is not None and config.lora is not None,
            "the actor trains LoRA adapters, which the pool would need merged in",
        ),
    ]
    problems = [why for wrong, why in problems if wrong]
    if problems:
        raise ValueError(f"a rollout pool of {devices} devices cannot be built: {'; '.join(problems)}")
    return dict(
        num_hosts=devices // devices_per_host,
        model=config,
        mesh=f"dp=-1,tp={tp}",
        rules=placement.rules("actor", "generate"),
        rollout=spec.rollout,
        dtype=np.dtype(generation_dtype(config) or config.param_dtype).name,
    )
