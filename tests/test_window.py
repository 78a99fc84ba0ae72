"""decoding/window.py: the row-cost curve, the window rule, and that sizing windows by it changes the speed only
(greedy output token for token, sampled output in distribution). Tiny random models: seconds."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from constraints import ConstraintState, json_schema_grammar, llg_tokenizer, regex_grammar
from decoding import CausalLM, Generator, SamplingParams, decode, speculative_decode
from decoding.stats import DecodeStats
from decoding.window import RowCost, WindowPolicy

from helpers import PROMPTS, FixedDrafter, char_model, exact_distribution, loaded_model, random_schema

STEEP = RowCost((1, 2, 3, 4, 8), (1.0, 1.7, 2.5, 2.5, 5.0))  # the 2-core EPYC's shape: 3 rows cost what 4 do
FLAT = RowCost((1, 32), (1.0, 1.0))  # a GPU-like verify: rows are free


def test_row_cost_interpolates_extrapolates_and_never_decreases():
    c = RowCost((1, 2, 4, 8), (1.0, 1.5, 2.6, 2.4), 30.0)
    assert c(1) == 1.0 and c(0) == 1.0 and c(2) == 1.5
    assert c(3) == pytest.approx(2.05)
    assert c(8) == 2.6  # a measured dip is noise: more rows never cost less
    assert c(12) >= c(8)
    assert RowCost((1, 2), (1.0, 2.0))(5) == pytest.approx(5.0)  # extended with the last slope
    assert RowCost.from_dict(c.to_dict()) == c
    for rows, cost in (((2, 4), (1.0, 2.0)), ((1, 4, 2), (1.0, 2.0, 1.5)), ((1, 2), (1.0,))):
        with pytest.raises(ValueError, match="increasing rows from 1"):
            RowCost(rows, cost)


def test_free_rows_admit_every_token_and_costly_rows_admit_only_what_pays():
    stats = DecodeStats()
    free = WindowPolicy(FLAT, stats)
    assert all(free.admit(False, j) for j in range(8))
    linear = RowCost((1, 2), (1.0, 2.0))  # a row costs a whole forward: only certain tokens pay
    policy = WindowPolicy(linear, stats, prior=(1.0, 2.0))
    assert not policy.admit(False, 0)  # acceptance 0.5 cannot pay for a forward
    policy.start()
    assert all(policy.admit(True, 0) for _ in range(5))  # schema-forced tokens are accepted with certainty


def test_a_forced_run_is_kept_through_a_bump_in_the_curve():
    bump = RowCost((1, 2, 3, 4, 8), (1.0, 1.6, 2.6, 2.6, 5.0))  # row 3 alone does not pay; rows 3 and 4 together do
    policy = WindowPolicy(bump, DecodeStats())
    assert policy.admit(True, 0) and policy.rows == 2
    assert not policy.admit(True, 0, max_rows=3)  # judged alone (no room for row 4), row 3 is not worth it
    assert policy.admit(True, 0)  # judged with the run it starts, it is
    assert policy.admit(True, 0) and policy.rows == 4


def test_acceptance_is_read_from_the_sequences_history_with_a_prior():
    stats = DecodeStats()
    policy = WindowPolicy(STEEP, stats, prior=(2.0, 3.0))
    assert policy.acceptance(0) == pytest.approx(2 / 3)
    for _ in range(6):
        stats.record_window([False], 0)  # rejected at drafter position 0, six windows running
    assert policy.acceptance(0) == pytest.approx(2 / 9)
    policy.start()
    assert not policy.admit(False, 0)  # a drafter that keeps failing is not sent
    stats2 = DecodeStats()
    for _ in range(6):
        stats2.record_window([False], 1)
    assert WindowPolicy(STEEP, stats2).admit(False, 0)  # one that keeps succeeding is


def _gen_with_curve(tiny_target, curve: RowCost) -> Generator:
    """A Generator whose backend row reports ``curve`` as its measured row cost."""
    gen = Generator(tiny_target)
    assert gen.backend.row_cost is None and gen.row_cost() is None  # torch: a verify costs about one forward
    gen.backend = dataclasses.replace(gen.backend, row_cost=lambda loaded: curve)
    return gen


@pytest.mark.parametrize("drafter", ["forced", "schema", "lookup"])
def test_windows_sized_by_a_steep_curve_keep_greedy_output_and_send_fewer_drafts(tiny_target, drafter):
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    gen = _gen_with_curve(tiny_target, STEEP)
    drafted = {"cost": 0, "fixed": 0}
    for i in range(6):
        grammar = json_schema_grammar(random_schema(random.Random(i)))
        prompt = tok.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)
        ref = decode(CausalLM(tiny_target), prompt, ConstraintState(llt, grammar), max_new_tokens=60, tokenizer=tok)
        for window in drafted:
            out = gen.generate(prompt, grammar, drafter=drafter, max_new_tokens=60, window=window)
            assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason, (window, ref.text, out.text)
            drafted[window] += out.stats.drafted + out.stats.forced
    assert gen.row_cost("fixed") is None and gen.row_cost() is STEEP
    assert drafted["cost"] <= drafted["fixed"]


def test_a_random_drafter_under_a_steep_curve_drafts_less_than_with_fixed_windows(tiny_target):
    """A drafter whose tokens are mostly rejected stops being sent once the sequence's history shows it."""
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    grammar = regex_grammar("[a-z ]{40,60}")
    prompt = tok.encode(PROMPTS[0], add_special_tokens=False)
    a = tok.encode("a", add_special_tokens=False)[0]
    runs = {}
    for curve in (None, STEEP):
        runs[curve] = speculative_decode(CausalLM(tiny_target), prompt, ConstraintState(llt, grammar),
                                         FixedDrafter(a), num_draft_tokens=4, max_new_tokens=50, row_cost=curve)
    assert runs[STEEP].tokens == runs[None].tokens
    assert runs[STEEP].stats.drafted < runs[None].stats.drafted


def test_unknown_window_is_refused(tiny_target):
    with pytest.raises(ValueError, match="unknown window 'adaptive'; choose one of cost, fixed"):
        Generator(tiny_target, window="adaptive")
    with pytest.raises(ValueError, match="unknown window"):
        Generator(tiny_target).generate([1, 2], regex_grammar("a"), window="auto")


SAMPLES = 600
TV_BOUND = 0.1  # as tests/test_sampling_paths.py: ~0.04-0.06 expected at 600 samples; a biased rule gives 0.2+


def test_sampled_output_keeps_the_constrained_distribution_when_windows_are_cut(char_tokenizer):
    """The rule decides before a token is drawn (history and forced-ness only), so cutting windows leaves the
    distribution of constrained sampling (Leviathan et al. 2023) as it is."""
    tok, llt = char_tokenizer
    vocab = len(tok.tokens)
    target = loaded_model(char_model(vocab, 11), "t")
    grammar = regex_grammar("[ab]{2,3}")
    prompt = tok("ab:")
    exact = exact_distribution(target.model, llt, grammar, prompt, SamplingParams(0.7, 0.8))
    curve = RowCost((1, 2, 3), (1.0, 1.55, 2.3))  # drafts pay only while this sequence's acceptance stays high
    counts: Counter = Counter()
    drafted = {None: 0, curve: 0}
    for seed in range(SAMPLES):
        for cost in drafted:
            res = speculative_decode(CausalLM(target), prompt, ConstraintState(llt, grammar),
                                     FixedDrafter(tok("a")[0]), num_draft_tokens=3, max_new_tokens=4, row_cost=cost,
                                     sampling=SamplingParams(0.7, 0.8, seed=seed))
            drafted[cost] += res.stats.drafted
        counts[tuple(res.tokens)] += 1  # the decode with the curve
    assert SAMPLES // 2 < drafted[curve] < drafted[None]  # the rule both sent drafts and cut windows
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(exact.get(k, 0.0) - counts[k] / SAMPLES) for k in keys)
    assert tv < TV_BOUND, (tv, sorted(exact.items(), key=lambda kv: -kv[1])[:5], counts.most_common(5))
