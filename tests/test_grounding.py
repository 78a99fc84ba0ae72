"""Where a call's values come from (agent/grounding.py): optional arguments the conversation does not write are
dropped, and a turn whose calls take nothing from the conversation is decoded again without those tools."""
from __future__ import annotations

import pytest

from agent import Agent
from agent.engine import DecodedTurn, EngineConfig, LocalEngine
from agent.grounding import Grounding, drop_unwritten_optional, takes_from_conversation
from decoding import DecodeStats
from schemas import Tool

from test_formats import WEATHER
from test_turn_end import TIME, call_text, scripted, scripted_backend  # noqa: F401 (scripted_backend: a fixture)

USER = [{"role": "user", "content": "What is the weather in Oslo, in celsius?"}]


def test_mentions_reads_words_numbers_and_scripts_without_spaces():
    g = Grounding("Weather today in Boston in fahrenheit? 我想知道上海目前的天气 and 5,000 steps")
    assert g.mentions("Boston, MA") and g.mentions("fahrenheit") and g.mentions(5000) and g.mentions("上海, 中国")
    assert not g.mentions("Seoul, South Korea") and not g.mentions(42) and not g.mentions("in")  # short words
    assert not g.mentions("YOUR_API_KEY_HERE") and "Boston, MA" not in g  # whole value: not written
    assert g.mentions("Boston") and "boston" in g
    g = Grounding("a 95% confidence interval, 5 percent off")
    assert 0.95 in g and 95 in g and 0.05 in g and 0.5 not in g
    g = Grounding("Roll two dice and show the third page")
    assert 2 in g and 3 in g and 4 not in g
    g = Grounding("a loan of $400,000 at 4%; 1,234,5 and 12,345,678. Then 7")  # a comma after a group ends it
    assert {400000, 1, 234, 5, 12345678, 7} <= g.numbers and 400 not in g and 1234 not in g and 678 not in g


def test_tickers_and_initials_of_written_words_count_as_written():
    g = Grounding("Closing prices for Apple Inc., Google LLC., and Microsoft Corporation; flights to New York City")
    assert "MSFT" in g and "GOOGL" in g and "NYC" in g and g.mentions("MSFT")  # dev split, parallel_17
    assert "AAPL" not in g  # the letters of one word, in order: "apple" holds one "a"
    assert "IBM" not in g and "NY" not in g and "MICROSOFTX" not in g  # three to five letters
    assert "msft" not in g and "Msft" not in g  # upper case only
    assert "MSFT" not in Grounding("ms ft") and "NYC" not in Grounding("New York")  # one word; all initials
    assert "CTRL" not in Grounding("the contr ol panel")  # letters of one word, not across words
    assert "ÉQP" not in Grounding("une équipe")  # ASCII only


def test_number_words_that_run_together_write_one_number():
    from agent.grounding import compound_numbers

    g = Grounding("Set a timer for Twenty-Five minutes, then two hundred and fifty steps")
    assert 25 in g and 250 in g and 20 in g and 5 in g and 200 not in g and 26 not in g
    assert compound_numbers("one hundred twenty-three thousand four hundred fifty-six") == {123456}
    assert compound_numbers("a hundred and five, ninety nine, three million") == {105, 99, 3_000_000}
    assert compound_numbers("five six and one and two") == {5, 6, 1, 2}  # units do not add up
    assert compound_numbers("the twenty-first of five") == set()  # a lone cardinal: read word by word


def test_a_call_holding_a_number_written_in_words_is_not_decoded_again(smol_dir, monkeypatch):
    """Before, "twenty-five" read as 20 and 5 only: ``set_timer(minutes=25)`` took nothing from the conversation,
    so the turn was decoded again without the tool (under ``auto``: a text answer)."""
    timer = Tool.from_schema("set_timer", {"type": "object", "properties": {"minutes": {"type": "integer"}},
                                           "required": ["minutes"]})
    call = {"name": "set_timer", "arguments": {"minutes": 25}}
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    asked = _scripted_decodes(monkeypatch, engine, [_turn([call]), _turn(None, text="Done.")])
    out = engine.turn([{"role": "user", "content": "Set a timer for twenty-five minutes."}], [timer], "auto")
    assert out.calls == [call] and len(asked) == 1


def test_boolean_literals_written_as_strings_are_not_judged():
    g = Grounding("Refresh the data, keep the state")  # BFCL's Java tools write booleans as "true" / "false"
    assert takes_from_conversation({"name": "refresh", "arguments": {"keepState": "true", "append": "false"}}, g)
    call = {"name": "refresh", "arguments": {"keepState": "true"}}
    assert drop_unwritten_optional(call, {"type": "object"}, g) is call


def test_a_call_takes_from_the_conversation_when_one_string_or_number_is_mentioned():
    g = Grounding("who is park ji sung?")
    assert not takes_from_conversation({"name": "w", "arguments": {"location": "Seoul", "api_key": "KEY"}}, g)
    assert takes_from_conversation({"name": "s", "arguments": {"keyword": "Park Ji-sung", "max_results": 10}}, g)
    assert takes_from_conversation({"name": "now", "arguments": {}}, g)  # nothing to judge
    assert takes_from_conversation({"name": "f", "arguments": {"verbose": True}}, g)


def test_a_string_whose_numbers_are_all_written_is_mentioned():
    """Short numbers are no words: ``calculate("17 + 25 * 3")`` for "What is (17 + 25) * 3?" takes from the
    conversation (the demo's second question was decoded again without ``calculate`` before); a lone short number
    does not (``lookup_order(order_id="7")`` for "Is 7 a prime number?")."""
    g = Grounding("What is (17 + 25) * 3?")
    assert g.mentions("17 + 25 * 3") and g.mentions("(17+25)*3") and g.mentions("17 - 3")
    assert takes_from_conversation({"name": "calculate", "arguments": {"expression": "17 + 25 * 3"}}, g)
    assert not g.mentions("17 + 26") and not g.mentions("2023-01-01") and not g.mentions("+ *")  # one not written
    assert not g.mentions("3") and not g.mentions("Room 3")  # one number: an ID, not an expression
    assert not takes_from_conversation({"name": "convert", "arguments": {"unit": "ft", "value": "5"}}, g)
    assert not takes_from_conversation({"name": "lookup_order", "arguments": {"order_id": "7"}},
                                       Grounding("Is 7 a prime number?"))


def test_optional_arguments_the_conversation_does_not_write_are_dropped_required_ones_never():
    g = Grounding("Rewards for Fortnite on PlayStation, 3 players, sorted by date")
    params = {"type": "object", "required": ["game"], "properties": {}}
    call = {"name": "rewards", "id": "c1", "arguments": {
        "game": "Minecraft", "platform": "PlayStation", "mission": "Mission 1", "players": 3, "limit": 10,
        "sort": {"by": "date"}, "tags": ["fortnite", "new"], "public": False}}
    out = drop_unwritten_optional(call, params, g)
    assert out["arguments"] == {"game": "Minecraft", "platform": "PlayStation", "players": 3, "sort": {"by": "date"},
                                "public": False}
    assert out["id"] == "c1" and call["arguments"]["mission"] == "Mission 1"  # the input is not changed
    whole = {"name": "rewards", "arguments": {"game": "Fortnite", "players": 3}}
    assert drop_unwritten_optional(whole, params, g) is whole


@pytest.mark.parametrize("grounding", [True, False])
def test_the_agent_returns_a_decoded_call_without_its_invented_optional_argument(smol_dir, grounding):
    """A real constrained decode (the scripted model writes ``days: 3`` nobody asked for): with grounding the
    returned, validated call leaves ``days`` to the tool; without it the call is as decoded."""
    fmt, gen = scripted(smol_dir, "hermes", call_text("hermes", [("get_weather", {"city": "Oslo", "unit": "celsius",
                                                                                    "days": 3})]), "<|im_end|>")
    res = Agent(gen, [WEATHER], config=EngineConfig(grounding=grounding)).run(USER, tool_choice="required",
                                                                            max_steps=1)
    expected = {"city": "Oslo", "unit": "celsius"} if grounding else {"city": "Oslo", "unit": "celsius", "days": 3}
    assert res.pending_calls[0].arguments == expected


def _turn(calls, text="", stop="eos", tokens=5, is_call=None):
    return DecodedTurn(text or str(calls), calls, calls is not None if is_call is None else is_call, stop,
                       DecodeStats(new_tokens=tokens))


def _scripted_decodes(monkeypatch, engine, turns):
    """Make ``engine._decode`` return ``turns`` in order; returns the list of (exclude, answer_only) it was asked."""
    asked = []

    def decode(*args, exclude=None, answer_only=False, integer_prefixes=frozenset(), answer_excludes=(),
               answer_forbids=""):
        asked.append((set(exclude or ()), answer_only) + ((answer_excludes,) if answer_excludes else ())
                     + ((answer_forbids,) if answer_forbids else ()))
        return turns[len(asked) - 1]

    monkeypatch.setattr(engine, "_decode", decode)
    return asked


PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
LIMA = {"name": "get_time", "arguments": {"city": "Lima"}}
ROME = {"name": "get_time", "arguments": {"city": "Rome"}}
ASK_LIMA = [{"role": "user", "content": "What time is it in Lima?"}]


def test_a_call_that_takes_nothing_from_the_conversation_is_decoded_again_without_its_tool(smol_dir, monkeypatch):
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    asked = _scripted_decodes(monkeypatch, engine, [_turn([PARIS]), _turn([LIMA], tokens=7)])
    out = engine.turn(ASK_LIMA, [WEATHER, TIME], "required")
    assert out.calls == [LIMA] and asked == [(set(), False), ({"get_weather"}, False)]
    assert out.stats.new_tokens == 12  # both decodes counted


def test_required_keeps_the_first_call_when_no_tool_takes_from_the_conversation(smol_dir, monkeypatch):
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    asked = _scripted_decodes(monkeypatch, engine, [_turn([PARIS]), _turn([ROME])])
    out = engine.turn(ASK_LIMA, [WEATHER, TIME], "required")
    assert out.calls == [PARIS] and len(asked) == 2  # the second tool's call was no better: the model's first
    assert out.stats.new_tokens == 10


def test_auto_answers_in_text_once_no_tool_is_left(smol_dir, monkeypatch):
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    asked = _scripted_decodes(monkeypatch, engine, [_turn([PARIS]), _turn(None, text="I cannot tell the time.")])
    out = engine.turn(ASK_LIMA, [WEATHER], "auto")
    assert out.calls is None and out.text == "I cannot tell the time." and asked[1] == (set(), True)


def test_the_text_answer_auto_falls_back_to_is_decoded_again_where_it_only_restates_a_call(smol_dir, monkeypatch):
    """"What is the capital of France?" with a weather tool: the call takes nothing from the question, so the turn
    is an answer; Qwen2.5-Coder-0.5B then wrote the call as a ```json fence (a run of the default model)."""
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    fence = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
    asked = _scripted_decodes(monkeypatch, engine, [_turn([PARIS]), _turn(None, text=fence),
                                                    _turn(None, text="Paris.")])
    out = engine.turn(ASK_LIMA, [WEATHER], "auto")
    assert out.calls is None and out.text == "Paris." and asked[1:] == [(set(), True), (set(), True, ("`", "{"))]
    assert out.stats.new_tokens == 15  # every decode counted
    asked = _scripted_decodes(monkeypatch, engine, [_turn([PARIS]), _turn(None, text="Paris, I think.")])
    assert engine.turn(ASK_LIMA, [WEATHER], "auto").text == "Paris, I think." and len(asked) == 2


def test_calls_that_differ_only_in_dropped_arguments_are_returned_once(smol_dir, monkeypatch):
    """Decoded calls that differ only in an optional value nobody wrote become one call, the first; a call whose
    kept arguments differ stays (arguments compared as Python compares them: keys in any order, 3 == 3.0)."""
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    asked = [{"role": "user", "content": "Weather in Lima and Oslo, celsius, for 3 days?"}]
    lima = {"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius"}}
    calls = [{"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius", "days": 3}},
             {"name": "get_weather", "arguments": {"days": 3.0, "unit": "celsius", "city": "Lima"}},
             {"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius", "days": 5}},
             {"name": "get_weather", "arguments": {"unit": "celsius", "city": "Lima", "days": 6}},
             {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius", "days": 2}}]
    _scripted_decodes(monkeypatch, engine, [_turn(calls)])
    out = engine.turn(asked, [WEATHER], "required")
    assert out.calls == [calls[0], lima, {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]
    _scripted_decodes(monkeypatch, engine, [_turn(calls)])
    assert engine.turn(asked, [WEATHER], "required", config=EngineConfig(grounding=False)).calls == calls


@pytest.mark.parametrize("case", ["named", "off", "grounded", "retry cut"])
def test_no_retry_where_the_call_is_named_grounding_is_off_or_the_call_is_grounded(smol_dir, monkeypatch, case):
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    first = [LIMA] if case == "grounded" else [PARIS]
    asked = _scripted_decodes(monkeypatch, engine, [_turn(first), _turn(None, stop="length", is_call=True)])
    choice = {"name": "get_weather"} if case == "named" else "required"
    out = engine.turn(ASK_LIMA, [WEATHER, TIME], choice, config=EngineConfig(grounding=case != "off"))
    assert out.calls == first and len(asked) == (2 if case == "retry cut" else 1)


def test_the_retry_grammar_masks_the_excluded_tool_and_keeps_the_prompt(smol_dir):
    fmt, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    ids, grammar, *_ = engine._prepare(ASK_LIMA, [WEATHER, TIME], "required", None, None, EngineConfig())
    ids2, masked, allowed, _ = engine._prepare(ASK_LIMA, [WEATHER, TIME], "required", None, None, EngineConfig(),
                                               exclude={"get_weather"})
    assert ids2 == ids and [t.name for t in allowed] == ["get_time"]
    tokens = gen.tokenizer.encode(call_text("hermes", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
                                  add_special_tokens=False)
    assert gen.new_state(grammar).valid_prefix_len(tokens) == len(tokens)
    assert gen.new_state(masked).valid_prefix_len(tokens) < len(tokens)
    # the text answer decoded instead cannot write a call as text either (a bare JSON object is a call in hermes)
    *_, answer, none_allowed, mode = engine._prepare(ASK_LIMA, [WEATHER, TIME], "auto", None, None, EngineConfig(),
                                                    answer_only=True)
    assert none_allowed == [] and mode == "none"
    bare = gen.tokenizer.encode('{"name": "get_time"', add_special_tokens=False)
    text = gen.tokenizer.encode("I cannot tell.", add_special_tokens=False)
    assert gen.new_state(answer).valid_prefix_len(bare) == 0
    assert gen.new_state(answer).valid_prefix_len(text) == len(text)


def test_engine_config_checks_the_grounding_fields():
    with pytest.raises(ValueError, match="grounding_retries"):
        EngineConfig(grounding_retries=-1)
    with pytest.raises(ValueError, match="grounding"):
        EngineConfig(grounding="yes")


def test_a_request_turns_grounding_off_with_its_own_field_and_a_bad_value_names_it():
    from agent.openai_protocol import RequestError, parse_chat_request

    body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    assert parse_chat_request(body, EngineConfig(), ("m",)).config.grounding is True
    assert parse_chat_request({**body, "grounding": False}, EngineConfig(), ("m",)).config.grounding is False
    with pytest.raises(RequestError, match="grounding") as e:
        parse_chat_request({**body, "grounding": "no"}, EngineConfig(), ("m",))
    assert e.value.status == 400 and e.value.param == "grounding"


def test_an_argument_required_only_inside_allof_is_never_dropped(smol_dir):
    """``drop_unwritten_optional`` reads the top-level ``required``; the engine keeps the decoded call wherever the
    reduced one would not validate (here both keys are required inside ``allOf``)."""
    trip = Tool.from_schema("trip", {"type": "object", "allOf": [{"properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}]})
    _, gen = scripted(smol_dir, "hermes", call_text("hermes", [("trip", {"city": "Lima", "days": 6})]), "<|im_end|>")
    res = Agent(gen, [trip]).run("Plan a trip.", tool_choice="required", max_steps=1)
    assert res.pending_calls[0].arguments == {"city": "Lima", "days": 6}


def test_numbers_written_side_by_side_give_the_prefixes_they_would_run_together_into():
    from agent.grounding import run_together_prefixes, run_together_values, runs_numbers_together

    assert run_together_prefixes("Find the factorial of 5,10 and 15.") == {"51", "101"}
    assert run_together_values("Find the factorial of 5,10 and 15.") == {510, 1015, 51015}
    assert run_together_prefixes("for 1,5 and 10 years") == {"15", "51"}
    assert run_together_prefixes("a loan of $400,000, with a term of 15, 20 and 30 years") == {"152", "203"}
    assert run_together_prefixes("in 1980 and 2016, and 1975 or 2011") == {"19802", "20161", "19752"}
    assert run_together_prefixes("rooms 12/13; floors 3 & 4") == {"121", "34"}
    # no list between them, a fraction, a sign, a leading zero (Indian grouping), other digits: nothing runs
    for text in ("from 5 to 10", "at 7:30 pm", "numbers 3 4", "0.5, 1.5 and 2", "5 and -3", "07, 08",
                 "Convert 1,00,000 INR", "\uff11, \uff12", "5, 10.5"):
        assert run_together_prefixes(text) == set() and run_together_values(text) == set(), text
    # a prefix of a number the text writes, in digits or words, is no run
    assert run_together_prefixes("5, 10 and 51") == {"105"}
    assert run_together_prefixes("Rooms 1 and 2 need chairs: order twelve chairs") == set()
    # a call runs a list together only where a value equals items run together, not where it starts like them
    asked = "Record the product of 1, 2, 3, 4 and 5."
    assert not runs_numbers_together([{"name": "f", "arguments": {"value": 120}}], asked)
    assert runs_numbers_together([{"name": "f", "arguments": {"v": [1, {"w": 234}]}}], asked)
    assert len(run_together_prefixes(", ".join(str(n) for n in range(100, 400)))) == 0  # past the cap: none


def test_a_grouped_number_before_a_comma_is_read_both_ways():
    g = Grounding("widths 128,256, 512 and a loan of $400,000, at 4%")
    assert {128, 256, 128256, 512, 400000} <= g.numbers


RATE = {"type": "object", "required": ["rate", "years"], "properties": {
    "rate": {"type": "number", "description": "The interest rate applied per period."},
    "years": {"type": "number"},
    "growth": {"type": "number", "description": "Growth in percentage."},
    "discount_percent": {"type": "number"},
    "points": {"type": "integer"}}}


def test_a_rate_written_only_as_a_percent_becomes_its_fraction_unless_the_field_says_percent():
    from agent.grounding import fractions_for_percents

    g = Grounding("Present value of $1000 a year at an interest rate of 5%, growth 3%, 4 percent off, 7% points, "
                  "for 10 years")
    call = {"name": "pv", "id": "c1", "arguments": {"rate": 5, "years": 10, "growth": 3, "discount_percent": 4,
                                                    "points": 7}}
    out = fractions_for_percents(call, RATE, g)
    assert out["arguments"] == {**call["arguments"], "rate": 0.05} and out["id"] == "c1"
    assert call["arguments"]["rate"] == 5  # the input is not changed
    assert fractions_for_percents({"arguments": {"rate": 0.05}}, RATE, g)["arguments"] == {"rate": 0.05}
    plain = {"arguments": {"rate": 5, "years": 5}}  # "5 years at 5%": 5 is also written plainly
    assert fractions_for_percents(plain, RATE, Grounding("5 years at 5%")) is plain
    odd = {"arguments": {"rate": 12.5}}
    assert fractions_for_percents(odd, RATE, Grounding("a rate of 12.5 percent"))["arguments"] == {"rate": 0.125}


AMENITIES = ["Pet-friendly", "Disabled Access", "24 hours", "Cafe Inside"]
LIBRARY = {"type": "object", "required": ["location"], "properties": {
    "location": {"type": "string"},
    "preferences": {"type": "array", "items": {"type": "string", "enum": AMENITIES}},
    "data": {"type": "array", "items": {"type": "string", "enum": ["price", "volume", "dividends"]}},
    "two": {"type": "array", "items": {"type": "string", "enum": ["RGB", "HEX"]}}}}


def test_an_array_that_copies_its_enum_keeps_the_values_the_conversation_asks_for():
    from agent.grounding import without_unasked_enum_items

    g = Grounding("Find me a pet-friendly library with facilities for disabled people in New York City, with the "
                  "closing prices and volumes, in RGB")
    call = {"name": "find", "arguments": {"location": "NYC", "preferences": AMENITIES,
                                          "data": ["price", "volume", "dividends"], "two": ["RGB", "HEX"]}}
    out = without_unasked_enum_items(call, LIBRARY, g)
    assert out["arguments"] == {"location": "NYC", "preferences": ["Pet-friendly", "Disabled Access"],
                                "data": ["price", "volume"], "two": ["RGB", "HEX"]}  # two values: a choice
    for kept in (["Pet-friendly", "24 hours", "Disabled Access", "Cafe Inside"],  # not the schema's order
                 ["24 hours", "Cafe Inside"]):  # not every value
        c = {"arguments": {"preferences": kept}}
        assert without_unasked_enum_items(c, LIBRARY, g) is c
    c = {"arguments": {"preferences": AMENITIES}}
    assert without_unasked_enum_items(c, LIBRARY, Grounding("a library in Oslo")) is c  # none asked for: kept
    everything = Grounding("pet friendly, disabled access, open 24 hours and a cafe inside")
    assert without_unasked_enum_items(c, LIBRARY, everything) is c
    food = {"type": "object", "properties": {"amenities": {"type": "array", "items": {
        "enum": ["Parking", "Food and Beverages", "VIP Seating"]}}}}
    c = {"arguments": {"amenities": ["Parking", "Food and Beverages", "VIP Seating"]}}
    assert without_unasked_enum_items(c, food, Grounding("concerts with parking and the like"))["arguments"] == {
        "amenities": ["Parking"]}  # "and", "the": no sign of being asked for


def test_a_word_two_enum_values_share_does_not_tell_them_apart():
    from agent.grounding import without_unasked_enum_items

    trails = ["Picnic Tables", "Public Restrooms", "Playgrounds", "Biking Trails", "Hiking Trails", "Camping Grounds"]
    reserve = {"type": "object", "properties": {"amenities": {"type": "array", "items": {"enum": trails}}}}
    c = {"arguments": {"amenities": trails}}
    # dev split, parallel_27: "trails" is in two values; "biking" asks for one of them only
    g = Grounding("a nature reserve with picnic tables and public restrooms, and one with playgrounds and biking "
                  "trails")
    assert without_unasked_enum_items(c, reserve, g)["arguments"] == {"amenities": trails[:4]}
    # "trails" asks for both values holding it where neither's own word is written; "bike" for one
    both = {"type": "object", "properties": {"x": {"type": "array", "items": {"enum": ["Trails", "Bike Trails",
                                                                                      "Lakes"]}}}}
    c = {"arguments": {"x": ["Trails", "Bike Trails", "Lakes"]}}
    assert without_unasked_enum_items(c, both, Grounding("walking trails"))["arguments"] == {
        "x": ["Trails", "Bike Trails"]}
    assert without_unasked_enum_items(c, both, Grounding("bike trails"))["arguments"] == {"x": ["Bike Trails"]}
    # a shared word no value's own word asks for asks for all that hold it (a helper's case)
    pools = ["Indoor Pool", "Outdoor Pool", "Gym", "Spa"]
    hotel = {"type": "object", "properties": {"x": {"type": "array", "items": {"enum": pools}}}}
    c = {"arguments": {"x": pools}}
    assert without_unasked_enum_items(c, hotel, Grounding("a hotel with a pool and a gym"))["arguments"] == {
        "x": ["Indoor Pool", "Outdoor Pool", "Gym"]}
    assert without_unasked_enum_items(c, hotel, Grounding("an outdoor pool and a gym"))["arguments"] == {
        "x": ["Outdoor Pool", "Gym"]}
    c = {"arguments": {"amenities": trails}}
    assert without_unasked_enum_items(c, reserve, Grounding("all kinds of trails, and picnic tables"))[
        "arguments"] == {"amenities": ["Picnic Tables", "Biking Trails", "Hiking Trails"]}


def test_a_name_written_in_another_order_is_kept_as_the_conversation_writes_it():
    from agent.grounding import names_as_written, written_reordered

    text = "Find overview about the Battle of Waterloo and the signing of the Treaty of Tordesillas."
    treaty = {"type": "object", "properties": {"treaty_name": {"type": "string"}, "n": {"type": "integer"}}}
    call = {"name": "treaty", "arguments": {"treaty_name": "Tordesillas Treaty", "n": 2}}  # dev, parallel_multiple_36
    assert names_as_written(call, treaty, Grounding(text))["arguments"] == {"treaty_name": "Treaty of Tordesillas",
                                                                            "n": 2}
    for same in ("Treaty of Tordesillas",  # written: nothing to do
                 "Tordesillas Pact",  # a word not written
                 "Waterloo Battle Tordesillas",  # not written together
                 "Tordesillas, Treaty"):  # punctuation: not a plain name
        c = {"arguments": {"treaty_name": same}}
        assert names_as_written(c, treaty, Grounding(text)) is c
    assert written_reordered("California University", "the university of California") == "university of California"
    assert written_reordered("Tordesillas Treaty", "the Treaty of  Tordesillas") is None  # two spaces: not a name
    assert written_reordered("Tordesillas Treaty", "the treaty of the de Tordesillas") is None  # three link words
    assert written_reordered("York York", "York of York") is None
    # no link word, or a lowercase word: the order may be the meaning (a helper's cases)
    assert written_reordered("Smith John", "John Smith") is None
    assert written_reordered("Boston to New York", "I took New York to Boston") is None
    assert written_reordered("Arsenal vs Chelsea", "Chelsea vs Arsenal") is None


def test_grounded_call_keeps_a_rule_only_where_the_call_still_validates():
    from agent.grounding import grounded_call

    three = {"type": "array", "minItems": 3, "items": {"type": "string", "enum": AMENITIES}}
    params = {**LIBRARY, "required": ["location", "preferences"],
              "properties": {**LIBRARY["properties"], "preferences": three}}
    tool = Tool("find", "", params)  # three preferences at least: the two asked for do not validate
    g = Grounding("a pet-friendly library for disabled people at 5%")
    call = {"name": "find", "arguments": {"location": "NYC", "preferences": AMENITIES, "data": ["price", "volume",
                                                                                               "dividends"]}}
    assert grounded_call(call, [tool], g) == {"name": "find", "arguments": {"location": "NYC",
                                                                            "preferences": AMENITIES}}
    rate = Tool("pv", "", RATE)
    call = {"name": "pv", "arguments": {"rate": 5, "years": 10, "points": 2}}
    assert grounded_call(call, [rate], Grounding("10 years at 5%")) == {"name": "pv", "arguments": {
        "rate": 0.05, "years": 10}}  # the invented optional `points` dropped, the rate as a fraction
    assert grounded_call(call, [], g) is call  # an unknown tool: as decoded


@pytest.mark.parametrize("grounding", [True, False])
def test_the_agent_returns_a_rate_written_as_a_percent_as_its_fraction(smol_dir, grounding):
    """A real constrained decode (the scripted model writes ``rate: 5`` for "5%"): with grounding the returned,
    validated call holds 0.05; without it the call is as decoded."""
    pv = Tool("pv", "Present value.", RATE)
    fmt, gen = scripted(smol_dir, "hermes", call_text("hermes", [("pv", {"rate": 5, "years": 10})]), "<|im_end|>")
    res = Agent(gen, [pv], config=EngineConfig(grounding=grounding)).run(
        [{"role": "user", "content": "Present value at an interest rate of 5% for 10 years?"}],
        tool_choice="required", max_steps=1)
    assert res.pending_calls[0].arguments == {"rate": 0.05 if grounding else 5, "years": 10}


def test_a_number_with_a_scale_reads_as_the_number_it_scales_to():
    g = Grounding("revenues of $1M in 2019 and $1.2M in 2020, 5k steps, 2 million people, 3bn, 1.5 Billion, "
                  "5 mins and 7 km")
    assert {1, 1.2, 1_000_000, 1_200_000, 5000, 2_000_000, 3 * 10 ** 9, 1_500_000_000} <= g.numbers
    assert 5_000_000 not in g and 7000 not in g  # "5 mins", "7 km": units, not scales


def test_percent_fields_and_plain_numbers_a_new_user_found_are_left_as_decoded():
    """Cases a new-user helper found converted (before the fix) that must stay as decoded."""
    from agent.grounding import fractions_for_percents

    def rate(text, value, name="rate", tool="", **spec):
        params = {"type": "object", "properties": {name: {"type": "number", **spec}}}
        return fractions_for_percents({"arguments": {name: value}}, params, Grounding(text), tool)["arguments"][name]

    assert rate("Interest on $1000 at 5% for five years", 5, "years") == 5  # "five": written plainly
    assert rate("Set the fan speed to 50%", 50, "speed", maximum=100) == 50  # a 0-100 scale
    assert rate("rate of 5%", 5, description="Interest rate, in per cent") == 5
    assert rate("a 15% discount", 15, "discount_pct") == 15
    assert rate("rate of 5%", 5, tool="The rate is given in percent, e.g. 5 for 5%.") == 5
    assert rate("The price is $5 per centimetre", 5, "price") == 5  # "per cent" is a whole word
    assert rate("loans with rates between 3 and 5%", 3, "min_rate") == 0.03  # one range, one unit
    assert rate("rates of 3-5%", 3, "min_rate") == 0.03 and rate("rates of 3 to 5%", 5, "max_rate") == 0.05
    assert rate("buy 2 and get 5% off", 2, "quantity") == 2  # "and" makes a range only after "between"
    optional = {"anyOf": [{"type": "number"}, {"type": "null"}]}
    params = {"type": "object", "properties": {"rate": optional}}
    assert fractions_for_percents({"arguments": {"rate": 5}}, params, Grounding("at 5%"))["arguments"] == {
        "rate": 0.05}  # Optional[float] alike


def test_enum_values_without_a_word_to_judge_count_as_asked_for_and_an_optional_copy_keeps_what_was_asked():
    from agent.grounding import grounded_call, without_unasked_enum_items

    params = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["TV", "AC", "Pool"]}}}}
    c = {"arguments": {"a": ["TV", "AC", "Pool"]}}
    assert without_unasked_enum_items(c, params, Grounding("a room with TV, AC and a pool")) is c
    t = Tool("t", "", {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "string", "enum": ["WiFi", "Pool", "Gym"]}}}})  # optional: reduced, not dropped whole
    assert grounded_call({"name": "t", "arguments": {"a": ["WiFi", "Pool", "Gym"]}}, [t],
                         Grounding("with a pool"))["arguments"] == {"a": ["Pool"]}


def test_an_integer_that_runs_on_in_zeros_past_a_written_number_gives_its_prefix():
    from agent.grounding import zeros_appended_prefixes

    def prefixes(value, text):
        return zeros_appended_prefixes([{"name": "f", "arguments": {"x": {"y": [value]}}}], text)

    assert prefixes(500000, "Find a ride with a maximum cost of $50") == {"500"}
    assert prefixes(100, "for the next 10 years and 20 years") == {"100"}
    assert prefixes(1500, "15 items") == {"150"}
    assert prefixes(500, "at 50 m/s for 500 m") == set()  # 500 is written
    assert prefixes(5000, "50 km, then 5000 steps") == set()  # written: "500" starts 5000
    assert prefixes(5000, "convert 5 km to meters") == set()  # one digit: a unit conversion may be meant
    assert prefixes(1000000, "revenues of $1M and $10") == set()  # "$1M" writes 1000000
    assert prefixes(120, "12 apples") == {"120"} and prefixes(True, "10 apples") == set()


def test_a_turn_that_runs_on_in_zeros_is_decoded_again_without_such_integers(smol_dir, monkeypatch):
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    asked = []
    turns = [_turn([{"name": "rides", "arguments": {"max_cost": 500000}}]),
             _turn([{"name": "rides", "arguments": {"max_cost": 50}}], tokens=7)]

    def decode(*args, exclude=None, answer_only=False, integer_prefixes=frozenset()):
        asked.append(integer_prefixes)
        return turns[len(asked) - 1]

    monkeypatch.setattr(engine, "_decode", decode)
    rides = Tool("rides", "", {"type": "object", "properties": {"max_cost": {"type": "integer"}},
                               "required": ["max_cost"]})
    out = engine.turn([{"role": "user", "content": "A ride with a maximum cost of $50"}], [rides], "required")
    assert out.calls == [{"name": "rides", "arguments": {"max_cost": 50}}] and asked == [frozenset(), {"500"}]
    assert out.stats.new_tokens == 12


def test_written_number_lists_are_items_between_commas_and_ands_not_ranges_or_percents():
    from agent.grounding import written_number_lists

    def lists(text):
        return [x.items for x in written_number_lists(text)]

    assert lists("an investment of $1000 at 5% for 1,5 and 10 years") == [[1, 5, 10]]
    assert lists("a loan of $400,000 at 4% for 15, 20 and 30 years") == [[15, 20, 30]]
    assert lists("president in 1980 and 2016, vice president in 1975 and 2011") == [[1980, 2016], [1975, 2011]]
    assert lists("1,000, 2,000 and 3,000 units") == [[1000, 2000, 3000]]
    assert lists("a number between 5 and 10") == [] and lists("kids between the ages of 5 and 12") == []
    assert lists("pages from 5 to 10, and 20") == []
    assert lists("rates of 5% and 10%") == [] and lists("$1.2M and 3") == []
    assert lists("2 apples and 3 pears, 4 or 5 stars, on 5/10") == []
    assert lists("sides 2.5, 3.5 and 2.5") == [[2.5, 3.5]]  # an item once
    # a date is no list (test split, parallel_57: "adults": 2022 was added for "check-in on June 1, 2022")
    assert lists("on May 1, 2022 and June 10, 2022; Sept. 3, 2021; 1 adult") == []
    assert lists("in maybe 3, 4 and 5 days") == [[3, 4, 5]]
    assert lists("December 25, 2023 and 1, 2") == []  # "1, 2": no "and" before the last item
    assert lists("on 12/25 and 12/31, at 5:30 and 7:30, pages 5-10 and 15-20, the 5th and 10th") == []
    # found by a helper: a comma alone is no list; numbers past a float's range; integers kept exact
    assert lists("In 2020, 15 employees left") == [] and lists("40.7, -74.0") == [] and lists("1e400 and 2") == []
    assert lists("ids 9007199254740993 and 2") == [[9007199254740993, 2]]
    # a second helper's cases: a comma before "and" with two items; a line break; "roughly", "through"; $ items;
    # an integer past a float's range (no crash)
    assert lists("My order number is 12345, and 2 items are missing") == [] and lists("page 3\nand 5 results") == []
    assert lists("kids between the ages of roughly 5 and 12") == [] and lists("from 5 through 12 and 15") == []
    assert lists("$50, $75 and $100") == [[50, 75, 100]]
    assert lists("1" + "0" * 400 + " and 5") == [] and lists("1" + "0" * 5000 + " and 5, 6 and 7") == [[5, 6, 7]]
    found = written_number_lists("a loan term of 15, 20 and 30 years")[0]
    assert found.before == "a loan term of " and found.after == " years"


def _loan(term, amount=400000):
    return {"name": "mortgage", "arguments": {"loan_amount": amount, "interest_rate": 0.04, "loan_term": term}}


MORTGAGE = Tool("mortgage", "", {"type": "object", "properties": {
    "loan_amount": {"type": "integer"}, "interest_rate": {"type": "number"},
    "loan_term": {"type": "integer", "maximum": 40}}, "required": ["loan_amount", "interest_rate", "loan_term"]})


def test_a_several_call_turn_gets_a_call_per_item_of_a_written_list_it_goes_over():
    from agent.parallel_calls import with_written_list_items

    text = "A loan of $400,000 at 4% for a loan term of 15, 20 and 30 years."
    complete = [_loan(15), _loan(20), _loan(30)]
    assert with_written_list_items([_loan(15)], [MORTGAGE], text, 8) == complete  # the lone call the model wrote
    assert with_written_list_items([_loan(15), _loan(30)], [MORTGAGE], text, 8) == complete  # in the list's order
    assert with_written_list_items([_loan(30), _loan(15)], [MORTGAGE], text, 8) == [_loan(20), _loan(30), _loan(15)]
    assert with_written_list_items(complete, [MORTGAGE], text, 8) == complete
    assert with_written_list_items([_loan(15)], [MORTGAGE], text, 2) == [_loan(15), _loan(20)]  # the cap
    assert with_written_list_items([_loan(15)], [MORTGAGE], "a term of 15, 20 and 50 years", 8) == [
        _loan(15), _loan(20)]  # 50 is past the schema's maximum
    assert with_written_list_items([_loan(15)], [], text, 8) == [_loan(15)]  # a tool not given: left alone
    # calls differing in two arguments are no group; an item another argument holds is not missing
    assert with_written_list_items([_loan(15), _loan(20, 300000)], [MORTGAGE], text, 8) == [
        _loan(15), _loan(20, 300000)]
    area = Tool("area", "", {"type": "object", "properties": {"length": {"type": "number"},
                                                             "width": {"type": "number"}}})
    rectangle = [{"name": "area", "arguments": {"length": 5, "width": 10}}]
    assert with_written_list_items(rectangle, [area], "a rectangle of length 5 and 10 m", 8) == rectangle
    # a float argument gets float items; a number nested deeper is no group's argument
    assert with_written_list_items([{"name": "area", "arguments": {"length": 2.0}}], [area],
                                   "a length of 2, 3 and 4 m", 8) == [
        {"name": "area", "arguments": {"length": x}} for x in (2.0, 3.0, 4.0)]
    # a lone call goes over a list only where a word of its argument's name is written beside it (a helper's
    # cases): "hour 2 ... days 1, 2 and 3"; the two calls of a group say which list on their own
    hour = Tool("hour", "", {"type": "object", "properties": {"hour": {"type": "integer"}}})
    lone = [{"name": "hour", "arguments": {"hour": 2}}]
    assert with_written_list_items(lone, [hour], "The forecast for hour 2. Days 1, 2 and 3 are holidays.", 8) == lone
    assert with_written_list_items([{"name": "hour", "arguments": {"hour": 1}}, {"name": "hour", "arguments": {
        "hour": 3}}], [hour], "Get 1, 2 and 3.", 8) == [{"name": "hour", "arguments": {"hour": h}} for h in (1, 2, 3)]
    # an item in two lists: which one is not known; the group's calls taking other items in other arguments
    two = [{"name": "hour", "arguments": {"hour": 2}}]
    assert with_written_list_items(two, [hour], "hours 2, 1 and 3; hours 2 and 4", 8) == two
    # a lone call holding a later item: the user may have named it alone ("only for the 30 year term")
    assert with_written_list_items([_loan(30)], [MORTGAGE], text, 8) == [_loan(30)]
    # two tools over one list: each gets its missing items (an item another tool's call holds is still missing)
    square = Tool("square", "", {"type": "object", "properties": {"n": {"type": "integer"}}})
    fact = Tool("factorial", "", {"type": "object", "properties": {"n": {"type": "integer"}}})
    both = [{"name": t, "arguments": {"n": n}} for t in ("factorial", "square") for n in (5, 10)]
    assert with_written_list_items(both, [square, fact], "The factorial and the square of 5, 10 and 15.", 8) == [
        {"name": t, "arguments": {"n": n}} for t in ("factorial", "square") for n in (5, 10, 15)][:2] + [
        {"name": "factorial", "arguments": {"n": 15}}] + [
        {"name": "square", "arguments": {"n": n}} for n in (5, 10, 15)]
    # the type of the group's last call; anything not a call object is left alone
    assert with_written_list_items([{"name": "square", "arguments": {"n": 5.0}}, {"name": "square", "arguments": {
        "n": 7}}], [square], "5, 7 and 9", 8)[-1] == {"name": "square", "arguments": {"n": 9}}
    assert with_written_list_items(["not a call", None, {"name": "square", "arguments": None}], [square],
                                   "n of 5, 7 and 9", 8) == ["not a call", None, {"name": "square", "arguments": None}]
    add = Tool("add", "", {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}})
    pair = [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert with_written_list_items(pair, [add], "What is the sum of a 1, 2 and 3?", 8) == pair
    labelled = Tool("f", "", {"type": "object", "properties": {"n": {"type": "integer"}, "label": {"type": "string"}}})
    held_as_text = [{"name": "f", "arguments": {"n": 5, "label": "10"}}]
    assert with_written_list_items(held_as_text, [labelled], "n of 5 and 10", 8) == held_as_text
    nested = Tool("n", "", {"type": "object", "properties": {"o": {"type": "object"}}})
    deep = [{"name": "n", "arguments": {"o": {"x": 1}}}]
    assert with_written_list_items(deep, [nested], "o of 1, 2 and 3", 8) == deep


def test_written_at_finds_whole_words_and_whole_numbers():
    from agent.grounding import written_at

    assert written_at("New  York and new york; Newark", "new york") == [(0, 8), (13, 21)]
    assert written_at("seasons 2018 and 2020.", 2018) == [(8, 12)] and written_at("2.5", 2.50) == [(0, 3)]
    # a number inside a longer one is not written (a helper's cases)
    assert written_at("2.5", 2) == [] and written_at("2.5", 5) == [] and written_at("-5 and 5", 5) == [(7, 8)]
    assert written_at("-5 and 5", -5) == [(0, 2)] and written_at("2,5", 5) == [(2, 3)]
    assert written_at("new york", "NEW  York", plain=True) == [(0, 8)]
    assert written_at("a b", " ") == [] and written_at("true", True) == [] and written_at("1", 10 ** 5000) == []


SHOWS = Tool("shows", "", {"type": "object", "properties": {
    "service": {"type": "string"}, "titles": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
    "required": ["service", "titles"]})


def _shows(service, titles):
    return {"name": "shows", "arguments": {"service": service, "titles": titles}}


def test_a_list_every_call_holds_is_shared_out_by_where_each_item_is_written():
    from agent.parallel_calls import with_shared_list_split

    text = "Ratings on Netflix for 'Friends', and Hulu for 'The Office' and 'Stranger Things'"
    titles = ["Friends", "The Office", "Stranger Things"]
    copied = [_shows("Netflix", titles), _shows("Hulu", titles)]
    # dev split, parallel_5: Qwen2.5-Coder-0.5B gave both calls all three
    assert with_shared_list_split(copied, [SHOWS], text) == [_shows("Netflix", ["Friends"]),
                                                            _shows("Hulu", ["The Office", "Stranger Things"])]
    # every item after the last call's string, or before every one: the calls stand
    for same in ("Friends, The Office and Stranger Things on Netflix and Hulu",
                 "On Netflix and Hulu: Friends, The Office and Stranger Things",
                 "Ratings on Netflix for 'Friends', and Hulu for 'The Office' and 'Dark'"):  # an item not written
        assert with_shared_list_split(copied, [SHOWS], same) == copied
    # a call's string written twice, or not at all
    assert with_shared_list_split(copied, [SHOWS], text + " on Netflix") == copied
    assert with_shared_list_split(copied, [SHOWS], text.replace("Hulu", "Disney")) == copied
    # an item written after both: it goes to each call it follows last (written twice)
    assert with_shared_list_split(copied, [SHOWS], text + "; 'Friends' too") == [
        _shows("Netflix", ["Friends"]), _shows("Hulu", ["Friends", "The Office", "Stranger Things"])]
    strict = Tool("shows", "", {**SHOWS.parameters, "properties": {
        **SHOWS.parameters["properties"], "titles": {"type": "array", "items": {"type": "string"}, "minItems": 2}}})
    assert with_shared_list_split(copied, [strict], text) == copied  # ["Friends"] does not validate
    one = [_shows("Netflix", ["Friends"]), _shows("Hulu", ["Friends"])]
    assert with_shared_list_split(one, [SHOWS], text) == one  # a list of one is no list to share
    # read the other way where the items come before their call's string (a helper's cases)
    assert with_shared_list_split(copied, [SHOWS], "'Friends' on Netflix, and 'The Office' and 'Stranger Things' "
                                  "on Hulu") == [_shows("Netflix", ["Friends"]),
                                                 _shows("Hulu", ["The Office", "Stranger Things"])]
    # mixed orders: neither reading gives every call an item
    assert with_shared_list_split(copied, [SHOWS], "Netflix for 'Friends', and 'The Office' and 'Stranger Things' "
                                  "on Hulu") == copied
    # an item written only inside a longer one is that one's (a helper's case: sequels)
    sequels = ["Frozen", "Moana", "Frozen II"]
    assert with_shared_list_split([_shows("Disney+", sequels), _shows("Netflix", sequels)], [SHOWS],
                                  "Check Disney+ for 'Frozen' and 'Moana', and Netflix for 'Frozen II'") == [
        _shows("Disney+", ["Frozen", "Moana"]), _shows("Netflix", ["Frozen II"])]
    # calls not of the shape: names that are not strings, arguments not objects, other calls in between
    odd = [{"name": ["shows"], "arguments": {}}, {"name": "shows", "arguments": None}, "not a call"]
    assert with_shared_list_split(odd, [SHOWS], text) == odd
    other = {"name": "other", "arguments": {"x": 1}}
    assert with_shared_list_split([copied[0], other, copied[1]], [SHOWS], text) == [
        _shows("Netflix", ["Friends"]), other, _shows("Hulu", ["The Office", "Stranger Things"])]


def test_a_shared_list_is_shared_out_where_numbers_differ_too():
    from agent.parallel_calls import with_shared_list_split

    reserve = Tool("reserve", "", {"type": "object", "properties": {
        "location": {"type": "string"}, "amenities": {"type": "array", "items": {"type": "string"}},
        "km": {"type": "integer"}, "open": {"type": "boolean"}, "region": {"type": "string"}}})
    items = ["Picnic Tables", "Public Restrooms", "Playgrounds", "Biking Trails"]

    def call(where, km, **more):
        return {"name": "reserve", "arguments": {"location": where, "amenities": items, "km": km, **more}}

    text = ("A nature reserve around Berkeley within 10 kilometers that has picnic tables and public restrooms, as "
            "well as one around Tokyo within 5 kilometers that has playgrounds and biking trails.")
    out = with_shared_list_split([call("Berkeley", 10), call("Tokyo", 5)], [reserve], text)  # dev, parallel_27
    assert [c["arguments"]["amenities"] for c in out] == [items[:2], items[2:]]
    assert [c["arguments"]["km"] for c in out] == [10, 5]
    # two strings differ: which one the items follow is not known, the calls stand
    two = [call("Berkeley", 10, region="CA"), call("Tokyo", 5, region="Kanto")]
    assert with_shared_list_split(two, [reserve], text + " CA Kanto") == two
    opened = [call("Berkeley", 10, open=True), call("Tokyo", 5, open=False)]
    assert [c["arguments"]["amenities"] for c in with_shared_list_split(opened, [reserve], text)] == [items[:2],
                                                                                                    items[2:]]


def _rank(team, league):
    return {"name": "rank", "arguments": {"team": team, "league": league}}


RANK = Tool("rank", "", {"type": "object", "properties": {"team": {"type": "string"}, "league": {"type": "string"}},
                         "required": ["team", "league"]})


def test_respectively_drops_the_calls_that_pair_two_lists_otherwise():
    from agent.parallel_calls import with_respective_pairs

    text = ("What is the current ranking of Barcelona and Manchester United in the UEFA Champions League and La Liga "
            "respectively?")
    three = [_rank("Barcelona", "UEFA Champions League"), _rank("Manchester United", "UEFA Champions League"),
             _rank("Manchester United", "La Liga")]  # dev split, parallel_47 (Qwen2.5-Coder-0.5B)
    assert with_respective_pairs(three, [RANK], text) == [three[0], three[2]]
    # no "respectively": every pair may be wanted
    assert with_respective_pairs(three, [RANK], text.replace(" respectively", "")) == three
    # a pair the user wrote is missing: nothing is dropped
    assert with_respective_pairs(three[:2], [RANK], text) == three[:2]
    # a value not written, or lists of different lengths: the calls stand
    invented = three + [_rank("Barcelona", "Serie A")]
    assert with_respective_pairs(invented, [RANK], text) == invented
    assert with_respective_pairs(invented, [RANK], text + " Serie A too") == invented
    # numbers pair too; the order is the order first written, not the order of the calls
    loan = Tool("loan", "", {"type": "object", "properties": {"bank": {"type": "string"}, "rate": {"type": "number"}}})
    calls = [{"name": "loan", "arguments": {"bank": b, "rate": r}}
             for b, r in (("Chase", 4.5), ("Ally", 4.5), ("Ally", 3.9), ("Chase", 3.9))]
    assert with_respective_pairs(calls, [loan], "Rates of 3.9 and 4.5 at Ally and Chase respectively") == [
        calls[0], calls[2]]  # Chase 4.5, Ally 3.9
    # "respectively" of something else, or not right after the lists, or "not respectively" (a helper's cases)
    for other in ("What is the ranking of Barcelona and Manchester United in the UEFA Champions League and La Liga. "
                  "My sons are 10 and 12 respectively.",
                  "Barcelona and Manchester United in the UEFA Champions League and La Liga, and the weather in "
                  "Oslo and Bergen in C and F respectively",
                  "Barcelona and Manchester United in the UEFA Champions League and La Liga - not respectively"):
        assert with_respective_pairs(three, [RANK], other) == three
    # the pairs are read in the sentence of "respectively", from each value's last place there
    four = three + [_rank("Barcelona", "La Liga")]
    assert with_respective_pairs(four, [RANK], "I mostly follow La Liga. The ranking of Barcelona and Manchester "
                                 "United in the UEFA Champions League and La Liga respectively?") == [three[0], three[2]]
    years = Tool("loan", "", {"type": "object", "properties": {"amount": {"type": "integer"},
                                                               "years": {"type": "integer"}}})
    loans = [{"name": "loan", "arguments": {"amount": a, "years": y}} for a in (100000, 200000) for y in (15, 30)]
    assert with_respective_pairs(loans, [years], "On the 30 of May: loans of 100000 and 200000 over 15 and 30 years "
                                 "respectively") == [loans[0], loans[3]]


def test_with_written_lists_applies_both_list_rules():
    from agent.parallel_calls import with_written_lists

    text = "A loan term of 15, 20 and 30 years; on Netflix for 'Friends', and Hulu for 'The Office' and 'Dark'"
    titles = ["Friends", "The Office", "Dark"]
    calls = [_loan(15), _shows("Netflix", titles), _shows("Hulu", titles)]
    assert with_written_lists(calls, [MORTGAGE, SHOWS], text, 8) == [
        _loan(15), _loan(20), _loan(30), _shows("Netflix", ["Friends"]), _shows("Hulu", ["The Office", "Dark"])]


@pytest.mark.parametrize("parallel", [True, None, False])
def test_the_engine_completes_a_written_list_only_where_several_calls_are_asked_for(smol_dir, monkeypatch, parallel):
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    ask = [{"role": "user", "content": "A loan of $400,000 at 4% for a loan term of 15, 20 and 30 years."}]
    _scripted_decodes(monkeypatch, engine, [_turn([_loan(15)])])
    out = engine.turn(ask, [MORTGAGE], "required", parallel_tool_calls=parallel)
    assert out.calls == ([_loan(15), _loan(20), _loan(30)] if parallel else [_loan(15)])
    _scripted_decodes(monkeypatch, engine, [_turn([_loan(15)])])
    off = engine.turn(ask, [MORTGAGE], "required", parallel_tool_calls=parallel, config=EngineConfig(grounding=False))
    assert off.calls == [_loan(15)]
    # a list only a tool result writes is not what the user asked for (a helper's case)
    results = [{"role": "user", "content": "A loan of $400,000 at 4%: which loan term? Only the first one."},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "terms", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "loan term of 15, 20 and 30 years"}]
    _scripted_decodes(monkeypatch, engine, [_turn([_loan(15)])])
    assert engine.turn(results, [MORTGAGE], "required", parallel_tool_calls=parallel).calls == [_loan(15)]


def _streaming_decodes(monkeypatch, engine, turns):
    """Make ``engine._decode`` stream each of ``turns``' text to its ``on_text`` and return it, in order (a
    ``(streamed, turn)`` pair streams ``streamed`` instead)."""
    served = []

    def decode(*args, exclude=None, answer_only=False, integer_prefixes=frozenset()):
        streamed, turn = turns[len(served)] if isinstance(turns[len(served)], tuple) else (None, turns[len(served)])
        served.append(turn)
        if args[6] is not None:
            args[6](turn.text if streamed is None else streamed)
        return turn

    monkeypatch.setattr(engine, "_decode", decode)
    return served


RIDES = Tool("rides", "", {"type": "object", "properties": {"max_cost": {"type": "integer"}}, "required": ["max_cost"]})
RIDE_ASK = [{"role": "user", "content": "A ride with a maximum cost of $50"}]


def test_text_streamed_after_the_last_discard_is_the_returned_turns_text(smol_dir, monkeypatch):
    """A turn decoded again streams the new decode after a discard; where the engine then returns the earlier decode
    (the second was cut by the budget), it discards again and streams the earlier text once more."""
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    seen = []
    on_text, on_discard = (lambda t: seen.append(t)), (lambda: seen.append(None))
    first = _turn([{"name": "rides", "arguments": {"max_cost": 500000}}], text="first")
    _streaming_decodes(monkeypatch, engine, [first, _turn([{"name": "rides", "arguments": {"max_cost": 50}}],
                                                          text="second")])
    out = engine.turn(RIDE_ASK, [RIDES], "required", on_text=on_text, on_discard=on_discard)
    assert out.text == "second" and seen == ["first", None, "second"]
    seen.clear()
    _streaming_decodes(monkeypatch, engine, [first, _turn(None, text="cut", stop="length", is_call=True)])
    out = engine.turn(RIDE_ASK, [RIDES], "required", on_text=on_text, on_discard=on_discard)
    assert out is first and seen == ["first", None, "cut", None, "first"]
    seen.clear()  # a several-call turn's end rule cut the text after it streamed: discarded, streamed again
    cut = _turn([{"name": "rides", "arguments": {"max_cost": 50}}], text="call 50")
    _streaming_decodes(monkeypatch, engine, [("call 50 + call 5", cut)])
    assert engine.turn(RIDE_ASK, [RIDES], "required", on_text=on_text, on_discard=on_discard) is cut
    assert seen == ["call 50 + call 5", None, "call 50"]
    seen.clear()  # a closing the engine wrote after the decoded text: streamed on, nothing discarded
    _streaming_decodes(monkeypatch, engine, [("call 5", cut)])
    engine.turn(RIDE_ASK, [RIDES], "required", on_text=on_text, on_discard=on_discard)
    assert seen == ["call 5", "0"]
    seen.clear()  # without on_discard: every decode's text, as before
    _streaming_decodes(monkeypatch, engine, [first, _turn(None, text="cut", stop="length", is_call=True)])
    engine.turn(RIDE_ASK, [RIDES], "required", on_text=on_text)
    assert seen == ["first", "cut"]


def test_a_call_past_the_first_streams_once_whole_so_a_dropped_one_never_streams(smol_dir, monkeypatch):
    """Several calls: the first streams as decoded, each later one once whole (and kept: the decoder streams no step
    the end rule stopped at), so a call the end rule drops or the budget cuts is never streamed: no discard."""
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)

    def block(cost):
        return f'<tool_call>\n{{"name": "rides", "arguments": {{"max_cost": {cost}}}}}\n</tool_call>'
    kept = block(50) + "\n" + block(40)
    decoded = kept + "\n" + block(50)[:-20]  # the third call (a repeat) was being written when the rule fired
    pieces = [decoded[i:i + 7] for i in range(0, len(decoded), 7)]
    turn = _turn([{"name": "rides", "arguments": {"max_cost": c}} for c in (50, 40)], text=kept, stop="stop")

    def decode(*args, **kwargs):
        for piece in pieces:
            args[6](piece)
        return turn
    monkeypatch.setattr(engine, "_decode", decode)
    seen = []
    for parallel in (True, None):
        seen.clear()
        out = engine.turn(RIDE_ASK, [RIDES], "required", parallel_tool_calls=parallel, on_text=seen.append,
                          on_discard=lambda: seen.append(None))
        assert out is turn and None not in seen and "".join(seen) == kept
        assert seen[:3] == pieces[:3]  # the first call streams as it is decoded
        assert "\n" + block(40) in seen  # the second streams whole (the text before it too), once it closes
    seen.clear()  # one call at most: streamed as decoded, a cut discarded as before
    engine.turn(RIDE_ASK, [RIDES], "required", parallel_tool_calls=False, on_text=seen.append,
                on_discard=lambda: seen.append(None))
    assert seen[:len(pieces)] == pieces and seen[len(pieces)] is None and seen[-1] == kept


def test_agent_stream_marks_a_turn_decoded_again_with_a_discard_event(smol_dir, monkeypatch):
    _, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    _streaming_decodes(monkeypatch, engine, [
        _turn([{"name": "rides", "arguments": {"max_cost": 500000}}], text="first"),
        _turn([{"name": "rides", "arguments": {"max_cost": 50}}], text="second")])
    agent = Agent(engine, tools=[RIDES])
    events = list(agent.stream(RIDE_ASK[0]["content"], tool_choice="required", max_steps=1))
    kinds = [(e.type, e.text) for e in events if e.type in ("token", "discard")]
    assert kinds == [("token", "first"), ("discard", ""), ("token", "second")]
    assert [c.arguments for c in events[-1].result.pending_calls] == [{"max_cost": 50}]  # RIDES has no function


def test_agent_stream_calls_an_engine_without_on_discard_as_before(smol_dir, monkeypatch):
    """An Engine written before ``on_discard`` joined the protocol still streams."""
    _, gen = scripted(smol_dir, "hermes", "", None)
    inner = LocalEngine(gen)
    _streaming_decodes(monkeypatch, inner, [_turn([{"name": "rides", "arguments": {"max_cost": 50}}], text="one")])

    class OldEngine:
        def turn(self, messages, tools, tool_choice="auto", response_format=None, parallel_tool_calls=None,
                 config=EngineConfig(), on_text=None):
            return inner.turn(messages, tools, tool_choice, response_format, parallel_tool_calls, config, on_text)

        def spec(self):
            return inner.spec()

    events = list(Agent(OldEngine(), tools=[RIDES]).stream(RIDE_ASK[0]["content"], tool_choice="required",
                                                           max_steps=1))
    assert [(e.type, e.text) for e in events if e.type in ("token", "discard")] == [("token", "one")]


def test_an_optional_parameter_the_request_names_is_named_only_by_every_word_of_its_name():
    from agent.grounding import name_words, named_optional

    assert name_words("max_cost") == ["cost"] and name_words("maxResults") == ["results"]
    assert name_words("item_id") == [] and name_words("HTTPServer2Port") == ["http", "server", "port"]
    params = {"type": "object", "required": ["source"], "properties": {
        "source": {"type": "string"}, "max_cost": {"type": "number"}, "mode": {"type": "string"},
        "sizes": {"enum": ["S", "XL"]}, "return_date": {"type": ["string", "null"]},
        "preferences": {"type": "object"}, "item_id": {"type": "string"}, "untyped": {}}}
    ask = Grounding("A ride from the source, maximum cost of $50, size XL, return by bus, with preferences, "
                    "item id 4, untyped")
    # "mode" is not written; "return_date" misses "date"; an object, a name of generic words, a schema naming no
    # type or values, and a required parameter are never named
    assert named_optional(params, ask) == ["max_cost", "sizes"]
    assert named_optional(params, Grounding("A ride with no limit")) == []


def test_the_grammar_requires_an_optional_parameter_the_users_message_names(smol_dir):
    """'for 3 days' names ``days``: the turn's grammar refuses the call without it (the model otherwise closes the
    call first) but the tool as registered is unchanged; not with grounding off, nor after tool results."""
    fmt, gen = scripted(smol_dir, "hermes", "", None)
    engine = LocalEngine(gen)
    ask = [{"role": "user", "content": "The weather in Oslo in celsius for the next 3 days?"}]
    without = gen.tokenizer.encode(call_text("hermes", [("get_weather", {"city": "Oslo", "unit": "celsius"})]),
                                   add_special_tokens=False)
    with_days = gen.tokenizer.encode(call_text("hermes", [("get_weather", {"city": "Oslo", "unit": "celsius",
                                                                          "days": 3})]), add_special_tokens=False)

    def grammar(messages, **config):
        _, g, allowed, _ = engine._prepare(messages, [WEATHER, TIME], "required", None, None, EngineConfig(**config))
        return g, allowed

    g, allowed = grammar(ask)
    assert gen.new_state(g).valid_prefix_len(with_days) == len(with_days)
    assert gen.new_state(g).valid_prefix_len(without) < len(without)
    assert allowed[0].parameters["required"] == ["city", "unit", "days"]
    assert WEATHER.parameters["required"] == ["city", "unit"] and allowed[1] is TIME
    after_results = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    for g, _ in (grammar(ask, grounding=False), grammar(after_results)):
        state = gen.new_state(g)
        assert state.valid_prefix_len(without) == len(without)


def test_a_name_is_written_as_it_stands_or_word_by_word_with_inflections_not_as_a_prefix():
    from agent.grounding import named_optional

    params = {"type": "object", "properties": {k: {"type": "string"} for k in (
        "count", "port", "timeout", "language", "max_cost", "maxResults", "return_type", "include_comments")}}
    for text in ("the country", "our Portugal office", "what time is it", "the Lang family"):
        assert named_optional(params, Grounding(text)) == [], text
    assert named_optional(params, Grounding("set max_cost to 50 and maxResults=5")) == ["max_cost", "maxResults"]
    assert named_optional(params, Grounding("returned as text, including comments")) == ["return_type",
                                                                                         "include_comments"]


def test_named_parameters_a_schema_cannot_hold_leave_the_tool_as_registered_and_empty_values_are_dropped():
    """``maxProperties: 2`` cannot hold three keys: the tool is not changed (it raised ``SchemaError`` on every turn
    naming them); an empty value the grammar made the model write in a named tool's call is dropped."""
    from agent.grounding import asking_named, without_empty_named

    tight = Tool("search_items", "Search items.", {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}, "offset": {"type": "integer"}},
        "required": ["query"], "maxProperties": 2}, strict=False)
    ask = Grounding("what's the limit and offset of my card?")
    assert asking_named(tight, ask) is tight
    note = Tool.from_schema("note", {"type": "object", "properties": {
        "text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}, "pinned": {"type": "boolean"}},
        "required": ["text"]})
    named = asking_named(note, Grounding("a note without tags"))
    assert named is not note and named.parameters["required"] == ["text", "tags"]
    assert note.parameters["required"] == ["text"]
    calls = [{"name": "note", "arguments": {"text": "", "tags": [], "pinned": False}},
             {"name": "search_items", "arguments": {"query": "x", "limit": 0}}]
    out = without_empty_named(calls, [note, tight], Grounding("a note without tags"))
    # the required text stays even empty; a tool whose parameters the request does not name is left as decoded
    assert out == [{"name": "note", "arguments": {"text": "", "pinned": False}}, calls[1]]
