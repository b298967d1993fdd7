"""Tool calls (`jaxflow.agents.tools`): parsed from the Qwen (hermes) and Llama 3 formats, run
under time limits, every failure answered to the model as an error, never raised."""

import json
import threading
import time

import pytest

from jaxflow.agents import CALCULATOR, Tool, ToolExecutor, calculate, parse_tool_calls


def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


SLOW = Tool(
    "sleep",
    "Sleep.",
    {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
    _slow,
    timeout_s=0.3,
)


def test_hermes_calls_are_parsed_and_malformed_ones_carry_an_error():
    text = (
        "I will compute.\n<tool_call>\n"
        + json.dumps({"name": "calculator", "arguments": {"expression": "2 + 3"}})
        + "\n</tool_call>\n<tool_call>{'name': bad}</tool_call>"
        + '<tool_call>{"arguments": {}}</tool_call>'
        + '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7\\"}"}</tool_call>'
        + '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}'
    )
    calls = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("calculator", {"expression": "2 + 3"}, True),
        ("", None, False),  # not JSON
        ("", None, False),  # no name
        ("calculator", {"expression": "7"}, True),  # arguments JSON-encoded, as some models send them
        ("calculator", {"expression": "1"}, False),  # the tag is not closed
    ]
    assert "not valid JSON" in calls[1].error and "not closed" in calls[4].error
    assert parse_tool_calls("The answer is 5.", "hermes") == []


def test_llama3_calls_are_parsed():
    one = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "6*7"}}<|eom_id|>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(one, "llama3")] == [("calculator", {"expression": "6*7"})]
    two = '{"name": "a", "parameters": {"x": "1;2"}}; {"name": "b", "parameters": {}}'
    assert [(c.name, c.arguments) for c in parse_tool_calls(two, "llama3")] == [("a", {"x": "1;2"}), ("b", {})]
    assert parse_tool_calls("Plain prose, no call.", "llama3") == []
    [bad] = parse_tool_calls("<|python_tag|>print(1)", "llama3")
    assert bad.error and bad.arguments is None
    with pytest.raises(ValueError, match="format must be one of"):
        parse_tool_calls("", "chatml")


def test_every_failure_is_an_answer_and_is_counted():
    executor = ToolExecutor([CALCULATOR, SLOW])
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "123456789123456789 * 987654321987654321"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>'
        '<tool_call>{"name": "sleep", "arguments": {"seconds": 5}}</tool_call>'
        "<tool_call>not json</tool_call>"
    )
    t0 = time.monotonic()
    results = executor.run(parse_tool_calls(text, "hermes"))
    assert time.monotonic() - t0 < 3  # the slow call is cut at its 0.3 s limit
    assert results[0].ok and results[0].content == str(123456789123456789 * 987654321987654321)
    assert [r.ok for r in results] == [True] + [False] * 7
    assert "unknown tool 'search'" in results[1].content
    assert "missing required argument(s) ['expression']" in results[2].content
    assert "must be string, got int" in results[3].content
    assert "ZeroDivisionError" in results[4].content
    assert "only numbers" in results[5].content
    assert results[6].timed_out and "timed out after 0.3 s" in results[6].content
    assert "not valid JSON" in results[7].content
    assert dict(executor.counts) == {"calls": 8, "errors": 6, "timeouts": 1}
    executor.close()


def test_calls_run_concurrently():
    started = []
    barrier = threading.Barrier(3, timeout=5)

    def meet(i: int) -> str:
        started.append(i)
        barrier.wait()  # all three must run at once to pass
        return str(i)

    tool = Tool("meet", "", {"type": "object", "properties": {"i": {"type": "integer"}}}, meet, timeout_s=10)
    executor = ToolExecutor([tool])
    calls = parse_tool_calls(
        "".join(f'<tool_call>{{"name": "meet", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(3))
    )
    assert [r.content for r in executor.run(calls)] == ["0", "1", "2"]
    executor.close()


def test_the_calculator_is_exact_and_refuses_everything_else():
    assert calculate("(2 + 3) * 4 - 7 // 2") == str((2 + 3) * 4 - 7 // 2)
    assert calculate("2 ** 64") == str(2**64)
    for bad in ("2 ** 1000", "x + 1", "abs(-1)", "().__class__", "9" * 5000):
        with pytest.raises(ValueError):
            calculate(bad)
    assert CALCULATOR.schema()["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="tool name"):
        Tool("no spaces", "", {}, calculate)
