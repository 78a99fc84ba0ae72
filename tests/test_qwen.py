"""The default model, Qwen2.5-Coder-0.5B-Instruct, in its own ``hermes`` format (marked ``slow``: ``make test-slow``
installs it, 491 MB; ~1 minute on one core)."""
from __future__ import annotations

import pytest
import torch

from agent import Agent
from bench.bfcl import load_questions, score
from bench.bfcl_dialect import tool_from_bfcl
from decoding import Generator, ModelNotFoundError, load_model

from conftest import FIXTURES

pytestmark = pytest.mark.slow


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First addend.
        b: Second addend.
    """
    return a + b


@pytest.fixture(scope="module")
def gen():
    try:
        return Generator(load_model("qwen2.5-coder-0.5b"))
    except ModelNotFoundError as e:
        pytest.skip(f"the default model is not installed ({e}); run `make model-default`")


def test_qwen_0_5b_calls_add_and_answers_42_with_auto_tool_choice(gen):
    agent = Agent(gen, [add])
    assert agent.format.name == "hermes"
    res = agent.run("What is 2 plus 40?")
    assert [(r.call.name, r.call.arguments) for r in res.tool_calls] == [("add", {"a": 2, "b": 40})]
    assert "42" in res.final_answer


def test_qwen_0_5b_answers_every_demo_question_with_the_right_tool(gen):
    """`make demo`'s three questions: the right tool, the right arguments, the result quoted in the answer."""
    from agent.demo_tools import PROMPTS, TOOLS

    agent = Agent(gen, TOOLS, max_steps=2)
    expected = [("get_weather", {"city": "Tokyo"}, "24"), ("calculate", {}, "126"),
                ("convert_length", {"value": 5, "from_unit": "kilometers", "to_unit": "feet"}, "16404")]
    for prompt, (name, args, answer) in zip(PROMPTS, expected):
        res = agent.run(prompt, max_new_tokens=96)
        assert [r.call.name for r in res.tool_calls] == [name], prompt
        assert args.items() <= res.tool_calls[0].call.arguments.items(), prompt
        assert answer in res.final_answer, (prompt, res.final_answer)


def test_bfcl_calls_are_token_identical_across_drafters_and_validate(gen):
    for row in load_questions("simple_python", FIXTURES, limit=3):
        tools = [tool_from_bfcl(fn) for fn in row["function"]]
        agent = Agent(gen, tools, strict=False, max_string_length=200, max_decimals=8)
        messages = [m for turn in row["question"] for m in turn]
        runs = {d: agent.run(messages, tool_choice="required", max_steps=1, parallel_tool_calls=False,
                             max_new_tokens=128, drafter=d) for d in ("none", "lookup", "mtp")}
        assert runs["none"].raw_turns == runs["lookup"].raw_turns == runs["mtp"].raw_turns, row["id"]
        calls, _ = agent.format.parse(runs["none"].raw_turns[0])
        for c in calls:
            agent.registry.parse_call(c)
        assert score(calls, row["ground_truth"]), (row["id"], calls)


def test_shipped_mtp_head_for_qwen_0_5b_loads_and_drafts_accepted_tokens(gen):
    """The Qwen2.5-Coder-0.5B head (checkpoints/mtp-1d9614638d18024d, trained on the dev split; simple_python 0-9 are
    in its validation split): its card names the target and the held-out test split, and on the fixture questions
    its drafts are accepted (a floor far below the measured test-split figure: a broken head drafts ~0)."""
    from decoding.mtp import load_head

    head, card = load_head(gen.loaded)
    assert card["target_sha256"] == gen.loaded.sha256 and "test split" in card["data"]["held_out"]
    assert type(head.block) is type(gen.loaded.model.model.layers[0])  # Qwen2's own layer (q/k/v biases)
    drafted = accepted = 0
    for row in load_questions("simple_python", FIXTURES, limit=3):
        tools = [tool_from_bfcl(fn) for fn in row["function"]]
        agent = Agent(gen, tools, strict=False, max_string_length=200, max_decimals=8)
        res = agent.run([m for turn in row["question"] for m in turn], tool_choice="required", max_steps=1,
                        parallel_tool_calls=False, max_new_tokens=128, drafter="mtp")
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    assert drafted >= 5 and accepted / drafted >= 0.15, (accepted, drafted)


@pytest.fixture(scope="module")
def cpp_q8():
    """The default 0.5B as the llama.cpp backend loads it (the alias's Q8_0 weights) in the identity configuration:
    one thread, no repacking."""
    pytest.importorskip("llama_cpp")
    from decoding import load_llamacpp

    try:
        return load_llamacpp("qwen2.5-coder-0.5b", n_threads=1, n_ctx=2048)
    except ModelNotFoundError as e:
        pytest.skip(f"the default model is not installed ({e}); run `make model-default`")


def test_qwen_0_5b_verify_rows_on_llamacpp_equal_one_row_forwards_up_to_33_rows(cpp_q8):
    """The default 0.5B's weights on llama.cpp (Q8_0), one thread: every row of a 33-row verify (the largest the
    decoder sends) is bit-identical to the same position fed alone; on the Q4_K_M as shipped a row differs from 8
    rows on (docs/benchmarks.md, "llama.cpp batch invariance")."""
    assert "Q8_0" in cpp_q8.name
    lm = cpp_q8.new_lm()
    lm.reset()
    prompt = list(range(300, 620))
    lm.forward(prompt, num_logits=1)
    window = [11, 2000, 345, 7, 999, *range(5000, 5028)]
    batched, _ = lm.forward(window)
    lm.crop(len(prompt))
    alone = torch.cat([lm.forward([t])[0] for t in window])
    assert torch.equal(batched, alone)


def test_qwen_0_5b_speculative_greedy_on_llamacpp_is_token_identical_with_fixed_windows(cpp_q8):
    """Greedy speculative decoding of the default 0.5B on llama.cpp (identity configuration), in its own hermes
    format, gives the turns of one token per forward on BFCL fixture questions, with windows sent whenever a
    drafter has tokens (``window="fixed"``, γ 8; schema-forced runs ride up to the 32-draft cap), in fewer
    forwards."""
    gen = Generator(cpp_q8)
    fewer = 0
    for row in load_questions("simple_python", FIXTURES, limit=4):
        tools = [tool_from_bfcl(fn) for fn in row["function"]]
        agent = Agent(gen, tools, strict=False, max_string_length=200, max_decimals=8, window="fixed")
        messages = [m for turn in row["question"] for m in turn]
        runs = {d: agent.run(messages, tool_choice="required", max_steps=1, parallel_tool_calls=False,
                             max_new_tokens=96, drafter=d, num_draft_tokens=8) for d in ("none", "forced", "lookup")}
        assert runs["none"].raw_turns == runs["forced"].raw_turns == runs["lookup"].raw_turns, row["id"]
        fewer += runs["lookup"].stats.target_forwards < runs["none"].stats.target_forwards
    assert fewer == 4


@pytest.mark.parametrize("qid,listed_first,asked_for", [("multiple_38", "library.reserve_book", "library.search_book"),
                                                        ("multiple_40", "electromagnetism.ampere_law",
                                                         "electromagnetism.biot_savart_law")])
def test_qwen_0_5b_calls_the_tool_asked_for_where_it_leans_to_the_first_listed(cpp_q8, qid, listed_first,
                                                                               asked_for):
    """Two dev questions where the 0.5B calls the tool listed first ("find a book" → ``library.reserve_book``);
    against its prior for the tools (``EngineConfig.tool_prior``, agent/tool_prior.py) it calls the one asked for.
    Fixture: the two BFCL dev rows (``tests/fixtures/BFCL_v4_multiple.dev_tool_prior.jsonl``)."""
    from agent.engine import EngineConfig, LocalEngine
    from bench.bfcl import bfcl_turn

    row = next(r for r in load_questions("multiple", FIXTURES) if r["id"] == qid)
    turn = bfcl_turn(row, "multiple")
    engine = LocalEngine(Generator(cpp_q8))
    names = {}
    for prior in (False, True):
        out = engine.turn(turn.messages, turn.tools, turn.tool_choice, parallel_tool_calls=turn.parallel,
                          config=EngineConfig(max_new_tokens=128, tool_prior=prior))
        names[prior] = [c["name"] for c in out.calls]
    assert names == {False: [listed_first], True: [asked_for]}
