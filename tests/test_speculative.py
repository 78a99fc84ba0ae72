"""decoding/speculative.py: greedy identity, sampling distribution, rollback properties, window edge cases."""
from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from constraints import ConstraintState, json_schema_grammar, lark_grammar, lark_json, llg_tokenizer
from decoding import CausalLM, Drafter, PromptLookupDrafter, decode, speculative_decode

from helpers import FIXED, PROMPTS, drafter_params, random_schema, registry_generator, speculative_sampling_tv

SCHEMAS = [random_schema(random.Random(s)) for s in range(5)]
FREE_TEXT_THEN_CALL = lark_grammar('start: /[a-z ]{0,12}/ "<tool_call>" '
                                   + lark_json(SCHEMAS[0], separators=(", ", ": ")) + ' "</tool_call>"')


@pytest.fixture(scope="module")
def gen(tiny_target, tiny_draft, tmp_path_factory):
    """Builds every row of decoding.DRAFTERS on the tiny target (a tiny draft model, a random MTP head)."""
    return registry_generator(tiny_target, tiny_draft, tmp_path_factory.mktemp("mtp"))


def _run_pair(target, grammar, prompt, drafter, gamma, max_new=80, **kw):
    tok = target.tokenizer
    llt = llg_tokenizer(tok, target.vocab_size)
    ref = decode(CausalLM(target), prompt, ConstraintState(llt, grammar), max_new_tokens=max_new, tokenizer=tok)
    spec = speculative_decode(CausalLM(target), prompt, ConstraintState(llt, grammar), drafter,
                              num_draft_tokens=gamma, max_new_tokens=max_new, tokenizer=tok, **kw)
    return ref, spec


@pytest.mark.parametrize("kind", drafter_params())
def test_greedy_identity_every_drafter_gamma_1_to_8_random_schemas(tiny_target, gen, kind):
    """Every row of the drafter table, built as the product builds it (``Generator.make_drafter``), gives the
    reference decode's tokens."""
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    cases = [(json_schema_grammar(s), i) for i, s in enumerate(SCHEMAS)] + [(FREE_TEXT_THEN_CALL, 9)]
    for gamma in range(1, 9):
        grammar, i = cases[gamma % len(cases)]
        prompt = tok.encode(PROMPTS[(i + gamma) % len(PROMPTS)], add_special_tokens=False)
        ref = decode(CausalLM(tiny_target), prompt, ConstraintState(llt, grammar), max_new_tokens=80, tokenizer=tok)
        spec = gen.generate(prompt, grammar, drafter=kind, num_draft_tokens=gamma, max_new_tokens=80)
        assert spec.tokens == ref.tokens, (kind, gamma, ref.text, spec.text)
        assert spec.stop_reason == ref.stop_reason
        assert spec.stats.target_forwards <= ref.stats.target_forwards


def test_greedy_identity_all_schemas_with_adaptive_gamma(tiny_target, gen):
    tok = tiny_target.tokenizer
    for i, schema in enumerate(SCHEMAS):
        prompt = tok.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)
        ref, spec = _run_pair(tiny_target, json_schema_grammar(schema), prompt,
                              gen.make_drafter("draft_model"), 2, adaptive=True)
        assert spec.tokens == ref.tokens
        if ref.stop_reason != "length":
            jsonschema.validate(json.loads(spec.text), schema)


def test_forced_tokens_cut_target_forwards(tiny_target):
    tok = tiny_target.tokenizer
    prompt = tok.encode("x", add_special_tokens=False)
    grammar = json_schema_grammar({"type": "object", "properties": {"a_long_property_name": {"type": "boolean"},
                                                                    "another_long_key": {"enum": ["yes", "no"]}},
                                   "required": ["a_long_property_name", "another_long_key"],
                                   "additionalProperties": False})
    ref, spec = _run_pair(tiny_target, grammar, prompt, None, 4)
    assert spec.tokens == ref.tokens
    assert spec.stats.forced > 0 and spec.stats.target_forwards < ref.stats.target_forwards / 2


class RowCountingLM(CausalLM):
    """Records the verify rows whose logits the decoder asks for (None: all of them)."""

    def __init__(self, loaded):
        super().__init__(loaded)
        self.requests: list[tuple[int, list[int] | None]] = []

    def forward(self, tokens, *, num_logits=None, hidden=False, logit_rows=None):
        self.requests.append((len(tokens), logit_rows))
        return super().forward(tokens, num_logits=num_logits, hidden=hidden, logit_rows=logit_rows)


def test_lm_head_is_skipped_for_rows_whose_next_token_is_forced(tiny_target):
    """Row i of a verify decides d_{i+1}; a schema-forced d_{i+1} needs no target logits, so none are computed —
    and the output is still the reference's."""
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    prompt = tok.encode("x", add_special_tokens=False)
    grammar = json_schema_grammar({"type": "object", "properties": {"a_long_property_name": {"type": "boolean"},
                                                                    "n": {"type": "integer"}},
                                   "required": ["a_long_property_name", "n"], "additionalProperties": False})
    ref = decode(CausalLM(tiny_target), prompt, ConstraintState(llt, grammar), max_new_tokens=40)
    target = RowCountingLM(tiny_target)
    spec = speculative_decode(target, prompt, ConstraintState(llt, grammar), PromptLookupDrafter(),
                              num_draft_tokens=4, max_new_tokens=40)
    assert spec.tokens == ref.tokens
    skipped = sum(k - len(rows) for k, rows in target.requests if rows is not None)  # a prefill asks for None
    assert skipped >= spec.stats.forced > 0  # every forced token's row (the distribution test covers sampling)


class ScriptedDrafter(Drafter):
    """Proposes a fixed script of tokens, position by position in the output (valid or not)."""

    name = "scripted"

    def __init__(self, prompt_len: int, script: list[int]):
        self.prompt_len = prompt_len
        self.script = script

    def propose(self, tokens, state, bitmask_row, sampling, generator):
        i = len(tokens) - self.prompt_len
        return (self.script[i], None) if i < len(self.script) else None


def test_draft_valid_then_invalid_bonus_row_is_masked(tiny_target):
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    grammar = json_schema_grammar(SCHEMAS[1])
    prompt = tok.encode("x", add_special_tokens=False)
    ref = decode(CausalLM(tiny_target), prompt, ConstraintState(llt, grammar), max_new_tokens=60)
    invalid = tok.convert_tokens_to_ids("Ġhello")
    script = []
    for t in ref.tokens:  # each window: a valid token, then an invalid one (the window must stop there)
        script.append(t)
    drafter = ScriptedDrafter(len(prompt), [t if i % 2 == 0 else invalid for i, t in enumerate(script)])
    spec = speculative_decode(CausalLM(tiny_target), prompt, ConstraintState(llt, grammar), drafter,
                              num_draft_tokens=3, max_new_tokens=60)
    assert spec.tokens == ref.tokens
    assert invalid not in spec.tokens


def test_oracle_draft_past_closing_brace_and_eos_is_fully_accepted_and_stops(tiny_target):
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    grammar = json_schema_grammar(SCHEMAS[2])
    prompt = tok.encode("x", add_special_tokens=False)
    ref = decode(CausalLM(tiny_target), prompt, ConstraintState(llt, grammar), max_new_tokens=80)
    assert ref.stop_reason in ("grammar", "eos")
    script = ref.tokens + [tok.eos_token_id] + tok.encode("}} more", add_special_tokens=False)
    spec = speculative_decode(CausalLM(tiny_target), prompt, ConstraintState(llt, grammar),
                              ScriptedDrafter(len(prompt), script), num_draft_tokens=8, max_new_tokens=80)
    assert spec.tokens == ref.tokens and spec.stop_reason == ref.stop_reason
    assert spec.stats.accepted == spec.stats.drafted  # the oracle is never rejected
    assert spec.stats.target_forwards < ref.stats.target_forwards


def test_budget_is_never_exceeded(tiny_target):
    tok = tiny_target.tokenizer
    prompt = tok.encode("x", add_special_tokens=False)
    grammar = json_schema_grammar({"type": "object", "properties": {"s": {"type": "string", "maxLength": 40}},
                                   "required": ["s"], "additionalProperties": False})
    for budget in (1, 2, 5, 9):
        ref, spec = _run_pair(tiny_target, grammar, prompt, PromptLookupDrafter(), 8, max_new=budget)
        assert spec.tokens == ref.tokens and len(spec.tokens) <= budget
        assert spec.truncated == ref.truncated


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_after_every_step_grammar_state_and_kv_cache_equal_a_rebuild(tiny_target, cache, data):
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    schema = SCHEMAS[data.draw(st.integers(0, len(SCHEMAS) - 1))]
    grammar = json_schema_grammar(schema)
    gamma = data.draw(st.integers(1, 8))
    prompt = tok.encode(PROMPTS[data.draw(st.integers(0, len(PROMPTS) - 1))], add_special_tokens=False)
    ref = decode(CausalLM(tiny_target), prompt, ConstraintState(llt, grammar), max_new_tokens=40)
    pool = ref.tokens + tok.encode('{"k0_str": 1} true , ]', add_special_tokens=False) + [tok.eos_token_id]
    script = data.draw(st.lists(st.sampled_from(pool), min_size=0, max_size=60))
    state = ConstraintState(llt, grammar)
    target = CausalLM(tiny_target, cache=cache)

    def check(tokens):
        fresh = ConstraintState(llt, grammar)
        fresh.consume_many(tokens)
        assert state.num_tokens == len(tokens)
        assert torch.equal(state.next_mask(), fresh.next_mask())
        assert state.is_accepting() == fresh.is_accepting()
        rebuilt = CausalLM(tiny_target, cache="dynamic")
        rebuilt.forward(prompt + tokens[:-1])
        n = len(prompt) + len(tokens) - 1
        assert target.length == rebuilt.length == n
        for layer_a, layer_b in zip(target.cache.layers, rebuilt.cache.layers):  # a static cache: its first n
            torch.testing.assert_close(layer_a.keys[:, :, :n], layer_b.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer_a.values[:, :, :n], layer_b.values, atol=1e-4, rtol=1e-4)

    spec = speculative_decode(target, prompt, state, ScriptedDrafter(len(prompt), script), num_draft_tokens=gamma,
                              max_new_tokens=40, on_step=check)
    assert spec.tokens == ref.tokens


# -- sampling: exact distribution of constrained sampling vs speculative samples -----------------------------------
@pytest.mark.parametrize("drafter", [*drafter_params(), FIXED])
def test_speculative_sampling_matches_constrained_sampling_distribution(char_tokenizer, drafter, tmp_path):
    tv = speculative_sampling_tv(char_tokenizer, drafter, tmp_path)
    assert tv < 0.07, tv  # expected ~0.03 at n=1500; a wrong acceptance or residual rule gives > 0.1
