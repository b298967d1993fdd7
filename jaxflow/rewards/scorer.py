"""The host-side rule scorer: responses in, one float per response out; a broken reward
function stops the run with one line instead of training on zeros.

:class:`RewardScorer` scores a batch of ``(data_source, solution_str, ground_truth,
extra_info)`` samples with either

- the built-in functions registered per ``data_source`` (GSM8K, MATH, jaxflow's tasks), run
  in this process; the code reward's samples (``jaxflow/code``) each in its own sandbox
  (`jaxflow.rewards.sandbox`), ``sandbox_workers`` of them at a time, isolated unless the user
  opted out (``sandbox="off"``); or
- one user function (verl's ``custom_reward_function.path`` / ``.name``, or a picklable
  callable) run in persistent worker processes, so that a function that never returns can be
  cut off. The user's file is imported only in the workers, under ``load_timeout_s``, when the
  scorer is built: a file that hangs or fails at import, or a function whose signature cannot
  take the scorer's call, is a :class:`RewardFunctionError` before anything else runs.

A sample whose function raises, returns something that is not a finite float (or a dict
holding one under ``"score"``), runs past ``timeout_s``, or kills its worker scores 0. It is
counted in the metrics (``reward/num_errors``, ``reward/num_timeouts``) and the first failure
of each kind is logged when it happens. Failures are tolerated only while they are the
exception: when *every* sample of a call fails, or more than ``max_failure_fraction`` of the
samples of the last ``failure_window`` calls, ``score`` raises :class:`RewardFunctionError`
naming the function, the counts and the first error.

Worker protocol. The samples of one call are split into ``num_workers`` contiguous chunks and
each chunk goes to its worker in one message; the worker answers sample by sample on its pipe.
The time limit applies to each sample: from the previous answer (or the send) to the next.
When a sample overruns, its worker is killed (a Python thread cannot be) and replaced, and
the rest of its chunk is re-sent to the new worker. A whole call ends by ``batch_timeout_s``:
samples not answered by then score 0 as timeouts. Results are indexed, so the outcome does
not depend on timing or on ``num_workers``: only which samples overrun does. A worker exits by
itself when the process that started it dies (even by SIGKILL), so none is left orphaned.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from jaxflow.rewards import registry
from jaxflow.rewards import sandbox as code_sandbox

logger = logging.getLogger(__name__)

OK, ERROR, TIMEOUT = 0, 1, 2
SANDBOX_MODES = ("required", "off")
_STARTUP_TIMEOUT_S = 300.0  # a worker may have to import the driver's __main__ (jax and all)
_PARENT_POLL_S = 0.2


class RewardFunctionError(RuntimeError):
    """The reward function cannot be used: it does not load (fails, hangs, wrong signature), or
    it fails on every sample of a batch, or on too many over several batches."""


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """What one :meth:`RewardScorer.score` call returns.

    Attributes:
      scores: ``[B]`` float32, 0 for failed samples.
      metrics: ``reward/mean|min|max``, ``reward/num_errors``, ``reward/num_timeouts``,
        ``reward/source/<data_source>/mean`` and ``reward/extra/<key>/mean`` for every extra
        numeric key returned in a dict.
      extra: ``[B]`` float32 per extra key, NaN where a sample did not report it.
      status: ``[B]`` int8: 0 ok, 1 error, 2 timeout.
    """

    scores: np.ndarray
    metrics: dict[str, float]
    extra: dict[str, np.ndarray]
    status: np.ndarray


class RewardScorer:
    """Scores responses with the rule-based reward functions (see the module docstring).

    Args:
      custom_reward_path: Python file holding a user reward function; when set (or when
        ``compute_score`` is) it scores every sample, whatever its ``data_source``.
      custom_reward_name: the function's name in that file.
      compute_score: instead of a file, a callable with the same signature
        ``(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs)``;
        with ``isolation="process"`` it must pickle by reference (a module-level function).
      reward_kwargs: extra keyword arguments for the user function.
      timeout_s: per-sample time limit for the user function (``isolation="process"``).
      batch_timeout_s: time limit of one ``score`` call (``isolation="process"``); None: none.
      load_timeout_s: time limit for a worker to import the user's file and find the function.
      max_failure_fraction: ``score`` raises when more than this fraction of the samples of the
        last ``failure_window`` calls failed (1.0: only when every sample of one call fails).
      failure_window: calls that ``max_failure_fraction`` looks at.
      num_workers: worker processes for the user function.
      isolation: ``"process"`` runs the user function in workers with the time limit;
        ``"inline"`` calls it here (errors still score 0, but nothing can be cut off).
        Built-in functions always run inline.
      start_method: multiprocessing start method for workers (``"spawn"`` or
        ``"forkserver"``; ``"fork"`` is unsafe once JAX runs threads).
      sandbox: the code reward's untrusted code: ``"required"`` runs it isolated (new user,
        network, mount and PID namespaces) and refuses a batch of it where this machine cannot
        isolate it; ``"off"`` runs it with the sandbox's limits but without isolation (trusted
        code only).
      sandbox_workers: code samples scored at a time (each is a subprocess; None: the CPU count).
    """

    def __init__(
        self,
        *,
        custom_reward_path: str | None = None,
        custom_reward_name: str = "compute_score",
        compute_score: Callable[..., Any] | None = None,
        reward_kwargs: Mapping[str, Any] | None = None,
        timeout_s: float = 5.0,
        batch_timeout_s: float | None = 60.0,
        load_timeout_s: float = 60.0,
        max_failure_fraction: float = 1.0,
        failure_window: int = 5,
        num_workers: int = 1,
        isolation: str = "process",
        start_method: str = "spawn",
        sandbox: str = "required",
        sandbox_workers: int | None = None,
    ):
        if custom_reward_path and compute_score is not None:
            raise ValueError("pass either custom_reward_path or compute_score, not both")
        if isolation not in ("process", "inline"):
            raise ValueError(f"isolation must be 'process' or 'inline', got {isolation!r}")
        self.sandbox, self.sandbox_workers = _sandbox_settings(sandbox, sandbox_workers)
        for name, value in (
            ("timeout_s", timeout_s),
            ("load_timeout_s", load_timeout_s),
            ("batch_timeout_s", 1.0 if batch_timeout_s is None else batch_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 < max_failure_fraction <= 1:
            raise ValueError(f"max_failure_fraction must be in (0, 1], got {max_failure_fraction}")
        if num_workers < 1 or failure_window < 1:
            raise ValueError(f"num_workers and failure_window must be >= 1, got {num_workers}, {failure_window}")
        self.timeout_s = float(timeout_s)
        self.batch_timeout_s = None if batch_timeout_s is None else float(batch_timeout_s)
        self.load_timeout_s = float(load_timeout_s)
        self.max_failure_fraction = float(max_failure_fraction)
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=int(failure_window))
        self.num_workers = int(num_workers)
        self.isolation = isolation
        self.reward_kwargs = dict(reward_kwargs or {})
        self._fn: Callable[..., Any] | None = None  # called here (inline)
        self._fn_spec: tuple | None = None  # what a worker loads
        self.description = "the built-in reward functions"
        self._ctx = multiprocessing.get_context(start_method)
        self._workers: list[_Worker | None] = []
        self._logged: set[int] = set()
        if custom_reward_path:
            path = os.path.abspath(os.path.expanduser(os.fspath(custom_reward_path)))
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"custom reward function file not found: {custom_reward_path!r} (resolved to {path})"
                )
            self._fn_spec = ("file", path, custom_reward_name)
            self.description = f"{custom_reward_name} in {path}"
            if isolation == "inline":
                self._fn = registry.load_reward_fn(path, custom_reward_name)
                registry.check_reward_signature(self._fn, self.reward_kwargs, where=f" in {path}")
        elif compute_score is not None:
            if not callable(compute_score):
                raise TypeError(f"compute_score must be callable, got {compute_score!r}")
            registry.check_reward_signature(compute_score, self.reward_kwargs)
            self._fn = compute_score
            self._fn_spec = ("callable", compute_score)
            self.description = getattr(compute_score, "__qualname__", repr(compute_score))
            if isolation == "process":
                try:
                    pickle.dumps(compute_score)
                except Exception as e:
                    raise TypeError(
                        f"compute_score {compute_score!r} cannot be sent to a worker process "
                        f"({type(e).__name__}: {e}); use a module-level function, "
                        "custom_reward_path, or isolation='inline'"
                    ) from e
        if self.uses_workers:
            self._ensure_workers(self.num_workers)  # loads the user's file now, under load_timeout_s

    @property
    def uses_workers(self) -> bool:
        return self._fn_spec is not None and self.isolation == "process"

    # ------------------------------------------------------------------ scoring

    def score(
        self,
        data_sources: Sequence[str] | str,
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Mapping | None] | None = None,
    ) -> RewardResult:
        """Scores ``B`` samples given column-wise (a single ``data_sources`` string is broadcast).

        Raises:
          RewardFunctionError: every sample failed, or too many over the recent calls.
        """
        n = len(solution_strs)
        if isinstance(data_sources, str):
            data_sources = [data_sources] * n
        if extra_infos is None:
            extra_infos = [None] * n
        lengths = {
            "data_sources": len(data_sources),
            "solution_strs": n,
            "ground_truths": len(ground_truths),
            "extra_infos": len(extra_infos),
        }
        if len(set(lengths.values())) != 1:
            raise ValueError(f"RewardScorer.score got inputs of different lengths: {lengths}")
        items = [(i, data_sources[i], solution_strs[i], ground_truths[i], extra_infos[i]) for i in range(n)]
        if self._fn_spec is None:
            for source in sorted(set(data_sources)):
                registry.get_reward_fn(source)  # unknown source: a config error, raised here
            outcomes = self._score_builtin(items)
        elif self.isolation == "inline":
            outcomes = [_call_user(self._fn, self.reward_kwargs, item) for item in items]
        else:
            outcomes = self._score_in_workers(items)
        result = self._collect(data_sources, outcomes)
        self._check_failures(result.status, outcomes)
        return result

    __call__ = score

    def _score_builtin(self, items: list[tuple]) -> list[tuple]:
        """The built-in functions' outcomes, in order: code samples in parallel sandboxes, the
        rest one by one here."""
        code = [item for item in items if item[1] == code_sandbox.CODE_DATA_SOURCE]
        outcomes = dict(zip([item[0] for item in code], self._score_code(code))) if code else {}
        return [outcomes[item[0]] if item[0] in outcomes else _call_builtin(item) for item in items]

    def _score_code(self, items: list[tuple]) -> list[tuple]:
        """Each code sample in its own sandbox (a subprocess: the threads only wait on them)."""
        isolated = self.sandbox == "required"
        if isolated and not code_sandbox.isolation_available():
            raise code_sandbox.SandboxUnavailable(
                f"cannot isolate the {code_sandbox.CODE_DATA_SOURCE} reward's untrusted code on this machine "
                f"({code_sandbox.isolation_problem()}); to run it without isolation (trusted code only), "
                "set jaxflow.reward.sandbox=off"
            )

        def one(item: tuple) -> tuple:
            _, _, solution, truth, extra_info = item
            try:
                return OK, normalize_reward(code_sandbox.score_code(solution, truth, extra_info, isolated=isolated))
            except Exception:  # noqa: BLE001 - a failing sample scores 0
                return ERROR, traceback.format_exc()

        workers = min(len(items), self.sandbox_workers or os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(one, items))

    def _check_failures(self, status: np.ndarray, outcomes: list[tuple]) -> None:
        n, failed = len(status), int(np.sum(status != OK))
        self._recent.append((failed, n))
        if not failed:
            return
        first = next(_summary(payload) for kind, payload in outcomes if kind != OK)
        counts = f"{int(np.sum(status == ERROR))} errors, {int(np.sum(status == TIMEOUT))} timeouts"
        if failed == n:
            raise RewardFunctionError(
                f"the reward function ({self.description}) failed on every sample of a batch ({n}: {counts}); "
                f"the first: {first}"
            )
        total_failed, total = map(sum, zip(*self._recent))
        if len(self._recent) == self._recent.maxlen and total_failed > self.max_failure_fraction * total:
            raise RewardFunctionError(
                f"the reward function ({self.description}) failed on {total_failed} of the {total} samples of the "
                f"last {len(self._recent)} batches, more than max_failure_fraction={self.max_failure_fraction:g}; "
                f"in the last batch {counts}, the first: {first}"
            )

    def _log_failure(self, kind: int, index: int, data_source: Any, payload: str) -> None:
        """Logs the first failure of each kind (when it happens) in one line, its full text (the
        user's traceback) at INFO (the run's log file); later ones are only counted."""
        if kind == OK or kind in self._logged:
            return
        self._logged.add(kind)
        what = "timed out" if kind == TIMEOUT else "failed"
        # One console line (the warning); the user's traceback goes to the log file only (INFO).
        logger.warning(
            "reward function %s on sample %d (data_source=%r): %s; it scores 0. Later failures are only counted "
            "in reward/num_errors and reward/num_timeouts",
            what,
            index,
            data_source,
            _summary(payload),
        )
        logger.info("reward function %s on sample %d (data_source=%r):\n%s", what, index, data_source, payload)

    def _collect(self, data_sources: Sequence[str], outcomes: list[tuple]) -> RewardResult:
        n = len(outcomes)
        scores = np.zeros(n, np.float32)
        status = np.zeros(n, np.int8)
        extra: dict[str, np.ndarray] = {}
        for i, (kind, payload) in enumerate(outcomes):
            status[i] = kind
            if kind == OK:
                score, extras = payload
                scores[i] = score
                for key, value in extras.items():
                    if key not in extra:
                        extra[key] = np.full(n, np.nan, np.float32)
                    extra[key][i] = value
            else:
                self._log_failure(kind, i, data_sources[i], payload)
        metrics = {
            "reward/mean": float(scores.mean()) if n else 0.0,
            "reward/max": float(scores.max()) if n else 0.0,
            "reward/min": float(scores.min()) if n else 0.0,
            "reward/num_errors": float(np.sum(status == ERROR)),
            "reward/num_timeouts": float(np.sum(status == TIMEOUT)),
        }
        sources = np.asarray(list(data_sources), dtype=object)
        for source in sorted(set(data_sources)):
            metrics[f"reward/source/{source}/mean"] = float(scores[sources == source].mean())
        for key, values in sorted(extra.items()):
            metrics[f"reward/extra/{key}/mean"] = float(np.nanmean(values))
        return RewardResult(scores=scores, metrics=metrics, extra=extra, status=status)

    # ------------------------------------------------------------------ workers

    def _score_in_workers(self, items: list[tuple]) -> list[tuple]:
        outcomes: list[tuple | None] = [None] * len(items)
        if not items:
            return []
        batch_deadline = math.inf if self.batch_timeout_s is None else time.monotonic() + self.batch_timeout_s
        n_workers = min(self.num_workers, len(items))
        self._ensure_workers(n_workers)
        bounds = np.linspace(0, len(items), n_workers + 1).astype(int)
        queues = {}
        for w in range(n_workers):
            chunk = items[bounds[w] : bounds[w + 1]]
            if chunk:
                queues[w] = collections.deque(chunk)
                self._send(w, list(chunk))
        deadlines = {w: time.monotonic() + self.timeout_s for w in queues}
        while queues:
            if time.monotonic() >= batch_deadline:
                self._abandon(queues, outcomes)
                break
            conns = {self._workers[w].conn: w for w in queues}
            timeout = max(0.0, min(min(deadlines[w] for w in queues), batch_deadline) - time.monotonic())
            ready = multiprocessing.connection.wait(list(conns), timeout=timeout)
            for conn in ready:
                w = conns[conn]
                crashed = self._drain(w, queues[w], outcomes)
                deadlines[w] = time.monotonic() + self.timeout_s
                if crashed:
                    code = self._workers[w].exitcode()
                    idx = queues[w].popleft()[0]
                    outcomes[idx] = (
                        ERROR,
                        f"the reward worker process died (exit code {code}) while scoring sample {idx}",
                    )
                    self._log_failure(ERROR, idx, items[idx][1], outcomes[idx][1])
                    self._replace(w, queues, deadlines, outcomes, batch_deadline)
                elif not queues[w]:
                    del queues[w], deadlines[w]
            now = time.monotonic()
            for w in [w for w in queues if deadlines[w] <= now]:
                if self._workers[w].conn.poll():
                    continue  # an answer arrived meanwhile; read it first
                idx = queues[w].popleft()[0]
                outcomes[idx] = (
                    TIMEOUT,
                    f"sample {idx} ran past the reward time limit of {self.timeout_s:g} s; "
                    "its worker process was killed and replaced",
                )
                self._log_failure(TIMEOUT, idx, items[idx][1], outcomes[idx][1])
                self._replace(w, queues, deadlines, outcomes, batch_deadline)
        return outcomes  # type: ignore[return-value]

    def _abandon(self, queues: dict, outcomes: list) -> None:
        """The call's deadline passed: unanswered samples time out; their workers are killed."""
        left = sum(len(q) for q in queues.values())
        for w, queue in list(queues.items()):
            for item in queue:
                outcomes[item[0]] = (
                    TIMEOUT,
                    f"sample {item[0]} was not scored within the batch deadline of {self.batch_timeout_s:g} s",
                )
            if self._workers[w] is not None:
                self._workers[w].kill()
                self._workers[w] = None
            del queues[w]
        logger.warning(
            "reward: the batch deadline of %g s passed with %d sample(s) unscored; they score 0 "
            "(counted in reward/num_timeouts)",
            self.batch_timeout_s,
            left,
        )

    def _drain(self, w: int, queue: collections.deque, outcomes: list) -> bool:
        """Reads every answer waiting from worker ``w``; True if the worker is gone."""
        conn = self._workers[w].conn
        try:
            while queue and conn.poll():
                idx, kind, payload = conn.recv()
                item = queue.popleft()
                if idx != item[0]:  # cannot happen unless the protocol is broken
                    raise RuntimeError(f"reward worker answered sample {idx}, expected {item[0]}")
                outcomes[idx] = (kind, payload)
                self._log_failure(kind, idx, item[1], payload)
        except (EOFError, OSError):
            return True
        return False

    def _replace(self, w: int, queues: dict, deadlines: dict, outcomes: list, batch_deadline: float) -> None:
        self._workers[w].kill()
        self._workers[w] = None
        if not queues[w]:
            del queues[w], deadlines[w]
            return
        worker = _Worker(self._ctx, self._fn_spec, self.reward_kwargs)
        if not worker.wait_ready(self.description, self.load_timeout_s, batch_deadline):
            worker.kill()  # the batch deadline passed while it started
            self._abandon({w: queues.pop(w)}, outcomes)
            del deadlines[w]
            return
        self._workers[w] = worker
        self._send(w, list(queues[w]))
        deadlines[w] = time.monotonic() + self.timeout_s

    def _send(self, w: int, chunk: list[tuple]) -> None:
        try:
            self._workers[w].conn.send(("score", chunk))
        except OSError:
            pass  # the worker died; the wait loop sees its pipe close and handles it

    def _ensure_workers(self, n: int) -> None:
        while len(self._workers) < n:
            self._workers.append(None)
        started = []
        for w in range(n):
            worker = self._workers[w]
            if worker is not None and not worker.alive():
                worker.kill()
                worker = None
            if worker is None:
                self._workers[w] = _Worker(self._ctx, self._fn_spec, self.reward_kwargs)
                started.append(w)
        try:
            for w in started:
                self._workers[w].wait_ready(self.description, self.load_timeout_s)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stops the worker processes (a later call starts new ones)."""
        for worker in self._workers:
            if worker is not None:
                worker.stop()
        self._workers = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


EXTRA_COLUMN_PREFIX = "reward_extra/"


def extra_columns(result: RewardResult) -> dict[str, np.ndarray]:
    """The named values a reward function returned besides ``"score"`` (verl's
    ``reward_extra_info``, what ``algorithm.gdpo_reward_keys`` name) as batch columns
    ``reward_extra/<key>`` ``[B]`` float32: 0 for the samples that failed (as their score), NaN
    for those whose function returned no such key."""
    failed = result.status != OK
    return {
        EXTRA_COLUMN_PREFIX + key: np.where(failed, 0.0, values).astype(np.float32)
        for key, values in result.extra.items()
    }


def token_level_scores(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """Places each response's score on its last valid token (verl's convention).

    Args:
      scores: ``[B]`` sequence scores.
      response_mask: ``[B, T]``, nonzero on response tokens (right-padded responses).

    Returns:
      ``[B, T]`` float32, zero except at each row's last masked position. A row with no
      response token gets no score.
    """
    scores_B = np.asarray(scores, np.float32)
    mask_BxT = np.asarray(response_mask) != 0
    if mask_BxT.ndim != 2 or scores_B.shape != mask_BxT.shape[:1]:
        raise ValueError(f"expected scores [B] and response_mask [B, T], got {scores_B.shape} and {mask_BxT.shape}")
    num_tokens = mask_BxT.shape[1]
    last_B = num_tokens - 1 - np.argmax(mask_BxT[:, ::-1], axis=1)
    has_B = mask_BxT.any(axis=1)
    out_BxT = np.zeros(mask_BxT.shape, np.float32)
    rows = np.nonzero(has_B)[0]
    out_BxT[rows, last_B[rows]] = scores_B[rows]
    return out_BxT


# ---------------------------------------------------------------------- helpers


def normalize_reward(value: Any) -> tuple[float, dict[str, float]]:
    """A reward function's return value as ``(score, extra numeric values)``.

    Accepts a real number (bools and numpy scalars included) or a mapping with a ``"score"``
    key; other keys with finite numeric values are kept as extras, the rest dropped.

    Raises:
      TypeError / ValueError: anything else, a dict without ``"score"``, or a non-finite score.
    """
    extras: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(
                f"reward function returned a dict without the key 'score' (keys: {sorted(map(str, value))})"
            )
        for key, item in value.items():
            if key != "score" and _is_real(item) and math.isfinite(float(item)):
                extras[str(key)] = float(item)
        value = value["score"]
    if not _is_real(value):
        raise TypeError(
            f"reward function must return a float or a dict with key 'score', got {type(value).__name__}: {value!r:.200}"
        )
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score, extras


def _sandbox_settings(sandbox: str, workers: int | None) -> tuple[str, int | None]:
    """`RewardScorer`'s ``sandbox`` and ``sandbox_workers``, checked."""
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"sandbox must be one of {SANDBOX_MODES}, got {sandbox!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"sandbox_workers must be >= 1, got {workers}")
    return sandbox, workers


def _is_real(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return x.ndim == 0 and (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_)
    return isinstance(x, (numbers.Real, np.bool_))


def _call_builtin(item: tuple) -> tuple:
    _, source, solution, truth, extra_info = item
    try:
        return OK, normalize_reward(registry.get_reward_fn(source)(solution, truth, extra_info))
    except Exception:  # noqa: BLE001 - a failing sample scores 0
        return ERROR, traceback.format_exc()


def _call_user(fn: Callable[..., Any], kwargs: Mapping[str, Any], item: tuple) -> tuple:
    _, source, solution, truth, extra_info = item
    try:
        value = fn(data_source=source, solution_str=solution, ground_truth=truth, extra_info=extra_info, **kwargs)
        return OK, normalize_reward(value)
    except BaseException as e:  # noqa: BLE001 - SystemExit from user code scores 0 too
        if isinstance(e, KeyboardInterrupt):
            raise
        return ERROR, traceback.format_exc()


def _summary(payload: Any) -> str:
    """The last line of a failure's text (the exception, for a traceback)."""
    lines = [line.strip() for line in str(payload).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "?"


class _Worker:
    """One worker process and its pipe (see the module docstring for the protocol)."""

    def __init__(self, ctx: Any, fn_spec: tuple, reward_kwargs: Mapping[str, Any]):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main,
            args=(child_conn, fn_spec, dict(reward_kwargs), os.getpid()),
            daemon=True,
            name="jaxflow-reward-worker",
        )
        self.proc.start()
        child_conn.close()

    def _receive(self, limit_s: float) -> tuple | None:
        """The next message within ``limit_s`` seconds, or None."""
        try:
            if not self.conn.poll(max(0.0, limit_s)):
                return None
            return self.conn.recv()
        except (EOFError, OSError):
            return ("exited", None)

    def wait_ready(self, description: str, load_timeout_s: float, deadline: float = math.inf) -> bool:
        """Waits for the worker to start (``_STARTUP_TIMEOUT_S``) and load the user function
        (``load_timeout_s``). False if ``deadline`` (monotonic) came first.

        Raises:
          RewardFunctionError: the function did not load (error, hang, exit, bad signature).
        """
        for phase, limit in (("started", _STARTUP_TIMEOUT_S), ("ready", load_timeout_s)):
            until = time.monotonic() + limit
            message = self._receive(min(until, deadline) - time.monotonic())
            if message is None and time.monotonic() >= deadline and deadline < until:
                return False
            if message is None:
                self.kill()
                if phase == "started":
                    raise RewardFunctionError(f"the reward worker process did not start within {limit:g} s")
                raise RewardFunctionError(
                    f"loading the reward function ({description}) did not finish within {limit:g} s "
                    "(jaxflow.reward.load_timeout_s): does importing its file hang?"
                )
            if message[0] == "exited":
                self.kill()
                raise RewardFunctionError(
                    f"the reward worker process exited while loading the reward function "
                    f"({description}) (exit code {self.proc.exitcode})"
                )
            if message[0] == "load_error":
                self.kill()
                logger.debug("reward function load error:\n%s", message[2])
                raise RewardFunctionError(message[1])
        return True

    def alive(self) -> bool:
        return self.proc.is_alive()

    def exitcode(self) -> int | None:
        self.proc.join(timeout=1.0)
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5.0)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(("stop", None))
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=1.0)
        self.kill()


def _exit_with_parent(parent_pid: int) -> None:
    """Ends this process when ``parent_pid`` is no longer its parent (the driver died, even by
    SIGKILL, and the worker was re-parented), also while the user function hangs."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(conn: Any, fn_spec: tuple, reward_kwargs: dict[str, Any], parent_pid: int) -> None:
    """Worker process: load the function, then answer ``("score", items)`` one item at a time."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when workers stop
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    conn.send(("started", None))
    try:
        if fn_spec[0] == "file":
            fn = registry.load_reward_fn(fn_spec[1], fn_spec[2])
            registry.check_reward_signature(fn, reward_kwargs, where=f" in {fn_spec[1]}")
        else:
            fn = fn_spec[1]
    except BaseException as e:  # noqa: BLE001
        conn.send(("load_error", str(e) or type(e).__name__, traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            command, items = conn.recv()
        except (EOFError, OSError):
            return
        if command == "stop":
            return
        for item in items:
            kind, payload = _call_user(fn, reward_kwargs, item)
            conn.send((item[0], kind, payload))
