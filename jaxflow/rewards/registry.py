"""Reward functions by ``data_source``, and user reward functions loaded from a file.

The rule scorer picks a function per sample by the dataset row's ``data_source`` column, as
verl's ``default_compute_score`` does. GSM8K and MATH register with this package
(`jaxflow.rewards.gsm8k`, `jaxflow.rewards.math`); jaxflow's own tasks (``jaxflow/*``) with the
rule scorer worker (`jaxflow.workers.reward`, the layer above both `jaxflow.data` and this
package). Users add theirs with a decorator::

    from jaxflow.rewards import register_reward

    @register_reward("my_org/my_dataset")
    def my_reward(solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)

A registered function takes ``(solution_str, ground_truth, extra_info=None)`` and returns a
float, or a dict holding ``"score"`` (other numeric keys become extra metrics).

Alternatively a whole-dataset function can be loaded from a Python file, as verl's
``custom_reward_function.path`` / ``.name``: it takes
``(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs)`` and replaces
the dispatch by ``data_source`` entirely (see :func:`load_reward_fn`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

RewardValue = float | Mapping[str, Any]
RewardFn = Callable[..., RewardValue]

_REGISTRY: dict[str, RewardFn] = {}


class UnknownDataSourceError(KeyError):
    """No reward function is registered for a ``data_source``; the message lists known ones."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


def register_reward(*data_sources: str, override: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under one or more ``data_source`` names.

    Registering a different function under a taken name raises ``ValueError`` unless
    ``override=True``; re-registering the same function is a no-op.
    """
    if not data_sources:
        raise TypeError("register_reward needs at least one data_source name")
    for name in data_sources:
        if not isinstance(name, str) or not name:
            raise TypeError(f"data_source must be a non-empty string, got {name!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"register_reward expects a callable, got {fn!r}")
        for name in data_sources:
            old = _REGISTRY.get(name)
            if old is not None and not _same_function(old, fn) and not override:
                raise ValueError(
                    f"a reward function is already registered for data_source {name!r} "
                    f"({_describe(old)}); pass override=True to replace it"
                )
            _REGISTRY[name] = fn
        return fn

    return decorator


def unregister_reward(data_source: str) -> None:
    """Removes ``data_source`` from the registry (mainly for tests)."""
    _REGISTRY.pop(data_source, None)


def known_data_sources() -> list[str]:
    """Sorted names of every data_source with a reward function (built-ins included)."""
    return sorted(_REGISTRY)


def get_reward_fn(data_source: str) -> RewardFn:
    """The reward function for ``data_source``.

    Raises:
      UnknownDataSourceError (a ``KeyError``): nothing is registered for it; the message lists
        the known data sources and how to add one.
    """
    fn = _REGISTRY.get(data_source) if isinstance(data_source, str) else None
    if fn is None:
        raise UnknownDataSourceError(
            f"no reward function for data_source {data_source!r}; known data sources: "
            f"{', '.join(sorted(_REGISTRY))}. Register one with "
            "@jaxflow.rewards.register_reward(data_source) or pass a custom reward function "
            "(custom_reward_function.path / .name)."
        )
    return fn


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping | None = None
) -> RewardValue:
    """verl's ``default_compute_score``: the registered function for ``data_source``."""
    return get_reward_fn(data_source)(solution_str, ground_truth, extra_info)


def load_reward_fn(path: str | os.PathLike, name: str = "compute_score") -> RewardFn:
    """Loads function ``name`` from the Python file at ``path`` (verl's custom reward function).

    The function is called as ``fn(data_source=..., solution_str=..., ground_truth=...,
    extra_info=..., **reward_kwargs)`` and returns a float or a dict holding ``"score"``.
    Errors as `load_function`'s."""
    return load_function(path, name, "custom reward function")


def load_function(path: str | os.PathLike, name: str, what: str) -> Any:
    """Function ``name`` of the Python file at ``path``; ``what`` names it in the errors (e.g.
    "custom reward function", "tool").

    Raises:
      FileNotFoundError: ``path`` does not exist or is not a file.
      ImportError: executing the file failed; the message names the file and the exception
        (which is also chained as ``__cause__``).
      AttributeError: the module has no attribute ``name``; the message lists its functions.
      TypeError: ``name`` exists but is not callable.
    """
    path = os.fspath(path)
    if not path:
        raise FileNotFoundError(f"{what} path is empty")
    abspath = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(abspath):
        raise FileNotFoundError(f"{what} file not found: {path!r} (resolved to {abspath})")
    module_name = "jaxflow_user_module_" + hashlib.sha1(abspath.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, abspath)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {what} file {abspath} (not a Python source file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets dataclasses and pickling inside the module work
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - SystemExit in a user file is a load failure too
        sys.modules.pop(module_name, None)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ImportError(f"failed to import {what} file {abspath}: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        functions = sorted(
            k for k, v in vars(module).items() if callable(v) and not k.startswith("_") and not isinstance(v, type)
        )
        raise AttributeError(f"{what} {name!r} not found in {abspath}; callables defined there: {functions or 'none'}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{what} {name!r} in {abspath} is not callable (it is a {type(fn).__name__})")
    return fn


def check_reward_signature(fn: RewardFn, reward_kwargs: Mapping[str, Any] | None = None, *, where: str = "") -> None:
    """Raises ``TypeError`` (one line) unless ``fn`` accepts the call the scorer makes:
    ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)``.

    verl's per-dataset scorers take ``(solution_str, ground_truth)``; given as the custom function
    they would fail on every sample, so they are refused here, before training starts."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: cannot check
        return
    call = {"data_source": "", "solution_str": "", "ground_truth": "", "extra_info": None, **(reward_kwargs or {})}
    try:
        signature.bind(**call)
    except TypeError as e:
        name = getattr(fn, "__name__", repr(fn))
        raise TypeError(
            f"custom reward function {name}{signature}{where} cannot be called as {name}(data_source=..., "
            f"solution_str=..., ground_truth=..., extra_info=...{''.join(f', {k}=...' for k in reward_kwargs or {})}) "
            f"({e}); give it that signature, e.g. wrap a (solution_str, ground_truth) scorer as "
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None): "
            "return my_score(solution_str, ground_truth)"
        ) from None


def _same_function(a: RewardFn, b: RewardFn) -> bool:
    # A reloaded module makes a new function object with the same qualified name.
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
        and getattr(a, "__qualname__", None) is not None
        and "<lambda>" not in a.__qualname__
    )


def _describe(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
