"""``python -m jaxflow.automap --config=NAME --devices=N --device_kind=KIND [--devices_per_host=H]
[--memory_gib=G] [--top=K] [--verify[=K]] [--concurrent] [--time_limit_s=S]
[--memory_scale=PHASE:F,...] [--json] [--config.key=value ...]``

Prints the auto-mapper's ranking for an experiment config on a cluster: per plan the pools
(roles, devices), every role's meshes per phase, the predicted time per stage and per
iteration (analytic), the memory per device (analytic) and the config overrides that
reproduce it. ``--verify`` compiles the best plan ahead of time on ``N`` simulated devices
through the dry run's builders and reports its compiled memory; when the compiler rejects it
because a program holds more than its analytic estimate, that phase's estimated working
memory (activations, KV cache) is scaled by what XLA allocated and the search runs again (``--verify=K``: at most K plans compiled).
``--memory_scale=generate:3.2``: start from such scales (e.g. learned by an earlier
``--verify``; its JSON's ``memory_scale``).
``--concurrent``: plan for a driver that runs stages on disjoint pools at the same time
(HybridFlow's; jaxflow's RL programs run one stage at a time, the default). The search stops
at ``--time_limit_s`` (default 60) and then says it was cut short.
``--json`` prints one object: ``{"best": plan, "candidates": [plans], "truncated": bool,
"search": {...}, ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

USAGE = __doc__


def _flag(rest: list[str], name: str, default: Any = None) -> Any:
    for a in rest:
        if a == f"--{name}":
            return True
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return default


def _format_plan(rank: int, d: dict[str, Any]) -> str:
    lines = [
        f"#{rank}  predicted {d['predicted_iteration_s']:.2f} s / iteration (analytic), "
        f"memory {d['memory_gib']:.2f} GiB per device (analytic)"
    ]
    for p in d["pools"]:
        lines.append(f"  pool {'+'.join(p['roles'])}: {p['devices']} devices, {p['memory_gib']:.2f} GiB")
        for role, meshes in p["meshes"].items():
            text = "; ".join(f"{ph} " + " ".join(f"{a}={n}" for a, n in m.items()) for ph, m in meshes.items())
            lines.append(f"    {role:<7} {text}")
    stages = sorted(d["predicted_stage_s"].items(), key=lambda kv: kv[1]["start"])
    lines.append(
        "  stages (s, analytic): "
        + ", ".join(f"{n} {s['seconds']:.2f} [{s['start']:.1f}-{s['end']:.1f}]" for n, s in stages)
    )
    lines.append(
        "  overrides: "
        + " ".join(f"--config.{k}={v if not isinstance(v, list) else tuple(v)}" for k, v in d["overrides"].items())
    )
    if "compiled" in d:
        c = d["compiled"]
        lines.append(
            f"  compiled on {d['overrides']['jaxflow.num_devices']} simulated devices: "
            f"{'fits' if c['fits'] else 'REJECTED: ' + str(c['rejected'])}; largest program total "
            f"{c['compiled_max_total_gib']:.2f} GiB (compiled) vs pool peak {c['estimated_max_pool_gib']:.2f} "
            f"GiB (analytic)"
        )
        for r in c["programs"]:
            lines.append(
                f"    {r['program']:<18} compiled peak {r['compiled_peak_gib']:7.2f} + resident "
                f"{r['resident_gib']:6.2f} = {r['compiled_total_gib']:7.2f} GiB  "
                f"(analytic pool peak {r['estimated_pool_peak_gib']:.2f})  {'fits' if r['fits'] else 'NO'}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from jaxflow import configs

    try:
        name, overrides, rest = configs.parse_cli_args(argv)
    except configs.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "--help" in rest or "-h" in rest:
        print(USAGE)
        return 0
    known = (
        "--devices",
        "--device_kind",
        "--devices_per_host",
        "--memory_gib",
        "--top",
        "--verify",
        "--json",
        "--time_limit_s",
        "--concurrent",
        "--memory_scale",
    )
    unknown = [a for a in rest if a.split("=", 1)[0] not in known]
    if unknown:
        print(f"error: unknown argument(s) {unknown}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        cfg = configs.get_config(name)
        configs.apply_overrides(cfg, overrides)
        devices = int(_flag(rest, "devices", cfg.jaxflow.num_devices))
        kind = _flag(rest, "device_kind", "cpu")
        per_host = _flag(rest, "devices_per_host")
        memory = _flag(rest, "memory_gib")
        top = int(_flag(rest, "top", 5))
        verify = _flag(rest, "verify", False)
        verify_top = 0 if verify is False else (1 if verify is True else int(verify))
        time_limit = float(_flag(rest, "time_limit_s", 60.0))
        concurrent = bool(_flag(rest, "concurrent", False))
        scales = {
            phase: float(f)
            for phase, f in (item.split(":") for item in filter(None, str(_flag(rest, "memory_scale", "")).split(",")))
        }
    except (configs.ConfigError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if verify_top:  # simulated devices must be set before JAX starts
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    from jaxflow.automap.profiles import get_profile
    from jaxflow.automap.search import Mapper
    from jaxflow.automap.verify import search_verified
    from jaxflow.automap.workload import workload_from_config

    as_json = bool(_flag(rest, "json", False))
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if as_json else (lambda s: print(s, flush=True))
    try:
        prof = get_profile(kind, int(per_host) if per_host else None, float(memory) if memory else None)
        t0 = time.perf_counter()
        w = workload_from_config(cfg)
        mapper = Mapper(w, devices, prof, concurrent=concurrent, whole_hosts=cfg.jaxflow.backend == "ray")
        for phase, factor in scales.items():
            mapper.scale_memory(phase, factor)
        plans = mapper.search(top=top, time_limit_s=time_limit)
        search_s = time.perf_counter() - t0
        best = plans[0]
        if verify_top:
            best, plans = search_verified(
                cfg, mapper, devices, attempts=verify_top, log=say, top=max(top, 20), time_limit_s=time_limit
            )
    except (ValueError, KeyError, configs.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {
        "config": name,
        "devices": devices,
        "device_kind": prof.name,
        "devices_per_host": prof.devices_per_host,
        "profile": prof.to_dict(),
        "search_s": search_s,
        "truncated": mapper.truncated,
        "search": {
            "time_limit_s": time_limit,
            "truncated": mapper.truncated,
            "concurrent": mapper.concurrent,
            "placements_explored": mapper.placements_done,
            "placements_total": mapper.placements_total,
            "allocations_evaluated": mapper.evaluated,
            "layouts_simulated": mapper.layouts_simulated,
        },
        "plans_evaluated": mapper.evaluated,
        "best": best.to_dict(devices),
        "best_rank": plans.index(best) + 1,
        "memory_scale": mapper.memory_scale,
        "candidates": [p.to_dict(devices) for p in plans[:top]],
    }
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"auto-mapper: {name} on {devices} x {prof.name} ({prof.devices_per_host} per host, "
        f"{prof.budget_bytes / 2**30:.1f} GiB usable each; profile {prof.source}); searched "
        f"{mapper.evaluated} allocations ({mapper.layouts_simulated} layouts simulated) in {search_s:.1f} s "
        f"(measured); stages {'overlap across pools' if mapper.concurrent else 'run one at a time'}"
    )
    if mapper.memory_scale:
        print(
            "estimated working memory scaled to what the compiled programs hold: "
            + ", ".join(f"{phase} x{f:.2f}" for phase, f in mapper.memory_scale.items())
        )
    if mapper.truncated:
        print(
            f"WARNING: search cut short at the {time_limit:g} s time limit: {mapper.placements_done} of "
            f"{mapper.placements_total} placements explored; the ranking covers only those (raise --time_limit_s)"
        )
    for i, p in enumerate(plans[:top], 1):
        print(_format_plan(i, p.to_dict(devices)))
    if best is not plans[0]:
        print("chosen (the best plan that compiles and fits):")
        print(_format_plan(plans.index(best) + 1, best.to_dict(devices)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
