"""JSON Schema → llguidance grammar: the compile options table, compilation, the strict enforceability check and the
translation of llguidance's error strings into :class:`schemas.SchemaError` (keyword + JSON pointer + advice).

This is the only place that compiles a JSON Schema; ``schemas`` knows JSON Schema only and gets
:func:`check_enforceable` injected for strict registration (installed by ``constraints/__init__.py``).
"""
from __future__ import annotations

import collections
import copy
import functools
import json
import math
import re
from typing import Any

import llguidance

from schemas.check import find_keyword, walk
from schemas.narrow import bound_integers, bounded_fractions, calendar_dates, narrowable_nodes
from schemas.errors import RELAX_RESPONSE_FORMAT, RELAX_TOOL, RESPONSE_FORMAT, SchemaError, json_pointer

# What strict mode tells the user to do, per keyword.
_REWRITE = "remove the keyword, rewrite it with enforceable keywords (enum, const, anyOf, pattern, minimum…)"


def _relax(tool: str | None) -> str:
    how = RELAX_RESPONSE_FORMAT if tool == RESPONSE_FORMAT else RELAX_TOOL
    return f"{how} to relax it in the grammar and validate every output afterwards"


def _advice(tool: str | None) -> str:
    return f"{_REWRITE}, or {_relax(tool)}"



def compile_options(separators: tuple[str, str] = (",", ":"), *, lenient: bool = False) -> dict:
    """The llguidance JSON options (``x-guidance``) of every JSON grammar in the project: fixed ``(item, key)``
    separators and no free whitespace (a model cannot loop on whitespace), so serialisation is canonical;
    ``lenient`` relaxes keywords the grammar cannot enforce (the caller validates outputs) and treats ``oneOf`` as
    ``anyOf``."""
    options: dict[str, Any] = {"whitespace_flexible": False, "item_separator": separators[0],
                               "key_separator": separators[1]}
    if lenient:
        options.update(lenient=True, coerce_one_of=True)
    return options


# compact: json.dumps(x, separators=(",", ":"))
JSON_COMPILE_OPTIONS = compile_options()
LENIENT_COMPILE_OPTIONS = compile_options(lenient=True)


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


def grammar_error_to_schema_error(schema: Any, message: str, tool: str | None = None) -> SchemaError:
    """Turn an llguidance compile error into a :class:`SchemaError` with keywords and pointers."""
    m = _UNIMPLEMENTED.search(message)
    if m:
        keywords = json.loads("[" + m.group(1) + "]")
        problems = []
        for kw in keywords:
            for pointer in find_keyword(schema, kw) or [""]:
                problems.append((pointer, kw, f"keyword {kw!r} at {pointer or '/'} cannot be enforced by the grammar"))
        where = ", ".join(f"{kw!r} at {p or '/'}" for p, kw, _ in problems)
        return SchemaError(f"schema uses keywords the grammar cannot enforce: {where}; {_advice(tool)}",
                           pointer=problems[0][0], keyword=problems[0][1], tool=tool, problems=problems)
    if "oneOf" in message:
        ptrs = find_keyword(schema, "oneOf")
        p = ptrs[0] if ptrs else ""
        more = f" (the schema has {len(ptrs)} oneOf: {', '.join(ptrs[:5])}{'…' if len(ptrs) > 5 else ''})" \
            if len(ptrs) > 1 else ""
        problems = [(q, "oneOf", f"keyword 'oneOf' at {q} may not be enforceable exactly") for q in ptrs]
        return SchemaError(f"keyword 'oneOf' at {p or '/'} cannot be enforced exactly (branches may overlap){more}; "
                           f"use anyOf with disjoint branches, or {_relax(tool)}",
                           pointer=p, keyword="oneOf", tool=tool, problems=problems or None)
    fm = _UNKNOWN_FORMAT.search(message)
    if fm:
        ptrs = [json_pointer(path + ("format",)) for path, node in walk(schema) if node.get("format") == fm.group(1)]
        p = ptrs[0] if ptrs else ""
        return SchemaError(f"keyword 'format' at {p or '/'}: format {fm.group(1)!r} is not one the grammar enforces "
                           f"(date-time, date, time, duration, email, hostname, ipv4, ipv6, uuid, uri); use a "
                           f"pattern, or {_relax(tool)}", pointer=p, keyword="format", tool=tool,
                           problems=[(q, "format", f"unknown format at {q}") for q in ptrs] or None)
    if _RESOURCE.search(message) or any(k in message for k in _COMPILE_ERRORS):
        return compile_error_to_schema_error(schema, message, tool=tool)
    for kw in ("pattern", "format", "$ref", "type", "enum", "const"):
        if kw in message or (kw == "$ref" and "Pointer" in message):
            ptrs = find_keyword(schema, kw)
            p = ptrs[0] if ptrs else ""
            return SchemaError(f"cannot compile schema (keyword {kw!r} near {p or '/'}): {message.strip()}",
                               pointer=p, keyword=kw, tool=tool)
    return compile_error_to_schema_error(schema, message, tool=tool)


_COUNT_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
                   "minContains", "maxContains")


def _normalise_counts(schema: Any) -> Any:
    """``schema`` with integral floats in count keywords (``"maxItems": 2.0``) made ints, which llguidance requires
    (same meaning in every draft since 06). The input is not modified; it is returned as is when nothing changes."""
    if not any(isinstance(node.get(k), float) for _, node in walk(schema) for k in _COUNT_KEYWORDS):
        return schema
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        for k in _COUNT_KEYWORDS:
            v = node.get(k)
            if isinstance(v, float) and v.is_integer():
                node[k] = int(v)
    return schema


_BOUND_KEYWORDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def _inexact(v: Any) -> bool:
    """An integer bound no float64 holds exactly (past ±2^53, or past the float range)."""
    if not isinstance(v, int) or isinstance(v, bool):
        return False
    try:
        return float(v) != v
    except OverflowError:
        return True


def _inexact_exclusive(node: dict, k: str) -> bool:
    """An exclusive bound of an integer past ±2^53 (``exclusiveMinimum: v``, or draft 04's ``minimum: v`` with
    ``exclusiveMinimum: true``; ``type`` ``integer``, a list holding it, or none: an ``allOf`` sibling may make it
    an integer): the integer next to it is no float64, and llguidance (which steps from the bound in floats) let the
    bound itself through (``exclusiveMinimum: 2^60`` admitted 2^60)."""
    v = node.get(k)
    types = node.get("type", "integer")
    if not (types == "integer" or (isinstance(types, list) and "integer" in types)):
        return False
    if not isinstance(v, (int, float)) or isinstance(v, bool) or abs(v) < 2 ** 53:
        return False
    return k.startswith("exclusive") or node.get("exclusive" + k[0].upper() + k[1:]) is True


def _inexact_bounds(schema: Any) -> list[tuple[tuple, str]]:
    return [(path, k) for path, node in walk(schema) for k in _BOUND_KEYWORDS
            if _inexact(node.get(k)) or _inexact_exclusive(node, k)]


def check_exact_bounds(schema: Any, tool: str | None = None) -> None:
    """Raise :class:`SchemaError` for an integer bound llguidance would round: it reads ``minimum``/``maximum``
    (and the exclusive ones) as 64-bit floats, so ``minimum: 2^53 + 1`` became ``2^53`` and let it through."""
    problems = []
    for path, k in _inexact_bounds(schema):
        pointer = json_pointer(path + (k,))
        node = path_value(schema, path)
        what = "no 64-bit float holds the integer next to it" if _inexact_exclusive(node, k) \
            else "no 64-bit float holds it"
        problems.append((pointer, k, f"keyword {k!r} at {pointer}: {node[k]} is past 2^53 and {what}, so the "
                                     f"grammar cannot enforce it exactly"))
    if problems:
        raise SchemaError(f"{problems[0][2]}; use a bound within ±2^53 (9007199254740992), or "
                          f"{_relax(tool)} (the grammar then keeps the nearest float inside the bound)",
                          pointer=problems[0][0], keyword=problems[0][1], tool=tool, problems=problems)


def path_value(schema: Any, path: tuple) -> Any:
    for key in path:
        schema = schema[key]
    return schema


def exact_bounds(schema: Any) -> Any:
    """``schema`` with each integer bound no float64 holds replaced by the nearest float inside it (lenient
    grammars: a bound is never widened, so the grammar admits no value beyond it; the few values between the
    bound and that float are left out, and every output is validated against the original anyway). Returned as
    is when every bound is exact. Raises :class:`SchemaError` for a bound past the float range."""
    found = _inexact_bounds(schema)
    if not found:
        return schema
    schema = copy.deepcopy(schema)
    for path, k in found:
        node = path_value(schema, path)
        v = node[k]
        try:
            f = float(v)
        except OverflowError:
            raise SchemaError(f"keyword {k!r} at {json_pointer(path + (k,))} is past the float range: the grammar "
                              f"cannot bound it", pointer=json_pointer(path + (k,)), keyword=k) from None
        lower = k in ("minimum", "exclusiveMinimum")
        if _inexact_exclusive(node, k):  # the inclusive bound next to it, rounded inwards below
            v = (math.floor(v) + 1) if lower else (math.ceil(v) - 1)
            inclusive = "minimum" if lower else "maximum"
            if k == inclusive:  # draft 04: drop the boolean that made it exclusive
                node.pop("exclusiveMinimum" if lower else "exclusiveMaximum")
            else:
                del node[k]
            k = inclusive
            f = float(v)
            if isinstance(node.get(k), (int, float)) and ((node[k] > v) if lower else (node[k] < v)):
                continue  # the inclusive bound beside it is tighter (and handled on its own)
        if (f < v) if lower else (f > v):
            f = math.nextafter(f, math.inf if lower else -math.inf)
        node[k] = int(f)
    return schema


_QUOTED_KEYWORD = re.compile(r"'(\$?[A-Za-z]+)'")
_PROCESSING = re.compile(r"while processing \S*#(\S*)")
_RESOURCE = re.compile(r"Resource '([^']+)' is not present")
_CIRCULAR = re.compile(r"circular references with sibling keys are not supported: \S*#(\S*)")
_RANGE = re.compile(r"Failed to generate regex for (integer|float) range: min=(?:Some\(([^)]*)\)|None), "
                    r"max=(?:Some\(([^)]*)\)|None)")
_COMPILE_ERRORS = ("Unsatisfiable", "look-around", "lookaround", "regex parse error", "circular references",
                   "schema too large", "stack level exceeded")


def _unquote(fragment: str) -> str:
    from urllib.parse import unquote

    return unquote(fragment)


def compile_error_to_schema_error(schema: Any, message: str, tool: str | None = None) -> SchemaError:
    """Turn an llguidance error raised while building the grammar into a :class:`SchemaError` naming the keyword
    and pointer (remote ``$ref`` targets, unsatisfiable subschemas, out-of-range keyword values)."""
    message = message.strip()
    m = _RESOURCE.search(message)
    if m:
        uri = m.group(1)
        ptrs = [json_pointer(p + ("$ref",)) for p, node in walk(schema)
                if isinstance(node.get("$ref"), str) and not node["$ref"].startswith("#")]
        p = ptrs[0] if ptrs else ""
        return SchemaError(f"$ref at {p or '/'} points outside this schema ({uri}); remote references are never "
                           f"fetched: inline the target under $defs", pointer=p, keyword="$ref", tool=tool)
    m = _PROCESSING.search(message)
    where = _unquote(m.group(1)) if m else None
    if "look-around" in message or "lookaround" in message or "regex parse error" in message:
        hits = [(json_pointer(path + ("pattern",)), "pattern") for path, node in walk(schema)
                if isinstance(node.get("pattern"), str) and node["pattern"] in message]
        hits += [(json_pointer(path + ("patternProperties", k)), "patternProperties") for path, node in walk(schema)
                 if isinstance(node.get("patternProperties"), dict) for k in node["patternProperties"] if k in message]
        if not hits:  # llguidance shows the regex rewritten (\d -> [0-9]): fall back to look-around syntax
            look = re.compile(r"\(\?<?[=!]")
            hits = [(json_pointer(path + ("pattern",)), "pattern") for path, node in walk(schema)
                    if isinstance(node.get("pattern"), str) and look.search(node["pattern"])]
            hits += [(json_pointer(path + ("patternProperties", k)), "patternProperties")
                     for path, node in walk(schema) if isinstance(node.get("patternProperties"), dict)
                     for k in node["patternProperties"] if look.search(k)]
        p, kw = hits[0] if hits else (where or "", "pattern")
        why = "look-around and anchors inside the pattern are not supported by the grammar's regex engine" \
            if "look" in message else "the regular expression does not parse"
        return SchemaError(f"keyword {kw!r} at {p or '/'} cannot be enforced: {why}; rewrite the regex without "
                           f"look-around, or {_relax(tool)} ({message.splitlines()[0]})",
                           pointer=p, keyword=kw, tool=tool)
    m = _RANGE.search(message)
    if m:
        return _range_error(schema, m, message, tool)
    m = _CIRCULAR.search(message)
    if m:
        p = _unquote(m.group(1))
        return SchemaError(f"$ref cycle through {p or '/'} with sibling keywords next to $ref cannot be compiled; "
                           f"move the siblings into an allOf or into the target", pointer=p, keyword="$ref", tool=tool)
    if "schema too large" in message or "stack level exceeded" in message:
        kw = "allOf" if "intersection" in message else "size"
        return SchemaError(f"schema too large or too deeply intersected for the grammar compiler ({message.splitlines()[0]});"
                           f" split it into smaller tools or flatten allOf", pointer=where or "", keyword=kw, tool=tool)
    if "Unsatisfiable" in message:
        p = where or ""
        return SchemaError(f"schema at {p or '/'} admits no value ({message.splitlines()[0]}): nothing can be "
                           f"generated; fix the contradiction", pointer=p, keyword="unsatisfiable", tool=tool)
    m = _QUOTED_KEYWORD.search(message)
    if m or "min/maxProperties" in message:
        kw = m.group(1) if m else next((k for k in ("minProperties", "maxProperties") if find_keyword(schema, k)),
                                       "minProperties")
        ptrs = find_keyword(schema, kw)
        p = ptrs[0] if ptrs else (where or "")
        return SchemaError(f"cannot compile schema: keyword {kw!r} at {p or '/'}: {message}", pointer=p,
                           keyword=kw, tool=tool)
    return SchemaError(f"cannot compile schema: {message}", pointer=where or "", tool=tool)


def _range_error(schema: Any, m: re.Match, message: str, tool: str | None) -> SchemaError:
    """The bound llguidance could not write a range for (``Failed to generate regex for integer range: min=…``),
    found by value: the node whose bounds give the most of the message's ``min``/``max``, and of those the bound
    largest in size. Its regex writer handles a one-sided bound below 10^18 in size and two-sided bounds within
    about ±9.2 * 10^18 (integers: a maximum of any size), measured on llguidance 1.x."""
    kind, lo, hi = m.group(1), m.group(2), m.group(3)

    def matches(k: str, v: Any) -> bool:
        wanted = lo if k in ("minimum", "exclusiveMinimum") else hi
        return wanted is not None and float(wanted) == float(v)

    bounds = [(path, k, node[k]) for path, node in walk(schema) for k in _BOUND_KEYWORDS
              if isinstance(node.get(k), (int, float)) and not isinstance(node[k], bool)]
    per_node = collections.Counter(path for path, k, v in bounds if matches(k, v))
    # where nothing matches, llguidance clamped the bound (to 64 bits): the largest bound of the schema
    path, k, v = max(bounds, key=lambda b: (per_node[b[0]] if matches(b[1], b[2]) else 0, abs(float(b[2]))),
                     default=(None, "minimum" if lo is not None else "maximum", lo or hi))
    p = "" if path is None else json_pointer(path + (k,))
    what = "integers" if kind == "integer" else "numbers"
    return SchemaError(f"keyword {k!r} at {p or '/'}: the grammar cannot write {what} bounded by {v} "
                       f"(llguidance builds no regex for min={lo}, max={hi}); keep the bounds within ±10^18 "
                       f"({message.splitlines()[0]})", pointer=p, keyword=k, tool=tool)


def check_exact_extras(schema: Any, tool: str | None = None) -> None:
    """Raise :class:`SchemaError` for constructs llguidance compiles but does not enforce exactly.

    ``minProperties`` above the number of required keys, on an object that allows undeclared keys: the grammar
    counts keys as written and cannot stop an undeclared key from repeating, so ``{"b":1,"b":2}`` passes
    ``minProperties: 2`` but parses to one key.
    """
    problems = []
    for path, node in walk(schema):
        m = node.get("minProperties")
        if not isinstance(m, (int, float)) or isinstance(m, bool):
            continue
        required = node.get("required") if isinstance(node.get("required"), list) else []
        closed = node.get("additionalProperties") is False and not node.get("patternProperties")
        if m > len(set(required)) and not closed:
            pointer = json_pointer(path + ("minProperties",))
            problems.append((pointer, "minProperties",
                             f"keyword 'minProperties' at {pointer} cannot be enforced exactly: a repeated "
                             f"undeclared key would count twice; list the keys in properties/required with "
                             f"additionalProperties: false"))
    if problems:
        where = ", ".join(f"{kw!r} at {p}" for p, kw, _ in problems)
        raise SchemaError(f"schema uses keywords the grammar cannot enforce: {where} (a repeated undeclared key "
                          f"would count twice); {_advice(tool)}", pointer=problems[0][0], keyword="minProperties",
                          tool=tool, problems=problems)


def compile_json_schema(schema: Any, *, lenient: bool = False, tool: str | None = None) -> str:
    """Compile a JSON Schema to an llguidance grammar (JSON text); raise :class:`SchemaError` when it cannot.

    Strict: unimplemented keywords (``not``, ``if``, ``uniqueItems``…) and integer bounds past 2^53 are errors
    naming their pointers. Lenient: they are ignored by the grammar, bounds kept inside (the caller must validate
    outputs).
    ``format: date`` / ``date-time`` admit only real calendar dates (:func:`schemas.narrow.calendar_dates`);
    ``time`` / ``date-time`` at most nanoseconds (:func:`schemas.narrow.bounded_fractions`).
    """
    options = LENIENT_COMPILE_OPTIONS if lenient else JSON_COMPILE_OPTIONS
    if not lenient:
        check_exact_extras(schema, tool=tool)
        check_exact_bounds(schema, tool=tool)
    if schema is True:
        schema = {}
    elif schema is False:
        raise SchemaError("schema false admits no value: nothing can be generated", keyword="false", tool=tool)
    try:
        engine = engine_schema(_normalise_counts(schema))
    except SchemaError as e:  # a keyword value the engine cannot write (named), with the tool's name
        raise SchemaError(e.problems[0][2], pointer=e.pointer, keyword=e.keyword, tool=tool) from None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(engine, overrides=options)
    except ValueError as e:
        raise compile_error_to_schema_error(schema, str(e), tool=tool) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise grammar_error_to_schema_error(schema, messages[0], tool=tool)
    return grammar


# llguidance writes a string's length bounds as a regex repetition, which parses up to 2**31 - 1
MAX_STRING_LENGTH_BOUND = 2 ** 31 - 1


def capped_lengths(schema: Any) -> Any:
    """``schema`` with each ``maxLength`` above :data:`MAX_STRING_LENGTH_BOUND` lowered to it (a narrowing: no
    turn writes two billion characters; outputs are validated against the original anyway), where narrowing the
    node narrows the whole (:func:`schemas.narrow.narrowable_nodes`). Returned as is when none is that large.
    Raises :class:`SchemaError` for a ``minLength`` above it (no string that long can be generated)."""
    def too_long(node: dict, k: str) -> bool:
        v = node.get(k)
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_STRING_LENGTH_BOUND

    found = [(path, node) for path, node in walk(schema) if too_long(node, "maxLength") or too_long(node, "minLength")]
    if not found:
        return schema
    for path, node in found:
        if too_long(node, "minLength"):
            raise SchemaError(f"keyword 'minLength' at {json_pointer(path + ('minLength',))} asks for more than "
                              f"{MAX_STRING_LENGTH_BOUND} characters: no such string can be generated",
                              pointer=json_pointer(path + ("minLength",)), keyword="minLength")
    schema = copy.deepcopy(schema)
    for node in narrowable_nodes(schema):
        if too_long(node, "maxLength"):
            node["maxLength"] = MAX_STRING_LENGTH_BOUND
    return schema


# keywords whose value is a count: a non-negative integer, which JSON Schema (draft 6 on) may write as 3.0
COUNT_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "minContains",
                  "maxContains")


def integral_counts(schema: Any) -> Any:
    """``schema`` with each count keyword written as an integral number (``"minItems": 3.0``, an integer to JSON
    Schema) as an int, which llguidance's ``%json`` requires ("Expected positive integer for 'minItems', got
    3.0"); the same language. Returned as is when none is."""
    def integral_float(v: Any) -> bool:
        return isinstance(v, float) and v.is_integer()

    if not any(integral_float(node.get(k)) for _, node in walk(schema) for k in COUNT_KEYWORDS):
        return schema
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        for k in COUNT_KEYWORDS:
            if integral_float(node.get(k)):
                node[k] = int(node[k])
    return schema


def engine_schema(schema: Any) -> Any:
    """The schema as llguidance is given it (JSON schemas and ``%json`` fragments alike): counts as integers
    (:func:`integral_counts`), real calendar dates (:func:`schemas.narrow.calendar_dates`), times with at most
    nanoseconds (:func:`schemas.narrow.bounded_fractions`), string lengths it can write (:func:`capped_lengths`),
    exact integer bounds (:func:`exact_bounds`) and bounds past 64 bits as the floats they equal
    (:func:`wide_bounds_as_floats`)."""
    dates = bounded_fractions(calendar_dates(integral_counts(schema)))
    return wide_bounds_as_floats(exact_bounds(capped_lengths(dates)))


def wide_bounds_as_floats(schema: Any) -> Any:
    """``schema`` with each integer bound past 64 bits (``maximum: 2**64``) written as the float it equals:
    llguidance's Python binding cannot pass such an int ("Value is not JSON serializable") and reads bounds as
    floats anyway (:func:`exact_bounds` has made them exact). Returned as is when there is none."""
    def wide(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and not -2 ** 63 <= v < 2 ** 63

    found = [(path, k) for path, node in walk(schema) for k in _BOUND_KEYWORDS if wide(node.get(k))]
    if not found:
        return schema
    schema = copy.deepcopy(schema)
    for path, k in found:
        node = path_value(schema, path)
        node[k] = float(node[k])
    return schema


def schema_compiles(schema: Any, lenient: bool = False) -> bool:
    """Whether ``schema`` compiles to a grammar (strict or lenient); cached by its canonical JSON text. Used by
    :func:`schemas.narrow.narrow_for_grammar` to keep only narrowings that still compile."""
    return _compiles(json.dumps(schema, ensure_ascii=False), lenient)


@functools.lru_cache(maxsize=1024)
def _compiles(canonical: str, lenient: bool) -> bool:
    try:
        compile_json_schema(json.loads(canonical), lenient=lenient)
    except SchemaError:
        return False
    return True


def check_enforceable(schema: Any, tool: str | None = None, lenient: bool = False) -> None:
    """Raise :class:`SchemaError` unless the grammar enforces ``schema`` exactly (strict registration; ``lenient``:
    unless its lenient grammar compiles): it compiles as written, or with integers bounded as the grammar bounds
    them (:func:`schemas.narrow.bound_integers`, the first step of ``narrow_for_grammar``: a one-sided integer bound
    from 10^18 on compiles only once the other bound is set). The error raised is the one of the schema as
    written."""
    try:
        compile_json_schema(schema, lenient=lenient, tool=tool)
    except SchemaError:
        bounded = bound_integers(schema)
        if bounded is schema or not schema_compiles(bounded, lenient):
            raise


