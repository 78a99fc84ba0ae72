"""Tool definitions -> JSON Schema, tool registry and output validation (first layer: imports nothing of ours)."""
from .check import check_enforceable, check_valid, set_enforceability_check
from .errors import InstanceError, SchemaError, SpecAgentError, ToolCallError, ToolError
from .narrow import bound_arrays, bound_scalars, calendar_dates, close_objects, narrow_for_grammar
from .registry import ToolRegistry, call_schema
from .tool import ResponseFormat, Tool, ToolCall, as_tool

__all__ = ["InstanceError", "ResponseFormat", "SchemaError", "SpecAgentError", "Tool", "ToolCall", "ToolCallError", "ToolError",
           "ToolRegistry", "as_tool", "bound_arrays", "bound_scalars", "calendar_dates", "call_schema", "close_objects",
           "check_enforceable", "check_valid", "narrow_for_grammar", "set_enforceability_check"]
