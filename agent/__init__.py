"""The agent loop (top layer: may import schemas, constraints and decoding)."""
from .agent import Agent, Event, RunResult, ToolCallRecord

__all__ = ["Agent", "Event", "RunResult", "ToolCallRecord"]
