"""decoding/model.py: the dynamic and static KV caches (crop = rollback), and the vectorised sampled acceptance."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from constraints import ConstraintState, json_schema_grammar, llg_tokenizer
from decoding import CausalLM, ChainDrafter, DraftModelDrafter, PromptLookupDrafter, SchemaDrafter, decode, \
    speculative_decode
from decoding.model import default_cache
from decoding.sampling import SamplingParams
from decoding.speculative import Draft, accept_sampled

from helpers import PROMPTS, random_schema

SCHEMAS = [random_schema(random.Random(s)) for s in range(3)]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_logits_after_crop_and_reforward_equal_logits_from_scratch(tiny_target, cache):
    torch.manual_seed(0)
    seq = torch.randint(0, tiny_target.vocab_size, (300,)).tolist()
    scratch = tiny_target.model(torch.tensor([seq])).logits[0].float()
    lm = CausalLM(tiny_target, cache=cache)
    lm.forward(seq[:20])
    lm.forward([7, 8, 9, 10, 11])  # a rejected window: rolled back below
    lm.crop(20)
    assert lm.length == 20
    logits, _ = lm.forward(seq[20:24])
    torch.testing.assert_close(logits, scratch[20:24], atol=1e-4, rtol=1e-4)
    lm.crop(22)  # roll back into the last forward, then run past a static cache's first capacity (256)
    logits, _ = lm.forward(seq[22:300])
    assert lm.length == 300
    torch.testing.assert_close(logits, scratch[22:300], atol=1e-4, rtol=1e-4)
    lm.reset()
    logits, _ = lm.forward(seq[:5])
    torch.testing.assert_close(logits, scratch[:5], atol=1e-4, rtol=1e-4)


def test_static_cache_crop_moves_the_length_only_and_grows_by_doubling(tiny_target):
    lm = CausalLM(tiny_target, cache="static", max_length=100)
    lm.forward(list(range(3, 50)))
    assert lm.capacity == 256  # the first capacity: max(needed, max_length) rounded up to 256
    keys = lm.cache.layers[0].keys
    lm.crop(10)  # O(1): the buffers stay, the stale entries are overwritten by the next forward
    assert lm.cache.layers[0].keys is keys and lm.length == 10
    lm.forward(list(range(3, 260)))
    assert lm.capacity == 512 and lm.length == 267


def test_unknown_cache_and_crop_past_the_length_are_refused(tiny_target):
    with pytest.raises(ValueError, match="unknown KV cache 'paged'"):
        CausalLM(tiny_target, cache="paged")
    lm = CausalLM(tiny_target, cache="static")
    lm.forward([5, 6, 7])
    with pytest.raises(ValueError, match="cannot crop the KV cache to 4: it holds 3"):
        lm.crop(4)


def test_default_cache_is_static_on_cuda_only():
    assert default_cache("cpu") == "dynamic" and default_cache("cuda:0") == "static"


@pytest.mark.parametrize("kind", ["forced", "lookup", "draft_model"])
def test_static_cache_speculative_greedy_is_token_identical_to_dynamic_decode(tiny_target, tiny_draft, kind):
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    for i, schema in enumerate(SCHEMAS):
        grammar = json_schema_grammar(schema)
        prompt = tok.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)
        ref = decode(CausalLM(tiny_target, cache="dynamic"), prompt, ConstraintState(llt, grammar),
                     max_new_tokens=60)
        drafter = {"forced": lambda: None,
                   "lookup": lambda: ChainDrafter([SchemaDrafter(), PromptLookupDrafter()]),
                   "draft_model": lambda: DraftModelDrafter(CausalLM(tiny_draft, cache="static"))}[kind]()
        spec = speculative_decode(CausalLM(tiny_target, cache="static"), prompt, ConstraintState(llt, grammar),
                                  drafter, num_draft_tokens=1 + i * 3, max_new_tokens=60)
        assert spec.tokens == ref.tokens, (kind, i)
        assert spec.stop_reason == ref.stop_reason


# -- accept_sampled: Leviathan et al. 2023 Alg. 1, vectorised -------------------------------------------------------
def _exact_outcomes(p: torch.Tensor, draft: Draft) -> dict[tuple, float]:
    """P(num_accepted, bonus) of Alg. 1 on probabilities ``p [rows, V]``, token by token (the reference)."""
    out: dict[tuple, float] = {}
    reach = 1.0
    for j, d in enumerate(draft.tokens):
        q = draft.q[j]
        if draft.forced[j]:
            continue
        if q is None or not float(q[d]) > 0:
            q = torch.nn.functional.one_hot(torch.tensor(d), p.shape[1]).float()
        accept_prob = min(1.0, float(p[j, d]) / float(q[d]))
        residual = (p[j] - q).clamp_min(0.0)
        residual = residual / residual.sum() if float(residual.sum()) > 0 else p[j]
        for t in torch.nonzero(residual).flatten().tolist():
            out[(j, t)] = out.get((j, t), 0.0) + reach * (1 - accept_prob) * float(residual[t])
        reach *= accept_prob
    k = len(draft.tokens)
    for t in torch.nonzero(p[k]).flatten().tolist():
        out[(k, t)] = out.get((k, t), 0.0) + reach * float(p[k, t])
    return out


def test_vectorised_acceptance_has_the_exact_outcome_distribution():
    """Forced tokens always accepted; q None and q(d) = 0 verified as one-hot; q proper: min(1, p/q)."""
    torch.manual_seed(3)
    vocab = 6
    logits = torch.randn(5, vocab) * 1.5
    logits[1] = float("-inf")
    logits[1, 2] = 0.0  # row 1: a schema-forced token
    sampling = SamplingParams(temperature=1.0)
    q_proper = torch.softmax(torch.randn(vocab), -1)
    q_zero = torch.softmax(torch.randn(vocab), -1)
    q_zero[4] = 0.0
    draft = Draft(tokens=[1, 2, 4, 3], q=[q_proper, None, q_zero, None], forced=[False, True, False, False], rows=5)
    from decoding.sampling import probs_from_logits

    exact = _exact_outcomes(probs_from_logits(logits, sampling), draft)
    assert abs(sum(exact.values()) - 1) < 1e-5
    n = 6000
    gen = torch.Generator().manual_seed(0)
    counts = Counter(accept_sampled(logits.clone(), draft, sampling, gen) for _ in range(n))
    assert all(k in exact for k in counts), set(counts) - set(exact)  # forced never rejected, no forbidden bonus
    tv = 0.5 * sum(abs(exact.get(k, 0.0) - counts[k] / n) for k in set(exact) | set(counts))
    assert tv < 0.04, (tv, sorted(exact.items(), key=lambda kv: -kv[1])[:6], counts.most_common(6))


def test_vectorised_acceptance_without_a_bonus_row_returns_none():
    sampling = SamplingParams(temperature=1.0)
    logits = torch.zeros(2, 4)
    logits[:, 3] = float("-inf")
    draft = Draft(tokens=[1, 2], q=[None, None], forced=[True, True], rows=2)  # the grammar stopped after d2
    assert accept_sampled(logits, draft, sampling, torch.Generator().manual_seed(0)) == (2, None)
