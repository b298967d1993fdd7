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
"search": {...}, ...}`` instead of the ranking; ``--json=PATH`` prints the ranking and writes
that object to PATH (as ``python -m jaxflow.run --dry_run --json=PATH`` does).
Each plan's ``overrides:`` line is shell-quoted: paste it after ``python -m jaxflow.run``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from typing import Any

from jaxflow.configs.run_spec import RunSpec

USAGE = __doc__


def _flag(rest: list[str], name: str, default: Any = None) -> Any:
    for a in rest:
        if a == f"--{name}":
            return True
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return default


def _typed(rest: list[str], name: str, kind: type, default: Any, minimum: float | None = None) -> Any:
    """``--name=VALUE`` as ``kind`` (``default`` when absent); a ValueError naming the flag
    for a missing value, one of another type, or one below ``minimum``."""
    raw = _flag(rest, name)
    if raw is None:
        return default
    if raw is True or raw == "":
        raise ValueError(f"--{name} needs a value (--{name}=...)")
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"--{name}={raw}: expected {'an integer' if kind is int else 'a number'}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"--{name}={raw}: must be >= {minimum:g}")
    return value


def _memory_scales(text: str) -> dict[str, float]:
    """``--memory_scale=generate:3.2,train:1.5`` as ``{phase: factor}``."""
    scales = {}
    for item in filter(None, text.split(",")):
        phase, _, factor = item.partition(":")
        try:
            scales[phase] = float(factor)
        except ValueError:
            raise ValueError(f"--memory_scale: {item!r} is not PHASE:FACTOR (e.g. generate:3.2)") from None
    return scales


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
        + " ".join(
            shlex.quote(f"--config.{k}={v if not isinstance(v, list) else tuple(v)}") for k, v in d["overrides"].items()
        )
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


KNOWN = (
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
FLAGS = tuple(f for name in KNOWN for f in (name, f"{name}="))  # each alone or with a value


@dataclasses.dataclass(frozen=True)
class Options:
    """The command line's flags, typed (`_options`)."""

    devices: int
    device_kind: str
    devices_per_host: int | None
    memory_gib: float | None
    top: int
    verify_top: int
    time_limit_s: float
    concurrent: bool
    memory_scale: dict[str, float]
    json_to: str | bool | None  # True: the JSON on stdout; a path: written there; None: no JSON


def _options(rest: list[str], default_devices: int) -> Options:
    """The flags of ``rest``; a ValueError naming the flag that is wrong."""
    json_to = _flag(rest, "json", None)
    if json_to == "":
        raise ValueError("--json= needs a path (or --json alone: the JSON on stdout)")
    return Options(
        devices=_typed(rest, "devices", int, default_devices, minimum=1),
        device_kind=str(_flag(rest, "device_kind", "cpu")),
        devices_per_host=_typed(rest, "devices_per_host", int, None, minimum=1),
        memory_gib=_typed(rest, "memory_gib", float, None),
        top=_typed(rest, "top", int, 5, minimum=1),
        verify_top=1 if _flag(rest, "verify") is True else _typed(rest, "verify", int, 0, minimum=0),
        time_limit_s=_typed(rest, "time_limit_s", float, 60.0),
        concurrent=bool(_flag(rest, "concurrent", False)),
        memory_scale=_memory_scales(str(_flag(rest, "memory_scale", ""))),
        json_to=json_to,
    )


def _search(spec: RunSpec, o: Options, say: Any) -> tuple[Any, Any, list[Any], Any, float]:
    """``(profile, mapper, plans, best, search seconds)``; ValueError for a cluster no plan fits."""
    from jaxflow.automap.profiles import get_profile
    from jaxflow.automap.search import Mapper
    from jaxflow.automap.verify import search_verified
    from jaxflow.automap.workload import workload_from_spec

    prof = get_profile(o.device_kind, o.devices_per_host, o.memory_gib)
    per = prof.devices_per_host
    if o.devices > per and o.devices % per:
        where = "--devices_per_host" if o.devices_per_host else f"the {prof.name} profile's; --devices_per_host"
        raise ValueError(f"--devices={o.devices} is not a whole number of hosts of {per} devices ({where})")
    t0 = time.perf_counter()
    mapper = Mapper(
        workload_from_spec(spec), o.devices, prof, concurrent=o.concurrent, whole_hosts=spec.trainer.backend == "ray"
    )
    for phase, factor in o.memory_scale.items():
        mapper.scale_memory(phase, factor)
    plans = mapper.search(top=o.top, time_limit_s=o.time_limit_s)
    search_s = time.perf_counter() - t0
    best = plans[0]
    if o.verify_top:
        best, plans = search_verified(
            spec, mapper, o.devices, attempts=o.verify_top, log=say, top=max(o.top, 20), time_limit_s=o.time_limit_s
        )
    return prof, mapper, plans, best, search_s


def _result(name: str, o: Options, prof: Any, mapper: Any, plans: list[Any], best: Any, search_s: float) -> dict:
    """The ``--json`` object."""
    return {
        "config": name,
        "devices": o.devices,
        "device_kind": prof.name,
        "devices_per_host": prof.devices_per_host,
        "profile": prof.to_dict(),
        "search_s": search_s,
        "truncated": mapper.truncated,
        "search": {
            "time_limit_s": o.time_limit_s,
            "truncated": mapper.truncated,
            "concurrent": mapper.concurrent,
            "placements_explored": mapper.placements_done,
            "placements_total": mapper.placements_total,
            "allocations_evaluated": mapper.evaluated,
            "layouts_simulated": mapper.layouts_simulated,
        },
        "plans_evaluated": mapper.evaluated,
        "best": best.to_dict(o.devices),
        "best_rank": plans.index(best) + 1,
        "memory_scale": mapper.memory_scale,
        "candidates": [p.to_dict(o.devices) for p in plans[: o.top]],
    }


def _print_ranking(name: str, o: Options, prof: Any, mapper: Any, plans: list[Any], best: Any, search_s: float) -> None:
    print(
        f"auto-mapper: {name} on {o.devices} x {prof.name} ({prof.devices_per_host} per host, "
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
            f"WARNING: search cut short at the {o.time_limit_s:g} s time limit: {mapper.placements_done} of "
            f"{mapper.placements_total} placements explored; the ranking covers only those (raise --time_limit_s)"
        )
    for i, p in enumerate(plans[: o.top], 1):
        print(_format_plan(i, p.to_dict(o.devices)))
    if best is not plans[0]:
        print("chosen (the best plan that compiles and fits):")
        print(_format_plan(plans.index(best) + 1, best.to_dict(o.devices)))


def main(argv: list[str] | None = None) -> int:
    """The command line (run.py's: `jaxflow.run.load_command`, `jaxflow.run.report`)."""
    from jaxflow.configs import ConfigError
    from jaxflow.mesh.devices import simulate_devices
    from jaxflow.run import load_command, report

    command = load_command(sys.argv[1:] if argv is None else argv, USAGE, FLAGS)
    if isinstance(command, int):
        return command
    planning_errors = (ValueError, KeyError, ConfigError)  # flags, configs and clusters no plan fits
    try:
        o = _options(command.rest, command.num_devices)
        if o.verify_top:  # simulated devices must be set before JAX starts
            simulate_devices(o.devices)
        as_json = o.json_to is True
        say = (lambda s: print(s, file=sys.stderr, flush=True)) if as_json else (lambda s: print(s, flush=True))
        spec = command.prepare(with_placement=False, with_datasets=False).spec
        found = _search(spec, o, say)
    except planning_errors as e:
        return report(e, user_errors=planning_errors)
    result = _result(command.name, o, *found)
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    _print_ranking(command.name, o, *found)
    if o.json_to is not None:
        try:
            with open(o.json_to, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
        except OSError as e:
            print(f"error: --json={o.json_to}: cannot write it: {e.strerror}", file=sys.stderr)
            return 2
        print(f"wrote {o.json_to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
