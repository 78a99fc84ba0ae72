"""BFCL's function-doc dialect -> JSON Schema (the scorer is in ``bench/bfcl.py``).

Dialect (see ``../shared/data/bfcl/NONSTANDARD_TYPES.md``): ``dict`` -> object, ``float``/``double`` -> number,
``tuple`` -> array, ``any`` or ``""`` -> string (as BFCL's FC harness declares it, ``GORILLA_TO_OPENAPI``, and as its
checker reads a Python ``any``, ``PYTHON_TYPE_MAPPING["any"] = str``: no other JSON type can be right), Java/JS
names (``String``, ``Boolean``, ``long``, ``HashMap``, ``ArrayList``, ``Array``…) mapped to their JSON types, a
non-standard ``optional`` key dropped, string booleans in ``default`` turned into booleans, an ``enum`` of scalars on an array moved to its ``items``.
Java/JavaScript docs are first rewritten as BFCL's FC harness rewrites them (:func:`language_specific_pre_processing`):
every parameter a string of source code.
"""
from __future__ import annotations

import copy
import json
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


def normalize_schema(node: Any, *, _root: bool = True) -> Any:
    """Return a JSON Schema for a BFCL ``parameters`` node (input unchanged). A value of type ``any`` (or ``""``) is
    a string, in every language: BFCL's FC harness declares it ``"string"`` (``bfcl_eval``'s ``GORILLA_TO_OPENAPI``)
    and its checker takes a Python ``any`` only as a ``str`` (``PYTHON_TYPE_MAPPING``), a Java/JavaScript one as
    source code; every ground truth in ``../shared`` holds a string there. (Before 2026-12-06 a Python ``any`` had
    no type constraint, and the default model wrote objects there that the checker could never take.)"""
    if not isinstance(node, dict):
        return node
    node = copy.deepcopy(node)
    out: dict[str, Any] = {}
    t = node.pop("type", None)
    node.pop("optional", None)
    if isinstance(t, str):
        key = t.strip().lower()
        if key in _ANY:
            t = None if _root else "string"
        elif key in _TYPE_MAP:
            t = _TYPE_MAP[key]
    if t is not None:
        out["type"] = t
    for k, v in node.items():
        if k == "properties" and isinstance(v, dict):
            out[k] = {name: normalize_schema(sub, _root=False) for name, sub in v.items()}
        elif k == "items" and isinstance(v, dict):
            out[k] = normalize_schema(v, _root=False)
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


# BFCL's FC harness (``bfcl_eval/utils.py``: ``_func_doc_language_specific_pre_processing``, then
# ``model_handler/utils.py``: ``convert_to_tool``) declares every Java/JavaScript parameter as a string, says so in
# its description, and its checker rejects any other JSON type (``type_error:java`` / ``type_error:js``).
_LANGUAGE_HINT = {"java": " Note that the provided function is in Java 8 SDK syntax.",
                  "javascript": " Note that the provided function is in JavaScript syntax."}
_LANGUAGE_NAME = {"java": "Java", "javascript": "JavaScript"}
# Every other category (Python, REST, live, irrelevance) gets the Python hint (``_get_language_specific_hint``).
_PYTHON_HINT = " Note that the provided function is in Python 3 syntax."


def language_specific_pre_processing(fn: dict, language: str) -> dict:
    """BFCL's ``_func_doc_language_specific_pre_processing`` for one function doc (a copy): the language hint
    appended to the description (Python's for every language but Java and JavaScript, as BFCL does); for
    Java/JavaScript, every top-level parameter declared
    ``"string"`` with its original type named in its description ("... in string representation."), an
    ``Array``/``ArrayList``/``array``'s ``items`` and a JS ``dict``'s ``properties`` moved into the description."""
    fn = copy.deepcopy(fn)
    if language not in _LANGUAGE_HINT:
        fn["description"] = fn.get("description", "") + _PYTHON_HINT
        return fn
    lang = _LANGUAGE_NAME[language]
    fn["description"] = fn.get("description", "") + _LANGUAGE_HINT[language]
    for value in fn["parameters"]["properties"].values():
        value.setdefault("description", "")
        if value["type"] == "any":
            value["description"] += f" This parameter can be of any type of {lang} object in string representation."
        else:
            value["description"] += f" This is {lang} {value['type']} type parameter in string representation."
        if value["type"] in (("ArrayList", "Array") if language == "java" else ("array",)):
            value["description"] += (f" The list elements are of type {value['items']['type']}; they are not in "
                                     f"string representation.")
            del value["items"]
        if language == "javascript" and value["type"] == "dict" and "properties" in value:
            value["description"] += (f" The dictionary entries have the following schema; they are not in string "
                                     f"representation. {json.dumps(value['properties'])}")
            del value["properties"]
        value["type"] = "string"
    return fn


# The literal syntax BFCL's checker parses for a parameter declared with a Java/JavaScript type (``bfcl_eval``'s
# ``java_type_converter`` / ``js_type_converter``: a value in any other syntax stays a string and fails the type's
# ground truth, e.g. ``"42"`` for a Java ``long``, which must read ``42L``). The harness declares these parameters as
# strings; the grammar keeps the scalar ones strings of that syntax or a name (a variable or constant such as
# ``ResultSet.CONCUR_READ_ONLY``, which ground truths hold for typed parameters too).
LITERAL_SYNTAX = {
    "java": {"integer": r"-?\d+", "int": r"-?\d+", "short": r"-?\d+", "byte": r"-?\d+", "long": r"-?\d+L",
             "float": r"-?\d+(\.\d+)?([eE][+-]?\d+)?f", "double": r"-?\d+(\.\d+)?([eE][+-]?\d+)?",
             "boolean": r"true|false"},
    "javascript": {"integer": r"-?\d+", "float": r"-?\d+(\.\d+)?", "Bigint": r"-?\d+n", "Boolean": r"true|false"},
}
NAME_SYNTAX = r"[A-Za-z_$][A-Za-z0-9_$]*(\.[A-Za-z_$][A-Za-z0-9_$]*)*"
# Java collections are Java expressions too: BFCL's converter (``parse_arraylist`` / ``parse_array`` /
# ``parse_hashmap``) reads ``new ArrayList<>(Arrays.asList(a, b))``, ``new T[]{a, b}`` and ``new HashMap<K, V>() {{
# put("k", v); }}``, its elements in the literal syntax of the declared item type, and keeps anything else a string
# (so ``"[101, 202]"`` never equals a list). Chosen on the dev split (docs/benchmarks.md, "Java collections as BFCL
# reads them"); a ground truth that holds a plain string for a collection (simple_java_35: a ``byte[]`` given as
# ``"user:online:both"``) cannot be written. JavaScript's ``array``/``dict`` stay free: its converter reads ``[…]``.
_JAVA_STRING = r'"[^",\\]*"'  # the converter splits elements at every comma, so none inside a string
_JAVA_ANY_VALUE = rf"{_JAVA_STRING}|-?\d+(\.\d+)?([eE][+-]?\d+)?[lLfF]?|true|false|{NAME_SYNTAX}"


def java_collection_syntax(param: dict) -> str | None:
    """The regular expression of the Java expression BFCL's checker parses for a parameter declared ``ArrayList``,
    ``Array`` or ``HashMap`` (elements in the syntax of ``items.type`` where given), else None."""
    kind = param.get("type")
    item = (param.get("items") or {}).get("type") if isinstance(param.get("items"), dict) else None
    element = {"String": _JAVA_STRING, "char": r"'.'", **LITERAL_SYNTAX["java"]}.get(item, _JAVA_ANY_VALUE)
    elements = f"({element})(, ({element}))*"
    generic = r"<([A-Z]\w*)?>"  # ``<>`` or a type name: the converter reads ``<\w*>``
    if kind == "ArrayList":
        return rf"new ArrayList{generic}\(Arrays\.asList\({elements}\)\)|new ArrayList{generic}\(\)"
    if kind == "Array":
        return rf"new \w+\[\] ?\{{({elements})?\}}"
    if kind == "HashMap":
        put = rf'put\({_JAVA_STRING}, ({_JAVA_ANY_VALUE})\);'
        return rf"new HashMap<([A-Z]\w*, [A-Z]\w*)?>\(\)( \{{\{{( {put})+ \}}\}})?"
    return None


def literal_syntax(fn: dict, language: str) -> dict[str, dict]:
    """``{parameter: {"pattern": …}}`` keeping each top-level Java/JavaScript parameter of the BFCL doc ``fn`` (as
    written, before :func:`language_specific_pre_processing`) to the literal syntax of its declared type
    (:data:`LITERAL_SYNTAX`; Java collections: :func:`java_collection_syntax`) or a name (:data:`NAME_SYNTAX`);
    parameters of ``String``/``any`` type are left free."""
    table = LITERAL_SYNTAX.get(language, {})
    out = {}
    for name, p in (fn.get("parameters") or {}).get("properties", {}).items():
        if not isinstance(p, dict):
            continue
        syntax = table.get(p.get("type")) or (java_collection_syntax(p) if language == "java" else None)
        if syntax:
            out[name] = {"pattern": f"^({syntax}|{NAME_SYNTAX})$"}
    return out


def tool_from_bfcl(fn: dict, *, code_strings: bool = False, language: str | None = None,
                   literals: bool = True) -> Tool:
    """A call-only :class:`Tool` from one BFCL function doc (``{"name", "description", "parameters"}``).

    Args:
        language: the doc as BFCL's FC harness declares it (:func:`language_specific_pre_processing`):
            ``"java"`` / ``"javascript"``: every parameter a string of source code, so the grammar writes only
            strings there; ``"python"`` or None: the Python hint appended to the description.
        code_strings: the older switch for the same (``language="java"`` when no language is given).
        literals: Java/JavaScript: each parameter's string kept to the literal syntax of its declared type
            (:func:`literal_syntax`).
    """
    language = language or ("java" if code_strings else None)
    syntax = literal_syntax(fn, language) if literals and language in _LANGUAGE_HINT else {}
    fn = language_specific_pre_processing(fn, language or "python")
    params = normalize_schema(fn.get("parameters") or {"type": "object", "properties": {}})
    params.setdefault("type", "object")
    if language in _LANGUAGE_HINT:
        params["type"] = "object"
    for name, keywords in syntax.items():
        params["properties"][name].update(keywords)
    return Tool.from_schema(fn["name"], params, description=fn.get("description", ""), strict=False)
