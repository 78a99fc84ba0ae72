"""The llama.cpp backend (decoding/llamacpp.py) on the real SmolLM2-135M GGUF (marked ``model``).

llama-cpp-python is installed by ``make setup`` (``make setup-llamacpp``), so these tests run in ``make test``.
"""
from __future__ import annotations

import pytest
import torch

from agent import Agent
from agent.formats.generic import parse_turn, render_prompt, turn_grammar
from bench.bfcl import load_questions
from bench.bfcl_dialect import tool_from_bfcl
from decoding import Generator, LlamaCppModel, ModelNotFoundError, SamplingParams, load_llamacpp
from decoding.drafters import DraftModelDrafter
from decoding.speculative import speculative_decode

from helpers import assert_identical_with_fewer_forwards, decode_bfcl
from test_model import BFCL_FIXTURE

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def cpp() -> LlamaCppModel:
    return load_llamacpp("smollm2", n_threads=1, n_ctx=2048)  # batch-invariant: see the test below


@pytest.fixture(scope="module")
def gen(cpp):
    return Generator(cpp)


@pytest.fixture(scope="module")
def questions():
    return load_questions("simple_python", BFCL_FIXTURE, limit=10)


MAX_NEW_TOKENS = 256


def _decode(gen, row, drafter, **kw):
    return decode_bfcl(gen, row, drafter, max_new_tokens=MAX_NEW_TOKENS, **kw)


@pytest.fixture(scope="module")
def references(gen, questions):
    return {row["id"]: _decode(gen, row, "none")[1] for row in questions}


def test_engine_is_llamacpp_with_the_gguf_vocabulary(gen, cpp):
    assert gen.engine == "llamacpp"
    assert cpp.vocab_size == 49152 and cpp.eos_token_id == gen.tokenizer.eos_token_id
    import llama_cpp

    text = 'get_weather(city="Zürich", days=3)\n{"a": [1, 2.5]}'
    ids = gen.tokenizer.encode(text, add_special_tokens=False)
    raw = text.encode()
    buf = (llama_cpp.llama_token * 256)()
    n = llama_cpp.llama_tokenize(cpp.vocab, raw, len(raw), buf, 256, False, False)
    assert list(buf[:n]) == ids  # llama.cpp's own tokenizer and the HF tokenizer read from the GGUF agree
    assert gen.llg_tokenizer.tokenize_str(text) == ids


def test_crop_then_forward_gives_the_logits_of_a_fresh_cache(cpp):
    lm = cpp.new_lm()
    lm.reset()
    prompt = list(range(100, 140))
    lm.forward(prompt, num_logits=1)
    first, _ = lm.forward([7, 8, 9, 10])
    assert first.shape == (4, cpp.vocab_size) and first.dtype == torch.float32 and lm.length == 44
    lm.crop(41)  # keep one of the four: a rejected draft of three
    assert lm.length == 41
    again, _ = lm.forward([8, 9, 10])
    assert torch.equal(again, first[1:])  # same rows, same batch shape: bit-identical
    lm.reset()
    fresh, _ = lm.forward(prompt + [7, 8, 9, 10], num_logits=3)
    assert torch.allclose(fresh, first[1:], atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="cannot crop"):
        lm.crop(lm.length + 1)


def test_bfcl_calls_parse_and_validate(gen, questions, references):
    for row in questions:
        res = references[row["id"]]
        assert not res.truncated, row["id"]
        calls, _ = parse_turn(res.text)
        tools = {fn["name"]: tool_from_bfcl(fn) for fn in row["function"]}
        assert len(calls) == 1
        tools[calls[0]["name"]].make_call(calls[0]["arguments"])  # raises if invalid


@pytest.mark.parametrize("drafter", ["forced", "schema", "lookup"])
def test_speculative_greedy_is_token_identical_to_one_token_per_forward(gen, questions, references, drafter):
    assert_identical_with_fewer_forwards(gen, questions, references, drafter, max_new_tokens=MAX_NEW_TOKENS)


def test_sampled_speculative_output_validates(gen, questions):
    # a budget every sampled call fits in (strings are capped at 200 characters): each output completes, and is
    # validated; none may pass by being cut off
    for row in questions[:3]:
        tools, res = decode_bfcl(gen, row, "lookup", sampling=SamplingParams(temperature=0.8, seed=1),
                                 max_new_tokens=4 * MAX_NEW_TOKENS)
        assert not res.truncated, (row["id"], len(res.tokens), res.text[-200:])
        calls, _ = parse_turn(res.text)
        assert calls and len(calls) == 1, (row["id"], res.text)
        tool = {t.name: t for t in tools}[calls[0]["name"]]
        tool.make_call(calls[0]["arguments"])  # raises if invalid


def test_agent_runs_tools_on_the_llamacpp_backend(cpp):
    from agent.demo_tools import TOOLS

    agent = Agent(Generator(cpp), TOOLS, max_steps=2)
    res = agent.run("What's the weather like in Tokyo right now?", tool_choice="required", max_new_tokens=96)
    assert res.tool_calls and res.tool_calls[0].call.name == "get_weather"
    assert res.tool_calls[0].result["city"].lower() == "tokyo"
    assert res.final_answer
    factory, args, kwargs = agent.engine.spec()  # rebuilt from the model spec it was loaded from (ctypes handles do
    assert kwargs["backend"] == "llamacpp" and args[0] == "smollm2"  # not pickle; a re-quantised alias stays itself)


@pytest.fixture(scope="module")
def gen_draft(cpp):
    """SmolLM2 drafting for itself on llama.cpp (loaded beside the target: one thread, the same context size), so in
    the identity configuration every greedy draft token is the target's own argmax."""
    return Generator(cpp, draft_model="smollm2")


def test_draft_model_runs_on_the_llamacpp_backend_token_identical_with_every_draft_accepted(gen_draft, questions,
                                                                                            references):
    draft = gen_draft.draft_model()
    assert isinstance(draft, LlamaCppModel) and draft is not gen_draft.loaded
    assert (draft.n_threads, draft.n_ctx) == (gen_draft.loaded.n_threads, gen_draft.loaded.n_ctx)
    assert_identical_with_fewer_forwards(gen_draft, questions, references, "draft_model",
                                         max_new_tokens=MAX_NEW_TOKENS)
    drafted = accepted = 0
    for row in questions[:4]:  # the draft alone (no schema fast-forward, whose tokenisation the target may reject):
        tools = [tool_from_bfcl(fn) for fn in row["function"]]  # a stale row of its KV cache would show as a rejection
        ids = render_prompt(gen_draft.tokenizer, [m for turn in row["question"] for m in turn], tools)
        state = gen_draft.new_state(turn_grammar(tools, "required", parallel=False, max_string_length=200,
                                                 max_decimals=8))
        s = speculative_decode(gen_draft.new_target(), ids, state, DraftModelDrafter(gen_draft.new_draft_target()),
                               max_new_tokens=MAX_NEW_TOKENS, tokenizer=gen_draft.tokenizer).stats
        drafted, accepted = drafted + s.drafted, accepted + s.accepted
    assert drafted > 20 and accepted == drafted


def test_the_targets_own_loaded_model_as_draft_gets_a_cache_of_its_own(cpp, questions, references):
    """``Generator(cpp, draft_model=cpp)``: on llama.cpp a loaded model holds its KV cache (one context per thread),
    so the drafter wrote its tokens into the target's cache and the target verified after them (a helper's review:
    "She is a. She is a." for a story). The draft is now a copy loaded from the same file."""
    same = Generator(cpp, draft_model=cpp, window="fixed")  # every draft sent (cost windows may send none)
    draft = same.draft_model()
    assert isinstance(draft, LlamaCppModel) and draft is not cpp and draft.path == cpp.path
    for row in questions[:3]:
        assert _decode(same, row, "draft_model")[1].tokens == references[row["id"]].tokens


def test_draft_model_reuses_its_prefix_cache_from_decode_to_decode(gen_draft):
    drafter = DraftModelDrafter(gen_draft.new_draft_target())
    fed: list[int] = []
    forward = drafter.model.forward
    drafter.model.forward = lambda tokens, **kw: (fed.append(len(tokens)), forward(tokens, **kw))[1]
    prompt = gen_draft.tokenizer.encode("The weather in Paris is mild in spring and warm in summer. " * 4)
    state = gen_draft.new_state(turn_grammar([], "none", parallel=False))
    row = state.next_mask()
    drafter.reset()
    first = drafter.propose(prompt, state, row, SamplingParams(), None)
    drafter.reset()  # a new decode: the draft's context still holds the prompt
    again = drafter.propose(prompt + prompt[:2], state, row, SamplingParams(), None)
    drafter.model.reset()  # emptied: the same proposal from a full prefill
    drafter.reset()
    fresh = drafter.propose(prompt + prompt[:2], state, row, SamplingParams(), None)
    assert fed == [len(prompt), 2, len(prompt) + 2]
    assert first is not None and again == fresh


def test_sampled_draft_model_output_validates_on_the_llamacpp_backend(gen_draft, questions):
    row = questions[0]
    tools, res = decode_bfcl(gen_draft, row, "draft_model", sampling=SamplingParams(temperature=0.8, seed=2),
                             max_new_tokens=4 * MAX_NEW_TOKENS, window="fixed")  # γ drafts whatever they cost
    assert not res.truncated and res.stats.drafted > 0
    calls, _ = parse_turn(res.text)
    assert calls and len(calls) == 1, res.text
    {t.name: t for t in tools}[calls[0]["name"]].make_call(calls[0]["arguments"])  # raises if invalid


def test_one_decode_gives_logits_and_the_hidden_states_the_lm_head_reads(cpp):
    lm = cpp.new_lm()
    lm.reset()
    prompt = list(range(100, 160))
    plain, none = lm.forward(prompt, num_logits=3)
    lm.reset()
    logits, hidden = lm.forward(prompt, num_logits=3, hidden=True)
    assert none is None and torch.equal(logits, plain)  # asking for the states changes no logit
    assert hidden.shape == (60, 576) and hidden.dtype == torch.float32
    shared = cpp.shared_weights()  # de-quantised from the same GGUF
    head_logits = hidden[-3:] @ shared.get_output_embeddings().weight.T  # the state after the final norm
    assert torch.equal(head_logits.argmax(-1), logits.argmax(-1))
    assert (head_logits - logits).abs().max() < 0.02 * logits.abs().max()  # llama.cpp rounds activations to 8 bits
    lm.crop(40)  # rollback drops the states of the removed positions with them
    assert lm.reuse_prefix(prompt[:40] + [7], hidden=True) == 40
    assert torch.equal(lm.cached_hidden(40), hidden[:40])
    with pytest.raises(ValueError, match="41 positions asked for; 40 are kept"):
        lm.cached_hidden(41)


def test_shared_weights_equal_the_torch_backends_and_are_cached_on_disk(cpp):
    from decoding import gguf_weights, load_model

    torch_model = load_model("smollm2").model  # the torch backend de-quantises the same GGUF with transformers
    shared = cpp.shared_weights()
    assert torch.equal(shared.get_input_embeddings().weight, torch_model.get_input_embeddings().weight)
    assert torch.equal(shared.model.norm.weight, torch_model.model.norm.weight)
    assert shared.layer_class is type(torch_model.model.layers[0])
    gguf_weights._CACHE.clear()  # the next process reads the de-quantised copy, not the GGUF
    again = cpp.shared_weights()
    assert again is not shared and torch.equal(again.lm_head.weight, shared.lm_head.weight)


@pytest.mark.parametrize("drafter", ["mtp", "lookup_mtp"])
def test_mtp_drafters_run_on_the_llamacpp_backend_token_identical(gen, questions, references, drafter):
    """The shipped SmolLM2 head (trained on the torch backend's states of the same GGUF) drafts from llama.cpp's
    states; one thread on Q4_1 is batch-invariant, so the output is the reference's token for token. Fixed windows:
    on a CPU where a second row costs nearly a forward the cost rule would send no head draft at all."""
    assert_identical_with_fewer_forwards(gen, questions, references, drafter, max_new_tokens=MAX_NEW_TOKENS,
                                         window="fixed")
    drafted = accepted = 0
    for row in questions[:4]:
        _, res = _decode(gen, row, drafter, window="fixed")
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    assert accepted > 0.3 * drafted > 0  # the head's drafts are accepted, not noise


def test_mtp_prefix_cache_keeps_the_prompts_hidden_states(gen, questions):
    row = questions[0]
    _, first = _decode(gen, row, "mtp", window="fixed")
    _, again = _decode(gen, row, "mtp", window="fixed")  # same prompt: the prefix and its states from the cache
    assert again.stats.prompt_tokens_cached == again.stats.prompt_tokens - 1
    assert again.tokens == first.tokens and again.stats.drafted == first.stats.drafted


def test_mtp_is_refused_under_continuous_batching_and_auto_falls_back_to_lookup(cpp):
    gen = Generator(cpp)
    assert gen.resolve_drafter("auto") == "lookup"  # SmolLM2's card names lookup
    batched = Generator(load_llamacpp("smollm2", n_threads=1, n_ctx=1024))
    batched.enable_batching(2, seq_ctx=512)
    try:
        with pytest.raises(ValueError, match="the mtp drafter needs the target's hidden states, which continuous "
                                             "batching"):
            batched.generate([1, 2, 3], turn_grammar([], "none", parallel=False), drafter="mtp")
    finally:
        batched.batcher.close()


def test_bad_backend_arguments_are_refused():
    for kwargs in ({"backend": "vllm"}, {"engine": "vllm"}):  # engine= is the older name of backend=
        with pytest.raises(ValueError, match="unknown backend 'vllm'; choose one of torch, llamacpp"):
            Generator("smollm2", **kwargs)
    with pytest.raises(ValueError, match="device='cuda'"):
        Generator("smollm2", backend="llamacpp", device="cuda")
    with pytest.raises(ModelNotFoundError, match="loads GGUF files"):
        load_llamacpp("Qwen/Qwen2.5-0.5B-Instruct")


def test_prompt_longer_than_the_context_is_refused(cpp):
    from decoding import ContextLengthError

    gen = Generator(cpp)
    with pytest.raises(ContextLengthError, match="2048"):
        gen.generate([1] * 2048, turn_grammar([], "none", parallel=False), max_new_tokens=4)


@pytest.mark.parametrize("rows", [5, 33], ids=["5-rows", "33-rows"])
def test_verify_rows_equal_one_row_forwards_in_the_batch_invariant_setting(cpp1, rows):
    """One thread, no weight repacking (the identity configuration): a row's logits in a k-row verify batch are
    bit-identical to the same position fed alone — what makes speculative greedy token-identical on this engine —
    up to the largest verify the decoder sends (``max_window`` 32 drafts + the current token = 33 rows). Measured:
    with 2 threads or repacking they differ by up to ~1 logit and near-ties flip."""
    from decoding.speculative import speculative_decode
    import inspect

    assert rows <= inspect.signature(speculative_decode).parameters["max_window"].default + 1
    lm = cpp1.new_lm()
    lm.reset()
    prompt = list(range(300, 420))
    lm.forward(prompt, num_logits=1)
    window = [11, 2000, 345, 7, 999, *range(5000, 5028)][:rows]
    batched, _ = lm.forward(window)
    lm.crop(len(prompt))
    alone = torch.cat([lm.forward([t])[0] for t in window])
    assert torch.equal(batched, alone)


@pytest.fixture(scope="module")
def cpp1() -> LlamaCppModel:
    return load_llamacpp("smollm2", n_threads=1, n_ctx=1024)


def test_bench_runs_the_llamacpp_modes_side_by_side(tmp_path):
    import json

    from bench import run
    from conftest import FIXTURES

    rc = run.main(["--model", "smollm2", "--data-dir", str(FIXTURES), "--limit", "2", "--threads", "1",
                   "--modes", "llamacpp_unconstrained,llamacpp_constrained,llamacpp_lookup_constrained,"
                   "llamacpp_engine_lookup,llamacpp_engine_best",
                   "--max-new-tokens", "96", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    meta = data.pop("meta")
    assert not meta["skipped"]
    assert set(data) == {"constrained", "llamacpp_engine_constrained", "llamacpp_unconstrained", "llamacpp_constrained",
                         "llamacpp_lookup_constrained", "llamacpp_engine_lookup", "llamacpp_engine_best"}
    for mode in ("llamacpp_engine_constrained", "llamacpp_engine_lookup", "llamacpp_engine_best"):
        assert data[mode]["valid"] == 1.0 and data[mode]["identical_to_constrained"] == 1.0, mode
    assert data["llamacpp_engine_lookup"]["tokens_per_forward"] > 1.0
    # llama.cpp's own speculative decoding (prompt lookup) under its grammar: valid, more than a token per eval
    assert data["llamacpp_lookup_constrained"]["valid"] == 1.0
    assert data["llamacpp_lookup_constrained"]["tokens_per_forward"] > 1.0
    assert {"llamacpp_engine_best / llamacpp_constrained", "llamacpp_engine_best / llamacpp_unconstrained",
            "llamacpp_engine_best / llamacpp_lookup_constrained"} <= set(meta["ratios"])


def _prefill_then_next_logits(lm, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """What ``decoding.decoder.prefill`` and the first forward do: (prompt tokens reused, float32 [V] logits)."""
    n = lm.reuse_prefix(prompt)
    if len(prompt) - 1 > n:
        lm.forward(prompt[n:-1], num_logits=1)
    return n, lm.forward(prompt[-1:])[0][0]


@pytest.mark.parametrize("length", [40, 100, 560])  # 560: 512 tokens big-class, a tail of 47 small (prefill_classes)
def test_a_reused_prefix_gives_the_logits_of_an_empty_cache_prefill(cpp, monkeypatch, length):
    """In the identity configuration a prompt's next-token logits do not depend on what its prefix-cache slot
    held: another prompt sharing 7, half or all but 10 of its tokens (shorter or longer than it, prefilled in
    one decode or several), or this prompt's own beginning followed by decoded tokens (a conversation's next turn).
    llama.cpp's CPU flash attention computes a row in one of two ways (fewer or more than 63 rows of its sequence
    in the decode: :data:`decoding.llamacpp.SMALL_UBATCH`); before, a prefix kept from a slot whose tokens were
    computed the other way changed the logits by up to 1.8 and a greedy answer with them (SmolLM2, one thread)."""
    from decoding import llamacpp

    assert cpp.batch_invariant
    monkeypatch.setattr(llamacpp, "SLOT_SIMILARITY", 0.0)  # keep any shared prefix (what a busy server does)
    prompt = [100 + (37 * i) % 4000 for i in range(length)]
    lm = cpp.new_lm()
    lm.reset()
    assert _prefill_then_next_logits(lm, prompt)[0] == 0
    lm.reset()
    fresh = _prefill_then_next_logits(lm, prompt)[1]
    for shared in (7, length // 2, length - 10):
        for held in (shared + 20, shared + 70) + ((700,) if shared == 7 else ()):
            lm.reset()
            lm.forward(prompt[:shared] + [4100 + i for i in range(held - shared)], num_logits=1)
            kept, logits = _prefill_then_next_logits(lm, prompt)
            assert kept <= shared and torch.equal(logits, fresh), (shared, held, kept)
    lm.reset()
    head = prompt[:length - 30]
    _prefill_then_next_logits(lm, head)
    for t in range(20):  # decoded one token at a time, as one token per forward does
        lm.forward([5000 + t])
    kept, logits = _prefill_then_next_logits(lm, head + [5000 + t for t in range(20)] + prompt[length - 10:])
    lm.reset()
    again = _prefill_then_next_logits(lm, head + [5000 + t for t in range(20)] + prompt[length - 10:])
    assert torch.equal(logits, again[1]) and again[0] == 0


def test_a_big_decode_after_small_ones_is_not_reused_as_small(cpp, monkeypatch):
    """A slot fed 10 tokens, then 79 in one decode (big-class rows past small ones): a 50-token prompt sharing 49 of
    them is prefilled all small from an empty cache, so only the first 10 may be kept."""
    from decoding import llamacpp

    monkeypatch.setattr(llamacpp, "SLOT_SIMILARITY", 0.0)
    prompt = [100 + (37 * i) % 4000 for i in range(50)]
    lm = cpp.new_lm()
    lm.reset()
    fresh = _prefill_then_next_logits(lm, prompt)[1]
    lm.reset()
    lm.forward(prompt[:10], num_logits=1)
    lm.forward(prompt[10:49] + [4100 + i for i in range(40)], num_logits=1)
    kept, logits = _prefill_then_next_logits(lm, prompt)
    assert kept == 10 and torch.equal(logits, fresh)


def test_prefix_cache_prefills_only_new_tokens_and_changes_no_token(cpp, questions):
    """A decode keeps the longest prefix of its prompt still in one of the thread's cached slots, and its tokens
    equal a decode from an empty cache. A prompt sharing under half of a slot (another question's tools) takes the
    least recent slot, so alternating prompts each keep their whole prefix (one slot evicted the other before)."""
    from agent.formats.generic import render_prompt

    gen = Generator(cpp)
    a, b = questions[0], questions[1]

    def prompt(row):
        tools = [tool_from_bfcl(fn) for fn in row["function"]]
        return render_prompt(gen.tokenizer, [m for t in row["question"] for m in t], tools), \
            turn_grammar(tools, "required", parallel=False, max_string_length=200, max_decimals=8)

    (ids_a, g_a), (ids_b, g_b) = prompt(a), prompt(b)
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    assert shared > 20  # the chat template's system header is common to both
    assert shared < len(ids_b) / 2
    for drafter in ("none", "lookup"):
        cpp.new_lm().reset()
        fresh = gen.generate(ids_b, g_b, drafter=drafter, max_new_tokens=64)
        assert fresh.stats.prompt_tokens_cached == 0
        first_a = gen.generate(ids_a, g_a, drafter=drafter, max_new_tokens=64)
        assert first_a.stats.prompt_tokens_cached == 0  # the other (empty) slot: b's stays whole
        after_a = gen.generate(ids_b, g_b, drafter=drafter, max_new_tokens=64)
        assert after_a.stats.prompt_tokens_cached == len(ids_b) - 1  # the last prompt token is always fed
        again_a = gen.generate(ids_a, g_a, drafter=drafter, max_new_tokens=64)
        assert again_a.stats.prompt_tokens_cached == len(ids_a) - 1
        assert fresh.tokens == after_a.tokens and first_a.tokens == again_a.tokens, drafter
        assert fresh.stats.prompt_tokens == after_a.stats.prompt_tokens == len(ids_b)
    c = prompt(questions[2])[0]  # a third prompt takes the least recently used slot (b's), keeping its header
    lm = cpp.new_lm()
    assert lm.reuse_prefix(c) == next(i for i, (x, y) in enumerate(zip(ids_b, c)) if x != y)
    assert lm.reuse_prefix(ids_a) == len(ids_a) - 1  # a's slot is untouched


def test_requantised_weights_load_by_tag_with_the_shipped_tokenizer_and_stay_batch_invariant(cpp1):
    """``alias:q8_0``: llama.cpp's quantizer re-quantises the shipped GGUF once (cached); same tokenizer, other
    weights (another sha256), and at one thread rows stay bit-identical up to the largest verify (33 rows)."""
    q8 = load_llamacpp("smollm2:q8_0", n_threads=1, n_ctx=1024)
    assert q8.sha256 != cpp1.sha256 and q8.path.name.endswith(".q8_0.gguf") and "Q8_0" in q8.name
    assert q8.tokenizer.get_vocab() == cpp1.tokenizer.get_vocab()
    lm = q8.new_lm()
    lm.reset()
    lm.forward(list(range(300, 420)), num_logits=1)
    window = [11, 2000, 345, 7, 999, *range(5000, 5028)]
    batched, _ = lm.forward(window)
    lm.crop(120)
    alone = torch.cat([lm.forward([t])[0] for t in window])
    assert torch.equal(batched, alone)
    shipped = cpp1.new_lm()
    shipped.reset()
    assert not torch.equal(batched, shipped.forward(list(range(300, 420)) + window, num_logits=33)[0])


def test_an_alias_loads_with_its_chosen_weights_and_shipped_names_the_file_as_shipped(cpp1):
    """A bare alias names the weights its ``ModelSource.llamacpp_weights`` chose (the default 0.5B: Q8_0),
    ``alias:shipped`` the GGUF as shipped; a re-quantised load keeps the shipped file's sha256 as the key of the
    model's MTP head."""
    from decoding.llamacpp import split_weights
    from decoding.mtp import target_sha256

    assert split_weights("qwen2.5-coder-0.5b") == ("qwen2.5-coder-0.5b", "q8_0")
    assert split_weights("qwen2.5-coder-0.5b:shipped") == ("qwen2.5-coder-0.5b", None)
    assert split_weights("qwen2.5-coder-0.5b:q4_0") == ("qwen2.5-coder-0.5b", "q4_0")
    assert split_weights("qwen2.5-coder-1.5b") == ("qwen2.5-coder-1.5b", None)
    assert split_weights("smollm2") == ("smollm2", None) and split_weights("x.gguf") == ("x.gguf", None)
    shipped = load_llamacpp("smollm2:shipped", n_threads=1, n_ctx=256)
    assert (shipped.path, shipped.sha256) == (cpp1.path, cpp1.sha256) and target_sha256(shipped) == cpp1.sha256
    q8 = load_llamacpp("smollm2:q8_0", n_threads=1, n_ctx=256)
    assert q8.sha256 != cpp1.sha256 and target_sha256(q8) == cpp1.sha256
    from decoding.backends import BACKENDS
    assert BACKENDS["llamacpp"].portable(q8)[0] == "smollm2:q8_0"  # a Ray worker loads the same weights and key


def test_a_weight_tag_that_is_unknown_or_not_for_the_backend_is_named(cpp1):
    """``alias:q5_k``, ``alias:`` and a tag on the torch backend name the tag and the ones there are (they read
    "model not found" before); tags are case-insensitive, as Ollama's are."""
    from decoding import WeightTagError
    from decoding.llamacpp import split_weights
    from decoding.loader import resolve_model

    assert split_weights("qwen2.5-coder-0.5b:Q8_0") == ("qwen2.5-coder-0.5b", "q8_0")
    assert split_weights("smollm2:SHIPPED") == ("smollm2", None)
    for spec, tag in (("smollm2:q5_k", "'q5_k'"), ("smollm2:", "''")):
        with pytest.raises(WeightTagError, match=f"unknown weight tag {tag}.*smollm2:q8_0.*smollm2:shipped"):
            split_weights(spec)
        with pytest.raises(WeightTagError, match="unknown weight tag"):
            Generator(spec)  # the backend is chosen from the spec: the tag is named before anything loads
    with pytest.raises(WeightTagError, match="torch backend de-quantises the GGUF as shipped: use 'smollm2'"):
        resolve_model("smollm2:q8_0")
    with pytest.raises(WeightTagError, match="torch backend"):
        Generator("smollm2:q8_0", dtype="bfloat16")
    assert resolve_model("smollm2:shipped")[1] == resolve_model("smollm2")[1]


def test_first_loads_that_race_re_quantise_each_into_a_file_of_their_own(cpp1, monkeypatch, tmp_path, capsys):
    """Two threads loading ``smollm2:q8_0`` into an empty cache at once both get the same file and digest (a shared
    temporary name made one of them fail with FileNotFoundError); the first load says so on stderr."""
    import threading

    from decoding.llamacpp import gguf_of

    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path))
    results, errors = [], []

    def load():
        try:
            results.append(gguf_of("smollm2:q8_0"))
        except Exception as e:  # noqa: BLE001 -- the assertion names it
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 2 and results[0] == results[1]
    path, _, sha = results[0]
    assert path.parent == tmp_path / "gguf" and sha == (path.parent / (path.name + ".sha256")).read_text()
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == [path.name, path.name + ".sha256"]
    assert "re-quantising" in capsys.readouterr().err
    assert gguf_of("smollm2:q8_0") == results[0] and "re-quantising" not in capsys.readouterr().err  # cached


def test_an_unwritable_cache_is_named_with_the_variable_that_moves_it(cpp1, monkeypatch, tmp_path, capsys):
    from agent.__main__ import main
    from decoding import CacheNotWritableError
    from decoding.llamacpp import gguf_of

    cache = tmp_path / "not-a-directory"  # unwritable even for root (these machines run tests as root)
    cache.write_text("")
    monkeypatch.setenv("SPECAGENT_CACHE", str(cache))
    with pytest.raises(CacheNotWritableError, match=f"cannot create the model cache {cache}/gguf .*SPECAGENT_CACHE"):
        gguf_of("smollm2:q8_0")
    assert main(["demo", "--model", "smollm2:q8_0", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: cannot create the model cache" in err and "Traceback" not in err


def test_run_names_the_model_its_weights_backend_and_threads_on_stderr(cpp1, capsys):
    from agent.__main__ import main

    assert main(["run", "--model", "smollm2:q8_0", "--backend", "llamacpp", "--threads", "1", "--tools",
                 "examples.my_tools:TOOLS", "--max-new-tokens", "24", "Add 2 and 3"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("\n>>> Add 2 and 3") and "model:" not in out  # stdout: the run's own lines
    assert "model: SmolLM2-135M-Instruct" in err and "re-quantised to Q8_0" in err and "1 thread" in err


def test_rowcost_measures_the_shipped_file_of_an_alias_whose_default_weights_are_re_quantised(monkeypatch, capsys):
    import bench.rowcost as rowcost

    specs = []
    monkeypatch.setattr(rowcost, "measure", lambda spec, **kw: specs.append(spec) or {
        "ms_1_row": 1.0, "cost": {1: 1.0, 2: 1.5}, "max_abs_diff": {1: 0.0, 2: 0.0}})
    assert rowcost.main(["--model", "qwen2.5-coder-0.5b", "--weights", "shipped,q8_0", "--rows", "1,2"]) == 0
    assert specs == ["qwen2.5-coder-0.5b:shipped", "qwen2.5-coder-0.5b:q8_0"]
    assert "| shipped | 1 | off | 1.0 | 1.50× | bit-identical at every n |" in capsys.readouterr().out


def test_ctx_size_sizes_the_kv_cache_and_a_prompt_past_it_is_refused():
    from agent.__main__ import main
    from decoding import ContextLengthError

    small = Generator("smollm2", backend="llamacpp", threads=1, ctx_size=256)
    assert small.loaded.n_ctx == 256 and small.context_length == 256
    with pytest.raises(ContextLengthError, match="256"):
        small.generate([1] * 300, turn_grammar([], "none", parallel=False), max_new_tokens=4)
    with pytest.raises(ValueError, match="llama.cpp"):
        Generator("smollm2", backend="torch", ctx_size=256)
    agent = Agent("smollm2", backend="llamacpp", threads=1, ctx_size=512)
    assert agent.engine.generator.loaded.n_ctx == 512
    assert agent.engine.spec()[2]["ctx_size"] == 512  # travels to Ray workers and batch copies
    assert main(["demo", "--model", "smollm2", "--ctx-size", "1"]) == 2  # refused before anything loads


def test_batch_rowcost_times_batched_and_one_sequence_decodes():
    from bench.batch_rowcost import measure

    r = measure("smollm2", threads=1, sequences=3, prompt_tokens=40, repeat=1)
    assert r["ms_one_row_alone"] > 0
    assert [b["rows"] for b in r["batched"]] == [3, 6, 12]
    assert [b["rows"] for b in r["one_sequence"]] == [8, 32, 128]
    assert all(b["ms"] > 0 and b["ms_per_row"] == pytest.approx(b["ms"] / b["rows"], abs=0.05 / b["rows"] + 0.005)
               and b["share_of_one_row"] == pytest.approx(b["ms_per_row"] / r["ms_one_row_alone"], rel=0.05, abs=0.002)
               for b in r["batched"] + r["one_sequence"])


def test_row_cost_is_measured_once_per_machine_model_and_threads_and_read_back(monkeypatch, tmp_path):
    from decoding import llamacpp

    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path))
    loaded = load_llamacpp("smollm2", n_threads=1, n_ctx=512)
    calls = []
    real = llamacpp.calibrate_row_cost
    monkeypatch.setattr(llamacpp, "calibrate_row_cost", lambda m: calls.append(m) or real(m, repeat=1))
    cost = loaded.row_cost()
    assert calls == [loaded] and cost.rows == llamacpp.ROW_COST_ROWS and cost.cost[0] == 1.0
    assert cost.ms_1_row > 0 and cost(32) > cost(2) > 1.0  # more rows cost more: no row is free on a CPU
    again = load_llamacpp("smollm2", n_threads=1, n_ctx=512)  # a new load (a new process) reads the cache
    assert again.row_cost() == cost and len(calls) == 1
    assert len(list((tmp_path / "rowcost").glob("*.json"))) == 1
    two = load_llamacpp("smollm2", n_threads=2, n_ctx=512)  # other threads: another curve
    two.row_cost()
    assert len(calls) == 2 and len(list((tmp_path / "rowcost").glob("*.json"))) == 2


def test_bench_windows_runs_fixed_and_cost_side_by_side_with_identical_outputs(tmp_path, capsys):
    import json

    from bench import windows
    from conftest import FIXTURES

    out = tmp_path / "windows.json"
    assert windows.main(["--model", "smollm2", "--threads", "1", "--split", "dev", "--limit", "2", "--drafters",
                         "lookup", "--max-new-tokens", "48", "--out", str(out),
                         "--data-dir", str(FIXTURES)]) == 0
    report = json.loads(out.read_text())
    assert set(report["drafters"]) == {"lookup/fixed", "lookup/cost", "none/fixed"}
    assert all(r["identical_to_none"] == 1.0 for r in report["drafters"].values())  # windows change speed only
    assert report["drafters"]["lookup/cost"]["cost_vs_fixed"] > 0 and report["row_cost"]["rows"][0] == 1
    assert "| lookup | cost |" in capsys.readouterr().out


def test_llama_cpp_log_lines_warnings_and_errors_less_the_benign_load_note(capsys):
    """llama-cpp-python's level table predates ggml's renumbering (it printed warnings, hid errors): every load of
    the default model printed "control-looking token … was not control-type"; errors were never shown."""
    from decoding.llamacpp import _log_line

    for level, text in ((4, b"error: no room\n"), (5, b"  continued\n"), (2, b"info chatter\n"), (1, b"debug\n"),
                        (3, b"load: control-looking token: 128247 '</s>' was not control-type\n"),
                        (3, b"a warning\n"), (5, b"and its tail\n")):
        _log_line(level, text, None)
    assert capsys.readouterr().err == "error: no room\n  continued\na warning\nand its tail\n"
