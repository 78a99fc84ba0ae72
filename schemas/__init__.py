"""Tool definitions -> JSON Schema, tool registry and output validation (first layer: imports nothing of ours)."""
from .check import JSON_COMPILE_OPTIONS, check_enforceable, check_valid, compile_json_schema
from .errors import InstanceError, SchemaError, SpecAgentError, ToolCallError, ToolError
from .registry import ToolRegistry, call_schema, close_objects
from .tool import ResponseFormat, Tool, ToolCall, as_tool

__all__ = ["InstanceError", "JSON_COMPILE_OPTIONS", "ResponseFormat", "SchemaError", "SpecAgentError", "Tool", "ToolCall", "ToolCallError", "ToolError",
           "ToolRegistry", "as_tool", "call_schema", "close_objects", "check_enforceable", "check_valid", "compile_json_schema"]
