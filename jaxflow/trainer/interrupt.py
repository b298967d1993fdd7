"""Ctrl-C and SIGTERM that are never lost.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT
arrives, and some of those places swallow it: a garbage-collector callback (reported as
"unraisable"), or library code that catches ``BaseException`` around a write. :func:`install`
remembers every SIGINT, and the trainer calls :func:`check` between steps and saves, so a
swallowed Ctrl-C still stops the run within one step.

SIGTERM (what SLURM, Kubernetes, preemptible VMs and ``timeout`` send) takes the same path: it
raises ``KeyboardInterrupt`` too, so every clean-up that a Ctrl-C runs (worker groups stopped,
a save cut short left incomplete) runs for it, and :func:`terminated` tells the CLI to exit
with 143 (128 + SIGTERM) instead of 130.
"""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()
_terminated = threading.Event()
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _on_signal(signum: int, frame: object) -> None:
    _requested.set()
    if signum == signal.SIGTERM:
        _terminated.set()
        raise KeyboardInterrupt("terminated by SIGTERM")
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT as Python does (raise ``KeyboardInterrupt``), SIGTERM alike, and remember
    both. Call from the main thread."""
    _requested.clear()
    _terminated.clear()
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a Ctrl-C or SIGTERM arrived (since :func:`install`)."""
    if _requested.is_set():
        raise KeyboardInterrupt("terminated by SIGTERM" if _terminated.is_set() else "interrupted by Ctrl-C")


def terminated() -> bool:
    """Whether a SIGTERM arrived (since :func:`install`)."""
    return _terminated.is_set()
