"""What the grammar enforces for a registered schema: closed objects, bounded scalars and calendar dates narrow it,
but never so far that a satisfiable schema admits no value; what registration accepts must decode.

Each test feeds a text through the public turn grammar (``agent.formats.generic.turn_grammar``) and checks that the grammar
accepts it (or rejects it) as a whole.
"""
from __future__ import annotations

import datetime
import json

import pytest

from agent import Agent
from agent.formats.generic import render_call_text, turn_grammar
from constraints import ConstraintState, llg_tokenizer
from decoding import Generator
from schemas import Tool, ToolCallError, ToolRegistry

ALLOF_TRIP = {"type": "object", "allOf": [
    {"properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
    {"properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["days"]}]}
REF_TRIP = {"type": "object",
            "$defs": {"Base": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                               "required": ["city"]}},
            "allOf": [{"$ref": "#/$defs/Base"}],
            "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["days"]}


def get_time(zone: str) -> str:
    """Time in a zone.

    Args:
        zone: IANA zone name.
    """
    return zone


@pytest.fixture(scope="module")
def llt(smol_tokenizer):
    return llg_tokenizer(smol_tokenizer, 49152)


def accepts(llt, tok, grammar, text: str) -> bool:
    """The grammar takes ``text`` whole (every token, and the end)."""
    ids = tok.encode(text, add_special_tokens=False)
    state = ConstraintState(llt, grammar)
    if state.valid_prefix_len(ids) != len(ids):
        return False
    state.consume_many(ids)
    return state.is_accepting()


def call(name, arguments):
    return render_call_text([{"name": name, "arguments": arguments}])


def tools_of(*specs):
    reg = ToolRegistry()
    for s in specs:
        reg.register(s)
    return list(reg)


# -- 1. closing objects never closes allOf / $ref branches --------------------------------------------------------
@pytest.mark.parametrize("schema", [ALLOF_TRIP, REF_TRIP], ids=["allOf", "ref"])
def test_properties_split_over_allof_or_ref_decode_alone(llt, smol_tokenizer, schema):
    tools = tools_of(Tool.from_schema("trip", schema))  # registers in strict mode
    grammar = turn_grammar(tools, "required")
    assert accepts(llt, smol_tokenizer, grammar, call("trip", {"city": "Oslo", "days": 3}))
    # still closed: an undeclared key is not generated
    assert not accepts(llt, smol_tokenizer, grammar, call("trip", {"city": "Oslo", "days": 3, "x": 1}))


@pytest.mark.parametrize("schema", [ALLOF_TRIP, REF_TRIP], ids=["allOf", "ref"])
def test_split_properties_tool_neither_disappears_nor_breaks_other_tools(llt, smol_tokenizer, schema):
    tools = tools_of(get_time, Tool.from_schema("trip", schema))
    grammar = turn_grammar(tools, "required")
    assert accepts(llt, smol_tokenizer, grammar, call("trip", {"city": "Oslo", "days": 3}))
    assert accepts(llt, smol_tokenizer, grammar, call("get_time", {"zone": "UTC"}))


def test_anyof_branches_keep_the_keys_the_parent_declares(llt, smol_tokenizer):
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["id"],
              "anyOf": [{"properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                        {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}
    grammar = turn_grammar(tools_of(Tool.from_schema("pick", schema)), "required")
    assert accepts(llt, smol_tokenizer, grammar, call("pick", {"id": 1, "a": True}))
    assert accepts(llt, smol_tokenizer, grammar, call("pick", {"id": 1, "b": False}))
    assert not accepts(llt, smol_tokenizer, grammar, call("pick", {"id": 1, "a": True, "zz": 1}))


def test_ref_target_shared_by_a_plain_use_and_an_allof_is_not_closed_for_either(llt, smol_tokenizer):
    schema = {"type": "object",
              "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                              "required": ["x"]}},
              "properties": {"plain": {"$ref": "#/$defs/P"},
                             "more": {"allOf": [{"$ref": "#/$defs/P"},
                                                {"properties": {"y": {"type": "boolean"}}, "required": ["y"]}]}},
              "required": ["plain", "more"]}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required")
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"plain": {"x": 1}, "more": {"x": 2, "y": True}}))


def test_required_key_missing_from_properties_is_not_closed_away(llt, smol_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a", "b"]}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required")
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"a": 1, "b": 2}))


def test_agent_runs_a_tool_whose_properties_sit_in_allof(tiny_target):
    seen = []
    agent = Agent(Generator(tiny_target, drafter="none"), [Tool.from_schema("trip", ALLOF_TRIP, fn=seen.append)],
                  max_steps=1, max_string_length=8)
    res = agent.run("Trip to Oslo for 3 days", tool_choice="required", max_new_tokens=64)
    assert res.tool_calls and not res.truncated
    assert set(res.tool_calls[0].call.arguments) == {"city", "days"}


# -- 1. grammar-only bounds never make a schema unsatisfiable -----------------------------------------------------
@pytest.mark.parametrize("prop,value", [
    ({"type": "string", "minLength": 300}, "x" * 300),
    ({"type": "integer", "minimum": 10 ** 16}, 10 ** 16),
    ({"type": "integer", "maximum": -(10 ** 16)}, -(10 ** 16)),
    ({"type": "number", "minimum": 0.123456785, "maximum": 0.123456789}, 0.123456787),
    ({"allOf": [{"type": "string"}, {"minLength": 300}]}, "y" * 300),
], ids=["minLength>cap", "min1e16", "max-1e16", "no-8-decimal-multiple", "minLength-in-branch"])
def test_grammar_bounds_never_make_a_schema_unsatisfiable(llt, smol_tokenizer, prop, value):
    schema = {"type": "object", "properties": {"v": prop}, "required": ["v"]}
    tools = tools_of(Tool.from_schema("f", schema))
    grammar = turn_grammar(tools, "required", max_string_length=200, max_decimals=8)
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"v": value}))


def test_grammar_bounds_still_bound_unbounded_values(llt, smol_tokenizer):
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "number"}}, "required": ["s"]}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required", max_string_length=5, max_decimals=2)
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"s": "abcde", "n": 1.25}))
    assert not accepts(llt, smol_tokenizer, grammar, call("f", {"s": "abcdef"}))
    assert not accepts(llt, smol_tokenizer, grammar, call("f", {"s": "a", "n": 1.255}))


def test_grammar_bounds_bound_a_structured_answer_too(llt, smol_tokenizer):
    """A ``response_format`` answer after a tool result wrote ``"temperature": 18.0000000000000250000…`` until the
    budget, ``max_decimals=6`` or not: the bounds applied to call arguments only."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "temperature": {"type": "number"},
                                               "tags": {"type": "array", "items": {"type": "integer"}}},
              "required": ["city", "temperature"]}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", {"type": "object", "properties": {}})), "auto",
                           response_format=schema, max_string_length=5, max_decimals=2, max_items=2)
    assert accepts(llt, smol_tokenizer, grammar, json.dumps({"city": "Paris", "temperature": 18.25, "tags": [1, 2]}))
    for bad in ({"city": "Paris", "temperature": 18.255}, {"city": "Parisx", "temperature": 1},
                {"city": "Paris", "temperature": 1, "tags": [1, 2, 3]}):
        assert not accepts(llt, smol_tokenizer, grammar, json.dumps(bad)), bad
    free = turn_grammar(tools_of(Tool.from_schema("f", {"type": "object", "properties": {}})), "auto",
                        response_format=schema)
    assert accepts(llt, smol_tokenizer, free, json.dumps({"city": "Parisx", "temperature": 18.255}))


# -- 2. calendar dates -------------------------------------------------------------------------------------------
def book_room(room: str, start: datetime.datetime, day: datetime.date) -> str:
    """Book a room.

    Args:
        room: Room name.
        start: Start time.
        day: Day.
    """
    return room


@pytest.mark.parametrize("day,ok", [("2024-02-29", True), ("2023-02-29", False), ("2000-02-29", True),
                                    ("1900-02-29", False), ("2023-04-31", False), ("2023-04-30", True),
                                    ("2023-12-31", True), ("0000-01-01", False)])
def test_grammar_admits_only_real_calendar_dates(llt, smol_tokenizer, day, ok):
    grammar = turn_grammar(tools_of(book_room), "required")
    args = {"room": "A", "start": f"{day}T10:00:00Z", "day": day}
    assert accepts(llt, smol_tokenizer, grammar, call("book_room", args)) is ok
    good_start = {**args, "start": "2024-01-01T10:00:00Z"}
    assert accepts(llt, smol_tokenizer, grammar, call("book_room", good_start)) is ok


def test_json_schema_grammar_date_with_its_own_pattern_is_still_a_calendar_date(llt, smol_tokenizer):
    from constraints import json_schema_grammar

    g = json_schema_grammar({"type": "string", "format": "date", "pattern": "^20"})
    assert accepts(llt, smol_tokenizer, g, '"2024-02-29"')
    assert not accepts(llt, smol_tokenizer, g, '"2023-02-29"')
    assert not accepts(llt, smol_tokenizer, g, '"1999-01-01"')



@pytest.mark.parametrize("fmt,prefix", [("time", ""), ("date-time", "2024-01-01T")])
@pytest.mark.parametrize("own_pattern", [False, True])
def test_a_time_fraction_is_at_most_nanoseconds_in_the_grammar(llt, smol_tokenizer, fmt, prefix, own_pattern):
    """RFC 3339 lets a second's fraction run on; the 0.5B copying "20:00" wrote ``20:00:00.0000000…`` until the
    budget cut the call. The grammar takes nine digits at most (with the node's own pattern too)."""
    from constraints import json_schema_grammar

    schema = {"type": "string", "format": fmt, **({"pattern": "^[0-9]"} if own_pattern else {})}
    g = json_schema_grammar(schema)
    assert accepts(llt, smol_tokenizer, g, f'"{prefix}20:00:00Z"')
    assert accepts(llt, smol_tokenizer, g, f'"{prefix}20:00:00.123456789+01:00"')
    assert not accepts(llt, smol_tokenizer, g, f'"{prefix}20:00:00.1234567890Z"')
    assert not accepts(llt, smol_tokenizer, g, f'"{prefix}20:00:00"')  # the format still wants its zone

# every format docs/schema-support.md says is enforced: validation rejects what the format forbids
@pytest.mark.parametrize("fmt,bad,good", [
    ("date", "2023-02-29", "2024-02-29"), ("date-time", "2023-02-29T10:00:00Z", "2024-02-29T10:00:00Z"),
    ("time", "25:00:00Z", "23:59:59Z"), ("duration", "P", "P1D"), ("email", "nobody", "a@b.org"),
    ("hostname", "-bad-", "example.org"), ("ipv4", "1.2.3.999", "1.2.3.4"), ("ipv6", "1::2::3", "::1"),
    ("uuid", "1234", "123e4567-e89b-12d3-a456-426614174000"), ("uri", "no scheme", "https://x.org/a")])
def test_raw_schema_tool_validation_checks_every_documented_format(fmt, bad, good):
    tool = Tool.from_schema("f", {"type": "object", "properties": {"v": {"type": "string", "format": fmt}},
                                  "required": ["v"]})
    assert tool.validate({"v": good}) == {"v": good}
    with pytest.raises(ToolCallError, match="format"):
        tool.validate({"v": bad})


def test_response_format_validation_checks_formats():
    from schemas import ResponseFormat

    rf = ResponseFormat({"type": "object", "properties": {"day": {"type": "string", "format": "date"}}})
    with pytest.raises(ToolCallError, match="format"):
        rf.validate({"day": "2023-02-29"})


# -- 5. response_format objects are closed like tool arguments ------------------------------------------------------
@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]},
    ALLOF_TRIP], ids=["plain", "allOf"])
def test_response_format_is_closed_with_the_tool_rule(llt, smol_tokenizer, schema):
    grammar = turn_grammar([], "none", response_format=schema)
    value = {"city": "Oslo", "days": 3} if "allOf" in schema else {"city": "Oslo"}
    assert accepts(llt, smol_tokenizer, grammar, json.dumps(value))
    assert not accepts(llt, smol_tokenizer, grammar, json.dumps({**value, "extra": 1}))


# -- 3. a date/time or place format a description states becomes a pattern ----------------------------------------
@pytest.mark.parametrize("description,good,bad", [
    ("The day, in the format 'MM/DD/YYYY'.", "05/15/2023", "15/05/2023"),
    ("Formatted as 'YYYY-MM-DD HH:MM:SS' in UTC.", "2023-05-15 09:30:00", "2023-05-15T09:30"),
    ("The range, formatted as 'YYYY-MM-DD to YYYY-MM-DD'.", "2023-01-01 to 2023-02-01", "January 2023"),
    ("Start time in 'HH:MM' format.", "23:59", "24:00"),
    ("Date in the format of 'dd.mm.yyyy'.", "31.12.2023", "2023-12-31"),
    # a place format: names with one comma and a space between (BFCL's live tools, 'San Francisco' for 'City, State')
    ("The city, in the format of 'City, State', such as 'San Francisco, CA' or 'New York, NY'.", "San Francisco, CA",
     "San Francisco"),
    ("In the format of 'City, State' or 'City, Country'; for example, 'Paris, France'.", "Paris, France",
     "Cancún, QR, Tulum, QR"),
    ("Formatted as 'City, State, Country'.", "Austin, TX, USA", "Austin, TX"),
    ("In the format 'City, State'.", "Boston, MA", "Boston ,MA"),
])
def test_a_date_or_place_format_stated_in_a_description_constrains_the_value(llt, smol_tokenizer, description, good, bad):
    schema = {"type": "object", "properties": {"when": {"type": "string", "description": description}},
              "required": ["when"]}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required", max_string_length=200)
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"when": good}))
    assert not accepts(llt, smol_tokenizer, grammar, call("f", {"when": bad}))


def test_a_stated_place_format_keeps_the_string_cap(llt, smol_tokenizer):
    """A place format's items are unbounded: with max_string_length 20, SmolLM2 wrote
    '上海_current_weather_data_2023_2024_…' without the comma until the token budget cut the call (a helper's find).
    The cap now holds there too; a date format (bounded) and a pattern of the schema's own are left as they are."""
    from schemas.narrow import bound_scalars, stated_formats

    place = {"type": "string", "description": "The location, in the format of 'City, State'."}
    date = {"type": "string", "description": "The day, in the format 'MM/DD/YYYY'."}
    own = {"type": "string", "pattern": "^[a-z]+$"}
    schema = {"type": "object", "properties": {"p": place, "d": date, "o": own}, "required": ["p", "d", "o"]}
    narrowed = bound_scalars(stated_formats(schema), max_string_length=20)["properties"]
    assert narrowed["p"]["maxLength"] == 20 and "maxLength" not in narrowed["d"] and "maxLength" not in narrowed["o"]
    assert bound_scalars(stated_formats(schema), max_string_length=2)["properties"]["p"]["maxLength"] == 4
    grammar = turn_grammar(tools_of(Tool.from_schema("f", {"type": "object", "properties": {"p": place},
                                                          "required": ["p"]})), "required", max_string_length=20)
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"p": "Boston, MA"}))
    assert not accepts(llt, smol_tokenizer, grammar, call("f", {"p": "Boston" * 4 + ", MA"}))


@pytest.mark.parametrize("prop", [
    {"type": "string", "description": "The format for dates in the reply, such as 'MM/DD/YYYY'."},  # a format value
    {"type": "string", "description": "In the format 'YYYY-MM-DD' or 'today'."},
    {"type": "string", "description": "In the format 'YYYY-MM-DD'.", "default": "today"},
    {"type": "string", "description": "In the format 'YYYY-MM-DD'.", "enum": ["soon", "later"]},
    {"type": "string", "description": "In the format 'City, State' or 'a ZIP code'."},
    {"type": "string", "description": "In the format 'City, State' or 'City, State, Country'."},
    {"type": "string", "description": "In the format 'City, State'.", "default": "Boston"},
    {"type": "string", "description": "The city, such as 'Berkeley, CA' or 'New York, NY'."},
    # a lone place allowed too, or the format negated (a helper's cases)
    {"type": "string", "description": "In the format of 'City, State'. Use just the city name outside the US."},
    {"type": "string", "description": "In the format 'City, State' (US) or just 'City' elsewhere."},
    {"type": "string", "description": "Not in the format 'City, State'; give a ZIP code."},
    {"type": "string", "description": "The day as a weekday name, not in the format 'YYYY-MM-DD'."},
], ids=["format-as-value", "or-another", "default-outside", "enum", "place-or-zip", "place-two-shapes",
        "place-default-outside", "place-examples-only", "place-or-lone-city", "place-or-quoted-city",
        "place-negated", "date-negated"])
def test_a_description_that_does_not_state_one_format_leaves_the_string_free(llt, smol_tokenizer, prop):
    from schemas.narrow import stated_formats

    schema = {"type": "object", "properties": {"v": prop}, "required": ["v"]}
    assert stated_formats(schema) == schema


# -- 3b. integers are kept to JSON's exact range (RFC 8259 §6), so their digits cannot run away ---------------------
def test_an_unbounded_integer_ends_within_the_safe_range(llt, smol_tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required")
    for good in (0, 2 ** 53 - 1, -(2 ** 53 - 1), 150000000000000):
        assert accepts(llt, smol_tokenizer, grammar, call("f", {"n": good})), good
    for bad in (2 ** 53, -2 ** 53, 15 * 10 ** 40):
        assert not accepts(llt, smol_tokenizer, grammar, call("f", {"n": bad})), bad
    Tool.from_schema("f", schema).validate({"n": 15 * 10 ** 40})  # the grammar's narrowing only


def test_integer_bounds_a_schema_sets_are_kept():
    from schemas.narrow import bound_integers

    wide = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2 ** 60}}}
    # meant to be large: its lower bound kept, the upper one the largest llguidance writes a regex for
    assert bound_integers(wide)["properties"]["n"] == {"type": "integer", "minimum": 2 ** 60, "maximum": 9 * 10 ** 18}
    past = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2 ** 63}}}
    assert bound_integers(past) == past  # no room below the grammar's bound: left alone (compiling names it)
    low = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}
    assert bound_integers(low)["properties"]["n"] == {"type": "integer", "minimum": 0, "maximum": 2 ** 53 - 1}
    both = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    assert bound_integers(both) == both
    assert bound_integers({"type": "integer", "enum": [1, 2]}) == {"type": "integer", "enum": [1, 2]}


@pytest.mark.parametrize("prop,good,bad", [
    ({"type": "integer", "minimum": 2 ** 60}, [2 ** 60, 2 ** 60 + 7, 9 * 10 ** 18], [2 ** 60 - 1, 0]),
    ({"type": "integer", "maximum": -10 ** 18}, [-10 ** 18, -(10 ** 18) - 3], [-(10 ** 18) + 1, 0]),
], ids=["minimum", "maximum"])
def test_an_integer_bounded_on_one_side_past_10_to_the_18_compiles_and_keeps_its_bound(llt, smol_tokenizer, prop,
                                                                                        good, bad):
    """llguidance builds no regex for such a one-sided bound ("Failed to generate regex for integer range"): the
    grammar takes the other bound at ±9 * 10^18 and keeps the schema's."""
    schema = {"type": "object", "properties": {"n": prop}, "required": ["n"]}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required")
    for v in good:
        assert accepts(llt, smol_tokenizer, grammar, call("f", {"n": v})), v
    for v in bad:
        assert not accepts(llt, smol_tokenizer, grammar, call("f", {"n": v})), v


def test_an_exclusive_integer_bound_past_2_to_the_53_is_refused_strict_and_made_inclusive_lenient(llt,
                                                                                                  smol_tokenizer):
    """llguidance steps from an exclusive bound in floats, so ``exclusiveMinimum: 2^60`` admitted 2^60 itself."""
    from constraints.json_schema import exact_bounds
    from schemas import SchemaError

    schema = {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 2 ** 60}},
              "required": ["n"]}
    with pytest.raises(SchemaError) as e:
        Tool.from_schema("f", schema)
    assert e.value.pointer == "/properties/n/exclusiveMinimum" and "the integer next to it" in str(e.value)
    assert exact_bounds(schema)["properties"]["n"] == {"type": "integer", "minimum": 2 ** 60 + 256}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema, strict=False)), "required")
    assert not accepts(llt, smol_tokenizer, grammar, call("f", {"n": 2 ** 60}))
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"n": 2 ** 60 + 256}))


@pytest.mark.parametrize("prop,keyword", [
    ({"type": "number", "minimum": 1e300}, "minimum"),
    ({"type": "number", "maximum": -1e18}, "maximum"),
    ({"type": "integer", "minimum": 2 ** 63}, "minimum"),
    ({"type": "integer", "minimum": 10 ** 20}, "minimum"),  # llguidance clamps it to 2^63 - 1 in its message
])
@pytest.mark.parametrize("strict", [True, False])
def test_a_bound_the_grammar_cannot_write_is_named_with_its_pointer(prop, keyword, strict):
    """Strict or not (a lenient tool relaxes what the grammar cannot enforce, but a bound it cannot write breaks
    the whole turn grammar: refused at registration, not at the first turn), beside a property with bounds."""
    from schemas import SchemaError

    schema = {"type": "object", "properties": {"a": {"type": "number", "minimum": 0, "maximum": 10}, "n": prop},
              "required": ["n"]}
    with pytest.raises(SchemaError) as e:
        Tool.from_schema("f", schema, strict=strict)
    assert e.value.keyword == keyword and e.value.pointer == f"/properties/n/{keyword}"
    assert f"keyword {keyword!r} at /properties/n/{keyword}" in str(e.value) and "±10^18" in str(e.value)


@pytest.mark.parametrize("prop", [
    {"allOf": [{"type": "integer"}, {"minimum": 2 ** 54}]},
    {"type": "integer", "allOf": [{"minimum": 2 ** 54}]},
    {"type": "integer", "maximum": 2 ** 64},  # an int past 64 bits, passed to llguidance as the float it equals
], ids=["allOf", "type-and-allOf", "past-64-bits"])
def test_large_integer_bounds_that_compile_as_written_still_register(llt, smol_tokenizer, prop):
    """Bounding the bare integer node to ±(2^53 - 1) would make these unsatisfiable: the check takes the schema as
    written where it compiles."""
    schema = {"type": "object", "properties": {"n": prop}, "required": ["n"]}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required")
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"n": 2 ** 54 + 1}))


def test_an_integer_bounded_on_one_side_past_10_to_the_18_keeps_its_object_closed(llt, smol_tokenizer):
    """The object-closing step compiles only once the integer has its other bound (bound_integers comes first)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": -10 ** 18}}, "required": ["n"]}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required")
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"n": -10 ** 18}))
    assert not accepts(llt, smol_tokenizer, grammar, call("f", {"n": -10 ** 18, "type": "integer"}))


@pytest.mark.parametrize("prop,keyword", [
    ({"type": ["integer", "null"], "exclusiveMinimum": 2 ** 60, "maximum": 2 ** 61}, "exclusiveMinimum"),
    ({"type": "integer", "minimum": 2 ** 60, "exclusiveMinimum": True}, "minimum"),  # draft 04
    ({"allOf": [{"type": "integer"}, {"exclusiveMinimum": 2 ** 60, "maximum": 2 ** 61}]}, "allOf/1/exclusiveMinimum"),
])
def test_every_form_of_an_exclusive_integer_bound_past_2_to_the_53_is_refused_strict(prop, keyword):
    from schemas import SchemaError

    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object", "properties": {"n": prop},
              "required": ["n"]}
    if keyword != "minimum":
        del schema["$schema"]
    with pytest.raises(SchemaError) as e:
        Tool.from_schema("f", schema)
    assert e.value.pointer == f"/properties/n/{keyword}"
    Tool.from_schema("f", schema, strict=False)  # lenient: the inclusive bound beside it


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"n": {"not": {"type": "integer"}}}},
    {"type": "object", "properties": {"n": {"if": {"type": "integer"}, "then": {"minimum": 0}}}},
    {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 1e16}]}}},
    {"type": "object", "properties": {"s": {"not": {"type": "string", "description": "In the format 'YYYY-MM-DD'."}}}},
], ids=["not", "if", "oneOf", "format-under-not"])
def test_nothing_under_not_if_or_one_of_is_narrowed(schema):
    """Bounding an integer under ``not`` would let through the integers the bound leaves out, which the schema
    forbids: the grammar's language must stay a subset."""
    from schemas.narrow import bound_integers, bound_scalars, stated_formats

    assert bound_integers(schema) == schema and stated_formats(schema) == schema
    assert bound_scalars(schema, max_string_length=10, max_decimals=2) == schema


def test_a_property_named_like_a_keyword_is_still_narrowed():
    from schemas.narrow import bound_integers

    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "integer"}}}
    out = bound_integers(schema)["properties"]
    assert out["not"]["maximum"] == out["if"]["maximum"] == 2 ** 53 - 1


@pytest.mark.parametrize("max_length", [2 ** 32, 10 ** 12])
def test_a_huge_max_length_is_accepted_and_bounds_nothing_a_turn_can_write(llt, smol_tokenizer, max_length):
    from constraints import json_schema_grammar

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": max_length}},
              "required": ["a"]}
    tool = Tool.from_schema("f", schema)  # was: "keyword 'pattern' at / cannot be enforced" (there is no pattern)
    grammar = json_schema_grammar(schema)
    assert accepts(llt, smol_tokenizer, grammar, '{"a":"' + "x" * 300 + '"}')
    assert tool.validate({"a": "hello"}) == {"a": "hello"}


def test_a_min_length_no_string_can_reach_is_named():
    from schemas import SchemaError

    with pytest.raises(SchemaError, match="keyword 'minLength' at /properties/a/minLength") as err:
        Tool.from_schema("f", {"type": "object", "properties": {"a": {"type": "string", "minLength": 2 ** 32}}})
    assert err.value.pointer == "/properties/a/minLength" and err.value.tool == "f"


# -- 3. arrays: a grammar-only cap on their items ----------------------------------------------------------------
def test_bound_arrays_caps_only_arrays_the_schema_leaves_unbounded():
    from schemas import bound_arrays

    schema = {"type": "object", "properties": {
        "free": {"type": "array", "items": {"type": "integer"}},
        "capped": {"type": "array", "maxItems": 100},
        "long": {"type": "array", "minItems": 50},
        "tuple": {"type": "array", "prefixItems": [{"type": "integer"}] * 6},
        "nullable": {"type": ["array", "null"], "items": {"type": "array", "items": {"type": "string"}}},
        "fixed": {"type": "array", "enum": [[1, 2]]},
        "negated": {"not": {"type": "array"}}}}
    out = bound_arrays(schema, 4)["properties"]
    # the cap is never below an item count the schema asks for anywhere (minItems 50 here)
    assert out["free"]["maxItems"] == out["long"]["maxItems"] == out["tuple"]["maxItems"] == 50
    assert out["capped"]["maxItems"] == 100 and "maxItems" not in out["fixed"]
    assert out["negated"] == {"not": {"type": "array"}}
    assert out["nullable"]["maxItems"] == 50 and out["nullable"]["items"]["maxItems"] == 50  # nested lists too
    assert "maxItems" not in schema["properties"]["free"]  # a copy: the registered schema is untouched
    short = {"type": "object",
             "properties": {"free": {"type": "array"}, "pair": {"type": "array", "prefixItems": [{}, {}]}}}
    assert [v["maxItems"] for v in bound_arrays(short, 4)["properties"].values()] == [4, 4]
    assert [v["maxItems"] for v in bound_arrays(short, 1)["properties"].values()] == [2, 2]
    plain = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert bound_arrays(plain, 4) is plain
    with pytest.raises(ValueError, match="max_items"):
        bound_arrays(schema, 0)


def test_the_item_cap_closes_a_list_and_never_makes_a_schema_unsatisfiable(llt, smol_tokenizer):
    schema = {"type": "object", "properties": {"board": {"type": "array", "items": {"type": "integer"}},
                                               "moves": {"type": "array", "minItems": 5, "items": {"type": "string"}}},
              "required": ["board"]}
    board_only = {**schema, "properties": {"board": schema["properties"]["board"]}}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", board_only)), "required", max_items=3)
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"board": [0, 0, 0]}))
    assert not accepts(llt, smol_tokenizer, grammar, call("f", {"board": [0, 0, 0, 0]}))
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required", max_items=3)  # minItems 5: cap 5
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"board": [], "moves": list("abcde")}))
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"board": [0] * 5}))
    assert not accepts(llt, smol_tokenizer, grammar, call("f", {"board": [0] * 6}))
    free = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required")
    assert accepts(llt, smol_tokenizer, free, call("f", {"board": [0] * 40}))  # no cap unless asked for


@pytest.mark.parametrize("schema, value", [
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}, "minContains": 4}},
      "required": ["a"]}, {"a": [1, 1, 1, 1]}),
    ({"type": "object", "properties": {"a": {"type": "array"}, "b": {"type": "integer"}},
      "dependentSchemas": {"b": {"properties": {"a": {"minItems": 4}}}}, "required": ["a", "b"]},
     {"a": [1, 2, 3, 4], "b": 1}),
    ({"type": "object", "properties": {"a": {"type": "array", "allOf": [{"minItems": 4}]}, "b": {"type": "array"}},
      "required": ["a"]}, {"a": [1, 2, 3, 4], "b": [1, 2, 3]}),
], ids=["minContains", "dependentSchemas", "allOf-sibling"])
def test_the_item_cap_keeps_item_counts_asked_for_elsewhere_writable(llt, smol_tokenizer, schema, value):
    """A floor the lenient grammar does not enforce (minContains, a dependentSchemas entry) or that sits beside the
    array (an allOf branch) is still below the cap: the valid value decodes (found by a helper breaking the cap)."""
    tool = Tool.from_schema("f", schema, strict=False)
    tool.validate(value)
    grammar = turn_grammar(tools_of(tool), "required", max_items=2)
    assert accepts(llt, smol_tokenizer, grammar, call("f", value))


def test_counts_written_as_integral_numbers_compile_and_bound(llt, smol_tokenizer):
    """``"minItems": 3.0`` is an integer to JSON Schema; llguidance's %json refused it ("Expected positive integer"),
    so a tool that registered failed at its first turn (found by a helper)."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "minItems": 3.0, "maxItems": 4.0},
                                               "s": {"type": "string", "maxLength": 2.0}}, "required": ["a"]}
    grammar = turn_grammar(tools_of(Tool.from_schema("f", schema)), "required")
    assert accepts(llt, smol_tokenizer, grammar, call("f", {"a": [1, 2, 3], "s": "ab"}))
    assert not accepts(llt, smol_tokenizer, grammar, call("f", {"a": [1, 2]}))
    assert not accepts(llt, smol_tokenizer, grammar, call("f", {"a": [1, 2, 3], "s": "abc"}))


# -- integers that would run two numbers of the conversation together ---------------------------------------------
def test_integers_take_out_the_prefixes_of_numbers_run_together(llt, smol_tokenizer):
    """"the factorial of 5,10 and 15": ``51`` and ``101`` start no integer (Qwen2.5-Coder-0.5B wrote 510); every
    other integer, negative ones and the schema's own bounds as before; a value the grammar takes validates."""
    from agent.formats.generic import GenericFormat
    from agent.grounding import run_together_prefixes
    from schemas.narrow import integers_without_prefixes

    schema = {"type": "object", "properties": {"number": {"type": "integer"}, "small": {"type": "integer",
              "minimum": 0, "maximum": 60}, "pick": {"type": "integer", "enum": [510, 5]}}, "required": ["number"]}
    tool = tools_of(Tool.from_schema("fact", schema))
    prefixes = run_together_prefixes("Find the factorial of 5,10 and 15.")
    assert prefixes == {"51", "101"}
    grammar = GenericFormat(None).turn_grammar(tool, "required", excluded_integer_prefixes=prefixes)
    plain = GenericFormat(None).turn_grammar(tool, "required")
    for n in (5, 10, 15, 50, 52, 100, 102, 509, 520, 5000, -51, 0, 10 ** 15):
        assert accepts(llt, smol_tokenizer, grammar, call("fact", {"number": n})), n
    for n in (51, 510, 515, 1015, 5100, 51 * 10 ** 12):
        assert not accepts(llt, smol_tokenizer, grammar, call("fact", {"number": n})), n
        assert accepts(llt, smol_tokenizer, plain, call("fact", {"number": n})), n
    assert accepts(llt, smol_tokenizer, grammar, call("fact", {"number": 5, "small": 50}))
    assert not accepts(llt, smol_tokenizer, grammar, call("fact", {"number": 5, "small": 51}))
    assert not accepts(llt, smol_tokenizer, grammar, call("fact", {"number": 5, "small": 61}))  # its own bound
    assert accepts(llt, smol_tokenizer, grammar, call("fact", {"number": 5, "pick": 510}))  # an enum: left alone
    # the schema is only narrowed where a taken-out value lies in an integer's range and another value is left
    assert integers_without_prefixes({"type": "integer", "minimum": 0, "maximum": 9}, {"51"}) == \
        {"type": "integer", "minimum": 0, "maximum": 9}
    assert "anyOf" not in integers_without_prefixes({"type": "integer", "minimum": 51, "maximum": 51}, {"51"})
    assert integers_without_prefixes({"type": "integer", "minimum": 40, "maximum": 600}, {"51"})["anyOf"] == [
        {"minimum": 40, "maximum": 50}, {"minimum": 52, "maximum": 509}, {"minimum": 520, "maximum": 600}]
