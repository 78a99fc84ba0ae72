"""``generic``: for chat templates that take no ``tools=`` (SmolLM2's among them).

The tools are listed in a system message written by us (``agent/format.py``); calls are one JSON array::

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>
"""
from __future__ import annotations

from schemas import Tool

from ..format import CALL_CLOSE, CALL_OPEN, SEPARATORS, parse_turn, render_prompt, to_chat_messages
from .base import ToolFormat


class GenericFormat(ToolFormat):
    name = "generic"
    parallel = True

    def render(self, messages: list[dict], tools: list[Tool], *, use_tools: bool = True) -> list[int]:
        if self.chat_template == getattr(self.tokenizer, "chat_template", None):
            return render_prompt(self.tokenizer, messages, tools, use_tools=use_tools)
        return self.encode_chat(to_chat_messages(messages, tools, use_tools=use_tools))

    def calls_rule(self, parallel: bool, after_results: bool = False) -> str:
        more = f' ("{SEPARATORS[0]}" call)*' if parallel else ""
        open_, close = self.marker(CALL_OPEN), self.marker(CALL_CLOSE)
        if open_.startswith('"') and close.startswith('"'):  # text markers: one literal each side, as before
            return f'"{CALL_OPEN}[" call{more} "]{CALL_CLOSE}"'
        return f'{open_} "[" call{more} "]" {close}'

    def is_call(self, text: str) -> bool:
        return text.lstrip().startswith(CALL_OPEN)

    def parse(self, text: str) -> tuple[list[dict] | None, str]:
        return parse_turn(text)
