"""agent/: multi-step and parallel calls, tool_choice, response_format, streaming, threads, timeouts.

The loop is driven by a scripted generator that writes a chosen text token by token *through the turn grammar*
(so a script the grammar forbids fails the test), plus the tiny random model where the model's choice is irrelevant.
"""
from __future__ import annotations

import json
import threading
import time

import pydantic
import pytest

from agent import Agent
from constraints import ConstraintState
from decoding import DecodeResult, DecodeStats, Generator


class ScriptedGenerator(Generator):
    """A Generator whose turn texts come from ``script(messages_text) -> str``, checked against the grammar."""

    def __init__(self, loaded, script):
        super().__init__(loaded, drafter="none")
        self.script = script
        self.prompts: list[str] = []

    def generate(self, prompt, grammar, *, max_new_tokens=256, on_text=None, **kw):
        text_prompt = self.tokenizer.decode(prompt)
        self.prompts.append(text_prompt)
        text = self.script(text_prompt)
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        state = ConstraintState(self.llg_tokenizer, grammar)
        state.consume_many(tokens)  # raises if the grammar forbids the scripted text
        assert state.is_accepting(), f"scripted turn {text!r} is incomplete under the grammar"
        for i in range(1, len(tokens) + 1):
            if on_text:
                on_text(self.tokenizer.decode(tokens[i - 1:i]))
        stats = DecodeStats(new_tokens=len(tokens), target_forwards=len(tokens))
        return DecodeResult(tokens, text, "eos", stats)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def square(x: int) -> int:
    """Square an integer."""
    return x * x


def slow(x: int) -> int:
    """Sleep for a while."""
    time.sleep(5)
    return x


def two_step_script(prompt: str) -> str:
    if "<|im_start|>tool" not in prompt:
        return '<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>'
    if prompt.count("<|im_start|>tool") == 1:
        result = int(prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0])
        return '<tool_call>[{"name": "square", "arguments": {"x": %d}}]</tool_call>' % result
    return "The answer is " + prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0] + "."


def test_two_step_run_feeds_the_first_result_into_the_second_call(tiny_target):
    gen = ScriptedGenerator(tiny_target, two_step_script)
    res = Agent(gen, [add, square], drafter="none").run("square of 2+3?")
    assert [(r.call.name, r.call.arguments, r.result) for r in res.tool_calls] == [
        ("add", {"a": 2, "b": 3}, 5), ("square", {"x": 5}, 25)]
    assert res.final_answer == "The answer is 25."
    assert [m["role"] for m in res.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert res.steps == 3
    # the transcript can be fed to another run (its tool calls validate)
    Agent(gen, [add, square], drafter="none").run(res.messages + [{"role": "user", "content": "again"}],
                                                  max_steps=1)


def test_parallel_calls_in_one_turn_run_concurrently_and_keep_order(tiny_target):
    seen = []
    barrier = threading.Barrier(2, timeout=5)

    def a(n: int) -> int:
        """A."""
        barrier.wait()  # both calls must be running at the same time
        seen.append("a")
        return n

    def b(n: int) -> int:
        """B."""
        barrier.wait()
        seen.append("b")
        return -n

    script = lambda p: ('<tool_call>[{"name": "b", "arguments": {"n": 1}}, {"name": "a", "arguments": {"n": 2}}]'
                        '</tool_call>') if "<|im_start|>tool" not in p else "done"
    res = Agent(ScriptedGenerator(tiny_target, script), [a, b], drafter="none").run("Run b on 1 and a on 2.")
    assert [(r.call.name, r.result) for r in res.tool_calls] == [("b", -1), ("a", 2)]
    tool_msgs = [m for m in res.messages if m["role"] == "tool"]
    assert [m["name"] for m in tool_msgs] == ["b", "a"] and sorted(seen) == ["a", "b"]


def test_parallel_calls_are_refused_by_the_grammar_when_disabled(tiny_target):
    script = lambda p: '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 1}}, {"name": "add", ' \
                       '"arguments": {"a": 1, "b": 2}}]</tool_call>'
    agent = Agent(ScriptedGenerator(tiny_target, script), [add], drafter="none")
    with pytest.raises(Exception, match="not allowed"):
        agent.run("go", parallel_tool_calls=False)


CALL_ADD = '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 1}}]</tool_call>'


@pytest.mark.parametrize("choice,text,outcome", [
    ("auto", "Hello there.", "text"),
    ("auto", CALL_ADD, "call"),
    ("required", "Hello there.", "refused"),
    ("none", "I would call add(1, 1).", "text"),  # "none": an answer, never a call
    ({"name": "square"}, CALL_ADD, "refused"),
    ({"name": "square"}, '<tool_call>[{"name": "square", "arguments": {"x": 3}}]</tool_call>', "call"),
])
def test_tool_choice_is_enforced_by_the_grammar(tiny_target, choice, text, outcome):
    agent = Agent(ScriptedGenerator(tiny_target, lambda p: text), [add, square], drafter="none")
    if outcome == "refused":
        with pytest.raises(Exception, match="not allowed"):
            agent.run("Add 1 and 1.", tool_choice=choice, max_steps=1)
        return
    res = agent.run("Add 1 and 1.", tool_choice=choice, max_steps=1)
    assert bool(res.tool_calls) == (outcome == "call")
    assert (res.final_answer == text) == (outcome == "text")


class Weather(pydantic.BaseModel):
    city: str
    celsius: float


def test_pydantic_response_format_returns_a_validated_instance(tiny_target):
    script = lambda p: '{"city": "Oslo", "celsius": 4.5}'
    res = Agent(ScriptedGenerator(tiny_target, script), [add], drafter="none").run(
        "weather?", response_format=Weather)
    assert res.output == Weather(city="Oslo", celsius=4.5)


def test_response_format_is_enforced_on_the_real_decoder(tiny_target):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    res = Agent(Generator(tiny_target), [add]).run("x", tool_choice="none", response_format=schema,
                                                   max_new_tokens=40)
    assert set(res.output) == {"ok", "n"} and json.loads(res.final_answer) == res.output


def test_streaming_yields_tokens_calls_results_answer_stats_in_order(tiny_target):
    gen = ScriptedGenerator(tiny_target, two_step_script)
    events = list(Agent(gen, [add, square], drafter="none").stream("square of 2+3?"))
    kinds = [e.type for e in events]
    assert kinds[-1] == "done" and kinds[-2] == "final_answer"
    first_start = kinds.index("tool_call_started")
    assert "token" in kinds[:first_start] and kinds.index("tool_call_finished") > first_start
    text = "".join(e.text for e in events[:first_start] if e.type == "token")
    assert text == '<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>'
    finished = [e.record.result for e in events if e.type == "tool_call_finished"]
    assert finished == [5, 25] and events[-1].result.final_answer == "The answer is 25."
    assert kinds.count("stats") == 3


def test_streaming_reraises_errors(tiny_target):
    agent = Agent(ScriptedGenerator(tiny_target, lambda p: "x"), [add], drafter="none")
    with pytest.raises(Exception, match="unknown tool"):
        list(agent.stream([{"role": "assistant", "tool_calls": [{"function": {"name": "nope", "arguments": {}}}]}]))


def test_a_stream_left_early_stops_its_decode_at_the_next_step(tiny_target):
    """A helper's finding: ``Agent.stream`` closed after three events kept decoding to its budget (21 s on the 0.5B)
    and slowed the next run. Now the decode stops at its next step."""
    agent = Agent(Generator(tiny_target), [add], drafter="none")
    steps, turn, ended = [], agent.engine.turn, threading.Event()

    def counted(*args, **kwargs):
        on_text = args[-1] if len(args) == 7 else kwargs.get("on_text")
        args = args[:-1] if len(args) == 7 else args
        kwargs["on_text"] = lambda text: (steps.append(text), on_text(text))
        try:
            return turn(*args, **kwargs)
        finally:
            ended.set()

    agent.engine.turn = counted
    stream = agent.stream("Say a long thing.", tool_choice="none", max_new_tokens=300)
    for i, event in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert ended.wait(60)  # the decode ends
    assert len(steps) <= 5, len(steps)  # the events read, and the step that found the stream closed
    full = list(agent.stream("Say a long thing.", tool_choice="none", max_new_tokens=300))
    assert full[-1].type == "done" and len(steps) > 10  # left open, the same decode runs on


def test_consecutive_streams_decode_on_one_kept_thread(tiny_target):
    """A helper's finding: each ``Agent.stream`` decoded on a new thread, and llama.cpp keeps a KV cache per thread,
    so no stream reused a prefix (``prompt_tokens_cached`` 0; on the 0.5B, 6.5 s a stream against 2.4 s a warm run).
    Streams now decode on threads the agent keeps: one after another, on the same one."""
    agent = Agent(Generator(tiny_target), [add], drafter="none")
    threads, turn = [], agent.engine.turn

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread())
        return turn(*args, **kwargs)

    agent.engine.turn = recorded
    for _ in range(3):
        assert list(agent.stream("Say a thing.", tool_choice="none", max_new_tokens=4))[-1].type == "done"
    assert len(set(threads)) == 1 and threads[0] is not threading.current_thread()
    assert threads[0].name.startswith("specagent-stream")


def test_tool_that_hangs_past_its_timeout_gets_a_timeout_error(tiny_target):
    script = lambda p: '<tool_call>[{"name": "slow", "arguments": {"x": 1}}]</tool_call>' \
        if "<|im_start|>tool" not in p else "gave up"
    agent = Agent(ScriptedGenerator(tiny_target, script), [slow], drafter="none", tool_timeout=0.2)
    t0 = time.perf_counter()
    res = agent.run("Run slow on 1.")
    assert time.perf_counter() - t0 < 3
    assert res.tool_calls[0].error == "tool 'slow' timed out after 0.2 s" and res.final_answer == "gave up"


def test_total_token_budget_stops_the_run(tiny_target):
    gen = ScriptedGenerator(tiny_target, two_step_script)
    res = Agent(gen, [add, square], drafter="none").run("Add 2 and 3, then square it.", max_total_tokens=30)
    assert res.truncated and res.stats.new_tokens <= 30 + 40


def test_sixteen_threads_match_sequential_runs(tiny_target):
    agent = Agent(Generator(tiny_target), [add, square], max_string_length=8)
    prompts = [f"prompt number {i}: add {i} and {i + 1}" for i in range(16)]
    sequential = [agent.run(p, tool_choice="required", max_new_tokens=40, max_steps=1).raw_turns for p in prompts]
    threaded = agent.run_batch(prompts, max_workers=16, tool_choice="required", max_new_tokens=40, max_steps=1)
    assert [r.raw_turns for r in threaded] == sequential


async def aget_time(timezone: str) -> str:
    """Get the local time.

    Args:
        timezone: IANA time zone
    """
    import asyncio

    await asyncio.sleep(0.01)
    return f"14:05 in {timezone}"


def test_an_async_tool_is_awaited_and_its_result_fed_back(tiny_target):
    script = lambda p: '<tool_call>[{"name": "aget_time", "arguments": {"timezone": "Europe/Paris"}}]</tool_call>' \
        if "<|im_start|>tool" not in p else "It is 14:05."
    agent = Agent(ScriptedGenerator(tiny_target, script), [aget_time], drafter="none")
    res = agent.run("What time is it in Europe/Paris?")
    assert res.tool_calls[0].error is None and res.tool_calls[0].result == "14:05 in Europe/Paris"
    assert "14:05 in Europe/Paris" in json.dumps(res.messages)


def test_an_async_tool_runs_from_inside_a_running_event_loop(tiny_target):
    import asyncio

    script = lambda p: '<tool_call>[{"name": "aget_time", "arguments": {"timezone": "UTC"}}]</tool_call>' \
        if "<|im_start|>tool" not in p else "done"
    agent = Agent(ScriptedGenerator(tiny_target, script), [aget_time], drafter="none", tool_timeout=5)

    async def main():
        return agent.run("Time in UTC?"), Agent(ScriptedGenerator(tiny_target, script), [aget_time],
                                                  drafter="none").run("Time in UTC?")
    with_timeout, without = asyncio.run(main())
    assert with_timeout.tool_calls[0].result == without.tool_calls[0].result == "14:05 in UTC"


def test_a_partial_is_a_tool_without_its_bound_arguments(tiny_target):
    import functools

    def power(base: float, exp: float) -> float:
        """Raise a number to a power.

        Args:
            base: the number
            exp: the power
        """
        return base ** exp

    script = lambda p: '<tool_call>[{"name": "power", "arguments": {"base": 3}}]</tool_call>' \
        if "<|im_start|>tool" not in p else "nine"
    agent = Agent(ScriptedGenerator(tiny_target, script), [functools.partial(power, exp=2.0)], drafter="none")
    tool = agent.registry.get("power")
    assert tool.description == "Raise a number to a power." and list(tool.parameters["properties"]) == ["base"]
    assert agent.run("Square 3.").tool_calls[0].result == 9.0


class CountingScript:
    """A script whose answer turns (after tool results) come from ``answers`` in turn; calls add(2, 40) first."""

    def __init__(self, *answers: str, first: str = '<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 40}}]'
                                                         '</tool_call>'):
        self.answers, self.first, self.grammars = list(answers), first, []

    def __call__(self, prompt: str) -> str:
        if self.first and "<|im_start|>tool" not in prompt:
            return self.first
        return self.answers.pop(0)


class GrammarRecorder(ScriptedGenerator):
    def generate(self, prompt, grammar, **kw):
        self.script.grammars.append(grammar)
        return super().generate(prompt, grammar, **kw)


def _refuses(gen, grammar, text: str) -> bool:
    state = ConstraintState(gen.llg_tokenizer, grammar)
    try:
        state.consume_many(gen.tokenizer.encode(text, add_special_tokens=False))
    except Exception:
        return True
    return False


def test_an_answer_that_restates_the_call_as_json_is_decoded_again_as_an_answer(tiny_target):
    script = CountingScript('```json\n{"name": "add", "arguments": {"a": 42, "b": 40}}\n```', "The sum is 42.")
    gen = GrammarRecorder(tiny_target, script)
    res = Agent(gen, [add], drafter="none").run("2 plus 40?")
    assert res.tool_calls[0].result == 42 and res.final_answer == "The sum is 42."
    assert len(script.grammars) == 3  # the call, the restating answer, the answer again
    assert _refuses(gen, script.grammars[2], "`") and not _refuses(gen, script.grammars[1], "```json\n")


def test_an_answer_that_echoes_a_tool_result_is_decoded_again(tiny_target):
    script = CountingScript('```json\n{"error": "RuntimeError: kaboom"}\n```', "The tool failed.")

    def boom(a: int, b: int) -> int:
        """Add two integers."""
        raise RuntimeError("kaboom")
    boom.__name__ = "add"
    res = Agent(GrammarRecorder(tiny_target, script), [boom], drafter="none").run("2 plus 40?")
    assert res.tool_calls[0].error == "RuntimeError: kaboom" and res.final_answer == "The tool failed."


def test_a_json_answer_that_is_no_call_and_no_result_stands(tiny_target):
    script = CountingScript('```json\n{"total": 42}\n```', "unused")
    res = Agent(GrammarRecorder(tiny_target, script), [add], drafter="none").run("2 plus 40?")
    assert res.final_answer == '```json\n{"total": 42}\n```' and script.answers == ["unused"]


def test_a_call_written_as_text_under_tool_choice_none_is_decoded_again(tiny_target):
    script = CountingScript('{"name": "add", "arguments": {"a": 1, "b": 2}}', "Hello!", first="")
    res = Agent(GrammarRecorder(tiny_target, script), [add], drafter="none").run("Say hello.", tool_choice="none")
    assert res.final_answer == "Hello!" and not res.tool_calls


def test_answer_json_reads_only_a_lone_json_block():
    from agent.engine import answer_json

    assert answer_json('```json\n{"a": 1}\n```') == (True, {"a": 1})
    assert answer_json(' {"a": [1, 2]} ') == (True, {"a": [1, 2]})
    assert answer_json('Here: ```json\n{"a": 1}\n```') == (False, None)
    assert answer_json('```json\n{"a": 1}\n```\nand ```json\n{"b": 2}\n```') == (False, None)
    assert answer_json('```json\n{"a": 1}\n``` that is all') == (False, None)
    assert answer_json("42 apples")[0] is False


def test_an_answer_that_is_the_scalar_a_tool_returned_stands(tiny_target):
    script = CountingScript("42", "unused")
    res = Agent(GrammarRecorder(tiny_target, script), [add], drafter="none").run("2 plus 40?")
    assert res.final_answer == "42" and script.answers == ["unused"]


def test_an_answer_that_writes_a_call_after_other_characters_is_decoded_again_as_prose(tiny_target):
    """After two tool results Qwen2.5-Coder-0.5B answered '>{"name": "get_weather", …}' (scripts/chain_steps.py):
    no lone JSON, so it stood. An answer opening with neither a letter nor a digit that writes a call of a tool is
    decoded again, now with no brace or backtick anywhere; one opening with a word stands, whatever it quotes."""
    script = CountingScript('>{"name": "add", "arguments": {"a": 2, "b": 40}}', "The sum is 42.")
    gen = GrammarRecorder(tiny_target, script)
    res = Agent(gen, [add], drafter="none").run("2 plus 40?")
    assert res.final_answer == "The sum is 42." and len(script.grammars) == 3
    retry = script.grammars[2]
    assert _refuses(gen, retry, "The sum is {") and _refuses(gen, retry, "The sum is `42`")
    assert not _refuses(gen, retry, "The sum is 42.")
    # a lone restated call keeps its retry, which may quote JSON or code after its first word (a helper found
    # the code and JSON asked for after a tool result mangled where every retry forbade braces)
    script = CountingScript('```json\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n```', "unused")
    gen = GrammarRecorder(tiny_target, script)
    Agent(gen, [add], drafter="none").run("2 plus 40?")
    assert not _refuses(gen, script.grammars[2], 'Here it is: ```python\n{"sum": 42}\n```')
    # the restated call's retry writing a call behind a sign (the 0.5B after two results): once more, no braces
    script = CountingScript('```json\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n```',
                            '>{"name": "add", "arguments": {"a": 2, "b": 40}}', "It is 42.", "unused")
    gen = GrammarRecorder(tiny_target, script)
    assert Agent(gen, [add], drafter="none").run("2 plus 40?").final_answer == "It is 42."
    assert script.answers == ["unused"] and _refuses(gen, script.grammars[3], "It is {")
    script = CountingScript('I called {"name": "add", "arguments": {"a": 2, "b": 40}}', "unused")
    res = Agent(GrammarRecorder(tiny_target, script), [add], drafter="none").run("2 plus 40?")
    assert res.final_answer.startswith("I called") and script.answers == ["unused"]


def test_the_answer_the_grounding_falls_back_to_is_checked_as_every_answer(tiny_target):
    """A call after the tool result that takes nothing from the conversation leaves no tool under ``"auto"``: the
    turn is an answer. Where that answer restates the call and its retry writes one behind a sign (Qwen2.5-Coder-0.5B
    in the llama3_json format: '({"name": "add", …}' returned as the final answer), it is decoded once more with no
    brace or backtick anywhere, as every answer is."""
    script = CountingScript('<tool_call>[{"name": "add", "arguments": {"a": 7, "b": 9}}]</tool_call>',
                            '```json\n{"name": "add", "arguments": {"a": 7, "b": 9}}\n```',
                            '({"name": "add", "arguments": {"a": 7, "b": 9}}', "The sum is 42.", "unused")
    gen = GrammarRecorder(tiny_target, script)
    res = Agent(gen, [add], drafter="none").run("2 plus 40?")
    assert res.final_answer == "The sum is 42." and script.answers == ["unused"]
    assert len(res.tool_calls) == 1 and res.tool_calls[0].result == 42
    assert _refuses(gen, script.grammars[3], "({") is False and _refuses(gen, script.grammars[4], "The sum is {")


@pytest.mark.parametrize("text,live", [("The sum is 42.", True), ('>{"name"', False), ("42 it is", True),
                                       ("* 42", False)])
def test_a_streamed_answer_after_tool_results_is_held_where_it_may_be_decoded_again(text, live):
    from agent.engine import EngineConfig
    from agent.openai_protocol import TextStream, parse_chat_request

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, EngineConfig(), ("m",))
    stream = TextStream(req, ("<tool_call>",))
    assert stream.feed(text) == (text if live else "") and stream.live == live


def test_under_none_a_call_written_as_text_is_an_answer_decoded_again_as_prose(tiny_target):
    """``"none"``: whatever the text says, it is an answer, never a call; one that writes a call behind a marker
    (``<tool_call>[{"name": "add", …}]``) is decoded again with no brace or backtick (``agent.engine.writes_call``)."""
    answers = iter([CALL_ADD, "Two."])
    agent = Agent(ScriptedGenerator(tiny_target, lambda p: next(answers)), [add, square], drafter="none")
    res = agent.run("Add 1 and 1.", tool_choice="none", max_steps=1)
    assert not res.tool_calls and res.final_answer == "Two." and res.stop_reason == "answer"


def test_an_answer_failing_a_relaxed_response_format_ends_the_run_with_error_not_an_exception(tiny_target):
    """``strict=False`` relaxes ``uniqueItems`` in the grammar; an answer that then fails it raised ToolCallError out
    of ``run``, losing the run (its tool results too). Now ``error`` says why, the text is kept, ``output`` None."""
    from schemas import ResponseFormat

    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                      "uniqueItems": True}}, "required": ["xs"]}
    agent = Agent(ScriptedGenerator(tiny_target, lambda p: '{"xs": [1, 1]}'), [add], drafter="none")
    res = agent.run("xs: 1 and 1", tool_choice="none", response_format=ResponseFormat(schema, strict=False))
    assert res.stop_reason == "error" and "uniqueItems" in res.error and res.output is None
    assert res.final_answer == '{"xs": [1, 1]}'
    agent = Agent(ScriptedGenerator(tiny_target, lambda p: '{"xs": [1, 2]}'), [add], drafter="none")
    res = agent.run("xs: 1 and 2", tool_choice="none", response_format=ResponseFormat(schema, strict=False))
    assert res.stop_reason == "answer" and res.output == {"xs": [1, 2]} and res.error is None
