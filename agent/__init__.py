"""The agent loop (top layer: may import schemas, constraints and decoding)."""
from schemas import Tool
from schemas.errors import SpecAgentError

from .agent import Agent, Event, RunResult, ToolCallRecord
from .engine import DecodedTurn, Engine, EngineConfig, LocalEngine
from .formats import ToolFormat, ToolFormatError
from .remote import OpenAIEngine

__all__ = ["Agent", "DecodedTurn", "Engine", "EngineConfig", "Event", "LocalEngine", "OpenAIEngine", "RunResult",
           "SpecAgentError", "Tool", "ToolCallRecord", "ToolFormat", "ToolFormatError"]
