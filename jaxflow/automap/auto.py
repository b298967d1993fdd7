"""``jaxflow.placement.type=auto``: the auto-mapper chooses the placement and every mesh at
start-up, so a run needs no hand-picked mesh keys.

:func:`auto_place` takes the run's description without a placement (`RunSpec`, as
`jaxflow.configs.prepare.prepare_run` gives it for ``auto``) and returns an
:class:`AutoPlacement`: the chosen `Plan` (with its predicted step time, analytic) and the
run's spec with the plan's `Placement` (:func:`apply_plan`, which makes every candidate the
compile check tries too). The config keys that reproduce the choice
(`AutoPlacement.overrides`) are only for people and records: a command line to pin it, and
the config a run records beside its checkpoints. The device profile is
``jaxflow.placement.device_kind`` (empty: the kind of the local devices, e.g. the calibrated
``cpu`` profile on simulated devices); tensor parallelism stays within
``jaxflow.placement.devices_per_host`` (0: the profile's host size).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxflow.automap.profiles import DeviceProfile, get_profile, local_device_kind
from jaxflow.automap.search import Mapper, Plan
from jaxflow.automap.verify import apply_plan, search_verified
from jaxflow.automap.workload import workload_from_spec
from jaxflow.configs.run_spec import RunSpec

DRY_RUN_ATTEMPTS = 6  # plans a dry run may compile before it gives up


def placement_profile(spec: RunSpec) -> DeviceProfile:
    """The device profile ``jaxflow.placement.*`` names (host size: the Ray backend's hosts)."""
    kind = spec.mapping.device_kind
    if not kind:
        import jax

        kind = local_device_kind(jax.devices()[0])
    return get_profile(kind, spec.mapping.devices_per_host or None)


def describe(plan: Plan) -> str:
    """``actor+ref on 8 (actor dp=1 fsdp=8 tp=1 gen_tp=1, ref ...); predicted 0.5 s per
    iteration (analytic)``."""
    pools = "; ".join(
        f"{'+'.join(pc.roles)} on {pc.devices} ("
        + ", ".join(f"{r} {rl.layout.text()}" for r, rl in pc.layouts.items())
        + ")"
        for pc in plan.pools
    )
    return f"{pools}; predicted {plan.iteration_s:.3g} s per iteration (analytic)"


@dataclasses.dataclass(frozen=True)
class AutoPlacement:
    """The auto-mapper's choice for a run: the ``plan`` (pools, layouts, predicted stage and
    step times, analytic), the run's ``spec`` placed by it (`apply_plan`), the ``profile`` it
    planned with, and what the search did (``mapper``: plans evaluated, truncation, memory
    scales; ``search_s`` measured)."""

    plan: Plan
    spec: RunSpec
    profile: DeviceProfile
    mapper: Mapper
    search_s: float

    @property
    def predicted_step_s(self) -> float:
        """The plan's iteration time (analytic)."""
        return self.plan.iteration_s

    def overrides(self) -> dict[str, Any]:
        """The config keys that reproduce the choice (`Plan.overrides`)."""
        return self.plan.overrides(self.spec.num_devices)

    def describe(self) -> str:
        """``jaxflow: auto-mapper (cpu profile, 8 devices, 12 plans in 0.3 s): actor+ref on 8 (...);
        predicted 0.5 s per iteration (analytic)``, with a word when the search was cut short or
        planned with memory scaled to the compiled programs."""
        m = self.mapper
        cut = " (search cut short by its time limit: the best plan found so far)" if m.truncated else ""
        if m.memory_scale:
            scales = ", ".join(f"{phase} x{f:.2f}" for phase, f in m.memory_scale.items())
            cut += f" (working memory scaled to the compiled programs: {scales})"
        return (
            f"jaxflow: auto-mapper ({self.profile.name} profile, {self.spec.num_devices} devices, {m.evaluated} plans "
            f"in {self.search_s:.1f} s){cut}: {describe(self.plan)}"
        )


def auto_place(
    spec: RunSpec, devices: Sequence[Any], *, verify: bool = False, log: Callable[[str], None] | None = print
) -> AutoPlacement:
    """The auto-mapper's placement of ``spec`` (an RL run without one) on ``devices``: the
    best plan for the profile (`placement_profile`), pools of whole hosts on Ray; stages run
    one at a time (the RL programs block after each), so the mapper plans for that. With
    ``verify`` (a dry run, on simulated devices) the plan must also compile and fit
    (:func:`jaxflow.automap.verify.search_verified`). ``log`` gets the choice in one line."""
    if spec.job != "rl" or spec.placement is not None:
        raise ValueError(f"auto_place places an RL run without a placement; {spec.name} is a placed {spec.job} run")
    prof = placement_profile(spec)
    n = spec.num_devices
    t0 = time.perf_counter()
    mapper = Mapper(workload_from_spec(spec), n, prof, whole_hosts=spec.trainer.backend == "ray")
    if verify:
        plan, _ = search_verified(spec, mapper, n, attempts=DRY_RUN_ATTEMPTS, log=log)
    else:
        plan = mapper.search(top=1)[0]
    chosen = AutoPlacement(plan, apply_plan(spec, plan, devices), prof, mapper, time.perf_counter() - t0)
    if log is not None:
        log(chosen.describe())
    return chosen
