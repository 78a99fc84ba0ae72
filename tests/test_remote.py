"""agent/remote.py: the agent loop over an OpenAI-compatible server (this project's own, over 127.0.0.1)."""
from __future__ import annotations

import pydantic
import pytest

from agent import Agent
from agent.engine import EngineConfig, LocalEngine
from agent.remote import OpenAIEngine, _check_tool_choice
from agent.server import ServerThread, create_app
from decoding import Generator
from schemas import ToolCallError


def lookup(code: str) -> dict:
    """Look up a code.

    Args:
        code: The code.
    """
    return {"code": code, "ok": True}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Reading(pydantic.BaseModel):
    ok: bool
    n: int = pydantic.Field(ge=0, le=99)


CONFIG = EngineConfig(max_string_length=8, max_decimals=2, max_new_tokens=64)
PROMPTS = ["look up abc", "add 2 and 3", "what is the code for Oslo?"]


@pytest.fixture(scope="module")
def local(tiny_target):
    return LocalEngine(Generator(tiny_target))


@pytest.fixture(scope="module")
def url(local):
    with ServerThread(create_app(local, model_name="tiny")) as url:
        yield url


def summary(res):
    return ([(r.call.name, r.call.arguments, r.result, r.error) for r in res.tool_calls], res.final_answer,
            res.truncated, res.steps, [m["role"] for m in res.messages])


@pytest.mark.parametrize("choice", ["required", {"name": "add"}])
def test_agent_on_the_served_model_returns_the_same_calls_as_the_local_agent(local, url, choice):
    remote = OpenAIEngine(url, "tiny", send_engine_config=True)
    for prompt in PROMPTS:
        kwargs = dict(tool_choice=choice, max_steps=2, parallel_tool_calls=False)
        want = Agent(local, [lookup, add], config=CONFIG).run(prompt, **kwargs)
        got = Agent(remote, [lookup, add], config=CONFIG).run(prompt, **kwargs)
        assert summary(got) == summary(want) and want.tool_calls
        assert got.stats.new_tokens == want.stats.new_tokens  # usage carries the decode figures
        assert got.stats.target_forwards == want.stats.target_forwards


def test_structured_output_over_the_server_is_validated_like_a_local_one(local, url):
    remote = Agent(OpenAIEngine(url, "tiny", send_engine_config=True), [add], config=CONFIG)
    res = remote.run("fill it in", tool_choice="none", response_format=Reading)
    want = Agent(local, [add], config=CONFIG).run("fill it in", tool_choice="none", response_format=Reading)
    assert isinstance(res.output, Reading) and res.output == want.output


def test_streaming_over_the_server_yields_the_same_run(local, url):
    remote = Agent(OpenAIEngine(url, "tiny", send_engine_config=True), [lookup, add], config=CONFIG)
    events = list(remote.stream("add 2 and 3", tool_choice="required", max_steps=2, parallel_tool_calls=False))
    want = Agent(local, [lookup, add], config=CONFIG).run("add 2 and 3", tool_choice="required", max_steps=2,
                                                                parallel_tool_calls=False)
    assert events[-1].type == "done" and summary(events[-1].result) == summary(want)
    assert "tool_call_started" in [e.type for e in events]


@pytest.mark.parametrize("choice, calls, match", [
    ("none", [{"name": "add"}], "tool_choice was 'none'"),
    ("required", None, "without a call"),
    ({"name": "add"}, [{"name": "lookup"}], "named 'add'")])
def test_a_server_that_ignores_tool_choice_is_caught(choice, calls, match):
    with pytest.raises(ToolCallError, match=match):
        _check_tool_choice(choice, calls)


def test_a_lenient_tool_and_response_format_go_over_the_wire_as_strict_false():
    """The remote engine sends ``"strict": false`` for a lenient tool and a lenient ``ResponseFormat`` (it sent
    ``true`` and the tools without it: this project's own server refused both)."""
    from schemas import ResponseFormat, Tool

    params = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                      "uniqueItems": True}}}
    engine = OpenAIEngine("http://127.0.0.1:9/v1", "m")
    body, _ = engine.request([{"role": "user", "content": "x"}], [Tool.from_schema("f", params, strict=False)],
                             "auto", ResponseFormat(params, strict=False))
    assert body["tools"][0]["function"]["strict"] is False
    assert body["response_format"]["json_schema"]["strict"] is False
    assert body["response_format"]["json_schema"]["schema"] == params
    body, _ = engine.request([{"role": "user", "content": "x"}], [], "auto", {"type": "object"})
    assert body["response_format"]["json_schema"] == {"name": "response", "schema": {"type": "object"},
                                                      "strict": True}
