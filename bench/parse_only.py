"""The same model under a parse-only runtime: ``python -m agent bfcl ... --runtime parse-only``.

What vLLM does with ``tool_choice="auto"`` and its ``hermes`` tool parser: the prompt is the chat template with
``tools=`` (here the model's own format render, ``agent.formats`` ``ToolFormat.render``: the same prompt our runtime
decodes from), the model writes freely (greedy, same backend and :class:`decoding.Generator`, no grammar on the
calls), and the calls are parsed out of the text afterwards:

* ``hermes`` models (Qwen2.5, Qwen3, Hermes): vLLM's ``Hermes2ProToolParser.extract_tool_calls`` —
  ``<tool_call>(.*?)</tool_call>|<tool_call>(.*)`` (``re.DOTALL``), ``json.loads`` of each block, ``name`` and
  ``arguments`` read; no ``<tool_call>`` in the text: a text answer; a block that does not load or lacks a key:
  invalid (vLLM hands the whole text back as content: no call);
* any other format (SmolLM2 -> ``generic``; vLLM has no parser for it): that format's own ``parse``
  (``parser`` in the summary says which).

"Free" is a grammar that admits any text and the vocabulary's added tokens that are not special (Qwen's
``<tool_call>`` is one token), up to EOS: the same decoder, no constraint on what the model writes (special tokens
such as ``<|endoftext|>`` stay out, as vLLM stops at or strips them). The runtime lives here, in ``bench/``: the
product never decodes without a grammar.
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

from constraints import lark_grammar
from schemas import ToolRegistry

HERMES_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
RUNTIMES = ("ours", "parse-only")


class HermesToolParser:
    """vLLM's hermes tool parser (``tool_choice="auto"``), with the ``is_call``/``parse`` interface
    ``BfclTurn.judge`` reads."""

    name = "hermes (vLLM Hermes2ProToolParser)"

    def is_call(self, text: str) -> bool:
        return "<tool_call>" in text

    def parse(self, text: str) -> tuple[list[dict] | None, str]:
        """``(calls, content)``; ``(None, text)`` without a ``<tool_call>``; ValueError for a block that is not a
        JSON call object (vLLM: ``tools_called=False``, the text returned as content)."""
        if not self.is_call(text):
            return None, text
        calls = []
        for closed, open_ in HERMES_TOOL_CALL.findall(text):
            obj = json.loads(closed or open_)  # json.JSONDecodeError is a ValueError
            if not isinstance(obj, dict) or "name" not in obj or "arguments" not in obj:
                raise ValueError(f"not a tool call object: {(closed or open_)[:80]!r}")
            args = obj["arguments"]
            if isinstance(args, str):  # vLLM json.dumps the arguments; a client loads them back
                args = json.loads(args)
            calls.append({"name": obj["name"], "arguments": args})
        return calls, text[:text.find("<tool_call>")]


class FormatParser:
    """A non-hermes format's own parser (``ToolFormat.is_call`` / ``parse``) on free text."""

    def __init__(self, fmt):
        self.fmt = fmt
        self.name = f"{fmt.name} (the format's own parser; vLLM has none for it)"

    def is_call(self, text: str) -> bool:
        return self.fmt.is_call(text)

    def parse(self, text: str) -> tuple[list[dict] | None, str]:
        return self.fmt.parse(text)


def parser_for(fmt):
    """vLLM's hermes parser for a ``hermes`` format, else the format's own."""
    return HermesToolParser() if fmt.name == "hermes" else FormatParser(fmt)


def free_grammar(tokenizer):
    """Any text, and any added token that is not special (``<tool_call>``), up to EOS."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = sorted(i for i in tokenizer.get_added_vocab().values() if i not in special)
    alts = " | ".join(["TEXT"] + [f"<[{i}]>" for i in ids])
    return lark_grammar(f"start: ({alts})*\nTEXT: /(?s:.+)/\n")


class ParseOnlyAgent:
    """Duck-types what ``bench.bfcl.run_bfcl`` uses of an ``Agent`` (``run``, ``registry``, ``format``), decoding
    free text with the engine's Generator and parsing it afterwards.

    Args:
        engine: a ``LocalEngine`` (its format renders the prompt; its Generator decodes).
        tools: the question's tools (registered leniently, as the bfcl CLI's Agent does: validity is judged the same).
        config: an ``EngineConfig`` (drafter, γ, sampling); the grammar caps do not apply (there is no grammar).
    """

    def __init__(self, engine, tools, config, grammar=None):
        self.engine = engine
        self.tools = list(tools)
        self.config = config
        self.registry = ToolRegistry(self.tools, strict=False)
        self.format = parser_for(engine.format)
        self.grammar = grammar if grammar is not None else free_grammar(engine.generator.tokenizer)

    def run(self, messages, *, tool_choice="auto", max_steps=1, parallel_tool_calls=None, drafter=None,
            max_new_tokens=None):
        """One free turn (``tool_choice``/``parallel_tool_calls`` are not enforced: vLLM's ``auto``)."""
        ids = self.engine.format.render(messages, self.tools)
        c = self.config
        out = self.engine.generator.generate(ids, self.grammar, max_new_tokens=max_new_tokens or c.max_new_tokens,
                                             sampling=c.sampling, drafter=drafter or c.drafter,
                                             num_draft_tokens=c.num_draft_tokens, adaptive=c.adaptive)
        return SimpleNamespace(raw_turns=[out.text], truncated=out.stop_reason == "length", stats=out.stats)


def parse_only_factory(engine, config):
    """``tools -> ParseOnlyAgent`` for ``run_bfcl`` (the free grammar built once)."""
    grammar = free_grammar(engine.generator.tokenizer)
    return lambda tools: ParseOnlyAgent(engine, tools, config, grammar)
