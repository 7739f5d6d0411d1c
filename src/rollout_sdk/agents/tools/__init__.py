"""Tools for multi-turn agent rollouts (see :mod:`.registry`)."""

from .registry import TOOL_ERROR_KINDS, Tool, ToolArgumentError, ToolRegistry, ToolResult, tool

__all__ = ["TOOL_ERROR_KINDS", "Tool", "ToolArgumentError", "ToolRegistry", "ToolResult", "tool"]
