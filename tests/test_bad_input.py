"""Bad input as a new user meets it: each gets a clear error or a sane documented result, and nothing is lost."""
from __future__ import annotations

import sys

import pytest

from agent import Agent
from agent.__main__ import main, tool_choice_arg
from agent.formats.generic import render_call_text, turn_grammar
from decoding import Generator
from schemas import Tool, ToolRegistry

from test_agent_loop import ScriptedGenerator, add
from test_grammar_narrowing import accepts, call


@pytest.fixture(scope="module")
def tiny_gen(tiny_target):
    return Generator(tiny_target, drafter="none")


# -- budgets ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 3])
def test_tiny_budget_with_required_never_returns_a_call_fragment(tiny_gen, budget):
    res = Agent(tiny_gen, [add]).run("add 2 and 3", tool_choice="required", max_new_tokens=budget)
    assert res.truncated and res.raw_turns and "<tool_call>".startswith(res.raw_turns[0])
    assert res.final_answer is None and not res.tool_calls
    assert [m["role"] for m in res.messages] == ["user"]


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"max_new_tokens": -5}, {"max_total_tokens": 0},
                                    {"max_steps": 0}])
def test_zero_or_negative_budget_is_rejected_naming_it(tiny_gen, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Agent(tiny_gen, [add]).run("add 2 and 3", **kwargs)


@pytest.mark.parametrize("budget", [0, -1])
def test_generator_rejects_a_budget_below_one(tiny_gen, budget):
    from constraints import regex_grammar

    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_gen.generate([1, 2], regex_grammar("a+"), max_new_tokens=budget)


@pytest.mark.parametrize("prompt", [None, "", "   ", [], 42])
def test_missing_or_empty_prompt_is_rejected_clearly(tiny_gen, prompt):
    with pytest.raises(ValueError, match="prompt"):
        Agent(tiny_gen, [add]).run(prompt)


# -- a lenient call still invalid after the retries -----------------------------------------------------------------
def test_lenient_call_still_invalid_after_retries_returns_the_transcript(tiny_target):
    picked = []
    pick = Tool.from_schema("pick", {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9, "not": {"const": 3}}}, "required": ["n"]},
        fn=picked.append, strict=False)

    def script(prompt):
        if "<|im_start|>tool" not in prompt:
            return render_call_text([{"name": "add", "arguments": {"a": 2, "b": 3}}])
        return render_call_text([{"name": "pick", "arguments": {"n": 3}}])  # the grammar relaxed "not"

    res = Agent(ScriptedGenerator(tiny_target, script), [add, pick], drafter="none", max_retries=1).run(
        "Add 2 and 3, then pick 3.")
    assert res.error and "pick" in res.error and "not" in res.error
    assert [(r.call.name, r.result) for r in res.tool_calls] == [("add", 5)]  # the earlier result is kept
    assert [m["role"] for m in res.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert not picked


def test_lenient_call_invalid_on_the_last_step_sets_the_error(tiny_target):
    """With no step left for the retry, the run used to end with no error, no call and no answer."""
    pick = Tool.from_schema("pick", {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9, "not": {"const": 3}}}, "required": ["n"]}, strict=False)
    script = lambda prompt: render_call_text([{"name": "pick", "arguments": {"n": 3}}])  # noqa: E731
    res = Agent(ScriptedGenerator(tiny_target, script), [pick], drafter="none").run(
        "Pick 3.", tool_choice="required", max_steps=1)
    assert res.error and "no step was left" in res.error and "pick" in res.error
    assert not res.tool_calls and not res.pending_calls


# -- streaming ----------------------------------------------------------------------------------------------------
def test_stream_sends_final_answer_when_the_answer_is_cut(tiny_gen):
    events = list(Agent(tiny_gen, [add]).stream("Say something long.", tool_choice="none", max_new_tokens=3))
    done = events[-1].result
    assert done.truncated and done.final_answer
    finals = [e for e in events if e.type == "final_answer"]
    assert len(finals) == 1 and finals[0].text == done.final_answer


# -- repeated parallel calls: what the user can do, enforced by the grammar ----------------------------------------
def test_parallel_tool_calls_false_admits_exactly_one_call(smol_tokenizer):
    from constraints import llg_tokenizer

    llt = llg_tokenizer(smol_tokenizer, 49152)
    tools = list(ToolRegistry([add]))
    two = render_call_text([{"name": "add", "arguments": {"a": 1, "b": 2}}] * 2)
    one = call("add", {"a": 1, "b": 2})
    assert accepts(llt, smol_tokenizer, turn_grammar(tools, "required", parallel=True), two)
    assert not accepts(llt, smol_tokenizer, turn_grammar(tools, "required", parallel=False), two)
    assert accepts(llt, smol_tokenizer, turn_grammar(tools, "required", parallel=False), one)


def test_array_parameter_with_max_items_bounds_the_values_of_one_call(smol_tokenizer):
    from constraints import llg_tokenizer

    llt = llg_tokenizer(smol_tokenizer, 49152)
    tool = Tool.from_schema("weather", {"type": "object", "properties": {"cities": {
        "type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 2}},
        "required": ["cities"]})
    grammar = turn_grammar([tool], "required", parallel=False)
    assert accepts(llt, smol_tokenizer, grammar, call("weather", {"cities": ["Oslo", "Rome"]}))
    assert not accepts(llt, smol_tokenizer, grammar, call("weather", {"cities": ["Oslo", "Oslo", "Oslo"]}))


# -- command line -------------------------------------------------------------------------------------------------
def test_cli_named_tool_choice_is_parsed():
    assert tool_choice_arg('{"name": "add"}') == {"name": "add"}
    assert tool_choice_arg('{"type": "function", "function": {"name": "add"}}') == {"name": "add"}
    assert tool_choice_arg("required") == "required"


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_cli_bad_tool_choice_fails_before_the_model_loads(capsys):
    with pytest.raises(SystemExit) as e:  # argparse: usage + one error line, status 2
        main(["run", "--model", "no-such-model", "--tools", "examples.my_tools:TOOLS", "--tool-choice", "bogus",
              "hi"])
    assert e.value.code == 2 and "bogus" in capsys.readouterr().err
    # a named tool that does not exist: found from the tools, before the (missing) model is looked up
    err = _one_line_error(capsys, ["run", "--model", "no-such-model", "--tools", "examples.my_tools:TOOLS",
                                   "--tool-choice", '{"name": "nope"}', "hi"])
    assert "nope" in err and "no-such-model" not in err


def test_bfcl_and_serve_refusals_are_one_error_line_before_the_model_loads(capsys):
    """``bfcl --runtime bad`` and a missing ``--data-dir`` exited 1 without the ``error:`` line (a SystemExit
    message); a server whose γ is past the per-request cap started and refused every request."""
    assert "choose from" in _one_line_error(capsys, ["bfcl", "--model", "no-such-model", "--runtime", "bad"])
    err = _one_line_error(capsys, ["serve", "--model", "no-such-model", "--num-draft-tokens", "100"])
    assert "at most 32" in err and "no-such-model" not in err


def test_cli_user_errors_are_one_line(capsys):
    assert "nope" in _one_line_error(capsys, ["run", "--tools", "nope:TOOLS", "hi"])
    assert "NOPE" in _one_line_error(capsys, ["run", "--tools", "examples.my_tools:NOPE", "hi"])
    assert "no-such-model" in _one_line_error(capsys, ["run", "--model", "no-such-model", "--tools",
                                                       "examples.my_tools:TOOLS", "hi"])


@pytest.mark.parametrize("flag, value, text", [("--max-items", "0", "count of items >= 1"),
                                               ("--max-items", "many", "count of items or 'none'"),
                                               ("--max-decimals", "-1", "count of decimals >= 0"),
                                               ("--limit", "0", ">= 1"), ("--limit", "-1", ">= 1"),
                                               ("--num-draft-tokens", "0", ">= 1")])
def test_cli_bad_grammar_bounds_fail_before_the_model_loads(capsys, flag, value, text):
    with pytest.raises(SystemExit) as e:
        main(["bfcl", "--model", "no-such-model", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and text in err and "no-such-model" not in err


@pytest.mark.parametrize("flag, value, text", [("--max-waiting", "-1", ">= 0"), ("--concurrency", "0", ">= 1"),
                                               ("--max-body-bytes", "0", ">= 1"), ("--request-timeout", "0", "> 0"),
                                               ("--request-timeout", "-5", "> 0"), ("--drain-timeout", "x", "number"),
                                               ("--max-batch", "0", ">= 1"), ("--seq-ctx", "-2", ">= 1"),
                                               ("--max-new-tokens", "0", ">= 1"), ("--ctx-size", "0", ">= 1"),
                                               ("--request-timeout", "nan", "> 0"), ("--drain-timeout", "nan", ">= 0")])
def test_serve_limits_under_which_nothing_could_be_served_fail_before_the_model_loads(capsys, flag, value, text):
    """``--max-waiting -1`` answered every request 429, ``--max-body-bytes 0`` every one 413, ``--concurrency 0``
    failed naming ``max_workers``: now argparse names the flag (exit status 2) and the Python API raises."""
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "no-such-model", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and text in err and "no-such-model" not in err
    from agent.server import create_app

    for kwargs in ({"max_waiting": -1}, {"concurrency": 0}, {"max_body_bytes": 0}, {"request_timeout": 0},
                   {"request_timeout": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            create_app(object(), model_name="x", **kwargs)


def test_cli_empty_prompt_fails_before_the_model_loads(capsys):
    assert "the prompt is empty" in _one_line_error(capsys, ["run", "--model", "no-such-model", "--tools",
                                                             "examples.my_tools:TOOLS", "  "])


# -- integer bounds past 2^53: the grammar compares bounds as 64-bit floats ------------------------------------------
BIG = 2 ** 53 + 1  # 9007199254740993: no float64 holds it (it rounds to 2^53 = 9007199254740992)


@pytest.mark.parametrize("keyword, bad", [("minimum", 2 ** 53), ("exclusiveMinimum", 2 ** 53 + 1),
                                          ("maximum", 2 ** 53 + 2), ("exclusiveMaximum", 2 ** 53 + 1)])
def test_integer_bound_past_2_53_never_admits_a_value_beyond_it(smol_tokenizer, keyword, bad):
    """``minimum: 2^53 + 1`` used to let ``2^53`` through the grammar (llguidance rounded the bound to a float).
    A strict tool is refused naming the keyword; a lenient one's grammar never admits a value beyond the bound."""
    from constraints import json_schema_grammar, llg_tokenizer
    from schemas import SchemaError

    llt = llg_tokenizer(smol_tokenizer, 49152)
    schema = {"type": "object", "properties": {"n": {"type": "integer", keyword: BIG}}, "required": ["n"],
              "additionalProperties": False}
    with pytest.raises(SchemaError, match=f"/properties/n/{keyword}.*2\\^53") as err:
        Tool.from_schema("f", schema)
    assert err.value.keyword == keyword and err.value.pointer == f"/properties/n/{keyword}"
    lenient = Tool.from_schema("f", schema, strict=False)
    assert not accepts(llt, smol_tokenizer, json_schema_grammar(schema, lenient=True), f'{{"n":{bad}}}')
    assert not accepts(llt, smol_tokenizer, turn_grammar([lenient], "required", parallel=False),
                       call("f", {"n": bad}))
    good = 2 ** 53 + 4 if "inimum" in keyword else 2 ** 53 - 2
    assert accepts(llt, smol_tokenizer, turn_grammar([lenient], "required", parallel=False), call("f", {"n": good}))


# -- a call complete exactly when the budget runs out ----------------------------------------------------------------
@pytest.fixture(scope="module")
def hermes_gen(smol_dir, tmp_path_factory):
    from helpers import registry_generator
    from test_formats import family

    _, target, draft = family(smol_dir, "hermes")
    return registry_generator(target, draft, tmp_path_factory.mktemp("mtp"))


def _drafters():
    from helpers import drafter_params

    return drafter_params()


@pytest.mark.parametrize("drafter", _drafters())
def test_a_call_complete_exactly_at_the_budget_is_returned_not_cut(hermes_gen, drafter):
    """Hermes with parallel calls allowed: after ``</tool_call>`` the grammar accepts but is not stopped (another
    call may follow). A budget that ends exactly there used to give stop "length" and the call was dropped."""
    from agent.engine import EngineConfig, LocalEngine
    from test_formats import WEATHER

    engine = LocalEngine(hermes_gen)
    assert engine.format.name == "hermes"
    messages = [{"role": "user", "content": "Weather in Oslo, please?"}]
    grammar = engine.format.turn_grammar([WEATHER], "required")
    full = hermes_gen.generate(engine.format.render(messages, [WEATHER]), grammar, max_new_tokens=120,
                               drafter="none")
    state = hermes_gen.new_state(grammar)
    for budget, token in enumerate(full.tokens, start=1):  # the first complete call's length
        state.consume(token)
        if state.is_accepting():
            break
    assert not state.is_stopped(), "another call may follow: the grammar accepts but has not stopped"
    turn = engine.turn(messages, [WEATHER], "required", config=EngineConfig(drafter=drafter, max_new_tokens=budget))
    assert turn.stats.new_tokens == budget and turn.stop_reason != "length" and not turn.truncated
    assert turn.calls and turn.calls[0]["name"] == "get_weather"
    WEATHER.validate(turn.calls[0]["arguments"])
    res = Agent(engine, [WEATHER]).run(messages[0]["content"], tool_choice="required", max_new_tokens=budget,
                                       drafter=drafter, max_steps=1)
    assert not res.truncated and [c.name for c in res.pending_calls][:1] == ["get_weather"]


@pytest.mark.parametrize("source, text", [("import nonexistent_dep_xyz\n", "cannot import module"),
                                          ("x = 1 / 0\n", "raised ZeroDivisionError: division by zero"),
                                          ("def f(:\n", "raised SyntaxError")])
def test_cli_tools_module_that_fails_to_import_is_one_error_line(capsys, tmp_path, monkeypatch, source, text):
    """A ``--tools`` module raising on import (or not parsing) printed a whole traceback and exited 1."""
    (tmp_path / "broken_tools_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_tools_mod", raising=False)
    err = _one_line_error(capsys, ["run", "--model", "no-such-model", "--tools", "broken_tools_mod:TOOLS", "hi"])
    assert text in err and "broken_tools_mod" in err


def test_cli_tools_may_be_a_dict_of_tools(tmp_path, monkeypatch):
    from agent.__main__ import load_tools

    (tmp_path / "dict_tools_mod.py").write_text("def add(a: int, b: int) -> int:\n    return a + b\n"
                                                "TOOLS = {'add': add}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [t.__name__ for t in load_tools("dict_tools_mod:TOOLS")] == ["add"]


def test_bfcl_checks_every_category_before_the_model_loads(capsys):
    """``--category simple_python,nosuch`` ran all of simple_python, then refused 'nosuch' (a helper's find);
    ``all,nosuch`` named 'all'."""
    for category in ("simple_python,nosuch", "all,nosuch"):
        err = _one_line_error(capsys, ["bfcl", "--model", "no-such-model", "--category", category])
        assert "unknown BFCL category 'nosuch'" in err and "no-such-model" not in err


def test_an_unreadable_or_unloadable_gguf_is_one_error_line(capsys, tmp_path, monkeypatch):
    """An unreadable file raised PermissionError through the CLI; a whole GGUF no loader takes raised the loader's
    own error (a config validator's) from deep inside."""
    import decoding.loader as loader
    from decoding.loader import KNOWN_MODELS, BadModelFileError, locate_gguf, naming_a_bad_gguf

    monkeypatch.setattr(loader, "sha256_file", lambda path: (_ for _ in ()).throw(PermissionError(
        13, "Permission denied", str(path))))
    err = _one_line_error(capsys, ["run", "--model", str(locate_gguf(KNOWN_MODELS["smollm2"])), "--backend", "torch",
                                   "--tools", "examples.my_tools:TOOLS", "hi"])
    assert "Permission denied" in err
    whole = locate_gguf(KNOWN_MODELS["smollm2"])
    with pytest.raises(BadModelFileError, match="is a GGUF file that could not be loaded: TypeError: odd"):
        with naming_a_bad_gguf(str(whole)):
            raise TypeError("odd")
    with pytest.raises(TypeError):  # an alias is not a file of the user's: its error stands
        with naming_a_bad_gguf("smollm2"):
            raise TypeError("odd")


def test_a_gguf_cut_short_is_one_error_line_naming_the_file(capsys, tmp_path):
    """A GGUF truncated in a copy failed deep in a loader: ``struct.error: unpack_from requires a buffer…`` (a
    traceback) or ``cannot reshape array of size 399424 into shape (576,960)``."""
    from decoding.loader import KNOWN_MODELS, locate_gguf

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(locate_gguf(KNOWN_MODELS["smollm2"]).read_bytes()[:1_000_000])
    for backend in ("llamacpp", "torch"):
        err = _one_line_error(capsys, ["run", "--model", str(cut), "--backend", backend, "--threads", "1",
                                       "--tools", "examples.my_tools:TOOLS", "hi"])
        assert "cut.gguf (1,000,000 bytes) is not a whole GGUF file, truncated or corrupt" in err


@pytest.mark.parametrize("template, text", [("{% for m in messages %}{{ m['role'] }", "TemplateSyntaxError"),
                                            ("{{ raise_exception('no') }}", "TemplateError: no"),
                                            ("{{ foo.bar }}", "UndefinedError"),
                                            ("{{ messages[0]['content'] + 1 }}", "TypeError")])
def test_a_chat_template_that_fails_is_one_error_line(capsys, tmp_path, template, text):
    """A broken ``--chat-template`` printed Jinja's traceback and exited 1; the API raised Jinja's own errors."""
    path = tmp_path / "t.jinja"
    path.write_text(template)
    err = _one_line_error(capsys, ["run", "--model", "smollm2", "--threads", "1", "--chat-template", str(path),
                                   "--tools", "examples.my_tools:TOOLS", "hi"])
    assert "the chat template cannot render one user message" in err and text in err


@pytest.mark.parametrize("raised, status, text", [("BrokenPipeError", 141, ""), ("KeyboardInterrupt", 130,
                                                                                 "interrupted")])
def test_cli_ends_quietly_on_a_closed_pipe_or_ctrl_c(raised, status, text):
    """``agent bfcl … | head -1`` ended in a BrokenPipeError traceback; Ctrl-C printed a KeyboardInterrupt one."""
    import subprocess

    code = ("import agent.__main__ as m\n"
            f"def boom(args):\n    raise {raised}\n"
            "m.cmd_run = boom\n"
            "raise SystemExit(m.main(['run', '--tools', 'examples.my_tools:TOOLS', 'hi']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == status and "Traceback" not in out.stderr and out.stderr.strip() == text


def test_a_ctrl_c_while_llama_cpp_loads_is_raised_once_the_load_returns():
    """ctypes drops an exception raised in a callback ("Exception ignored on calling ctypes callback function"):
    a Ctrl-C that landed in llama.cpp's log callback while it loaded was lost and the run went on to its end. The
    load now defers SIGINT and raises it after; a Ctrl-C landing in the callback at another time is delivered again
    a moment later. (Python's own SIGINT handler set here: an earlier test may have left a server's.)"""
    import signal
    import time

    from decoding.llamacpp import _log_line, sigint_deferred

    class Interrupted:
        def decode(self, *args, **kwargs):
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reached = []
        with pytest.raises(KeyboardInterrupt):
            with sigint_deferred():
                signal.raise_signal(signal.SIGINT)  # recorded: the block goes on
                reached.append("after the signal")
        assert reached == ["after the signal"]
        with pytest.raises(KeyboardInterrupt):
            _log_line(3, Interrupted(), None)  # returns: the interrupt is passed on to the main thread
            time.sleep(5)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_user_template_failing_on_a_later_conversation_is_a_tool_format_error(tiny_target, tmp_path):
    """A template of the user's that renders one user message but fails with a tool result (Gemma's "System role
    not supported", or an error of its own expression) raised that error from inside transformers."""
    from agent.formats import ToolFormatError

    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                "supported') }}{% endif %}{% if m['role'] == 'tool' %}{{ m['content'] + 1 }}{% endif %}"
                "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    agent = Agent(Generator(tiny_target), [add], chat_template=template, tool_format="hermes")
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [{"role": "user", "content": "1 plus 2?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    with pytest.raises(ToolFormatError, match="the chat template failed to render this conversation"):
        agent.run(history, max_steps=1)
