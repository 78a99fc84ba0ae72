"""agent/engine.py: one owner for the engine settings, honoured overrides, no silently ignored arguments."""
from __future__ import annotations

import dataclasses

import pytest

from agent import Agent
from agent.engine import DecodedTurn, Engine, EngineConfig, LocalEngine
from decoding import DEFAULT_DRAFTER, DEFAULT_NUM_DRAFT_TOKENS, Generator


def lookup(code: str) -> dict:
    """Look up a code."""
    return {"code": code}


class SpyGenerator(Generator):
    """Records the keyword arguments of every ``generate`` call."""

    def __init__(self, loaded):
        super().__init__(loaded)
        self.calls: list[dict] = []

    def generate(self, prompt, grammar, **kwargs):
        self.calls.append(kwargs)
        return super().generate(prompt, grammar, **kwargs)


@pytest.fixture()
def spy(tiny_target):
    return SpyGenerator(tiny_target)


def test_config_has_one_default_and_is_frozen():
    c = EngineConfig()
    assert (c.drafter, c.num_draft_tokens) == (DEFAULT_DRAFTER, DEFAULT_NUM_DRAFT_TOKENS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.drafter = "none"


@pytest.mark.parametrize("field, value", [("drafter", "magic"), ("num_draft_tokens", -1), ("max_new_tokens", 0),
                                          ("temperature", -0.1), ("top_p", 0.0), ("max_string_length", 0),
                                          ("max_decimals", -2), ("seed", 1.5), ("num_draft_tokens", True),
                                          ("window", "adaptive"), ("max_items", 0), ("max_items", 2.5)])
def test_out_of_range_config_fields_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_run_with_zero_draft_tokens_is_honoured_not_replaced_by_the_default(spy):
    Agent(spy, [lookup], max_string_length=8).run("x", tool_choice="required", max_new_tokens=30, max_steps=1,
                                                   num_draft_tokens=0)
    assert spy.calls[-1]["num_draft_tokens"] == 0


def test_agent_settings_reach_the_decoder_with_a_ready_generator(spy):
    agent = Agent(spy, [lookup], drafter="schema", num_draft_tokens=7, adaptive=True, window="fixed",
                  max_string_length=8)
    agent.run("x", tool_choice="required", max_new_tokens=30, max_steps=1, temperature=0.5, seed=3)
    kw = spy.calls[-1]
    assert (kw["drafter"], kw["num_draft_tokens"], kw["adaptive"], kw["window"]) == ("schema", 7, True, "fixed")
    assert (kw["sampling"].temperature, kw["sampling"].seed, kw["max_new_tokens"]) == (0.5, 3, 30)
    assert agent.config.temperature == 0.0  # a run's override does not change the agent's config


@pytest.mark.parametrize("kwargs", [dict(device="cuda"), dict(dtype="bfloat16"), dict(draft_model="smollm2")])
def test_load_time_arguments_with_a_ready_generator_raise_instead_of_being_ignored(spy, kwargs):
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))} would be ignored"):
        Agent(spy, [lookup], **kwargs)
    with pytest.raises(ValueError, match="would be ignored"):
        Agent(LocalEngine(spy), [lookup], **kwargs)


def test_local_engine_is_an_engine_and_returns_a_parsed_turn(spy):
    engine = LocalEngine(spy)
    assert isinstance(engine, Engine)
    agent = Agent(engine, [lookup])
    turn = engine.turn([{"role": "user", "content": "x"}], list(agent.registry), "required",
                       config=EngineConfig(max_string_length=8, max_new_tokens=40))
    assert isinstance(turn, DecodedTurn) and turn.is_call and turn.stop_reason != "length"
    assert [c["name"] for c in turn.calls] == ["lookup"] and turn.text.startswith(engine.call_prefixes)
    assert turn.stats.new_tokens == len(spy.tokenizer.encode(turn.text, add_special_tokens=False))
