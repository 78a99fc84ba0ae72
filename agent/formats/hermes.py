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

# Where several calls are asked for (``parallel_tool_calls=True``), the system message ends with a worked example of
# several calls in this layout, its markers the control tokens (the format's text, not a message's). Dev split,
# Qwen2.5-Coder-0.5B, the first 50 parallel and parallel_multiple questions: docs/benchmarks.md, "An example of
# several calls in the prompt".
SEVERAL_CALLS_EXAMPLE = (
    "The user may ask for several things in one message. Make one function call for each of them. For example, "
    "for \"Get the stock price of Apple and of Tesla, and the latest news about Tesla.\" with functions "
    "stock_price(company) and company_news(company), answer:\n"
    "<tool_call>\n{\"name\": \"stock_price\", \"arguments\": {\"company\": \"Apple\"}}\n</tool_call>\n"
    "<tool_call>\n{\"name\": \"stock_price\", \"arguments\": {\"company\": \"Tesla\"}}\n</tool_call>\n"
    "<tool_call>\n{\"name\": \"company_news\", \"arguments\": {\"company\": \"Tesla\"}}\n</tool_call>")
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


class HermesFormat(ToolFormat):
    name = "hermes"
    parallel = True
    counts_calls = True
    _default_system: str | None = None  # default_system(), once read from the template

    def render(self, messages: list[dict], tools: list[Tool], *, use_tools: bool = True,
               several: bool = False, call_asked: bool = False) -> list[int]:
        chat = template_chat(messages)
        if use_tools and tools and messages and messages[-1]["role"] == "tool" and not call_asked:
            if chat[0]["role"] == "system":
                chat[0] = {"role": "system", "content": chat[0]["content"] + "\n\n" + ANSWER_SYSTEM_PROMPT}
            else:
                chat.insert(0, {"role": "system", "content": ANSWER_SYSTEM_PROMPT})
            use_tools = False
        elif several and use_tools and tools:
            chat = self._with_several_calls_example(chat)
            # the example is the format's text, not a message's: its markers are control tokens, as measured
            return self.encode_chat(chat, format_suffix=(0, SEVERAL_CALLS_EXAMPLE), tools=openai_tools(tools))
        extra = {"tools": openai_tools(tools)} if use_tools and tools else {}
        return self.encode_chat(chat, **extra)

    def _with_several_calls_example(self, chat: list[dict]) -> list[dict]:
        """``chat`` with :data:`SEVERAL_CALLS_EXAMPLE` at the end of its system message; where the chat has none,
        a system message holding the template's own default system text first (:meth:`default_system`), so the
        prompt differs from the plain one only by the example."""
        if chat and chat[0]["role"] == "system":
            return [{**chat[0], "content": chat[0]["content"] + "\n\n" + SEVERAL_CALLS_EXAMPLE}] + chat[1:]
        default = self.default_system()
        return [{"role": "system", "content": (default + "\n\n" if default else "") + SEVERAL_CALLS_EXAMPLE}] + chat

    def default_system(self) -> str:
        """The system text the chat template writes before ``# Tools`` where the chat has no system message
        (Qwen2.5: "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."; Qwen3: none, "")."""
        if self._default_system is None:
            probe = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[probe],
                                                      add_generation_prompt=True, tokenize=False,
                                                      chat_template=self.chat_template)
            m = re.search(r"<\|im_start\|>system\n(.*?)# Tools", text, re.S)
            self._default_system = m.group(1).strip() if m else ""
        return self._default_system

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
