"""``generic``: for chat templates that take no ``tools=`` (SmolLM2's among them): our system prompt, chat rendering,
the per-turn grammar and parsing.

Format (SmolLM2-Instruct's function-calling format, a JSON array so several calls fit in one turn)::

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

The tools are listed in a system message written by us (:data:`SYSTEM_PROMPT`). The turn grammar is an llguidance
Lark grammar: a tool-call branch whose calls are ``%json`` with one ``anyOf`` branch per tool (the name, a
``const``, selects the arguments schema), and/or a free-text branch, per ``tool_choice``. JSON has no free
whitespace, so the grammar bounds every call.

The module-level functions (:func:`render_prompt`, :func:`turn_grammar`, :func:`parse_turn`, …) are the format
without a :class:`GenericFormat` object, for callers that hold only a tokenizer.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from schemas import Tool, ToolCallError

from .base import SEPARATORS, ToolFormat
from .chat import ANSWER_SYSTEM_PROMPT, encode_template_chat

# The system prompt shows the layout with placeholders only: a worked example's values (a city, a date) were copied
# into answers (4 of 200 never-seen tool-call benchmark questions on SmolLM2-135M).
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# Separators inside tool calls: json.dumps' own (", ", ": "; ``SEPARATORS``), fixed (no free whitespace). SmolLM2 was
# trained on calls written this way: on the tool-call benchmark's simple_python (first 50) accuracy went from 0.58
# with compact separators to 0.70.

SYSTEM_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible functions.
Based on the question, you will need to make one or more function/tool calls to achieve the purpose.
If none of the functions can be used, or the question is answered by the tool results, answer in plain text.

You have access to the following tools:
<tools>{tools}</tools>

To call tools, the output MUST strictly adhere to the following format, and NO other text MUST be included.
Please make sure the parameter type is correct and take the argument values from the question.
The output is one JSON array of calls (placeholders in angle brackets):
<tool_call>[{{"name": <function-name>, "arguments": <args-json-object>}}]</tool_call>"""


class GenericFormat(ToolFormat):
    name = "generic"
    parallel = True

    def render(self, messages: list[dict], tools: list[Tool], *, use_tools: bool = True,
               several: bool = False, call_asked: bool = False) -> list[int]:
        if self.chat_template == getattr(self.tokenizer, "chat_template", None):
            return render_prompt(self.tokenizer, messages, tools, use_tools=use_tools, call_asked=call_asked)
        return self.encode_chat(to_chat_messages(messages, tools, use_tools=use_tools, call_asked=call_asked))

    def calls_rule(self, parallel: bool, after_results: bool = False) -> str:
        more = f' ("{SEPARATORS[0]}" call)*' if parallel else ""
        open_, close = self.marker(CALL_OPEN), self.marker(CALL_CLOSE)
        if open_.startswith('"') and close.startswith('"'):  # text markers: one literal each side, as before
            return f'"{CALL_OPEN}[" call{more} "]{CALL_CLOSE}"'
        return f'{open_} "[" call{more} "]" {close}'

    def gbnf_root(self) -> str:
        return f'"{CALL_OPEN}[" call "]{CALL_CLOSE}"'

    def is_call(self, text: str) -> bool:
        return text.lstrip().startswith(CALL_OPEN)

    def parse(self, text: str) -> tuple[list[dict] | None, str]:
        s = text.strip()
        if s.startswith(CALL_OPEN):
            end = s.rfind(CALL_CLOSE)
            body = s[len(CALL_OPEN): end if end >= 0 else None]
            calls = json.loads(body)
            if not isinstance(calls, list):
                raise ToolCallError(f"tool calls must be a JSON array, got {body[:80]!r}")
            return calls, ""
        return None, text

    def complete_calls(self, text: str) -> list[tuple[dict, int]]:
        s = text.lstrip()
        if not s.startswith(CALL_OPEN + "["):
            return []
        decoder, out = json.JSONDecoder(), []
        i = len(text) - len(s) + len(CALL_OPEN) + 1
        while i < len(text):
            try:
                obj, end = decoder.raw_decode(text, i)
                out.append(({"name": obj["name"], "arguments": obj["arguments"]}, end))
            except (ValueError, KeyError, TypeError):
                break
            if not text.startswith(SEPARATORS[0], end):
                break
            i = end + len(SEPARATORS[0])
        return out

    def calls_text(self, text: str, end: int) -> str:
        return text[:end] + "]" + CALL_CLOSE


def tools_json(tools: Iterable[Tool]) -> str:
    return json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters}
                       for t in tools], ensure_ascii=False)


def system_prompt(tools: list[Tool], extra: str | None = None) -> str:
    text = SYSTEM_PROMPT.format(tools=tools_json(tools))
    return text if not extra else extra.rstrip() + "\n\n" + text


def render_call_text(calls: list[dict]) -> str:
    """``<tool_call>[...]</tool_call>`` for ``[{"name", "arguments"}]`` (compact JSON, as the grammar emits)."""
    body = SEPARATORS[0].join(json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False,
                                         separators=SEPARATORS) for c in calls)
    return f"{CALL_OPEN}[{body}]{CALL_CLOSE}"


def to_chat_messages(messages: list[dict], tools: list[Tool], *, use_tools: bool,
                     call_asked: bool = False) -> list[dict]:
    """OpenAI-style messages -> plain ``{"role", "content"}`` messages for a chat template without tool support.

    The tool list goes into the system message (after tool results an answer prompt instead, unless
    ``call_asked``: ``ToolFormat.render``); assistant tool calls become their ``<tool_call>`` text; tool results
    keep the ``tool`` role with JSON content.
    """
    out: list[dict] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = tc["function"]
                args = fn["arguments"]
                calls.append({"name": fn["name"], "arguments": json.loads(args) if isinstance(args, str) else args})
            text = (m.get("content") or "") + render_call_text(calls)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            out.append({"role": "tool", "content": m.get("content") if isinstance(m.get("content"), str)
                        else json.dumps(m.get("content"), ensure_ascii=False)})
        else:
            out.append({"role": role, "content": m.get("content") or ""})
    after_results = bool(messages) and messages[-1]["role"] == "tool" and not call_asked
    if use_tools and tools:
        user_system = out[0]["content"] if out and out[0]["role"] == "system" else None
        text = (ANSWER_SYSTEM_PROMPT if user_system is None else user_system + "\n\n" + ANSWER_SYSTEM_PROMPT) \
            if after_results else system_prompt(tools, user_system)
        if user_system is not None:
            out[0] = {"role": "system", "content": text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render_prompt(tokenizer, messages: list[dict], tools: list[Tool], *, use_tools: bool = True,
                  call_asked: bool = False) -> list[int]:
    """Token ids of the chat in the ``generic`` format with the tokenizer's own chat template (generation prompt
    added); message content is tokenized as plain text (see :func:`agent.formats.chat.encode_template_chat`).

    Raises:
        ValueError: the chat template rewrites message content in a way that hides where it sits in the prompt,
            and some content holds a special-token string (it cannot then be kept plain text).
    """
    return encode_template_chat(tokenizer, to_chat_messages(messages, tools, use_tools=use_tools,
                                                            call_asked=call_asked))


def turn_grammar(tools: list[Tool], tool_choice: Any = "auto", *, parallel: bool = True,
                 response_format: dict | None = None, max_string_length: int | None = None,
                 max_decimals: int | None = None, max_items: int | None = None, tokenizer=None):
    """The Lark grammar of one assistant turn in the ``generic`` format, markers as text (see
    ``ToolFormat.turn_grammar``).

    Args:
        tools: tools the model may call (already filtered for a named ``tool_choice``).
        tool_choice: ``"auto"`` (calls or an answer), ``"required"`` (calls), ``"none"`` (an answer only).
        parallel: allow several calls in one turn.
        response_format: JSON Schema of the final answer (replaces free text).
        max_string_length: cap (characters) on argument strings that set no ``maxLength``/``enum``/``const``/
            ``pattern``/``format``, so a call always closes within a token budget. Outputs stay schema-valid.
        max_decimals: bound numbers to this many decimals and ``|x| <= 1e15`` (see :func:`schemas.bound_scalars`).
        max_items: cap on the items of arrays that set no ``maxItems`` (see :func:`schemas.bound_arrays`).
    """
    return GenericFormat(None).turn_grammar(tools, tool_choice, parallel=parallel, response_format=response_format,
                                            max_string_length=max_string_length, max_decimals=max_decimals,
                                            max_items=max_items)


def parse_turn(text: str) -> tuple[list[dict] | None, str]:
    """Split decoded turn text into (calls or None, answer text). Calls are ``[{"name", "arguments"}]``."""
    return GenericFormat(None).parse(text)
