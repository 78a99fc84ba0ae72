"""The agent loop (top layer: may import schemas, constraints and decoding)."""
from schemas.errors import SpecAgentError

from .agent import Agent, Event, RunResult, ToolCallRecord

__all__ = ["Agent", "Event", "RunResult", "SpecAgentError", "ToolCallRecord"]
