"""The agent loop (top layer: may import schemas, constraints and decoding)."""
from .agent import Agent, RunResult, ToolCallRecord

__all__ = ["Agent", "RunResult", "ToolCallRecord"]
