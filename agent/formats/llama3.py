"""``llama3_json``: Llama 3.1 / 3.2 with custom (JSON) tools.

The tokenizer's chat template renders the prompt with ``tools=``; the model answers a call with one bare JSON
object and no marker::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Llama 3.x's template renders exactly one call per assistant turn (it raises on more), so the family has no trained
layout for several calls: ``parallel_tool_calls=True`` is refused. Tool results go through the template's
``ipython`` role.
"""
from __future__ import annotations

import json

from schemas import Tool

from .base import ToolFormat, openai_tools, template_chat


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    parallel = False

    def render(self, messages: list[dict], tools: list[Tool], *, use_tools: bool = True,
               several: bool = False, call_asked: bool = False) -> list[int]:
        chat = template_chat(messages, one_call_per_turn=True)
        extra = {"tools": openai_tools(tools)} if use_tools and tools else {}
        return self.encode_chat(chat, **extra)

    def call_object_schema(self, schema: dict) -> dict:
        """``{"name", "arguments"}`` -> ``{"name", "parameters"}`` in every branch."""
        def rename(branch: dict) -> dict:
            props = branch["properties"]
            return {**branch, "properties": {"name": props["name"], "parameters": props["arguments"]},
                    "required": ["name", "parameters"]}

        if "anyOf" in schema:
            return {**schema, "anyOf": [rename(b) for b in schema["anyOf"]]}
        return rename(schema)

    def calls_rule(self, parallel: bool, after_results: bool = False) -> str:
        return "call"

    def gbnf_root(self) -> str:
        return "call"

    def call_prefixes(self) -> tuple[str, ...]:
        return ("{",)

    def is_call(self, text: str) -> bool:
        return text.lstrip().startswith('{"name"')

    def parse(self, text: str) -> tuple[list[dict] | None, str]:
        if not self.is_call(text):
            return None, text
        obj = json.loads(text.strip())
        return [{"name": obj["name"], "arguments": obj["parameters"]}], ""
