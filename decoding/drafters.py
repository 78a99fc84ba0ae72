"""Drafters: propose the next draft token for a sequence under a grammar mask.

One small base class (as in transformers' candidate generators): :meth:`Drafter.propose` returns a token the mask
allows plus its draft distribution q (None = deterministic, i.e. one-hot q), or None to end the draft window.
Names map to drafters in one table, :data:`decoding.registry.DRAFTERS`.
Schema-forced tokens (the mask allows exactly one token) are drafted by the speculative decoder itself, for free,
before any drafter is asked.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from constraints import ConstraintState, apply_bitmask, is_allowed_row

from .sampling import SamplingParams, pick

if TYPE_CHECKING:
    from .backends import TargetModel


class Drafter:
    """Base class of every drafter: declares everything the speculative step may call (as transformers'
    ``CandidateGenerator`` declares ``get_candidates`` / ``update_candidate_strategy``).

    A new drafter subclasses this, overrides :meth:`propose` (and whatever else it needs) and gets one row in
    :data:`decoding.registry.DRAFTERS`. Implementations keep whatever state they need and resynchronise from
    ``tokens`` (the sequence can shrink after a rejection).

    Attributes:
        name: the name shown in statistics and logs.
        needs_hidden_states: the speculative step computes the target's last-layer hidden states in the prefill and
            verify forwards and passes them to :meth:`observe` (an MTP head is seeded with them).
    """

    name: str = "drafter"
    needs_hidden_states: bool = False

    def propose(self, tokens: list[int], state: ConstraintState, bitmask_row: torch.Tensor,
                sampling: SamplingParams, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None] | None:
        """Next draft token after ``tokens`` (prompt + output + drafts so far).

        Args:
            tokens: the full sequence so far.
            state: the grammar state after ``tokens`` (read it, do not advance it).
            bitmask_row: ``int32 [ceil(V/32)]`` mask of allowed next tokens.
            sampling: greedy or sampled drafting (use :func:`decoding.sampling.pick` on masked logits).
            generator: the run's random generator (None when greedy).
        Returns:
            ``(token, q)`` with ``q`` the masked, renormalised draft distribution ``float32 [V]`` (sampling with a
            model drafter) or None (deterministic proposal), or None to stop drafting.
        """
        raise NotImplementedError

    def observe(self, hidden: torch.Tensor | None, next_tokens: list[int], start: int) -> None:
        """Learn the target's view of accepted tokens: called after the prefill (``start = 0``, the prompt) and after
        every verified window (the accepted drafts and the bonus token). A no-op by default.

        Args:
            hidden: target last-layer hidden states ``float [m, d]`` of positions ``start … start+m-1`` when
                :attr:`needs_hidden_states`, else None.
            next_tokens: the ``m`` tokens that followed those positions (accepted drafts and the bonus token).
            start: sequence position of ``hidden[0]``.
        """

    def adapt_num_draft_tokens(self, num_draft_tokens: int, num_drafted: int, num_accepted: int,
                               max_num_draft_tokens: int) -> int:
        """γ for the next window after one verified window (called with ``adaptive=True`` when the drafter
        proposed at least one token). Default: transformers' "heuristic" schedule, +2 after a fully accepted
        window, −1 otherwise, within ``[1, max_num_draft_tokens]``."""
        if num_accepted == num_drafted:
            return min(num_draft_tokens + 2, max_num_draft_tokens)
        return max(1, num_draft_tokens - 1)

    def reset(self) -> None:
        """Forget per-sequence state (called before each decode)."""


class NoDrafter(Drafter):
    """Proposes nothing: the speculative step then drafts schema-forced tokens only (mode ``forced``)."""

    name = "forced"

    def propose(self, tokens, state, bitmask_row, sampling, generator):
        return None


class SchemaDrafter(Drafter):
    """Proposes the canonical tokenisation of the bytes the grammar forces next (llguidance's fast-forward bytes),
    e.g. ``' "'`` after ``"city":`` where the mask also allows ``' '`` + ``'"'`` and ``' "Paris'``-like merges.
    The target decides: these proposals are verified like any draft."""

    name = "schema"

    def propose(self, tokens, state, bitmask_row, sampling, generator):
        ff = state.ff_tokens()
        if not ff:
            forced = state.ff_bytes()
            ff = state.tokenizer.tokenize_bytes(forced) if forced else []
        if ff and is_allowed_row(bitmask_row, ff[0]):
            return ff[0], None
        return None


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: match the last n tokens (n = ``max_ngram`` … ``min_ngram``) against earlier
    context and propose the token that followed the most recent match (tool arguments are often copied from the
    user's words). Proposals the grammar forbids end the window.

    Source: Saxena 2023, "Prompt Lookup Decoding"; transformers' ``PromptLookupCandidateGenerator``.
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def lookup(self, tokens: list[int]) -> int | None:
        """The token after the most recent earlier occurrence of the longest matching suffix n-gram."""
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            suffix = tokens[n_tok - n:]
            first = suffix[0]
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start] == first and tokens[start:start + n] == suffix:
                    return tokens[start + n]
        return None

    def propose(self, tokens, state, bitmask_row, sampling, generator):
        tok = self.lookup(tokens)
        if tok is None or not is_allowed_row(bitmask_row, tok):
            return None
        return tok, None


class DraftModelDrafter(Drafter):
    """A smaller model with the same tokenizer and its own KV cache drafts token by token, masking its logits
    with the grammar row (so every draft is grammatical). Greedy: argmax (one-hot q). Sampling: a draw from its
    masked, renormalised q, returned for the Leviathan et al. acceptance test (2211.17192, §2.3).

    The draft cache follows the sequence by longest common prefix: rollback after rejection is a crop, and
    schema-forced tokens it did not see are fed in the next draft forward, batched. After :meth:`reset` the first
    proposal starts from the backend's prefix cache (``reuse_prefix``: on llama.cpp the draft's context keeps the
    previous turn, so a turn with the same system prompt and tools prefills only its new tokens on the draft too).

    Args:
        model: the draft's KV-cached forward on the target's backend (a :class:`decoding.backends.TargetModel`:
            :class:`decoding.model.CausalLM` or :class:`decoding.llamacpp.LlamaCppLM`).
    """

    name = "draft_model"

    def __init__(self, model: TargetModel):
        self.model = model
        self.cached: list[int] | None = None  # what the draft's KV cache holds; None: not known (sync by prefix)
        self.forwards = 0

    def reset(self) -> None:
        self.cached = None

    def propose(self, tokens, state, bitmask_row, sampling, generator):
        if self.cached is None or self.model.length != len(self.cached):
            keep = self.model.reuse_prefix(tokens)  # <= len(tokens) - 1: one token at least to feed
        else:
            keep = min(_common_prefix(self.cached, tokens), len(tokens) - 1)
            self.model.crop(keep)
        logits, _ = self.model.forward(tokens[keep:], num_logits=1)
        self.forwards += 1
        self.cached = list(tokens)
        width = bitmask_row.shape[0] * 32
        if logits.shape[-1] < width:
            logits = torch.nn.functional.pad(logits, (0, width - logits.shape[-1]), value=float("-inf"))
        masked = apply_bitmask(logits[:, :width].clone(), bitmask_row.unsqueeze(0))
        return pick(masked, sampling, generator)


class ChainDrafter(Drafter):
    """Ask several drafters in order; the first proposal wins (e.g. schema fast-forward, then prompt lookup)."""

    def __init__(self, drafters: list[Drafter]):
        self.drafters = list(drafters)
        self.name = "+".join(d.name for d in self.drafters)
        self.needs_hidden_states = any(d.needs_hidden_states for d in self.drafters)

    def observe(self, hidden, next_tokens, start) -> None:
        """Pass the target's hidden states to the members that use them (MTP)."""
        for d in self.drafters:
            if d.needs_hidden_states:
                d.observe(hidden, next_tokens, start)

    def propose(self, tokens, state, bitmask_row, sampling, generator):
        for d in self.drafters:
            out = d.propose(tokens, state, bitmask_row, sampling, generator)
            if out is not None:
                return out
        return None

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
