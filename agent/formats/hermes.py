"""``hermes``: Qwen2.5, Qwen3 and Hermes models.

The tokenizer's own chat template renders the prompt with ``tools=`` (it lists the tools and explains the layout);
earlier calls and tool results go through the template's own roles. A turn writes one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    ...

``<tool_call>`` / ``</tool_call>`` are single added tokens in Qwen's vocabulary: the grammar names them as tokens.

The same call objects written bare, one per line, with no marker, are accepted too: Qwen2.5-Coder-Instruct writes
its calls that way (measured on Qwen2.5-Coder-0.5B for "What is 2 plus 40?" with an ``add`` tool: first-token
probability 0.74 for ``{"``, 4e-11 for ``<tool_call>``). The model picks the layout; both parse the same. A text
answer may then not start with ``<`` or ``{``.

A call object in a Markdown fence (```` ```json ````) is text, as vLLM's hermes parser reads it. Both Qwen2.5-Coder
models write that fence when no tool fits the question; the 1.5B writes its calls that way too. Measured on the dev
split (docs/benchmarks.md, "Fenced calls"), taking the fence as a call cost Qwen2.5-Coder-0.5B its irrelevance
(1 of 16 questions answered without a call, from 1.00) and left its other categories within a question or two, so
the fence stays text: under ``tool_choice="auto"`` the 1.5B answers in fenced text, and ``"required"`` makes it call.

After tool results the turn is rendered the way ``generic`` renders it (a short answer instruction instead of the
tool list) and only the marked layout can call again: with the tool list and bare calls allowed, Qwen2.5-Coder-0.5B
repeats its call instead of answering (first-token probability 0.97 for ``{"`` after the result of ``add``; with
the tool list kept and the instruction after the results, the demo's three answers were ```` ```json ```` calls).
The answer turn's prompt therefore shares little with the next question's: the llama.cpp backend keeps it in a
second cached slot (``decoding.llamacpp``), so the system prompt and tools stay in the prefix cache.
"""
from __future__ import annotations

import json
import re

from schemas import Tool

from .base import ToolFormat, openai_tools, template_chat
from .chat import ANSWER_SYSTEM_PROMPT

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


class HermesFormat(ToolFormat):
    name = "hermes"
    parallel = True
    counts_calls = True

    def render(self, messages: list[dict], tools: list[Tool], *, use_tools: bool = True) -> list[int]:
        chat = template_chat(messages)
        if use_tools and tools and messages and messages[-1]["role"] == "tool":
            if chat[0]["role"] == "system":
                chat[0] = {"role": "system", "content": chat[0]["content"] + "\n\n" + ANSWER_SYSTEM_PROMPT}
            else:
                chat.insert(0, {"role": "system", "content": ANSWER_SYSTEM_PROMPT})
            use_tools = False
        extra = {"tools": openai_tools(tools)} if use_tools and tools else {}
        return self.encode_chat(chat, **extra)

    def calls_rule(self, parallel: bool, after_results: bool = False) -> str:
        block = f'{self.marker(OPEN)} "\\n" call "\\n" {self.marker(CLOSE)}'
        if after_results:
            return f'{block} ("\\n" {block})*' if parallel else block
        if not parallel:
            return f"{block} | call"
        return f'{block} ("\\n" {block})* | call ("\\n" call)*'

    def several_calls_rule(self, after_results: bool = False, min_calls: int = 2) -> str:
        block = f'{self.marker(OPEN)} "\\n" call "\\n" {self.marker(CLOSE)}'
        # the marked layout (the one the model continues in), min_calls or more (the engine asks for more than its
        # cap: the model's end masked, agent.parallel_calls ends the turn)
        return f'{block} ("\\n" {block}){{{max(min_calls, 1) - 1},}}'

    def gbnf_root(self) -> str:
        return f'"{OPEN}\\n" call "\\n{CLOSE}" | call'

    def call_prefixes(self) -> tuple[str, ...]:
        return "<", "{"

    def call_close(self, open_call: str) -> str:
        return "\n" + CLOSE if open_call.startswith(OPEN) else ""

    def is_call(self, text: str) -> bool:
        s = text.lstrip()
        return s.startswith(OPEN) or s.startswith('{"name"')

    def parse(self, text: str) -> tuple[list[dict] | None, str]:
        if not self.is_call(text):
            return None, text
        s = text.strip()
        bodies = _BLOCK.findall(s) if s.startswith(OPEN) else [obj for obj, _ in _bare_objects(s)]
        if not bodies:
            raise ValueError(f"no complete {OPEN} block in {text[:80]!r}")
        calls = []
        for body in bodies:
            obj = json.loads(body) if isinstance(body, str) else body
            calls.append({"name": obj["name"], "arguments": obj["arguments"]})
        return calls, ""

    def complete_calls(self, text: str) -> list[tuple[dict, int]]:
        s = text.lstrip()
        if s.startswith(OPEN):
            found = ((m.group(1), m.end()) for m in _BLOCK.finditer(text))
        elif s.startswith('{"name"'):
            found = _bare_objects(text, len(text) - len(s), whole=False)
        else:
            return []
        out = []
        for body, end in found:
            try:
                obj = json.loads(body) if isinstance(body, str) else body
                out.append(({"name": obj["name"], "arguments": obj["arguments"]}, end))
            except (ValueError, KeyError, TypeError):
                break
        return out


def _bare_objects(text: str, i: int = 0, *, whole: bool = True) -> list[tuple[dict, int]]:
    """The JSON objects of ``text`` from offset ``i`` on, written one after another (whitespace between), each with
    the offset just past it. ``whole``: the rest of ``text`` must be such objects (``ValueError`` otherwise); else the
    list stops at the first incomplete one (a turn cut mid-call)."""
    decoder, out = json.JSONDecoder(), []
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            if whole:
                raise
            break
        out.append((obj, i))
        while i < len(text) and text[i].isspace():
            i += 1
    return out
