"""constraints/: grammar compilation, ConstraintState consume / rollback / masks, bitmask helpers."""
from __future__ import annotations

import json

import pytest
import torch

from constraints import (ConstraintError, ConstraintState, GrammarError, allocate_bitmask, allowed_among,
                         allowed_tokens,
                         apply_bitmask, json_schema_grammar, lark_grammar, llg_tokenizer, regex_grammar,
                         single_allowed)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}}, "required": ["city", "n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def llt(smol_tokenizer):
    return llg_tokenizer(smol_tokenizer, 49152)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def mask_of(state):
    return state.next_mask()


def test_bitmask_roundtrip_and_apply():
    bm = allocate_bitmask(2, 70)
    bm.zero_()
    bm[0, 1] = 1 << 3  # token 35 only
    bm[1, 0] = 0b101  # tokens 0 and 2
    assert single_allowed(bm[0]) == 35 and single_allowed(bm[1]) is None
    assert allowed_tokens(bm[1], 70).tolist() == [0, 2]
    logits = torch.zeros(2, 70)
    apply_bitmask(logits, bm)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [35]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2]
    bm[1, 1] = -(1 << 31)  # token 63 (the sign bit of an int32 word)
    assert allowed_among(bm[1], torch.tensor([63, 2, 1, 35, 0])).tolist() == [63, 2, 0]


def test_bitmask_sign_bit_word_is_single_token():
    bm = allocate_bitmask(1, 64)
    bm.zero_()
    bm[0, 0] = torch.tensor(-(2 ** 31), dtype=torch.int32)  # bit 31 only
    assert single_allowed(bm[0]) == 31


def test_json_output_is_accepted_and_then_only_eos(llt, smol_tokenizer):
    st = ConstraintState(llt, json_schema_grammar(SCHEMA))
    ids = encode(smol_tokenizer, json.dumps({"city": "Oslo", "n": 3}, separators=(",", ":")))
    st.consume_many(ids)
    assert st.is_accepting() and st.is_stopped()
    assert allowed_tokens(mask_of(st), 49152).tolist() == [smol_tokenizer.eos_token_id]


def test_consume_full_json_and_eos_then_roll_back_two_is_not_stopped_and_eos_forbidden(llt, smol_tokenizer):
    st = ConstraintState(llt, json_schema_grammar(SCHEMA))
    ids = encode(smol_tokenizer, '{"city":"Oslo","n":12}')
    st.consume_many(ids)
    st.consume(smol_tokenizer.eos_token_id)
    st.rollback(2)
    assert not st.is_stopped()
    m = mask_of(st)
    assert not bool((m[smol_tokenizer.eos_token_id // 32] >> (smol_tokenizer.eos_token_id % 32)) & 1)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_rollback_after_eos_on_a_complete_grammar_removes_eos_first(llt, smol_tokenizer, n):
    """llguidance records no token for EOS consumed once the grammar is stopped: rollback(n) must undo EOS and
    n - 1 body tokens (the state of ``ids[:3 - (n - 1)]``), not n body tokens."""
    ids = [smol_tokenizer.convert_tokens_to_ids(c) for c in "xyz"]
    eos = smol_tokenizer.eos_token_id
    st = ConstraintState(llt, regex_grammar("xyz"))
    st.consume_many(ids)
    assert st.is_stopped()
    st.consume(eos)
    st.rollback(n)
    kept = 3 - (n - 1)
    assert st.num_tokens == kept and st.is_stopped() == (n == 1)
    assert st.valid_prefix_len(ids[kept:]) == 3 - kept  # exactly the removed body tokens may follow …
    st.consume_many(ids[kept:])
    assert st.is_stopped()  # … and complete the grammar again
    st.consume(eos)
    assert st.num_tokens == 4


def test_rollback_after_eos_on_an_accepting_grammar_removes_eos_first(llt, smol_tokenizer):
    st = ConstraintState(llt, regex_grammar("x(yz)?"))
    st.consume(smol_tokenizer.convert_tokens_to_ids("x"))
    assert st.is_accepting() and not st.is_stopped()
    st.consume(smol_tokenizer.eos_token_id)
    st.rollback(1)
    assert st.num_tokens == 1 and st.is_accepting() and not st.is_stopped()


def test_token_with_valid_first_bytes_and_invalid_rest_is_rejected_state_unchanged(llt, smol_tokenizer):
    st = ConstraintState(llt, json_schema_grammar(SCHEMA))
    st.consume_many(encode(smol_tokenizer, '{"city":"Os'))
    before = mask_of(st)
    tok = smol_tokenizer.convert_tokens_to_ids('"}')  # '"' closes the string (valid); '}' skips required "n"
    assert smol_tokenizer.decode([tok]) == '"}'
    n = st.num_tokens
    with pytest.raises(ConstraintError, match="not allowed"):
        st.consume(tok)
    assert st.num_tokens == n and torch.equal(mask_of(st), before)
    st.consume(smol_tokenizer.convert_tokens_to_ids('"'))  # the state still works


def test_rollback_then_reconsume_gives_same_masks(llt, smol_tokenizer):
    st = ConstraintState(llt, json_schema_grammar(SCHEMA))
    ids = encode(smol_tokenizer, '{"city":"Bergen","n":42}')
    masks = []
    for t in ids:
        masks.append(mask_of(st))
        st.consume(t)
    st.rollback(len(ids) - 3)
    for i, t in enumerate(ids[3:], start=3):
        assert torch.equal(mask_of(st), masks[i])
        st.consume(t)
    assert st.is_stopped()


def test_rollback_more_than_consumed_is_an_error_and_keeps_state(llt, smol_tokenizer):
    st = ConstraintState(llt, json_schema_grammar(SCHEMA))
    st.consume_many(encode(smol_tokenizer, '{"'))
    with pytest.raises(ValueError, match="cannot roll back"):
        st.rollback(5)
    assert st.num_tokens == len(encode(smol_tokenizer, '{"'))


def test_consume_many_is_all_or_nothing(llt, smol_tokenizer):
    st = ConstraintState(llt, json_schema_grammar(SCHEMA))
    good = encode(smol_tokenizer, '{"city":"A"')
    with pytest.raises(ConstraintError, match="index"):
        st.consume_many(good + encode(smol_tokenizer, "}}}"))
    assert st.num_tokens == 0


def test_compact_json_has_no_free_whitespace(llt, smol_tokenizer):
    st = ConstraintState(llt, json_schema_grammar(SCHEMA))
    st.consume_many(encode(smol_tokenizer, '{"city":"A"'))
    allowed = allowed_tokens(mask_of(st), 49152).tolist()
    assert all(not smol_tokenizer.decode([t]).startswith((" ", "\n")) for t in allowed)


def test_forced_tokens_after_fixed_keys(llt, smol_tokenizer):
    st = ConstraintState(llt, lark_grammar('start: "<tool_call>" "x"'))
    st.consume(encode(smol_tokenizer, "<")[0])
    forced = single_allowed(mask_of(st))
    assert forced is not None and smol_tokenizer.decode([forced]) == "tool"


def test_regex_and_lark_errors_are_exceptions_with_messages():
    with pytest.raises(GrammarError, match="look-around"):
        regex_grammar("(?=a)b")
    with pytest.raises(GrammarError):
        lark_grammar("start: undefined_rule")


def test_regex_grammar_constrains(llt, smol_tokenizer):
    st = ConstraintState(llt, regex_grammar(r"[0-9]{3}"))
    st.consume_many(encode(smol_tokenizer, "123"))
    assert st.is_stopped()
