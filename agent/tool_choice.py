"""``tool_choice`` handling: which tools a turn may call, and whether it must call one."""
from __future__ import annotations

from typing import Any, Iterable

from schemas import Tool, ToolCallError


def filter_tools(tools: Iterable[Tool], tool_choice: Any) -> tuple[list[Tool], str]:
    """Apply ``tool_choice`` to ``tools`` (a list or a :class:`ToolRegistry`) -> (allowed tools, mode
    ``auto``/``required``/``none``).

    ``{"name": X}`` or OpenAI's ``{"type": "function", "function": {"name": X}}`` forces a call of X.

    Raises:
        ToolCallError: the named tool is not among ``tools``.
        ValueError: ``tool_choice`` is none of the above, or ``"required"`` with no tools.
    """
    tools = list(tools)
    if tool_choice == "required" and not tools:
        raise ValueError("tool_choice 'required' needs at least one tool; none is registered")
    if tool_choice in ("auto", "required", "none"):
        return tools, tool_choice
    if isinstance(tool_choice, dict):
        name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
        if name is None:
            raise ValueError(f"tool_choice dict must name a tool: {tool_choice!r}")
        named = [t for t in tools if t.name == name]
        if not named:
            raise ToolCallError(f"unknown tool {name!r} in tool_choice; tools: {sorted(t.name for t in tools)}",
                                tool=name)
        return named, "required"
    raise ValueError(f"tool_choice must be 'auto', 'required', 'none' or {{'name': ...}}, got {tool_choice!r}")
