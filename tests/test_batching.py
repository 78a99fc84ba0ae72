"""Continuous batching on the llama.cpp backend (decoding/batch.py, ``--max-batch``) on the real SmolLM2-135M GGUF
(marked ``model``), in the identity configuration (``threads=1``, no repacking).

The reference of every request is the same request decoded alone, from an empty KV cache, by the one-sequence
backend (``Generator.generate`` without batching). Checked: greedy tokens equal it for concurrent requests of
different lengths that join and leave mid-run, within a binding row cap; sampled tokens equal it (same seed, no window
shortened); every complete output parses and validates; a cancelled sequence leaves with its KV cache removed and the
others untouched; a request that does not fit one sequence's KV cache is refused before anything is decoded.
"""
from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

from agent.formats.generic import parse_turn
from bench.bfcl import load_questions
from bench.bfcl_dialect import tool_from_bfcl
from decoding import ContextLengthError, Generator, LlamaCppModel, SamplingParams, load_llamacpp
from decoding.batch import PREFILL_BATCH, SMALL_UBATCH, KVCacheFullError, prefill_classes

from helpers import decode_bfcl
from test_model import BFCL_FIXTURE

pytestmark = pytest.mark.model

BUDGETS = [64, 64, 12, 64, 64]  # new tokens per request: outputs of different lengths (one cut by its budget)


@pytest.fixture(scope="module")
def cpp() -> LlamaCppModel:
    return load_llamacpp("smollm2", n_threads=1, n_ctx=2048)  # the identity configuration


@pytest.fixture(scope="module")
def questions():
    return load_questions("simple_python", BFCL_FIXTURE, limit=len(BUDGETS))


def alone(gen: Generator, row: dict, budget: int, **kw):
    """``row`` decoded by the one-sequence backend from an empty KV cache: the reference."""
    gen.new_target().reset()
    return decode_bfcl(gen, row, "lookup", max_new_tokens=budget, **kw)[1]


@pytest.fixture(scope="module")
def references(cpp, questions):
    gen = Generator(cpp)
    return [alone(gen, row, budget) for row, budget in zip(questions, BUDGETS)]


def together(gen: Generator, questions, budgets, **kw):
    """All requests at once, one thread each (as the server's pool), through ``gen``'s scheduler."""
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(lambda rb: decode_bfcl(gen, rb[0], "lookup", max_new_tokens=rb[1], **kw)[1],
                             zip(questions, budgets)))


def assert_valid(row: dict, res) -> None:
    calls, _ = parse_turn(res.text)
    assert len(calls) == 1, (row["id"], res.text)
    tools = {fn["name"]: tool_from_bfcl(fn) for fn in row["function"]}
    tools[calls[0]["name"]].make_call(calls[0]["arguments"])  # raises if invalid


def test_every_rows_logits_in_a_multi_sequence_decode_equal_the_sequence_decoded_alone(cpp):
    """The ground the identity stands on: 4 sequences of different lengths, 6 steps of 1-5 verify rows each (1-33 in one
    step: up to 132 rows per decode) with their own crops (seq_rm) in between: every row's logits are bit-identical to the same
    row in a one-sequence context. (With a unified KV cache they are not: measured up to ~1 logit.)"""
    import numpy as np

    from decoding.llamacpp import SequenceBatchContext

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 10000, n).tolist() for n in (30, 120, 12, 80)]
    plans = [[(int(rng.integers(1, 34 if t == 2 else 6)), None) for t in range(6)] for _ in prompts]
    plans = [[(rows, int(rng.integers(0, rows + 1))) for rows, _ in plan] for plan in plans]
    feeds = [[rng.integers(100, 10000, rows).tolist() for rows, _ in plan] for plan in plans]
    expected = []
    for prompt, plan, feed in zip(prompts, plans, feeds):  # alone: the one-sequence backend
        lm = cpp.new_lm()
        lm.reset()
        lm.forward(prompt, num_logits=1)
        out = []
        for (rows, keep), toks in zip(plan, feed):
            start = lm.length
            out.append(lm.forward(toks)[0].numpy())
            lm.crop(start + keep)
        expected.append(out)
    ctx = SequenceBatchContext(cpp, 4, 512)
    for s, prompt in enumerate(prompts):
        ctx.decode([(s, prompt, [])])
    for t in range(6):
        parts = [(s, feeds[s][t], list(range(len(feeds[s][t])))) for s in range(4)]
        starts = [len(ctx.tokens[s]) for s in range(4)]
        outs = ctx.decode(parts)
        for s in range(4):
            assert np.array_equal(outs[s], expected[s][t]), (s, t)
            ctx.crop(s, starts[s] + plans[s][t][1])
            assert ctx.used(s) == len(ctx.tokens[s])


@pytest.mark.parametrize("max_batch, max_rows", [(3, 128), (4, 6)], ids=["3-slots-join-leave", "row-cap-6"])
def test_concurrent_greedy_equals_each_request_decoded_alone(cpp, questions, references, max_batch, max_rows):
    """5 requests on 3 slots (two join when others leave) and on 4 slots with at most 6 tokens per step (windows
    shortened, sequences waiting a step): every request's tokens equal its reference; complete ones validate."""
    gen = Generator(cpp)
    sched = gen.enable_batching(max_batch, seq_ctx=1024, max_rows=max_rows)
    outs = together(gen, questions, BUDGETS)
    for row, ref, out, budget in zip(questions, references, outs, BUDGETS):
        assert out.tokens == ref.tokens, (row["id"], ref.text, out.text)
        assert out.stop_reason == ref.stop_reason
        if budget == 64:
            assert out.stop_reason != "length"
            assert_valid(row, out)
    assert references[2].stop_reason == "length"  # the short one is cut: lengths differ
    assert sched.max_sequences_seen >= 2  # verified together
    assert sched.steps < sum(o.stats.target_forwards for o in outs)  # fewer decodes than sequence-steps
    assert sched.max_rows_seen <= max_rows
    assert sched.active == 0
    if max_rows == 6:
        assert sched.max_rows_seen == 6  # the cap was reached: windows were shortened


def test_sequences_move_down_to_the_lowest_seq_ids_and_still_decode_as_alone(cpp, questions, references):
    """llama.cpp runs a decode's sequences in one micro-batch only over consecutive seq_ids (``split_equal``), so a
    sequence above a freed slot moves down into it (a KV stream copy): the short request takes slot 0 and leaves
    first, the one in the top slot moves there; every decode runs while the held slots are 0 … k-1, and every
    output still equals its request decoded alone (the keys/values move bit for bit)."""
    gen = Generator(cpp)
    sched = gen.enable_batching(5, seq_ctx=1024, max_rows=256)  # no sequence waits a step for rows
    held = []
    decode = sched.ctx.decode

    def recording(parts):
        held.append(sched.held_slots)
        return decode(parts)

    sched.ctx.decode = recording
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        short = pool.submit(decode_bfcl, gen, questions[2], "lookup", max_new_tokens=BUDGETS[2])
        while sched.held_slots != [0]:  # it holds slot 0 (prefilling) before the others come
            time.sleep(0.001)
        rest = {i: pool.submit(decode_bfcl, gen, questions[i], "lookup", max_new_tokens=BUDGETS[i])
                for i in (0, 1, 3, 4)}
        outs = {2: short.result()[1]} | {i: f.result()[1] for i, f in rest.items()}
    assert sched.moves >= 1
    assert max(len(h) for h in held) == 5
    assert all(h == list(range(len(h))) for h in held), [h for h in held if h != list(range(len(h)))]
    for i, out in outs.items():
        assert out.tokens == references[i].tokens, questions[i]["id"]
    assert sched.active == 0 and all(sched.ctx.used(s) == len(sched.ctx.tokens[s]) for s in range(5))


def test_a_decode_returns_each_parts_logits_whatever_order_the_parts_come_in(cpp):
    """The batch is laid out by seq_id (one micro-batch); the logits come back in the caller's order of parts."""
    import numpy as np

    from decoding.llamacpp import SequenceBatchContext

    ctx = SequenceBatchContext(cpp, 3, 256)
    feeds = {0: [11, 12, 13], 1: [21], 2: [31, 32]}
    for s in range(3):
        ctx.decode([(s, [100 + s] * 5, [])])
    forward = ctx.decode([(s, feeds[s], list(range(len(feeds[s])))) for s in (0, 1, 2)])
    for s in range(3):
        ctx.crop(s, 5)
    backward = ctx.decode([(s, feeds[s], list(range(len(feeds[s])))) for s in (2, 1, 0)])
    for k, s in enumerate((2, 1, 0)):
        assert backward[k].shape == (len(feeds[s]), ctx.vocab_size)
        assert np.array_equal(backward[k], forward[s]), s
    assert not np.array_equal(forward[0][:1], forward[2][:1])  # the parts' logits differ: a swap would show


def test_a_context_keeps_its_model_alive_when_the_caller_drops_it():
    """A context reads the model's weights: dropping the caller's last reference to the model must not free them
    under it (it did: an abort in ``llama_decode``). Run in a child process, so a crash fails this test only."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import gc
        from decoding import load_llamacpp
        from decoding.llamacpp import SequenceBatchContext

        def make():
            return SequenceBatchContext(load_llamacpp("smollm2", n_threads=1, n_ctx=512), 2, 256)

        ctx = make()
        gc.collect()
        logits = ctx.decode([(0, [100, 101, 102], [2]), (1, [103], [0])])
        print(len(logits), logits[0].shape[0], logits[1].shape[0])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "1", "1"]


def test_sampled_batched_output_equals_its_serial_draws_and_validates(cpp, questions):
    sampling = SamplingParams(temperature=0.8, seed=7)
    serial = Generator(cpp, window="fixed")  # batched windows are not sized by the row cost: the same windows
    refs = [alone(serial, row, 128, sampling=sampling) for row in questions[:3]]
    gen = Generator(cpp)
    gen.enable_batching(3, seq_ctx=1024, max_rows=128)  # no window shortened: the same draws, in the same order
    outs = together(gen, questions[:3], [128] * 3, sampling=sampling)
    for row, ref, out in zip(questions, refs, outs):
        assert out.tokens == ref.tokens, (row["id"], ref.text, out.text)
        assert out.stop_reason != "length"
        assert_valid(row, out)


class Leave(Exception):
    """Raised from a request's streaming callback: its client left."""


def test_a_cancelled_sequence_frees_its_slot_and_kv_without_disturbing_the_other(cpp, questions, references):
    gen = Generator(cpp)
    sched = gen.enable_batching(2, seq_ctx=1024)
    seen_active = []

    def leave(_text):
        seen_active.append(sched.active)
        raise Leave

    def cancelled():
        with pytest.raises(Leave):
            decode_bfcl(gen, questions[1], "lookup", max_new_tokens=64, on_text=leave)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        left = pool.submit(cancelled)
        stays = pool.submit(lambda: decode_bfcl(gen, questions[0], "lookup", max_new_tokens=64)[1])
        left.result()
        out = stays.result()
    assert seen_active == [2]  # it left while the other was decoding beside it
    assert out.tokens == references[0].tokens
    held = sorted((len(sched.ctx.tokens[s]), sched.ctx.used(s)) for s in range(2))
    assert held[0] == (0, 0)  # the cancelled sequence: nothing recorded, no KV cell left (seq_rm)
    assert held[1][0] == held[1][1] > 0  # the finished one keeps its cache (prefix for the next request)
    assert sched.active == 0
    after = decode_bfcl(gen, questions[3], "lookup", max_new_tokens=64)[1]  # slots still serve
    assert after.tokens == references[3].tokens


def test_a_joining_request_copies_the_shared_prompt_prefix_from_a_busy_slot(cpp, questions, references):
    """After one request, two more at once: one reuses the warm slot, the other gets that slot's prefix (the
    system prompt) copied into its empty slot (``seq_cp``) instead of a full prefill; both equal their
    references and neither prefills the shared part again."""
    gen = Generator(cpp)
    sched = gen.enable_batching(2, seq_ctx=1024)
    first = decode_bfcl(gen, questions[0], "lookup", max_new_tokens=64)[1]
    assert first.tokens == references[0].tokens and sched.copies == 0
    outs = together(gen, [questions[1], questions[3]], [64, 64])
    assert sched.copies == 1
    for out, ref in zip(outs, [references[1], references[3]]):
        assert out.tokens == ref.tokens
        assert out.stats.prompt_tokens_cached >= 90 - SMALL_UBATCH  # the shared system prompt (90) was not refed


def test_a_request_beyond_one_sequences_kv_cache_is_refused_and_nothing_is_corrupted(cpp, questions, references):
    gen = Generator(cpp)
    sched = gen.enable_batching(2, seq_ctx=256)
    assert gen.context_length == sched.seq_ctx >= 256
    long_prompt = list(range(300, 300 + sched.seq_ctx + 10))
    with pytest.raises(ContextLengthError):  # Generator.generate: the prompt does not fit one sequence
        gen.generate(long_prompt, gen.new_state(_grammar()), max_new_tokens=4)
    with pytest.raises(KVCacheFullError, match="do not fit one sequence"):  # prompt + budget beyond seq_ctx
        sched.decode(list(range(300, 400)), gen.new_state(_grammar()), None, max_new_tokens=sched.seq_ctx)
    sched.ctx.decode([(0, list(range(300, 340)), [])])
    with pytest.raises(ValueError, match="do not fit"):  # the context itself refuses before decoding
        sched.ctx.decode([(1, [5, 6], [1]), (0, list(range(sched.seq_ctx)), [0])])
    assert (len(sched.ctx.tokens[0]), sched.ctx.used(0), sched.ctx.used(1)) == (40, 40, 0)
    big = Generator(cpp)
    big.enable_batching(2, seq_ctx=1024)
    assert decode_bfcl(big, questions[0], "lookup", max_new_tokens=64)[1].tokens == references[0].tokens
    with pytest.raises(ContextLengthError):  # a BFCL prompt (~300 tokens) does not fit 256 positions
        decode_bfcl(gen, questions[0], "lookup", max_new_tokens=8)


def _grammar():
    from constraints import regex_grammar

    return regex_grammar("[a-z]{1,4}")


P300 = list(range(1000, 1300))


@pytest.mark.parametrize("prompt, held, held_big, expected", [
    (P300[:40], [], 0, (0, 0)),  # short: every token small-class (< 64 in its decode), any chunks
    (P300, [], 0, (299, 0)),  # fresh: one big decode of prompt[:-1]
    (P300, P300[:250] + [7] * 60, 299, (299, 299 - SMALL_UBATCH)),  # 250 shared; >= 64 still fed alone
    (P300, P300[:120] + [7] * 100, 220, (299, 120)),  # classes agree up to 120
    (P300, P300 + [7] * 5, 299, (299, 299)),  # the same prompt again: all cached
    (P300[:60], P300[:59], 200, (0, 0)),  # a short prompt after a big one: classes differ from token 0
    (list(range(PREFILL_BATCH + 20)), [], 0, (PREFILL_BATCH, 0)),  # empty-cache prefill: 512 big, then 19 small
], ids=["short", "fresh", "shared-250", "shared-120", "repeat", "short-after-big", "long"])
def test_prefill_classes_follow_an_empty_cache_prefill(prompt, held, held_big, expected):
    assert prefill_classes(prompt, held, held_big) == expected


def test_server_max_batch_streams_concurrent_requests_equal_to_serial_and_refuses_past_seq_ctx(cpp):
    """``create_app(max_batch=2)``: three concurrent requests (two streamed) on two slots all answer their serial
    answer with valid calls; a prompt past one sequence's KV cache gets 400 naming ``messages``."""
    import openai

    from agent.demo_tools import TOOLS as DEMO
    from agent.engine import EngineConfig, LocalEngine
    from agent.remote import collect_stream
    from agent.server import ServerThread, create_app
    from schemas import ToolRegistry

    registry = ToolRegistry(DEMO)
    tools = [t.to_openai() for t in registry]
    config = EngineConfig(max_string_length=16, max_decimals=4, max_new_tokens=96)
    asks = ["What's the weather in Oslo?", "What is 3 plus 9?", "Convert 2 km to m."]
    serial = LocalEngine(Generator(cpp))
    expected = []
    for ask in asks:
        serial.generator.new_target().reset()
        turn = serial.turn([{"role": "user", "content": ask}], list(registry), "required", config=config)
        assert turn.calls, (ask, turn.stop_reason, turn.text)
        expected.append([(c["name"], c["arguments"]) for c in turn.calls])
    engine = LocalEngine(Generator(cpp))
    app = create_app(engine, model_name="m", config=config, max_batch=2, seq_ctx=1024)
    assert engine.context_length == engine.generator.batcher.seq_ctx
    with ServerThread(app) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

        def ask(i: int):
            kw = dict(model="m", messages=[{"role": "user", "content": asks[i]}], tools=tools, tool_choice="required")
            if i == 1:
                m = client.chat.completions.create(**kw).choices[0].message
                return [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls]
            _, calls, finish, _ = collect_stream(client.chat.completions.create(stream=True, **kw))
            assert finish == "tool_calls"
            return [(c["name"], json.loads(c["arguments"])) for c in calls]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, range(3)))
        for calls, want in zip(got, expected):
            assert calls == want
            for name, arguments in calls:
                registry.parse_call({"name": name, "arguments": arguments})  # raises if invalid
        assert engine.generator.batcher.max_sequences_seen == 2
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 1100}],
                                           tools=tools)
        assert e.value.body["param"] == "messages"


def test_the_models_end_stops_a_batched_sequence_where_it_stops_alone(cpp, questions, references):
    """``end_when`` (the model's end where the grammar forbids it: ``Generator.generate``) stops a sequence decoded
    with others at the token where it stops decoded alone; the others are untouched."""
    from constraints import regex_grammar

    gen = Generator(cpp)
    text = gen.tokenizer.apply_chat_template([{"role": "user", "content": "Reply with yes or no: is the sky blue?"}],
                                             add_generation_prompt=True, tokenize=False)
    ids = gen.tokenizer.encode(text, add_special_tokens=False)
    grammar = regex_grammar("[a-zA-Z ,.!]{20,60}")  # the model ends after "No." (3 tokens); the grammar forbids it
    asked = []

    def end_when(text: str) -> bool:
        asked.append(text)
        return True

    gen.new_target().reset()
    ref = gen.generate(ids, grammar, drafter="lookup", max_new_tokens=40, end_when=end_when)
    assert ref.stop_reason == "masked_end" and len(asked) == 1 and ref.text == asked[0] and len(ref.tokens) < 20
    gen.enable_batching(3, seq_ctx=1024)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        others = [pool.submit(lambda r: decode_bfcl(gen, r, "lookup", max_new_tokens=64)[1], row)
                  for row in questions[:2]]
        out = gen.generate(ids, grammar, drafter="lookup", max_new_tokens=40, end_when=end_when)
        others = [f.result() for f in others]
    assert out.stop_reason == "masked_end" and out.tokens == ref.tokens and asked[1] == asked[0]
    assert [o.tokens for o in others] == [r.tokens for r in references[:2]]


def test_a_prompt_that_shares_little_keeps_another_prompts_cache(cpp):
    """A 150-token prompt, then an unrelated short one, then the first again, one at a time through the scheduler:
    the short one takes an empty slot (not the one holding the long prompt), and when it runs alone on seq 0 the
    long prompt's cache moves aside instead of being overwritten; the long prompt's second run reuses all of it
    (a helper saw it prefilled anew after every unrelated request: 4.1 s instead of 1.0 s on Qwen)."""
    from constraints import regex_grammar

    gen = Generator(cpp)
    gen.enable_batching(4, seq_ctx=1024)
    long_prompt = gen.tokenizer.encode("Once upon a time there was a dragon who lived in a cave. " * 10)
    short = gen.tokenizer.encode("The weather today is")
    grammar = regex_grammar(r"[a-z ]{1,24}")
    first = gen.generate(long_prompt, grammar, drafter="none", max_new_tokens=6)
    for prompt in (short, gen.tokenizer.encode("Name a colour:")):
        gen.generate(prompt, grammar, drafter="none", max_new_tokens=6)
        again = gen.generate(long_prompt, grammar, drafter="none", max_new_tokens=6)
        assert again.stats.prompt_tokens_cached >= len(long_prompt) - 1 and again.tokens == first.tokens
