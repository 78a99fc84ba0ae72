"""Grammar-constrained speculative decoding: draft γ tokens under the grammar, verify all γ+1 positions in one
target forward with per-position masks, accept the matching prefix plus one bonus token, roll back the rest.

Greedy output is token-identical to :func:`decoding.decoder.decode`; sampled output has its distribution
(Leviathan et al. 2023, arXiv 2211.17192, Alg. 1, applied to the *masked, renormalised* target p and draft q;
on rejection the bonus is drawn from norm(max(0, p − q)); deterministic drafts use one-hot q).

Window of one step (``cur`` = last accepted token, not yet in the KV cache)::

    draft:   row 0 = mask(state)            -> d1   (forced if row 0 allows one token, else the drafter)
             row 1 = mask(state + d1)       -> d2 …
    verify:  target([cur, d1 … dk]) -> logits [k+1, V]; logits[i] masked with row i (bonus row included)
    accept:  n = matching prefix; bonus = pick(masked logits[n]) (greedy) or Leviathan's rule (sampling)
    commit:  grammar rollback(k − n) then consume(bonus); KV cache cropped to the accepted length
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from constraints import ConstraintState, allocate_bitmask, apply_bitmask, is_allowed_row, single_allowed

from .decoder import _detok, prefill
from .drafters import Drafter
from .model import CausalLM
from .sampling import SamplingParams, probs_from_logits, sample
from .stats import DecodeResult, DecodeStats


@dataclass
class Draft:
    """One draft window.

    Attributes:
        tokens: ``d1 … dk`` (may end with EOS).
        q: per token, the draft distribution ``float32 [V]`` or None (deterministic / forced: one-hot q).
        forced: per token, True when the grammar allowed only that token.
        rows: bitmask rows filled (row i = state after ``d1 … di``); ``k`` or ``k + 1``.
    """

    tokens: list[int]
    q: list[torch.Tensor | None]
    forced: list[bool]
    rows: int


def draft_window(state: ConstraintState, drafter: Drafter | None, seq: list[int], bitmask: torch.Tensor,
                 num_draft_tokens: int, max_tokens: int, sampling: SamplingParams,
                 generator: torch.Generator | None, eos: int) -> Draft:
    """Draft up to ``num_draft_tokens`` drafter tokens plus any schema-forced tokens (at most ``max_tokens``).

    Fills ``bitmask[i]`` (``int32 [rows, W]``) before each token and advances ``state`` by each drafted token
    (EOS is not consumed). Stops at EOS, when the grammar is stopped, when the drafter has nothing, or at the caps.
    """
    tokens: list[int] = []
    qs: list[torch.Tensor | None] = []
    forced: list[bool] = []
    rows = 0
    n_model = 0
    while not state.is_stopped():
        i = len(tokens)
        state.fill_bitmask(bitmask, i)
        rows = i + 1
        if i >= max_tokens:
            break
        row = bitmask[i]
        tok = single_allowed(row)
        is_forced = tok is not None
        q = None
        if not is_forced:
            if drafter is None or n_model >= num_draft_tokens:
                break
            proposal = drafter.propose(seq + tokens, state, row, sampling, generator)
            if proposal is None:
                break
            tok, q = proposal
            if not is_allowed_row(row, tok):  # a drafter must respect the mask; never verify a forbidden token
                break
            n_model += 1
        tokens.append(tok)
        qs.append(q)
        forced.append(is_forced)
        if tok == eos:
            break
        state.consume(tok)
    return Draft(tokens, qs, forced, rows)


def accept_greedy(masked: torch.Tensor, draft: Draft) -> tuple[int, int | None]:
    """Greedy verification: ``(n accepted, bonus or None)`` from masked target logits ``[rows, V]``.

    Accept while ``argmax(masked[i]) == d_{i+1}``; the bonus is the argmax at the first mismatch, or at row k when
    all are accepted (None when that row was not filled: the grammar stopped or the draft ended with EOS).
    """
    choice = torch.argmax(masked, dim=-1).tolist()
    n = 0
    while n < len(draft.tokens) and draft.tokens[n] == choice[n]:
        n += 1
    bonus = choice[n] if n < len(choice) and n < draft.rows else None
    return n, bonus


def accept_sampled(masked: torch.Tensor, draft: Draft, sampling: SamplingParams,
                   generator: torch.Generator) -> tuple[int, int | None]:
    """Speculative sampling on masked, renormalised p (target) and q (draft).

    Leviathan et al. 2023, Alg. 1: accept ``d`` with probability ``min(1, p(d)/q(d))``; at the first rejection
    the bonus is drawn from ``norm(max(0, p − q))``; if all are accepted, from ``p`` at row k.
    """
    p = probs_from_logits(masked, sampling)
    for j, d in enumerate(draft.tokens):
        if draft.forced[j]:
            continue  # p(d) = 1: the mask allows only d
        q = draft.q[j]
        pd = float(p[j, d])
        qd = 1.0 if q is None else float(q[d])
        if float(torch.rand((), generator=generator)) < min(1.0, pd / qd):
            continue
        if q is None:
            residual = p[j].clone()
            residual[d] = 0.0
        else:
            residual = (p[j] - _fit(q, p.shape[-1]).to(p.device)).clamp_min(0.0)
        total = float(residual.sum())
        residual = p[j] if total <= 0.0 else residual / total
        return j, sample(residual, generator)
    n = len(draft.tokens)
    bonus = sample(p[n], generator) if n < p.shape[0] and n < draft.rows else None
    return n, bonus


def _fit(q: torch.Tensor, width: int) -> torch.Tensor:
    """A draft distribution over the target's vocabulary width (the mask forbids ids past either width)."""
    if q.shape[-1] >= width:
        return q[..., :width]
    return torch.nn.functional.pad(q, (0, width - q.shape[-1]))


def speculative_decode(target: CausalLM, prompt: list[int], state: ConstraintState, drafter: Drafter | None, *,
                       num_draft_tokens: int = 4, max_new_tokens: int = 256,
                       sampling: SamplingParams = SamplingParams(), adaptive: bool = False,
                       max_num_draft_tokens: int = 8, max_window: int = 32, eos_token_id: int | None = None,
                       tokenizer=None, on_step: Callable[[list[int]], None] | None = None) -> DecodeResult:
    """Constrained speculative decoding (see module docstring).

    Args:
        target: the target model.
        prompt: prompt token ids.
        state: grammar state of the sequence (advanced in place by the output).
        drafter: proposes non-forced draft tokens; None = schema-forced tokens only.
        num_draft_tokens: γ, drafter tokens per window (forced tokens do not count; ``max_window`` caps both).
        adaptive: adapt γ online: +2 after a fully accepted window, −1 otherwise (transformers' "heuristic"),
            within ``[1, max_num_draft_tokens]``.
        max_new_tokens: output budget (``stop_reason == "length"`` when reached).
        sampling: greedy when ``temperature == 0``.
        on_step: called after each committed step with the output tokens so far (tests check that the grammar
            state and KV cache then equal those rebuilt from scratch).

    Returns:
        :class:`DecodeResult` with acceptance statistics.
    """
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    eos = state.eos_token if eos_token_id is None else eos_token_id
    stats = DecodeStats()
    t_start = time.perf_counter()
    mask0 = state.mask_seconds
    gen = None if sampling.greedy else sampling.generator(target.device)
    if drafter is not None:
        drafter.reset()
    bitmask = allocate_bitmask(max_window + 1, target.vocab_size)
    needs_hidden = drafter is not None and drafter.needs_hidden_states  # an MTP head is seeded with target states
    if needs_hidden:
        cur, h = prefill(target, prompt, stats, hidden=True)
        if h is not None:
            drafter.observe(h, prompt[1:], 0)
    else:
        cur = prefill(target, prompt, stats)
    seq = list(prompt)
    tokens: list[int] = []
    gamma = num_draft_tokens
    stop = "length"
    while len(tokens) < max_new_tokens:
        if state.is_stopped():
            stop = "grammar"
            break
        # -- draft ---------------------------------------------------------------------------------------------
        t0 = time.perf_counter()
        budget = max_new_tokens - len(tokens)
        draft = draft_window(state, drafter, seq, bitmask, gamma, min(max_window, budget - 1), sampling, gen, eos)
        consumed = len(draft.tokens) - (1 if draft.tokens and draft.tokens[-1] == eos else 0)
        t1 = time.perf_counter()
        stats.draft_seconds += t1 - t0
        # -- verify: one target forward over [cur, d1 … dk] (a trailing EOS needs no logits after it) -----------
        base = target.length
        inputs = [cur] + draft.tokens[:consumed]
        logits, hidden = target.forward(inputs, hidden=needs_hidden)
        stats.target_forwards += 1
        n_rows = min(draft.rows, logits.shape[0])
        masked = apply_bitmask(logits[:n_rows].clone(), bitmask[:n_rows])
        if sampling.greedy:
            n, bonus = accept_greedy(masked, draft)
        else:
            n, bonus = accept_sampled(masked, draft, sampling, gen)
        stats.verify_seconds += time.perf_counter() - t1
        # -- statistics ----------------------------------------------------------------------------------------
        position = 0
        model_drafted = model_accepted = 0
        for j, is_forced in enumerate(draft.forced):
            if is_forced:
                stats.forced += int(j < n)
                continue
            model_drafted += 1
            model_accepted += int(j < n)
            if j <= n:
                stats.record_position(position, j < n)
            position += 1
        stats.drafted += model_drafted
        stats.accepted += model_accepted
        if adaptive and model_drafted:
            gamma = min(gamma + 2, max_num_draft_tokens) if model_accepted == model_drafted else max(1, gamma - 1)
        # -- commit / roll back --------------------------------------------------------------------------------
        accepted = draft.tokens[:n]
        if accepted and accepted[-1] == eos:  # EOS inside the window: accept through it and finish
            state.rollback(consumed - (n - 1))
            tokens.extend(accepted[:-1])
            stop = "eos"
            break
        state.rollback(consumed - n)
        tokens.extend(accepted)
        seq.extend(accepted)
        if bonus is None:  # all accepted and the grammar is complete: nothing may follow
            stop = "grammar"
            break
        if bonus == eos:
            stop = "eos"
            break
        state.consume(bonus)
        tokens.append(bonus)
        seq.append(bonus)
        target.crop(base + 1 + n)  # keep cur + accepted drafts; bonus becomes the new cur
        if needs_hidden:  # the verify forward's states of cur + accepted drafts seed the next draft round
            drafter.observe(hidden[: n + 1], accepted + [bonus], base)
        cur = bonus
        if on_step is not None:
            on_step(tokens)
    stats.new_tokens = len(tokens)
    stats.mask_seconds = state.mask_seconds - mask0
    stats.seconds = time.perf_counter() - t_start
    return DecodeResult(tokens, _detok(tokens, state, tokenizer), stop, stats)
