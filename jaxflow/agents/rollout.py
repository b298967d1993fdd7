"""The actor's multi-turn rollout (verl's ``actor_rollout_ref.rollout.multi_turn``): what the
actor worker runs instead of a single response per sample when multi-turn is on.

`MultiTurn` holds the loop's settings and the tools; the actor hands it its prompts and a
`TurnSampler` over its engine (the generation weights of this step), and gets the rollout's
columns back (`jaxflow.agents.AgentRollout`). The worker does not import this package (it sits
on the same floor): it calls the object the run's description built.

Tools come from ``multi_turn.tools`` (built-in tools by name: `BUILTIN_TOOLS`) and from
``multi_turn.tool_config_path``, a JSON file (YAML too when PyYAML is installed) with a
``tools`` list whose entries name a built-in tool (``{"name": "calculator"}``) or give a Python
callable and its schema as verl's tool configs do::

    {"tools": [{"callable": "my_tools.py:lookup",            # file.py:function or module:function
                "timeout_s": 5,
                "tool_schema": {"type": "function",
                                "function": {"name": "lookup", "description": "...",
                                             "parameters": {"type": "object", ...}}}}]}
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from jaxflow.agents.loop import (
    AgentConfig,
    AgentRollout,
    Environment,
    TurnSampler,
    chatml_user_turn,
    hermes_tool_turn,
    run_agent,
)
from jaxflow.agents.tools import CALCULATOR, Tool, ToolExecutor, ToolResult
from jaxflow.data.tasks import tool_response_turn
from jaxflow.rewards.registry import load_function

BUILTIN_TOOLS: dict[str, Tool] = {CALCULATOR.name: CALCULATOR}
CHATML_START = "<|im_start|>"


def plain_tool_turn(results: Sequence[ToolResult]) -> str:
    """The tool turn of tokenizers without ChatML (`jaxflow.data.tasks.tool_response_turn`)."""
    return tool_response_turn([r.content for r in results])


@dataclasses.dataclass(frozen=True)
class MultiTurn:
    """``config``: the loop's limits and format (`AgentConfig`; its ``max_response_tokens`` is
    the run's response length); ``tools``: what the model may call; ``environment``: builds
    each conversation's `jaxflow.agents.Environment` (verl's interaction; None: none), which
    takes the model's turns without a tool call and rewards them; ``max_workers``: tool calls
    run at once; ``reuse_kv``: the model-turn sampler keeps each conversation's KV pages
    between its turns (`jaxflow.sampling.EngineTurns`)."""

    config: AgentConfig
    tools: tuple[Tool, ...]
    environment: Callable[[], Environment] | None = None
    max_workers: int = 8
    reuse_kv: bool = True

    def rollout(
        self,
        prompts: Sequence[Sequence[int]],
        sample: TurnSampler,
        tokenizer: Any,
        pad_token_id: int,
        samples: Sequence[Any] | None = None,
    ) -> AgentRollout:
        """One conversation per prompt (token ids, unpadded) to its end; tool turns rendered
        and environment observations in the tokenizer's chat format (ChatML:
        `hermes_tool_turn`, `chatml_user_turn`; otherwise `plain_tool_turn` and the
        observation's text as it is) and encoded once without special tokens. ``samples``: each
        conversation's dataset row, which starts its environment (``reset``)."""
        environments = None if self.environment is None else [self.environment() for _ in prompts]
        chatml = tokenizer.token_to_id(CHATML_START) is not None
        config = dataclasses.replace(
            self.config,
            tool_turn=hermes_tool_turn if chatml else plain_tool_turn,
            observation_turn=chatml_user_turn if chatml else str,
        )
        executor = ToolExecutor(self.tools, max_workers=self.max_workers)
        try:
            return run_agent(
                prompts,
                sample,
                lambda text: tokenizer.encode(text, add_special_tokens=False),
                lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                executor,
                config,
                pad_token_id=pad_token_id,
                environments=environments,
                samples=samples,
            )
        finally:
            executor.close()


def load_tools(names: Sequence[str], config_path: str = "") -> tuple[Tool, ...]:
    """The built-in tools ``names`` and those of the file ``config_path`` (module docstring);
    a ``ValueError`` names what is wrong (an unknown tool, a missing callable, a bad schema)."""
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"unknown built-in tool(s) {unknown}; the built-in tools are {sorted(BUILTIN_TOOLS)}")
    tools = [BUILTIN_TOOLS[n] for n in names]
    if config_path:
        tools += [_tool_from_entry(entry, config_path) for entry in _read_config(config_path, "tools")]
    seen: set[str] = set()
    for t in tools:
        if t.name in seen:
            raise ValueError(f"two tools are named {t.name!r}")
        seen.add(t.name)
    return tuple(tools)


def load_environment(config_path: str) -> Callable[[], Environment]:
    """The environment factory of an interaction config (verl's ``interaction_config_path``):
    a JSON (or YAML) file ``{"interaction": [{"name": ..., "callable": "file.py:Factory",
    "config": {...}}]}`` whose one entry's callable, called with ``config``'s keywords, builds
    an `Environment` for each conversation."""
    entries = _read_config(config_path, "interaction")
    if len(entries) != 1 or "callable" not in entries[0]:
        raise ValueError(f"interaction config {config_path} must hold one interaction with a 'callable'")
    factory = _load_callable(entries[0]["callable"], os.path.dirname(os.path.abspath(os.path.expanduser(config_path))))
    return functools.partial(factory, **entries[0].get("config", {}))


def _read_config(path: str, key: str) -> list[dict[str, Any]]:
    """The list ``key`` of a JSON (or YAML) config file."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ValueError(f"{key} config {path} does not exist")
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise ValueError(f"{key} config {path} is YAML but PyYAML is not installed; use JSON") from e
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise ValueError(f"{key} config {path} must hold {{'{key}': [...]}}")
    return data[key]


def _tool_from_entry(entry: dict[str, Any], path: str) -> Tool:
    """A built-in tool by ``name``, or ``callable`` + ``tool_schema`` (verl's shape)."""
    if "callable" not in entry:
        name = entry.get("name") or entry.get("tool_schema", {}).get("function", {}).get("name")
        if name not in BUILTIN_TOOLS:
            raise ValueError(f"tool config {path}: {entry} names no built-in tool and gives no 'callable'")
        return BUILTIN_TOOLS[name]
    function = entry.get("tool_schema", {}).get("function")
    if not isinstance(function, dict) or "name" not in function:
        raise ValueError(f"tool config {path}: {entry['callable']} needs tool_schema.function with a name")
    return Tool(
        name=function["name"],
        description=function.get("description", ""),
        parameters=function.get("parameters", {"type": "object", "properties": {}}),
        fn=_load_callable(entry["callable"], os.path.dirname(os.path.abspath(os.path.expanduser(path)))),
        timeout_s=float(entry.get("timeout_s", 10.0)),
    )


def _load_callable(ref: str, base_dir: str) -> Any:
    """``file.py:function`` (relative to the tool config's folder) or ``module:function``."""
    target, _, attr = ref.rpartition(":")
    if not target or not attr:
        raise ValueError(f"a tool callable is 'file.py:function' or 'module:function', got {ref!r}")
    try:
        if target.endswith(".py"):
            return load_function(os.path.join(base_dir, os.path.expanduser(target)), attr, "tool")
        fn = getattr(importlib.import_module(target), attr, None)
    except (ImportError, AttributeError, TypeError, FileNotFoundError) as e:
        raise ValueError(f"tool callable {ref!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"tool callable {ref!r}: {attr} is not a function of {target}")
    return fn
