"""Untrusted Python run in a sandbox, and the code reward built on it: the fraction of a
sample's tests that the response's code passes.

Each run is a fresh process (`run_python`):

- started as ``nobody`` when jaxflow runs as root (``setpriv``; root ignores the per-user
  process limit), else as jaxflow's user, whose process limit then counts its own processes
  plus the sandbox's allowance;
- resource limits (`SandboxLimits`, ``prlimit``): CPU seconds, address space, bytes per
  written file, processes, open files, no core dumps; and a wall-clock timeout enforced from
  outside;
- in new user, network, mount and PID namespaces (``unshare``): no network device but a
  loopback that is down; ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are fresh size-capped tmpfs
  mounts that vanish with the run, and the program starts in ``/tmp``; the rest of the file
  system is writable only where the sandbox's user could write anyway (``nobody``: nowhere
  that matters), and the program itself runs with every capability dropped (``setpriv``), so it
  cannot undo the mounts;
- the program is PID 1 of its namespace: when it exits or is killed, the kernel kills every
  process it forked, so nothing is left behind.

Without user namespaces (or the ``unshare`` / ``setpriv`` tools) the sandbox refuses to run
(`SandboxUnavailable`) unless the caller passes ``isolated=False``, which keeps the limits, the
timeout and the process group but not the namespaces.

Scoring. `score_code` takes the response's last fenced code block (or the whole response),
appends each test (an ``assert`` statement, from the ground truth) and counts the tests after
which the harness printed a per-run random token. Code that loops forever, exhausts memory,
forks without bound, writes outside its directory or opens a socket fails its tests and
scores 0. The token guards against a response that prints "passed" itself; a program that
reads the harness's own frames could still find it, so the score is a reward, not a security
boundary: the isolation above is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxflow.rewards.registry import register_reward

NOBODY = 65534
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate untrusted code (no user namespaces, or no ``unshare`` /
    ``setpriv``); the message says what is missing."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per run: ``cpu_s`` CPU seconds (each process), ``wall_s`` seconds of wall clock,
    ``memory_bytes`` of address space (each process), ``file_bytes`` per written file and for
    each tmpfs, ``processes`` the run may start, ``output_bytes`` of stdout / stderr kept."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 512 << 20
    file_bytes: int = 16 << 20
    processes: int = 16
    open_files: int = 64
    output_bytes: int = 1 << 16

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_bytes", "file_bytes", "processes", "open_files", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one run did: its exit code (negative: killed by that signal), whether the wall
    clock ran out, its output (cut at ``output_bytes``) and whether it ran isolated."""

    returncode: int
    timed_out: bool
    stdout: str
    stderr: str
    isolated: bool


def _tool(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + "/usr/bin:/bin:/usr/sbin:/sbin")


def _user_processes(uid: int) -> int:
    """Processes of ``uid`` now (from /proc)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += 1
            except OSError:
                continue
    return count


def _sandbox_user() -> list[str]:
    """The command prefix that runs as ``nobody`` when jaxflow runs as root (so that the
    per-user process limit applies; root ignores it), else nothing."""
    if os.geteuid() != 0:
        return []
    return [_tool("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def _limits_prefix(limits: SandboxLimits) -> list[str]:
    """``prlimit`` with the run's limits; the process limit counts the sandbox user's
    processes now plus the run's allowance."""
    uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    procs = _user_processes(uid) + limits.processes + 4  # + unshare, sh, setpriv, the program
    return [
        _tool("prlimit"),
        f"--cpu={limits.cpu_s}",
        f"--as={limits.memory_bytes}",
        f"--fsize={limits.file_bytes}",
        f"--nproc={procs}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]


_CANDIDATES = (os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3")


def _first_interpreter(command) -> tuple[str | None, str]:
    """``(the first of `_CANDIDATES` that runs ``pass`` under ``command(interpreter)``, "")``,
    or ``(None, why none did)``: jaxflow's own interpreter may sit in a home directory that the
    sandbox's user cannot enter."""
    error = "no Python interpreter starts inside the sandbox"
    for candidate in _CANDIDATES:
        if not os.path.isfile(candidate):
            continue
        try:
            p = subprocess.run(
                command(candidate), input=b"pass\n", capture_output=True, timeout=60, start_new_session=True
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            error = f"{error} ({candidate}: {e})"
            continue
        if p.returncode == 0:
            return candidate, ""
        error = f"{error} ({candidate}: {p.stderr.decode(errors='replace').strip()[-300:]})"
    return None, error


def _probe() -> tuple[str | None, str | None]:
    """``(interpreter, None)`` when runs can be isolated here, else ``(None, what is missing)``."""
    for tool in ("unshare", "setpriv", "prlimit"):
        if _tool(tool) is None:
            return None, f"the {tool!r} tool (util-linux) is not installed"
    interpreter, error = _first_interpreter(lambda python: _isolated_command(SandboxLimits(), python))
    return interpreter, (error or None)


def _plain_command(limits: SandboxLimits, interpreter: str) -> list[str]:
    """The unisolated run: the sandbox's user and limits only."""
    limited = _limits_prefix(limits) if _tool("prlimit") else []
    return _sandbox_user() + limited + [interpreter, "-I", "-S", "-"]


_PLAIN: list[tuple[str | None, str]] = []


_PROBED: list[tuple[str | None, str | None]] = []


def _probed() -> tuple[str | None, str | None]:
    if not _PROBED:
        _PROBED.append(_probe())
    return _PROBED[0]


def isolation_available() -> bool:
    """Whether `run_python` can isolate a run on this machine (checked once)."""
    return _probed()[0] is not None


def isolation_problem() -> str | None:
    """What this machine lacks to isolate a run (None when it can)."""
    return _probed()[1]


def _isolated_command(limits: SandboxLimits, interpreter: str) -> list[str]:
    """``unshare`` into fresh namespaces, tmpfs scratch space, then the interpreter (reading
    the program from stdin) with every capability dropped; it is the namespace's PID 1."""
    scratch = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
    mounts = " && ".join(
        f"mount -t tmpfs -o size={limits.file_bytes},mode=1777,nosuid,nodev tmpfs {d}" for d in scratch
    )
    setpriv = (
        f"{_tool('setpriv')} --securebits=+noroot,+noroot_locked,+no_setuid_fixup,+no_setuid_fixup_locked "
        "--bounding-set=-all --inh-caps=-all --ambient-caps=-all --no-new-privs"
    )
    script = f"{mounts} && cd /tmp && exec {setpriv} {interpreter} -I -S -"
    unshare = [_tool("unshare"), "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child"]
    return _sandbox_user() + _limits_prefix(limits) + unshare + ["--mount-proc", "sh", "-c", script]


def run_python(program: str, limits: SandboxLimits = SandboxLimits(), *, isolated: bool = True) -> SandboxResult:
    """Run ``program`` (Python source) in a sandbox (see the module docstring) and return what
    it did. ``isolated=False`` runs without namespaces (limits and timeout only), for machines
    without user namespaces and trusted code; with ``isolated=True`` on such a machine this
    raises `SandboxUnavailable`."""
    if isolated:
        interpreter, missing = _probed()
        if interpreter is None:
            raise SandboxUnavailable(f"cannot isolate untrusted code on this machine: {missing}")
        cmd, cwd = _isolated_command(limits, interpreter), "/"
    else:
        if not _PLAIN:
            _PLAIN.append(_first_interpreter(lambda python: _plain_command(SandboxLimits(), python)))
        interpreter, error = _PLAIN[0]
        if interpreter is None:
            raise SandboxUnavailable(error)
        cwd = tempfile.mkdtemp(prefix="jaxflow_sandbox_")
        os.chmod(cwd, 0o777)
        cmd = _plain_command(limits, interpreter)
    try:
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,  # its own process group, killed whole at the timeout
        )
        timed_out = False
        try:
            out, err = p.communicate(program.encode(), timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(p.pid)
            out, err = p.communicate()
        _kill_group(p.pid)  # what the program forked and left running (isolated: already gone)
        return SandboxResult(
            returncode=p.returncode,
            timed_out=timed_out,
            stdout=out[: limits.output_bytes].decode(errors="replace"),
            stderr=err[: limits.output_bytes].decode(errors="replace"),
            isolated=isolated,
        )
    finally:
        if not isolated:
            _kill_leftovers(cwd)
            shutil.rmtree(cwd, ignore_errors=True)


def _kill_group(pgid: int, wait_s: float = 10.0) -> None:
    """SIGKILL the run's process group until none of it is left (``unshare --kill-child`` takes
    the namespace's PID 1 with it, and with that the kernel every process in the namespace)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def _kill_leftovers(cwd: str) -> None:
    """Without a PID namespace: processes still running in the run's directory (forks that
    left the process group) are killed."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/cwd").startswith(cwd):
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                continue


# --- the code reward -------------------------------------------------------------------------


def extract_code(solution_str: str) -> str:
    """The response's last fenced code block (```python / ```py / ```), else the whole text."""
    blocks = _FENCE.findall(solution_str)
    return blocks[-1] if blocks else solution_str


def parse_tests(ground_truth: Any) -> list[str]:
    """The tests of a sample: a list of Python statements (``assert f(1) == 2``), given as a
    list, a JSON list, a dict / JSON object with ``"tests"`` (verl's code datasets keep them
    under ``reward_model.ground_truth``), or statements one per line."""
    tests = ground_truth
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            tests = [line for line in tests.splitlines() if line.strip()]
    if isinstance(tests, Mapping):
        tests = tests.get("tests", tests.get("test_list"))
    if isinstance(tests, str):
        tests = [line for line in tests.splitlines() if line.strip()]
    if not isinstance(tests, Sequence) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(
            f"the code reward's ground truth must hold a non-empty list of test statements, got {ground_truth!r}"
        )
    return list(tests)


def _harness(code: str, tests: list[str], token: str) -> str:
    """The program: the solution in its own namespace, then each test in a copy of it; a
    passed test prints ``token index``."""
    lines = [
        "import sys",
        "_ns = {'__name__': '__main__'}",
        "try:",
        f"    exec(compile({code!r}, '<solution>', 'exec'), _ns)",
        "except BaseException:",
        "    sys.exit(1)",
    ]
    for i, test in enumerate(tests):
        lines += [
            "try:",
            f"    exec(compile({test!r}, '<test>', 'exec'), dict(_ns))",
            f"    print({token!r}, {i}, flush=True)",
            "except BaseException:",
            "    pass",
        ]
    return "\n".join(lines) + "\n"


CODE_DATA_SOURCE = "jaxflow/code"  # samples whose ground truth is a list of test statements


@register_reward(CODE_DATA_SOURCE)
def score_code(
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    *,
    limits: SandboxLimits = SandboxLimits(),
    isolated: bool = True,
) -> dict[str, float]:
    """The fraction of the sample's tests (`parse_tests`) that the response's code
    (`extract_code`) passes in one sandboxed run (`run_python`): ``{"score", "passed",
    "tests", "timed_out", "crashed"}``."""
    del extra_info
    tests = parse_tests(ground_truth)
    token = secrets.token_hex(16)
    result = run_python(_harness(extract_code(solution_str), tests, token), limits, isolated=isolated)
    passed = set()
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == token and parts[1].isdigit():
            passed.add(int(parts[1]))
    return {
        "score": len(passed) / len(tests),
        "passed": float(len(passed)),
        "tests": float(len(tests)),
        "timed_out": float(result.timed_out),
        "crashed": float(result.returncode != 0 and not result.timed_out),
    }


def score_code_batch(
    samples: Sequence[tuple[str, Any]],
    *,
    limits: SandboxLimits = SandboxLimits(),
    isolated: bool = True,
    workers: int | None = None,
) -> list[dict[str, float]]:
    """`score_code` of ``(solution_str, ground_truth)`` pairs, ``workers`` sandboxes at a time
    (default: the CPU count)."""
    if isolated and not isolation_available():
        raise SandboxUnavailable(f"cannot isolate untrusted code on this machine: {isolation_problem()}")
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda s: score_code(s[0], s[1], limits=limits, isolated=isolated), samples))
