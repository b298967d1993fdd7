"""The actor's rollouts on devices of their own (``jaxflow.placement.rollout_devices``), generated
by a thread while the trainer updates on the other devices.

::

    pool = LocalRolloutPool(actor_worker, devices[-4:], gen_tp=2)   # weights in a generation layout
    rollouter = Rollouter(pool)                                     # one thread generating on it
    ahead = GenerateAhead(lookahead, last_step, loader, to_batch, rollouter=rollouter)

A rollout pool (`RolloutPool`, implemented here for the local backend and by the Ray backend
between worker groups: `jaxflow.workers.ray.RayRolloutPool`, whose calls this thread makes to
the pool's group while the trainer's thread calls the actor's) holds the actor's generation weights on its own devices, of the
policy version it was last synced to (``version``; -1 before the first sync). ``sync(v)``
replaces them by the actor's current training weights (local: `jaxflow.reshard.WeightSync`,
shard by shard between the two device sets, nothing through the host; it reports
``weight_sync/bytes`` and ``timing_s/weight_sync``, verl's names). ``generate(prompts, step=)``
samples exactly as ``ActorWorker.generate(prompts, sampling="train", step=step)`` would from
the same weights: the same request (`jaxflow.workers.actor.rollout_request`: the key
``fold_in(key(seed), step)``, per-prompt and per-token folds) and the same engine call
(`jaxflow.workers.actor.sample_columns`), only on the pool's mesh (generation tp times
replicas over the pool, `jaxflow.reshard.generation_layout`). On Ray the sync is a
`jaxflow.workers.ray.WeightStream` between the actor's and the pool's worlds, and a restart
(``jaxflow.ray.max_restarts``) rejoins the pool to the actor's new group and discards the
rollouts in flight (`Rollouter.discard`).

`Rollouter` runs a pool's generations in submission order on one daemon thread: the trainer
(`jaxflow.trainer.ahead.GenerateAhead`) submits the rollouts of later steps and goes on with
the update on its own devices, and waits (`Rollouter.wait`) only for the rollout it consumes.
A sync replaces the pool's weights, so `Rollouter.sync` runs it only after every rollout in
flight has finished (`Rollouter.drain`), or, with partial rollouts (``trainer.partial_rollout``:
``partial_segment`` tokens), interrupts the one generating instead: the thread generates a
rollout in segments of at most ``partial_segment`` tokens per row (the pool's `start_partial` /
`run_partial` / `finish_partial`, `jaxflow.workers.actor.RolloutSampling` over
`jaxflow.sampling.partial`; on Ray the state stays in the pool's processes,
`jaxflow.workers.ray.RayRolloutPool`) and asks before each segment whether a sync is waiting; if so it
parks the rollout (its tokens, rollout log-probs and per-token versions kept), the sync
replaces the weights, and the rollout resumes under them (each row's prompt and tokens so far
prefilled again), its new tokens recording the new version. The rollouts queued behind it start
under the new weights. The sync waits for one segment at most, never for a whole rollout
(``fully_async/partial/interrupted``: the rollouts a step's sync parked). The thread's error is the trainer's: every later wait
re-raises it as one `RolloutError` line; a wait also stops on Ctrl-C / SIGTERM
(`jaxflow.trainer.interrupt`) and never waits without end for a thread that died. `close`
stops the thread: the generation in flight (one engine call, which JAX cannot cut short)
finishes, nothing after it starts, and the join waits ``close_timeout_s`` at most (a daemon
thread never keeps the process alive). ``overlap=False`` runs each generation in the
submitting thread instead: the same rollouts, without the overlap (for comparisons).

Idle time (`Rollouter.busy_seconds`): the thread records when each generation ran, so the
share of a step's wall time in which the pool generated nothing is its rollouter idle ratio
(``fully_async/rollouter/idle_ratio``); the trainer's is the share it spent waiting for
rollouts (``fully_async/trainer/idle_ratio``, `GenerateAhead.idle_ratios`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxflow.data.batch import Batch
from jaxflow.mesh.rules import state_shardings
from jaxflow.reshard import WeightSync, generation_layout
from jaxflow.trainer import interrupt
from jaxflow.workers.actor import ActorWorker, RolloutSampling

log = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """The rollouter thread failed; the trainer's wait raises this, in one line."""


class RolloutPool(Protocol):
    """The actor's generation on devices of its own (see the module docstring)."""

    version: int  # the policy version of the weights it holds (-1 before the first sync)

    def sync(self, version: int) -> dict[str, float]: ...

    def generate(self, prompts: Batch, *, step: int) -> Batch: ...

    def rollout_metrics(self) -> dict[str, float]: ...

    def generation_seconds(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class PartialRolloutPool(RolloutPool, Protocol):
    """A rollout pool whose rollouts a sync can interrupt (``trainer.partial_rollout``): the
    partial entry points of `jaxflow.workers.actor.RolloutSampling` (``start_partial(prompts,
    step=, version=)``, ``run_partial(partial, version, max_steps=, until=)``,
    ``finish_partial(partial)``: the rows of `generate` plus ``token_versions``). ``partial`` is
    whatever `start_partial` returns with a ``done`` attribute (the local pool's state, the Ray
    pool's `jaxflow.workers.ray.rollout_pool.PartialHandle`)."""

    def start_partial(self, prompts: Batch, *, step: int, version: int) -> Any: ...

    def run_partial(self, partial: Any, version: int, *, max_steps: int, until: Callable[[], bool]) -> Any: ...

    def finish_partial(self, partial: Any) -> Batch: ...


class LocalRolloutPool(RolloutSampling):
    """A `RolloutPool` in this process: ``actor``'s weights in its generation dtype
    (`ActorWorker.generation_dtype`) laid out ``gen_tp``-way tensor parallel with replicas over
    ``devices`` (none of the actor's), synced from its training weights by a `WeightSync`.
    It samples as the actor does (`jaxflow.workers.actor.RolloutSampling`: `generate`, and the
    partial rollouts' `start_partial` / `run_partial` / `finish_partial`) from those weights;
    the rollout probe does not run on it."""

    def __init__(self, actor: ActorWorker, devices: Sequence[Any], gen_tp: int):
        if actor.frozen is not None:
            raise ValueError("the rollout pool does not sync LoRA adapters yet")
        self.actor, self.graphdef = actor, actor.graphdef
        self._start_sampling(actor.rollout)
        self.probe = None
        self.gen_rules, self.gen_mesh = generation_layout(actor.rules, actor.mesh, devices, gen_tp)
        shardings = state_shardings(actor.params, self.gen_rules, self.gen_mesh)
        self.weight_sync = WeightSync(shardings, dtype=actor.generation_dtype())
        self.params: Any = None
        self.version = -1
        self.last_report = None  # the last sync's `SyncReport`

    def sync(self, version: int) -> dict[str, float]:
        """The actor's training weights of policy version ``version`` -> the pool's layout."""
        self.params, self.last_report = self.weight_sync(self.actor.params)
        self.version = version
        return {
            "weight_sync/bytes": float(self.last_report.bytes_moved),
            "timing_s/weight_sync": self.last_report.seconds,
        }

    def _generation_weights(self, stack: contextlib.ExitStack) -> tuple[Any, Any, Any, Any]:
        """What `RolloutSampling` samples from: the pool's weights, on its mesh (``reshard``
        seconds: none, the weights are synced apart)."""
        if self.params is None:
            raise RuntimeError("the rollout pool generates after its first sync")
        return self.graphdef, self.params, self.gen_mesh, self.gen_rules

    def close(self) -> None:
        """Drops the pool's weights."""
        self.params = None


class PoolGroup:
    """A rollout pool seen as the actor's worker group by `jaxflow.trainer.ahead.generate_rollout`
    (per-rank lists for the one-to-all methods)."""

    def __init__(self, pool: RolloutPool, generate: Callable[..., Batch] | None = None):
        self.pool = pool
        self._generate = pool.generate if generate is None else generate

    def generate(self, prompts: Batch, *, step: int) -> Batch:
        return self._generate(prompts, step=step)

    def generation_seconds(self) -> list[dict[str, float]]:
        return [self.pool.generation_seconds()]

    def rollout_metrics(self) -> list[dict[str, float]]:
        return [self.pool.rollout_metrics()]


class RolloutFuture(concurrent.futures.Future):
    """A submitted rollout: its step and policy version now, the `Rollout` when generated."""

    def __init__(self, step: int, version: int):
        super().__init__()
        self.step, self.version = step, version


class Rollouter:
    """One daemon thread generating ``pool``'s rollouts in submission order (see the module
    docstring); ``overlap=False``: each in the submitting thread."""

    WAIT_POLL_S = 0.5  # a wait checks for Ctrl-C and a dead thread this often
    KEPT_INTERVALS = 64  # generation intervals kept for `busy_seconds`

    def __init__(
        self,
        pool: RolloutPool,
        *,
        overlap: bool = True,
        close_timeout_s: float = 30.0,
        partial_segment: int | None = None,
    ):
        self.pool, self.overlap, self.close_timeout_s = pool, overlap, close_timeout_s
        self.partial_segment = partial_segment  # tokens per row per segment of a partial rollout; None: whole
        self._sync_requested = threading.Event()  # the trainer waits to sync: no segment starts
        self._segments = threading.Condition()  # guards the two below
        self._segment_running = False
        self._interrupted = 0  # rollouts parked by syncs, since `partial_counts` last read it
        self.error: BaseException | None = None  # the first generation that failed
        self._jobs: queue.Queue = queue.Queue()
        self._in_flight: collections.deque[RolloutFuture] = collections.deque()
        self._intervals: collections.deque[list[float | None]] = collections.deque(maxlen=self.KEPT_INTERVALS)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def submit(self, step: int, prompts: Batch, version: int) -> RolloutFuture:
        """Step ``step``'s rollout of ``prompts`` by the pool's weights (of policy ``version``)."""
        if self._stop.is_set():
            raise RuntimeError("the rollouter is closed")
        future = RolloutFuture(step, version)
        while self._in_flight and self._in_flight[0].done():  # the trainer waits on those itself
            self._in_flight.popleft()
        self._in_flight.append(future)
        if not self.overlap:
            self._run(future, prompts)
            return future
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jaxflow-rollouter", daemon=True)
            self._thread.start()
        self._jobs.put((future, prompts))
        return future

    def wait(self, future: RolloutFuture) -> Any:
        """The submitted rollout, once generated; the thread's error as a `RolloutError`."""
        while not future.done():
            concurrent.futures.wait([future], timeout=self.WAIT_POLL_S)
            interrupt.check()
            alive = self._thread is not None and self._thread.is_alive()
            if self.overlap and not alive and not future.done():
                raise RolloutError(f"the rollouter thread stopped before step {future.step}'s rollout")
        error = future.exception()
        if error is None:
            return future.result()
        if isinstance(error, RolloutError):
            raise error
        raise RolloutError(
            f"the rollouter failed generating step {future.step}'s rollout: {type(error).__name__}: {error}"
        ) from error

    def drain(self) -> None:
        """Waits for every rollout in flight (before a sync replaces the pool's weights)."""
        while self._in_flight:
            future = self._in_flight[0]
            self.wait(future)
            if self._in_flight and self._in_flight[0] is future:
                self._in_flight.popleft()

    def discard(self) -> None:
        """Waits for the rollouts in flight (their errors ignored) and forgets them and the
        thread's error, as a restart does (`jaxflow.trainer.ahead.GenerateAhead.discard_pending`):
        the rollouts submitted after it run again, on the pool as the restart rejoined it."""
        for future in list(self._in_flight):
            with contextlib.suppress(Exception):
                self.wait(future)
        self._in_flight.clear()
        self.error = None

    def sync(self, version: int) -> dict[str, float]:
        """The pool's weights replaced by the actor's of ``version``: after the rollouts in
        flight have finished, or (partial rollouts, ``partial_segment``) once the one
        generating has parked at the end of its segment; it goes on under the new weights."""
        if self.partial_segment is None:
            self.drain()
            return self.pool.sync(version)
        self._sync_requested.set()
        try:
            with self._segments:
                while self._segment_running:
                    self._segments.wait(self.WAIT_POLL_S)
                    interrupt.check()
            return self.pool.sync(version)
        finally:
            with self._segments:
                self._sync_requested.clear()
                self._segments.notify_all()

    def partial_counts(self) -> dict[str, float]:
        """``fully_async/partial/interrupted``: the rollouts the syncs parked since the last
        call (each resumes under the new weights)."""
        with self._segments:
            counts, self._interrupted = {"fully_async/partial/interrupted": float(self._interrupted)}, 0
        return counts

    def _generate_partial(self, prompts: Batch, *, step: int) -> Batch:
        """Step ``step``'s rollout (the pool's ``generate`` rows plus ``token_versions``) in
        segments of at most ``partial_segment`` tokens per row under the pool's weights of
        their version; a sync requested (`sync`) parks it between two segments, and the next
        segment runs under the synced weights (each row's prompt and tokens so far prefilled
        again: `jaxflow.sampling.partial`)."""
        partial = None
        while partial is None or not partial.done:
            with self._segments:
                while self._sync_requested.is_set():
                    if self._stop.is_set():
                        raise RolloutError(f"the rollouter closed with step {step}'s rollout parked")
                    self._segments.wait(self.WAIT_POLL_S)
                self._segment_running = True
            parked = False
            try:
                if partial is None:
                    partial = self.pool.start_partial(prompts, step=step, version=self.pool.version)
                partial = self.pool.run_partial(
                    partial, self.pool.version, max_steps=self.partial_segment, until=self._sync_requested.is_set
                )
                parked = not partial.done
            finally:
                with self._segments:
                    self._segment_running = False
                    self._interrupted += parked
                    self._segments.notify_all()
        return self.pool.finish_partial(partial)

    @property
    def version(self) -> int:
        return self.pool.version

    def busy_seconds(self, t0: float, t1: float) -> float:
        """Seconds of ``[t0, t1]`` (``time.perf_counter``) in which the pool generated."""
        with self._lock:
            intervals = [(s, t1 if e is None else e) for s, e in self._intervals]
        return sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in intervals)

    def close(self) -> None:
        """Stops the thread: the generation in flight finishes, nothing after it starts; joins
        it for ``close_timeout_s`` at most. Then the pool is closed."""
        self._stop.set()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(self.close_timeout_s)
            if self._thread.is_alive():
                log.warning("the rollouter thread is still generating after %.0f s; not waiting", self.close_timeout_s)
        for future in self._in_flight:
            future.cancel()  # those not started
        self._in_flight.clear()
        self.pool.close()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._stop.is_set():
                return
            self._run(*job)

    def _run(self, future: RolloutFuture, prompts: Batch) -> None:
        from jaxflow.trainer.ahead import generate_rollout

        if not future.set_running_or_notify_cancel():
            return
        if self.error is not None:  # nothing is generated after a failure
            future.set_exception(RolloutError(f"an earlier rollout failed: {self.error}"))
            return
        interval = [time.perf_counter(), None]
        with self._lock:
            self._intervals.append(interval)
        try:
            partial = None if self.partial_segment is None else self._generate_partial
            rollout = generate_rollout(future.step, prompts, future.version, PoolGroup(self.pool, partial))
        except BaseException as e:  # the trainer's next wait raises it
            self.error = e
            future.set_exception(e)
        else:
            future.set_result(rollout)
        finally:
            with self._lock:
                interval[1] = time.perf_counter()
