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

from dataclasses import dataclass
from typing import Callable

import torch

from constraints import ConstraintState, apply_bitmask, is_allowed_row, single_allowed

from .decoder import MASKED_END, finish_decode, masked_end_rows, start_decode
from .backends import TargetModel
from .drafters import Drafter, NoDrafter
from .sampling import SamplingParams, probs_from_logits, sample
from .stats import DecodeResult
from .window import RowCost, WindowPolicy


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
                 generator: torch.Generator | None, eos: frozenset[int], policy: WindowPolicy | None = None) -> Draft:
    """Draft up to ``num_draft_tokens`` drafter tokens plus any schema-forced tokens (at most ``max_tokens``).

    Fills ``bitmask[i]`` (``int32 [rows, W]``) before each token and advances ``state`` by each drafted token
    (EOS is not consumed). Stops at EOS, when the grammar is stopped, when the drafter has nothing, at the caps, or
    where ``policy`` (:class:`decoding.window.WindowPolicy`) says the next token's row does not pay for itself
    (decided before the drafter is asked: the output does not depend on it).
    """
    tokens: list[int] = []
    qs: list[torch.Tensor | None] = []
    forced: list[bool] = []
    rows = 0
    n_model = 0
    if policy is not None:
        policy.start()
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
        if not is_forced and (drafter is None or n_model >= num_draft_tokens):
            break
        if policy is not None and not policy.admit(is_forced, n_model):
            break
        if not is_forced:
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
        if tok in eos:
            return Draft(tokens, qs, forced, rows, ends_with_eos=True)
        state.consume(tok)
    return Draft(tokens, qs, forced, rows)


def verify(target: TargetModel, cur: int, draft: Draft, bitmask: torch.Tensor, *, hidden: bool = False,
           eos: frozenset[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """One target forward over ``[cur, d1 … dk]`` (a trailing EOS needs no logits after it).

    Row i's logits decide draft token ``d_{i+1}``; where that token is schema-forced (row i of the mask allows it
    alone) they cannot change the outcome — greedy takes the one allowed token, and the masked, renormalised p is
    one-hot on it, so Leviathan's rule accepts it with probability 1 — so the target's LM head is skipped for those
    rows (``logit_rows``) and a zero row stands in before masking. The two halves, :func:`verify_inputs` and
    :func:`verify_logits`, let a scheduler verify several sequences' windows in one forward (``decoding.batch``).

    Returns:
        ``(target_logits, hidden, end_rows)``: target logits ``float [rows, V]`` with row i masked by
        ``bitmask[i]`` (the bonus row included); with ``hidden=True`` the target's last-layer states
        ``float [k + 1, d]``; with ``eos`` the rows where the model asks to end and the mask forbids it
        (:func:`verify_end_rows`), else ``[]``.
    """
    tokens, needed, n_rows = verify_inputs(cur, draft)
    if needed is None:
        logits, h = target.forward(tokens, hidden=hidden)
    else:
        logits, h = target.forward(tokens, hidden=hidden, logit_rows=needed)
    ends = [] if eos is None else verify_end_rows(logits, needed, n_rows, bitmask, eos)
    return verify_logits(logits, needed, n_rows, bitmask), h, ends


def verify_end_rows(logits: torch.Tensor, needed: list[int] | None, n_rows: int, bitmask: torch.Tensor,
                    eos: frozenset[int]) -> list[int]:
    """:func:`decoding.decoder.masked_end_rows` of a verify's unmasked rows (``logits`` and ``needed`` as
    :func:`verify_logits` takes them): the rows below ``n_rows`` where the model asks to end and the mask forbids
    it (rows whose LM head was skipped are forced, so never listed)."""
    return masked_end_rows(logits, list(range(n_rows)) if needed is None else needed, bitmask, eos)


def verify_inputs(cur: int, draft: Draft) -> tuple[list[int], list[int] | None, int]:
    """What :func:`verify` feeds the target: ``(tokens [cur, d1 … dk] (a trailing EOS dropped), the indices of the
    rows whose logits are needed (None: every token's), the number of masked rows n_rows)``."""
    tokens = [cur] + draft.tokens[:draft.num_consumed]
    n_rows = min(draft.rows, len(tokens))
    needed = [i for i in range(n_rows) if not (i < len(draft.forced) and draft.forced[i])]
    return tokens, (None if len(needed) == len(tokens) else needed), n_rows


def verify_logits(logits: torch.Tensor, needed: list[int] | None, n_rows: int, bitmask: torch.Tensor) -> torch.Tensor:
    """The masked verify logits ``float [n_rows, V]`` from the target's rows (``logits``: ``float [len(needed), V]``,
    or every token's when ``needed`` is None; :func:`verify_inputs`): zero rows where the LM head was skipped, row i
    masked with ``bitmask[i]``."""
    if needed is None:
        return apply_bitmask(logits.clone(), bitmask[:n_rows])
    out = torch.zeros((n_rows, logits.shape[-1]), dtype=logits.dtype, device=logits.device)
    if needed:
        out[needed] = logits
    return apply_bitmask(out, bitmask[:n_rows])


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
    schema-forced tokens are always accepted (``p(d) = 1``). Three steps: :func:`draft_q` (q of each draft token),
    :func:`first_rejection` (the uniforms), :func:`bonus_distribution` (residual or p).

    Args:
        masked: masked target logits ``float [rows, V]`` on the device.
        generator: the run's generator; every draw (``k`` uniforms, then one token) is made on its device.
    Returns:
        ``(num_accepted, bonus token or None)``; one host sync per window.
    """
    p = probs_from_logits(masked, sampling)
    k = len(draft.tokens)
    bonus_row = k < p.shape[0] and k < draft.rows  # row k exists: a bonus follows a fully accepted window
    if k == 0:
        return 0, (sample(p[0], generator) if bonus_row else None)
    draft_tokens = torch.tensor(draft.tokens, device=p.device)
    q = draft_q(draft, draft_tokens, p.shape[1])
    p_draft = p[torch.arange(k, device=p.device), draft_tokens]  # p(d) [k]
    num_accepted = first_rejection((p_draft / q.at_draft).clamp_max(1.0), draft.forced, generator)
    dist = bonus_distribution(p, num_accepted, draft_tokens, q)
    bonus = torch.multinomial(dist.to(generator.device), 1, generator=generator)[0].to(p.device)
    n, token = torch.stack([num_accepted, bonus]).tolist()  # the one host sync
    if n == k and not bonus_row:
        return n, None
    return n, token


@dataclass
class DraftQ:
    """The draft distributions of one window on the device.

    Attributes:
        at_draft: ``q(d)`` per draft token ``float32 [k]``; 1 where the draft is verified as deterministic.
        one_hot: ``bool [k]``: no q, or ``q(d) = 0``: verified as deterministic, ``q = one-hot(d)``.
        rows: the given q's stacked ``float32 [m, V]`` (None when no token has one), ``row_of``: ``long [k]``,
            draft j's row in ``rows``.
    """

    at_draft: torch.Tensor
    one_hot: torch.Tensor
    rows: torch.Tensor | None
    row_of: torch.Tensor | None


def draft_q(draft: Draft, draft_tokens: torch.Tensor, vocab: int) -> DraftQ:
    """The window's q's over the target's vocabulary width (step 1 of :func:`accept_sampled`)."""
    device, k = draft_tokens.device, len(draft.tokens)
    with_q = [j for j, qj in enumerate(draft.q) if qj is not None]
    raw_q = torch.zeros(k, device=device)  # q(d) [k]; 0 where there is no q
    rows = row_of = None
    if with_q:
        rows = torch.stack([_fit(draft.q[j], vocab).to(device, torch.float32) for j in with_q])  # [m, V]
        raw_q[with_q] = rows[torch.arange(len(with_q), device=device), draft_tokens[with_q]]
        row_of = torch.zeros(k, dtype=torch.long)
        row_of[with_q] = torch.arange(len(with_q))
        row_of = row_of.to(device)
    one_hot = ~(raw_q > 0.0)  # also NaN
    return DraftQ(torch.where(one_hot, 1.0, raw_q), one_hot, rows, row_of)


def first_rejection(accept_prob: torch.Tensor, forced: list[bool], generator: torch.Generator) -> torch.Tensor:
    """Step 2 of :func:`accept_sampled`: draft j is accepted when ``u_j < accept_prob[j]`` (``k`` uniforms drawn
    at once) or when it is schema-forced. Returns the number accepted before the first rejection (``long []``,
    ``k`` when none is rejected), on ``accept_prob``'s device."""
    k, device = accept_prob.shape[0], accept_prob.device
    uniforms = torch.rand(k, generator=generator, device=generator.device).to(device)
    rejected = ~(torch.tensor(forced, device=device) | (uniforms < accept_prob))
    return torch.where(rejected.any(), rejected.int().argmax(), k)


def bonus_distribution(p: torch.Tensor, num_accepted: torch.Tensor, draft_tokens: torch.Tensor,
                       q: DraftQ) -> torch.Tensor:
    """Step 3 of :func:`accept_sampled`: the bonus token's distribution ``float [V]``: after a rejection at row n,
    the residual ``norm(max(0, p[n] − q_n))`` (``p[n]`` itself if that is empty); after a fully accepted window,
    ``p`` at row k. Tensor ops only (no host sync)."""
    k = draft_tokens.shape[0]
    at = num_accepted.clamp(max=k - 1)
    p_at = p.index_select(0, at)[0]
    residual = p_at.index_fill(0, draft_tokens.index_select(0, at), 0.0)  # max(0, p − one-hot(d)): d zeroed
    if q.rows is not None:
        with_draft_q = (p_at - q.rows.index_select(0, q.row_of.index_select(0, at))[0]).clamp_min(0.0)
        residual = torch.where(q.one_hot.index_select(0, at), residual, with_draft_q)
    total = residual.sum()
    residual = torch.where(total > 0.0, residual / total.clamp_min(1e-30), p_at)
    p_next = p.index_select(0, num_accepted.clamp(max=p.shape[0] - 1))[0]
    return torch.where(num_accepted < k, residual, p_next)


def _fit(q: torch.Tensor, width: int) -> torch.Tensor:
    """A draft distribution over the target's vocabulary width (the mask forbids ids past either width)."""
    if q.shape[-1] >= width:
        return q[..., :width]
    return torch.nn.functional.pad(q, (0, width - q.shape[-1]))


def commit(state: ConstraintState, target: TargetModel, draft: Draft, num_accepted: int, bonus: int | None,
           base: int, eos: frozenset[int]) -> tuple[list[int], str | None]:
    """Keep the accepted drafts and the bonus token; roll the rest back.

    The grammar state rolls back the rejected drafts and consumes the bonus; the KV cache is cropped to
    ``base + 1 + num_accepted`` (``cur`` and the accepted drafts; the bonus becomes the next ``cur``).

    Returns:
        ``(new output tokens, stop reason or None)``: ``"eos"`` when EOS was accepted inside the window or is the
        bonus (EOS itself is not output), ``"grammar"`` when all drafts were accepted and nothing may follow.
    """
    accepted = draft.tokens[:num_accepted]
    if accepted and accepted[-1] in eos:  # EOS inside the window: accept through it and finish
        state.rollback(draft.num_consumed - (num_accepted - 1))
        return accepted[:-1], "eos"
    state.rollback(draft.num_consumed - num_accepted)
    if bonus is None:  # all accepted and the grammar is complete: nothing may follow
        return accepted, "grammar"
    if bonus in eos:
        return accepted, "eos"
    state.consume(bonus)
    target.crop(base + 1 + num_accepted)
    return accepted + [bonus], None


def speculative_decode(target: TargetModel, prompt: list[int], state: ConstraintState, drafter: Drafter | None, *,
                       num_draft_tokens: int = 4, max_new_tokens: int = 256,
                       sampling: SamplingParams = SamplingParams(), adaptive: bool = False,
                       max_num_draft_tokens: int = 8, max_window: int = 32, eos_token_id: int | None = None,
                       tokenizer=None, on_step: Callable[[list[int]], bool | None] | None = None,
                       row_cost: RowCost | None = None,
                       end_when: Callable[[list[int]], bool] | None = None) -> DecodeResult:
    """Constrained speculative decoding (module docstring): draft, verify, accept, commit until EOS, a complete
    grammar or ``max_new_tokens``. ``drafter`` proposes non-forced tokens (None: schema-forced tokens only);
    γ = ``num_draft_tokens`` drafter tokens per window (forced ones do not count; ``max_window`` caps both),
    adapted online with ``adaptive`` (:meth:`Drafter.adapt_num_draft_tokens`, within ``max_num_draft_tokens``);
    with ``row_cost`` (the backend's measured :class:`decoding.window.RowCost`) a token is drafted only where its
    verify row pays (:class:`decoding.window.WindowPolicy`); greedy when ``sampling.temperature == 0``.
    ``on_step(tokens)`` runs after each committed step (grammar state and KV cache then equal those rebuilt from
    scratch); True from it stops there (``"stop"``). ``end_when`` as in :func:`decoding.decoder.decode`: asked
    at each accepted position where the model asks to end and the grammar forbids it (:func:`verify_end_rows`),
    True stops before that position (``"masked_end"``). → :class:`DecodeResult`."""
    run = SpeculativeSequence(target, prompt, state, drafter, num_draft_tokens=num_draft_tokens,
                              max_new_tokens=max_new_tokens, sampling=sampling, adaptive=adaptive,
                              max_num_draft_tokens=max_num_draft_tokens, max_window=max_window,
                              eos_token_id=eos_token_id, tokenizer=tokenizer, on_step=on_step, row_cost=row_cost,
                              end_when=end_when)
    while (draft := run.draft()) is not None:
        with run.stats.timer("verify_seconds", target.synchronize):  # CUDA is asynchronous: time the work
            target_logits, hidden, ends = verify(target, run.cur, draft, run.setup.bitmask,
                                                 hidden=run.drafter.needs_hidden_states,
                                                 eos=None if end_when is None else run.setup.eos)
            verdict = run.accept(target_logits, ends)
        run.commit(verdict, hidden)
    return run.finish()


class SpeculativeSequence:
    """One sequence's :func:`speculative_decode`, a step at a time, split where the target's verify forward goes,
    so that a scheduler can verify many sequences' windows in one forward (``decoding.batch``)::

        run = SpeculativeSequence(target, prompt, state, drafter, …)   # set-up and prefill (start_decode)
        while (draft := run.draft(max_rows)) is not None:               # draft_window, or None: the decode is over
            logits = verify_logits(<target rows of verify_inputs(run.cur, draft)>, …)
            run.commit(run.accept(logits), hidden)                      # accept, commit, on_step, drafter.observe
        result = run.finish()                                           # finish_decode → DecodeResult

    Arguments as :func:`speculative_decode`. ``draft(max_rows)`` caps the verify rows of the step (``cur`` + the
    drafts) at ``max_rows >= 1``: a shorter window changes neither the greedy output nor the sampled distribution.
    A scheduler that batches sequences passes no ``row_cost`` (a row's cost there is shared with the others).

    Raises:
        ValueError: ``num_draft_tokens < 0``; an empty prompt.
    """

    def __init__(self, target: TargetModel, prompt: list[int], state: ConstraintState, drafter: Drafter | None, *,
                 num_draft_tokens: int = 4, max_new_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
                 adaptive: bool = False, max_num_draft_tokens: int = 8, max_window: int = 32,
                 eos_token_id: int | None = None, tokenizer=None,
                 on_step: Callable[[list[int]], bool | None] | None = None, row_cost: RowCost | None = None,
                 end_when: Callable[[list[int]], bool] | None = None):
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        self.target, self.prompt_length, self.state, self.sampling = target, len(prompt), state, sampling
        self.max_new_tokens, self.adaptive, self.max_window = max_new_tokens, adaptive, max_window
        self.max_num_draft_tokens, self.tokenizer, self.on_step = max_num_draft_tokens, tokenizer, on_step
        self.end_when = end_when
        self.end_at: int | None = None  # the window row where end_when stopped the decode
        self.drafter = drafter or NoDrafter()
        self.drafter.reset()
        self.setup = start_decode(target, prompt, state, sampling, eos_token_id, rows=max_window + 1,
                                  hidden=self.drafter.needs_hidden_states, observe=self.drafter.observe)
        self.stats, self.cur, self.seq, self.gamma = self.setup.stats, self.setup.cur, list(prompt), num_draft_tokens
        self.tokens: list[int] = []
        self.stop: str | None = None
        self.policy = None if row_cost is None else WindowPolicy(row_cost, self.stats)
        self.window: Draft | None = None  # the drafted window awaiting its verify
        self.base = 0  # the KV cache's length when the window was drafted

    @property
    def done(self) -> bool:
        """The decode is over (a stop reason, the budget, or a stopped grammar): :meth:`finish` gives the result."""
        return self.stop is not None or len(self.tokens) >= self.max_new_tokens or self.state.is_stopped()

    def draft(self, max_rows: int | None = None) -> Draft | None:
        """Draft the next window (:func:`draft_window`, timed as ``draft_seconds``) of at most ``max_rows`` verify
        rows (None: no cap beyond ``max_window``); None when the decode is over."""
        if self.done:  # finish_decode: stopped grammar → "grammar"
            return None
        window = min(self.max_window, self.max_new_tokens - len(self.tokens) - 1)
        if max_rows is not None:
            window = max(0, min(window, max_rows - 1))
        run = self.setup
        with self.stats.timer("draft_seconds", self.target.synchronize):  # a draft model's forwards: the device too
            self.window = draft_window(self.state, self.drafter, self.seq, run.bitmask, self.gamma, window,
                                       self.sampling, run.generator, run.eos, self.policy)
        self.base = self.target.length
        return self.window

    def accept(self, target_logits: torch.Tensor, end_rows: list[int] = ()) -> tuple[int, int | None]:
        """:func:`accept` on the window's masked verify logits ``float [rows, V]``: ``(num_accepted, bonus)``.

        ``end_rows``: the rows where the model asks to end and the grammar forbids it (:func:`verify_end_rows`,
        ascending); at the first one the decode reaches (row ``r <= num_accepted``) for which ``end_when`` says
        stop, the verdict is ``(r, None)``: the drafts before it are kept, and :meth:`commit` ends the decode there
        (``"masked_end"``), as the one-token-per-forward decoder would."""
        verdict = accept(target_logits, self.window, self.sampling, self.setup.generator)
        if self.end_when is not None:
            for r in end_rows:
                if r > verdict[0]:
                    break
                if self.end_when(self.tokens + self.window.tokens[:r]):
                    self.end_at = r
                    return r, None
        return verdict

    def commit(self, verdict: tuple[int, int | None], hidden: torch.Tensor | None = None) -> None:
        """Count the window, adapt γ, :func:`commit` the accepted tokens (grammar rollback, KV crop), report them
        (``on_step``) and let the drafter observe them (``hidden``: the verify's ``float [k + 1, d]`` or None).
        Exceptions from ``on_step`` propagate (the sequence is then abandoned)."""
        num_accepted, bonus = verdict
        draft, stats = self.window, self.stats
        self.window = None
        stats.target_forwards += 1
        num_drafted, num_model_accepted = stats.record_window(draft.forced, num_accepted)
        if self.adaptive and num_drafted:
            self.gamma = self.drafter.adapt_num_draft_tokens(self.gamma, num_drafted, num_model_accepted,
                                                             self.max_num_draft_tokens)
        if self.end_at is not None:  # the model asked to end inside the window and end_when stopped it there
            self.state.rollback(draft.num_consumed - num_accepted)
            self.target.crop(self.base + 1 + num_accepted)
            new_tokens, stop = draft.tokens[:num_accepted], MASKED_END
        else:
            new_tokens, stop = commit(self.state, self.target, draft, num_accepted, bonus, self.base,
                                      self.setup.eos)
        self.tokens.extend(new_tokens)
        if report_step(self.on_step, self.tokens, new_tokens, self.target, self.prompt_length,
                       final=stop is not None) and stop is None:
            stop = "stop"
        self.stop = stop
        if stop is not None:
            return
        self.seq.extend(new_tokens)
        self.drafter.observe(None if hidden is None else hidden[:num_accepted + 1], new_tokens, self.base)  # MTP
        self.cur = new_tokens[-1]

    def finish(self) -> DecodeResult:
        """The :class:`DecodeResult` (:func:`finish_decode`)."""
        return finish_decode(self.setup, self.tokens, self.stop or "length", self.state, self.tokenizer, self.target)


def report_step(on_step: Callable[[list[int]], bool | None] | None, tokens: list[int], new_tokens: list[int],
                target: TargetModel, prompt_length: int, *, final: bool) -> bool:
    """Call ``on_step(tokens)`` after a step that committed ``new_tokens`` (none: nothing to report) and return
    whether it asks to stop. After the final window (``final=True``: it ended with EOS or a complete grammar, and
    :func:`commit` left the KV cache as verified) the cache is first cropped, as after every step, to all but the
    last token."""
    if on_step is None or not new_tokens:
        return False
    if final:
        target.crop(min(target.length, prompt_length + len(tokens) - 1))
    return bool(on_step(tokens))
