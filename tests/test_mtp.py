"""decoding/mtp.py and scripts/train_mtp.py: head shapes, weight sharing, identity, training, checkpoint checks."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from constraints import allowed_tokens, json_schema_grammar
from decoding import Generator, LoadedModel
from decoding import CausalLM
from decoding.mtp import MTPDrafter, MTPError, MTPHead, load_head, save_head, target_sha256
from decoding.speculative import speculative_decode

from conftest import ROOT, tiny_llama
from helpers import PROMPTS, random_schema

sys.path.insert(0, str(ROOT / "scripts"))
import train_mtp  # noqa: E402


@pytest.fixture(scope="module")
def head(tiny_target):
    torch.manual_seed(0)
    return MTPHead(tiny_target.model).eval()


def test_head_shapes_and_shared_frozen_embedding_and_lm_head(tiny_target, head):
    d = tiny_target.model.config.hidden_size
    assert head.proj.weight.shape == (d, 2 * d)
    names = dict(head.named_parameters())
    assert all(p.shape[0] != tiny_target.vocab_size for p in names.values())  # no copy of embedding / LM head
    assert not any("embed" in n and "norm" not in n for n in names)
    g = head(torch.randn(1, 3, d), torch.tensor([[5, 6, 7]]), torch.arange(3)[None])
    assert g.shape == (1, 3, d)
    assert head.logits(g).shape == (1, 3, tiny_target.vocab_size)
    ids = torch.tensor([3, 9])
    torch.testing.assert_close(head.logits(g, ids), head.logits(g)[..., ids])  # mask-sparse = gathered rows
    assert head.target.get_output_embeddings().weight.data_ptr() == tiny_target.model.lm_head.weight.data_ptr()
    same_layer = type(tiny_target.model.model.layers[0])
    assert isinstance(head.block, same_layer)


def test_head_cache_matches_full_sequence_forward(tiny_target, head):
    from transformers import DynamicCache

    d = tiny_target.model.config.hidden_size
    h, toks = torch.randn(1, 7, d), torch.randint(0, 100, (1, 7))
    full = head(h, toks, torch.arange(7)[None])
    cache = DynamicCache()
    a = head(h[:, :4], toks[:, :4], torch.arange(4)[None], cache)
    b = head(h[:, 4:], toks[:, 4:], torch.arange(4, 7)[None], cache)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_identity_mtp_vs_none_random_schemas(tiny_target, head, gamma):
    gen = Generator(tiny_target)
    gen._mtp_head = head
    tok = tiny_target.tokenizer
    drafted = 0
    for i in range(3):
        grammar = json_schema_grammar(random_schema(random.Random(10 * gamma + i)))
        prompt = tok.encode(PROMPTS[i], add_special_tokens=False)
        ref = gen.generate(prompt, grammar, drafter="none", max_new_tokens=60)
        for mode in ("mtp", "lookup_mtp"):
            spec = gen.generate(prompt, grammar, drafter=mode, max_new_tokens=60, num_draft_tokens=gamma)
            assert spec.tokens == ref.tokens, mode
            drafted += spec.stats.drafted
    assert drafted > 0


def test_training_script_five_steps_on_tiny_target_lowers_the_loss(tiny_target):
    tok = tiny_target.tokenizer
    seqs = [{"tokens": tok.encode("the weather in paris is sunny and warm today " * 4), "prompt_len": 6}]
    feats = train_mtp.featurize(tiny_target, seqs)
    head = MTPHead(tiny_target.model)
    before = float(train_mtp.head_loss(head, feats[0])[0].detach())
    losses = train_mtp.train_head(head, feats, max_steps=5, lr=3e-3)
    after = float(train_mtp.head_loss(head, feats[0])[0].detach())
    assert len(losses) == 5 and after < before


def test_head_block_is_the_targets_own_layer_class_qwen2_with_qkv_bias(smol_tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=smol_tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, initializer_range=0.5, eos_token_id=2)
    target = LoadedModel(Qwen2ForCausalLM(cfg).eval(), smol_tokenizer, "tiny-qwen2", None, torch.device("cpu"),
                         torch.float32)
    head = MTPHead(target.model).eval()
    assert isinstance(head.block, type(target.model.model.layers[0]))
    assert head.block.self_attn.q_proj.bias is not None  # a Llama layer here would drop Qwen2's q/k/v biases
    gen = Generator(target)
    gen._mtp_head = head
    grammar = json_schema_grammar(random_schema(random.Random(3)))
    prompt = smol_tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    ref = gen.generate(prompt, grammar, drafter="none", max_new_tokens=40)
    spec = gen.generate(prompt, grammar, drafter="mtp", max_new_tokens=40, num_draft_tokens=3)
    assert spec.tokens == ref.tokens and spec.stats.drafted > 0


def test_training_loss_covers_every_recurrent_depth_and_evaluation_reports_them(tiny_target):
    tok = tiny_target.tokenizer
    seqs = [{"tokens": tok.encode("call get_weather with the city paris and the unit celsius " * 3), "prompt_len": 8}]
    rec = train_mtp.featurize(tiny_target, seqs)[0]
    head = MTPHead(tiny_target.model)
    _, parts = train_mtp.head_loss(head, rec, depths=3)
    assert sorted(parts) == ["depth0", "depth1", "depth2"]
    res = train_mtp.evaluate(head.eval(), [rec], depths=3)
    n = len(rec["tokens"]) - 2 - (8 - 2)  # answer positions with a label two ahead
    assert len(res["free"]) == 3 and res["positions_free"] == n and len(res["samples"]) == 3 * n


def test_depth0_evaluation_is_the_drafters_first_proposal(tiny_target):
    """Training/validation and drafting feed the head the same way: after the prompt is observed, the drafter's
    first proposal (from h_{P-2} and x_{P-1}) is the head's depth-0 prediction at that position."""
    torch.manual_seed(3)
    head = MTPHead(tiny_target.model).eval()
    tok = tiny_target.tokenizer
    ids = tok.encode("the weather in paris is sunny and warm today", add_special_tokens=False)
    rec = train_mtp.featurize(tiny_target, [{"tokens": ids, "prompt_len": len(ids) - 1}])[0]
    from decoding.sampling import SamplingParams

    drafter = MTPDrafter(head, sparse_limit=0)
    _, h = CausalLM(tiny_target).forward(ids[:-1], hidden=True)
    drafter.observe(h, ids[1:], 0)
    row = torch.full((1, (tiny_target.vocab_size + 31) // 32), -1, dtype=torch.int32)[0]  # everything allowed
    proposal, _ = drafter.propose(ids, None, row, SamplingParams(), None)
    with torch.inference_mode():
        g = head(rec["hidden"][None, :-1].float(), rec["tokens"][None, 1:].long(), torch.arange(len(ids) - 1)[None])
    assert proposal == int(head.logits(g[0, -1]).argmax())


def test_confidence_stop_ends_windows_and_keeps_greedy_identity(tiny_target):
    torch.manual_seed(0)
    gen = Generator(tiny_target)
    tok = tiny_target.tokenizer
    grammar = json_schema_grammar(random_schema(random.Random(7)))
    prompt = tok.encode(PROMPTS[0], add_special_tokens=False)
    ref = gen.generate(prompt, grammar, drafter="none", max_new_tokens=60)
    drafted = {}
    for threshold in (0.0, 1.0):  # 1.0: a free token is never drafted with certainty under a >1-token mask
        gen._mtp_head = MTPHead(tiny_target.model, min_confidence=threshold).eval()
        res = gen.generate(prompt, grammar, drafter="mtp", max_new_tokens=60, num_draft_tokens=4)
        assert res.tokens == ref.tokens
        drafted[threshold] = res.stats.drafted
    assert drafted[0.0] > 0 and drafted[1.0] == 0


def test_min_confidence_is_chosen_where_drafting_pays():
    # confident drafts are right, unsure ones wrong: the threshold lands between them
    samples = [(0, 0.9, True)] * 30 + [(0, 0.6, True)] * 5 + [(1, 0.2, False)] * 40 + [(1, 0.1, True)] * 2
    threshold, kept = train_mtp.choose_min_confidence(samples, draft_cost=0.15)
    assert 0.2 < threshold <= 0.6 and kept["kept_agreement"] == 1.0
    assert train_mtp.choose_min_confidence([(0, 0.5, True)] * 3, 0.15)[0] == 0.0  # all pay: never stop


def test_depth_stop_drafts_only_near_the_targets_own_state_and_keeps_identity(tiny_target):
    gen = Generator(tiny_target)
    tok = tiny_target.tokenizer
    depths = {None: [], 1: []}
    for i, max_depth in [(i, m) for i in range(4) for m in (None, 1)]:
        grammar = json_schema_grammar(random_schema(random.Random(11 + i)))
        prompt = tok.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)
        ref = gen.generate(prompt, grammar, drafter="none", max_new_tokens=60)
        torch.manual_seed(0)
        head = MTPHead(tiny_target.model, max_depth=max_depth).eval()
        seen = depths[max_depth]

        class Recording(MTPDrafter):
            def propose(self, tokens, state, row, sampling, generator):
                out = super().propose(tokens, state, row, sampling, generator)
                if out is not None:
                    seen.append(len(tokens) - 2 - (self.known - 1))  # stand-ins before the drafted token
                return out

        res = speculative_decode(CausalLM(tiny_target), prompt, gen.new_state(grammar), Recording(head),
                                 num_draft_tokens=4, max_new_tokens=60)
        assert res.tokens == ref.tokens
    assert max(depths[None]) > 1 and depths[1] and set(depths[1]) <= {0, 1}
    assert train_mtp.choose_max_depth([0.6, 0.5, 0.3, 0.2, 0.4], draft_cost=0.15, step_cost=0.02) == 2
    assert train_mtp.choose_max_depth([0.1, 0.5], draft_cost=0.15, step_cost=0.02) is None


def test_draft_vocabulary_limits_proposals_to_candidates_keeps_identity_and_round_trips(tiny_target, tmp_path):
    gen = Generator(tiny_target)
    tok = tiny_target.tokenizer
    torch.manual_seed(0)
    head = MTPHead(tiny_target.model).eval()
    head.draft_vocab = torch.arange(30, 3000)
    gen._mtp_head = head
    proposed, drafted = [], 0
    for i in range(3):
        grammar = json_schema_grammar(random_schema(random.Random(30 + i)))
        prompt = tok.encode(PROMPTS[i], add_special_tokens=False)
        ref = gen.generate(prompt, grammar, drafter="none", max_new_tokens=60)

        class Recording(MTPDrafter):
            def propose(self, tokens, state, row, sampling, generator):
                out = super().propose(tokens, state, row, sampling, generator)
                if out is not None and int(allowed_tokens(row, tiny_target.vocab_size).numel()) > self.sparse_limit:
                    proposed.append((out[0], set(tokens)))  # the prompt's and the output's tokens are candidates
                return out

        res = speculative_decode(CausalLM(tiny_target), prompt, gen.new_state(grammar),
                                 Recording(head, sparse_limit=8), num_draft_tokens=4, max_new_tokens=60)
        assert res.tokens == ref.tokens
        drafted += res.stats.drafted
    assert drafted and proposed and all(30 <= t < 3000 or t in p for t, p in proposed)
    save_head(head, tmp_path, {"target_sha256": target_sha256(tiny_target)})
    assert torch.equal(load_head(tiny_target, tmp_path)[0].draft_vocab, head.draft_vocab)


def test_output_tokens_become_candidates_as_they_are_accepted(tiny_target):
    torch.manual_seed(0)
    head = MTPHead(tiny_target.model).eval()
    head.draft_vocab = torch.arange(30, 40)
    tok = tiny_target.tokenizer
    prompt = tok.encode(PROMPTS[0], add_special_tokens=False)
    observed: list[int] = []

    class Recording(MTPDrafter):
        def observe(self, hidden, next_tokens, start):
            super().observe(hidden, next_tokens, start)
            if start:
                observed.extend(next_tokens)  # accepted drafts and bonus tokens (the final window is never fed)

    drafter = Recording(head, sparse_limit=8)
    res = speculative_decode(CausalLM(tiny_target), prompt, Generator(tiny_target).new_state(
        json_schema_grammar(random_schema(random.Random(5)))), drafter, num_draft_tokens=4, max_new_tokens=40)
    cand = set(drafter.cand.tolist())
    assert set(range(30, 40)) | set(prompt[1:]) <= cand  # the prompt's tokens after the first (fed to the head)
    assert observed == res.tokens[:len(observed)] and set(observed) - set(prompt) and set(observed) <= cand


def test_calibration_pauses_a_confidently_wrong_head_and_resumes_after_decay(tiny_target):
    head = MTPHead(tiny_target.model, min_confidence=0.3).eval()
    d = MTPDrafter(head, calibration_prior=2.0, calibration_decay=0.9)

    def draft(position, token, confidence):  # what propose does with a greedy proposal
        if d._stop(confidence):
            return False
        d.pending[position] = (token, confidence)
        return True

    assert d.calibration() == 1.0 and draft(10, 5, 0.9)
    draft(11, 6, 0.9)
    draft(12, 7, 0.9)
    d._judge([5, 9], start=9)  # 5 accepted at 10, bonus 9 at 11 rejects 6, 12 never judged
    assert d.hits == pytest.approx(0.9) and d.expected == pytest.approx(1.62) and not d.pending
    assert d.calibration() == pytest.approx((0.9 + 2) / (1.62 + 2))
    windows = 0
    while draft(100 + windows, 1, 0.9):  # confident drafts, every one rejected
        d._judge([2], start=99 + windows)
        windows += 1
    assert 2 <= windows <= 10 and d.stops == 1  # paused: 0.9 × calibration < 0.3
    waited = 0
    while not draft(200, 1, 0.9):  # windows without proposals: the counts decay, the prior wins again
        d._judge([], start=0)
        waited += 1
    assert 1 <= waited <= 30
    off = MTPDrafter(head, calibration_prior=float("inf"))
    off.expected = 50.0
    assert off.calibration() == 1.0 and not off._stop(0.31)
    with pytest.raises(ValueError, match="calibration"):
        MTPDrafter(head, calibration_decay=0.0)


def test_calibration_keeps_greedy_identity_and_never_drafts_more(tiny_target):
    tok = tiny_target.tokenizer
    gen = Generator(tiny_target)
    class Sharp(MTPHead):  # a random head made confident: confidently wrong, as on a loop it never saw
        def logits(self, g, token_ids=None):
            return 50.0 * super().logits(g, token_ids)

    torch.manual_seed(1)
    head = Sharp(tiny_target.model, min_confidence=0.3).eval()
    drafted = {}
    for prior in (float("inf"), 0.5):
        drafted[prior] = 0
        for i in range(3):
            grammar = json_schema_grammar(random_schema(random.Random(40 + i)))
            prompt = tok.encode(PROMPTS[i], add_special_tokens=False)
            ref = gen.generate(prompt, grammar, drafter="none", max_new_tokens=60)
            res = speculative_decode(CausalLM(tiny_target), prompt, gen.new_state(grammar),
                                     MTPDrafter(head, calibration_prior=prior), num_draft_tokens=4,
                                     max_new_tokens=60)
            assert res.tokens == ref.tokens
            drafted[prior] += res.stats.drafted
    assert 0 < drafted[0.5] < drafted[float("inf")]


def test_auto_drafter_is_the_cards_drafter_where_a_head_loads_else_lookup(tiny_target, head, tmp_path):
    from decoding import ChainDrafter, check_drafter

    tok = tiny_target.tokenizer
    prompt = tok.encode(PROMPTS[1], add_special_tokens=False)
    grammar = json_schema_grammar(random_schema(random.Random(3)))
    no_head = Generator(tiny_target)
    no_head.mtp_checkpoint = tmp_path / "missing"
    assert no_head.drafter == "auto" and no_head.resolve_drafter("auto") == "lookup"
    for named in ("lookup_mtp", "lookup-mtp", "draft_model", None):
        card = {"target_sha256": target_sha256(tiny_target)} | ({"drafter": named} if named else {})
        save_head(head, tmp_path / str(named), card)
        gen = Generator(tiny_target)
        gen.mtp_checkpoint = tmp_path / str(named)
        assert gen.resolve_drafter("mtp") == "mtp"
        if named in ("lookup-mtp", "draft_model"):  # a typo, or a drafter a card cannot supply: a clear error
            with pytest.raises(MTPError, match=f"names drafter '{named}'"):
                gen.resolve_drafter("auto")
        else:
            assert gen.resolve_drafter("auto") == (named or "lookup")
    drafter = gen.make_drafter("auto")  # the last card names no drafter: lookup
    assert isinstance(drafter, ChainDrafter) and not drafter.needs_hidden_states
    gen = Generator(tiny_target)
    gen.mtp_checkpoint = tmp_path / "lookup_mtp"
    drafter = gen.make_drafter("auto")
    assert any(isinstance(d, MTPDrafter) for d in drafter.drafters)
    ref = gen.generate(prompt, grammar, drafter="none", max_new_tokens=40)
    res = gen.generate(prompt, grammar, max_new_tokens=40)  # the generator's default: auto
    assert res.tokens == ref.tokens
    with pytest.raises(ValueError, match="auto"):
        check_drafter("automatic")


def test_card_sets_stand_in_and_confidence_stop_and_old_cards_keep_the_raw_stand_in(tiny_target, head, tmp_path):
    save_head(head, tmp_path, {"target_sha256": target_sha256(tiny_target)})
    old, _ = load_head(tiny_target, tmp_path)
    assert old.stand_in_kind == "raw" and old.min_confidence == 0.0
    g = torch.randn(2, tiny_target.model.config.hidden_size)
    torch.testing.assert_close(old.stand_in(g), g)
    save_head(head, tmp_path, {"target_sha256": target_sha256(tiny_target), "stand_in": "final_norm",
                               "min_confidence": 0.3})
    new, _ = load_head(tiny_target, tmp_path)
    assert new.min_confidence == 0.3
    torch.testing.assert_close(new.stand_in(g), tiny_target.model.model.norm(g))


def test_checkpoint_for_another_model_is_refused(tiny_target, tiny_draft, head, tmp_path):
    save_head(head, tmp_path, {"target_sha256": target_sha256(tiny_target)})
    load_head(tiny_target, tmp_path)  # the right target loads
    with pytest.raises(MTPError, match="refusing a mismatched head"):
        load_head(tiny_draft, tmp_path)
    with pytest.raises(FileNotFoundError, match="train one"):
        load_head(tiny_target, tmp_path / "nothing")


def test_jsonschemabench_items_read_first_halves_only_and_filter_schemas(tmp_path):
    import mtp_data

    small = {"type": "object", "properties": {"a": {"type": "integer"}}, "title": "Set a"}
    rows = [{"id": "s1", "subset": "Glaiveai2K", "schema": small},
            {"id": "s2", "subset": "Glaiveai2K", "schema": {"type": "array", "items": {"type": "string"}}},
            {"id": "s3", "subset": "Glaiveai2K", "schema": {"type": "object", "description": "x" * 400}}]
    (tmp_path / "Glaiveai2K.first_half.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "Glaiveai2K.second_half.jsonl").write_text(json.dumps({**rows[0], "id": "held"}) + "\n")
    items = mtp_data.jsonschemabench_items(tmp_path, max_schema_chars=300)
    assert [it["id"] for it in items] == ["jsonschemabench/Glaiveai2K/s1"]  # not the array, not the long one
    tool, message = mtp_data.schema_tool(items[0])
    assert tool.name == "s1" and tool.parameters["properties"] == small["properties"]
    assert message == {"role": "user", "content": "Set a"}


def test_float16_checkpoint_halves_the_file_and_loads_the_rounded_weights(tiny_target, head, tmp_path):
    save_head(head, tmp_path / "f32", {"target_sha256": target_sha256(tiny_target)})
    save_head(head, tmp_path / "f16", {"target_sha256": target_sha256(tiny_target)}, dtype=torch.float16)
    size = lambda d: (tmp_path / d / "mtp_head.safetensors").stat().st_size  # noqa: E731
    assert size("f16") < 0.6 * size("f32")
    loaded, _ = load_head(tiny_target, tmp_path / "f16")
    w = loaded.proj.weight
    assert w.dtype == head.proj.weight.dtype  # cast back to the target's dtype on load
    assert torch.equal(w, head.proj.weight.half().to(w.dtype)) and not torch.equal(w, head.proj.weight)


def test_card_names_a_drafter_per_backend_and_its_torch_choice_does_not_carry_to_llamacpp():
    from decoding.mtp import card_drafter

    old = {"drafter": "lookup_mtp"}  # chosen on the torch benchmark, before the head ran on llama.cpp
    assert card_drafter(old, "torch") == "lookup_mtp" and card_drafter(old, "llamacpp") is None
    both = old | {"drafters": {"llamacpp": "mtp"}}
    assert card_drafter(both, "llamacpp") == "mtp" and card_drafter(both, "torch") == "lookup_mtp"
    assert card_drafter({}, "torch") is None
