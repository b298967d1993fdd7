"""A small name -> function registry, shared by the estimator, loss and KL registries.

A config string selects the function (``cfg.adv_estimator = "grpo"``); users add their own
with a decorator::

    @register_adv_est("my_adv")
    def my_adv(token_level_rewards, response_mask): ...

An unknown name raises ``UnknownNameError`` (both a ``KeyError`` and a ``ValueError``) whose
message lists the valid names.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class UnknownNameError(KeyError, ValueError):
    """Raised for a name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would print the message's repr
        return str(self.args[0]) if self.args else ""


class Registry:
    """Maps names to callables.

    Args:
      kind: what is registered, used in error messages (e.g. ``"advantage estimator"``).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, Callable[..., Any]] = {}

    def register(self, name: str, *, override: bool = False) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``.

        Registering a different function under a taken name raises ``ValueError`` unless
        ``override=True`` (re-registering the same function is a no-op, so module reloads
        are harmless).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            old = self._fns.get(name)
            if old is not None and old is not fn and not override:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({old!r}); pass override=True to replace it"
                )
            self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered under ``name``; ``UnknownNameError`` listing valid names."""
        try:
            return self._fns[name]
        except (KeyError, TypeError):
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}") from None

    def unregister(self, name: str) -> None:
        """Removes ``name`` (mainly for tests that register throw-away entries)."""
        self._fns.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._fns)


def accepts_keywords(fn: Callable[..., Any], droppable: Iterable[str] | None = None) -> Callable[..., Any]:
    """Wraps ``fn`` so that keyword arguments it does not declare are dropped.

    This lets a caller hand every column it has to any registered function:
    ``get_adv_estimator_fn(name)(**columns)``. With ``droppable`` given, only those names are
    dropped when undeclared and any other unknown keyword still raises ``TypeError`` (so a
    misspelt option is not silently ignored). A function that itself takes ``**kwargs``
    receives everything. Positional arguments pass through unchanged, and a missing required
    argument still raises ``TypeError``.
    """
    sig = inspect.signature(fn)
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn
    known = frozenset(
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )
    drop = None if droppable is None else frozenset(droppable) - known

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if drop is None:
            kwargs = {k: v for k, v in kwargs.items() if k in known}
        else:
            kwargs = {k: v for k, v in kwargs.items() if k not in drop}
        return fn(*args, **kwargs)

    return wrapper
