"""Narrowing a JSON Schema for the grammar: a copy whose language is a subset of the original's, so every output
the grammar allows still validates against the original schema (validation always uses the original).

These are pure JSON Schema → JSON Schema transformations, so they live in ``schemas/`` (no grammar engine needed):
``close_objects`` (no invented keys) and ``bound_scalars`` (strings and numbers that always end within a token
budget). ``schemas.call_schema`` applies ``close_objects``; ``agent.format.turn_grammar`` applies ``bound_scalars``.
"""
from __future__ import annotations

import copy
from typing import Any

from .check import walk

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where objects that list ``properties`` but say nothing of other keys get
    ``additionalProperties: false``.

    Used for the grammar only: every output is still valid against the original schema (the language is a subset),
    and a small model can no longer wander into invented keys. Validation uses the original schema.
    """
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        if "properties" in node and not any(k in node for k in _OPEN_KEYS):
            node["additionalProperties"] = False
    return schema


def bound_scalars(schema: dict, max_string_length: int | None = None, max_decimals: int | None = None) -> dict:
    """A copy of ``schema`` whose unbounded scalars are bounded (for the grammar only; outputs stay valid).

    Strings with no ``maxLength``/``enum``/``const``/``pattern``/``format`` get ``maxLength: max_string_length``.
    With ``max_decimals``, numbers with no ``multipleOf`` get ``multipleOf: 10**-max_decimals`` (at most that many
    decimals, no exponent) and numbers and integers without bounds get ``|x| <= 1e15``. A small model can then not
    run away inside a value (seen on SmolLM2-135M: ``"3.0000…"`` until the token budget ran out).
    """
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        t = node.get("type")
        if t == "string" and max_string_length is not None and not any(
                k in node for k in ("maxLength", "enum", "const", "pattern", "format")):
            node["maxLength"] = max_string_length
        if t in ("number", "integer") and max_decimals is not None and not any(k in node for k in ("enum", "const")):
            if t == "number" and "multipleOf" not in node:
                node["multipleOf"] = 10.0 ** -max_decimals
            if not any(k in node for k in ("maximum", "exclusiveMaximum")):
                node["maximum"] = 10 ** 15
            if not any(k in node for k in ("minimum", "exclusiveMinimum")):
                node["minimum"] = -(10 ** 15)
    return schema
