"""Agentic rollouts: tools the model calls (`tools`: schemas, tool-call parsing for the Qwen
(hermes) and Llama 3 chat formats, calls under time limits)."""

from jaxflow.agents.tools import (
    CALCULATOR,
    FORMATS,
    Tool,
    ToolCall,
    ToolExecutor,
    ToolResult,
    calculate,
    parse_tool_calls,
)

__all__ = ["CALCULATOR", "FORMATS", "Tool", "ToolCall", "ToolExecutor", "ToolResult", "calculate", "parse_tool_calls"]
