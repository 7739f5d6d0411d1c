"""Tools for multi-turn agent rollouts: a tool's definition (:mod:`.definition`: ``Tool``, ``@tool``)
and the registry that runs the calls (:mod:`.registry`: ``ToolRegistry``, ``ToolResult``)."""

from .definition import Tool, ToolArgumentError, tool
from .registry import TOOL_ERROR_KINDS, ToolImage, ToolRegistry, ToolResult

__all__ = ["TOOL_ERROR_KINDS", "Tool", "ToolArgumentError", "ToolImage", "ToolRegistry", "ToolResult", "tool"]
