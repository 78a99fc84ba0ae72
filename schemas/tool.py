"""Tool definitions: typed Python functions, pydantic models, raw JSON Schema and OpenAI-style dicts -> :class:`Tool`.

A :class:`Tool` carries a name, a description, the JSON Schema of its arguments and, optionally, a Python callable.
Arguments decoded by the model are validated with pydantic (function and model tools) or jsonschema (raw schemas)
into a typed :class:`ToolCall`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

import docstring_parser
import jsonschema
import pydantic
from pydantic.fields import FieldInfo

from .check import check_enforceable, check_valid, instance_validator, walk
from .errors import RESPONSE_FORMAT, SchemaError, ToolCallError, ToolError, json_pointer

NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ToolCall:
    """One validated tool call.

    Attributes:
        name: the tool's registered name.
        arguments: the arguments as the engine returned them (parsed JSON object; an engine may leave out
            optional arguments the model wrote).
        value: the validated arguments: a pydantic model instance for function/model tools, a dict for raw schemas.
        id: an OpenAI-style call id (``call_<hex>``).
    """

    name: str
    arguments: dict
    value: Any
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict:
        """OpenAI ``tool_calls`` entry: ``{"id", "type": "function", "function": {"name", "arguments": str}}``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class Tool:
    """A callable (or call-only) tool with a JSON Schema for its arguments.

    Attributes:
        name: unique name, ``[A-Za-z0-9_.-]{1,64}``.
        description: shown to the model.
        parameters: JSON Schema of the arguments object.
        fn: the Python callable run with the validated arguments, or None (the call is returned to the caller).
        model: pydantic model that validates the arguments (function and model tools), or None (jsonschema).
        strict: True: keywords the grammar cannot enforce are rejected at registration; False: relaxed in the
            grammar and every decoded call is validated with jsonschema/pydantic afterwards.
        thread_safe: the agent may run several calls of this tool at once.
    """

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any] | None = None
    model: type[pydantic.BaseModel] | None = None
    strict: bool = True
    thread_safe: bool = True
    _validator: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise ToolError(f"tool name {self.name!r} must match {NAME_RE.pattern}")
        if not isinstance(self.parameters, dict):
            raise SchemaError(f"parameters must be a JSON Schema object, got {type(self.parameters).__name__}",
                              tool=self.name)
        kind = self.parameters.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise SchemaError(f"parameters must be a JSON Schema of type 'object' (the arguments are a JSON object), "
                              f"got type {kind!r}", pointer="/type", keyword="type", tool=self.name)
        check_valid(self.parameters, tool=self.name)
        check_enforceable(self.parameters, tool=self.name, lenient=not self.strict)
        if self.model is None:  # formats are assertions, as in the grammar (2023-02-29 is no date)
            self._validator = instance_validator(self.parameters)

    # -- validation ---------------------------------------------------------------------------------------------
    def validate(self, arguments: Any) -> Any:
        """Validate decoded arguments; returns a pydantic instance (model/function tools) or the dict (raw schema).

        Raises:
            ToolCallError: naming the tool, the argument's JSON pointer and what is wrong.
        """
        if not isinstance(arguments, dict):
            raise ToolCallError(f"tool {self.name!r}: arguments must be a JSON object, got "
                                f"{type(arguments).__name__}", tool=self.name)
        return _validate_value(arguments, self.model, self._validator, f"tool {self.name!r}: argument", self.name)

    def make_call(self, arguments: Any, call_id: str | None = None) -> ToolCall:
        """Validate ``arguments`` and wrap them into a :class:`ToolCall` (raises :class:`ToolCallError`)."""
        value = self.validate(arguments)
        call = ToolCall(self.name, arguments, value)
        if call_id:
            call.id = call_id
        return call

    def invoke(self, call: ToolCall) -> Any:
        """Run ``fn`` with the validated arguments of ``call`` and return its result; an ``async def`` tool (any
        awaitable result) is awaited to completion, in a fresh event loop (on a helper thread when this thread
        already runs one). Raises ToolError when the tool has no callable."""
        if self.fn is None:
            raise ToolError(f"tool {self.name!r} has no Python callable to run")
        value = call.value
        if isinstance(value, pydantic.BaseModel):
            if getattr(self, "_takes_model", False):
                return _awaited(self.fn(value))
            names = getattr(self, "_parameters", {})  # field -> the function's parameter (from_function)
            kwargs = {names.get(k, f.alias or k): getattr(value, k) for k, f in type(value).model_fields.items()}
            args = [kwargs.pop(names.get(k, k)) for k in getattr(self, "_positional", ())]
            return _awaited(self.fn(*args, **kwargs))
        return _awaited(self.fn(**value))

    def to_openai(self) -> dict:
        """OpenAI tool dict ``{"type": "function", "function": {"name", "description", "parameters"}}``, with
        ``"strict": false`` for a lenient tool (as OpenAI's API and this project's server read it)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if not self.strict:
            function["strict"] = False
        return {"type": "function", "function": function}

    # -- constructors -------------------------------------------------------------------------------------------
    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                      strict: bool = True) -> "Tool":
        """Build a tool from a typed function: parameters from the signature, descriptions from the docstring.

        Per-argument descriptions come from the docstring: Google ``Args:`` (``name (type): text``), reST/Sphinx
        ``:param name: text`` or NumPy ``Parameters`` sections.

        Raises:
            ToolError: a parameter without annotation, ``*args`` / ``**kwargs``, or annotations pydantic cannot
                build a model from (naming the tool).
        """
        inner = fn.func if isinstance(fn, functools.partial) else fn  # a partial has no name or docstring
        tool_name = name or getattr(inner, "__name__", None)
        if not tool_name:
            raise ToolError(f"cannot name a tool for {fn!r}: pass name= (Tool.from_function(fn, name=...))")
        doc = inspect.getdoc(inner) or ""
        summary, arg_docs = _parse_docstring(doc)
        try:
            sig = inspect.signature(fn)
            hints = _type_hints(inner)
        except (TypeError, ValueError) as e:
            raise ToolError(f"tool {tool_name!r}: cannot read the signature of {fn!r}: {e}") from None
        fields: dict[str, Any] = {}
        positional: list[str] = []  # the fields of positional-only parameters (``def f(a, /)``), in order
        parameters: dict[str, str] = {}  # field -> parameter name (a field may be renamed, its alias another name)
        bound = set(fn.keywords) if isinstance(fn, functools.partial) else set()  # fixed by the partial
        for pname, p in sig.parameters.items():
            if pname in bound:
                continue
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ToolError(f"tool {tool_name!r}: parameter {pname!r} is *args/**kwargs; tools need named, "
                                f"typed parameters")
            if pname not in hints:
                raise ToolError(f"tool {tool_name!r}: parameter {pname!r} has no type annotation")
            if isinstance(hints[pname], str):
                raise ToolError(f"tool {tool_name!r}: parameter {pname!r}: cannot resolve its annotation "
                                f"{hints[pname]!r} ({_LOCAL_TYPE_ADVICE})")
            default = ... if p.default is p.empty else p.default
            doc = arg_docs.get(pname)  # none: an Annotated[..., Field(description=...)] keeps its own
            extra = {"description": doc} if doc else {}
            field = pname
            if pname.startswith("_") or pname.startswith("model_") or hasattr(pydantic.BaseModel, pname):
                # a name pydantic keeps for itself (model_config, model_dump, _x, schema): a field of another
                # name with the parameter's as its alias (the schema, validation and invoke() use the alias)
                field, extra = f"arg_{len(fields)}_", {**extra, "alias": pname}
            parameters[field] = pname
            if p.kind == p.POSITIONAL_ONLY:
                positional.append(field)
            if isinstance(default, FieldInfo):
                # `n: int = Field(5, ge=1)`: the default and constraints of that Field, as pydantic's validate_call
                # reads it (a docstring's description comes first, as for an Annotated Field)
                own = (pydantic.Field(default_factory=default.default_factory, **extra) if default.default_factory
                       else pydantic.Field(... if default.is_required() else default.default, **extra))
                fields[field] = (Annotated[hints[pname], default], own)
            else:
                fields[field] = (hints[pname], pydantic.Field(default, **extra))
        try:
            model = pydantic.create_model(_model_name(tool_name), **fields)
            schema = _clean_pydantic_schema(model.model_json_schema())
        except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError, NameError) as e:
            raise ToolError(f"tool {tool_name!r}: cannot build the model of its arguments from the signature: "
                            f"{str(e).splitlines()[0]} ({_LOCAL_TYPE_ADVICE})") from None
        tool = cls(tool_name, description if description is not None else summary, schema, fn=fn, model=model,
                   strict=strict)
        tool._positional, tool._parameters = positional, parameters
        return tool

    @classmethod
    def from_model(cls, model: type[pydantic.BaseModel], *, name: str | None = None,
                   description: str | None = None, fn: Callable[..., Any] | None = None,
                   strict: bool = True) -> "Tool":
        """Build a tool from a pydantic model: its fields are the arguments; the validated value is an instance.

        ``fn``, if given, is called with the model instance.
        """
        schema = _clean_pydantic_schema(model.model_json_schema())
        tool = cls(name or model.__name__, description if description is not None else
                   (inspect.getdoc(model) or "").split("\n\n")[0], schema, fn=fn, model=model, strict=strict)
        tool._takes_model = True
        return tool

    @classmethod
    def from_schema(cls, name: str, parameters: dict, *, description: str = "",
                    fn: Callable[..., Any] | None = None, strict: bool = True) -> "Tool":
        """Build a tool from a raw JSON Schema (validated with jsonschema); ``fn`` gets the arguments as kwargs."""
        return cls(name, description, copy.deepcopy(parameters), fn=fn, strict=strict)

    @classmethod
    def from_openai(cls, spec: dict, *, fn: Callable[..., Any] | None = None, strict: bool = True) -> "Tool":
        """Build a tool from ``{"type": "function", "function": {...}}`` or the bare ``{"name", "parameters"}``;
        the dict's ``"strict": false`` makes it lenient as ``strict=False`` does."""
        if spec.get("type", "function") != "function":
            raise ToolError(f"OpenAI-style tool dict has type {spec['type']!r}: only 'function' tools can be called")
        if "function" in spec and "name" not in spec:  # the wrapped form {"type": "function", "function": {...}}
            if not isinstance(spec["function"], dict):
                raise ToolError(f"OpenAI-style tool dict: 'function' must be an object with 'name' and "
                                f"'parameters', got {type(spec['function']).__name__}")
            spec = spec["function"]
        if "name" not in spec:
            raise ToolError(f"OpenAI-style tool dict needs a 'name' (got keys {sorted(spec)})")
        params = spec.get("parameters", {"type": "object", "properties": {}})
        return cls.from_schema(spec["name"], params, description=spec.get("description", ""), fn=fn,
                               strict=strict and spec.get("strict") is not False)


class ResponseFormat:
    """A structured final answer: a pydantic model class or a JSON Schema (any JSON type at the root; OpenAI's
    ``{"type": "json_schema", "json_schema": {"schema": ...}}`` and ``{"type": "json_object"}`` are read as theirs).

    Attributes:
        schema: the JSON Schema the grammar enforces.
        strict: True: the grammar enforces it exactly; False: keywords it cannot enforce are relaxed in the
            grammar, and :meth:`validate` checks every answer.
    Raises (constructor):
        SchemaError: invalid or (strict) unenforceable schema, naming keyword and pointer.
    """

    def __init__(self, spec: Any, *, strict: bool = True):
        if isinstance(spec, dict) and spec.get("type") == "json_schema" and isinstance(spec.get("json_schema"), dict):
            # OpenAI's wrapper {"type": "json_schema", "json_schema": {"schema": ..., "strict": ...}} (no JSON
            # Schema has type "json_schema"): its schema
            strict = strict and spec["json_schema"].get("strict") is not False
            spec = spec["json_schema"].get("schema", {})
        elif spec == {"type": "json_object"}:  # OpenAI's JSON mode: any JSON object
            spec = {"type": "object"}
        self.model = spec if isinstance(spec, type) and issubclass(spec, pydantic.BaseModel) else None
        if self.model is not None:
            self.schema = _clean_pydantic_schema(self.model.model_json_schema())
        elif isinstance(spec, (dict, bool)):
            self.schema = copy.deepcopy(spec)
        else:
            raise ToolError(f"response_format must be a pydantic model class or a JSON Schema, got "
                            f"{type(spec).__name__}")
        self.strict = strict
        check_valid(self.schema, tool=RESPONSE_FORMAT)
        check_enforceable(self.schema, tool=RESPONSE_FORMAT, lenient=not strict)
        self._validator = None if self.model else instance_validator(self.schema)

    def validate(self, value: Any) -> Any:
        """The validated answer: a model instance or the JSON value. Raises ToolCallError naming the pointer."""
        return _validate_value(value, self.model, self._validator, "response", None)


def _validate_value(value: Any, model: type[pydantic.BaseModel] | None, validator: Any, what: str,
                    tool: str | None) -> Any:
    """Validate with the pydantic ``model`` (-> instance) or the jsonschema ``validator`` (-> the value).

    Raises:
        ToolCallError: ``"<what> at <pointer> …"`` naming the first failing value's JSON pointer and the keyword.
    """
    if model is not None:
        try:
            return model.model_validate(value)
        except pydantic.ValidationError as e:
            err = e.errors()[0]
            pointer = json_pointer(err["loc"])
            raise ToolCallError(f"{what} at {pointer or '/'} is invalid: {err['msg']} ({len(e.errors())} error(s))",
                                tool=tool, pointer=pointer) from None
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        pointer = json_pointer(e.absolute_path)
        raise ToolCallError(f"{what} at {pointer or '/'} fails keyword {e.validator!r}: {e.message}",
                            tool=tool, pointer=pointer)
    return value


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _awaited(value: Any) -> Any:
    """``value``, or what it resolves to when it is awaitable (the coroutine of an ``async def`` tool)."""
    if not inspect.isawaitable(value):
        return value
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no event loop in this thread: run one here
        return asyncio.run(_await(value))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:  # this thread's loop is busy running us
        return pool.submit(asyncio.run, _await(value)).result()


def as_tool(obj: Any, *, strict: bool = True) -> Tool:
    """Coerce a function, pydantic model class, OpenAI dict or :class:`Tool` into a :class:`Tool`.

    A raw JSON Schema dict needs a name: pass ``{"name": ..., "parameters": schema}`` or use
    :meth:`Tool.from_schema`.
    """
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, type) and issubclass(obj, pydantic.BaseModel):
        return Tool.from_model(obj, strict=strict)
    if isinstance(obj, dict):
        kind = obj.get("type")
        if "function" in obj or "name" in obj or (isinstance(kind, str) and kind not in _JSON_TYPES):
            return Tool.from_openai(obj, strict=strict)  # an OpenAI tool dict, or one of a type it cannot call
        raise ToolError("a raw JSON Schema needs a tool name: use Tool.from_schema(name, schema) or "
                        "{'name': ..., 'parameters': schema}")
    if callable(obj):
        return Tool.from_function(obj, strict=strict)
    raise ToolError(f"cannot make a tool from {type(obj).__name__}: pass a function, a pydantic model, "
                    f"an OpenAI tool dict or a Tool")


_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}  # a raw schema's "type"


# -- helpers ----------------------------------------------------------------------------------------------------
def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """``(summary, {argument: description})`` of a docstring in Google (``Args:``), reST/Sphinx (``:param a:``) or
    NumPy (``Parameters`` / ``----------``) style, detected by ``docstring_parser`` (only parameter sections count:
    not ``Attributes``); the summary is the text before the sections, whitespace collapsed. A docstring it cannot
    parse, or where it finds no parameter and the lenient Google reader :func:`_parse_google` does (an ``Args:``
    line without a colon) or ends the summary sooner (an empty ``Args:``), is read by :func:`_parse_google`."""
    try:
        parsed = docstring_parser.parse(doc)
    except docstring_parser.ParseError:
        return _parse_google(doc)
    args = {p.arg_name.strip(): " ".join((p.description or "").split()) for p in parsed.params
            if p.args and p.args[0] in _PARAM_SECTIONS}
    summary = " ".join(" ".join(t for t in (parsed.short_description, parsed.long_description) if t).split())
    if not args:  # the Google reader's where it finds parameters, or a shorter summary (it stopped at a section)
        google = _parse_google(doc)
        if google[1] or len(google[0]) < len(summary):
            return google
    return summary, args


_PARAM_SECTIONS = {"param", "parameter", "arg", "argument", "key", "keyword"}  # docstring_parser's section keys


_ARGS_HEADER = re.compile(r"^(Args|Arguments|Parameters|Params):\s*$", re.I)
_SECTION = re.compile(r"^(Returns?|Raises|Yields|Examples?|Notes?):\s*$", re.I)
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def _parse_google(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (summary, {arg: description}), leniently (a section line without a
    colon, an unindented ``Args:`` block): where ``docstring_parser`` gives up."""
    lines = doc.splitlines()
    summary_lines: list[str] = []
    args: dict[str, str] = {}
    i = 0
    while i < len(lines) and not _ARGS_HEADER.match(lines[i].strip()) and not _SECTION.match(lines[i].strip()):
        summary_lines.append(lines[i])
        i += 1
    current = None
    in_args = False
    for line in lines[i:]:
        s = line.strip()
        if _ARGS_HEADER.match(s):
            in_args = True
            continue
        if _SECTION.match(s):
            in_args = False
            continue
        if not in_args or not s:
            continue
        m = _ARG_LINE.match(line)
        indent = len(line) - len(line.lstrip())
        if m and (current is None or indent <= args.get("__indent__", indent)):
            current = m.group(1)
            args[current] = m.group(3).strip()
            args.setdefault("__indent__", indent)
        elif current:
            args[current] = (args[current] + " " + s).strip()
    args.pop("__indent__", None)
    summary = " ".join(" ".join(summary_lines).split())
    return summary, args


# why an annotation may not resolve, and what to do (both from_function errors about annotations end with it)
_LOCAL_TYPE_ADVICE = ("a type defined inside a function cannot be resolved from a string annotation, e.g. under "
                      "`from __future__ import annotations`: define it at module level")


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    import typing
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:  # an unresolved forward reference: resolve each annotation alone (a str where it fails)
        hints = {}
        for k, v in getattr(fn, "__annotations__", {}).items():
            try:
                hints[k] = typing.get_type_hints(_Annotated(k, v, fn), include_extras=True)[k]
            except Exception:
                hints[k] = v
        return hints


class _Annotated:
    """One annotation of ``fn`` alone, for ``typing.get_type_hints`` (resolved in ``fn``'s globals)."""

    def __init__(self, name: str, annotation: Any, fn: Callable[..., Any]):
        self.__annotations__ = {name: annotation}
        self.__globals__ = getattr(fn, "__globals__", {})
        self.__module__ = getattr(fn, "__module__", None)


def _model_name(tool_name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]", tool_name) if part) + "Args"


def _clean_pydantic_schema(schema: dict) -> dict:
    """Drop pydantic's ``title`` annotations (noise for the model and the grammar); keep everything else."""
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        title = node.get("title")
        if isinstance(title, str):
            del node["title"]
    return schema
