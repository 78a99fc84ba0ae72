"""BFCL's function-doc dialect -> JSON Schema (the scorer is in ``bench/bfcl.py``).

Dialect (see ``../shared/data/bfcl/NONSTANDARD_TYPES.md``): ``dict`` -> object, ``float``/``double`` -> number,
``tuple`` -> array, ``any`` or ``""`` -> no type constraint, Java/JS names (``String``, ``Boolean``, ``long``,
``HashMap``, ``ArrayList``, ``Array``…) mapped to their JSON types, a non-standard ``optional`` key dropped, string
booleans in ``default`` turned into booleans, an ``enum`` of scalars on an array moved to its ``items``.
"""
from __future__ import annotations

import copy
from typing import Any

from schemas import Tool

_TYPE_MAP = {
    "dict": "object", "object": "object", "hashmap": "object", "map": "object", "hashtable": "object",
    "float": "number", "double": "number", "number": "number",
    "integer": "integer", "int": "integer", "long": "integer", "short": "integer", "byte": "integer",
    "bigint": "integer",
    "string": "string", "str": "string", "char": "string", "character": "string",
    "boolean": "boolean", "bool": "boolean",
    "array": "array", "list": "array", "tuple": "array", "arraylist": "array", "set": "array",
    "null": "null",
}
_ANY = {"any", ""}


def normalize_schema(node: Any, *, code_strings: bool = False, _root: bool = True) -> Any:
    """Return a JSON Schema for a BFCL ``parameters`` node (input unchanged).

    Args:
        code_strings: Java/JavaScript categories, where BFCL's values are often source-code expressions
            (``"mapController"``, ``"new Path('/x')"``): an ``any`` (or empty) type becomes ``{"type": "string"}``
            instead of no constraint; declared types (``Boolean``, ``String``, ``long``, ``HashMap``…) map as usual.
    """
    if not isinstance(node, dict):
        return node
    node = copy.deepcopy(node)
    out: dict[str, Any] = {}
    t = node.pop("type", None)
    node.pop("optional", None)
    if isinstance(t, str):
        key = t.strip().lower()
        if key in _ANY:
            t = "string" if code_strings and not _root else None
        elif key in _TYPE_MAP:
            t = _TYPE_MAP[key]
    if t is not None:
        out["type"] = t
    for k, v in node.items():
        if k == "properties" and isinstance(v, dict):
            out[k] = {name: normalize_schema(sub, code_strings=code_strings, _root=False) for name, sub in v.items()}
        elif k == "items" and isinstance(v, dict):
            out[k] = normalize_schema(v, code_strings=code_strings, _root=False)
        elif k == "required" and isinstance(v, list):
            out[k] = [r for r in v if isinstance(r, str)]
        elif k == "default":
            out[k] = _fix_default(v, out.get("type"))
        elif k == "format" and v not in ("date", "date-time", "time", "email", "uri", "uuid"):
            continue
        else:
            out[k] = v
    enum = out.get("enum")
    if out.get("type") == "array" and isinstance(enum, list) and enum and not any(isinstance(e, list) for e in enum):
        # BFCL writes the allowed values of an array's items on the array (live_simple: "metrics"): move them
        out["items"] = {**out.get("items", {}), "enum": out.pop("enum")}
    if out.get("type") == "object" and "properties" in out:
        props = out["properties"]
        out["required"] = [r for r in out.get("required", []) if r in props]
    return out


def _fix_default(v: Any, t: Any) -> Any:
    if t == "boolean" and isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    return v


def tool_from_bfcl(fn: dict, *, code_strings: bool = False) -> Tool:
    """A call-only :class:`Tool` from one BFCL function doc (``{"name", "description", "parameters"}``)."""
    params = normalize_schema(fn.get("parameters") or {"type": "object", "properties": {}},
                              code_strings=code_strings)
    params.setdefault("type", "object")
    if code_strings:
        params["type"] = "object"
    return Tool.from_schema(fn["name"], params, description=fn.get("description", ""), strict=False)
