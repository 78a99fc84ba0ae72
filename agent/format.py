"""The model-facing tool-call format: system prompt, chat rendering, the per-turn grammar and parsing.

Format (SmolLM2-Instruct's function-calling format, a JSON array so several calls fit in one turn)::

    <tool_call>[{"name":"get_weather","arguments":{"city":"Paris"}}]</tool_call>

The turn grammar is an llguidance Lark grammar: a tool-call branch whose calls are ``%json`` with one ``anyOf``
branch per tool (the name, a ``const``, selects the arguments schema), and/or a free-text branch, per
``tool_choice``. JSON is compact (no free whitespace), so the grammar bounds every call.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Iterable

from schemas import Tool, ToolCallError

# The system prompt shows the layout with placeholders only: a worked example's values (a city, a date) were copied
# into answers (4 of 200 never-seen BFCL questions on SmolLM2-135M).
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# Separators inside tool calls: json.dumps' own (", ", ": "), fixed (no free whitespace). SmolLM2 was trained on
# calls written this way: on BFCL simple_python (first 50) accuracy went from 0.58 with compact separators to 0.70.
SEPARATORS = (", ", ": ")

SYSTEM_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible functions.
Based on the question, you will need to make one or more function/tool calls to achieve the purpose.
If none of the functions can be used, or the question is answered by the tool results, answer in plain text.

You have access to the following tools:
<tools>{tools}</tools>

To call tools, the output MUST strictly adhere to the following format, and NO other text MUST be included.
Please make sure the parameter type is correct and take the argument values from the question.
The output is one JSON array of calls (placeholders in angle brackets):
<tool_call>[{{"name": <function-name>, "arguments": <args-json-object>}}]</tool_call>"""


# After tool results, small models answer far better without the tool-listing prompt (measured on SmolLM2-135M:
# with it, 0/3 demo answers used the result; with this one, the answers quote it). The grammar still allows calls.
ANSWER_SYSTEM_PROMPT = "You are a helpful assistant. Answer the user's question with the tool results given."


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


def to_chat_messages(messages: list[dict], tools: list[Tool], *, use_tools: bool) -> list[dict]:
    """OpenAI-style messages -> plain ``{"role", "content"}`` messages for a chat template without tool support.

    The tool list goes into the system message; assistant tool calls become their ``<tool_call>`` text; tool
    results keep the ``tool`` role with JSON content.
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
    after_results = bool(messages) and messages[-1]["role"] == "tool"
    if use_tools and tools:
        user_system = out[0]["content"] if out and out[0]["role"] == "system" else None
        text = (ANSWER_SYSTEM_PROMPT if user_system is None else user_system + "\n\n" + ANSWER_SYSTEM_PROMPT) \
            if after_results else system_prompt(tools, user_system)
        if user_system is not None:
            out[0] = {"role": "system", "content": text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render_prompt(tokenizer, messages: list[dict], tools: list[Tool], *, use_tools: bool = True) -> list[int]:
    """Token ids of the chat (template applied, generation prompt added).

    Message content (every role: system, user, assistant, tool results, tool descriptions) is tokenized as plain
    text: a string such as ``<|im_end|>`` or ``<|im_start|>system`` inside it stays text and never becomes a control
    token, so a tool result cannot open a new turn. Only the chat template's own structure yields control tokens.

    Raises:
        ValueError: the chat template rewrites message content in a way that hides where it sits in the prompt,
            and some content holds a special-token string (it cannot then be kept plain text).
    """
    chat = to_chat_messages(messages, tools, use_tools=use_tools)
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    pieces = _template_pieces(tokenizer, chat, text)
    if pieces is None:
        specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
        bad = [i for i, m in enumerate(chat) if any(t in (m.get("content") or "") for t in specials)]
        if bad:
            raise ValueError(f"message {bad[0]} holds a special-token string and the chat template rewrites message "
                             f"content, so it cannot be kept plain text; remove the special-token strings")
        return tokenizer.encode(text, add_special_tokens=False)
    plain = _plain_text_encoder(tokenizer)
    ids: list[int] = []
    for i, piece in enumerate(pieces):  # even: template text (control tokens parsed); odd: message content
        if piece:
            ids += plain(piece) if i % 2 else tokenizer.encode(piece, add_special_tokens=False)
    return ids


_PLAIN_ENCODERS: dict[int, Any] = {}
_PLAIN_LOCK = threading.Lock()


def _plain_text_encoder(tokenizer):
    """``text -> ids`` with special-token strings kept as plain text.

    A private copy of the fast tokenizer's backend with ``encode_special_tokens`` set once: HF's
    ``split_special_tokens=True`` flips that flag on the *shared* backend for the duration of a call, so another
    thread encoding the template at the same time would lose its control tokens. Slow tokenizers use
    ``split_special_tokens`` (they keep no such shared flag).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda text: tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    with _PLAIN_LOCK:
        entry = _PLAIN_ENCODERS.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(backend.to_str())
            copy.encode_special_tokens = True
            entry = _PLAIN_ENCODERS[id(tokenizer)] = (tokenizer, copy)
    copy = entry[1]
    return lambda text: copy.encode(text, add_special_tokens=False).ids


def _template_pieces(tokenizer, chat: list[dict], text: str) -> list[str] | None:
    """``text`` split into [template, content, template, content, …, template], or None when the template does not
    place each message's content (or its stripped form) verbatim."""
    marks = [f"\x00specagent-content-{i}\x00" for i in range(len(chat))]
    marked = tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(chat, marks)],
                                           add_generation_prompt=True, tokenize=False)
    for transform in (lambda c: c, str.strip):
        pieces: list[str] = []
        rest = marked
        for m, mark in zip(chat, marks):
            before, found, rest = rest.partition(mark)
            if not found or mark in rest:
                return None
            pieces += [before, transform(m.get("content") or "")]
        pieces.append(rest)
        if "".join(pieces) == text:
            return pieces
    return None


def turn_grammar(tools: list[Tool], tool_choice: Any = "auto", *, parallel: bool = True,
                 response_format: dict | None = None, max_string_length: int | None = None,
                 max_decimals: int | None = None, tokenizer=None):
    """The Lark grammar of one assistant turn in the ``generic`` format (see ``ToolFormat.turn_grammar``).

    Args:
        tools: tools the model may call (already filtered for a named ``tool_choice``).
        tool_choice: ``"auto"`` (calls or an answer), ``"required"`` (calls), ``"none"`` (an answer only).
        parallel: allow several calls in one turn.
        response_format: JSON Schema of the final answer (replaces free text).
        max_string_length: cap (characters) on argument strings that set no ``maxLength``/``enum``/``const``/
            ``pattern``/``format``, so a call always closes within a token budget. Outputs stay schema-valid.
        max_decimals: bound numbers to this many decimals and ``|x| <= 1e15`` (see :func:`schemas.bound_scalars`).
    """
    from .formats.generic import GenericFormat  # the one builder of the generic grammar (markers as text)

    return GenericFormat(None).turn_grammar(tools, tool_choice, parallel=parallel, response_format=response_format,
                                            max_string_length=max_string_length, max_decimals=max_decimals)


def parse_turn(text: str) -> tuple[list[dict] | None, str]:
    """Split decoded turn text into (calls or None, answer text). Calls are ``[{"name", "arguments"}]``."""
    s = text.strip()
    if s.startswith(CALL_OPEN):
        end = s.rfind(CALL_CLOSE)
        body = s[len(CALL_OPEN): end if end >= 0 else None]
        calls = json.loads(body)
        if not isinstance(calls, list):
            raise ToolCallError(f"tool calls must be a JSON array, got {body[:80]!r}")
        return calls, ""
    return None, text


def filter_tools(tools: Iterable[Tool], tool_choice: Any) -> tuple[list[Tool], str]:
    """Apply ``tool_choice`` to ``tools`` (a list or a :class:`ToolRegistry`) -> (allowed tools, mode
    ``auto``/``required``/``none``).

    ``{"name": X}`` or OpenAI's ``{"type": "function", "function": {"name": X}}`` forces a call of X.

    Raises:
        ToolCallError: the named tool is not among ``tools``.
        ValueError: ``tool_choice`` is none of the above.
    """
    tools = list(tools)
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
