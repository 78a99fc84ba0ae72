"""Grammars: JSON Schema, Lark and regex compiled to llguidance grammars, cached by a hash of the canonical source.

The tool-turn grammar (a tool call in the model's format *or* free text) is built in ``agent/``; this module only
compiles sources and checks them.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import llguidance

from .json_schema import compile_json_schema, compile_options, engine_schema
from schemas.errors import SchemaError, SpecAgentError


class GrammarError(SpecAgentError, ValueError):
    """A Lark or regex grammar does not compile (the message is llguidance's)."""


@dataclass(frozen=True)
class Grammar:
    """A compiled llguidance grammar.

    Attributes:
        text: llguidance's serialised grammar (pass to ``LLMatcher``).
        kind: ``"json_schema"``, ``"lark"`` or ``"regex"``.
        key: sha256 of the canonical source (cache key).
    """

    text: str
    kind: str
    key: str


def _canonical(obj: Any) -> str:
    # Key order is kept, not sorted: llguidance emits properties in schema order, so two schemas that differ only
    # in the order of their keys are different grammars.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def json_schema_grammar(schema: Any, *, lenient: bool = False) -> Grammar:
    """Compile a JSON Schema (compact separators, no free whitespace). Raises :class:`SchemaError`."""
    return _json_cached(_canonical(schema), lenient)


@functools.lru_cache(maxsize=256)
def _json_cached(canonical: str, lenient: bool) -> Grammar:
    text = compile_json_schema(json.loads(canonical), lenient=lenient)
    return Grammar(text, "json_schema", hashlib.sha256((str(lenient) + canonical).encode()).hexdigest())


@functools.lru_cache(maxsize=256)
def lark_grammar(lark: str) -> Grammar:
    """Compile a Lark grammar (llguidance dialect: ``%json {...}`` embeds a JSON Schema). Raises GrammarError."""
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), "lark", lark, "Lark grammar")


@functools.lru_cache(maxsize=256)
def regex_grammar(regex: str) -> Grammar:
    """Compile a regular expression (no look-around). Raises GrammarError."""
    return _checked(llguidance.LLMatcher.grammar_from_regex(regex), "regex", regex, "regex")


def _checked(text: str, kind: str, source: str, what: str) -> Grammar:
    """The :class:`Grammar` of llguidance's ``text`` compiled from ``source``, or GrammarError naming ``what``."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise GrammarError(f"{what} does not compile: {messages[0]}")
    return Grammar(text, kind, hashlib.sha256(source.encode()).hexdigest())


def lark_json(schema: Any, *, separators: tuple[str, str] = (",", ":"), lenient: bool = False) -> str:
    """The Lark fragment ``%json {...}`` embedding a JSON Schema in a Lark rule.

    Args:
        separators: ``(item, key)`` separators, fixed (no free whitespace): compact ``(",", ":")`` by default;
            ``(", ", ": ")`` is what ``json.dumps`` writes and what most chat models saw in training.
        lenient: relax keywords the grammar cannot enforce (the caller validates outputs).

    ``format: date`` / ``date-time`` admit only real calendar dates (:func:`schemas.narrow.calendar_dates`);
    integer bounds past 2^53 are kept inside (:func:`constraints.json_schema.exact_bounds`).
    """
    if not isinstance(schema, dict):
        schema = {} if schema is True else {"not": {}}
    schema = engine_schema(schema)
    return "%json " + json.dumps({**schema, "x-guidance": compile_options(separators, lenient=lenient)},
                                 ensure_ascii=False)


__all__ = ["Grammar", "GrammarError", "SchemaError", "json_schema_grammar", "lark_grammar", "lark_json",
           "regex_grammar"]
