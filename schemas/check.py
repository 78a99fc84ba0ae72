"""Registration-time checks: is a JSON Schema valid, and can the grammar enforce it exactly?

Strict policy (default): a schema that is not valid JSON Schema for its declared draft (default 2020-12), or that
uses keywords llguidance cannot enforce, raises :class:`SchemaError` naming each keyword and its JSON pointer.
Lenient policy: such keywords are relaxed in the grammar and every output is validated afterwards with jsonschema.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

import jsonschema
import jsonschema.validators

from .errors import SchemaError, json_pointer

# Keywords whose value is a schema / map of schemas / list of schemas (for walking a schema tree).
_SUBSCHEMA = {"not", "if", "then", "else", "items", "additionalProperties", "contains", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems", "additionalItems"}
_SCHEMA_MAP = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_SCHEMA_LIST = {"allOf", "anyOf", "oneOf", "prefixItems"}

# What strict mode tells the user to do, per keyword.
_ADVICE = ("remove the keyword, rewrite it with enforceable keywords (enum, const, anyOf, pattern, minimum…), or "
           "register with strict=False to relax it in the grammar and validate every output afterwards")


def walk(schema: Any, path: tuple = ()) -> Iterator[tuple[tuple, dict]]:
    """Yield ``(path, node)`` for every schema object in ``schema`` (pre-order)."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key, value in schema.items():
        if key in _SUBSCHEMA:
            if isinstance(value, list) and key == "items":
                for i, sub in enumerate(value):
                    yield from walk(sub, path + (key, i))
            else:
                yield from walk(value, path + (key,))
        elif key in _SCHEMA_MAP and isinstance(value, dict):
            for name, sub in value.items():
                yield from walk(sub, path + (key, name))
        elif key in _SCHEMA_LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from walk(sub, path + (key, i))
        elif key == "dependencies" and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    yield from walk(sub, path + (key, name))


def find_keyword(schema: Any, keyword: str) -> list[str]:
    """JSON pointers of every schema node that uses ``keyword`` (e.g. ``["/properties/age/not"]``)."""
    return [json_pointer(path + (keyword,)) for path, node in walk(schema) if keyword in node]


def validator_class(schema: Any):
    """The jsonschema validator class for the schema's declared ``$schema`` (Draft 2020-12 when absent)."""
    default = jsonschema.Draft202012Validator
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str):
        return jsonschema.validators.validator_for(schema, default=default)
    return default


def check_valid(schema: Any, tool: str | None = None) -> None:
    """Raise :class:`SchemaError` if ``schema`` is not valid JSON Schema for its declared draft.

    Checks the meta-schema (e.g. ``{"type": "objekt"}`` -> keyword ``type`` at pointer ``/type``) and that every
    local ``$ref`` resolves.
    """
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(f"a JSON Schema must be an object or a boolean, got {type(schema).__name__}", tool=tool)
    cls = validator_class(schema)
    errors = sorted(cls(cls.META_SCHEMA).iter_errors(schema), key=lambda e: list(e.absolute_path))
    if errors:
        problems = []
        for e in errors:
            path = list(e.absolute_path)
            # the keyword at fault is the last key of the path when the bad value sits under a keyword
            keyword = next((p for p in reversed(path) if isinstance(p, str)), e.validator)
            problems.append((json_pointer(path), str(keyword), e.message))
        pointer, keyword, message = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SchemaError(f"invalid JSON Schema at {pointer or '/'} (keyword {keyword!r}): {message}{more}",
                          pointer=pointer, keyword=keyword, tool=tool, problems=problems)
    for path, node in walk(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if resolve_local_ref(schema, ref) is _MISSING:
                pointer = json_pointer(path + ("$ref",))
                raise SchemaError(f"$ref {ref!r} at {pointer} points to nothing in this schema",
                                  pointer=pointer, keyword="$ref", tool=tool)


_MISSING = object()


def resolve_local_ref(schema: Any, ref: str) -> Any:
    """Resolve ``#/a/b`` (or ``#``) inside ``schema``; returns a sentinel when the target does not exist.

    ``#name`` anchors are looked up among ``$anchor`` values.
    """
    frag = ref[1:]
    if frag == "":
        return schema
    if not frag.startswith("/"):
        for _, node in walk(schema):
            if node.get("$anchor") == frag:
                return node
        return _MISSING
    node = schema
    for part in frag[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


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
        return SchemaError(f"schema uses keywords the grammar cannot enforce: {where}; {_ADVICE}",
                           pointer=problems[0][0], keyword=problems[0][1], tool=tool, problems=problems)
    if "oneOf" in message:
        ptrs = find_keyword(schema, "oneOf")
        p = ptrs[0] if ptrs else ""
        return SchemaError(f"keyword 'oneOf' at {p or '/'} cannot be enforced exactly (branches may overlap); "
                           f"use anyOf with disjoint branches, or {_ADVICE.split(', or ')[-1]}",
                           pointer=p, keyword="oneOf", tool=tool)
    for kw in ("pattern", "format", "$ref", "type", "enum", "const"):
        if kw in message or (kw == "$ref" and "Pointer" in message):
            ptrs = find_keyword(schema, kw)
            p = ptrs[0] if ptrs else ""
            return SchemaError(f"cannot compile schema (keyword {kw!r} near {p or '/'}): {message.strip()}",
                               pointer=p, keyword=kw, tool=tool)
    return SchemaError(f"cannot compile schema: {message.strip()}", tool=tool)


# Grammar compile options shared by every JSON grammar in the project: compact separators, no free whitespace
# (a model cannot loop on whitespace), so serialisation is canonical: json.dumps(x, separators=(",", ":")).
JSON_COMPILE_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
LENIENT_COMPILE_OPTIONS = {**JSON_COMPILE_OPTIONS, "lenient": True, "coerce_one_of": True}


def compile_json_schema(schema: Any, *, lenient: bool = False, tool: str | None = None) -> str:
    """Compile a JSON Schema to an llguidance grammar (JSON text); raise :class:`SchemaError` when it cannot.

    Strict: unimplemented keywords (``not``, ``if``, ``uniqueItems``…) are errors naming their pointers.
    Lenient: they are ignored by the grammar (the caller must validate outputs).
    """
    import llguidance

    options = LENIENT_COMPILE_OPTIONS if lenient else JSON_COMPILE_OPTIONS
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as e:
        raise SchemaError(f"cannot compile schema: {e}", tool=tool) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise grammar_error_to_schema_error(schema, messages[0], tool=tool)
    return grammar


def check_enforceable(schema: Any, tool: str | None = None) -> None:
    """Raise :class:`SchemaError` unless the grammar enforces ``schema`` exactly (strict registration)."""
    compile_json_schema(schema, lenient=False, tool=tool)
