"""Schema conformance: the grammar accepts valid instances and never an invalid one; strict registration rejects what
it cannot enforce (keyword + JSON pointer); lenient compiles and post-validates.

The conformance slice lives in tests/fixtures/conformance (made by scripts/make_conformance_fixtures.py from
../shared/data: every 4th–32nd maskbench schema per file, 23 JSON-Schema-Test-Suite draft 2020-12 files).
"""
from __future__ import annotations

import json
import time

import pytest

from bench.bfcl_dialect import normalize_schema
from bench.conformance import Matcher, run, schema_order, serialisations
from constraints import ConstraintState, allowed_tokens, compile_json_schema, json_schema_grammar, llg_tokenizer
from schemas import SchemaError, ToolRegistry
from schemas.check import InstanceError, check_valid, instance_validator, validate_instance

from conftest import FIXTURES

SLICE = FIXTURES / "conformance"


@pytest.fixture(scope="module")
def llt(smol_tokenizer):
    return llg_tokenizer(smol_tokenizer, 49152, smol_tokenizer.eos_token_id)


def feed(llt, tok, grammar, text: str) -> tuple[bool, bool]:
    """-> (every token allowed, accepting at the end)."""
    st = ConstraintState(llt, grammar)
    ids = tok.encode(text, add_special_tokens=False)
    n = st.valid_prefix_len(ids)
    if n != len(ids):
        return False, False
    st.consume_many(ids)
    return True, st.is_accepting()


def accepts(llt, tok, schema, text: str, *, lenient: bool = False) -> bool:
    return feed(llt, tok, json_schema_grammar(schema, lenient=lenient), text)[1]


# -- the runner over the fixed slice ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["maskbench", "test-suite"])
def counts(request, tmp_path_factory):
    return run(request.param, SLICE, tmp_path_factory.mktemp(request.param), log=open("/dev/null", "w"))


def test_slice_never_accepts_an_invalid_instance_and_accepts_valid_ones(counts):
    assert counts["compiled"] >= 20 and counts["invalid_total"] >= 50 and counts["valid_total"] >= 50
    assert counts["invalid_accepted"] == 0
    assert counts["valid_accepted"] / counts["valid_total"] >= 0.99
    assert counts["schemas"] == counts["compiled"] + counts["rejected_unsupported"] + counts["rejected_invalid"]


def test_slice_rejections_name_keywords(counts):
    if counts["suite"] == "test-suite":  # not, oneOf, unevaluated…: rejected with the keyword named
        assert counts["rejected_unsupported"] > 0
        assert "(other)" not in counts["rejected_unsupported_by_keyword"]


def test_serialisation_puts_keys_in_schema_order_and_undeclared_keys_last():
    schema = {"type": "object", "properties": {"b": {"type": "object", "properties": {"y": {}, "x": {}}},
                                               "a": {"type": "integer"}}, "additionalProperties": True}
    value = {"z": 1, "a": 1.0, "b": {"x": 1, "y": 2}}
    v = instance_validator(schema)
    assert list(schema_order(value, schema, schema, v)) == ["b", "a", "z"]
    texts = serialisations(value, schema, v)
    assert texts[0] == '{"b":{"y":2,"x":1},"a":1.0,"z":1}' and '{"b":{"y":2,"x":1},"a":1,"z":1}' in texts
    assert serialisations("é", {}, v) == ['"é"']  # raw UTF-8, as the grammar emits it


# -- named cases -------------------------------------------------------------------------------------------------
NOT_ZERO = {"type": "integer", "not": {"const": 0}}


def test_not_rejected_strictly_with_pointer_and_registry_too():
    with pytest.raises(SchemaError) as e:
        compile_json_schema(NOT_ZERO)
    assert e.value.keyword == "not" and e.value.pointer == "/not" and "strict=False" in str(e.value)
    with pytest.raises(SchemaError) as e:
        ToolRegistry().register({"name": "f", "parameters": {"type": "object", "properties": {"n": NOT_ZERO}}})
    assert e.value.pointer == "/properties/n/not" and "'f'" in str(e.value)


def test_not_compiles_leniently_and_post_validation_rejects_zero(llt, smol_tokenizer):
    compile_json_schema(NOT_ZERO, lenient=True)
    assert accepts(llt, smol_tokenizer, NOT_ZERO, "0", lenient=True)  # the grammar lets 0 through…
    with pytest.raises(InstanceError) as e:  # …and post-validation catches it
        validate_instance(NOT_ZERO, 0)
    assert e.value.keyword == "not" and e.value.schema_pointer == "/not" and e.value.pointer == ""
    assert "'not'" in str(e.value) and "/not" in str(e.value)
    validate_instance(NOT_ZERO, 7)
    with pytest.raises(InstanceError) as e:
        validate_instance({"properties": {"age": NOT_ZERO}}, {"age": 0}, tool="person")
    assert e.value.pointer == "/age" and e.value.schema_pointer == "/properties/age/not" and "person" in str(e.value)


def test_exactly_two_items(llt, smol_tokenizer):
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2}
    g = json_schema_grammar(schema)
    assert feed(llt, smol_tokenizer, g, '["a","b"]') == (True, True)
    assert feed(llt, smol_tokenizer, g, '["a"') == (True, False)
    assert feed(llt, smol_tokenizer, g, '["a"]')[1] is False
    assert feed(llt, smol_tokenizer, g, '["a","b","c"]')[0] is False
    assert feed(llt, smol_tokenizer, g, '[]')[1] is False


def test_object_grammar_allows_no_whitespace_token_after_brace(llt, smol_tokenizer):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
              "additionalProperties": {"type": "string"}}
    for prefix in ("{", '{"city":"x"', '{"city":"x",'):
        st = ConstraintState(llt, json_schema_grammar(schema))
        st.consume_many(smol_tokenizer.encode(prefix, add_special_tokens=False))
        allowed = allowed_tokens(st.next_mask(), 49152).tolist()
        assert allowed
        texts = [smol_tokenizer.decode([t]) for t in allowed]
        assert not [t for t in texts if t[:1].isspace()], prefix


def test_dangling_ref_names_the_pointer():
    with pytest.raises(SchemaError) as e:
        check_valid({"$ref": "#/defs/missing"})
    assert e.value.keyword == "$ref" and e.value.pointer == "/$ref" and "#/defs/missing" in str(e.value)


def test_remote_ref_is_rejected_with_pointer():
    schema = {"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}
    with pytest.raises(SchemaError) as e:
        compile_json_schema(schema)
    assert e.value.keyword == "$ref" and e.value.pointer == "/properties/a/$ref"


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["name"], "additionalProperties": False},
    {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/node",
     "definitions": {"node": {"type": "object", "properties": {"name": {"type": "string"},
                                                               "kids": {"type": "array",
                                                                        "items": {"$ref": "#/definitions/node"}}},
                              "required": ["name"], "additionalProperties": False}}},
])
def test_recursive_ref_compiles_and_accepts_nested_instances(llt, smol_tokenizer, schema):
    check_valid(schema)
    text = '{"name":"a","kids":[{"name":"b","kids":[{"name":"c"}]},{"name":"d","kids":[]}]}'
    assert accepts(llt, smol_tokenizer, schema, text)
    assert not accepts(llt, smol_tokenizer, schema, '{"name":"a","kids":[{"kids":[]}]}')  # inner name missing


def test_draft04_dialect_exclusive_maximum_boolean(llt, smol_tokenizer):
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "maximum": 5,
              "exclusiveMaximum": True}
    check_valid(schema)
    assert accepts(llt, smol_tokenizer, schema, "4") and not accepts(llt, smol_tokenizer, schema, "5")
    with pytest.raises(SchemaError) as e:  # a 2020-12 number there is not valid draft-04
        check_valid({**schema, "exclusiveMaximum": 5})
    assert e.value.pointer == "/exclusiveMaximum"


def test_openai_strict_and_bfcl_dialects_compile_strictly(llt, smol_tokenizer):
    openai = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": ["string", "null"],
                                                                                   "enum": ["c", "f", None]}},
              "required": ["city", "unit"], "additionalProperties": False}
    assert accepts(llt, smol_tokenizer, openai, '{"city":"Oslo","unit":null}')
    assert not accepts(llt, smol_tokenizer, openai, '{"city":"Oslo"}')
    rows = [json.loads(line) for line in (FIXTURES / "BFCL_v4_simple_python.first10.jsonl").read_text().splitlines()]
    for row in rows:
        for fn in row["function"]:
            schema = normalize_schema(fn["parameters"])
            check_valid(schema)
            compile_json_schema(schema)


def test_repeated_undeclared_key_cannot_satisfy_min_properties(llt, smol_tokenizer):
    schema = {"type": "object", "minProperties": 2}
    with pytest.raises(SchemaError) as e:
        compile_json_schema(schema)
    assert e.value.keyword == "minProperties" and e.value.pointer == "/minProperties"
    # why: leniently the grammar counts the repeated key twice, and post-validation catches it
    assert accepts(llt, smol_tokenizer, schema, '{"b":1,"b":2}', lenient=True)
    with pytest.raises(InstanceError):
        validate_instance(schema, json.loads('{"b":1,"b":2}'))
    closed = {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "minProperties": 2}
    compile_json_schema(closed)  # enforced exactly: the required keys already make two


def test_decimal_multiple_of_agrees_with_the_grammar(llt, smol_tokenizer):
    schema = {"type": "number", "multipleOf": 0.1}
    assert accepts(llt, smol_tokenizer, schema, "0.3")
    validate_instance(schema, 0.3)  # plain jsonschema says 0.3 / 0.1 = 2.9999999999999996
    with pytest.raises(InstanceError):
        validate_instance(schema, 0.35)


def test_boolean_and_float_count_schemas_compile(llt, smol_tokenizer):
    assert accepts(llt, smol_tokenizer, True, '{"a":[1]}')
    with pytest.raises(SchemaError):
        compile_json_schema(False)
    assert accepts(llt, smol_tokenizer, {"type": "array", "maxItems": 2.0}, "[1,2]")
    assert not accepts(llt, smol_tokenizer, {"type": "array", "maxItems": 2.0}, "[1,2,3]")


def _big_schema(target_bytes: int) -> dict:
    """A Kubernetes-like object schema of about ``target_bytes`` bytes (nested objects, enums, descriptions)."""
    defs, i = {}, 0
    while len(json.dumps(defs)) < target_bytes:
        defs[f"io.k8s.api.Kind{i}"] = {
            "type": "object", "description": f"Kind {i}: " + "a resource description. " * 8,
            "properties": {
                "apiVersion": {"type": "string", "description": "APIVersion defines the versioned schema."},
                "kind": {"type": "string", "enum": [f"Kind{i}"]},
                "metadata": {"$ref": "#/definitions/meta"},
                "spec": {"type": "object", "properties": {
                    f"field{j}": {"type": ["string", "null"], "maxLength": 64, "description": "a field " * 4}
                    for j in range(12)}, "additionalProperties": False},
                "replicas": {"type": "integer", "minimum": 0, "maximum": 1000}},
            "required": ["kind"], "additionalProperties": False}
        i += 1
    defs["meta"] = {"type": "object", "properties": {"name": {"type": "string"},
                                                     "labels": {"type": "object",
                                                                "additionalProperties": {"type": "string"}}}}
    return {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": defs,
            "anyOf": [{"$ref": f"#/definitions/{k}"} for k in defs if k != "meta"]}


def test_500kb_schema_registers_in_bounded_time(llt):
    schema = _big_schema(500_000)
    assert len(json.dumps(schema)) >= 500_000
    t0 = time.perf_counter()
    try:
        check_valid(schema)
        grammar = json_schema_grammar(schema)
        ConstraintState(llt, grammar).next_mask()
    except SchemaError as e:  # allowed: a clear error, fast
        assert str(e)
    assert time.perf_counter() - t0 < 10.0


def test_runner_main_writes_counts(tmp_path):
    from bench.conformance import main

    rc = main(["--suite", "test-suite", "--data", str(SLICE), "--out", str(tmp_path), "--limit", "2"])
    counts = json.loads((tmp_path / "conformance.json").read_text())
    assert rc == 0 and counts["suite"] == "test-suite" and counts["schemas"] > 0
    assert {"compiled", "rejected_unsupported", "rejected_invalid", "valid_total", "valid_accepted",
            "invalid_total", "invalid_accepted"} <= set(counts)


def test_matcher_uses_the_default_tokenizer_only():
    m = Matcher()
    assert m.vocab_size == 49152 and not hasattr(m, "model")
