"""Non-speculative constrained decoding: one token per target forward (the reference every speculative mode must
match token for token under greedy decoding, and in distribution under sampling).

Loop invariant (as in gpt-fast): the KV cache holds every token but the last one, ``cur``; each step feeds
``cur``, masks the logits with the grammar state, picks the next token and consumes it.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from constraints import ConstraintState, allocate_bitmask, apply_bitmask

from .model import CausalLM
from .sampling import SamplingParams, probs_from_logits, sample
from .stats import DecodeResult, DecodeStats


def prefill(target: CausalLM, prompt: list[int], stats: DecodeStats, *, hidden: bool = False):
    """Fill the cache with ``prompt[:-1]``; returns ``cur = prompt[-1]`` (not yet fed), or with ``hidden=True``
    ``(cur, last-layer hidden states float [len(prompt) - 1, d])``."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    t0 = time.perf_counter()
    target.reset()
    h = None
    if len(prompt) > 1:
        _, h = target.forward(prompt[:-1], num_logits=1, hidden=hidden)
    stats.prompt_tokens += len(prompt)
    stats.prefill_seconds += time.perf_counter() - t0
    return (prompt[-1], h) if hidden else prompt[-1]


def decode(target: CausalLM, prompt: list[int], state: ConstraintState, *, max_new_tokens: int = 256,
           sampling: SamplingParams = SamplingParams(), eos_token_id: int | None = None,
           tokenizer=None, on_step: Callable[[list[int]], None] | None = None) -> DecodeResult:
    """Constrained decoding, one token per forward.

    Args:
        target: the model.
        prompt: prompt token ids (chat template applied).
        state: the sequence's grammar state (advanced in place by the emitted tokens; EOS is not consumed).
        max_new_tokens: output budget; reaching it gives ``stop_reason == "length"``.
        sampling: greedy when ``temperature == 0``.
        eos_token_id: defaults to the grammar tokenizer's EOS.
        tokenizer: HF tokenizer for ``text`` (None: llguidance's decoder).
        on_step: called with the output tokens so far after each emitted token (streaming).

    Returns:
        :class:`DecodeResult`; stops at EOS (allowed only when the grammar accepts) or when the grammar is complete.
    """
    eos = state.eos_token if eos_token_id is None else eos_token_id
    stats = DecodeStats()
    t_start = time.perf_counter()
    mask0 = state.mask_seconds
    gen = None if sampling.greedy else sampling.generator(target.device)
    bitmask = allocate_bitmask(1, target.vocab_size)
    cur = prefill(target, prompt, stats)
    tokens: list[int] = []
    stop = "length"
    while len(tokens) < max_new_tokens:
        if state.is_stopped():
            stop = "grammar"
            break
        t0 = time.perf_counter()
        logits, _ = target.forward([cur])
        stats.target_forwards += 1
        stats.verify_seconds += time.perf_counter() - t0
        state.fill_bitmask(bitmask, 0)
        masked = apply_bitmask(logits[-1:].clone(), bitmask)
        if sampling.greedy:
            tok = int(torch.argmax(masked[0]))
        else:
            tok = sample(probs_from_logits(masked, sampling)[0], gen)
        if tok == eos:
            stop = "eos"
            break
        state.consume(tok)
        tokens.append(tok)
        cur = tok
        if on_step is not None:
            on_step(tokens)
    stats.new_tokens = len(tokens)
    stats.mask_seconds = state.mask_seconds - mask0
    stats.seconds = time.perf_counter() - t_start
    return DecodeResult(tokens, _detok(tokens, state, tokenizer), stop, stats)


def _detok(tokens: list[int], state: ConstraintState, tokenizer) -> str:
    if tokenizer is not None:
        return tokenizer.decode(tokens, skip_special_tokens=False)
    return state.tokenizer.decode_str(tokens)
