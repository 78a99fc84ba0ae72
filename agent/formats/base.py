"""The interface every tool-call format implements, and what the formats share.

A format is how one model family was trained to see tools and write calls:
    * ``render``: OpenAI-style messages + tools -> prompt token ids (the chat template, generation prompt added);
    * ``turn_grammar``: the llguidance grammar of one assistant turn (calls in the family's layout, and/or an answer,
      per ``tool_choice``), argument schemas enforced exactly, no free whitespace;
    * ``parse``: the decoded turn text -> calls ``[{"name", "arguments"}]`` or an answer;
    * ``gbnf_root``: the call layout as a GBNF root rule (the benchmark's llama.cpp peer decodes with it).

Markers that are single added tokens in the vocabulary (Qwen's ``<tool_call>`` is id 151657) are named in the grammar
as tokens (llguidance's ``<[id]>``): llguidance matches no text against a special token, so a quoted ``"<tool_call>"``
would never match the token the model writes.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

from constraints import Grammar, lark_grammar, lark_json, schema_compiles
from schemas import Tool, call_schema, narrow_for_grammar
from schemas.errors import SpecAgentError

from .chat import plain_text_encoder

# json.dumps' own separators: what chat templates' ``tojson`` writes, so what the models saw in training.
SEPARATORS = (", ", ": ")


class ToolFormatError(SpecAgentError, ValueError):
    """A tool-call format cannot do what was asked (unknown format, several calls where the family has no layout
    for them, no chat template)."""


class ToolFormat:
    """One model family's tool-call format, bound to a tokenizer (and optionally a chat template override).

    Attributes:
        name: the format's name (``Agent(tool_format=name)``).
        parallel: the family has a trained layout for several calls in one turn.
        counts_calls: :meth:`several_calls_rule` counts calls (``min_calls``), so the model's end can be masked where
            several are asked for and ``agent.parallel_calls.ParallelCallsEnd`` ends the turn from the calls.
        end_whitespace: Lark for what may follow the last call before the model's end-of-generation token (one
            optional newline: Qwen2.5-Coder writes ``\n`` after ``</tool_call>``).
    """

    name = "base"
    parallel = True
    counts_calls = False
    user_template = False  # the chat template is the user's (``chat_template=``), not the tokenizer's
    end_whitespace = '"\\n"?'  # Lark: what may follow the last call before the turn ends (one optional newline)

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer  # None: grammar only, markers as text
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if tokenizer is not None and not self.chat_template:
            raise ToolFormatError(
                "the tokenizer has no chat template (tokenizer.chat_template is not set); pass one: "
                "Agent(..., chat_template=TEXT_OR_PATH) or `python -m agent ... --chat-template FILE`")

    # -- the interface --------------------------------------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[Tool], *, use_tools: bool = True,
               several: bool = False, call_asked: bool = False) -> list[int]:
        """Prompt token ids for OpenAI-style ``messages`` (generation prompt added).

        Args:
            use_tools: list ``tools`` in the prompt.
            several: several calls are asked for (``parallel_tool_calls=True``); a format may then show its
                several-call layout in the prompt (``hermes`` does; the others render as without).
            call_asked: the turn's grammar asks for a call (``tool_choice`` ``"required"`` or a named tool).
                After tool results ``hermes`` and ``generic`` render an answer prompt without the tool list
                (small models answer from the results better so); where a call is asked for they list the tools
                as on a first turn.
        """
        raise NotImplementedError

    def turn_grammar(self, tools: list[Tool], tool_choice: str = "auto", *, parallel: bool | None = None,
                     response_format: dict | None = None, max_string_length: int | None = None,
                     max_decimals: int | None = None, max_items: int | None = None,
                     excluded_integer_prefixes: frozenset[str] = frozenset(), after_results: bool = False,
                     lenient_answer: bool = False, min_calls: int = 2,
                     answer_opens_no_call: bool | None = None,
                     answer_excludes: tuple[str, ...] = (), answer_forbids: str = "") -> Grammar:
        """The grammar of one assistant turn.

        Args:
            tools: tools the model may call (already filtered for a named ``tool_choice``).
            tool_choice: ``"auto"`` (calls or an answer), ``"required"`` (calls), ``"none"`` (an answer only).
            parallel: ``False``: one call; ``None``: several allowed, as the format allows (:meth:`calls_rule`);
                ``True``: several asked for: the layout the family continues in (:meth:`several_calls_rule`).
            response_format: JSON Schema of the final answer (replaces free text).
            max_string_length, max_decimals: grammar-only bounds on unbounded scalars (see ``bound_scalars``), in
                call arguments and in a ``response_format`` answer alike.
            max_items: grammar-only cap on the items of unbounded arrays (see ``bound_arrays``), likewise.
            excluded_integer_prefixes: digit strings no non-negative integer argument may start with (see
                ``schemas.narrow.integers_without_prefixes``; the engine passes
                ``agent.grounding.run_together_prefixes`` of the conversation).
            after_results: the turn follows tool results (a format may narrow the call layouts it accepts).
            lenient_answer: ``response_format`` is not strict (``"strict": false``): keywords the grammar cannot
                enforce are relaxed, and the caller validates the answer.
            min_calls: with ``parallel=True``, the fewest calls the turn may end after (where the format's layout
                can count them: :attr:`counts_calls`). The engine passes one more than its call cap, which masks
                the model's end entirely, so only ``agent.parallel_calls.ParallelCallsEnd`` (a repeat, a call with
                no new value from the conversation, the cap) or the budget end the turn (chosen on the dev split:
                docs/benchmarks.md, "Several calls in one turn").
            answer_opens_no_call: a text answer may not start with what opens a call (``call_prefixes``); None:
                where calls are allowed too (so text and calls are told apart). True also under ``"none"``: the
                answer the engine decodes instead of a call that took nothing from the conversation.
            answer_excludes: more openings a text answer may not start with (the engine passes a backtick when it
                decodes again an answer that only restated a call as JSON: ``LocalEngine.turn``).
            answer_forbids: characters a text answer may not hold anywhere (the engine passes ``{`` and a backtick
                when it decodes again, after tool results, an answer that wrote a call as JSON).
        Raises:
            ToolFormatError: ``parallel=True`` for a format with no trained layout for several calls.
        """
        several = parallel is True  # asked for: the layout the family continues in (several_calls_rule)
        parallel = self.check_parallel(parallel)
        rules, start = [], []
        if tool_choice != "none" and tools:
            schema = self.call_object_schema(call_schema(tools, max_string_length=max_string_length,
                                                         max_decimals=max_decimals, max_items=max_items,
                                                         excluded_integer_prefixes=excluded_integer_prefixes,
                                                         compiles=schema_compiles))
            lenient = any(not t.strict for t in tools)
            rules.append(f"call: {lark_json(schema, separators=SEPARATORS, lenient=lenient)}")
            # the model's own end: any whitespace it writes before its end-of-generation token (Qwen2.5-Coder
            # writes "\n" after </tool_call>, p ≈ 0.99, then <|endoftext|>); the parsers strip it
            body = self.several_calls_rule(after_results, min_calls) if several else \
                self.calls_rule(parallel, after_results)
            rules.append(f"calls: ({body}) {self.end_whitespace}")
            start.append("calls")
        if tool_choice != "required" or not tools:
            if response_format is not None:
                # closed like tool arguments (the model cannot add undeclared keys); validated against the original
                answer = narrow_for_grammar(response_format, lenient=lenient_answer, compiles=schema_compiles,
                                            max_string_length=max_string_length, max_decimals=max_decimals,
                                            max_items=max_items)
                rules.append(f"answer: {lark_json(answer, separators=SEPARATORS, lenient=lenient_answer)}")
            else:
                no_call = bool(start) if answer_opens_no_call is None else answer_opens_no_call
                excluded = (tuple(self.call_prefixes()) if no_call else ()) + tuple(answer_excludes)
                rules.append(f"answer: TEXT\nTEXT: /{answer_text_regex(excluded, answer_forbids)}/")
            start.append("answer")
        return lark_grammar("start: " + " | ".join(start) + "\n" + "\n".join(rules) + "\n")

    def parse(self, text: str) -> tuple[list[dict] | None, str]:
        """Decoded turn text -> (calls ``[{"name", "arguments"}]`` or None, answer text). Raises ValueError on a
        call that is not well-formed JSON (possible only when a turn was cut)."""
        raise NotImplementedError

    def is_call(self, text: str) -> bool:
        """The turn text starts a tool call (rather than an answer)."""
        raise NotImplementedError

    def complete_calls(self, text: str) -> list[tuple[dict, int]]:
        """The calls of a call turn's text, possibly cut mid-call, that are complete: ``[(call, end)]`` in order,
        ``call`` = ``{"name", "arguments"}`` and ``end`` the offset in ``text`` just past its text. Used to end a
        parallel turn early and to return the whole calls of a turn the budget cut. Default: the one call of a
        complete turn (formats without a layout for several calls)."""
        try:
            calls, _ = self.parse(text)
        except ValueError:
            return []
        return [(calls[0], len(text.rstrip()))] if calls else []

    def calls_text(self, text: str, end: int) -> str:
        """A complete turn holding the calls of ``text`` up to offset ``end`` (a :meth:`complete_calls` end),
        closed where the layout needs it. Default: ``text[:end]``."""
        return text[:end]

    def closed_turns(self, text: str) -> Iterator[tuple[str, list[dict]]]:
        """Ways to end a call turn whose last call is open (the model asked to end inside it; open: after the
        whole calls of :meth:`complete_calls`, text other than whitespace): ``(turn text,
        calls)`` pairs, longest first, lazily, each the text up to a point of the open call where its JSON value
        can be closed (:func:`json_closings`: only values the text finished are kept) with the brackets and braces
        it lacks, then closed as the layout needs (:meth:`call_close`, :meth:`calls_text`); ``calls`` are the
        turn's whole calls, the closed one last. Where no call object is begun (only whole calls, perhaps a
        separator after them) and the layout still needs closing after them (generic's ``]</tool_call>``), the one
        way is those calls, closed. None validated against a schema (the caller does that). Nothing when no
        closing exists."""
        if not self.is_call(text):
            return
        whole = self.complete_calls(text)
        end = whole[-1][1] if whole else 0
        body = text[end:].lstrip()  # the call being written, from its marker or object ("" : none is open)
        start = len(text) - len(body)
        obj = text.find("{", start) if body else -1
        if obj < 0:  # no call object begun: the whole calls, where the layout still needs closing after them
            if whole and (turn := self.calls_text(text, end)) != text[:end]:
                yield turn, [c for c, _ in whole]  # generic: "]</tool_call>" after its last whole call
            return
        suffixes = dict.fromkeys((self.call_close(body), ""))
        for closed in json_closings(text[obj:]):
            candidate = text[:obj] + closed
            for suffix in suffixes:
                try:
                    calls = self.complete_calls(candidate + suffix)
                except (ValueError, KeyError, TypeError):  # a layout's parser on a call without its keys
                    continue
                if len(calls) == len(whole) + 1:
                    yield self.calls_text(candidate + suffix, calls[-1][1]), [c for c, _ in calls]
                    break

    def call_close(self, open_call: str) -> str:
        """What closes the layout around one call object, given the open call's text from its start (hermes: the
        ``</tool_call>`` of a marked block). Default ``""``."""
        return ""

    # -- what the subclasses fill in ------------------------------------------------------------------------------
    def calls_rule(self, parallel: bool, after_results: bool = False) -> str:
        """The Lark body of ``calls`` in terms of the ``call`` rule (one call object)."""
        raise NotImplementedError

    def several_calls_rule(self, after_results: bool = False, min_calls: int = 2) -> str:
        """The Lark body of ``calls`` when several calls are asked for (``parallel_tool_calls=True``): the layout the
        family's models continue in after a call (hermes: the marked blocks, at least ``min_calls`` —
        Qwen2.5-Coder-0.5B ends after its first call otherwise: dev split, several-call questions 0/10, with two or
        more 4/10). Default: :meth:`calls_rule` with ``parallel=True`` (``min_calls`` not counted: set
        :attr:`counts_calls` where an override counts it)."""
        return self.calls_rule(True, after_results)

    def gbnf_root(self) -> str:
        """The GBNF root rule of one turn of one call in this family's layout, in terms of a ``call`` rule (the call
        schema's rule): what the benchmark's llama.cpp peer constrains its output with (``bench/modes.py``)."""
        raise NotImplementedError(f"tool format {self.name!r} defines no gbnf_root")

    def call_object_schema(self, schema: dict) -> dict:
        """The call schema ``{"name", "arguments"}`` as this family writes it (default: unchanged)."""
        return schema

    def call_prefixes(self) -> tuple[str, ...]:
        """What the text of a call turn may start with in this format: with calls allowed, a text answer starts with
        none of these (so an answer never opens a call, and a turn cut early is known to be a call). Default
        ``("<",)``."""
        return ("<",)

    def check_parallel(self, parallel: bool | None) -> bool:
        if parallel is None:
            return self.parallel
        if parallel and not self.parallel:
            raise ToolFormatError(
                f"tool format {self.name!r} has no trained layout for several calls in one turn; "
                f"use parallel_tool_calls=False (the model calls one tool per turn)")
        return parallel

    # -- shared helpers -------------------------------------------------------------------------------------------
    def marker(self, text: str) -> str:
        """The Lark term for ``text``: ``<[id]>`` when it is one added token of the vocabulary, else a literal."""
        tid = None if self.tokenizer is None else single_added_token(self.tokenizer, text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    def encode_chat(self, chat: list[dict], *, format_suffix: tuple[int, str] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Apply the chat template and tokenize: only the template's own markers become special tokens.

        Message content is tokenized as plain text, so a user or tool result that contains ``<|im_end|>`` (or any
        added token's text) cannot forge a control token; so is every string the template writes as JSON (a call's
        arguments in the history, a tool's description or enum values) that holds an added token's text.
        ``format_suffix``: ``(i, text)`` where message ``i``'s content ends with ``text`` written by the format
        itself (not the user: hermes' example of several calls), whose markers are control tokens like the
        template's own.
        """
        tok = self.tokenizer
        kwargs = dict(add_generation_prompt=True, tokenize=False, chat_template=self.chat_template, **template_kwargs)
        added = [t for t in tok.get_added_vocab()]
        strings: dict[str, str] = {}  # placeholder -> a JSON string's body as the template's tojson writes it

        def mask(value: Any) -> Any:  # JSON values the template writes with tojson: risky strings as placeholders
            if isinstance(value, dict):
                return {k: mask(v) for k, v in value.items()}
            if isinstance(value, list):
                return [mask(v) for v in value]
            if isinstance(value, str) and any(a in value for a in added):
                key = f"\ue000j{len(strings)}\ue001"
                strings[key] = json.dumps(value, ensure_ascii=False)[1:-1]
                return key
            return value

        chat = [{**m, "tool_calls": mask(m["tool_calls"])} if m.get("tool_calls") else m for m in chat]
        if "tools" in kwargs:
            kwargs["tools"] = mask(kwargs["tools"])
        if format_suffix is None and not strings and not any(
                isinstance(m.get("content"), str) and any(a in m["content"] for a in added) for m in chat):
            return tok.encode(tok.apply_chat_template(chat, **kwargs), add_special_tokens=False)
        contents: dict[str, str] = dict(strings)  # placeholder -> plain text: message contents and JSON strings
        masked = []
        for i, m in enumerate(chat):
            if isinstance(m.get("content"), str) and m["content"]:
                key = f"\ue000{i}\ue001"
                contents[key] = m["content"]
                m = {**m, "content": key}
            masked.append(m)
        text = tok.apply_chat_template(masked, **kwargs)
        if any(k not in text and json.dumps(k)[1:-1] in text for k in strings):  # written escaped: never guess
            raise ValueError("the chat template escapes tool-call arguments or tool definitions, so a string "
                             "holding a special token's text cannot be kept plain text; remove it")
        plain = plain_text_encoder(tok)  # a private tokenizer copy: thread-safe plain-text encoding
        suffix_key, suffix = (f"\ue000{format_suffix[0]}\ue001", format_suffix[1]) if format_suffix else (None, "")
        ids: list[int] = []
        for piece in re.split("(\ue000j?\\d+\ue001)", text):
            if piece == suffix_key and contents[piece].endswith(suffix):
                body = contents[piece][:len(contents[piece]) - len(suffix)]
                ids += (plain(body) if body else []) + tok.encode(suffix, add_special_tokens=False)
            elif piece in contents:
                ids += plain(contents[piece])
            elif piece:
                ids += tok.encode(piece, add_special_tokens=False)
        return ids


def json_closings(text: str) -> Iterator[str]:
    """Complete JSON values made from a JSON value cut short (``text`` starts with ``{`` or ``[``), keeping only
    values the text finished: each is the text up to just after an opening bracket or brace, before a ``,``, or
    just after a closed string value, array or object, or at the end after a number or literal (where the model
    asked to end, it did not mean to write more digits), followed by the ``]``, ``}`` it lacks. A string still
    being written at the end is never closed (``"San Fr"`` is no value the model wrote), nor is a key without its
    value. Longest first, lazily; each parses with ``json.loads``."""
    stack: list[str] = []  # open containers: "{" or "["
    expect_key: list[bool] = []  # per open object: a key comes next (after "{" or ",")
    points: list[tuple[int, str]] = []  # (cut offset, closers)
    in_str = esc = is_key = False

    def closers() -> str:
        return "".join("}" if c == "{" else "]" for c in reversed(stack))

    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if not is_key:
                    points.append((i + 1, closers()))
            continue
        if ch == '"':
            in_str, is_key = True, bool(stack) and stack[-1] == "{" and expect_key[-1]
        elif ch in "{[":
            stack.append(ch)
            expect_key.append(ch == "{")
            points.append((i + 1, closers()))
        elif ch in "}]":
            if not stack:
                break
            stack.pop()
            expect_key.pop()
            points.append((i + 1, closers()))
            if not stack:
                break
        elif ch == ",":
            points.append((i, closers()))
            if stack and stack[-1] == "{":
                expect_key[-1] = True
        elif ch == ":":
            if stack and stack[-1] == "{":
                expect_key[-1] = False
    if not in_str:  # a number or literal at the end, after which the model asked to end: whole, if it parses
        points.append((len(text.rstrip()), closers()))
    seen = set()
    for i, c in reversed(points):
        candidate = text[:i] + c
        if candidate in seen:
            continue
        seen.add(candidate)
        try:
            json.loads(candidate)
        except ValueError:
            continue
        yield candidate


def answer_text_regex(excluded: tuple[str, ...] | list[str], forbids: str = "") -> str:
    """A regex (llguidance's Lark dialect, no delimiters) of a non-empty text answer: its first character is not
    whitespace, it starts with none of ``excluded`` (a text that is a proper prefix of one, e.g. a lone
    ``"`"`` for ``"```json"``, is allowed) and holds none of the characters ``forbids``. Built from the prefixes'
    trie, since the dialect has no lookahead."""
    def esc(c: str) -> str:
        return "\\" + c if c in "\\]^-[/" else ("\\n" if c == "\n" else c)

    banned = "".join(esc(c) for c in sorted(set(forbids)))
    tail = f"[^{banned}]*" if banned else "(.|\\n)*"

    def node(prefixes: list[str], top: bool) -> str:
        firsts = sorted({p[0] for p in prefixes})
        alts = ["[^" + "".join(esc(c) for c in firsts) + banned + ("\\s" if top else "") + "]" + tail]
        for c in firsts:
            rest = [p[1:] for p in prefixes if p[0] == c]
            if "" not in rest and c not in forbids:  # c opens no whole prefix yet: what may follow it
                alts.append(f"{esc(c)}({node(rest, False)})?")
        return "|".join(alts) if len(alts) > 1 else alts[0]

    prefixes = [p for p in excluded if p]
    return node(prefixes, True) if prefixes else f"[^{banned}\\s]" + tail


def single_added_token(tokenizer, text: str) -> int | None:
    """The id of ``text`` when the vocabulary has it as one added token, else None."""
    tid = tokenizer.get_added_vocab().get(text)
    return int(tid) if tid is not None else None


def openai_tools(tools: list[Tool]) -> list[dict]:
    """``[{"type": "function", "function": {name, description, parameters}}]`` for a chat template's ``tools=``."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


def call_arguments(tool_call: dict) -> tuple[str, dict]:
    """(name, arguments dict) of an OpenAI-style ``tool_calls`` entry (arguments may be a JSON string)."""
    fn = tool_call.get("function", tool_call)
    args = fn.get("arguments", {})
    return fn["name"], (json.loads(args) if isinstance(args, str) else args)


def template_chat(messages: list[dict], *, one_call_per_turn: bool = False) -> list[dict]:
    """OpenAI-style messages -> messages for a chat template that takes ``tools=``: assistant calls with their
    arguments as dicts (the template writes them with ``tojson``), tool results as text in the ``tool`` role.

    ``one_call_per_turn``: an assistant turn with several calls becomes one turn per call (Llama 3's template
    renders exactly one).
    """
    chat = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"type": "function", "function": dict(zip(("name", "arguments"), call_arguments(tc)))}
                     for tc in m["tool_calls"]]
            groups = [[c] for c in calls] if one_call_per_turn else [calls]
            for i, group in enumerate(groups):
                chat.append({"role": "assistant", "content": (m.get("content") or "") if i == 0 else "",
                             "tool_calls": group})
        elif m["role"] == "tool":
            chat.append({"role": "tool", "content": content_text(m), "name": m.get("name"),
                         "tool_call_id": m.get("tool_call_id")})
        else:
            chat.append({"role": m["role"], "content": content_text(m)})
    return chat


def content_text(message: dict) -> str:
    """A message's content as text (non-string tool results as JSON)."""
    c = message.get("content")
    if c is None:
        return ""
    return c if isinstance(c, str) else json.dumps(c, ensure_ascii=False)
