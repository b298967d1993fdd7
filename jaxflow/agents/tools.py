"""Tools for agentic rollouts: Python callables described by an OpenAI function-calling schema,
the tool calls of a model's turn parsed from its chat format, and the calls run with a time
limit whose failures go back to the model as an error message, never a crash.

Formats (`parse_tool_calls`):

- ``"hermes"`` (Qwen2.5 and Qwen3 chat templates): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``;
- ``"llama3"`` (Llama 3.1+ JSON tool calling): one JSON object ``{"name": ..., "parameters":
  {...}}`` (or ``"arguments"``), after ``<|python_tag|>`` when the model emits it, else the
  turn's whole text; several calls may be separated by ``;``.

A call that cannot be parsed (bad JSON, no name, an unclosed tag) becomes a `ToolCall` with an
``error``; running it answers that error. A call of an unknown tool, with arguments that do
not fit the tool's schema (missing required, unknown, or wrongly typed arguments), that
raises, or that runs past the tool's ``timeout_s`` is answered likewise and counted
(`ToolExecutor.counts`). A Python thread cannot be stopped: a tool that overruns keeps its
thread until it returns, which is why `ToolExecutor` runs calls on a pool of its own.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

FORMATS = ("hermes", "llama3")
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable the model may call by ``name``: ``fn(**arguments)`` returns the answer (a
    string, or anything JSON-serialisable); ``parameters`` is the JSON schema of the arguments
    (``{"type": "object", "properties": {...}, "required": [...]}``)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any]
    timeout_s: float = 10.0

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", self.name or ""):
            raise ValueError(f"a tool name is letters, digits, '_', '.', '-', got {self.name!r}")
        if self.parameters.get("type", "object") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type 'object'")
        if not self.timeout_s > 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling description (what chat templates render)."""
        params = {"type": "object", "properties": {}, **dict(self.parameters)}
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }

    def check(self, arguments: Mapping[str, Any]) -> str | None:
        """None if ``arguments`` fit the schema (required present, none unknown, top-level
        types right), else what is wrong."""
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", ()) if k not in arguments]
        if missing:
            return f"missing required argument(s) {missing}"
        unknown = sorted(set(arguments) - set(props))
        if unknown and not self.parameters.get("additionalProperties", False):
            return f"unknown argument(s) {unknown}; {self.name} takes {sorted(props)}"
        for key, value in arguments.items():
            want = props.get(key, {}).get("type")
            types = [want] if isinstance(want, str) else list(want or ())
            allowed = tuple(t for name in types for t in _JSON_TYPES.get(name, ()))
            if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)):
                return f"argument {key!r} must be {' or '.join(types)}, got {type(value).__name__}"
        return None


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's ``name`` and ``arguments``, the text it came from, and an
    ``error`` when the text was not a well-formed call."""

    name: str
    arguments: Mapping[str, Any] | None
    raw: str
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """A call's answer (``content``: the tool's output, or the error the model is told)."""

    name: str
    content: str
    ok: bool
    timed_out: bool = False


def _call_from_json(text: str, args_keys: tuple[str, ...]) -> ToolCall:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall("", None, text, f"the tool call is not valid JSON ({e.msg} at {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", None, text, 'a tool call is a JSON object with a "name"')
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models send the arguments JSON-encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], None, text, "the tool call's arguments are not valid JSON")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], None, text, "the tool call's arguments must be a JSON object")
    return ToolCall(obj["name"], args, text)


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """The tool calls in a model turn ``text`` (see the module docstring for ``fmt``); an
    empty list when the turn calls no tool."""
    if fmt == "hermes":
        calls = []
        for body, closing in _HERMES.findall(text):
            call = _call_from_json(body.strip(), ("arguments", "parameters"))
            if not closing:
                call = dataclasses.replace(call, error="the <tool_call> tag is not closed")
            calls.append(call)
        return calls
    if fmt == "llama3":
        body = text.split(_PYTHON_TAG, 1)[1] if _PYTHON_TAG in text else text
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.split(end, 1)[0]
        body = body.strip()
        if not body.startswith("{"):
            return (
                []
                if _PYTHON_TAG not in text
                else [ToolCall("", None, body, "expected a JSON tool call after <|python_tag|>")]
            )
        parts = [p for p in _split_top_level(body, ";") if p.strip()]
        return [_call_from_json(p.strip(), ("parameters", "arguments")) for p in parts]
    raise ValueError(f"tool-call format must be one of {FORMATS}, got {fmt!r}")


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside JSON strings and brackets."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if quoted:
            escaped = ch == "\\" and not escaped
            if ch == '"' and not escaped:
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def sample_tool_kwargs(sample: Mapping[str, Any] | None, tool: str) -> dict[str, Any]:
    """A dataset row's keyword arguments for ``tool``: verl's
    ``extra_info.tools_kwargs[tool]["create_kwargs"]`` (e.g. the sample's ground truth for a
    tool that checks an answer); ``{}`` without. A malformed entry raises ``ValueError``."""
    entry = ((sample or {}).get("extra_info") or {}).get("tools_kwargs") or {}
    if not isinstance(entry, Mapping):
        raise ValueError(f"extra_info.tools_kwargs must be a dict of tool names, got {type(entry).__name__}")
    kwargs = (entry.get(tool) or {}).get("create_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"extra_info.tools_kwargs[{tool!r}].create_kwargs must be a dict, got {kwargs!r:.80}")
    return dict(kwargs)


class ToolExecutor:
    """Runs parsed calls against a set of tools on a thread pool, each under its tool's time
    limit; ``counts`` holds ``calls``, ``errors`` (parse, unknown tool, bad arguments, raised)
    and ``timeouts``."""

    def __init__(self, tools: Iterable[Tool], max_workers: int = 8):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="jaxflow-tool")
        self.counts: collections.Counter[str] = collections.Counter()

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def run(
        self, calls: Sequence[ToolCall], sample_kwargs: Sequence[Mapping[str, Any]] | None = None
    ) -> list[ToolResult]:
        """The answers of ``calls``, in order (the calls run concurrently). ``sample_kwargs``:
        per call, keyword arguments from its conversation's dataset row (verl's
        ``extra_info.tools_kwargs[tool]["create_kwargs"]``, `sample_tool_kwargs`) passed to the
        tool beside the model's arguments, winning on a clash (the model cannot set them)."""
        futures = []
        for k, call in enumerate(calls):
            self.counts["calls"] += 1
            problem = call.error
            tool = self.tools.get(call.name)
            if problem is None and tool is None:
                problem = f"unknown tool {call.name!r}; the tools are {sorted(self.tools)}"
            if problem is None:
                problem = tool.check(call.arguments or {})
            arguments = {**(call.arguments or {}), **(sample_kwargs[k] if sample_kwargs else {})}
            futures.append((call, tool, problem, None if problem else self._pool.submit(tool.fn, **arguments)))
        results = []
        for call, tool, problem, future in futures:
            if problem is not None:
                self.counts["errors"] += 1
                results.append(ToolResult(call.name, f"Error: {problem}", ok=False))
                continue
            try:
                value = future.result(timeout=tool.timeout_s)
            except FutureTimeout:
                self.counts["timeouts"] += 1
                results.append(
                    ToolResult(call.name, f"Error: {call.name} timed out after {tool.timeout_s:g} s", False, True)
                )
                continue
            except Exception as e:  # noqa: BLE001 - a failing tool is an answer to the model
                self.counts["errors"] += 1
                results.append(ToolResult(call.name, f"Error: {type(e).__name__}: {e}", ok=False))
                continue
            content = value if isinstance(value, str) else json.dumps(value)
            results.append(ToolResult(call.name, content, ok=True))
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# --- a built-in tool -------------------------------------------------------------------------

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_DIGITS = 4000  # results and operands beyond this are refused (a calculator, not a bignum DoS)


def calculate(expression: str) -> str:
    """Exact integer (and float) arithmetic of ``expression``: + - * / // % ** and
    parentheses, numbers only (no names, calls or attributes); ``**`` with an exponent of at
    most 64."""

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponents above 64 are refused")
            value = _OPS[type(node.op)](left, right)
            if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
                raise ValueError(f"results over {MAX_DIGITS} digits are refused")
            return value
        raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")

    if len(expression) > MAX_DIGITS:
        raise ValueError(f"expressions over {MAX_DIGITS} characters are refused")
    return str(ev(ast.parse(expression.strip(), mode="eval")))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression exactly (integers of any size): + - * / // % ** and parentheses.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 123456789 * 987654321"}},
        "required": ["expression"],
    },
    fn=calculate,
    timeout_s=5.0,
)
