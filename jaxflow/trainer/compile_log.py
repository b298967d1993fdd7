"""Seconds spent compiling, per program, as JAX reports them (``jax.monitoring``'s backend
compile events, one per compilation or persistent-cache load, named after the jitted
function: ``actor_train_step``, ``_generate_program``, ``old_log_probs``, ...)."""

from __future__ import annotations

import threading

import jax.monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileLog:
    """While entered, adds up the compile seconds of every program by name (MEASURED wall
    time of XLA's compile, or of loading the executable from the persistent cache)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.cache_hits = 0  # executables loaded from the persistent cache
        self._lock = threading.Lock()
        self._listening = False

    def _hit(self, event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if event != COMPILE_EVENT:
            return
        name = str(kwargs.get("fun_name", "?"))
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + duration
            self.counts[name] = self.counts.get(name, 0) + 1

    def __enter__(self) -> CompileLog:
        if not self._listening:
            jax.monitoring.register_event_duration_secs_listener(self._listener)
            jax.monitoring.register_event_listener(self._hit)
            self._listening = True
        return self

    def __exit__(self, *exc) -> None:
        if self._listening:
            jax.monitoring.unregister_event_duration_listener(self._listener)
            jax.monitoring.unregister_event_listener(self._hit)
            self._listening = False

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def summary(self, top: int = 6) -> str:
        """``compiled 9 programs in 95.1 s: actor_train_step 45.0 s, ...`` (the ``top`` slowest)."""
        if not self.seconds:
            return "compiled nothing (every program came from the in-memory cache)"
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        parts = [
            f"{name} {s:.1f} s" + (f" (x{self.counts[name]})" if self.counts[name] > 1 else "")
            for name, s in ranked[:top]
        ]
        more = f", {len(ranked) - top} more" if len(ranked) > top else ""
        hits = f" ({self.cache_hits} loaded from the persistent cache)" if self.cache_hits else ""
        return f"compiled {sum(self.counts.values())} programs in {self.total:.1f} s{hits}: {', '.join(parts)}{more}"
