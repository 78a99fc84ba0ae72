"""agent/: the loop, tool_choice, tool errors, truncation, bad user messages (tiny random model; fast)."""
from __future__ import annotations

import json

import pytest

from agent import Agent
from agent.formats.generic import parse_turn, render_call_text, turn_grammar
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


def _grammar_takes(tokenizer, grammar, text: str) -> bool:
    """The grammar's matcher consumes every token of ``text`` and then accepts (the turn may end there)."""
    from constraints import ConstraintState, llg_tokenizer

    ids = tokenizer.encode(text, add_special_tokens=False)
    state = ConstraintState(llg_tokenizer(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_id), grammar)
    if state.valid_prefix_len(ids) != len(ids):
        return False
    state.consume_many(ids)
    return state.is_accepting()


def test_turn_grammar_and_parse_roundtrip(smol_tokenizer):
    tool = Tool.from_function(lookup)
    one = [{"name": "lookup", "arguments": {"code": "x"}}]
    two = one + [{"name": "lookup", "arguments": {"code": "Zürich 2"}}]
    for calls_in in (one, two):
        text = render_call_text(calls_in)
        for choice in ("auto", "required"):  # the grammar the decoder runs takes the text the parser reads
            assert _grammar_takes(smol_tokenizer, turn_grammar([tool], choice), text), (choice, text)
        calls, answer = parse_turn(text)
        assert calls == calls_in and answer == ""
    assert not _grammar_takes(smol_tokenizer, turn_grammar([tool], "auto", parallel=False),
                              render_call_text(two))  # one call per turn without parallel
    assert not _grammar_takes(smol_tokenizer, turn_grammar([tool], "required"),
                              render_call_text([{"name": "lookup", "arguments": {"code": "x", "y": 1}}]))
    assert _grammar_takes(smol_tokenizer, turn_grammar([tool], "auto"), "plain answer")
    assert not _grammar_takes(smol_tokenizer, turn_grammar([tool], "required"), "plain answer")
    assert parse_turn("plain answer") == (None, "plain answer")
    with pytest.raises(ValueError, match="tool_choice"):
        from agent.tool_choice import filter_tools
        from schemas import ToolRegistry
        filter_tools(ToolRegistry([tool]), "sometimes")
