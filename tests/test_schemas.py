"""schemas/: tool definitions -> JSON Schema, registry, envelope, validation, BFCL dialect, registration errors."""
from __future__ import annotations

import enum
import re
from typing import Annotated, Literal, Optional

import jsonschema
import pydantic
import pytest

import constraints  # noqa: F401  (installs the grammar engine check used by strict registration)
from bench.bfcl_dialect import normalize_schema, tool_from_bfcl
from schemas import SchemaError, Tool, ToolCallError, ToolError, ToolRegistry, call_schema, close_objects


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Address(pydantic.BaseModel):
    street: str
    zip_code: int


def book(city: str, nights: int = 2, note: Optional[str] = None, color: Color = Color.RED,
         mode: Literal["fast", "slow"] = "fast", tags: list[str] = [], address: Optional[Address] = None) -> str:
    """Book a hotel.

    Args:
        city: Where to stay.
        nights (int): How many nights,
            at least one.
    """
    return f"{city}:{nights}"


def test_function_schema_carries_types_defaults_optional_enums_lists_and_nested_models():
    t = Tool.from_function(book)
    p = t.parameters
    assert t.name == "book" and t.description == "Book a hotel."
    assert p["required"] == ["city"]
    props = p["properties"]
    assert props["city"] == {"type": "string", "description": "Where to stay."}
    assert props["nights"]["type"] == "integer" and props["nights"]["default"] == 2
    assert props["nights"]["description"] == "How many nights, at least one."
    assert {"type": "null"} in props["note"]["anyOf"]
    assert props["mode"]["enum"] == ["fast", "slow"]
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert "$defs" in p and set(p["$defs"]) == {"Address", "Color"}
    assert p["$defs"]["Color"]["enum"] == ["red", "blue"]
    assert "title" not in props["city"]


def test_function_tool_validates_into_typed_values_and_invokes():
    t = Tool.from_function(book)
    call = t.make_call({"city": "Oslo", "address": {"street": "Main", "zip_code": 5}})
    assert isinstance(call.value.address, Address) and call.value.nights == 2
    assert t.invoke(call) == "Oslo:2"


def test_invalid_arguments_name_the_tool_and_the_pointer():
    t = Tool.from_function(book)
    with pytest.raises(ToolCallError) as e:
        t.make_call({"city": "Oslo", "address": {"street": "Main", "zip_code": "x"}})
    assert e.value.tool == "book" and e.value.pointer == "/address/zip_code"
    raw = Tool.from_schema("area", {"type": "object", "properties": {"r": {"type": "number", "minimum": 0}},
                                    "required": ["r"]})
    with pytest.raises(ToolCallError) as e:
        raw.make_call({"r": -1})
    assert e.value.pointer == "/r" and "minimum" in str(e.value)


def test_pydantic_model_tool_returns_model_instances():
    class Search(pydantic.BaseModel):
        """Search the web."""
        query: str
        limit: int = 5

    t = Tool.from_model(Search)
    assert t.name == "Search" and t.description == "Search the web."
    assert isinstance(t.make_call({"query": "x"}).value, Search)


def test_openai_dict_and_bare_function_dict():
    spec = {"type": "function", "function": {"name": "get_time", "description": "Time now.",
                                             "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
    t = Tool.from_openai(spec)
    assert t.name == "get_time" and t.parameters["properties"]["tz"] == {"type": "string"}
    assert Tool.from_openai(spec["function"]).name == "get_time"
    assert t.to_openai()["function"]["name"] == "get_time"


def test_duplicate_tool_names_rejected_and_registry_unchanged():
    reg = ToolRegistry([book])
    with pytest.raises(ToolError, match="duplicate tool name 'book'"):
        reg.register(book)
    assert reg.names == ["book"]


def test_unknown_tool_lookup_names_the_tool():
    reg = ToolRegistry([book])
    with pytest.raises(ToolCallError, match="unknown tool 'nope'"):
        reg.parse_call({"name": "nope", "arguments": {}})


def test_schema_with_unknown_type_rejected_with_pointer():
    with pytest.raises(SchemaError) as e:
        Tool.from_schema("bad", {"type": "objekt"})
    assert e.value.keyword == "type" and e.value.pointer == "/type" and "bad" in str(e.value)


def test_schema_using_not_rejected_strictly_with_pointer_and_advice():
    schema = {"type": "object", "properties": {"age": {"type": "integer", "not": {"const": 0}}}}
    with pytest.raises(SchemaError) as e:
        Tool.from_schema("person", schema)
    assert e.value.keyword == "not" and e.value.pointer == "/properties/age/not"
    assert "strict=False" in str(e.value)
    assert Tool.from_schema("person", schema, strict=False).strict is False


def test_parameters_not_of_type_object_and_patterns_python_cannot_validate_are_rejected_with_pointer():
    """Both registered before, then every call failed after its decode (a 500 from the server)."""
    with pytest.raises(SchemaError) as e:
        Tool.from_schema("s", {"type": "string"})
    assert e.value.pointer == "/type" and "object" in str(e.value)
    for schema, pointer in (({"type": "object", "properties": {"a": {"type": "string", "pattern": "\\p{L}+"}}},
                             "/properties/a/pattern"),
                            ({"type": "object", "patternProperties": {"(?<x>a)": {}}}, "/patternProperties/(?<x>a)")):
        with pytest.raises(SchemaError) as e:
            Tool.from_schema("p", schema)
        assert e.value.keyword == "pattern" and e.value.pointer == pointer
    assert Tool.from_schema("ok", {"type": ["object", "null"], "properties": {"a": {"pattern": "^[a-z]+$"}}})


def test_dangling_ref_names_the_pointer():
    with pytest.raises(SchemaError) as e:
        Tool.from_schema("r", {"$ref": "#/defs/missing"})
    assert e.value.keyword == "$ref" and "#/defs/missing" in str(e.value)


@pytest.mark.parametrize("strict", [True, False])
def test_a_ref_that_admits_no_finite_value_is_refused_at_registration(strict):
    """llguidance failed at the first mask ("NoExtensionBias", "Too many items": a 500 from the server) and
    jsonschema recursed forever: now a SchemaError naming the $ref."""
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}
    loop = {"type": "object", "required": ["a"], "additionalProperties": {"$ref": "#/$defs/L"}}
    refused = [  # (the first $ref the schema uses that admits no finite value, schema)
        ("/properties/v/$ref", {"$defs": {"A": {"$ref": "#/$defs/A"}}, "properties": {"v": {"$ref": "#/$defs/A"}}}),
        ("/properties/v/$ref", {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
                                "properties": {"v": {"$ref": "#/$defs/A"}}}),
        ("/properties/v/$ref", {"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}]}},
                                "properties": {"v": {"$ref": "#/$defs/A"}}}),
        ("/properties/v/$ref", {"$defs": {"N": {**node, "required": ["next"]}},
                                "properties": {"v": {"$ref": "#/$defs/N"}}, "required": ["v"]}),
        ("/properties/t/$ref", {"$defs": {"T": {"type": "object", "required": ["kids"], "properties": {
            "kids": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/T"}}}}},
            "properties": {"t": {"$ref": "#/$defs/T"}}}),
        ("/properties/t/$ref", {"$defs": {"L": loop}, "properties": {"t": {"$ref": "#/$defs/L"}}}),  # a second helper's
        ("/properties/t/$ref", {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"T": {
            "type": "array", "minItems": 1, "items": [{"$ref": "#/definitions/T"}]}},
            "properties": {"t": {"$ref": "#/definitions/T"}}}),
        ("/$defs/A/properties/b/$ref", {"$defs": {
            "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}}, "B": {"$ref": "#/$defs/B"}},
            "properties": {"a": {"$ref": "#/$defs/A"}}}),
    ]
    for pointer, schema in refused:
        with pytest.raises(SchemaError, match="admits no finite value") as e:
            Tool.from_schema("f", {"type": "object", **schema}, strict=strict)
        assert e.value.keyword == "$ref" and e.value.pointer == pointer
    kept = [  # recursion with a way out: an optional property, a null alternative, an empty array
        {"$defs": {"N": node}, "properties": {"v": {"$ref": "#/$defs/N"}}, "required": ["v"]},
        {"$defs": {"N": {**node, "required": ["next"], "properties": {
            "next": {"anyOf": [{"$ref": "#/$defs/N"}, {"type": "null"}]}}}},
         "properties": {"v": {"$ref": "#/$defs/N"}}},
        {"$defs": {"T": {"type": "object", "required": ["kids"], "properties": {
            "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}}}}, "properties": {"t": {"$ref": "#/$defs/T"}}},
        {"properties": {"child": {"$ref": "#"}}},
        {"properties": {"a": {"type": "string"}}, "$defs": {"Loop": {"$ref": "#/$defs/Loop"}}},  # never used
        {"required": ["x"], "properties": {"x": {"$ref": "#/$defs/T"}}, "$defs": {"T": {  # resolved in a nested $id
            "$id": "https://example.com/inner", "type": "object", "required": ["t"],
            "properties": {"t": {"$ref": "#/$defs/T"}}, "$defs": {"T": {"type": "string"}}}}},
    ]
    for schema, value in zip(kept, ({"v": {"next": {}}}, {"v": {"next": None}}, {"t": {"kids": [{"kids": []}]}},
                                     {"child": {"child": {}}}, {"a": "x"}, {"x": {"t": "s"}})):
        Tool.from_schema("f", {"type": "object", **schema}, strict=strict).validate(value)


def test_parameter_names_pydantic_keeps_for_itself_are_tool_arguments_like_any_other():
    """``model_config``, ``model_dump``, ``schema`` and ``_x`` are legal Python parameter names: they raised
    pydantic's own errors (``'FieldInfo' object is not iterable``, "protected namespace")."""
    def f(model_config: str, _x: int, model_dump: int = 1, schema: str = "s") -> str:
        return f"{model_config}{_x}{model_dump}{schema}"

    tool = Tool.from_function(f)
    assert list(tool.parameters["properties"]) == ["model_config", "_x", "model_dump", "schema"]
    assert tool.parameters["required"] == ["model_config", "_x"]
    assert tool.invoke(tool.make_call({"model_config": "a", "_x": 2, "schema": "z"})) == "a21z"
    with pytest.raises(ToolCallError):
        tool.make_call({"model_config": "a"})


def test_an_annotation_that_cannot_be_resolved_names_the_parameter():
    """Under ``from __future__ import annotations`` (this module), a class defined inside a function is a string
    nobody can resolve: pydantic's "not fully defined" (or, named like the argument model, a schema referring to
    itself) became a ToolError naming the parameter."""
    class GArgs(pydantic.BaseModel):
        a: int

    def g(x: GArgs, n: int) -> int:
        return x.a + n

    with pytest.raises(ToolError, match="tool 'g': parameter 'x': cannot resolve its annotation 'GArgs'"):
        Tool.from_function(g)


def test_function_without_annotations_or_with_varargs_is_rejected():
    def f(x):
        return x

    def g(*args: int):
        return args

    with pytest.raises(ToolError, match="no type annotation"):
        Tool.from_function(f)
    with pytest.raises(ToolError, match=r"\*args"):
        Tool.from_function(g)


def test_envelope_selects_arguments_schema_by_name():
    reg = ToolRegistry([book, Tool.from_schema("area", {"type": "object", "properties": {"r": {"type": "number"}},
                                                        "required": ["r"]})])
    schema = call_schema(reg)
    v = jsonschema.Draft202012Validator(schema)
    assert v.is_valid({"name": "area", "arguments": {"r": 1.5}})
    assert not v.is_valid({"name": "area", "arguments": {"city": "Oslo"}})  # book's arguments under area's name
    assert v.is_valid({"name": "book", "arguments": {"city": "Oslo", "address": {"street": "a", "zip_code": 1}}})
    assert not v.is_valid({"name": "book", "arguments": {"city": "Oslo", "address": {"street": "a"}}})  # $ref kept
    assert not v.is_valid({"name": "other", "arguments": {}})


def test_close_objects_only_closes_objects_that_say_nothing_about_extra_keys():
    s = close_objects({"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
                       "additionalProperties": True})
    assert s["additionalProperties"] is True and s["properties"]["a"]["additionalProperties"] is False


def test_bfcl_dialect_normalised_to_json_schema():
    params = {"type": "dict", "properties": {
        "x": {"type": "float"}, "t": {"type": "tuple", "items": {"type": "integer"}}, "a": {"type": "any"},
        "flag": {"type": "boolean", "default": "false"}, "o": {"type": "string", "optional": True}},
        "required": ["x", "missing"]}
    s = normalize_schema(params)
    assert s["type"] == "object" and s["properties"]["x"] == {"type": "number"}
    # a Python "any" is a string, as BFCL's FC harness declares it and its checker reads it (PYTHON_TYPE_MAPPING)
    assert s["properties"]["t"]["type"] == "array" and s["properties"]["a"] == {"type": "string"}
    assert s["properties"]["flag"]["default"] is False and "optional" not in s["properties"]["o"]
    assert s["required"] == ["x"]
    jsonschema.Draft202012Validator.check_schema(s)


def test_bfcl_java_parameters_are_all_declared_as_code_strings_as_bfcl_declares_them():
    fn = {"name": "Foo.bar", "description": "d", "parameters": {"type": "dict", "properties": {
        "n": {"type": "long", "description": "n."}, "m": {"type": "HashMap", "description": "m."},
        "c": {"type": "any", "description": "c."}, "b": {"type": "Boolean", "description": "b."},
        "a": {"type": "ArrayList", "description": "a.", "items": {"type": "String"}}}, "required": ["n"]}}
    t = tool_from_bfcl(fn, language="java")
    props = t.parameters["properties"]
    assert {p["type"] for p in props.values()} == {"string"} and "items" not in props["a"]
    assert props["n"]["description"] == "n. This is Java long type parameter in string representation."
    assert t.description == "d Note that the provided function is in Java 8 SDK syntax."
    assert tool_from_bfcl(fn, code_strings=True).parameters == t.parameters
    t.make_call({"n": "42L", "c": "new Path('/x')"})
    with pytest.raises(ToolCallError):
        t.make_call({"n": 42})


def test_every_project_error_derives_from_spec_agent_error_and_its_builtin():
    import bench.llamacpp_peer
    import bench.modes
    from constraints import ConstraintError, GrammarError
    from decoding import ModelNotFoundError, MTPError
    from schemas import InstanceError, SchemaError, SpecAgentError, ToolCallError, ToolError

    for cls, builtin in [(SchemaError, ValueError), (ToolError, ValueError), (ToolCallError, ValueError),
                         (InstanceError, ValueError), (GrammarError, ValueError), (ConstraintError, RuntimeError),
                         (ModelNotFoundError, FileNotFoundError), (MTPError, ValueError),
                         (bench.llamacpp_peer.LlamaCppUnavailable, RuntimeError), (bench.modes.SkipMode, Exception)]:
        assert issubclass(cls, SpecAgentError) and issubclass(cls, builtin), cls


def test_schemas_imports_no_grammar_engine_and_strict_registration_asks_for_one():
    # with the engine installed (this process), strict registration rejects 'not': tests/test_conformance.py
    import subprocess
    import sys

    code = ("import sys, schemas\n"
            "assert 'llguidance' not in sys.modules and 'constraints' not in sys.modules\n"
            "try:\n    schemas.Tool.from_schema('f', {'type': 'object'})\nexcept schemas.SpecAgentError as e:\n"
            "    assert 'import constraints' in str(e)\nelse:\n    raise SystemExit('strict without an engine passed')\n"
            "schemas.Tool.from_schema('f', {'not': {'type': 'null'}}, strict=False)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_annotated_field_description_is_kept_where_the_docstring_gives_none():
    def f(n: Annotated[int, pydantic.Field(ge=0, description="zero or more")],
          k: Annotated[int, pydantic.Field(description="own")] = 2) -> None:
        """Doc.

        Args:
            k: from the docstring.
        """
    props = Tool.from_function(f).parameters["properties"]
    assert props["n"] == {"description": "zero or more", "minimum": 0, "type": "integer"}
    assert props["k"]["description"] == "from the docstring."


@pytest.mark.parametrize("case", ["parameter named like a keyword", "nested $id", "'#' in a nested $id"])
def test_call_grammar_keeps_refs_under_parameters_named_like_keywords_and_inside_nested_ids(smol_tokenizer, case):
    """A tool's schema moves under ``$defs`` in the call grammar (compact JSON), its local ``$ref`` re-rooted: not inside a
    property named ``default``/``enum``/``const``/``examples`` (a pydantic type there is a ``$ref``: every run
    failed to compile), and not inside a subschema with its own ``$id`` (its ``#…`` resolves against it)."""
    from constraints import ConstraintState, json_schema_grammar, llg_tokenizer

    if case == "parameter named like a keyword":
        params = {"type": "object", "$defs": {"Addr": {"type": "object", "properties": {"city": {"enum": ["Oslo"]}},
                                                      "required": ["city"]}},
                  "properties": {"default": {"$ref": "#/$defs/Addr"}, "enum": {"$ref": "#/$defs/Addr"}},
                  "required": ["default", "enum"]}
        good, bad = '{"default":{"city":"Oslo"},"enum":{"city":"Oslo"}}', '{"default":{"city":"Rome"},"enum":{"city":"Oslo"}}'
    elif case == "nested $id":
        params = {"$id": "https://example.com/root.json", "type": "object", "$defs": {"inner": {
            "$id": "inner.json", "type": "object", "properties": {"v": {"$ref": "#/$defs/num"}}, "required": ["v"],
            "$defs": {"num": {"type": "integer", "maximum": 5}}}}, "properties": {"i": {"$ref": "inner.json"}},
            "required": ["i"]}
        good, bad = '{"i":{"v":3}}', '{"i":{"v":7}}'
    else:
        params = {"type": "object", "$defs": {"node": {"$id": "https://example.com/node.json", "type": "object",
                  "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                  "required": ["v", "next"]}}, "properties": {"n": {"$ref": "https://example.com/node.json"}},
                  "required": ["n"]}
        good, bad = '{"n":{"v":1,"next":{"v":2,"next":null}}}', '{"n":{"v":1,"next":{"v":2}}}'
    other = Tool.from_schema("other", {"type": "object", "properties": {"q": {"type": "string"}}})
    llt = llg_tokenizer(smol_tokenizer, 49152, smol_tokenizer.eos_token_id)
    grammar = json_schema_grammar(call_schema([other, Tool.from_schema("t", params)]))

    def accepted(arguments: str) -> bool:
        st = ConstraintState(llt, grammar)
        ids = smol_tokenizer.encode('{"name":"t","arguments":' + arguments + "}", add_special_tokens=False)
        if st.valid_prefix_len(ids) != len(ids):
            return False
        st.consume_many(ids)
        return st.is_accepting()

    assert accepted(good) and not accepted(bad)


def test_an_openai_dicts_strict_false_makes_a_lenient_tool_and_a_lenient_tool_says_so():
    """A dict with ``"strict": false`` (as OpenAI and the server read it) registers a keyword the grammar cannot
    enforce, relaxed; ``to_openai`` writes it back, so a remote engine sends it (the server refused the tool)."""
    params = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                      "uniqueItems": True}}}
    spec = {"type": "function", "function": {"name": "f", "parameters": params, "strict": False}}
    tool = Tool.from_openai(spec)
    assert tool.strict is False and tool.to_openai()["function"]["strict"] is False
    assert Tool.from_openai(tool.to_openai()).strict is False
    with pytest.raises(SchemaError, match="uniqueItems"):
        Tool.from_openai({"type": "function", "function": {"name": "f", "parameters": params}})
    assert "strict" not in Tool.from_schema("g", {"type": "object"}).to_openai()["function"]


def test_a_field_as_a_parameter_default_gives_its_default_and_constraints():
    """``n: int = Field(5, ge=1, le=10)`` (pydantic's validate_call form): the schema holds the bounds and the
    description, validation applies them, and a call leaving ``n`` out runs with 5 — the tool got the FieldInfo
    object itself, and the bounds were lost."""
    def count(n: int = pydantic.Field(5, ge=1, le=10, description="1 to 10"),
              tags: list[str] = pydantic.Field(default_factory=list), r: int = pydantic.Field(ge=0),
              model_config: int = pydantic.Field(3, description="a name pydantic keeps")) -> tuple:
        """Count.

        Args:
            r: from the docstring.
        """
        return n, tags, r, model_config

    tool = Tool.from_function(count)
    props = tool.parameters["properties"]
    assert props["n"] == {"default": 5, "description": "1 to 10", "maximum": 10, "minimum": 1, "type": "integer"}
    assert props["r"] == {"description": "from the docstring.", "minimum": 0, "type": "integer"}
    assert tool.parameters["required"] == ["r"] and props["model_config"]["default"] == 3
    assert tool.invoke(tool.make_call({"r": 1})) == (5, [], 1, 3)
    assert tool.invoke(tool.make_call({"r": 1, "model_config": 4})) == (5, [], 1, 4)
    with pytest.raises(ToolCallError, match="/n"):
        tool.make_call({"n": 50, "r": 1})


def test_positional_only_parameters_are_passed_by_position():
    def f(a: int, schema: int, /, b: int, *, c: int = 2) -> tuple:
        return a, schema, b, c

    tool = Tool.from_function(f)
    assert tool.parameters["required"] == ["a", "schema", "b"]
    assert tool.invoke(tool.make_call({"a": 1, "schema": 7, "b": 5})) == (1, 7, 5, 2)


@pytest.mark.parametrize("spec, message", [
    ({"type": "retrieval", "function": {"name": "t"}}, "type 'retrieval': only 'function' tools"),
    ({"type": "function", "function": "t"}, "'function' must be an object"),
    ({"type": "function", "function": {"description": "x"}}, "needs a 'name'"),
    ({"type": "code_interpreter"}, "type 'code_interpreter'"), ({"name": "f", "type": "web_search"}, "web_search"),
])
def test_openai_tool_dict_errors_name_what_is_wrong(spec, message):
    """Both first dicts were refused as needing a 'name', which each has."""
    from schemas import as_tool

    with pytest.raises(ToolError, match=re.escape(message)):
        as_tool(spec)


@pytest.mark.parametrize("doc", [
    "Add two numbers.\n\nArgs:\n    a: the first\n    b (int): the second,\n        on two lines\n\nReturns:\n    the sum\n",
    "Add two numbers.\n\n:param a: the first\n:param int b: the second,\n    on two lines\n:returns: the sum\n",
    "Add two numbers.\n\nParameters\n----------\na : int\n    the first\nb : int\n    the second,\n    on two lines\n"
    "\nReturns\n-------\nint\n    the sum\n",
])
def test_parameter_descriptions_come_from_google_sphinx_and_numpy_docstrings(doc):
    """Sphinx and NumPy docstrings lost their parameter descriptions, and their ``:param`` lines went into the
    tool's description."""
    def add(a: int, b: int) -> int:
        return a + b
    add.__doc__ = doc

    tool = Tool.from_function(add)
    assert tool.description == "Add two numbers."
    assert {k: v.get("description") for k, v in tool.parameters["properties"].items()} == {
        "a": "the first", "b": "the second, on two lines"}


def test_a_field_alias_names_the_argument_and_the_function_gets_its_parameter():
    """``n: int = Field(1, alias="count")`` (or Annotated): the schema and validation use ``count``; the tool ran
    as ``fn(count=…)`` and raised TypeError."""
    def f(n: int = pydantic.Field(1, alias="count"), m: Annotated[int, pydantic.Field(alias="size")] = 2) -> tuple:
        return n, m

    tool = Tool.from_function(f)
    assert set(tool.parameters["properties"]) == {"count", "size"}
    assert tool.invoke(tool.make_call({"count": 5, "size": 7})) == (5, 7)


@pytest.mark.parametrize("doc", [
    "Add.\n\nArgs:\n    a: the first\n    b: the second\n    this line has no colon\n",
    "Add.\n\nArgs:\n    a: the first\n    b: the second\n\nRaises:\n    when bad\n",
])
def test_a_docstring_the_library_cannot_parse_is_read_as_google_style(doc):
    def add(a: int, b: int) -> int:
        return a + b
    add.__doc__ = doc

    tool = Tool.from_function(add)
    assert tool.description == "Add." and tool.parameters["properties"]["a"]["description"] == "the first"


def test_attributes_are_not_parameters():
    def f(a: int) -> int:
        """F.

        Args:
            a: the a

        Attributes:
            a: not this
        """
        return a
    assert Tool.from_function(f).parameters["properties"]["a"]["description"] == "the a"
