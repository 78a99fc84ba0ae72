"""Where a turn ends: every end-of-generation token the model declares ends it where the grammar accepts (after the
whitespace the model writes), and a several-call turn ends at the first call that repeats an earlier one, at the
call cap, or at the budget with its whole calls returned.

The target is scripted (a backend row of its own, ``decoding.BACKENDS``): its argmax writes a given text, so each
test states exactly what the model wants to write, for every tool format's tiny family tokenizer."""
from __future__ import annotations

import dataclasses
import json

import openai
import pytest
import torch

from agent import Agent
from agent.engine import EngineConfig, LocalEngine
from agent.formats import FORMATS, make_format
from agent.server import ServerThread, create_app
from decoding import BACKENDS, Backend, Generator, LoadedModel
from schemas import Tool

from test_formats import WEATHER, family

OSLO = {"city": "Oslo", "unit": "celsius"}
ROME = {"city": "Rome", "unit": "celsius"}
TIME = Tool.from_openai({"type": "function", "function": {
    "name": "get_time", "description": "Local time of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}})


class ScriptedLoaded(LoadedModel):
    """A tiny model whose target writes ``script`` (token ids) greedily after any prompt."""

    script: list[int] = []


class ScriptedLM:
    """A :class:`decoding.TargetModel` whose logits put the script's next token first (10.0; all others 0.0)."""

    def __init__(self, loaded: ScriptedLoaded):
        self.loaded, self.device, self.vocab_size = loaded, torch.device("cpu"), loaded.vocab_size
        self.seq: list[int] = []
        self.prompt_len = 0

    @property
    def length(self) -> int:
        return len(self.seq)

    def reset(self) -> None:
        self.seq = []

    def reuse_prefix(self, prompt: list[int], hidden: bool = False) -> int:
        self.prompt_len, self.seq = len(prompt), []
        return 0

    def cached_hidden(self, n: int) -> torch.Tensor:
        raise ValueError("no hidden states kept")

    def forward(self, tokens, *, num_logits=None, hidden=False, logit_rows=None):
        start = len(self.seq)
        self.seq += tokens
        rows = logit_rows if logit_rows is not None else list(range(len(tokens) - (num_logits or len(tokens)),
                                                                    len(tokens)))
        logits = torch.zeros((len(rows), self.vocab_size))
        for r, i in enumerate(rows):
            out = start + i + 1 - self.prompt_len  # index of the output token these logits choose
            if 0 <= out < len(self.loaded.script):
                logits[r, self.loaded.script[out]] = 10.0
        return logits, None

    def crop(self, length: int) -> None:
        del self.seq[length:]

    def synchronize(self) -> None:
        pass


@pytest.fixture(autouse=True)
def scripted_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "scripted", Backend("scripted", "the test's scripted target", ScriptedLoaded,
                                                      lambda *a, **k: None, lambda loaded, kv: ScriptedLM(loaded)))


def scripted(smol_dir, name: str, text: str, end: str | None):
    """(format, Generator) for the ``name`` family whose model writes ``text`` and then the token ``end``."""
    tok, target, _ = family(smol_dir, name)
    loaded = ScriptedLoaded(**{f.name: getattr(target, f.name) for f in dataclasses.fields(target)})
    loaded.script = tok.encode(text, add_special_tokens=False) + ([tok.convert_tokens_to_ids(end)] if end else [])
    return make_format(tok), Generator(loaded)


def call_text(name: str, calls: list[tuple[str, dict]]) -> str:
    """The calls in the ``name`` family's layout (what its models write)."""
    objs = [json.dumps({"name": n, ("parameters" if name == "llama3_json" else "arguments"): a}) for n, a in calls]
    if name == "hermes":
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
    if name == "generic":
        return "<tool_call>[" + ", ".join(objs) + "]</tool_call>"
    return objs[0]


@pytest.mark.parametrize("drafter", ["none", "lookup"])
@pytest.mark.parametrize("name,newline", [(n, False) for n in FORMATS] + [("hermes", True)])
def test_an_end_token_other_than_eos_ends_the_turn(smol_dir, name, newline, drafter):
    """Qwen2.5-Coder writes ``</tool_call>``, ``\n``, ``<|endoftext|>`` (its EOS is ``<|im_end|>``): before, the
    grammar forbade both, and every turn was forced into another call up to the budget."""
    text = call_text(name, [("get_weather", OSLO)]) + ("\n" if newline else "")
    fmt, gen = scripted(smol_dir, name, text, "<|endoftext|>")
    endoftext = gen.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext in gen.eog_token_ids and endoftext != gen.tokenizer.eos_token_id
    engine = LocalEngine(gen)
    turn = engine.turn([{"role": "user", "content": "Weather in Oslo?"}], [WEATHER], "required",
                       config=EngineConfig(drafter=drafter, max_new_tokens=120))
    assert turn.stop_reason == "eos" and turn.calls == [{"name": "get_weather", "arguments": OSLO}], turn.text
    assert turn.text == text  # the end token itself is not output
    res = Agent(engine, [WEATHER]).run("Weather in Oslo?", tool_choice="required", max_new_tokens=120, max_steps=1)
    assert not res.truncated and [(c.name, c.arguments) for c in res.pending_calls] == [("get_weather", OSLO)]
    events = list(Agent(engine, [WEATHER]).stream("Weather in Oslo?", tool_choice="required", max_new_tokens=120,
                                                  max_steps=1))
    assert "".join(e.text for e in events if e.type == "token") == text
    assert [e.call.name for e in events if e.type == "tool_call_started"] == ["get_weather"]


def test_an_end_token_is_masked_where_the_grammar_does_not_accept(smol_dir):
    fmt, gen = scripted(smol_dir, "hermes", "", None)
    state = gen.new_state(fmt.turn_grammar([WEATHER], "required"))
    row = state.next_mask()
    from constraints import is_allowed_row

    assert not any(is_allowed_row(row, t) for t in gen.eog_token_ids)  # a call must come first
    text = call_text("hermes", [("get_weather", OSLO)])
    state.consume_many(gen.tokenizer.encode(text, add_special_tokens=False))
    row = state.next_mask()
    assert all(is_allowed_row(row, t) for t in gen.eog_token_ids)


@pytest.mark.parametrize("drafter", ["none", "lookup"])
@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.parallel])
def test_a_parallel_turn_ends_at_the_first_repeated_call_and_returns_each_call_once(smol_dir, name, drafter):
    repeats = [("get_weather", OSLO), ("get_time", {"city": "Oslo"}), ("get_weather", OSLO), ("get_weather", ROME)]
    text = call_text(name, repeats)
    if name == "generic":
        text = text[:-len("]</tool_call>")] + ", "  # the model would go on writing calls
    fmt, gen = scripted(smol_dir, name, text, None)
    turn = LocalEngine(gen).turn([{"role": "user", "content": "Weather and time in Oslo?"}], [WEATHER, TIME],
                                 "required", parallel_tool_calls=True,
                                 config=EngineConfig(drafter=drafter, max_new_tokens=200))
    assert turn.stop_reason == "stop" and not turn.truncated
    assert turn.calls == [{"name": "get_weather", "arguments": OSLO}, {"name": "get_time", "arguments": {"city": "Oslo"}}]
    assert fmt.parse(turn.text)[0] == turn.calls  # the kept text is a complete turn


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.parallel])
def test_a_parallel_turn_stops_at_the_call_cap(smol_dir, name):
    calls = [("get_weather", {"city": c, "unit": "celsius"}) for c in ("Oslo", "Rome", "Paris", "Bern")]
    fmt, gen = scripted(smol_dir, name, call_text(name, calls), None)
    turn = LocalEngine(gen).turn([{"role": "user", "content": "Weather?"}], [WEATHER], "required",
                                 parallel_tool_calls=True, config=EngineConfig(max_new_tokens=300,
                                                                              max_parallel_calls=2))
    assert [c["arguments"]["city"] for c in turn.calls] == ["Oslo", "Rome"] and turn.stop_reason == "stop"


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.parallel])
def test_a_parallel_turn_cut_by_the_budget_returns_its_whole_calls_never_the_cut_one(smol_dir, name):
    calls = [("get_weather", OSLO), ("get_weather", ROME), ("get_weather", {"city": "Paris", "unit": "celsius"})]
    text = call_text(name, calls)
    fmt, gen = scripted(smol_dir, name, text, None)
    whole_two = len(gen.tokenizer.encode(call_text(name, calls[:2]), add_special_tokens=False))
    engine = LocalEngine(gen)
    turn = engine.turn([{"role": "user", "content": "Weather?"}], [WEATHER], "required", parallel_tool_calls=True,
                       config=EngineConfig(max_new_tokens=whole_two + 6))
    assert turn.truncated and turn.calls == [{"name": "get_weather", "arguments": OSLO},
                                             {"name": "get_weather", "arguments": ROME}]
    res = Agent(engine, [WEATHER]).run("Weather?", tool_choice="required", parallel_tool_calls=True,
                                       max_new_tokens=whole_two + 6)
    assert res.truncated and [c.arguments["city"] for c in res.pending_calls] == ["Oslo", "Rome"]
    turn = engine.turn([{"role": "user", "content": "Weather?"}], [WEATHER], "required", parallel_tool_calls=True,
                       config=EngineConfig(max_new_tokens=3))
    assert turn.truncated and turn.calls is None  # nothing whole yet: nothing returned


def test_server_answers_tool_calls_ended_by_the_models_own_end_token(smol_dir):
    fmt, gen = scripted(smol_dir, "hermes", call_text("hermes", [("get_weather", OSLO)]) + "\n", "<|endoftext|>")
    with ServerThread(create_app(LocalEngine(gen), model_name="scripted")) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Oslo?"}],
                                           tools=[{"type": "function", "function": {
                                               "name": WEATHER.name, "description": WEATHER.description,
                                               "parameters": WEATHER.parameters}}],
                                           tool_choice="required", max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", OSLO)]


def test_several_calls_asked_for_make_hermes_write_a_second_call(smol_dir):
    """``parallel_tool_calls=True`` on hermes: at least two marked blocks (Qwen2.5-Coder-0.5B stops after one call
    where several are asked for); with the default (None) the model ends the turn itself; a second call that
    repeats the first is dropped."""
    one = call_text("hermes", [("get_weather", OSLO)]) + "\n"
    fmt, gen = scripted(smol_dir, "hermes", one + call_text("hermes", [("get_weather", OSLO)]), "<|endoftext|>")
    engine = LocalEngine(gen)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    turn = engine.turn(ask, [WEATHER], "required", config=EngineConfig(max_new_tokens=200))
    assert turn.stop_reason == "stop" and turn.calls == [{"name": "get_weather", "arguments": OSLO}]
    fmt, gen = scripted(smol_dir, "hermes", one, "<|endoftext|>")
    engine = LocalEngine(gen)
    turn = engine.turn(ask, [WEATHER], "required", config=EngineConfig(max_new_tokens=200))
    assert turn.stop_reason == "eos" and len(turn.calls) == 1  # default: the model ends
    turn = engine.turn(ask, [WEATHER], "required", parallel_tool_calls=True, config=EngineConfig(max_new_tokens=60))
    assert turn.stop_reason != "eos" and turn.text.startswith(one + "<tool_call>")  # asked for several: goes on


def test_a_remote_engine_keeps_the_whole_calls_of_a_turn_the_budget_cut(smol_dir):
    from agent.remote import OpenAIEngine

    calls = [("get_weather", OSLO), ("get_weather", ROME), ("get_weather", {"city": "Paris", "unit": "celsius"})]
    fmt, gen = scripted(smol_dir, "hermes", call_text("hermes", calls), None)
    budget = len(gen.tokenizer.encode(call_text("hermes", calls[:2]), add_special_tokens=False)) + 6
    with ServerThread(create_app(LocalEngine(gen), model_name="scripted")) as url:
        turn = OpenAIEngine(url, "scripted").turn([{"role": "user", "content": "Weather?"}], [WEATHER], "required",
                                                  parallel_tool_calls=True,
                                                  config=EngineConfig(max_new_tokens=budget))
    assert turn.truncated and [json.loads(c["arguments"])["city"] for c in turn.calls] == ["Oslo", "Rome"]


def test_the_repeat_rule_is_checked_on_the_final_text_too(smol_dir, monkeypatch):
    """A step that ends inside a multi-byte character is not shown to the rule; when it is also the last step (the
    budget), the final text is checked: the repeat is never returned."""
    fmt, gen = scripted(smol_dir, "hermes", "", None)
    text = call_text("hermes", [("get_weather", OSLO), ("get_weather", ROME), ("get_weather", OSLO)]) + "\n<tool_"
    from decoding import DecodeResult, DecodeStats

    monkeypatch.setattr(gen, "generate", lambda *a, **k: DecodeResult([], text, "length", DecodeStats()))
    turn = LocalEngine(gen).turn([{"role": "user", "content": "Weather?"}], [WEATHER], "required",
                                 parallel_tool_calls=True)
    assert turn.stop_reason == "stop" and [c["arguments"]["city"] for c in turn.calls] == ["Oslo", "Rome"]


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_an_explicit_eos_token_id_still_ends_on_every_end_token(smol_dir, drafter):
    from decoding import decode, speculative_decode
    from decoding.drafters import ChainDrafter, PromptLookupDrafter, SchemaDrafter

    text = call_text("generic", [("get_weather", OSLO)])
    fmt, gen = scripted(smol_dir, "generic", text, "<|endoftext|>")
    prompt = fmt.render([{"role": "user", "content": "Weather in Oslo?"}], [WEATHER])
    state = gen.new_state(fmt.turn_grammar([WEATHER], "required"))
    kwargs = dict(max_new_tokens=120, eos_token_id=gen.tokenizer.eos_token_id, tokenizer=gen.tokenizer)
    if drafter == "none":
        out = decode(ScriptedLM(gen.loaded), prompt, state, **kwargs)
    else:
        out = speculative_decode(ScriptedLM(gen.loaded), prompt, state,
                                 ChainDrafter([SchemaDrafter(), PromptLookupDrafter()]), **kwargs)
    assert out.stop_reason == "eos" and out.text == text


def test_a_cut_turn_counts_the_positions_where_the_grammar_masked_the_models_end(smol_dir):
    """``count_masked_ends``: a turn the grammar kept going (two calls asked for, the model ends after one) records
    where its argmax was an end token the mask forbade; a turn cut while the model was still writing records none."""
    text = call_text("hermes", [("get_weather", OSLO)]) + "\n"
    fmt, gen = scripted(smol_dir, "hermes", text, "<|endoftext|>")
    engine = LocalEngine(gen)
    messages = [{"role": "user", "content": "Weather in Oslo and Rome?"}]
    config = EngineConfig(drafter="none", max_new_tokens=len(gen.tokenizer.encode(text)) + 6, count_masked_ends=True)
    turn = engine.turn(messages, [WEATHER], "required", parallel_tool_calls=True, config=config)
    grammar = fmt.turn_grammar([WEATHER], "required", parallel=True)
    ids = fmt.render(messages, [WEATHER])
    out = gen.tokenizer.encode(turn.text, add_special_tokens=False)
    where = gen.masked_end_argmax(ids, out, grammar)  # past its script the model's ties go to token 0, an end token
    assert where[0] == len(gen.tokenizer.encode(text, add_special_tokens=False)), (where, turn.text)
    assert turn.stop_reason == "length" and turn.stats.masked_end_argmax == len(where) >= 1, turn.text
    off = engine.turn(messages, [WEATHER], "required", parallel_tool_calls=True,
                      config=dataclasses.replace(config, count_masked_ends=False))
    assert off.stop_reason == "length" and off.stats.masked_end_argmax == 0

    fmt, gen = scripted(smol_dir, "hermes", call_text("hermes", [("get_weather", ROME)]), "<|endoftext|>")
    cut = LocalEngine(gen).turn(messages, [WEATHER], "required", config=dataclasses.replace(config, max_new_tokens=5))
    assert cut.stop_reason == "length" and cut.stats.masked_end_argmax == 0


def test_min_calls_masks_the_models_end_until_that_many_calls(smol_dir):
    """``turn_grammar(parallel=True, min_calls=n)``: the model's end tokens are masked until n marked calls."""
    from constraints import is_allowed_row

    fmt, gen = scripted(smol_dir, "hermes", "", None)
    two = call_text("hermes", [("get_weather", OSLO), ("get_weather", ROME)]) + "\n"
    for min_calls, ends in ((2, True), (3, False)):
        state = gen.new_state(fmt.turn_grammar([WEATHER], "required", parallel=True, min_calls=min_calls))
        state.consume_many(gen.tokenizer.encode(two, add_special_tokens=False))
        assert all(is_allowed_row(state.next_mask(), t) for t in gen.eog_token_ids) is ends


FENCED = "```json\n" + json.dumps({"name": "get_weather", "arguments": OSLO}) + "\n```"


def test_hermes_takes_a_json_fence_under_auto_as_text_and_required_still_calls(smol_dir):
    """Both Qwen2.5-Coder models write a ```json fence where no tool fits (dev split: taking it as a call cost the
    0.5B its irrelevance), so under ``auto`` it is text, as vLLM's hermes parser reads it."""
    fmt, gen = scripted(smol_dir, "hermes", FENCED, "<|im_end|>")
    engine = LocalEngine(gen)
    turn = engine.turn([{"role": "user", "content": "Weather in Oslo?"}], [WEATHER], "auto",
                       config=EngineConfig(max_new_tokens=120))
    assert not turn.is_call and turn.calls is None and turn.text == FENCED
    turn = engine.turn([{"role": "user", "content": "Weather in Oslo?"}], [WEATHER], "required",
                       config=EngineConfig(max_new_tokens=120))
    # the grammar keeps the scripted model off the fence: a call in a layout it parses, valid for the tool
    assert [c["name"] for c in turn.calls] == ["get_weather"] and not turn.text.startswith("```")
    WEATHER.make_call(turn.calls[0]["arguments"])


@pytest.mark.parametrize("answer", ['{"code": "print(21)"}', '{"name": "Oslo", "temp": 21}'])
@pytest.mark.parametrize("after_results", [False, True])
def test_a_structured_answer_beside_tools_is_an_answer_not_a_call(smol_dir, answer, after_results):
    """``response_format`` with tools under ``auto``: the answer opens with ``{`` like a bare hermes call; it was
    taken for a call with no calls (``Agent.run`` raised TypeError, the server sent an empty message)."""
    fmt, gen = scripted(smol_dir, "hermes", answer, "<|im_end|>")
    schema = {"type": "object", "properties": {"code": {"type": "string"}, "name": {"type": "string"},
                                               "temp": {"type": "integer"}}, "additionalProperties": False}
    messages = [{"role": "user", "content": "Weather in Oslo as JSON?"}]
    if after_results:
        messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(OSLO)}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
    res = Agent(gen, [WEATHER]).run(messages, response_format=schema, max_steps=1)
    assert res.output == json.loads(answer) and not res.tool_calls and not res.pending_calls
    turn = LocalEngine(gen).turn(messages, [WEATHER], "auto", schema, config=EngineConfig(max_new_tokens=60))
    assert not turn.is_call and turn.calls is None and turn.text == answer


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_a_call_being_written_with_an_unwritten_value_ends_the_several_call_turn_before_the_budget(smol_dir, drafter):
    """The third call's finished value "Paris" is not in the conversation: the whole call would end the turn, so the
    turn ends as soon as that value is finished, not at the budget (a runaway invented value cannot cut it); where
    the conversation writes Paris, the same budget cuts the turn and only the whole calls come back."""
    paris = {"city": "Paris", "unit": "celsius"}
    text = call_text("hermes", [("get_weather", OSLO), ("get_weather", ROME), ("get_weather", paris)])
    fmt, gen = scripted(smol_dir, "hermes", text, "<|endoftext|>")
    budget = len(gen.tokenizer.encode(text[:text.index('"Paris",') + len('"Paris", "un')], add_special_tokens=False))
    engine = LocalEngine(gen)
    config = EngineConfig(drafter=drafter, max_new_tokens=budget)
    two = [{"name": "get_weather", "arguments": OSLO}, {"name": "get_weather", "arguments": ROME}]
    ended = engine.turn([{"role": "user", "content": "Weather in Oslo and Rome?"}], [WEATHER], "required",
                        parallel_tool_calls=True, config=config)
    assert ended.stop_reason == "stop" and not ended.truncated and ended.calls == two
    assert fmt.parse(ended.text)[0] == two
    cut = engine.turn([{"role": "user", "content": "Weather in Oslo, Rome and Paris?"}], [WEATHER], "required",
                      parallel_tool_calls=True, config=config)
    assert cut.truncated and cut.calls == two


def test_finished_values_of_a_call_being_written():
    from agent.parallel_calls import finished_values

    assert list(finished_values('<tool_call>\n{"name": "f", "arguments": {"xs": ["apple", "ban')) == ["apple"]
    assert list(finished_values('{"name": "f", "arguments": {"a": 5, "b": "q\\"x", "c": [1, 2.5], "d": 3')) == [
        5, 'q"x', 1, 2.5]  # 3 may still grow
    assert list(finished_values('{"name": "f", "argu')) == []


def test_grounding_reads_numbers_and_strings_of_the_conversation():
    from agent.grounding import Grounding, conversation_text
    from agent.parallel_calls import brings_new_values

    text = conversation_text([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": [{"type": "text", "text": "Population of New  York in "
                                                                                   "2,000 and 5.6 feet"}]},
                              {"role": "assistant", "content": "Tokyo"}, {"role": "tool", "content": "Lima: 7"}])
    g = Grounding(text)
    assert 2000 in g and 5.6 in g and 7 in g and "new york" in g and "LIMA" in g and True in g and None in g
    assert 2 not in g and 6 not in g and "Tokyo" not in g and "be brief!" not in g  # assistant text is not a source
    first = {"name": "f", "arguments": {"city": "New York", "year": 2000, "exact": True}}
    assert brings_new_values({"name": "f", "arguments": {"city": "Lima", "year": 2000, "exact": True}}, [first], g)
    assert not brings_new_values({"name": "f", "arguments": {"city": "Lima", "year": 2001}}, [first], g)  # 2001
    assert not brings_new_values({"name": "f", "arguments": {"city": "New York", "year": 2000, "exact": False}},
                                 [first], g)  # only a boolean changed: a recombination, nothing new
    assert not brings_new_values({"name": "g", "arguments": {"city": "New York"}}, [first], g)  # another tool, old
    assert not brings_new_values({"name": "f", "arguments": {"city": "New York", "year": 2000.0}}, [first], g)
    nums = Grounding("1,2,3 and 5,000; .5, 1e-05, \u22124, e4 to e5, 12,345,6 and STRASSE")
    assert all(x in nums for x in (1, 2, 3, 5000, 0.5, 1e-05, -4, 12, 345, 6, "straße"))
    assert 123 not in nums and 4 not in nums and 12345 not in nums
    assert 10 ** 400 not in nums  # beyond a float: not an error


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_several_calls_asked_for_end_at_the_first_call_past_the_second_with_nothing_new(smol_dir, drafter):
    """hermes, ``parallel_tool_calls=True``: the model's end is masked, so the turn ends from the calls: a call past
    the second whose new values are not in the conversation (here Paris) ends it and is dropped."""
    paris = {"city": "Paris", "unit": "celsius"}
    fmt, gen = scripted(smol_dir, "hermes", call_text("hermes", [("get_weather", OSLO), ("get_weather", ROME),
                                                                 ("get_weather", paris)]), "<|endoftext|>")
    engine, config = LocalEngine(gen), EngineConfig(drafter=drafter, max_new_tokens=200)

    def turn(question, parallel=True):
        return engine.turn([{"role": "user", "content": question}], [WEATHER], "required",
                           parallel_tool_calls=parallel, config=config)

    two = turn("Weather in Oslo and Rome?")
    assert two.stop_reason == "stop" and [c["arguments"]["city"] for c in two.calls] == ["Oslo", "Rome"]
    assert fmt.parse(two.text)[0] == two.calls
    three = turn("Weather in Oslo, Rome and Paris?")  # Paris is asked for: kept; the end stays masked after it
    assert [c["arguments"]["city"] for c in three.calls[:3]] == ["Oslo", "Rome", "Paris"]
    assert three.stop_reason != "eos"
    free = turn("Weather in Oslo and Rome?", parallel=None)  # the model ends the turn: the rule does not apply
    assert free.stop_reason == "eos" and [c["arguments"]["city"] for c in free.calls] == ["Oslo", "Rome", "Paris"]


MEDIAN, MODE = (Tool.from_openai({"type": "function", "function": {
    "name": f"statistics.{n}", "description": f"The {n} of numbers.",
    "parameters": {"type": "object", "properties": {"data": {"type": "array", "items": {"type": "integer"}}},
                   "required": ["data"], "additionalProperties": False}}}) for n in ("median", "mode"))


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_the_first_call_of_a_tool_the_user_names_goes_on_with_values_already_used(smol_dir, drafter):
    """dev ``parallel_multiple_20``: "the median and variance of 3,4,5,2,8,5, and the mode": the third call
    (``statistics.mode``, the same data) brings no new value, which ends the turn for any other tool; the user
    names this one, so it is kept. A second call of it, or a tool the request does not name, still ends it."""
    data = {"data": [3, 4, 5, 2, 8, 5]}
    script = [("statistics.median", data), ("statistics.median", {"data": [3, 4, 5]}), ("statistics.mode", data),
              ("statistics.mode", {"data": [3, 4]})]
    fmt, gen = scripted(smol_dir, "hermes", call_text("hermes", script), "<|endoftext|>")
    engine, config = LocalEngine(gen), EngineConfig(drafter=drafter, max_new_tokens=300)

    def names(question: str, **changes) -> list[str]:
        turn = engine.turn([{"role": "user", "content": question}], [MEDIAN, MODE], "required",
                           parallel_tool_calls=True, config=dataclasses.replace(config, **changes))
        assert turn.stop_reason == "stop" and fmt.parse(turn.text)[0] == turn.calls
        return [c["name"] for c in turn.calls]

    assert names("The median of 3,4,5,2,8,5 and its mode.") == ["statistics.median", "statistics.median",
                                                                "statistics.mode"]
    assert names("The median of 3,4,5,2,8,5, and then the most common one.") == ["statistics.median"] * 2
    assert names("The median of 3,4,5,2,8,5. No need for the mode.") == ["statistics.median"] * 2  # declined
    assert names("The median of 3,4,5,2,8,5 and its mode.", grounding=False) == ["statistics.median"] * 2


def test_tools_a_request_names():
    from agent.grounding import Grounding, named_tools

    tools = [Tool.from_schema(n, {"type": "object", "properties": {}}) for n in (
        "museum.get_waiting_time", "museum.get_hours", "painting.display", "statistics.mode", "us_history.gdp",
        "concert_ticket.buy", "train_ticket.buy", "calculate", "scienceFacts.getDiameter")]
    request = Grounding("Buy a train ticket, get the waiting times and GDP, display the painting; the diameters? "
                        "And the hour.")
    assert named_tools(tools, request) == ["museum.get_waiting_time", "museum.get_hours", "painting.display",
                                           "us_history.gdp", "train_ticket.buy",
                                           "scienceFacts.getDiameter"]  # "hour" names get_hours
    assert named_tools(tools, Grounding("Calculate it.")) == ["calculate"]  # only a verb: the whole name's words
    assert named_tools(tools, Grounding("a mode of transport")) == ["statistics.mode"]  # words, not meaning
    assert named_tools(tools, Grounding("nothing here")) == []
    # a tool named in a clause that declines it is not named (a helper: "I don't need a hotel" booked one)
    hotel = [Tool.from_schema(n, {"type": "object", "properties": {}}) for n in ("book_hotel", "rent_car")]
    assert named_tools(hotel, Grounding("Rent a car in Boston. I don\u2019t need a hotel.")) == ["rent_car"]
    assert named_tools(hotel, Grounding("No hotel, but rent a car")) == ["rent_car"]
    assert named_tools(tools, Grounding("The mode I already know; skip the GDP")) == []
    assert named_tools(hotel, Grounding("A hotel without a pool, and rent a car")) == ["book_hotel", "rent_car"]


PLAY = Tool.from_openai({"type": "function", "function": {
    "name": "play", "description": "Play rounds of the game of life from a board.",
    "parameters": {"type": "object", "properties": {
        "rounds": {"type": "integer"}, "board": {"type": "array", "items": {"type": "integer"}}},
        "required": ["rounds", "board"], "additionalProperties": False}}})


def play_text(name: str, arguments: str) -> str:
    """A call of ``play`` cut inside ``arguments`` (the arguments object's text so far) in the family's layout."""
    key = "parameters" if name == "llama3_json" else "arguments"
    obj = '{"name": "play", "%s": %s' % (key, arguments)
    return {"hermes": "<tool_call>\n" + obj, "generic": "<tool_call>[" + obj}.get(name, obj)


@pytest.mark.parametrize("drafter", ["none", "lookup"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_the_models_end_inside_a_call_closes_the_call_there(smol_dir, name, drafter):
    """A runaway list (BFCL parallel_multiple_52: ``start_board: [0, 0, …]`` to the budget): where the model's argmax
    is its end token inside the call, the decode stops and the call is closed there, valid; before, the grammar
    masked the end and the turn ran to the budget and returned nothing."""
    fmt, gen = scripted(smol_dir, name, play_text(name, '{"rounds": 3, "board": [0, 0, 0'), "<|endoftext|>")
    engine = LocalEngine(gen)
    messages = [{"role": "user", "content": "Play 3 rounds on an empty board."}]
    turn = engine.turn(messages, [PLAY], "required", config=EngineConfig(drafter=drafter, max_new_tokens=120))
    assert turn.stop_reason == "eos" and not turn.truncated, turn.text
    assert turn.calls == [{"name": "play", "arguments": {"rounds": 3, "board": [0, 0, 0]}}]
    assert turn.stats.closed_at_end == 1 and fmt.parse(turn.text)[0] == turn.calls  # a complete turn's text
    res = Agent(engine, [PLAY]).run(messages, tool_choice="required", max_new_tokens=120, max_steps=1)
    assert not res.truncated and [c.arguments for c in res.pending_calls] == [{"rounds": 3, "board": [0, 0, 0]}]

    kept = engine.turn(messages, [PLAY], "required",
                       config=EngineConfig(drafter=drafter, max_new_tokens=120, close_at_model_end=False))
    assert kept.stop_reason == "length" and kept.calls is None and kept.stats.closed_at_end == 0


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_the_models_end_where_no_closing_validates_leaves_the_model_writing(smol_dir, drafter):
    """Closed where the model first asks to end, the call would lack a required argument: its end stays masked and
    the model goes on (past its script, its ties go to the lowest allowed token) until the call closes into a
    valid one; the whole call before it is kept."""
    text = call_text("hermes", [("get_weather", OSLO)]) + "\n" + play_text("hermes", '{"rounds": 3')
    fmt, gen = scripted(smol_dir, "hermes", text, "<|endoftext|>")
    turn = LocalEngine(gen).turn([{"role": "user", "content": "Oslo, then play."}], [WEATHER, PLAY], "required",
                                 config=EngineConfig(drafter=drafter, max_new_tokens=120))
    assert turn.stop_reason == "eos" and turn.stats.closed_at_end == 1, turn.text
    assert turn.text.startswith(text + ", ") and fmt.parse(turn.text)[0] == turn.calls
    assert turn.calls[0] == {"name": "get_weather", "arguments": OSLO}
    assert turn.calls[1]["name"] == "play" and turn.calls[1]["arguments"]["rounds"] == 3
    PLAY.validate(turn.calls[1]["arguments"])


def test_the_models_end_stops_every_decode_path_at_the_same_position(smol_dir):
    """``end_when`` is asked where the model's unmasked argmax is an end token the grammar forbids; one token per
    forward and a speculative window drafted past that position stop before it alike (``"masked_end"``), and
    without ``end_when`` both go on alike."""
    from constraints import allowed_tokens
    from decoding.decoder import decode
    from decoding.drafters import Drafter
    from decoding.speculative import speculative_decode

    head = play_text("hermes", '{"rounds": 3, "board": [0, 0')
    fmt, gen = scripted(smol_dir, "hermes", head, "<|endoftext|>")
    script, eos = gen.loaded.script, frozenset(gen.eog_token_ids)
    prompt = gen.tokenizer.encode("Play.", add_special_tokens=False)
    grammar = fmt.turn_grammar([PLAY], "required")

    class Oracle(Drafter):
        """Drafts what the scripted target's masked argmax will be: past the end it keeps drafting."""
        name = "oracle"

        def propose(self, tokens, state, bitmask_row, sampling, generator):
            pos = len(tokens) - len(prompt)
            if pos < len(script) and script[pos] not in eos:
                return script[pos], None
            return int(allowed_tokens(bitmask_row, gen.loaded.vocab_size)[0]), None

    asked = []

    def end_when(tokens):
        asked.append(len(tokens))
        return True

    ref = decode(ScriptedLM(gen.loaded), prompt, gen.new_state(grammar), max_new_tokens=60, end_when=end_when)
    spec = speculative_decode(ScriptedLM(gen.loaded), prompt, gen.new_state(grammar), Oracle(), num_draft_tokens=8,
                              max_new_tokens=60, end_when=end_when)
    assert ref.stop_reason == spec.stop_reason == "masked_end" and ref.truncated
    assert ref.tokens == spec.tokens == script[:-1] and asked == [len(script) - 1] * 2
    assert spec.stats.target_forwards < ref.stats.target_forwards
    ref = decode(ScriptedLM(gen.loaded), prompt, gen.new_state(grammar), max_new_tokens=60)
    spec = speculative_decode(ScriptedLM(gen.loaded), prompt, gen.new_state(grammar), Oracle(), num_draft_tokens=8,
                              max_new_tokens=60)
    assert ref.tokens == spec.tokens and len(ref.tokens) > len(script)


def test_server_closes_a_call_where_the_model_ends_it_and_takes_the_request_field(smol_dir):
    fmt, gen = scripted(smol_dir, "hermes", play_text("hermes", '{"rounds": 3, "board": [0, 0'), "<|endoftext|>")
    kwargs = dict(model="scripted", messages=[{"role": "user", "content": "Play 3 rounds."}],
                  tools=[{"type": "function", "function": {"name": PLAY.name, "description": PLAY.description,
                                                           "parameters": PLAY.parameters}}],
                  tool_choice="required", max_tokens=60)
    with ServerThread(create_app(LocalEngine(gen), model_name="scripted")) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        closed = client.chat.completions.create(**kwargs).choices[0]
        kept = client.chat.completions.create(**kwargs, extra_body={"close_at_model_end": False}).choices[0]
        with pytest.raises(openai.BadRequestError, match="close_at_model_end"):
            client.chat.completions.create(**kwargs, extra_body={"close_at_model_end": "yes"})
    assert closed.finish_reason == "tool_calls"
    assert json.loads(closed.message.tool_calls[0].function.arguments) == {"rounds": 3, "board": [0, 0]}
    assert kept.finish_reason == "length" and not kept.message.tool_calls


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_a_call_closed_at_the_models_end_is_judged_by_the_several_call_rules(smol_dir, drafter):
    """The closed call repeats the call before it: the repeat rule drops it, as for a call the model finished."""
    text = call_text("hermes", [("get_weather", OSLO)]) + "\n" + \
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"'
    fmt, gen = scripted(smol_dir, "hermes", text, "<|endoftext|>")
    turn = LocalEngine(gen).turn([{"role": "user", "content": "Oslo?"}], [WEATHER], "required",
                                 config=EngineConfig(drafter=drafter, max_new_tokens=120))
    assert turn.stop_reason == "stop" and turn.calls == [{"name": "get_weather", "arguments": OSLO}], turn.text


def test_a_string_being_written_is_never_closed(smol_dir):
    """``"city": "Ro`` and the model's end: a closing would keep ``"Ro"``, a value the model never finished; the
    required city leaves no other closing, so the model goes on writing it."""
    fmt, gen = scripted(smol_dir, "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro',
                        "<|endoftext|>")
    turn = LocalEngine(gen).turn([{"role": "user", "content": "Rome?"}], [WEATHER], "required",
                                 config=EngineConfig(drafter="none", max_new_tokens=120))
    city = turn.calls[0]["arguments"]["city"]
    assert city.startswith("Ro") and city != "Ro" and turn.stop_reason == "eos", turn.text
    WEATHER.validate(turn.calls[0]["arguments"])


def test_closing_tries_a_bounded_number_of_points():
    """A runaway list before a required argument: no closing validates, and only the last ``CLOSINGS_TRIED``
    closing points are tried (each masked end of a long call would otherwise validate every element's prefix)."""
    from agent import engine as engine_module

    fmt = make_format(None, "hermes")
    text = '<tool_call>\n{"name": "play", "arguments": {"board": [' + ", ".join(["0"] * 5000)
    tried = []
    validate = PLAY.validate

    class Counting:
        name = PLAY.name

        def validate(self, arguments):
            tried.append(1)
            return validate(arguments)

    eng = engine_module.LocalEngine.__new__(engine_module.LocalEngine)
    eng.format = fmt
    assert eng._close(text, [Counting()]) is None
    assert len(tried) == engine_module.CLOSINGS_TRIED


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_the_models_end_after_a_whole_call_closes_an_open_layout(smol_dir, drafter):
    """generic: ``<tool_call>[{call}`` and the model's end: the grammar wants ``]</tool_call>`` (or another call);
    the turn ends with the call, the layout closed. hermes after ``</tool_call>`` needs no closing, so its masked
    end between calls of a several-call turn is never asked to end it."""
    fmt, gen = scripted(smol_dir, "generic", call_text("generic", [("get_weather", OSLO)])[:-len("]</tool_call>")],
                        "<|endoftext|>")
    turn = LocalEngine(gen).turn([{"role": "user", "content": "Oslo?"}], [WEATHER], "required",
                                 config=EngineConfig(drafter=drafter, max_new_tokens=120))
    assert turn.stop_reason == "eos" and turn.calls == [{"name": "get_weather", "arguments": OSLO}], turn.text
    assert turn.text == call_text("generic", [("get_weather", OSLO)]) and turn.stats.closed_at_end == 1
    hermes = make_format(None, "hermes")
    assert list(hermes.closed_turns(call_text("hermes", [("get_weather", OSLO)]) + "\n")) == []


@pytest.mark.parametrize("drafter", ["none", "lookup"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_a_runaway_list_closes_at_the_item_cap_and_the_turn_is_not_cut(smol_dir, name, drafter):
    """A model that never ends a list (BFCL parallel_multiple_52: ``start_board: [0, 0, …]``, its argmax never an
    end token there) runs to the budget and the turn returns no call; with ``max_items`` the grammar allows only the
    list's close after that many items, and the call closes whole and valid."""
    fmt, gen = scripted(smol_dir, name, play_text(name, '{"rounds": 3, "board": [' + "0, " * 80), None)
    engine = LocalEngine(gen)
    messages = [{"role": "user", "content": "Play 3 rounds on an empty board."}]
    cut = engine.turn(messages, [PLAY], "required", config=EngineConfig(drafter=drafter, max_new_tokens=120))
    assert cut.stop_reason == "length" and cut.calls is None
    turn = engine.turn(messages, [PLAY], "required",
                       config=EngineConfig(drafter=drafter, max_new_tokens=120, max_items=4))
    assert not turn.truncated, turn.text
    assert turn.calls[0] == {"name": "play", "arguments": {"rounds": 3, "board": [0, 0, 0, 0]}}
    for c in turn.calls:
        PLAY.validate(c["arguments"])
    res = Agent(engine, [PLAY], max_items=4).run(messages, tool_choice="required", max_new_tokens=120, max_steps=1)
    assert not res.truncated and res.pending_calls[0].arguments == {"rounds": 3, "board": [0, 0, 0, 0]}


FACTORIAL = Tool.from_openai({"type": "function", "function": {
    "name": "factorial", "description": "The factorial of a number.",
    "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}})


@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_a_call_that_runs_a_written_list_together_is_decoded_again_without_it(smol_dir, drafter):
    """The model writes ``510`` for "5,10 and 15" (Qwen2.5-Coder-0.5B did, dev split): under grounding the turn is
    decoded again with integers starting ``51`` (and ``101``) taken out of the grammar; without grounding, as
    written. A computed value that only starts like a run (120 for the product of 1, 2, 3, 4 and 5) and a
    number the text writes in words (twelve) are kept: no second decode."""
    text = call_text("hermes", [("factorial", {"number": 510}), ("factorial", {"number": 15})])
    asked = [{"role": "user", "content": "Find the factorial of 5,10 and 15."}]
    for grounding in (True, False):
        fmt, gen = scripted(smol_dir, "hermes", text, "<|endoftext|>")
        seen: list[str] = []
        turn = LocalEngine(gen).turn(asked, [FACTORIAL], "required", config=EngineConfig(
            drafter=drafter, max_new_tokens=80, grounding=grounding), on_text=seen.append)
        numbers = [str(c["arguments"]["number"]) for c in turn.calls]
        if grounding:
            # the script's "1" is masked after "5": a scripted model takes the lowest allowed token there ("0")
            assert numbers and numbers[0].startswith("5") and not any(n.startswith(("51", "101")) for n in numbers)
            assert '"number": 510' in "".join(seen) and '"number": 510' not in turn.text  # the first decode's
        else:
            assert numbers == ["510", "15"], turn.text
    for question, value in (("Record the factorial of the product of 1, 2, 3, 4 and 5.", 120),
                            ("Rooms 1 and 2 need chairs: the factorial of twelve.", 12)):
        fmt, gen = scripted(smol_dir, "hermes", call_text("hermes", [("factorial", {"number": value})]),
                            "<|endoftext|>")
        turn = LocalEngine(gen).turn([{"role": "user", "content": question}], [FACTORIAL], "required",
                                     config=EngineConfig(drafter=drafter, max_new_tokens=80))
        assert turn.calls == [{"name": "factorial", "arguments": {"number": value}}], turn.text
