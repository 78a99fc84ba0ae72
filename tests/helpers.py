"""Test helpers: random schemas, prompts and reference computations (no cache, full forwards)."""
from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest

import torch

from agent.formats.generic import render_prompt, turn_grammar
from bench.bfcl_dialect import tool_from_bfcl
from constraints import ConstraintState, allocate_bitmask, apply_bitmask, is_allowed_row, regex_grammar
from decoding import DRAFTERS, CausalLM, Drafter, Generator, LoadedModel, SamplingParams, speculative_decode
from decoding.mtp import MTPHead, save_head, target_sha256
from decoding.sampling import probs_from_logits

from conftest import tiny_llama


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded random object schema (every output finishes): strings, integers, booleans, enums, arrays, objects."""
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["string", "integer", "boolean", "enum", "array", "object" if depth == 0 else "string"])
        if kind == "string":
            s = {"type": "string", "maxLength": rng.randint(1, 6)}
        elif kind == "integer":
            s = {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])}
        elif kind == "boolean":
            s = {"type": "boolean"}
        elif kind == "enum":
            s = {"enum": rng.sample(["red", "green", "blue", "cyan", "x"], rng.randint(1, 3))}
        elif kind == "array":
            s = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": rng.randint(1, 3)}
        else:
            s = random_schema(rng, depth + 1)
        props[f"k{i}_{kind[:3]}"] = s
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


PROMPTS = ["Call the tool for Paris and 42.", "Give me the blue one with 7 items please",
           '{"k0_str": "ab", "k1_int": 3}', "x"]


@torch.inference_mode()
def reference_greedy_check(model, prompt: list[int], tokens: list[int], state_factory) -> None:
    """Assert each emitted token is the argmax of the grammar-masked logits of a full (cache-free) forward."""
    state = state_factory()
    vocab = model.config.vocab_size
    bm = allocate_bitmask(1, vocab)
    seq = list(prompt)
    for i, t in enumerate(tokens):
        logits = model(torch.tensor([seq])).logits[0, -1:].float()
        state.fill_bitmask(bm, 0)
        masked = apply_bitmask(logits.clone(), bm)
        assert int(masked.argmax()) == t, f"step {i}: emitted {t}, masked argmax {int(masked.argmax())}"
        state.consume(t)
        seq.append(t)


# -- sampling: exact distribution of constrained sampling ----------------------------------------------------------
def char_model(vocab: int, seed: int):
    """A tiny random Llama over a character vocabulary (logits spread enough for non-degenerate sampling tests)."""
    return tiny_llama(vocab, seed, hidden=16, layers=1, init=0.15)


def loaded_model(model, name, tokenizer=None):
    """``model`` as a LoadedModel (CPU, float32; no tokenizer unless given)."""
    return LoadedModel(model, tokenizer, name, None, torch.device("cpu"), torch.float32)


def hf_char_tokenizer(char_tok):
    """A Hugging Face fast tokenizer with the token strings and ids of a :class:`conftest.CharTokenizer` (EOS id 0),
    so a :class:`decoding.Generator` runs the char models: its llguidance tokenizer has the same token bytes (it
    may split a text differently; the tests pass token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t.decode(): i for i, t in enumerate(char_tok.tokens)}
    merges = [(m[:1].decode(), m[1:].decode()) for m in char_tok.tokens if len(m) == 2]
    inner = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # ASCII: bytes as is
    inner.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token=char_tok.tokens[0].decode())
    assert tok.eos_token_id == char_tok.eos_token_id and len(tok) == len(char_tok.tokens)
    return tok


# -- every row of the drafter table (decoding.DRAFTERS) -----------------------------------------------------------
# what the tiny torch test models give a drafter: hidden states and torch weights (the MTP head's shared weights, a
# draft model on the same device); :func:`registry_generator` supplies the draft model and an MTP head
TINY_PROVIDES = frozenset({"hidden_states", "torch_weights"})


def drafter_params(provides: frozenset[str] = TINY_PROVIDES) -> list:
    """One ``pytest.param`` per row of :data:`decoding.DRAFTERS` (id: its name), so a new row is tested by adding
    it. A row that needs what the tiny test models cannot give (its ``needs`` beyond ``provides``) is marked skip,
    with the row and the reason, never left out."""
    params = []
    for name in list(DRAFTERS):
        missing = set(getattr(DRAFTERS[name], "needs", ())) - set(provides)
        marks = [pytest.mark.skip(reason=f"drafter {name!r} needs {sorted(missing)}, which the tiny test models "
                                         f"do not provide")] if missing else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def registry_generator(target: LoadedModel, draft: LoadedModel, mtp_dir: Path, *, head_seed: int = 5,
                       **kwargs) -> Generator:
    """A Generator on ``target`` that builds every row of :data:`decoding.DRAFTERS`: ``draft`` is its draft model
    and a randomly initialised MTP head for ``target`` (seed ``head_seed``, saved to ``mtp_dir``) its MTP head."""
    torch.manual_seed(head_seed)
    head = MTPHead(target.model).eval()
    save_head(head, Path(mtp_dir), {"target_sha256": target_sha256(target), "stand_in": "final_norm"})
    gen = Generator(target, draft_model=draft, **kwargs)
    gen.mtp_checkpoint = Path(mtp_dir)
    return gen


@torch.inference_mode()
def exact_distribution(model, llt, grammar, prompt, sampling, max_len=4):
    """P(output tokens) of constrained sampling (mask -> temperature -> top-p), by enumerating the grammar tree."""
    out: dict[tuple, float] = {}
    bm = allocate_bitmask(1, model.config.vocab_size)

    def rec(prefix, p):
        state = ConstraintState(llt, grammar)
        state.consume_many(prefix)
        if state.is_stopped() or len(prefix) == max_len:
            out[tuple(prefix)] = out.get(tuple(prefix), 0.0) + p
            return
        logits = model(torch.tensor([prompt + prefix])).logits[0, -1:].float()
        state.fill_bitmask(bm, 0)
        probs = probs_from_logits(apply_bitmask(logits, bm), sampling)[0]
        for t in torch.nonzero(probs > 0).flatten().tolist():
            if t == llt.eos_token:
                out[tuple(prefix)] = out.get(tuple(prefix), 0.0) + p * float(probs[t])
            else:
                rec(prefix + [t], p * float(probs[t]))

    rec([], 1.0)
    return out


class FixedDrafter(Drafter):
    """Deterministic drafts (one-hot q): always proposes the same token when the grammar allows it."""

    name = "fixed"

    def __init__(self, token):
        self.token = token

    def propose(self, tokens, state, bitmask_row, sampling, generator):
        return (self.token, None) if is_allowed_row(bitmask_row, self.token) else None


FIXED = "fixed"  # not a row of the drafter table: deterministic drafts (one-hot q) from FixedDrafter


def speculative_sampling_tv(char_tokenizer, drafter: str, workdir: Path, n: int = 1500,
                            place: Callable[[LoadedModel], LoadedModel] = lambda loaded: loaded) -> float:
    """Total-variation distance between ``n`` seeded samples of (speculative) constrained sampling and the exact
    distribution of constrained sampling, on ``[ab]{2,3}`` after ``ab:`` with char models (target seed 11, draft
    seed 12, a random MTP head saved under ``workdir``; the exact one computed on CPU).

    ``drafter``: a row of :data:`decoding.DRAFTERS`, run as the product runs it (``Generator.generate``; ``none``
    is the reference decoder), or :data:`FIXED` (one-hot q). ``place`` moves a model (e.g. onto CUDA). Expected
    ~0.03 at n=1500; a wrong acceptance or residual rule gives > 0.1."""
    tok, _ = char_tokenizer
    hf_tok = hf_char_tokenizer(tok)
    vocab = len(tok.tokens)
    target_cpu = loaded_model(char_model(vocab, 11), "t", hf_tok)
    target, draft = place(target_cpu), place(loaded_model(char_model(vocab, 12), "d", hf_tok))
    gen = registry_generator(target, draft, workdir, num_draft_tokens=3)
    llt = gen.llg_tokenizer
    grammar = regex_grammar("[ab]{2,3}")
    prompt = tok("ab:")
    exact = exact_distribution(target_cpu.model, llt, grammar, prompt, SamplingParams(temperature=1.0))
    assert abs(sum(exact.values()) - 1) < 1e-5 and max(exact.values()) < 0.6  # a non-degenerate test
    counts = Counter()
    for seed in range(n):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        if drafter == FIXED:
            res = speculative_decode(CausalLM(target), prompt, ConstraintState(llt, grammar),
                                     FixedDrafter(tok("a")[0]), num_draft_tokens=3, max_new_tokens=4,
                                     sampling=sampling)
        else:
            res = gen.generate(prompt, grammar, drafter=drafter, max_new_tokens=4, sampling=sampling)
        counts[tuple(res.tokens)] += 1
    return 0.5 * sum(abs(exact.get(k, 0.0) - counts[k] / n) for k in set(exact) | set(counts))


def decode_bfcl(gen, row: dict, drafter: str, *, max_new_tokens: int = 384, **kwargs):
    """One BFCL question with ``gen`` as the generic format renders it (``tool_choice="required"``, one call,
    strings capped at 200 characters, 8 decimals): ``(tools, DecodeResult)``."""
    tools = [tool_from_bfcl(fn) for fn in row["function"]]
    ids = render_prompt(gen.tokenizer, [m for turn in row["question"] for m in turn], tools)
    grammar = turn_grammar(tools, "required", parallel=False, max_string_length=200, max_decimals=8)
    return tools, gen.generate(ids, grammar, drafter=drafter, max_new_tokens=max_new_tokens, **kwargs)


def assert_identical_with_fewer_forwards(gen, questions: list[dict], references: dict, drafter: str,
                                         **kwargs) -> None:
    """Each question decoded with ``drafter`` gives the tokens of its reference (``references[id]``, decoded with
    ``drafter="none"`` by :func:`decode_bfcl` with the same ``kwargs``) in fewer target forwards."""
    fewer = 0
    for row in questions:
        ref = references[row["id"]]
        _, spec = decode_bfcl(gen, row, drafter, **kwargs)
        assert spec.tokens == ref.tokens, (row["id"], ref.text, spec.text)
        fewer += spec.stats.target_forwards < ref.stats.target_forwards
    assert fewer == len(questions)
