"""The iteration time of jaxflow's three trainer modes (issue 23), ANALYTIC: a model over the
simulators of :mod:`jaxflow.automap.simulate` and the mapper of :mod:`jaxflow.automap.search`;
nothing here is measured.

Modes, for a workload ``w`` on ``N`` devices (``G`` the rollout's generation seconds on its
pool, ``Rest`` the rest of the step on the training pool, ``S`` the weight sync's seconds):

- ``sync`` (today): the mapper's best plan; its iteration time is the plan's schedule
  (:func:`jaxflow.automap.search.schedule`): generation, then the forwards, then the updates.
- ``one_step_off`` (verl's one-step-off policy): the ``N`` devices split into a rollout pool
  of ``Nr`` whole hosts running the actor's generation and a training pool of ``N - Nr``
  running every other stage (the mapper's best plan of the workload without its rollout, on
  those devices). The rollout of step ``k+1`` overlaps the update of step ``k``; the new
  weights then cross to the rollout pool, which neither pool overlaps::

      T_one_step_off = max(G_max, Rest) + S

- ``async`` (a rollouter produces continuously into a buffer, the trainer consumes
  mini-batches as they fill, staleness bounded by ``max_staleness >= 1``): in steady state
  the slower of producer and consumer sets the pace, and each sync pauses both::

      T_async = max(G_mean, Rest) + S

  With ``max_staleness = 0`` the rollouter may not run ahead of the trainer: nothing
  overlaps, ``T = G_mean + Rest + S``. On a ``shared_host`` profile (simulated devices on
  one processor) the pools never overlap either.

**The long tail.** A synchronous generation call (``sync``, ``one_step_off``) decodes each
wave of its slots until the wave's longest response ends: ``R_max`` steps per wave (the
simulator's ``generate`` stage with ``response_len = R_max``). A continuous rollouter starts
a new sequence in every slot that frees, so in steady state a slot serves a response per
``R_mean`` steps: ``G_mean`` is the same stage with ``response_len = R_mean = rho R_max``
(the same engine shape, slots and KV memory as for ``R_max``; the decode steps' mean context
``P + (R_mean + 1) / 2``). ``rho = E[L] / R_max`` is an explicit assumption
(:class:`LongTail`): by default the lengths ``L = min(R_max, X)``, ``X`` lognormal with
``sigma = 1`` and median ``R_max / 4``, so::

      rho = e^{sigma^2 / 2} Phi((ln k - sigma^2) / sigma) / k + 1 - Phi(ln k / sigma),  k = 4

  i.e. ``rho = 0.351``, and ``1 - Phi(ln k / sigma) = 8.3 %`` of the responses reach the cap
  (a batch of 1024 has one at the cap with probability ``1 - 0.917^1024 ~ 1``, so the
  batch's ``R_max`` is the cap). The training stages' times do not change: batches are
  padded to ``R_max`` in every mode.

**The weight sync** (:func:`weight_sync`): after each update the actor's generation weights
(its parameters in the generation dtype) cross from the training pool to the rollout pool,
shard by shard, every device on its own inter-host link (``inter_bw``; the pools are on
different hosts). Each of the ``Nr`` rollout devices receives its generation shard ``Wg``
(:attr:`jaxflow.plan.dry_run.RolePlan.generate_param_bytes`: every generation replica needs
a whole copy); the ``Na`` devices of the actor's training pool send those ``Nr Wg`` bytes
between them. With the fastest of the profile's protocols (each ``p``)::

      S = min_p (base_s + net_hop_s + max(Wg, Nr Wg / Na) / (bw_fraction inter_bw))

The split search (:func:`split_modes`): every ``Nr`` and ``Nt`` of whole hosts with
``Nr + Nt <= N``; per mode the rollout layout on ``Nr`` with the least generation time whose
generation memory (the weights' generation shard, the KV cache, the decode activations) fits
a device, the mapper's best plan of the rest on ``Nt`` (its pools leave the actor's
generation memory out: :class:`TrainingPoolMapper`), and the split with the least iteration
time. Hosts left idle are reported: the mapper must use every device of a pool it is given,
and on some counts (a batch that does not divide, pools forced to run one after another)
the model predicts them slower than fewer devices; with idle hosts allowed, more devices are
never slower.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxflow.automap.layouts import RoleLayout, feasible_layouts
from jaxflow.automap.profiles import DeviceProfile
from jaxflow.automap.search import Mapper, Plan, pool_sizes
from jaxflow.automap.simulate import StageTime, stage_time
from jaxflow.automap.workload import Stage, Workload

MODES = ("sync", "one_step_off", "async")
ROLLOUT_PHASES = frozenset({"generate", "generate_one"})  # the rollout pool's stages (the actor's)


def _phi(x: float) -> float:
    """The standard normal's distribution function."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclasses.dataclass(frozen=True)
class LongTail:
    """The response lengths' assumption: ``L = min(R_max, X)``, ``X`` lognormal with ``sigma``
    and median ``R_max / cap_over_median`` (see the module docstring); ``mean_over_max``
    given: that ``rho = E[L] / R_max`` instead of the distribution's."""

    sigma: float = 1.0
    cap_over_median: float = 4.0
    mean_over_max_given: float | None = None

    def __post_init__(self):
        rho = self.mean_over_max_given
        if rho is not None and not 0 < rho <= 1:
            raise ValueError(f"mean/max response length {rho} must be in (0, 1]")
        if self.sigma <= 0 or self.cap_over_median < 1:
            raise ValueError(f"lognormal sigma={self.sigma} must be > 0, cap/median={self.cap_over_median} >= 1")

    @property
    def capped_fraction(self) -> float:
        """``P(X >= R_max) = 1 - Phi(ln k / sigma)``."""
        return 1.0 - _phi(math.log(self.cap_over_median) / self.sigma)

    @property
    def mean_over_max(self) -> float:
        """``rho = E[min(R_max, X)] / R_max``."""
        if self.mean_over_max_given is not None:
            return self.mean_over_max_given
        s, k = self.sigma, self.cap_over_median
        return math.exp(s * s / 2) * _phi((math.log(k) - s * s) / s) / k + self.capped_fraction

    def text(self, rows: int) -> str:
        rho = self.mean_over_max
        if self.mean_over_max_given is not None:
            return f"mean/max response length rho = {rho:.3f} (given)"
        return (
            f"response lengths min(R_max, X), X lognormal (sigma {self.sigma:g}, median R_max/{self.cap_over_median:g}): "
            f"mean/max rho = {rho:.3f}, {self.capped_fraction:.1%} of responses at the cap, a batch of {rows} "
            f"reaches it with probability {1 - (1 - self.capped_fraction) ** rows:.4f}"
        )


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """What the model assumes beyond the profile and the workload (printed with its numbers)."""

    long_tail: LongTail = LongTail()
    max_staleness: int = 1  # async: policy versions the rollouter may run ahead
    concurrent: bool = False  # stages on disjoint pools of one side overlap (HybridFlow's driver)

    def lines(self, w: Workload) -> list[str]:
        return [
            "ANALYTIC model (jaxflow.automap.async_schedule), nothing measured",
            "long tail: " + self.long_tail.text(w.rows),
            f"sync and one_step_off generation calls wait for R_max = {w.response_len} tokens per wave; the async "
            f"rollouter decodes R_mean = {mean_response_len(w, self.long_tail)} per response (same slots and KV memory)",
            "training stages pad to R_max in every mode; the weight sync pauses both pools",
            f"async max_staleness = {self.max_staleness} (0: no overlap); one_step_off has staleness 1",
            "weight sync: the actor's generation weights, shard by shard, every device on its own inter-host link",
            "stages on disjoint pools of one side "
            + ("overlap (HybridFlow's driver)" if self.concurrent else "run one at a time (jaxflow's driver)"),
            "pools between rollout and training: whole hosts; memory checked analytically (no compile check)",
        ]


def mean_response_len(w: Workload, tail: LongTail) -> int:
    """``R_mean = max(1, round(rho R_max))``."""
    return max(1, round(tail.mean_over_max * w.response_len))


def training_workload(w: Workload) -> Workload:
    """The step without its rollout: the actor's generation and reshard stages dropped (they
    run on the rollout pool, the weights arrive by the sync), and with them the dependencies."""
    gone = {s.name for s in w.stages if s.role == "actor" and (s.phase in ROLLOUT_PHASES or s.phase == "reshard")}
    stages = tuple(
        Stage(s.name, s.role, s.phase, tuple(d for d in s.deps if d not in gone))
        for s in w.stages
        if s.name not in gone
    )
    return dataclasses.replace(w, name=f"{w.name} (training pool)", stages=stages)


class TrainingPoolMapper(Mapper):
    """The mapper of a training pool beside a rollout pool: the actor's pools keep no
    generation copy, KV cache or decode activations."""

    phases_elsewhere = frozenset({"generate"})


@dataclasses.dataclass(frozen=True)
class RolloutPool:
    """The actor's generation alone on ``devices`` (analytic)."""

    devices: int
    layout: RoleLayout
    times: dict[str, StageTime]
    memory_bytes: int  # per device: generation weights, KV cache, decode activations

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.times.values())


def rollout_memory(rl: RoleLayout) -> int:
    p = rl.plan
    return p.generate_param_bytes + p.kv_cache_bytes + p.activation_bytes.get("generate", 0)


def rollout_layouts(w: Workload, devices: int, prof: DeviceProfile) -> list[RoleLayout]:
    """The actor's layouts on ``devices`` whose generation memory fits a device (the actor
    does not train there: its mini-batches need not split over the pool)."""
    untrained = dataclasses.replace(
        w,
        mini_batch_rows={r: v for r, v in w.mini_batch_rows.items() if r != "actor"},
        train_micro={r: v for r, v in w.train_micro.items() if r != "actor"},
        epochs={r: v for r, v in w.epochs.items() if r != "actor"},
    )
    return [
        rl
        for rl in feasible_layouts(untrained, "actor", devices, prof.devices_per_host)
        if rollout_memory(rl) <= prof.budget_bytes
    ]


def best_rollout(w: Workload, w_time: Workload, layouts: list[RoleLayout], prof: DeviceProfile) -> RolloutPool:
    """The fastest of ``layouts`` at generating ``w_time``'s responses (``w``'s stages)."""
    stages = [s for s in w.stages if s.role == "actor" and s.phase in ROLLOUT_PHASES]
    pools = [
        RolloutPool(
            rl.layout.devices, rl, {s.name: stage_time(w_time, s.phase, rl, prof) for s in stages}, rollout_memory(rl)
        )
        for rl in layouts
    ]
    return min(pools, key=lambda p: p.seconds)


@dataclasses.dataclass(frozen=True)
class WeightSync:
    """One sync of the actor's weights from the training pool to the rollout pool (analytic)."""

    model_bytes: int  # one copy of the actor's parameters in the generation dtype
    bytes_per_receiver: int  # Wg: each rollout device's generation shard
    total_bytes: int  # Nr Wg: what crosses between the pools
    senders: int  # Na: the actor's training devices
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def weight_sync(w: Workload, rollout: RolloutPool, senders: int, prof: DeviceProfile) -> WeightSync:
    """``S = min_p (base_s + net_hop_s + max(Wg, Nr Wg / Na) / (bw_fraction inter_bw))``."""
    rm = w.models["actor"]
    per_receiver = rollout.layout.plan.generate_param_bytes
    total = per_receiver * rollout.devices
    link_bytes = max(per_receiver, total / senders)
    seconds = min(p.base_s + p.net_hop_s + link_bytes / (p.bw_fraction * prof.inter_bw) for p in prof.protocols)
    model_bytes = rm.num_params * min(rm.compute_itemsize, rm.param_itemsize)
    return WeightSync(model_bytes, per_receiver, total, senders, seconds)


def steady_state(generate_s: float, rest_s: float, sync_s: float, overlap: bool) -> float:
    """``max(G, Rest) + S`` when the pools overlap, else ``G + Rest + S``."""
    return (max(generate_s, rest_s) if overlap else generate_s + rest_s) + sync_s


@dataclasses.dataclass(frozen=True)
class ModePlan:
    """One mode's predicted steady-state iteration (analytic). ``generate_s``: the rollout's
    generation seconds per iteration; ``rest_s``: the rest of the step (``sync``: the
    iteration less the generation stages); ``training``: the plan of the training side (for
    ``sync`` the whole step's)."""

    mode: str
    devices: int
    iteration_s: float
    generate_s: float
    rest_s: float
    training: Plan
    rollout: RolloutPool | None = None
    sync: WeightSync | None = None

    def to_dict(self, w: Workload, sync_iteration_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "predicted_iteration_s": self.iteration_s,
            "samples_per_s": w.rows / self.iteration_s,
            "speedup_over_sync": sync_iteration_s / self.iteration_s,
            "generate_s": self.generate_s,
            "rest_s": self.rest_s,
            "rollout_devices": self.rollout_devices,
            "training_devices": self.training_devices,
            "idle_devices": self.devices - self.rollout_devices - self.training_devices,
            "training_pools": [{"roles": list(p.roles), "devices": p.devices} for p in self.training.pools],
        }
        if self.rollout is not None:
            out["rollout_layout"] = self.rollout.layout.layout.text()
            out["rollout_memory_gib"] = self.rollout.memory_bytes / 2**30
            out["rollout_idle_fraction"] = 1 - self.generate_s / (self.iteration_s - self.sync.seconds)
            out["trainer_idle_fraction"] = 1 - self.rest_s / (self.iteration_s - self.sync.seconds)
            out["weight_sync"] = self.sync.to_dict()
        return out

    @property
    def rollout_devices(self) -> int:
        return self.rollout.devices if self.rollout is not None else 0

    @property
    def training_devices(self) -> int:
        return sum(p.devices for p in self.training.pools)


def sync_mode(w: Workload, devices: int, prof: DeviceProfile, a: Assumptions, time_limit_s: float = 60.0) -> ModePlan:
    """Today's synchronous step: the mapper's best plan on all the devices."""
    plan = Mapper(w, devices, prof, concurrent=a.concurrent).search(top=1, time_limit_s=time_limit_s)[0]
    rollout = plan.pool_of("actor")
    generate_s = sum(t.seconds for name, t in rollout.stage_times.items() if _rollout_stage(w, name))
    return ModePlan("sync", devices, plan.iteration_s, generate_s, plan.iteration_s - generate_s, plan)


def _rollout_stage(w: Workload, name: str) -> bool:
    return any(s.name == name and s.phase in ROLLOUT_PHASES for s in w.stages)


def host_sizes(devices: int, devices_per_host: int) -> list[int]:
    """A pool's sizes beside another: whole hosts, leaving at least one host to the other."""
    return [s for s in pool_sizes(devices, devices_per_host, whole_hosts=True) if s < devices]


def training_plans(w: Workload, devices: int, prof: DeviceProfile, a: Assumptions, time_limit_s: float) -> dict:
    """Training pool size -> the mapper's best plan of the step without its rollout (the
    sizes where something fits)."""
    w_train, plans = training_workload(w), {}
    for n in host_sizes(devices, prof.devices_per_host):
        try:
            plans[n] = TrainingPoolMapper(w_train, n, prof, concurrent=a.concurrent).search(1, time_limit_s)[0]
        except ValueError:  # nothing fits on n devices
            continue
    return plans


def split_modes(
    w: Workload, devices: int, prof: DeviceProfile, a: Assumptions, time_limit_s: float = 60.0
) -> dict[str, ModePlan]:
    """``one_step_off`` and ``async`` at their best split of whole hosts (none when no split
    fits). A split may leave hosts idle (``Nr + Nt <= N``) when the model predicts no gain
    from them (a pool the batch does not divide, a training pool the mapper must cut into
    pools that run one after another), so that more devices are never slower."""
    overlap = not prof.shared_host
    w_mean = dataclasses.replace(w, response_len=mean_response_len(w, a.long_tail))
    modes = (("one_step_off", w, overlap), ("async", w_mean, overlap and a.max_staleness >= 1))
    trainings = training_plans(w, devices, prof, a, time_limit_s)
    best: dict[str, ModePlan] = {}
    for n_rollout in host_sizes(devices, prof.devices_per_host):
        layouts = rollout_layouts(w, n_rollout, prof)
        if not layouts:
            continue
        for mode, w_time, overlapped in modes:
            rollout = best_rollout(w, w_time, layouts, prof)
            for n_train, training in trainings.items():
                if n_rollout + n_train > devices:
                    continue
                sync = weight_sync(w, rollout, training.pool_of("actor").devices, prof)
                it = steady_state(rollout.seconds, training.iteration_s, sync.seconds, overlapped)
                plan = ModePlan(mode, devices, it, rollout.seconds, training.iteration_s, training, rollout, sync)
                if mode not in best or _rank(plan) < _rank(best[mode]):
                    best[mode] = plan
    return best


def _rank(p: ModePlan) -> tuple[float, int]:
    """Faster first; at equal time, fewer idle devices."""
    return p.iteration_s, p.devices - p.rollout_devices - p.training_devices


def predict(
    w: Workload, devices: int, prof: DeviceProfile, a: Assumptions = Assumptions(), time_limit_s: float = 60.0
) -> dict[str, ModePlan]:
    """Every mode's best plan (``sync`` first); a split mode is absent when no split fits."""
    return {"sync": sync_mode(w, devices, prof, a, time_limit_s), **split_modes(w, devices, prof, a, time_limit_s)}


__all__ = [
    "MODES",
    "Assumptions",
    "LongTail",
    "ModePlan",
    "RolloutPool",
    "TrainingPoolMapper",
    "WeightSync",
    "best_rollout",
    "mean_response_len",
    "predict",
    "rollout_layouts",
    "host_sizes",
    "split_modes",
    "steady_state",
    "sync_mode",
    "training_plans",
    "training_workload",
    "weight_sync",
]
