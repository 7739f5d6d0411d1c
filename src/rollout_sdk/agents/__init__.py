"""Multi-turn agent rollouts with tools: token-in/token-out trajectories with loss masks and logprobs.

See docs/agents.md.  Importing this package imports no tokenizer and starts nothing.
"""

from ..errors import StalenessError
from ..rollouts.context import RolloutContext
from ..rollouts.group import Agent, RewardFn, group_stats, rollout_group
from ..rollouts.trajectory import ToolCallRecord, Trajectory, TrajectoryBuilder, Turn
from .chat import ChatTemplate, DriftReport, TemplateError
from .loop import AgentConfig, ToolAgent
from .parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NoReasoningParser,
    ParsedTurn,
    ParseError,
    Qwen3CoderParser,
    ReasoningParser,
    ThinkReasoningParser,
    ToolCall,
    ToolCallParser,
    format_tool_error,
    get_parser,
    get_reasoning_parser,
    parser_names,
    reasoning_parser_names,
    register_parser,
    register_reasoning_parser,
)
from .tools import Tool, ToolArgumentError, ToolImage, ToolRegistry, ToolResult, tool

__all__ = [
    "Agent",
    "AgentConfig",
    "ChatTemplate",
    "DriftReport",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "NoReasoningParser",
    "ParseError",
    "ParsedTurn",
    "Qwen3CoderParser",
    "ReasoningParser",
    "RewardFn",
    "RolloutContext",
    "StalenessError",
    "TemplateError",
    "ThinkReasoningParser",
    "Tool",
    "ToolAgent",
    "ToolArgumentError",
    "ToolCall",
    "ToolCallParser",
    "ToolCallRecord",
    "ToolImage",
    "ToolRegistry",
    "ToolResult",
    "Trajectory",
    "TrajectoryBuilder",
    "Turn",
    "format_tool_error",
    "get_parser",
    "get_reasoning_parser",
    "group_stats",
    "parser_names",
    "reasoning_parser_names",
    "register_parser",
    "register_reasoning_parser",
    "rollout_group",
    "tool",
]
