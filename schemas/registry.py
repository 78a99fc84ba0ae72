"""ToolRegistry: the set of tools an agent may call, with the tool-call envelope schema."""
from __future__ import annotations

import copy
import json
from typing import Any, Callable, Iterable, Iterator

from .errors import ToolCallError, ToolError
from .narrow import narrow_for_grammar
from .tool import Tool, ToolCall, as_tool


class ToolRegistry:
    """Registered tools by name. Duplicate names are rejected; lookups of unknown names raise ToolCallError."""

    def __init__(self, tools: Iterable[Any] = (), *, strict: bool = True):
        self.strict = strict
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.register(t)

    def register(self, obj: Any, *, strict: bool | None = None) -> Tool:
        """Register a function, pydantic model, OpenAI dict or Tool; returns the Tool.

        Raises:
            ToolError: a tool with that name is already registered (the registry is unchanged).
            SchemaError: the schema is invalid or (strict) not enforceable; names keyword and pointer.
        """
        tool = as_tool(obj, strict=self.strict if strict is None else strict)
        if tool.name in self._tools:
            raise ToolError(f"duplicate tool name {tool.name!r}: a tool with this name is already registered")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise ToolCallError(f"unknown tool {name!r}; registered tools: {sorted(self._tools)}",
                                tool=name) from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def validate_call(self, name: str, arguments: Any, call_id: str | None = None) -> ToolCall:
        """Validate a call by tool name (raises ToolCallError for unknown tools or invalid arguments)."""
        return self.get(name).make_call(arguments, call_id)

    def parse_call(self, obj: Any) -> ToolCall:
        """Validate an envelope ``{"name": ..., "arguments": {...}}`` into a ToolCall."""
        if not isinstance(obj, dict) or "name" not in obj or "arguments" not in obj:
            raise ToolCallError(f"a tool call must be an object with 'name' and 'arguments', got {obj!r:.200}")
        args = obj["arguments"]
        if isinstance(args, str):  # OpenAI messages carry arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise ToolCallError(f"tool {obj['name']!r}: arguments are not valid JSON: {e}",
                                    tool=obj["name"]) from None
        return self.validate_call(obj["name"], args, obj.get("id"))


def call_schema(tools: Iterable[Tool], *, max_string_length: int | None = None, max_decimals: int | None = None,
                max_items: int | None = None, excluded_integer_prefixes: frozenset[str] = frozenset(),
                compiles: Callable[[Any, bool], bool] | None = None) -> dict:
    """JSON Schema of one tool call ``{"name": <const>, "arguments": <that tool's schema>}``.

    One ``anyOf`` branch per tool: the name (a ``const``) selects the arguments schema, narrowed for the grammar
    by :func:`schemas.narrow.narrow_for_grammar` (closed objects; with ``max_string_length`` / ``max_decimals``,
    bounded scalars; with ``max_items``, bounded arrays; with ``excluded_integer_prefixes``, integers that start
    with none of them); with the grammar engine's ``compiles`` check, a narrowing that would leave a tool's schema
    uncompilable is dropped for that tool, so one tool never breaks another. A tool schema that uses local ``$ref`` is moved under ``$defs`` with its references
    rewritten, so pointers still resolve.
    """
    tools = list(tools)
    if not tools:
        raise ToolError("no tools to call")
    defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(tools):
        params = narrow_for_grammar(tool.parameters, lenient=not tool.strict, max_string_length=max_string_length,
                                    max_decimals=max_decimals, max_items=max_items,
                                    excluded_integer_prefixes=excluded_integer_prefixes, compiles=compiles)
        if _has_local_ref(params):
            key = f"tool{i}"
            defs[key] = _rewrite_refs(copy.deepcopy(params), f"#/$defs/{key}")
            params = {"$ref": f"#/$defs/{key}"}
        branches.append({"type": "object",
                         "properties": {"name": {"const": tool.name}, "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(_has_local_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    return False


# keywords whose value maps names (property names, definition names) to subschemas: a key there is a name, never a
# keyword ("default", "enum" are parameter names as often as keywords)
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# keywords whose value is an instance, not a schema: nothing inside is a reference
_INSTANCE_VALUES = ("const", "enum", "default", "examples")


def _rewrite_refs(node: Any, base: str, *, names: bool = False) -> Any:
    """``node`` (a schema; with ``names``, a map of names to schemas) with every local ``$ref`` re-rooted under
    ``base`` (``#/x`` → ``base/x``), instance values (``const``, ``enum``, ``default``, ``examples``) left as they
    are, and so is a subschema with its own ``$id``: a resource of its own, against which its ``#…`` references
    resolve wherever it stands."""
    if isinstance(node, dict):
        if not names and "$id" in node:
            return node
        if names:
            return {k: _rewrite_refs(v, base) for k, v in node.items()}
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = base + v[1:] if v.startswith("#/") or v == "#" else v
            elif k in _INSTANCE_VALUES:
                out[k] = v
            else:
                out[k] = _rewrite_refs(v, base, names=k in _NAMED_SUBSCHEMAS)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, base) for v in node]
    return node
