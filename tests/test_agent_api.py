"""The Python API refuses a user's mistakes before decoding, naming what is wrong (found by a helper trying the
README as a new user): each of these ran before, or crashed with a TypeError."""
from __future__ import annotations

import re

import pytest

from agent import Agent
from agent.formats import ToolFormatError, load_chat_template
from decoding import Generator
from schemas import ResponseFormat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def agent(tiny_target):
    return Agent(Generator(tiny_target), [WEATHER], max_steps=1)


@pytest.fixture
def turns(agent, monkeypatch):
    """The configs ``engine.turn`` was called with (the decode itself is not run)."""
    seen = []

    def turn(messages, tools, tool_choice, response_format, parallel_tool_calls, config, on_text=None):
        seen.append(config)
        raise RuntimeError("stop here")
    monkeypatch.setattr(agent.engine, "turn", turn)
    return seen


def test_run_takes_grounding_as_the_readme_says(agent, turns):
    with pytest.raises(RuntimeError, match="stop here"):
        agent.run("Weather in Oslo?", tool_choice="required", grounding=False)
    assert turns[-1].grounding is False and agent.config.grounding is True


@pytest.mark.parametrize("messages, message", [
    ([{"role": "robot", "content": "hi"}], "message 0: role 'robot' is not one of"),
    ([{"role": "user"}], "message 0 (user) has no 'content'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text content parts"),
    ([{"role": "user", "content": 5}], "'content' must be a string"),
])
def test_malformed_messages_are_refused_naming_the_message(agent, turns, messages, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        agent.run(messages)
    assert not turns


def test_text_parts_are_read_as_their_text(agent, turns, monkeypatch):
    seen = []
    monkeypatch.setattr(agent.engine, "turn", lambda messages, *a, **k: seen.append(messages) or (_ for _ in ()).throw(
        RuntimeError("stop here")))
    with pytest.raises(RuntimeError):
        agent.run([{"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "?"}]},
                   CALLED, {"role": "tool", "tool_call_id": "x", "content": {"temp": 21}}])
    assert seen[0][0]["content"] == "Weather ?" and seen[0][2]["content"] == {"temp": 21}


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "zz", "content": "3"}],
     "message 1 (tool) answers no call"),
    ([{"role": "user", "content": "hi"}, CALLED, {"role": "tool", "tool_call_id": "zz", "content": "3"}],
     "message 2 (tool): tool_call_id 'zz' names no call of message 1"),
])
def test_a_tool_message_must_answer_a_call_as_the_server_requires(agent, turns, messages, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        agent.run(messages)
    assert not turns
    with pytest.raises(RuntimeError, match="stop here"):  # answering the call (an id is optional here) decodes
        agent.run([{"role": "user", "content": "hi"}, CALLED, {"role": "tool", "content": "3"}])


@pytest.mark.parametrize("calls", ["get_weather", ["get_weather"], [{"function": "get_weather"}]])
def test_malformed_tool_calls_in_the_history_are_a_value_error_naming_the_message(agent, turns, calls):
    with pytest.raises(ValueError, match=re.escape("message 1: 'tool_calls' must be a list of calls")):
        agent.run([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}])
    assert not turns


def test_developer_messages_are_system_and_tool_text_parts_their_text(agent, monkeypatch):
    """As the server reads them: a ``developer`` message is the system prompt (a chat template renders no
    "developer" role: the instruction was lost), a tool result's text parts are its text (not their JSON)."""
    seen = []
    monkeypatch.setattr(agent.engine, "turn", lambda messages, *a, **k: seen.append(messages) or (_ for _ in ()).throw(
        RuntimeError("stop here")))
    with pytest.raises(RuntimeError):
        agent.run([{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}, CALLED,
                   {"role": "tool", "tool_call_id": "x", "content": [{"type": "text", "text": "rainy, 12C"}]}])
    assert seen[0][0] == {"role": "system", "content": "Answer in French."}
    assert seen[0][3]["content"] == "rainy, 12C"


def test_a_lenient_response_format_reaches_the_engine_as_lenient(agent, monkeypatch):
    """``"strict": false`` relaxes the grammar through the Python API as over HTTP: the engine gets the
    ``ResponseFormat`` (its ``strict``), not only its schema (which it compiled strictly: every run failed)."""
    seen = []
    monkeypatch.setattr(agent.engine, "turn", lambda messages, tools, choice, rf, *a, **k: seen.append(rf) or (
        _ for _ in ()).throw(RuntimeError("stop here")))
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                      "uniqueItems": True}}, "required": ["xs"]}
    with pytest.raises(RuntimeError):
        agent.run("xs = 1, 2", tool_choice="none", response_format={
            "type": "json_schema", "json_schema": {"name": "x", "strict": False, "schema": schema}})
    assert seen[0].strict is False and seen[0].schema == schema


def test_run_batch_refuses_max_workers_below_one(agent, turns):
    with pytest.raises(ValueError, match="max_workers must be an integer >= 1, got 0"):
        agent.run_batch(["hi"], max_workers=0)
    assert not turns


def test_required_with_no_tools_is_refused(tiny_target):
    with pytest.raises(ValueError, match="'required' needs at least one tool"):
        Agent(Generator(tiny_target)).run("hi", tool_choice="required")


def test_run_batch_checks_every_prompt_before_running_any(agent, turns):
    with pytest.raises(ValueError, match="a list of prompts"):
        agent.run_batch("Weather in Oslo?")
    with pytest.raises(ValueError, match=r"prompts\[1\]: the prompt is empty"):
        agent.run_batch(["Weather in Oslo?", " "])
    assert not turns


@pytest.mark.parametrize("kwargs, error", [(dict(max_new_tokens=0), "max_new_tokens must be"),
                                           (dict(tool_choice={"name": "nope"}), "unknown tool 'nope'"),
                                           (dict(parallel_tool_calls="yes"), "parallel_tool_calls must be"),
                                           (dict(temprature=0.5), r"Agent\.run\(\): .*'temprature'"),
                                           (dict(drafter="draft_model"), "needs draft_model=")])
def test_run_batch_checks_the_run_options_before_running_any(agent, turns, kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        agent.run_batch(["Weather in Oslo?", "Weather in Rome?"], max_workers=2, **kwargs)
    assert not turns


def test_run_batch_checks_what_the_engine_refuses_before_running_any(tiny_target):
    """A helper's finds: parallel_tool_calls=True in a format with no layout for several calls ran every prompt into
    the same error; a message calling an unknown tool was re-raised as a plain ValueError (``except ToolCallError``
    missed it)."""
    from schemas import ToolCallError

    agent = Agent(Generator(tiny_target), [WEATHER], max_steps=1, tool_format="llama3_json")
    ran = []
    agent.engine.turn = lambda *a, **k: ran.append(a)
    with pytest.raises(ToolFormatError, match="no trained layout for several calls"):
        agent.run_batch(["Weather in Oslo?", "Weather in Rome?"], parallel_tool_calls=True)
    call = {"id": "c1", "type": "function", "function": {"name": "nope", "arguments": "{}"}}
    with pytest.raises(ToolCallError, match=r"prompts\[1\]: .*nope"):
        agent.run_batch(["Weather in Oslo?", [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": None, "tool_calls": [call]}]])
    assert not ran


def test_one_failing_prompt_does_not_cost_the_batch_its_results(tiny_target):
    """A helper's batch of three, the second longer than the context: ContextLengthError discarded the two results
    (max_workers 1 or 3; Ray alike). Now that prompt's result says why, the others stand; return_errors=False
    raises it."""
    agent = Agent(Generator(tiny_target), [WEATHER], max_steps=1)
    prompts = ["Weather in Oslo?", "word " * 5000, "Weather in Rome?"]
    for workers in (1, 3):
        results = agent.run_batch(prompts, max_workers=workers, tool_choice="required", max_new_tokens=24)
        assert [r.stop_reason for r in results] != ["error"] * 3
        assert results[1].stop_reason == "error" and results[1].error.startswith("ContextLengthError: ")
        assert results[1].messages == [{"role": "user", "content": prompts[1]}] and not results[1].tool_calls
        serial = [agent.run(p, tool_choice="required", max_new_tokens=24) for p in prompts[::2]]
        for r, alone in zip(results[::2], serial):
            assert r.error is None and r.stop_reason == alone.stop_reason and r.raw_turns == alone.raw_turns
    from decoding import ContextLengthError
    with pytest.raises(ContextLengthError):
        agent.run_batch(prompts, max_workers=3, return_errors=False, tool_choice="required", max_new_tokens=24)


def test_response_format_takes_a_response_format_and_the_agents_strict(tiny_target):
    """A ``ResponseFormat`` passed to ``run`` was refused ('got ResponseFormat'), and ``Agent(strict=False)`` did not
    relax a response format (its error said to 'register with strict=False', which a response format cannot)."""
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                      "uniqueItems": True}}, "required": ["xs"]}
    seen = []

    def engine_turn(messages, tools, choice, rf, *a, **k):
        seen.append(rf)
        raise RuntimeError("stop here")
    for agent, rf in ((Agent(Generator(tiny_target), [WEATHER]), ResponseFormat(schema, strict=False)),
                      (Agent(Generator(tiny_target), [WEATHER], strict=False), schema)):
        agent.engine.turn = engine_turn
        with pytest.raises(RuntimeError, match="stop here"):
            agent.run("xs = 1, 2", tool_choice="none", response_format=rf)
        assert seen[-1].strict is False and seen[-1].schema == schema
    with pytest.raises(Exception, match=r"pass ResponseFormat\(schema, strict=False\)") as err:
        Agent(Generator(tiny_target), [WEATHER]).run("xs", response_format=schema)
    assert "register with" not in str(err.value)


@pytest.mark.parametrize("kwargs, name", [(dict(max_steps=0), "max_steps"), (dict(max_retries=-1), "max_retries"),
                                          (dict(tool_timeout=-1), "tool_timeout")])
def test_agent_settings_out_of_range_are_refused(tiny_target, kwargs, name):
    with pytest.raises(ValueError, match=name):
        Agent(Generator(tiny_target), [WEATHER], **kwargs)


def test_a_chat_template_path_that_does_not_exist_is_an_error_not_the_template(tiny_target, tmp_path):
    with pytest.raises(ToolFormatError, match="no such file"):
        load_chat_template(str(tmp_path / "nope.jinja"))
    with pytest.raises(ToolFormatError, match="no such file"):
        Agent(Generator(tiny_target), chat_template="my_tmpl.jinja")
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_chat_template(str(tmp_path / "t.jinja")).startswith("{%")
    assert load_chat_template("{{ messages }}") == "{{ messages }}"


def test_openais_response_format_wrappers_are_read_as_their_schema():
    inner = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = ResponseFormat({"type": "json_schema", "json_schema": {"name": "r", "schema": inner, "strict": False}})
    assert rf.schema == inner and rf.strict is False
    assert ResponseFormat({"type": "json_object"}).schema == {"type": "object"}


def test_stream_refuses_an_unknown_keyword_and_run_a_non_boolean_parallel_flag(agent, turns):
    with pytest.raises(TypeError, match="foo"):
        agent.stream("Weather in Oslo?", foo=1)
    with pytest.raises(ValueError, match="parallel_tool_calls"):
        agent.run("Weather in Oslo?", parallel_tool_calls="yes")
    assert not turns


def test_cuda_on_a_torch_without_cuda_is_a_value_error_not_a_traceback():
    import torch

    from decoding import load_model
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for torch builds without it")
    with pytest.raises(ValueError, match="no CUDA device"):
        load_model("smollm2", device="cuda")


def test_tool_results_past_the_context_end_the_run_keeping_what_it_has(tiny_target):
    """A tool result too long for the context raised ContextLengthError after the tool had run, losing the run's
    results, and blamed the prompt; now the run ends with ``error`` naming the tool, its calls and transcript
    kept. The caller's own messages past the context still raise."""
    from decoding import ContextLengthError
    from schemas import Tool

    fetch = Tool.from_schema("fetch_page", {"type": "object", "properties": {}}, description="Fetch the page.",
                             fn=lambda: "word " * 6000)
    agent = Agent(Generator(tiny_target), [fetch], max_steps=3)
    res = agent.run("Fetch the page.", tool_choice="required", max_new_tokens=40)
    assert [rec.call.name for rec in res.tool_calls] == ["fetch_page"] and res.steps == 1
    assert "tool 'fetch_page'" in res.error and "30000 characters" in res.error
    assert res.messages[-1]["role"] == "tool"
    with pytest.raises(ContextLengthError):
        agent.run("word " * 6000, tool_choice="required", max_new_tokens=40)


def test_run_says_why_it_stopped(tiny_target, monkeypatch, capsys):
    """A model calling again and again ran to ``max_steps`` with no sign of it (``error`` None, no answer); now
    ``stop_reason`` says why each run ended, and ``python -m agent run`` prints it."""
    from agent.__main__ import _print_run
    from agent.engine import DecodedTurn
    from schemas import Tool

    call = DecodedTurn('{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                       [{"name": "get_weather", "arguments": {"city": "Oslo"}}], True, "eos")
    weather = Tool.from_schema("get_weather", WEATHER["function"]["parameters"], fn=lambda city: {"temp": 20})
    agent = Agent(Generator(tiny_target), [weather], max_steps=3)
    for turn, reason in [(call, "max_steps"), (DecodedTurn("It is 20 degrees.", None, False, "eos"), "answer"),
                         (DecodedTurn("It is", None, False, "length"), "length")]:
        monkeypatch.setattr(agent.engine, "turn", lambda *a, turn=turn, **k: turn)
        res = agent.run("Weather in Oslo?")
        assert res.stop_reason == reason and res.error is None
    assert res.final_answer == "It is" and res.truncated
    monkeypatch.setattr(agent.engine, "turn", lambda *a, **k: call)
    res = agent.run("Weather in Oslo?")
    assert res.steps == 3 and len(res.tool_calls) == 3 and res.final_answer is None
    _print_run("Weather in Oslo?", res)
    assert "3 steps ran out before an answer" in capsys.readouterr().out
    pending = Agent(agent.engine, [WEATHER], max_steps=3).run("Weather in Oslo?")
    assert pending.stop_reason == "calls" and pending.steps == 1 and pending.pending_calls
