"""ConstraintState: one llguidance matcher per sequence, with bitmask fill, consume, rollback and status.

llguidance reports misuse through an error state (see its ``LLMatcher`` docs); this wrapper turns every error state
into a :class:`ConstraintError` and never leaves a matcher half-advanced: a rejected token leaves the state as it was.
"""
from __future__ import annotations

import time
from typing import Iterable

import llguidance
import torch

from schemas.errors import SpecAgentError

from .bitmask import allocate_bitmask, allow_tokens, is_allowed as is_allowed_row
from .grammar import Grammar


class ConstraintError(SpecAgentError, RuntimeError):
    """The grammar cannot take a token (or is in an error state); the message says which token and why."""


class GrammarEngineError(ConstraintError):
    """llguidance itself failed on the grammar (its matcher is in an error state), e.g. a limit of its lexer or
    parser ("too many expressions constructed" for ``"pattern": "^a{100000}$"``, "Too many items"): the schema the
    grammar came from is too complex for it, not a token the decoder chose. The message holds the first line of
    llguidance's error; :attr:`detail` all of it (with the parser state).

    Attributes:
        detail: llguidance's whole error text.
    """

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def _engine_error(what: str, error: str) -> GrammarEngineError:
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    return GrammarEngineError(f"{what}: {first}", error)


class ConstraintState:
    """The grammar state of one sequence.

    Args:
        tokenizer: the llguidance tokenizer (``constraints.tokenizer.llg_tokenizer``).
        grammar: a compiled :class:`Grammar`.
        eog_tokens: the model's end-of-generation tokens besides the tokenizer's EOS (e.g. Qwen's ``<|endoftext|>``
            beside ``<|im_end|>``): each is allowed wherever EOS is (the grammar accepts) and counts as EOS.

    Attributes:
        num_tokens: tokens consumed so far (after rollbacks), EOS included.
        mask_seconds: total wall time spent computing masks (s).
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: Grammar, eog_tokens: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.eog_tokens = frozenset({tokenizer.eos_token, *eog_tokens})
        self._extra_eog = sorted(self.eog_tokens - {tokenizer.eos_token})
        self.grammar = grammar
        self.vocab_size = tokenizer.vocab_size
        self.matcher = llguidance.LLMatcher(tokenizer, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise _engine_error("grammar does not load", self.matcher.get_error())
        self.num_tokens = 0
        self._eos_unrecorded = False  # EOS consumed on a stopped matcher: llguidance keeps no token for it
        self._tokens: list[int] = []  # consumed tokens (one is consumed again when an unrecorded EOS is undone)
        self.mask_seconds = 0.0
        self.mask_calls = 0
        self._row = allocate_bitmask(1, self.vocab_size)

    # -- masks ---------------------------------------------------------------------------------------------------
    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the next-token mask into ``bitmask[row]`` (``int32 [rows, ceil(V/32)]``, CPU, contiguous); where EOS
        is allowed, so is every other end-of-generation token (``eog_tokens``)."""
        t0 = time.perf_counter()
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        if self._extra_eog and is_allowed_row(v, self.tokenizer.eos_token):
            allow_tokens(v, self._extra_eog)
        self.mask_seconds += time.perf_counter() - t0
        self.mask_calls += 1
        self.raise_if_error("computing the mask")

    def next_mask(self) -> torch.Tensor:
        """The next-token mask as a fresh ``int32 [ceil(V/32)]`` row."""
        self.fill_bitmask(self._row, 0)
        return self._row[0].clone()

    def ff_tokens(self) -> list[int]:
        """llguidance's fast-forward tokens: the canonical tokenisation of the bytes the grammar forces next."""
        return self.matcher.compute_ff_tokens()

    def ff_bytes(self) -> bytes:
        """The bytes the grammar forces next (may be non-empty where several tokenisations exist)."""
        return self.matcher.compute_ff_bytes()

    # -- advancing -----------------------------------------------------------------------------------------------
    def consume(self, token: int) -> None:
        """Advance by one token (an end-of-generation token counts as EOS). Raises :class:`ConstraintError` (state
        unchanged) if the grammar forbids it."""
        if token in self.eog_tokens:
            token = self.tokenizer.eos_token
        ok = self.matcher.is_accepting() if token == self.tokenizer.eos_token else \
            self.matcher.validate_tokens([token]) == 1
        if not ok:
            raise ConstraintError(f"token {token} ({self._show(token)}) is not allowed here"
                                  f"{self._context()}")
        unrecorded = token == self.tokenizer.eos_token and self.matcher.is_stopped()
        if not self.matcher.consume_token(token):
            raise _engine_error(f"consuming token {token} failed", self.matcher.get_error())
        self._eos_unrecorded = unrecorded
        self._tokens.append(token)
        self.num_tokens += 1

    def consume_many(self, tokens: list[int]) -> None:
        """Advance by several tokens, all or nothing (raises :class:`ConstraintError`, state unchanged)."""
        if tokens and tokens[-1] in self.eog_tokens:  # EOS goes through consume (its own bookkeeping)
            self.consume_many(tokens[:-1])
            try:
                self.consume(tokens[-1])
            except ConstraintError:
                self.rollback(len(tokens) - 1)
                raise
            return
        n = self.matcher.validate_tokens(list(tokens)) if tokens else 0
        if n != len(tokens):
            bad = tokens[n]
            raise ConstraintError(f"token {bad} ({self._show(bad)}) at index {n} is not allowed{self._context()}")
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise _engine_error("consuming tokens failed", self.matcher.get_error())
        self._tokens.extend(tokens)
        self.num_tokens += len(tokens)

    def valid_prefix_len(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar would accept from here (state unchanged)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens (0 <= n <= num_tokens), EOS counting as one.

        EOS consumed once the grammar was stopped is not on llguidance's token stack (the matcher only marks it
        consumed, and its ``rollback(n)`` removes that mark and ``n`` body tokens), so there the body token
        removed too many is consumed again."""
        if n < 0 or n > self.num_tokens:
            raise ValueError(f"cannot roll back {n} tokens: {self.num_tokens} consumed")
        if n and self._eos_unrecorded:
            self._eos_unrecorded = False
            if n == self.num_tokens:
                self.matcher.reset()
            elif not (self.matcher.rollback(n) and self.matcher.consume_token(self._tokens[-n - 1])):
                raise ConstraintError(f"rollback of {n} tokens failed: {self.matcher.get_error()}")
        elif n and not self.matcher.rollback(n):
            raise ConstraintError(f"rollback of {n} tokens failed: {self.matcher.get_error()}")
        del self._tokens[len(self._tokens) - n:]
        self.num_tokens -= n

    def reset(self) -> None:
        """Back to the start state."""
        self.matcher.reset()
        self.num_tokens = 0
        self._tokens.clear()
        self._eos_unrecorded = False

    # -- status --------------------------------------------------------------------------------------------------
    def is_accepting(self) -> bool:
        """The tokens so far form a complete match (EOS is allowed)."""
        return self.matcher.is_accepting()

    def is_stopped(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete and cannot extend)."""
        return self.matcher.is_stopped()

    @property
    def eos_token(self) -> int:
        return self.tokenizer.eos_token

    # -- helpers -------------------------------------------------------------------------------------------------
    def raise_if_error(self, what: str) -> None:
        """Raise :class:`ConstraintError` (naming ``what`` and llguidance's message) when the matcher is in its
        error state; no-op otherwise."""
        if self.matcher.is_error():
            raise _engine_error(f"grammar error while {what}", self.matcher.get_error())

    def _show(self, token: int) -> str:
        try:
            return repr(self.tokenizer.decode_str([token]))
        except Exception:
            return "?"

    def _context(self) -> str:
        return f" after {self.num_tokens} tokens"
