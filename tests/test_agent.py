"""agent/: the loop, tool_choice, tool errors, truncation, bad user messages (tiny random model; fast)."""
from __future__ import annotations

import json

import pytest

from agent import Agent
from agent.format import parse_turn, render_call_text, turn_grammar
from decoding import Generator
from schemas import SchemaError, Tool, ToolCallError, ToolError

CALLS: list[dict] = []


def lookup(code: str) -> dict:
    """Look up a code.

    Args:
        code: The code.
    """
    CALLS.append({"code": code})
    return {"code": code, "ok": True}


def broken(n: int) -> int:
    """Always fails."""
    raise RuntimeError("database is down")


@pytest.fixture(scope="module")
def gen(tiny_target):
    return Generator(tiny_target, drafter="lookup")


def test_required_call_runs_the_tool_and_feeds_the_result_back(gen):
    CALLS.clear()
    agent = Agent(gen, [lookup], max_steps=2, max_string_length=8)
    res = agent.run("look up abc", tool_choice="required", max_new_tokens=60)
    assert len(res.tool_calls) >= 1 and CALLS
    first = res.tool_calls[0]
    assert first.call.name == "lookup" and isinstance(first.call.arguments["code"], str)
    roles = [m["role"] for m in res.messages]
    assert roles[:3] == ["user", "assistant", "tool"]
    assert res.messages[1]["tool_calls"][0]["id"] == res.messages[2]["tool_call_id"]
    assert json.loads(res.messages[2]["content"]) == first.result
    assert res.stats.new_tokens > 0 and res.steps == 2


def test_tool_that_raises_gets_its_error_fed_back_and_the_run_goes_on(gen):
    agent = Agent(gen, [broken], max_steps=2, max_decimals=2)  # bounded integer: the call always closes
    res = agent.run("go", tool_choice="required", max_new_tokens=96)
    rec = res.tool_calls[0]
    assert rec.error == "RuntimeError: database is down" and rec.result is None
    tool_msg = next(m for m in res.messages if m["role"] == "tool")
    assert json.loads(tool_msg["content"]) == {"error": "RuntimeError: database is down"}
    assert res.steps == 2  # the loop continued after the failure


def test_named_tool_choice_forces_that_tool(gen):
    agent = Agent(gen, [lookup, broken], max_steps=1, max_string_length=8)
    res = agent.run("anything", tool_choice={"name": "broken"}, parallel_tool_calls=False, max_new_tokens=40)
    assert [r.call.name for r in res.tool_calls] == ["broken"]


def test_tool_choice_none_answers_in_text(gen):
    agent = Agent(gen, [lookup], max_steps=1)
    res = agent.run("hello", tool_choice="none", max_new_tokens=10)
    assert not res.tool_calls and (res.final_answer is not None or res.truncated)
    assert not res.raw_turns[0].startswith("<tool_call>")


def test_max_new_tokens_mid_call_is_truncated_and_never_returned_as_a_call(gen):
    agent = Agent(gen, [lookup], max_steps=1)
    res = agent.run("x", tool_choice="required", max_new_tokens=6)
    assert res.truncated and not res.tool_calls and res.final_answer is None
    assert res.raw_turns[0].startswith("<tool_call>")


def test_user_message_with_unknown_tool_call_is_rejected_clearly(gen):
    agent = Agent(gen, [lookup])
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "rm_rf", "arguments": "{}"}}]}]
    with pytest.raises(ToolCallError, match="message 1: unknown tool 'rm_rf'"):
        agent.run(msgs)


def test_user_message_with_invalid_arguments_is_rejected_with_pointer(gen):
    agent = Agent(gen, [lookup])
    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "lookup", "arguments": '{"code": 5}'}}]}]
    with pytest.raises(ToolCallError) as e:
        agent.run(msgs)
    assert e.value.tool == "lookup" and e.value.pointer == "/code"


def test_duplicate_tools_and_bad_schemas_fail_at_registration(gen):
    with pytest.raises(ToolError, match="duplicate"):
        Agent(gen, [lookup, lookup])
    agent = Agent(gen, [lookup])
    with pytest.raises(SchemaError, match="/properties/age/not"):
        agent.register({"name": "t", "parameters": {"type": "object", "properties": {"age": {"not": {"const": 0}}}}})
    assert agent.registry.names == ["lookup"]


def test_turn_grammar_and_parse_roundtrip():
    tool = Tool.from_function(lookup)
    text = render_call_text([{"name": "lookup", "arguments": {"code": "x"}}])
    calls, answer = parse_turn(text)
    assert calls == [{"name": "lookup", "arguments": {"code": "x"}}] and answer == ""
    assert parse_turn("plain answer") == (None, "plain answer")
    turn_grammar([tool], "auto")  # compiles
    with pytest.raises(ValueError, match="tool_choice"):
        from agent.format import filter_tools
        from schemas import ToolRegistry
        filter_tools(ToolRegistry([tool]), "sometimes")
