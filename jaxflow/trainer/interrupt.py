"""Ctrl-C that is never lost.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT
arrives, and some of those places swallow it: a garbage-collector callback (reported as
"unraisable"), or library code that catches ``BaseException`` around a write. :func:`install`
remembers every SIGINT, and the trainer calls :func:`check` between steps and saves, so a
swallowed Ctrl-C still stops the run within one step.
"""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()


def _on_sigint(signum: int, frame: object) -> None:
    _requested.set()
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT as Python does (raise ``KeyboardInterrupt``) and remember it. Call from
    the main thread."""
    _requested.clear()
    signal.signal(signal.SIGINT, _on_sigint)


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a Ctrl-C arrived (since :func:`install`)."""
    if _requested.is_set():
        raise KeyboardInterrupt("interrupted by Ctrl-C")
