"""``jaxflow.placement.type=auto``: the auto-mapper chooses the placement and every mesh at
start-up, so a run needs no hand-picked mesh keys.

:func:`resolve_placement` returns the config with the chosen plan's keys set (placement type
``custom`` or ``colocated``, pool sizes, ``jaxflow.mesh.*``), validated; configs with another
placement type come back unchanged. The device profile is ``jaxflow.placement.device_kind``
(empty: the kind of the local devices, e.g. the calibrated ``cpu`` profile on simulated
devices); tensor parallelism stays within ``jaxflow.placement.devices_per_host`` (0: the
profile's host size).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ml_collections import ConfigDict

from jaxflow.automap.profiles import DeviceProfile, get_profile, local_device_kind
from jaxflow.automap.search import Mapper, Plan
from jaxflow.automap.verify import apply_plan, search_verified

DRY_RUN_ATTEMPTS = 6  # plans a dry run may compile before it gives up


def placement_profile(cfg: ConfigDict) -> DeviceProfile:
    """The device profile ``jaxflow.placement.*`` names (host size: the Ray backend's hosts)."""
    p = cfg.jaxflow.placement
    kind = p.device_kind
    if not kind:
        import jax

        kind = local_device_kind(jax.devices()[0])
    per_host = cfg.jaxflow.ray.devices_per_host if cfg.jaxflow.backend == "ray" else p.devices_per_host
    return get_profile(kind, per_host or None)


def describe(plan: Plan) -> str:
    pools = "; ".join(
        f"{'+'.join(pc.roles)} on {pc.devices} ("
        + ", ".join(f"{r} {rl.layout.text()}" for r, rl in pc.layouts.items())
        + ")"
        for pc in plan.pools
    )
    return f"{pools}; predicted {plan.iteration_s:.3g} s per iteration (analytic)"


def resolve_placement(cfg: ConfigDict, log: Callable[[str], None] | None = print) -> ConfigDict:
    """``cfg`` with ``jaxflow.placement.type=auto`` replaced by the auto-mapper's choice. Other
    configs, and sft jobs (the actor alone on every device), are returned as they are. In a
    dry run (``jaxflow.dry_run.enable``, on simulated devices) the choice is also compiled:
    the best plan whose programs fit (:func:`jaxflow.automap.verify.search_verified`)."""
    from jaxflow.automap.workload import workload_from_config
    from jaxflow.configs import validate

    if cfg.jaxflow.placement.type != "auto" or cfg.jaxflow.job != "rl":
        return cfg  # an sft job runs the actor alone: auto is the colocated placement
    prof = placement_profile(cfg)
    n = cfg.jaxflow.num_devices
    t0 = time.perf_counter()
    # Pools of whole hosts on Ray (one process per host per group); stages run one at a time
    # (the RL programs block after each), so the mapper plans for that.
    mapper = Mapper(workload_from_config(cfg), n, prof, whole_hosts=cfg.jaxflow.backend == "ray")
    if cfg.jaxflow.dry_run.enable:  # simulated devices at hand: the plan must also compile and fit
        plan, _ = search_verified(cfg, mapper, n, attempts=DRY_RUN_ATTEMPTS, log=log)
    else:
        plan = mapper.search(top=1)[0]
    out = apply_plan(cfg, plan, n)
    validate(out)
    if log is not None:
        cut = " (search cut short by its time limit: the best plan found so far)" if mapper.truncated else ""
        if mapper.memory_scale:
            cut += (
                " (working memory scaled to the compiled programs: "
                + ", ".join(f"{phase} x{f:.2f}" for phase, f in mapper.memory_scale.items())
                + ")"
            )
        log(
            f"jaxflow: auto-mapper ({prof.name} profile, {n} devices, {mapper.evaluated} plans in "
            f"{time.perf_counter() - t0:.1f} s){cut}: {describe(plan)}"
        )
    return out
