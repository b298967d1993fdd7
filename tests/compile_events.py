"""Counting what JAX traces and compiles while a block runs (``jax.monitoring``'s events), for
tests that check that repeated calls reuse their programs."""

import jax.monitoring

COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"


class CompileEvents:
    """``compiles``: XLA compilations; ``traces``: jaxpr traces of functions whose name
    contains ``name`` (all functions when empty)."""

    def __init__(self, name: str = ""):
        self.name = name
        self.compiles = 0
        self.traces = 0

    def _listener(self, event, duration, **kwargs):
        if event == COMPILE:
            self.compiles += 1
        elif event == TRACE and self.name in str(kwargs.get("fun_name", "")):
            self.traces += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)
