"""Registration-time checks: is a JSON Schema valid, and can the grammar enforce it exactly? Post-validation.

Strict policy (default): a schema that is not valid JSON Schema for its declared draft (default 2020-12), or that
uses keywords the grammar engine cannot enforce, raises :class:`SchemaError` naming each keyword and its JSON
pointer. This module knows JSON Schema only: whether a schema is enforceable is the grammar engine's question
(``constraints/json_schema.py``, installed with :func:`set_enforceability_check`).
Lenient policy: such keywords are relaxed in the grammar and every output is validated afterwards with jsonschema.
"""
from __future__ import annotations

import copy
import re
from typing import Any, Callable, Iterator, Optional

import jsonschema
import jsonschema.validators

from .errors import (RELAX_RESPONSE_FORMAT, RELAX_TOOL, RESPONSE_FORMAT, InstanceError, SchemaError, SpecAgentError,
                     json_pointer)

# Keywords whose value is a schema / map of schemas / list of schemas (for walking a schema tree).
_SUBSCHEMA = {"not", "if", "then", "else", "items", "additionalProperties", "contains", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems", "additionalItems"}
_SCHEMA_MAP = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_SCHEMA_LIST = {"allOf", "anyOf", "oneOf", "prefixItems"}

def walk(schema: Any, path: tuple = (), skip: frozenset[str] = frozenset()) -> Iterator[tuple[tuple, dict]]:
    """Yield ``(path, node)`` for every schema object in ``schema`` (pre-order); subschemas under a keyword in
    ``skip`` (e.g. ``"not"``) are not visited."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key, value in schema.items():
        if key in skip:
            continue
        if key in _SUBSCHEMA:
            if isinstance(value, list) and key == "items":
                for i, sub in enumerate(value):
                    yield from walk(sub, path + (key, i), skip)
            else:
                yield from walk(value, path + (key,), skip)
        elif key in _SCHEMA_MAP and isinstance(value, dict):
            for name, sub in value.items():
                yield from walk(sub, path + (key, name), skip)
        elif key in _SCHEMA_LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from walk(sub, path + (key, i), skip)
        elif key == "dependencies" and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    yield from walk(sub, path + (key, name), skip)


def find_keyword(schema: Any, keyword: str) -> list[str]:
    """JSON pointers of every schema node that uses ``keyword`` (e.g. ``["/properties/age/not"]``)."""
    return [json_pointer(path + (keyword,)) for path, node in walk(schema) if keyword in node]


def validator_class(schema: Any):
    """The jsonschema validator class for the schema's declared ``$schema`` (Draft 2020-12 when absent).

    ``multipleOf`` is checked in exact decimal arithmetic (as the grammar does): plain jsonschema divides floats and
    rejects ``0.3`` as a multiple of ``0.1``.
    """
    default = jsonschema.Draft202012Validator
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str):
        return _exact_multiple_of(jsonschema.validators.validator_for(schema, default=default))
    return _exact_multiple_of(default)


_EXACT: dict[type, type] = {}


def _exact_multiple_of(cls):
    if cls not in _EXACT:
        _EXACT[cls] = jsonschema.validators.extend(cls, {"multipleOf": _multiple_of})
    return _EXACT[cls]


def _multiple_of(validator, divisor, instance, schema):
    """``multipleOf`` on the decimal values the JSON text denotes (``repr`` of a float is its shortest decimal)."""
    import decimal

    if not validator.is_type(instance, "number") or isinstance(instance, bool):
        return
    try:
        with decimal.localcontext() as ctx:
            ctx.prec = 1000
            ctx.traps[decimal.Inexact] = True
            failed = decimal.Decimal(repr(instance)) % decimal.Decimal(repr(divisor)) != 0
    except (decimal.DecimalException, ValueError):  # a quotient beyond 1000 digits: fall back to jsonschema's
        yield from jsonschema.Draft202012Validator.VALIDATORS["multipleOf"](validator, divisor, instance, schema)
        return
    if failed:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor}")


def check_valid(schema: Any, tool: str | None = None) -> None:
    """Raise :class:`SchemaError` if ``schema`` is not valid JSON Schema for its declared draft.

    Checks the meta-schema (e.g. ``{"type": "objekt"}`` -> keyword ``type`` at pointer ``/type``), that every
    local ``$ref`` resolves and that every ``pattern`` (and ``patternProperties`` key) compiles with Python's ``re``,
    which validates outputs (a ``\\p{L}`` class does not).
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
        patterns = [(("pattern",), node.get("pattern"))] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += [(("patternProperties", k), k) for k in node["patternProperties"]]
        for where, pattern in patterns:  # post-validation runs Python's re (jsonschema): refuse what it cannot read
            try:
                re.compile(pattern)
            except (re.error, RecursionError, OverflowError) as e:
                pointer = json_pointer(path + where)
                raise SchemaError(f"pattern {pattern!r} at {pointer} cannot be validated (Python's re: {e}); write "
                                  f"it without that construct (a \\p{{...}} class as an explicit one: [A-Za-z])",
                                  pointer=pointer, keyword="pattern", tool=tool) from None
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            # "#…" resolves against the nearest enclosing resource (a subschema with its own $id); real-world
            # schemas misuse nested ids, so resolving against the root or any enclosing resource is accepted
            bases = [schema] + [n for n in _ancestors(schema, path)[1:] if isinstance(n, dict) and "$id" in n]
            if all(resolve_local_ref(b, ref) is MISSING for b in bases):
                pointer = json_pointer(path + ("$ref",))
                raise SchemaError(f"$ref {ref!r} at {pointer} points to nothing in this schema",
                                  pointer=pointer, keyword="$ref", tool=tool)
    check_finite(schema, tool)


def check_finite(schema: Any, tool: str | None = None) -> None:
    """Raise :class:`SchemaError` where a local ``$ref`` that the schema uses describes no finite value: every value
    it admits must hold itself again (``{"$defs": {"A": {"$ref": "#/$defs/A"}}}`` used somewhere, or an object whose
    required property refers back to it). No value could be generated (llguidance fails at the first mask) or
    validated (jsonschema recurses forever).

    The check is a least fixpoint over the schema's local ``$ref`` targets (a context-free grammar's productive
    nonterminals): a target is finite once its own keywords can be met with finite values: ``allOf`` all,
    ``anyOf``/``oneOf`` one, an object's ``required`` properties (where ``type`` is only ``"object"``; a name not
    under ``properties`` takes ``additionalProperties``), an array's first ``minItems`` items (where ``type`` is only
    ``"array"``; ``prefixItems``, or draft-07's ``items`` list), and its own ``$ref``. Other keywords (types,
    bounds, ``minProperties``) are taken as satisfiable: only cycles through those keywords are found; a cycle
    needing others fails at the first mask instead (a 400 from the server: ``constraints.GrammarEngineError``).
    Only ``$ref`` nodes reachable from the root count (an unused definition is never generated); a schema with a
    nested ``$id`` (references resolved against another base) is not checked.
    """
    nodes = list(walk(schema))
    if any("$id" in node for path, node in nodes if path):
        return
    refs: dict[str, Any] = {}
    for _, node in nodes:
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in refs:
            target = resolve_local_ref(schema, ref)
            if target is not MISSING:
                refs[ref] = target
    if not refs:
        return
    finite: set[str] = set()

    def ok(node: Any) -> bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in refs and ref not in finite:
            return False
        for key, need in (("allOf", all), ("anyOf", any), ("oneOf", any)):
            if isinstance(node.get(key), list) and node[key] and not need(ok(s) for s in node[key]):
                return False
        kind = node.get("type")
        kind = kind[0] if isinstance(kind, list) and len(kind) == 1 else kind
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if kind == "object" and isinstance(node.get("required"), list) and "patternProperties" not in node:
            extra = node.get("additionalProperties")
            extra = extra if isinstance(extra, dict) else True  # false: no cycle (llguidance's own error)
            for name in node["required"]:
                if isinstance(name, str) and not ok(props[name] if name in props else extra):
                    return False
        if kind == "array" and isinstance(node.get("minItems"), int) and node["minItems"] > 0:
            prefix = node.get("prefixItems", node.get("items"))
            prefix = prefix if isinstance(prefix, list) else []
            first = prefix[:node["minItems"]]
            rest = node.get("items") if len(first) < node["minItems"] and isinstance(node.get("items"), dict) \
                else None
            if not all(ok(s) for s in first) or (rest is not None and not ok(rest)):
                return False
        return True

    changed = True
    while changed:
        changed = False
        for ref, target in refs.items():
            if ref not in finite and ok(target):
                finite.add(ref)
                changed = True
    if len(finite) == len(refs):
        return
    # the $ref nodes the schema uses: reachable from the root, definitions entered through a $ref only
    paths = {id(node): path for path, node in nodes}
    seen: set[int] = set()
    todo = [((), schema)]
    while todo:
        base, start = todo.pop()
        if not isinstance(start, dict) or id(start) in seen:
            continue
        seen.add(id(start))
        for path, node in walk(start, base, skip=frozenset({"$defs", "definitions"})):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref in refs:
                if ref not in finite:
                    pointer = json_pointer(path + ("$ref",))
                    raise SchemaError(f"$ref {ref!r} at {pointer} admits no finite value: it leads to false, or back "
                                      f"to itself with no way out (every value it describes would hold itself "
                                      f"again); make a property on the cycle optional or add an alternative (anyOf "
                                      f"with a null)", pointer=pointer, keyword="$ref", tool=tool)
                todo.append((paths.get(id(refs[ref]), ()), refs[ref]))


MISSING = object()
"""Sentinel returned by :func:`resolve_local_ref` when a reference points to nothing."""


def _ancestors(schema: Any, path: tuple) -> list:
    """The nodes from the root down to ``path`` (inclusive)."""
    out, node = [schema], schema
    for part in path:
        node = node[part]
        out.append(node)
    return out


def resolve_local_ref(schema: Any, ref: str) -> Any:
    """Resolve ``#/a/b`` (or ``#``) inside ``schema``; returns :data:`MISSING` when the target does not exist.

    ``#name`` anchors are looked up among ``$anchor`` and ``$dynamicAnchor`` values; the fragment is
    percent-decoded first (``#/definitions/a%3Ab``).
    """
    from urllib.parse import unquote

    frag = unquote(ref[1:])  # a URI fragment: JSON pointer characters may be percent-encoded (%3A, %25…)
    if frag == "":
        return schema
    if not frag.startswith("/"):
        for _, node in walk(schema):
            if node.get("$anchor") == frag or node.get("$dynamicAnchor") == frag:
                return node
        return MISSING
    node = schema
    for part in frag[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node


EnforceabilityCheck = Callable[[Any, Optional[str], bool], None]
"""``check(schema, tool, lenient)``: raise :class:`SchemaError` unless the grammar engine enforces ``schema``
exactly (``lenient``: unless it compiles with what it cannot enforce relaxed)."""

_enforceability_checks: list[EnforceabilityCheck] = []


def set_enforceability_check(check: EnforceabilityCheck) -> None:
    """Install the grammar engine's enforceability check used by strict registration (:func:`check_enforceable`).

    ``schemas`` knows JSON Schema only; the engine that compiles grammars lives in ``constraints`` and installs
    its check (``constraints.check_enforceable``) when imported. A later call replaces the check.
    """
    _enforceability_checks[:] = [check]


def check_enforceable(schema: Any, tool: str | None = None, lenient: bool = False) -> None:
    """Raise :class:`SchemaError` unless the grammar enforces ``schema`` exactly (strict registration); with
    ``lenient`` (a ``strict=False`` tool or response format), unless its grammar compiles with the keywords it cannot
    enforce relaxed (a bound past what the engine writes is still an error: better at registration than at the
    first turn). Without an installed engine a lenient check passes (nothing to compile with).

    Raises:
        SchemaError: the installed engine cannot enforce (compile) the schema (keyword and pointer named).
        SpecAgentError: strict, and no grammar engine is installed (``import constraints`` installs llguidance's).
    """
    if not _enforceability_checks:
        if lenient:
            return
        relax = RELAX_RESPONSE_FORMAT if tool == RESPONSE_FORMAT else RELAX_TOOL
        raise SpecAgentError("strict registration needs the grammar engine's enforceability check: import "
                             f"constraints (or any of decoding, agent) first, or {relax}")
    _enforceability_checks[0](schema, tool, lenient)


def instance_validator(schema: Any, *, check_formats: bool = True):
    """A jsonschema validator for ``schema``'s declared draft that never fetches remote ``$ref`` targets.

    Args:
        check_formats: treat ``format`` as an assertion (the grammar enforces the formats it knows), using the
            draft's format checker (formats whose checker library is not installed pass).
    """
    import referencing

    cls = validator_class(schema)
    fmt = format_checker(cls) if check_formats else None
    return cls(schema, format_checker=fmt, registry=referencing.Registry())


_DATE = r"(\d{4})-(\d{2})-(\d{2})"
_TIME = r"(\d{2}):(\d{2}):(\d{2})(?:\.\d+)?(?:[Zz]|[+-](\d{2}):(\d{2}))"
_DATE_TIME_RE = re.compile(rf"^{_DATE}[Tt]{_TIME}$", re.ASCII)
_TIME_RE = re.compile(rf"^{_TIME}$", re.ASCII)
_DURATION_RE = re.compile(r"^P(?:\d+W|(?=\d|T\d)(?:\d+Y)?(?:\d+M)?(?:\d+D)?(?:T(?=\d)(?:\d+H)?(?:\d+M)?(?:\d+S)?)?)$",
                          re.ASCII)
_HOST_LABEL_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$", re.ASCII)
_URI_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s<>\"{}|\\^`]*$")


def _check_time(m: re.Match, at: int) -> bool:
    h, mi, sec = int(m.group(at)), int(m.group(at + 1)), int(m.group(at + 2))
    oh, om = m.group(at + 3), m.group(at + 4)
    return h < 24 and mi < 60 and sec <= 60 and (oh is None or (int(oh) < 24 and int(om) < 60))


def _is_date_time(value: Any) -> bool:
    import datetime

    if not isinstance(value, str):
        return True
    m = _DATE_TIME_RE.match(value)
    if not m:
        return False
    try:
        datetime.date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    except ValueError:
        return False
    return _check_time(m, 4)


def _is_time(value: Any) -> bool:
    if not isinstance(value, str):
        return True
    m = _TIME_RE.match(value)
    return bool(m) and _check_time(m, 1)


def _is_duration(value: Any) -> bool:
    return not isinstance(value, str) or bool(_DURATION_RE.match(value))


def _is_hostname(value: Any) -> bool:
    if not isinstance(value, str):
        return True
    return 0 < len(value) <= 253 and all(_HOST_LABEL_RE.match(label) for label in value.split("."))


def _is_uri(value: Any) -> bool:
    return not isinstance(value, str) or bool(_URI_RE.match(value))


_FALLBACK_FORMATS = {"date-time": _is_date_time, "time": _is_time, "duration": _is_duration,
                     "hostname": _is_hostname, "uri": _is_uri}


def format_checker(cls=None):
    """jsonschema's format checker (Draft 2020-12 formats and the draft's own), plus RFC 3339 ``date-time``/``time``, ISO 8601 ``duration``,
    RFC 1123 ``hostname`` and absolute ``uri`` checks where the optional checker libraries are not installed
    (the formats the grammar enforces should be checked the same way after generation)."""
    checker = copy.deepcopy(jsonschema.Draft202012Validator.FORMAT_CHECKER)
    if cls is not None:  # the draft's own formats too (the grammar enforces a format whatever the draft)
        for name, entry in cls.FORMAT_CHECKER.checkers.items():
            checker.checkers.setdefault(name, entry)
    for name, fn in _FALLBACK_FORMATS.items():
        if name not in checker.checkers:
            checker.checks(name)(fn)
    return checker


def validate_instance(schema: Any, value: Any, *, check_formats: bool = True, tool: str | None = None) -> None:
    """Raise :class:`InstanceError` unless ``value`` satisfies ``schema`` (jsonschema, the schema's own draft).

    Use it to post-validate outputs of a grammar compiled with ``lenient=True``. The error names the failing
    keyword, its pointer in the schema (``/properties/age/not``) and the pointer of the bad value in the instance.

    Raises:
        InstanceError: the value is invalid (``pointer``, ``keyword``, ``schema_pointer``, ``problems``).
        SchemaError: the schema itself is unusable (e.g. a ``$ref`` that cannot be resolved).
    """
    import referencing.exceptions

    try:
        errors = list(instance_validator(schema, check_formats=check_formats).iter_errors(value))
    except referencing.exceptions.Unresolvable as e:
        raise SchemaError(f"cannot validate: $ref {e.ref!r} does not resolve", keyword="$ref", tool=tool) from None
    if not errors:
        return
    errors.sort(key=lambda e: (list(map(str, e.absolute_path)), list(map(str, e.absolute_schema_path))))
    problems = [(json_pointer(e.absolute_path), str(e.validator), json_pointer(e.absolute_schema_path), e.message)
                for e in errors]
    pointer, keyword, schema_pointer, message = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    prefix = f"tool {tool!r}: " if tool else ""
    raise InstanceError(f"{prefix}value at {pointer or '/'} fails keyword {keyword!r} at schema {schema_pointer or '/'}"
                        f": {message}{more}", pointer=pointer, keyword=keyword, schema_pointer=schema_pointer,
                        tool=tool, problems=problems)
