"""Executables compiled ahead of their first call, called by the programs they were compiled for.

`jaxflow.trainer.compile_ahead` compiles the step's programs concurrently before step 1. A
jitted function's own cache is filled only by calling it, never by ``Lowered.compile()``
(``f.lower(x).compile()`` then ``f(x)`` compiles again), so without this step 1 would compile
each program again, or load it again from the persistent cache (on an H200: 4.1 s for the 0.5B
actor's train step). `offer` puts the compiled executables in a pool under their program's
name; at its first call a `Program` (a jitted function wrapped by `ahead_of_time`) takes the
first executable of its own name that accepts its arguments (the same pytree, shapes, dtypes
and shardings: a `jax.stages.Compiled` checks them before it runs, so a mismatch costs no work
and donates nothing) and calls it for every later call it accepts; otherwise it calls its
jitted function. The name matters: two programs may take the same arguments (the actor's
old-log-prob forward and the reference's, colocated) and compute different things; for the
same reason the reshard programs (anonymous, and alike in their inputs but not in their output
layouts) are not wrapped: they compile in 0.1 s. With an empty pool a `Program` is its jitted
function."""

from __future__ import annotations

import re
import threading
from typing import Any

import jax

_POOL: list[tuple[str, jax.stages.Compiled]] = []  # (program name, executable)
_ANONYMOUS = ("", "lambda")  # programs of lambdas: a name says nothing about what they compute
_LOCK = threading.Lock()
_MISMATCH = (TypeError, ValueError)  # what `jax.stages.Compiled.__call__` raises for other inputs


def program_name(name: str) -> str:
    """A program's name as both sides spell it: ``"jit_actor_train_step"`` (a lowered module's
    ``sym_name``) and ``"actor_train_step"`` (a jitted function's ``__name__``) alike."""
    name = name.strip('"')
    name = name[len("jit_") :] if name.startswith("jit_") else name
    return re.sub(r"[^A-Za-z0-9]", "", name).lower()


def lowered_name(lowered: Any) -> str:
    """The `program_name` of a ``jax.stages.Lowered`` (its module's symbol name)."""
    return program_name(str(lowered.compiler_ir().operation.attributes["sym_name"]))


def offer(executables: list[tuple[str, jax.stages.Compiled]]) -> None:
    """Add ``(program name, executable)`` pairs compiled ahead to the pool the `Program`
    objects draw from (those of anonymous programs are dropped)."""
    named = [(program_name(name), exe) for name, exe in executables]
    with _LOCK:
        _POOL.extend((name, exe) for name, exe in named if name not in _ANONYMOUS)


def clear() -> None:
    """Empty the pool (the executables stay with the programs that took them)."""
    with _LOCK:
        _POOL.clear()


def pooled() -> int:
    """Executables offered and not yet taken by a program."""
    return len(_POOL)


class Program:
    """A jitted function that calls an executable compiled ahead for its arguments when there
    is one (see the module docstring); ``lower`` and every other attribute are the jitted
    function's."""

    def __init__(self, jitted: Any):
        self.jitted = jitted
        self.name = program_name(getattr(jitted, "__name__", ""))
        self.executables: list[jax.stages.Compiled] = []
        self._called = False

    def __call__(self, *args):
        for exe in self.executables:
            try:
                return exe(*args)
            except _MISMATCH:
                continue
        first, self._called = not self._called, True
        if first and _POOL and self.name not in _ANONYMOUS:
            with _LOCK:
                candidates = [entry for entry in _POOL if entry[0] == self.name]
            for entry in candidates:
                try:
                    out = entry[1](*args)
                except _MISMATCH:
                    continue
                with _LOCK:
                    if entry in _POOL:
                        _POOL.remove(entry)
                self.executables.append(entry[1])
                return out
        return self.jitted(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted, name)


def ahead_of_time(jitted: Any) -> Any:
    """``jitted`` as a `Program` (anything that cannot be lowered is returned as it is)."""
    return Program(jitted) if hasattr(jitted, "lower") and not isinstance(jitted, Program) else jitted
