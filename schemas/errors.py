"""Exceptions raised for bad schemas, bad tool definitions and invalid tool calls.

Every error names what is wrong in terms a user can act on: the tool, the argument, the JSON Schema keyword and
its JSON pointer (RFC 6901) inside the schema or instance.
"""
from __future__ import annotations

# the ``tool`` an error names for a response format's schema (``schemas.ResponseFormat``)
RESPONSE_FORMAT = "response_format"
# How the Python API relaxes a schema keyword, as the advice of a strict schema error says it (a server rewrites
# these in its request's terms: agent.openai_protocol): a tool is registered leniently; a response format says so.
RELAX_TOOL = "register with strict=False"
RELAX_RESPONSE_FORMAT = "pass ResponseFormat(schema, strict=False) (or \"strict\": false in OpenAI's json_schema)"


class SpecAgentError(Exception):
    """Base class of every exception this project raises on purpose (catch it to catch ours).

    Each subclass also derives from the built-in exception that describes it (``ValueError`` for bad input,
    ``RuntimeError`` for a failed operation, ``FileNotFoundError`` for a missing model), so existing
    ``except ValueError`` handlers keep working. Subclasses: :class:`SchemaError`, :class:`ToolError`,
    :class:`ToolCallError`, :class:`InstanceError` (here); ``constraints.GrammarError``,
    ``constraints.ConstraintError``; ``decoding.ModelNotFoundError``, ``decoding.UnsupportedModelError``, ``decoding.BadModelFileError``,
    ``decoding.ContextLengthError``, ``decoding.MTPError``; ``agent.ToolFormatError``; and in ``bench/``
    ``SkipMode`` and ``LlamaCppUnavailable``.
    """


class SchemaError(SpecAgentError, ValueError):
    """A JSON Schema is invalid, or uses keywords that cannot be enforced exactly.

    Attributes:
        pointer: JSON pointer of the offending node inside the schema (``""`` = the root).
        keyword: the JSON Schema keyword at fault (``"not"``, ``"type"``, ``"$ref"``…), or None.
        tool: the tool name the schema belongs to, if any.
        problems: every ``(pointer, keyword, message)`` found (the first one also fills the fields above).
    """

    def __init__(self, message: str, *, pointer: str = "", keyword: str | None = None,
                 tool: str | None = None, problems: list[tuple[str, str | None, str]] | None = None):
        self.pointer = pointer
        self.keyword = keyword
        self.tool = tool
        self.problems = problems or [(pointer, keyword, message)]
        prefix = f"tool {tool!r}: " if tool else ""
        super().__init__(prefix + message)


class ToolError(SpecAgentError, ValueError):
    """A tool definition is unusable (duplicate or malformed name, unsupported object, bad signature)."""


class ToolCallError(SpecAgentError, ValueError):
    """A tool call does not name a registered tool or its arguments fail validation.

    Attributes:
        tool: the tool name in the call (may be unknown).
        pointer: JSON pointer into the arguments of the first failing value (``""`` = the arguments object).
    """

    def __init__(self, message: str, *, tool: str | None = None, pointer: str = ""):
        self.tool = tool
        self.pointer = pointer
        super().__init__(message)


def json_pointer(path) -> str:
    """RFC 6901 pointer for a sequence of keys/indices: ``["a", 0, "b/c"]`` -> ``"/a/0/b~1c"``."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


class InstanceError(ToolCallError):
    """A JSON value does not satisfy its JSON Schema (post-validation of a leniently compiled grammar's output).

    Attributes:
        pointer: JSON pointer into the value of the first failing part (``""`` = the value itself).
        keyword: the schema keyword that failed (``"not"``, ``"minimum"``…).
        schema_pointer: JSON pointer of that keyword inside the schema (e.g. ``"/properties/age/not"``).
        problems: every ``(pointer, keyword, schema_pointer, message)`` found, first one first.
    """

    def __init__(self, message: str, *, pointer: str = "", keyword: str | None = None, schema_pointer: str = "",
                 tool: str | None = None, problems: list[tuple[str, str | None, str, str]] | None = None):
        self.keyword = keyword
        self.schema_pointer = schema_pointer
        self.problems = problems or [(pointer, keyword, schema_pointer, message)]
        super().__init__(message, tool=tool, pointer=pointer)
