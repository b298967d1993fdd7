"""Which Ray cluster a run uses, joining or starting it, and noticing that it went away.

`choose_cluster`: ``jaxflow.ray.address``, else ``RAY_ADDRESS``, else a cluster started with
``ray start``, else a private instance of the run's own; never another process's private
instance. `join_cluster` joins or starts it with Ray's logs and the workers' output routed to
Python logging and the run's signal handlers kept. When the cluster goes away mid-run,
`lost_cluster` says so (`ClusterLost`): a worker's death is then its symptom.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
import warnings
from typing import Any

from jaxflow.workers.ray.errors import ClusterError, ClusterLost

log = logging.getLogger(__name__)
worker_log = logging.getLogger("jaxflow.workers.ray_host")  # the worker processes' forwarded output

LOST_GRACE_S = 5.0  # after a worker's death, how long the cluster's GCS is watched for going away too
# A Ray instance starts one idle Python worker per CPU when its first driver connects, for tasks
# to come; a run's only Ray work is its `HostProcess` actors, which each start a worker of their
# own (their runtime environment differs), so a private instance skips those. Measured on the
# 2-core machine: 1.7 s less CPU to start an instance, and each idle worker took 3.5 s of CPU
# over a 6-minute session (start-up included).
NO_IDLE_WORKERS = {"prestart_worker_first_driver": False}


def ray_module():
    """The ``ray`` package, imported when first needed (the local path never loads it)."""
    import ray

    return ray


@dataclasses.dataclass(frozen=True)
class ClusterChoice:
    """The Ray cluster a run uses: ``init_address`` is what ``ray.init`` gets (``"local"``: a
    private instance; None: Ray finds the one RAY_ADDRESS or ``ray start`` names, and turns on
    its token authentication as for any cluster it finds itself), ``reason`` says why, for the
    run's start-up line."""

    init_address: str | None
    reason: str

    @property
    def private(self) -> bool:
        return self.init_address == "local"


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts connections at ``host:port`` (a Ray GCS)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def goes_away(address: str, within_s: float) -> bool:
    """Whether the GCS at ``address`` stops answering within ``within_s`` seconds: a cluster
    whose owner shuts it down kills its actors first and its GCS a second or two later."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not _answers(address, timeout_s=1.0):
            return True
        time.sleep(0.25)
    return False


def _ray_start_address() -> tuple[str, str] | None:
    """``(address, file)`` of the cluster that ``ray start`` last started on this machine (Ray
    records it in ``<ray temp dir>/ray_current_cluster``; ``ray stop`` removes it), or None."""
    try:
        from ray._common.utils import get_ray_address_file
    except ImportError:  # older Ray
        from ray._private.utils import get_ray_address_file
    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            address = f.read().strip()
    except OSError:
        return None
    return (address, path) if address else None


def choose_cluster(address: str = "") -> ClusterChoice:
    """Which Ray cluster a run uses: ``address`` (``jaxflow.ray.address``) when given, else
    ``RAY_ADDRESS``, else the cluster that ``ray start`` started on this machine if it answers,
    else a private instance that the run starts (and stops). Never a private instance of another
    process (a notebook's or a test session's plain ``ray.init()``, another run's), which Ray's
    ``address="auto"`` would join: the run would compete for its CPUs and die with it."""
    if address:
        return ClusterChoice(address, "jaxflow.ray.address names it")
    if os.environ.get("RAY_ADDRESS"):
        return ClusterChoice(None, "RAY_ADDRESS names it")
    started = _ray_start_address()
    if started is not None and _answers(started[0]):
        return ClusterChoice(None, f"it was started with `ray start` on this machine ({started[1]})")
    stale = f"; `ray start`'s cluster in {started[1]}, {started[0]}, does not answer" if started else ""
    return ClusterChoice(
        "local",
        "neither jaxflow.ray.address nor RAY_ADDRESS names a cluster and none was started with `ray start`"
        f"{stale}; other Ray instances on this machine are left alone; it stops with the run",
    )


def ray_logs_to_python_logging() -> None:
    """Ray's log records (its ``ray`` loggers: start-up, token authentication, ...) go through
    Python logging like any library's, to the application's handlers (``jaxflow.run``: the
    log file, the console from WARNING up, Ray's below ERROR not), instead of Ray's own stderr
    handler."""
    ray_log = logging.getLogger("ray")
    for handler in list(ray_log.handlers):
        if type(handler).__name__ == "PlainRayHandler":
            ray_log.removeHandler(handler)
    ray_log.propagate = True


def _log_worker_lines(data: dict[str, Any]) -> None:
    who = data.get("actor_name") or data.get("task_name") or "worker"
    for line in data.get("lines", ()):
        worker_log.info("(%s pid=%s) %s", who, data.get("pid"), line)


def worker_output_to_log() -> None:
    """What the worker processes print (Ray forwards it to the driver: gloo's connection
    reports, XLA's warnings) goes to the ``jaxflow.workers.ray_host`` logger at INFO (the run's
    log file), not to the console; a worker's failure reaches the driver as its exception."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # another Ray: its own printing stays
        return
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("jaxflow_log", _log_worker_lines)


@contextlib.contextmanager
def handlers_kept(*signums: int):
    """Restores the Python handlers of ``signums`` after the block (main thread only):
    ``ray.init`` replaces SIGTERM's with absl's failure handler (a C stack, exit 1), which
    would bypass the run's own (stop the groups, one line, exit 143)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {signum: signal.getsignal(signum) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


def join_cluster(address: str = "", local_num_cpus: int | None = None) -> tuple[str, bool]:
    """Joins or starts the cluster `choose_cluster` picks for ``address`` (a private instance
    gets at least ``local_num_cpus`` logical CPUs, at least the machine's, and no idle workers:
    `NO_IDLE_WORKERS`). Returns the line
    saying which cluster and why, and whether this process started it (and must stop it).
    A process that already joined a Ray instance keeps it."""
    ray = ray_module()
    if ray.is_initialized():
        return f"ray: using the Ray instance this process had joined ({ray.get_runtime_context().gcs_address})", False
    choice, private_options = choose_cluster(address), {}
    ray_logs_to_python_logging()
    with handlers_kept(signal.SIGINT, signal.SIGTERM), warnings.catch_warnings():
        # Ray starts its GCS and raylet with fork + exec, which CPython's check for a fork
        # in a threaded process reports; nothing runs between the two.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        if choice.private:
            private_options = {
                "num_cpus": max(os.cpu_count() or 1, local_num_cpus or 0),
                "_system_config": NO_IDLE_WORKERS,
            }
        try:
            ray.init(address=choice.init_address, include_dashboard=False, configure_logging=False, **private_options)
        except (ConnectionError, ray.exceptions.AuthenticationError) as e:
            ray.shutdown()
            where = choice.init_address or os.environ.get("RAY_ADDRESS") or "the address `ray start` recorded"
            raise ClusterError(
                f"cannot join the Ray cluster at {where} ({choice.reason}): {' '.join(str(e).split())[:300]}; "
                "if it uses token authentication (Ray's default for the clusters it starts), set "
                "RAY_AUTH_MODE=token"
            ) from e
        except BaseException:  # e.g. Ctrl-C while Ray starts: what it started so far stops
            ray.shutdown()
            raise
    worker_output_to_log()
    verb = "started a private Ray instance" if choice.private else "joined the Ray cluster"
    line = f"ray: {verb} at {ray.get_runtime_context().gcs_address}: {choice.reason}"
    log.info("%s", line)
    return line, choice.private


def lost_cluster(what: str, group: str) -> ClusterLost | None:
    """`ClusterLost` when the cluster itself went away (its GCS stops answering within
    `LOST_GRACE_S`), noticed during ``what`` of worker group ``group``; None while it answers."""
    gcs = ray_module().get_runtime_context().gcs_address
    if not goes_away(gcs, LOST_GRACE_S):
        return None
    return ClusterLost(
        f"the Ray cluster at {gcs} is gone (noticed during {what} of worker group {group!r}): whoever "
        "started it stopped it, or its head node died; run again (with jaxflow.ray.address and RAY_ADDRESS "
        "empty, the run starts a Ray instance of its own)"
    )
