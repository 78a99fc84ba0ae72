"""The agent loop (top layer: may import schemas, constraints and decoding)."""
from schemas import Tool
from schemas.errors import SpecAgentError

from .agent import Agent, Event, RunResult, ToolCallRecord
from .formats import ToolFormat, ToolFormatError

__all__ = ["Agent", "Event", "RunResult", "SpecAgentError", "Tool", "ToolCallRecord", "ToolFormat", "ToolFormatError"]
