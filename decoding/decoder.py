"""Non-speculative constrained decoding: one token per target forward (the reference every speculative mode must
match token for token under greedy decoding, and in distribution under sampling).

Loop invariant (as in gpt-fast): the KV cache holds every token but the last one, ``cur``; each step feeds
``cur``, masks the logits with the grammar state, picks the next token and consumes it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from constraints import ConstraintState, allocate_bitmask, apply_bitmask, is_allowed_row, single_allowed

from .backends import TargetModel
from .sampling import SamplingParams, pick
from .stats import DecodeResult, DecodeStats


MASKED_END = "masked_end"  # stop reason: the model's end where the grammar forbade it, and ``end_when`` said stop


def masked_end_rows(logits: torch.Tensor, rows: list[int] | None, bitmask: torch.Tensor,
                    eos: frozenset[int]) -> list[int]:
    """The rows where the model asks to end and the grammar forbids it: row ``r`` (of ``bitmask``, ``int32 [R, W]``)
    is listed when the *unmasked* argmax of its logits is an end-of-generation token (``eos``), bitmask row ``r``
    forbids that token, and row ``r`` allows more than one token (a schema-forced position, whose logits a
    speculative verify may skip, is never listed, so every decode path sees the same positions).

    Args:
        logits: ``float [len(rows), V]`` target logits, unmasked; with ``rows`` None, row ``r`` is ``logits[r]``.
        rows: the bitmask row of each logits row, ascending (None: ``range(len(logits))``).
    Returns: the listed rows, ascending.
    """
    rows = list(range(logits.shape[0])) if rows is None else rows
    argmax = logits[:len(rows)].argmax(dim=-1).tolist()
    return [r for r, tok in zip(rows, argmax)
            if tok in eos and not is_allowed_row(bitmask[r], tok)
            and bool(bitmask[r].any()) and single_allowed(bitmask[r]) is None]  # two tokens or more allowed


def prefill(target: TargetModel, prompt: list[int], stats: DecodeStats, *, hidden: bool = False):
    """Fill the cache with ``prompt[:-1]``; returns ``cur = prompt[-1]`` (not yet fed), or with ``hidden=True``
    ``(cur, last-layer hidden states float [len(prompt) - 1, d])``.

    A prefix of the prompt still in the backend's KV cache from the previous decode is kept
    (``target.reuse_prefix``; counted in ``stats.prompt_tokens_cached``) and only the rest is prefilled; with
    ``hidden``, only a prefix whose hidden states the backend kept too (``target.cached_hidden``: llama.cpp keeps
    them with its prefix slots; torch's cache lives for one decode, so it prefills it all)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    t0 = time.perf_counter()
    reused = target.reuse_prefix(prompt, hidden=hidden)
    h = None
    if len(prompt) - 1 > reused:
        _, h = target.forward(prompt[reused:-1], num_logits=1, hidden=hidden)
    if hidden and reused:
        kept = target.cached_hidden(reused)
        h = kept if h is None else torch.cat([kept.to(h.device, h.dtype), h])
    target.synchronize()  # CUDA runs asynchronously: time the prefill, not its launch
    stats.prompt_tokens += len(prompt)
    stats.prompt_tokens_cached += reused
    stats.prefill_seconds += time.perf_counter() - t0
    return (prompt[-1], h) if hidden else prompt[-1]


@dataclass
class DecodeSetup:
    """What both decoders hold for one sequence after :func:`start_decode` (set-up shared with
    ``decoding.speculative``).

    Attributes:
        eos: the end-of-generation token ids (the grammar tokenizer's EOS and the model's other end tokens).
        stats: the decode's counters, prefill already counted.
        generator: the run's random generator (None when greedy).
        bitmask: ``int32 [rows, ceil(V/32)]`` mask buffer (row i = grammar state after i draft tokens).
        cur: the last prompt token, not yet fed to the target (the KV cache holds the rest).
        hidden: target last-layer hidden states ``float [len(prompt) - 1, d]`` of the prompt (``hidden=True``
            only), else None.
        t_start: ``time.perf_counter()`` at the start (s); ``mask_start``: the state's mask time then (s).
    """

    eos: frozenset[int]
    stats: DecodeStats
    generator: torch.Generator | None
    bitmask: torch.Tensor
    cur: int
    hidden: torch.Tensor | None
    t_start: float
    mask_start: float


def start_decode(target: TargetModel, prompt: list[int], state: ConstraintState, sampling: SamplingParams,
                 eos_token_id: int | None, *, rows: int = 1, hidden: bool = False,
                 observe: Callable[[torch.Tensor | None, list[int], int], None] | None = None) -> DecodeSetup:
    """Set up one decode: EOS id, statistics, random generator, a bitmask of ``rows`` rows, and the prefill.

    ``observe(hidden, prompt[1:], 0)`` (a drafter's :meth:`~decoding.drafters.Drafter.observe`) is called after the
    prefill with the prompt's hidden states (``hidden=True``; else None) and counted as prefill time: an MTP head's
    pass over the prompt is its prefill.

    Raises:
        ValueError: the prompt is empty.
    """
    eos = state.eog_tokens if eos_token_id is None else state.eog_tokens | {eos_token_id}  # the mask allows them all
    stats = DecodeStats()
    t_start = time.perf_counter()
    mask_start = state.mask_seconds
    gen = None if sampling.greedy else sampling.generator(target.device)
    bitmask = allocate_bitmask(rows, target.vocab_size)
    if hidden:
        cur, h = prefill(target, prompt, stats, hidden=True)
    else:
        cur, h = prefill(target, prompt, stats), None
    if observe is not None and (h is not None or not hidden):  # a one-token prompt has no states to observe
        with stats.timer("prefill_seconds", target.synchronize):
            observe(h, prompt[1:], 0)
    return DecodeSetup(eos, stats, gen, bitmask, cur, h, t_start, mask_start)


def finish_decode(setup: DecodeSetup, tokens: list[int], stop: str, state: ConstraintState,
                  tokenizer=None, target: TargetModel | None = None) -> DecodeResult:
    """Wrap up one decode: final counters and timings (s) in ``setup.stats`` and the :class:`DecodeResult`
    (``target.synchronize()`` first, so the whole decode's time includes the device's queued work).

    A decode that reached the budget on the token that completed the grammar stops with ``"grammar"``, not
    ``"length"``: nothing was cut.
    """
    if stop == "length" and state.is_stopped():
        stop = "grammar"
    stats = setup.stats
    stats.new_tokens = len(tokens)
    stats.mask_seconds = state.mask_seconds - setup.mask_start
    if target is not None:
        target.synchronize()
    stats.seconds = time.perf_counter() - setup.t_start
    return DecodeResult(tokens, detokenize(tokens, state, tokenizer), stop, stats)


def detokenize(tokens: list[int], state: ConstraintState, tokenizer=None) -> str:
    """``tokens`` as text: with the HF ``tokenizer`` (special tokens kept), or llguidance's when it is None."""
    if tokenizer is not None:
        return tokenizer.decode(tokens, skip_special_tokens=False)
    return state.tokenizer.decode_str(tokens)


def decode(target: TargetModel, prompt: list[int], state: ConstraintState, *, max_new_tokens: int = 256,
           sampling: SamplingParams = SamplingParams(), eos_token_id: int | None = None,
           tokenizer=None, on_step: Callable[[list[int]], bool | None] | None = None,
           end_when: Callable[[list[int]], bool] | None = None) -> DecodeResult:
    """Constrained decoding, one token per forward.

    Args:
        target: the model.
        prompt: prompt token ids (chat template applied).
        state: the sequence's grammar state (advanced in place by the emitted tokens; EOS is not consumed).
        max_new_tokens: output budget; reaching it gives ``stop_reason == "length"``.
        sampling: greedy when ``temperature == 0``.
        eos_token_id: one more end token beside the state's ``eog_tokens`` (the tokenizer's EOS and the model's
            other end-of-generation tokens, all of which the mask allows where the grammar accepts).
        tokenizer: HF tokenizer for ``text`` (None: llguidance's decoder).
        on_step: called with the output tokens so far after each emitted token (streaming); a true return value
            stops the decode there (``stop_reason == "stop"``: a stop condition, nothing cut).
        end_when: asked with the output tokens so far at each position where the model asks to end and the grammar
            forbids it (:func:`masked_end_rows`); True stops the decode before that position's token
            (``stop_reason == "masked_end"``). The rule depends on the prefix alone, so the speculative decoders
            stop at the same position (greedy) and keep the distribution (sampling).

    Returns:
        :class:`DecodeResult`; stops at EOS (allowed only when the grammar accepts) or when the grammar is complete.
    """
    run = start_decode(target, prompt, state, sampling, eos_token_id)
    stats, cur = run.stats, run.cur
    tokens: list[int] = []
    stop = "length"
    while len(tokens) < max_new_tokens and not state.is_stopped():  # finish_decode: stopped grammar → "grammar"
        t0 = time.perf_counter()
        logits, _ = target.forward([cur])
        target.synchronize()
        stats.target_forwards += 1
        stats.verify_seconds += time.perf_counter() - t0
        state.fill_bitmask(run.bitmask, 0)
        if end_when is not None and masked_end_rows(logits[-1:], None, run.bitmask, run.eos) and end_when(tokens):
            stop = MASKED_END
            break
        tok, _ = pick(apply_bitmask(logits[-1:].clone(), run.bitmask), sampling, run.generator)
        if tok in run.eos:
            stop = "eos"
            break
        state.consume(tok)
        tokens.append(tok)
        cur = tok
        if on_step is not None and on_step(tokens):
            stop = "stop"
            break
    return finish_decode(run, tokens, stop, state, tokenizer, target)
