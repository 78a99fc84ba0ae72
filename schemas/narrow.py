"""Narrowing a JSON Schema for the grammar: a copy whose language is a subset of the original's, so every output
the grammar allows still validates against the original schema (validation always uses the original): closed
objects, bounded scalars and arrays, calendar-valid dates, date/time formats stated in descriptions, integers that
start with none of a set of digit prefixes.

These are pure JSON Schema → JSON Schema transformations, so they live in ``schemas/`` (no grammar engine needed).
The grammar may enforce a *subset* of what a schema allows, but it must never turn a satisfiable schema into an
unsatisfiable one: whatever registration accepted must decode. The rules here are built so; with the engine's
``compiles`` check, :func:`narrow_for_grammar` also keeps the original when a narrowing step would not compile.
``schemas.call_schema`` applies :func:`narrow_for_grammar` per tool; the grammar engine applies
:func:`calendar_dates` to every JSON Schema it compiles.
"""
from __future__ import annotations

import copy
import decimal
import functools
import math
import re
from typing import Any, Callable

from .check import resolve_local_ref, walk

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_COMBINATORS = ("allOf", "anyOf", "oneOf")
# Keywords after which a subschema no longer describes a value on its own (conditionals, negation, …).
_PARTIAL = ("not", "if", "then", "else", "contains", "propertyNames", "dependentSchemas", "dependencies",
            "unevaluatedProperties", "unevaluatedItems")
_ANNOTATIONS = {"$ref", "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                "writeOnly", "$id", "$anchor", "$schema"}


# Narrowing a subschema under these keywords would not narrow the whole: ``not`` and ``if`` turn a narrower
# subschema into a wider language, and a narrower ``oneOf`` branch can let through a value that two branches held.
_NOT_NARROWABLE = frozenset({"not", "if", "oneOf"})


def narrowable_nodes(schema: Any) -> list[dict]:
    """The schema objects of ``schema`` (pre-order) whose narrowing narrows the whole schema: every node that is
    not under ``not``, ``if`` or ``oneOf``."""
    return [node for _, node in walk(schema, skip=_NOT_NARROWABLE)]


# -- closing objects -------------------------------------------------------------------------------------------------
def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where each object that declares properties but says nothing of other keys takes only
    the keys it declares (``additionalProperties: false``).

    The declared keys of an object are its own ``properties`` and ``required`` plus those of everything that
    applies to the same value: ``allOf`` / ``anyOf`` / ``oneOf`` branches and ``$ref`` targets (recursively). The
    node that holds the combinators is closed, with the keys its branches declare added to its ``properties`` as
    ``{}``; branches and ``$defs`` targets shared with other schemas are never closed themselves (closing a branch
    would forbid the keys its siblings declare: ``allOf: [{city}, {days}]`` would admit no value). A ``$defs``
    target is closed only when every reference to it is a bare ``{"$ref": …}`` standing for a whole value. Nothing
    is closed where anything involved leaves keys open (``additionalProperties``, ``patternProperties``,
    ``unevaluatedProperties``) or is conditional (``if``, ``not``, ``dependentSchemas``…).

    Used for the grammar only: the language is a subset (no undeclared keys), so a small model cannot wander into
    invented keys; validation uses the original schema.
    """
    schema = copy.deepcopy(schema)
    if not isinstance(schema, dict):
        return schema
    whole, shared = _value_nodes(schema)
    for node in whole:
        if id(node) in shared or any(k in node for k in _OPEN_KEYS) or _is_bare_ref(node):
            continue
        keys = _declared_keys(schema, node, set())
        if keys is None or not _declares_properties(schema, node, set()):
            continue
        props = node.setdefault("properties", {})
        for k in keys:
            props.setdefault(k, {})
        node["additionalProperties"] = False
    return schema


def _is_bare_ref(node: dict) -> bool:
    return "$ref" in node and set(node) <= _ANNOTATIONS


def _value_nodes(root: dict) -> tuple[list[dict], set[int]]:
    """(nodes that describe a whole value, ids of nodes that describe one only together with other schemas)."""
    whole: dict[int, dict] = {}
    shared: set[int] = set()
    seen: set[tuple[int, bool]] = set()

    def visit(node: Any, complete: bool) -> None:
        if not isinstance(node, dict) or (id(node), complete) in seen:
            return
        seen.add((id(node), complete))
        if complete:
            whole[id(node)] = node
        else:
            shared.add(id(node))
        combined = any(k in node for k in _COMBINATORS) or ("$ref" in node and not _is_bare_ref(node))
        child = complete and not combined
        props_child = child and not node.get("patternProperties")
        for sub in (node.get("properties") or {}).values() if isinstance(node.get("properties"), dict) else ():
            visit(sub, props_child)
        for key in ("additionalProperties", "items", "additionalItems"):
            value = node.get(key)
            for sub in value if isinstance(value, list) else [value]:
                visit(sub, child)
        for sub in node.get("prefixItems") or [] if isinstance(node.get("prefixItems"), list) else []:
            visit(sub, child)
        pattern_props = node.get("patternProperties")
        for sub in pattern_props.values() if isinstance(pattern_props, dict) else ():
            visit(sub, False)
        for key in _COMBINATORS:
            for sub in node.get(key) or [] if isinstance(node.get(key), list) else []:
                visit(sub, False)
        for key in _PARTIAL:
            value = node.get(key)
            if isinstance(value, dict) and key in ("dependentSchemas", "dependencies"):
                for sub in value.values():
                    visit(sub, False)
            elif isinstance(value, (dict, list)):
                for sub in value if isinstance(value, list) else [value]:
                    visit(sub, False)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = resolve_local_ref(root, ref)
            visit(target, complete and _is_bare_ref(node))

    visit(root, True)
    return list(whole.values()), shared


def _declared_keys(root: dict, node: Any, seen: set[int]) -> list[str] | None:
    """Keys declared for the value ``node`` describes (own, branches', ``$ref`` targets'); None when open."""
    if node is False:
        return []
    if not isinstance(node, dict):
        return None  # ``true`` (or junk) admits any key
    if id(node) in seen:
        return []
    seen = seen | {id(node)}
    if node is not None and any(k in node for k in _PARTIAL):
        return None
    if node.get("additionalProperties", False) is not False or node.get("patternProperties") \
            or "unevaluatedProperties" in node:
        return None
    keys = list(node.get("properties") or {}) if isinstance(node.get("properties"), dict) else []
    keys += [k for k in node.get("required") or [] if isinstance(k, str)]
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = resolve_local_ref(root, ref) if ref.startswith("#") else None
        if not isinstance(target, (dict, bool)):
            return None
        sub = _declared_keys(root, target, seen)
        if sub is None:
            return None
        keys += sub
    for key in _COMBINATORS:
        for branch in node.get(key) or []:
            sub = _declared_keys(root, branch, seen)
            if sub is None:
                return None
            keys += sub
    return list(dict.fromkeys(keys))


def _declares_properties(root: dict, node: Any, seen: set[int]) -> bool:
    if not isinstance(node, dict) or id(node) in seen:
        return False
    seen = seen | {id(node)}
    if "properties" in node:
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and _declares_properties(root, resolve_local_ref(root, ref), seen):
        return True
    return any(_declares_properties(root, b, seen) for k in _COMBINATORS for b in node.get(k) or [])


# -- bounding scalars --------------------------------------------------------------------------------------------
NUMBER_BOUND = 10 ** 15


def bound_scalars(schema: Any, max_string_length: int | None = None, max_decimals: int | None = None) -> Any:
    """A copy of ``schema`` whose unbounded scalars are bounded (for the grammar only; outputs stay valid).

    Strings with no ``maxLength``/``enum``/``const``/``pattern``/``format`` get ``maxLength: max_string_length``
    (or their ``minLength`` when that is larger), and so does a string whose ``pattern`` is the place format its
    description states (:func:`stated_formats`: its items are otherwise unbounded, and a model that never wrote the
    comma ran on to the token budget; a date format is bounded already); a pattern of the schema's own stays the
    schema's bound. With ``max_decimals``, numbers with no ``multipleOf`` get
    ``multipleOf: 10**-max_decimals`` (at most that many decimals, no exponent) unless their range holds no such
    multiple, and numbers and integers without bounds get ``|x| <= 1e15``, widened to reach a bound the schema sets
    (``minimum: 1e16`` gives ``maximum: 1e16``). A small model can then not run away inside a value (seen on
    SmolLM2-135M: ``"3.0000…"`` until the token budget ran out), and a satisfiable schema stays satisfiable.
    """
    schema = copy.deepcopy(schema)
    for node in narrowable_nodes(schema):
        t = node.get("type")
        place = _stated_place_items(node)  # the items of a place format its description states, else 0
        if t == "string" and max_string_length is not None and not any(
                k in node for k in ("maxLength", "enum", "const", "format", *(() if place else ("pattern",)))):
            min_length = node.get("minLength")
            floor = int(min_length) if isinstance(min_length, (int, float)) and not isinstance(min_length, bool) else 0
            node["maxLength"] = max(max_string_length, floor, 3 * place - 2)  # "a, b": the shortest of two items
        if t in ("number", "integer") and max_decimals is not None and not any(k in node for k in ("enum", "const")):
            lo, hi = _bound(node, "minimum", "exclusiveMinimum"), _bound(node, "maximum", "exclusiveMaximum")
            if t == "number" and "multipleOf" not in node and _has_multiple(lo, hi, max_decimals):
                node["multipleOf"] = 10.0 ** -max_decimals
            if hi is None:
                node["maximum"] = max(NUMBER_BOUND, _ceil(lo[0]) + 1 if lo else NUMBER_BOUND)
            if lo is None:
                node["minimum"] = min(-NUMBER_BOUND, _floor(hi[0]) - 1 if hi else -NUMBER_BOUND)
    return schema


def _bound(node: dict, inclusive: str, exclusive: str) -> tuple[decimal.Decimal, bool] | None:
    """(value, exclusive?) of a lower or upper bound (draft-04 boolean ``exclusiveMinimum`` included)."""
    value = node.get(inclusive)
    ex = node.get(exclusive)
    if isinstance(ex, bool):  # draft 04: exclusiveMinimum: true modifies minimum
        return None if not _is_num(value) else (decimal.Decimal(repr(value)), ex)
    if _is_num(ex):
        if _is_num(value):
            a, b = decimal.Decimal(repr(value)), decimal.Decimal(repr(ex))
            lower = inclusive == "minimum"
            return (b, True) if (b >= a if lower else b <= a) else (a, False)
        return decimal.Decimal(repr(ex)), True
    return (decimal.Decimal(repr(value)), False) if _is_num(value) else None


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _ceil(d: decimal.Decimal) -> int:
    return int(d.to_integral_value(rounding=decimal.ROUND_CEILING))


def _floor(d: decimal.Decimal) -> int:
    return int(d.to_integral_value(rounding=decimal.ROUND_FLOOR))


def _has_multiple(lo, hi, decimals: int) -> bool:
    """Whether the range ``lo … hi`` holds a multiple of ``10**-decimals`` (always, when a side is open)."""
    if lo is None or hi is None:
        return True
    with decimal.localcontext() as ctx:
        ctx.prec = 1000
        scale = decimal.Decimal(10) ** decimals
        first = _ceil(lo[0] * scale) + (1 if lo[1] and lo[0] * scale == _ceil(lo[0] * scale) else 0)
        last = _floor(hi[0] * scale) - (1 if hi[1] and hi[0] * scale == _floor(hi[0] * scale) else 0)
    return first <= last


# -- calendar dates ------------------------------------------------------------------------------------------------
_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999 (RFC 3339 has no year 0)
_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
# leap years: divisible by 4 but not by 100, or by 400 (0000 excluded)
_LEAP_DAY = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)-02-29"
DATE_REGEX = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_DAY})"
"""A regular expression for RFC 3339 ``full-date`` that admits only real calendar dates (leap years included)."""

# llguidance's own ``date`` / ``date-time`` formats check the shape and the day range 01-31 only (2023-02-29
# passes); the pattern added next to the format makes the grammar take only real dates.
_CALENDAR_PATTERNS = {"date": f"^{DATE_REGEX}$", "date-time": f"^{DATE_REGEX}[Tt]"}


def calendar_dates(schema: Any) -> Any:
    """``schema`` with each ``format: date`` / ``date-time`` also constrained to real calendar dates (a pattern
    next to the format, or inside an ``allOf`` when the node has its own ``pattern``). Returned as is when the
    schema has no such format."""
    return _with_format_patterns(schema, _CALENDAR_PATTERNS)


# RFC 3339 lets a time's fraction of a second run on (``12:00:00.0000000…``): a small model copying a time can write
# zeros until the token budget cuts the call (seen on Qwen2.5-Coder-0.5B for "20:00"). The grammar admits at most
# nanoseconds; every output stays a valid time.
FRACTION_DIGITS = 9
_FRACTION_PATTERN = f"^[^.]*(?:\\.[0-9]{{1,{FRACTION_DIGITS}}}(?:[^0-9][^.]*)?)?$"


def bounded_fractions(schema: Any) -> Any:
    """``schema`` with each ``format: time`` / ``date-time`` also constrained to at most :data:`FRACTION_DIGITS`
    digits of a second's fraction (a pattern next to the format, or inside an ``allOf`` when the node has its own
    ``pattern``). Returned as is when the schema has no such format."""
    return _with_format_patterns(schema, {"time": _FRACTION_PATTERN, "date-time": _FRACTION_PATTERN})


def _with_format_patterns(schema: Any, patterns: dict[str, str]) -> Any:
    """A copy of ``schema`` where each node whose ``format`` is a key of ``patterns`` is also constrained by that
    pattern: as its ``pattern``, or inside an ``allOf`` where it has its own; ``schema`` itself where none is."""
    if not any(node.get("format") in patterns for _, node in walk(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        pattern = patterns.get(node.get("format"))
        if pattern is None:
            continue
        if "pattern" not in node:
            node["pattern"] = pattern
        else:
            node["allOf"] = list(node.get("allOf") or []) + [{"pattern": pattern}]
    return schema


# -- formats stated in descriptions ---------------------------------------------------------------------------------
# "in the format 'YYYY-MM-DD'", "formatted as 'MM/DD/YYYY'", "in ISO 8601 format 'YYYY-MM-DDTHH:MM:SS'"
_STATED = re.compile(r"""(?:\b(?:in|with)\s+(?:the\s+)?(?:[\w-]+\s+){0,3}?format(?:\s+of)?|\bformatted\s+as)\s*:?\s*"""
                     r"""(['"`])([^'"`]+)\1|\b(?:in|as)\s+(['"`])([^'"`]+)\3\s+format""", re.IGNORECASE)
_PLACEHOLDER = re.compile(r"YYYY|YY|MM|DD|HH|SS|\s+to\s+|[-/:. T,]", re.IGNORECASE)
_PLACEHOLDER_REGEX = {"yyyy": "[0-9]{4}", "yy": "[0-9]{2}", "mm": "(?:0[1-9]|1[0-2])",
                      "dd": "(?:0[1-9]|[12][0-9]|3[01])", "hh": "(?:[01][0-9]|2[0-3])", "ss": "[0-5][0-9]"}


def stated_format_pattern(description: str) -> str | None:
    """The ``pattern`` of a date/time format (or, where none is stated, a place format: :func:`_place_pattern`) a
    description states, or None.

    Rule (general, never per tool): the description says ``in the format 'F'`` / ``format of 'F'`` / ``formatted
    as 'F'`` / ``in 'F' format`` (any quotes) and ``F`` is made only of the placeholders ``YYYY YY MM DD HH SS`` (any case; ``MM`` after
    ``HH:`` is minutes), separators ``- / : . , T`` and spaces, and `` to `` (a range), with at least two
    placeholders; e.g. ``'MM/DD/YYYY'`` → ``^(?:0[1-9]|1[0-2])/(?:0[1-9]|[12][0-9]|3[01])/[0-9]{4}$``. Exactly one
    such format must be stated (two different ones, ``… or 'today'``, or "not" right before the format give None);
    a description that merely shows a format as an example (``such as 'MM/DD/YYYY'``, e.g. for a parameter whose
    value *is* a format) is not matched.
    """
    stated = list(_STATED.finditer(description or ""))
    if any(_NOT_STATED.search(description, 0, m.start()) for m in stated):
        return None  # "not in the format …"
    formats = list({f for m in stated if _placeholders(f := m.group(2) or m.group(4)) is not None})
    if formats:
        if len(formats) != 1 or re.search(r"\bor\s+['\"`]", description):
            return None
        return _placeholders(formats[0])
    return _place_pattern(description or "", stated)


# "in the format of 'City, State'", "'City, State' or 'City, Country'": names of places, one comma between each
_PLACE = r"(?:city|town|state|province|region|county|country)"
_PLACE_FORMAT = re.compile(rf"{_PLACE}(?:, {_PLACE})+", re.IGNORECASE)
_PLACE_ITEM = r"[^,\s](?:[^,\n]*[^,\s])?"  # no comma or line break, no space at either end
# the description allows a lone place too: "just the city name outside the US", "or just 'City'", "only a country"
_LONE_PLACE = re.compile(rf"""\b(?:just|only)\s+(?:the\s+|a\s+|an\s+)?(?:['"`])?{_PLACE}\b|['"`]{_PLACE}['"`]""",
                         re.IGNORECASE)
_NOT_STATED = re.compile(r"\b(?:not|never|no longer)\s+(?:\w+\s+){0,2}$", re.IGNORECASE)
_OR_ALTERNATIVE = re.compile(r"""\s*,?\s*or\s+(['"`])([^'"`]+)\1""", re.IGNORECASE)


def _place_pattern(description: str, stated: list[re.Match]) -> str | None:
    """The ``pattern`` of a place format a description states — ``'City, State'``, ``'City, Country'``,
    ``'City, State, Country'`` (the words city, town, state, province, region, county and country, any case, a comma
    and a space between each) — as its items: text without commas or spaces at either end, ``", "`` between them
    (``^I, I$`` for two, ``I`` = ``[^,\\s](?:[^,\\n]*[^,\\s])?``). The formats stated (``in the format of``,
    ``formatted as``, as for dates) and the alternatives written right after one (``'City, State' or 'City,
    Country'``) must all have the same number of items; an alternative of another kind (``or 'a ZIP code'``) gives
    None, as does a description that also allows a lone place ("just the city name outside the US", "or just
    'City'"). ``stated``: the description's matches of the stated-format phrases (:func:`stated_format_pattern`
    has found them, and none said with "not" before it). Examples elsewhere in the text (``such as 'Berkeley, CA'
    or 'New York, NY'``) are not read."""
    if _LONE_PLACE.search(description):
        return None
    counts = set()
    for m in stated:
        formats = [m.group(2) or m.group(4)]
        if alt := _OR_ALTERNATIVE.match(description, m.end()):
            formats.append(alt.group(2))
        for f in formats:
            if not _PLACE_FORMAT.fullmatch(f.strip()):
                return None
            counts.add(f.count(",") + 1)
    if len(counts) != 1:
        return None
    return "^" + ", ".join([_PLACE_ITEM] * counts.pop()) + "$"


def _placeholders(text: str) -> str | None:
    parts, pos, count, previous = [], 0, 0, ""
    for m in _PLACEHOLDER.finditer(text):
        if m.start() != pos:
            return None
        piece = m.group(0)
        key = piece.lower()
        if key in _PLACEHOLDER_REGEX:
            count += 1
            minutes = key == "mm" and previous.lower().endswith("hh:")
            parts.append("[0-5][0-9]" if minutes else _PLACEHOLDER_REGEX[key])
        elif piece.strip().lower() == "to":
            parts.append(" to ")
        else:
            parts.append(piece.replace(".", r"\."))
        previous += piece
        pos = m.end()
    if pos != len(text) or count < 2:
        return None
    return "^" + "".join(parts) + "$"


def stated_formats(schema: Any) -> Any:
    """A copy of ``schema`` where each string that sets no ``pattern``/``format``/``enum``/``const`` and whose
    description states a date/time or place format (:func:`stated_format_pattern`) takes that format as its
    ``pattern`` (for the grammar only; a string ``default`` the pattern would refuse leaves the node alone). Returned as is
    when nothing applies."""
    if not any(_stated_applies(node) for node in narrowable_nodes(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for node in narrowable_nodes(schema):
        if _stated_applies(node):
            node["pattern"] = stated_format_pattern(node["description"])
    return schema


def _stated_place_items(node: dict) -> int:
    """How many items the place format a string's description states has, where its ``pattern`` is that format's
    (:func:`stated_formats`); else 0."""
    pattern = node.get("pattern")
    if not isinstance(pattern, str) or _PLACE_ITEM not in pattern or not isinstance(node.get("description"), str):
        return 0
    return pattern.count(_PLACE_ITEM) if pattern == stated_format_pattern(node["description"]) else 0


def _stated_applies(node: Any) -> bool:
    if not isinstance(node, dict) or node.get("type") != "string" or not isinstance(node.get("description"), str) \
            or any(k in node for k in ("pattern", "format", "enum", "const")):
        return False
    pattern = stated_format_pattern(node["description"])
    default = node.get("default")
    return pattern is not None and (not isinstance(default, str) or re.fullmatch(pattern[1:-1], default) is not None)


# -- integers in JSON's interoperable range -------------------------------------------------------------------------
SAFE_INTEGER = 2 ** 53 - 1  # RFC 8259 §6: [-(2**53)+1, 2**53-1] is exact in every JSON implementation
INTEGER_GRAMMAR_BOUND = 9 * 10 ** 18  # measured: llguidance writes no regex for an integer bounded on one side only
#                                      from 10^18 on, but does for two-sided bounds within ±9.2 * 10^18


def bound_integers(schema: Any) -> Any:
    """A copy of ``schema`` where each integer without an upper (lower) bound takes ``maximum: 2**53 - 1``
    (``minimum: -(2**53 - 1)``), the range every JSON implementation holds exactly (RFC 8259 §6), for the grammar
    only, so a model cannot run away inside an integer's digits (seen on Qwen2.5-Coder-0.5B: ``150000…`` until the
    token budget ran out); every integer of up to 15 digits still decodes. An integer whose schema sets a bound
    past that range (``minimum: 2**60``) is meant to be large: its other bound is
    ``±`` :data:`INTEGER_GRAMMAR_BOUND` (9 * 10^18) instead, where its own bound lies inside that (llguidance writes
    no regex for a one-sided bound from 10^18 on; past ±9 * 10^18 the bound is left alone and compiling names it).
    An integer under ``not``, ``if`` or ``oneOf`` is left alone (:func:`narrowable_nodes`). Returned as is when
    nothing applies."""
    def applies(node: Any) -> bool:
        if not isinstance(node, dict) or node.get("type") != "integer" or any(k in node for k in ("enum", "const")):
            return False
        lo, hi = _bound(node, "minimum", "exclusiveMinimum"), _bound(node, "maximum", "exclusiveMaximum")
        past = (lo is not None and lo[0] >= INTEGER_GRAMMAR_BOUND) or \
            (hi is not None and hi[0] <= -INTEGER_GRAMMAR_BOUND)
        return (lo is None or hi is None) and not past

    if not any(applies(node) for node in narrowable_nodes(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for node in narrowable_nodes(schema):
        if applies(node):
            lo, hi = _bound(node, "minimum", "exclusiveMinimum"), _bound(node, "maximum", "exclusiveMaximum")
            large = (lo is not None and lo[0] >= SAFE_INTEGER - 1) or (hi is not None and hi[0] <= 1 - SAFE_INTEGER)
            bound = INTEGER_GRAMMAR_BOUND if large else SAFE_INTEGER
            if hi is None:
                node["maximum"] = bound
            if lo is None:
                node["minimum"] = -bound
    return schema


def _allowed_intervals(lo: int, hi: int, prefixes: frozenset[str]) -> list[tuple[int, int]]:
    """The intervals of ``lo … hi`` (inclusive integers) left once every non-negative integer whose decimal digits
    start with one of ``prefixes`` is taken out, in order, adjacent ones merged."""
    out: list[tuple[int, int]] = []

    def keep(a: int, b: int) -> None:
        a, b = max(a, lo), min(b, hi)
        if a > b:
            return
        if out and out[-1][1] + 1 >= a:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))

    keep(lo, -1)  # negative integers start with "-": no prefix applies
    width = max(len(str(max(hi, 0))), max((len(p) for p in prefixes), default=1))
    for length in range(1, width + 1):  # the integers of each digit count, less the blocks the prefixes start
        first, last = (0 if length == 1 else 10 ** (length - 1)), 10 ** length - 1
        if first > hi or last < max(lo, 0):
            continue
        x = first
        for p in sorted(p for p in prefixes if len(p) <= length):
            start = int(p) * 10 ** (length - len(p))
            if start > x:
                keep(x, start - 1)
            x = max(x, start + 10 ** (length - len(p)))
        if x <= last:
            keep(x, last)
    return out


def integers_without_prefixes(schema: Any, prefixes: frozenset[str] | set[str]) -> Any:
    """A copy of ``schema`` where each integer admits no non-negative value whose decimal digits start with one of
    ``prefixes`` (digit strings, such as ``"51"``), for the grammar only: an ``anyOf`` of the ``minimum``/``maximum``
    intervals left is added beside the integer's own keywords. Where a call ran the items of a list of numbers
    the conversation writes together (``510`` for "the factorial of 5,10 and 15", seen on Qwen2.5-Coder-0.5B, dev
    split: docs/benchmarks.md "Numbers written side by side"), the engine decodes the turn again with the
    prefixes of ``agent.grounding.run_together_prefixes`` ("5,10" → ``"51"``) taken out.

    Applies only to integers bounded on both sides (as :func:`bound_integers` leaves every integer) that carry no
    ``enum``, ``const``, ``multipleOf`` or combinator of their own, that are not under ``not``, ``if`` or ``oneOf``
    (:func:`narrowable_nodes`), and whose range holds a taken-out value and keeps another. Returned as is when
    nothing applies."""
    prefixes = frozenset(p for p in prefixes if p.isdigit() and not p.startswith("0"))
    if not prefixes:
        return schema

    def intervals(node: Any) -> list[tuple[int, int]] | None:
        if not isinstance(node, dict) or node.get("type") != "integer" or any(
                k in node for k in ("enum", "const", "multipleOf", *_COMBINATORS, "not")):
            return None
        lo, hi = _bound(node, "minimum", "exclusiveMinimum"), _bound(node, "maximum", "exclusiveMaximum")
        if lo is None or hi is None:
            return None
        a = _ceil(lo[0]) + (1 if lo[1] and lo[0] == _ceil(lo[0]) else 0)
        b = _floor(hi[0]) - (1 if hi[1] and hi[0] == _floor(hi[0]) else 0)
        if a > b:
            return None
        left = _allowed_intervals(a, b, prefixes)
        return left if left and left != [(a, b)] else None

    if not any(intervals(node) for node in narrowable_nodes(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for node in narrowable_nodes(schema):
        left = intervals(node)
        if left:
            node["anyOf"] = [{"minimum": a, "maximum": b} for a, b in left]
    return schema


def bound_arrays(schema: Any, max_items: int) -> Any:
    """A copy of ``schema`` where each array with no ``maxItems`` (and no ``enum``/``const``) takes
    ``maxItems: max_items`` for the grammar only, so a small model cannot run away inside a list (seen on
    Qwen2.5-Coder-0.5B: ``"start_board": [0, 0, 0, …]`` until the token budget ran out, the turn then cut and its
    calls lost). At the cap the grammar allows only the array's close, and the model goes on from there.

    A satisfiable schema stays satisfiable: the cap is never below the largest item count the schema asks for
    anywhere — ``minItems``, ``minContains``, a count of positional items (``prefixItems``, a draft-04 ``items``
    list) — since such a floor may reach an array from elsewhere (an ``allOf`` sibling, a ``$ref``, a
    ``dependentSchemas`` entry) and a lenient tool's grammar does not enforce all of them (so the engine's compile
    check would not see the conflict). Arrays under ``not``, ``if`` or ``oneOf`` are left alone
    (:func:`narrowable_nodes`). Returned as is when nothing applies.

    Raises:
        ValueError: ``max_items`` below 1.
    """
    if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
        raise ValueError(f"max_items must be an integer >= 1, got {max_items!r}")

    def applies(node: Any) -> bool:
        if not isinstance(node, dict) or "maxItems" in node or any(k in node for k in ("enum", "const")):
            return False
        t = node.get("type")
        return t == "array" or (isinstance(t, list) and "array" in t)

    if not any(applies(node) for node in narrowable_nodes(schema)):
        return schema
    floor = 0
    for _, node in walk(schema):
        for key in ("minItems", "minContains"):
            n = node.get(key)
            if isinstance(n, (int, float)) and not isinstance(n, bool) and n == n and n != float("inf"):
                floor = max(floor, math.ceil(n))
        for key in ("prefixItems", "items"):
            if isinstance(node.get(key), list):
                floor = max(floor, len(node[key]))
    cap = max(max_items, floor)
    schema = copy.deepcopy(schema)
    for node in narrowable_nodes(schema):
        if applies(node):
            node["maxItems"] = cap
    return schema


# -- the grammar's schema ------------------------------------------------------------------------------------------
def narrow_for_grammar(schema: Any, *, lenient: bool = False, max_string_length: int | None = None,
                       max_decimals: int | None = None, max_items: int | None = None,
                       excluded_integer_prefixes: frozenset[str] = frozenset(),
                       compiles: Callable[[Any, bool], bool] | None = None) -> Any:
    """The schema the grammar enforces for ``schema``: integers kept to JSON's exact range (:func:`bound_integers`)
    and, when asked, to no excluded prefix (:func:`integers_without_prefixes`), closed objects, date/time and place
    formats its descriptions state (:func:`stated_formats`), then bounded scalars and arrays (when asked:
    :func:`bound_scalars`, :func:`bound_arrays`); each narrows only nodes whose narrowing narrows the whole
    (:func:`narrowable_nodes`).

    Args:
        excluded_integer_prefixes: digit strings no non-negative integer may start with
            (:func:`integers_without_prefixes`, right after :func:`bound_integers`); empty: none.
        compiles: ``compiles(schema, lenient) -> bool`` from the grammar engine (``constraints.schema_compiles``).
            Each narrowing step is then kept only when its result compiles (llguidance finds an unsatisfiable
            schema at compile time), so a schema that registered always decodes: a step that would not compile is
            dropped, never the tool. None: the steps are kept as built (they are satisfiable by construction).
    """
    out = schema
    # integers first: a large one-sided integer bound compiles only once bound_integers gives it its other bound
    # (a step is kept only where its result compiles), so the steps after it can narrow that schema too
    steps = [bound_integers, close_objects, stated_formats]
    if excluded_integer_prefixes:
        steps.insert(1, functools.partial(integers_without_prefixes, prefixes=excluded_integer_prefixes))
    if max_string_length is not None or max_decimals is not None:
        steps.append(functools.partial(bound_scalars, max_string_length=max_string_length, max_decimals=max_decimals))
    if max_items is not None:
        steps.append(functools.partial(bound_arrays, max_items=max_items))
    for step in steps:
        narrowed = step(out)
        if narrowed != out and (compiles is None or compiles(narrowed, lenient)):
            out = narrowed
    return out
