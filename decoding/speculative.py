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

Each line is one function: :func:`draft_window`, :func:`verify`, :func:`accept`, :func:`commit`; set-up and
wrap-up are shared with the reference decoder (:func:`decoding.decoder.start_decode` / ``finish_decode``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from constraints import ConstraintState, apply_bitmask, is_allowed_row, single_allowed

from .decoder import finish_decode, start_decode
from .drafters import Drafter
from .model import CausalLM
from .sampling import SamplingParams, probs_from_logits, sample
from .stats import DecodeResult


@dataclass
class Draft:
    """One draft window.

    Attributes:
        tokens: ``d1 … dk`` (may end with EOS).
        q: per token, the draft distribution ``float32 [V]`` or None (deterministic / forced: one-hot q).
        forced: per token, True when the grammar allowed only that token.
        rows: bitmask rows filled (row i = state after ``d1 … di``); ``k`` or ``k + 1``.
        ends_with_eos: the last token is EOS (not consumed by the grammar state, nothing fed after it).
    """

    tokens: list[int]
    q: list[torch.Tensor | None]
    forced: list[bool]
    rows: int
    ends_with_eos: bool = False

    @property
    def num_consumed(self) -> int:
        """Draft tokens the grammar state consumed (all but a trailing EOS)."""
        return len(self.tokens) - int(self.ends_with_eos)


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
            return Draft(tokens, qs, forced, rows, ends_with_eos=True)
        state.consume(tok)
    return Draft(tokens, qs, forced, rows)


def verify(target: CausalLM, cur: int, draft: Draft, bitmask: torch.Tensor, *,
           hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward over ``[cur, d1 … dk]`` (a trailing EOS needs no logits after it).

    Row i's logits decide draft token ``d_{i+1}``; where that token is schema-forced (row i of the mask allows it
    alone) they cannot change the outcome — greedy takes the one allowed token, and the masked, renormalised p is
    one-hot on it, so Leviathan's rule accepts it with probability 1 — so the target's LM head is skipped for those
    rows (``logit_rows``) and a zero row stands in before masking.

    Returns:
        ``(target_logits, hidden)``: target logits ``float [rows, V]`` with row i masked by ``bitmask[i]`` (the
        bonus row included), and with ``hidden=True`` the target's last-layer states ``float [k + 1, d]``.
    """
    tokens = [cur] + draft.tokens[:draft.num_consumed]
    n_rows = min(draft.rows, len(tokens))
    needed = [i for i in range(n_rows) if not (i < len(draft.forced) and draft.forced[i])]
    if len(needed) == len(tokens):
        logits, h = target.forward(tokens, hidden=hidden)
        return apply_bitmask(logits.clone(), bitmask[:n_rows]), h
    rows, h = target.forward(tokens, hidden=hidden, logit_rows=needed)
    logits = torch.zeros((n_rows, rows.shape[-1]), dtype=rows.dtype, device=rows.device)
    if needed:
        logits[needed] = rows
    return apply_bitmask(logits, bitmask[:n_rows]), h


def accept(target_logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
           generator: torch.Generator | None) -> tuple[int, int | None]:
    """``(num_accepted, bonus token or None)``: :func:`accept_greedy` or, when sampling, :func:`accept_sampled`."""
    if sampling.greedy:
        return accept_greedy(target_logits, draft)
    return accept_sampled(target_logits, draft, sampling, generator)


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
    """Speculative sampling on masked, renormalised p (target) and q (draft), vectorised over the window.

    Leviathan et al. 2023, Alg. 1: accept ``d`` with probability ``min(1, p(d)/q(d))``; at the first rejection
    the bonus is drawn from ``norm(max(0, p − q))``; if all are accepted, from ``p`` at row k. A proposal with
    ``q(d) = 0`` (or no q) is verified as a deterministic one (one-hot q), which is exact for any proposal;
    schema-forced tokens are always accepted (``p(d) = 1``).

    Args:
        masked: masked target logits ``float [rows, V]`` on the device.
        generator: the run's generator; every draw (``k`` uniforms, then one token) is made on its device.
    Returns:
        ``(num_accepted, bonus token or None)``; one host sync per window.
    """
    p = probs_from_logits(masked, sampling)
    rows, vocab = p.shape
    k = len(draft.tokens)
    bonus_row = k < rows and k < draft.rows  # row k exists: a bonus follows a fully accepted window
    if k == 0:
        return 0, (sample(p[0], generator) if bonus_row else None)
    device = p.device
    draft_tokens = torch.tensor(draft.tokens, device=device)
    steps = torch.arange(k, device=device)
    p_draft = p[steps, draft_tokens]  # p(d) [k]
    with_q = [j for j, qj in enumerate(draft.q) if qj is not None]
    raw_q = torch.zeros(k, device=device)  # q(d) [k]; 0 where there is no q
    if with_q:
        qs = torch.stack([_fit(draft.q[j], vocab).to(device, torch.float32) for j in with_q])  # [m, V]
        raw_q[with_q] = qs[torch.arange(len(with_q), device=device), draft_tokens[with_q]]
        q_of = torch.zeros(k, dtype=torch.long)  # the row of `qs` holding draft j's q
        q_of[with_q] = torch.arange(len(with_q))
        q_of = q_of.to(device)
    one_hot = ~(raw_q > 0.0)  # no q, or q(d) = 0 (or NaN): verified as deterministic, q = one-hot(d)
    draft_q = torch.where(one_hot, 1.0, raw_q)
    accept_prob = (p_draft / draft_q).clamp_max(1.0)
    uniforms = torch.rand(k, generator=generator, device=generator.device).to(device)
    forced = torch.tensor(draft.forced, device=device)
    rejected = ~(forced | (uniforms < accept_prob))
    num_accepted = torch.where(rejected.any(), rejected.int().argmax(), k)  # first rejection, or k
    # the bonus: from the residual norm(max(0, p − q)) at row n (p itself if that is empty), or from p at row k
    at = num_accepted.clamp(max=k - 1)
    p_at = p.index_select(0, at)[0]
    residual = p_at.index_fill(0, draft_tokens.index_select(0, at), 0.0)  # max(0, p − one-hot(d)): d zeroed
    if with_q:
        with_draft_q = (p_at - qs.index_select(0, q_of.index_select(0, at))[0]).clamp_min(0.0)
        residual = torch.where(one_hot.index_select(0, at), residual, with_draft_q)
    total = residual.sum()
    residual = torch.where(total > 0.0, residual / total.clamp_min(1e-30), p_at)
    p_next = p.index_select(0, num_accepted.clamp(max=rows - 1))[0]
    dist = torch.where(num_accepted < k, residual, p_next)
    bonus = torch.multinomial(dist.to(generator.device), 1, generator=generator)[0].to(device)
    n, token = torch.stack([num_accepted, bonus]).tolist()  # the one host sync
    if n == k and not bonus_row:
        return n, None
    return n, token


def _fit(q: torch.Tensor, width: int) -> torch.Tensor:
    """A draft distribution over the target's vocabulary width (the mask forbids ids past either width)."""
    if q.shape[-1] >= width:
        return q[..., :width]
    return torch.nn.functional.pad(q, (0, width - q.shape[-1]))


def commit(state: ConstraintState, target: CausalLM, draft: Draft, num_accepted: int, bonus: int | None,
           base: int, eos: int) -> tuple[list[int], str | None]:
    """Keep the accepted drafts and the bonus token; roll the rest back.

    The grammar state rolls back the rejected drafts and consumes the bonus; the KV cache is cropped to
    ``base + 1 + num_accepted`` (``cur`` and the accepted drafts; the bonus becomes the next ``cur``).

    Returns:
        ``(new output tokens, stop reason or None)``: ``"eos"`` when EOS was accepted inside the window or is the
        bonus (EOS itself is not output), ``"grammar"`` when all drafts were accepted and nothing may follow.
    """
    accepted = draft.tokens[:num_accepted]
    if accepted and accepted[-1] == eos:  # EOS inside the window: accept through it and finish
        state.rollback(draft.num_consumed - (num_accepted - 1))
        return accepted[:-1], "eos"
    state.rollback(draft.num_consumed - num_accepted)
    if bonus is None:  # all accepted and the grammar is complete: nothing may follow
        return accepted, "grammar"
    if bonus == eos:
        return accepted, "eos"
    state.consume(bonus)
    target.crop(base + 1 + num_accepted)
    return accepted + [bonus], None


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
        adaptive: adapt γ online with :meth:`Drafter.adapt_num_draft_tokens` (default: +2 after a fully accepted
            window, −1 otherwise, transformers' "heuristic"), within ``[1, max_num_draft_tokens]``.
        max_new_tokens: output budget (``stop_reason == "length"`` when reached).
        sampling: greedy when ``temperature == 0``.
        on_step: called after each committed step with the output tokens so far (tests check that the grammar
            state and KV cache then equal those rebuilt from scratch).

    Returns:
        :class:`DecodeResult` with acceptance statistics.
    """
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    if drafter is not None:
        drafter.reset()
    needs_hidden = drafter is not None and drafter.needs_hidden_states  # an MTP head is seeded with target states
    run = start_decode(target, prompt, state, sampling, eos_token_id, rows=max_window + 1, hidden=needs_hidden)
    if run.hidden is not None:  # the MTP head's prefill: its cache over the prompt (counted as prefill time)
        t0 = time.perf_counter()
        drafter.observe(run.hidden, prompt[1:], 0)
        target.synchronize()
        run.stats.prefill_seconds += time.perf_counter() - t0
    stats, cur, gen = run.stats, run.cur, run.generator
    seq = list(prompt)
    tokens: list[int] = []
    reported = 0  # output tokens already passed to on_step
    gamma = num_draft_tokens
    stop = "length"
    while len(tokens) < max_new_tokens and not state.is_stopped():  # finish_decode: stopped grammar → "grammar"
        t0 = time.perf_counter()
        budget = max_new_tokens - len(tokens)
        draft = draft_window(state, drafter, seq, run.bitmask, gamma, min(max_window, budget - 1), sampling, gen,
                             run.eos)
        target.synchronize()  # a draft model's forwards run on the device too
        t1 = time.perf_counter()
        stats.draft_seconds += t1 - t0
        base = target.length
        target_logits, hidden = verify(target, cur, draft, run.bitmask, hidden=needs_hidden)
        stats.target_forwards += 1
        num_accepted, bonus = accept(target_logits, draft, sampling, gen)
        target.synchronize()  # CUDA runs asynchronously: time the verify, not its launch
        stats.verify_seconds += time.perf_counter() - t1
        num_drafted, num_model_accepted = stats.record_window(draft.forced, num_accepted)
        if adaptive and num_drafted:
            gamma = drafter.adapt_num_draft_tokens(gamma, num_drafted, num_model_accepted, max_num_draft_tokens)
        new_tokens, stop_reason = commit(state, target, draft, num_accepted, bonus, base, run.eos)
        tokens.extend(new_tokens)
        if stop_reason is not None:
            stop = stop_reason
            break
        seq.extend(new_tokens)
        if needs_hidden:  # the verify forward's states of cur + accepted drafts seed the next draft round
            drafter.observe(hidden[: num_accepted + 1], new_tokens, base)
        cur = new_tokens[-1]
        if on_step is not None:
            on_step(tokens)
            reported = len(tokens)
    if on_step is not None and len(tokens) > reported:  # the final window (ended by the grammar or EOS)
        target.crop(min(target.length, len(prompt) + len(tokens) - 1))  # as after every step: all but the last
        on_step(tokens)
    return finish_decode(run, tokens, stop, state, tokenizer, target)
