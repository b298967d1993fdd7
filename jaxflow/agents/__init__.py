"""Agentic rollouts: tools the model calls (`tools`: schemas, tool-call parsing for the Qwen
(hermes) and Llama 3 chat formats, calls under time limits) and multi-turn conversations over
the engine (`loop`: token in, token out, a loss mask on the model's own tokens)."""

from jaxflow.agents.loop import (
    AgentConfig,
    AgentRollout,
    Environment,
    chatml_user_turn,
    engine_turns,
    hermes_tool_turn,
    run_agent,
)
from jaxflow.agents.tools import (
    CALCULATOR,
    FORMATS,
    Tool,
    ToolCall,
    ToolExecutor,
    ToolResult,
    calculate,
    parse_tool_calls,
    sample_tool_kwargs,
)

__all__ = [
    "CALCULATOR",
    "FORMATS",
    "AgentConfig",
    "AgentRollout",
    "Environment",
    "Tool",
    "ToolCall",
    "ToolExecutor",
    "ToolResult",
    "calculate",
    "chatml_user_turn",
    "engine_turns",
    "hermes_tool_turn",
    "parse_tool_calls",
    "run_agent",
    "sample_tool_kwargs",
]
