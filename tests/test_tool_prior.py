"""The tool a turn calls, chosen against the model's prior for it (agent/tool_prior.py, EngineConfig.tool_prior)."""
from __future__ import annotations

import pytest
import torch

from agent.engine import DecodedTurn, EngineConfig, LocalEngine
from agent.tool_prior import (CONTENT_FREE, PriorCache, calibrated_pick, content_free_messages, name_span,
                              opening_tokens, tokens_starting_with)
from decoding import DecodeStats, Generator

from test_formats import WEATHER
from test_turn_end import TIME, call_text, scripted, scripted_backend  # noqa: F401 (scripted_backend: a fixture)

ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it in Lima?"}]
LIMA_WEATHER = {"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius"}}
LIMA_TIME = {"name": "get_time", "arguments": {"city": "Lima"}}


def test_the_content_free_conversation_keeps_system_and_developer_messages_only():
    dev = {"role": "developer", "content": "Use metric units."}
    msgs = ASK + [dev, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Now Oslo."}]
    assert content_free_messages(msgs) == [ASK[0], dev, {"role": "user", "content": CONTENT_FREE}]


def test_the_first_call_name_and_the_character_after_it_are_found():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"city": "get_weather"}}\n</tool_call>'
    start, closing = name_span(text, "get_time")
    assert text[start:start + len("get_time")] == "get_time" and closing == '"'
    assert name_span(text, "get_weather") is None  # not the first call's name
    assert name_span('<function=get_time>{"city": "Lima"}</function>', "get_time") is None  # names written otherwise


def test_the_opening_ends_at_the_last_token_before_the_name(smol_tokenizer):
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}'
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    start, _ = name_span(text, "get_time")
    decode = lambda t: smol_tokenizer.decode(t, skip_special_tokens=False)  # noqa: E731
    kept, rest = opening_tokens(decode, ids, text, start)
    assert decode(kept) + rest == text[:start] and kept == ids[:len(kept)]  # nothing lost, none of the name
    assert opening_tokens(decode, [], text, start) is None


def test_the_tokens_after_a_name_are_those_starting_with_its_closing(smol_tokenizer):
    mask = tokens_starting_with(smol_tokenizer, '"')
    assert mask.shape == (len(smol_tokenizer),) and mask.dtype == torch.bool
    for text in ('"', '",'):
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            assert mask[ids[0]]
    assert not mask[smol_tokenizer.encode("a", add_special_tokens=False)[0]]
    assert 0 < int(mask.sum()) < len(smol_tokenizer) // 10


def test_the_pick_divides_by_the_prior_among_the_names_scored_and_breaks_ties_by_order():
    names, never = ["a", "b", "c"], float("-inf")
    assert calibrated_pick([-0.1, -2.5, -9.0], [-0.01, -4.0, -9.0], names) == "b"  # -0.09 < 1.5
    assert calibrated_pick([-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], names) == "a"
    assert calibrated_pick([-0.1, -2.5, never], [-0.01, -4.0, -30.0], names) == "b"  # c was not a candidate
    assert calibrated_pick([never, never], [0.0, 0.0], ["a", "b"]) is None


def test_the_prior_cache_computes_each_continuation_once_and_drops_the_least_recently_used_prompt():
    cache, asked = PriorCache(size=2), []

    def compute(missing):
        asked.append(missing)
        return [float(len(c)) for c in missing]
    assert cache.get((1,), [(5,), (6, 7)], compute) == [1.0, 2.0]
    assert cache.get((1,), [(6, 7), (8, 8, 8)], compute) == [2.0, 3.0]  # only (8, 8, 8) is new
    cache.get((2,), [(5,)], compute)
    cache.get((1,), [(5,)], compute)  # prompt (1,) used last: (2,) is dropped next
    cache.get((3,), [(5,)], compute)
    cache.get((1,), [(5,)], compute)
    cache.get((2,), [(5,)], compute)
    assert asked == [[(5,), (6, 7)], [(8, 8, 8)], [(5,)], [(5,)], [(5,)]]


def test_continuation_logprobs_equal_one_full_forward(tiny_target):
    gen = Generator(tiny_target)
    prompt, conts = [5, 9, 2, 7], [[3], [4, 8, 1], [3, 3]]
    got = gen.continuation_logprobs(prompt, conts)
    for cont, value in zip(conts, got):
        target = gen.new_target()
        target.reset()
        seq = prompt + cont
        logp = torch.log_softmax(target.forward(seq[:-1])[0].float(), dim=-1)
        want = sum(logp[len(prompt) - 1 + j, cont[j]].item() for j in range(len(cont)))
        assert value == pytest.approx(want, abs=1e-4)
    conts = [[3], [4, 8, 1], [3, 3], [6, 2]]
    got = gen.continuation_logprobs(prompt, conts)
    first = gen.continuation_logprobs(prompt, [[c[0]] for c in conts])
    floor = (min(first) + max(first)) / 2  # the continuations whose first token is below it are not scored
    cut = gen.continuation_logprobs(prompt, conts, floor=floor)
    assert float("-inf") in cut and any(v != float("-inf") for v in cut)
    for value, whole, head in zip(cut, got, first):
        assert value == (float("-inf") if head < floor else pytest.approx(whole, abs=1e-4))
    after = gen.continuation_logprobs(prompt[:2], conts, prefix=prompt[2:])  # the same text, part of it decoded
    assert after == pytest.approx(got, abs=1e-4)
    then = torch.zeros(gen.loaded.vocab_size, dtype=torch.bool)
    then[[1, 5]] = True  # followed by token 1 or 5: p(c) * (p(1) + p(5)) after c
    for cont, value in zip(conts, gen.continuation_logprobs(prompt, conts, then=then)):
        ends = gen.continuation_logprobs(prompt, [cont + [1], cont + [5]])
        assert value == pytest.approx(float(torch.logsumexp(torch.tensor(ends), dim=0)), abs=1e-4)
    with pytest.raises(ValueError):
        gen.continuation_logprobs(prompt, [[]])


def _decodes(monkeypatch, engine, turns):
    """``engine._decode`` returns ``turns`` in order; returns the ``exclude`` sets it was asked with."""
    asked = []

    def decode(*args, exclude=None, answer_only=False, integer_prefixes=frozenset(), answer_excludes=()):
        asked.append(set(exclude or ()))
        return turns[len(asked) - 1]
    monkeypatch.setattr(engine, "_decode", decode)
    return asked


def _turn(calls, stop="eos", tokens=5, text=None):
    return DecodedTurn(text if text is not None else str(calls), calls, calls is not None, stop,
                       DecodeStats(new_tokens=tokens))


@pytest.fixture
def engine(smol_dir):
    _, gen = scripted(smol_dir, "hermes", "", None)
    return LocalEngine(gen)


def test_a_tool_the_prior_picks_is_decoded_again_with_the_others_masked(engine, monkeypatch):
    monkeypatch.setattr(engine, "_prior_pick", lambda *a: "get_time")
    asked = _decodes(monkeypatch, engine, [_turn([LIMA_WEATHER]), _turn([LIMA_TIME], tokens=7)])
    out = engine.turn(ASK, [WEATHER, TIME], "required")
    assert out.calls == [LIMA_TIME] and asked == [set(), {"get_weather"}]
    assert out.stats.new_tokens == 12  # both decodes counted


@pytest.mark.parametrize("second,why", [
    (_turn([LIMA_TIME], stop="length"), "cut by the budget where the first was not"),
    (_turn(None, text="It is noon."), "an answer instead of a call"),
    (_turn([{"name": "get_time", "arguments": {"city": "Rome"}}]), "takes nothing from the conversation"),
])
def test_the_first_decode_stands_where_the_prior_s_decode_is_worse(engine, monkeypatch, second, why):
    monkeypatch.setattr(engine, "_prior_pick", lambda *a: "get_time")
    asked = _decodes(monkeypatch, engine, [_turn([LIMA_WEATHER]), second])
    out = engine.turn(ASK, [WEATHER, TIME], "auto")
    assert out.calls == [LIMA_WEATHER], why
    assert asked == [set(), {"get_weather"}] and out.stats.new_tokens == 10


@pytest.mark.parametrize("tools,choice,calls,config", [
    ([WEATHER, TIME], "required", [LIMA_WEATHER, LIMA_TIME], EngineConfig()),  # two tools called
    ([WEATHER], "required", [LIMA_WEATHER], EngineConfig()),  # one tool to choose from
    ([WEATHER, TIME], {"name": "get_weather"}, [LIMA_WEATHER], EngineConfig()),  # the caller chose
    ([WEATHER, TIME], "required", [LIMA_WEATHER], EngineConfig(tool_prior=False)),
])
def test_the_prior_is_not_asked_where_there_is_no_choice_to_make(engine, monkeypatch, tools, choice, calls, config):
    def never(*a):
        raise AssertionError("the prior was asked")
    monkeypatch.setattr(engine, "_prior_pick", never)
    _decodes(monkeypatch, engine, [_turn(calls)])
    assert engine.turn(ASK, tools, choice, config=config).calls == calls


def test_the_prior_scores_each_name_after_the_decoded_opening(smol_dir, monkeypatch):
    """A real decode (the scripted model calls ``get_weather``): the names are scored after the tokens the decode
    wrote before the name, once after the conversation and once after the content-free one (cached)."""
    text = call_text("hermes", [("get_weather", {"city": "Lima", "unit": "celsius"})])
    _, gen = scripted(smol_dir, "hermes", text, "<|im_end|>")
    engine = LocalEngine(gen)
    seen = []

    def logprobs(prompt, conts, prefix=(), floor=None, then=None):
        assert then is not None and then[gen.tokenizer.convert_tokens_to_ids('"')]  # a name is followed by "…
        seen.append((prompt + list(prefix), conts))
        # after the conversation get_weather is likelier; after "N/A" far likelier still: get_time wins
        return [-0.5, -1.5] if len(seen) % 2 else [-0.01, -5.0]
    monkeypatch.setattr(gen, "continuation_logprobs", logprobs)
    real_decode, excluded = engine._decode, []

    def spy(*args, exclude=None, **kwargs):
        excluded.append(exclude)
        return real_decode(*args, exclude=exclude, **kwargs)
    monkeypatch.setattr(engine, "_decode", spy)
    engine.turn(ASK, [WEATHER, TIME], "required", config=EngineConfig(max_new_tokens=60))
    decode = lambda ids: gen.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    (real, conts), (free, conts_free) = seen[:2]
    assert conts == conts_free and [decode(c) for c in conts] == ["get_weather", "get_time"]
    assert decode(real).endswith('What time is it in Lima?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "')
    assert decode(free).endswith(f'{CONTENT_FREE}<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{{"name": "')
    assert "Be brief." in decode(free) and "Lima" not in decode(free)
    assert excluded[:2] == [None, {"get_weather"}]  # decoded again with the prior's pick the only tool left
    engine.turn(ASK, [WEATHER, TIME], "required", config=EngineConfig(max_new_tokens=60))
    assert len(seen) == 3 and seen[2][0] == real  # the content-free scores came from the cache


def test_the_request_field_and_the_remote_engine_carry_tool_prior():
    from agent.openai_protocol import RequestError, parse_chat_request
    from agent.remote import OpenAIEngine

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_prior": False}
    assert parse_chat_request(body, EngineConfig(), ("m",)).config.tool_prior is False
    assert parse_chat_request(dict(body, tool_prior=None), EngineConfig(), ("m",)).config.tool_prior is True
    with pytest.raises(RequestError, match="tool_prior must be a boolean") as e:
        parse_chat_request(dict(body, tool_prior="yes"), EngineConfig(), ("m",))
    assert e.value.status == 400
    remote = OpenAIEngine("http://127.0.0.1:9/v1", "m", send_engine_config=True)
    _, extra = remote.request(ASK, [WEATHER, TIME], config=EngineConfig(tool_prior=False))
    assert extra["tool_prior"] is False


def test_the_agent_takes_tool_prior_as_it_takes_grounding(engine, monkeypatch):
    from agent import Agent

    seen = []

    def turn(messages, tools, tool_choice="auto", response_format=None, parallel_tool_calls=None,
             config=EngineConfig(), on_text=None):
        seen.append(config.tool_prior)
        return _turn(None, text="Noon.")
    monkeypatch.setattr(engine, "turn", turn)
    agent = Agent(engine, [WEATHER, TIME], tool_prior=False)
    assert agent.config.tool_prior is False
    agent.run("Time in Lima?")
    agent.run("Time in Lima?", tool_prior=True)
    assert seen == [False, True]
