"""Decode statistics and results (small dataclasses; summed across turns with ``+``)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator


@dataclass
class DecodeStats:
    """Counters and timings of one or more decodes.

    Attributes:
        prompt_tokens: prompt tokens (prefilled, or found in the KV cache).
        prompt_tokens_cached: prompt tokens whose keys/values were reused from the previous decode (prefix caching).
        new_tokens: tokens emitted (EOS excluded).
        target_forwards: target model forwards after prefill (one per decode step / verification).
        drafted: tokens proposed by a drafter (schema-forced tokens not included).
        accepted: drafted tokens the target accepted.
        forced: schema-forced tokens (the mask allowed exactly one token), accepted without a drafter call.
        drafted_by_position / accepted_by_position: per draft position in the window (0 = first drafted token).
        masked_end_argmax: positions where the model's unmasked argmax was an end-of-generation token the grammar
            forbade (counted only for turns cut by the budget, when asked: ``EngineConfig.count_masked_ends``).
        closed_at_end: calls the engine closed where the model asked to end inside them (``agent.engine``:
            ``EngineConfig.close_at_model_end``; the closing brackets were written by the engine, not decoded).
        seconds: wall time of the decode (s), prefill included; ``prefill_seconds`` (the target's prompt forward,
            and an MTP head's pass over the prompt), ``draft_seconds``, ``verify_seconds``, ``mask_seconds`` split it
            (mask time is also inside draft time).
    """

    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    forced: int = 0
    masked_end_argmax: int = 0
    closed_at_end: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    mask_seconds: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Emitted tokens per target forward after prefill (the end token is not counted, its forward is: a turn of
        a few tokens, or one cut by the grammar's end, can show less than 1)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (drafter proposals only)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_s(self) -> float:
        """Emitted tokens per second of decode time (prefill excluded)."""
        t = self.seconds - self.prefill_seconds
        return self.new_tokens / t if t > 0 else 0.0

    @contextmanager
    def timer(self, name: str, synchronize: Callable[[], None] | None = None) -> Iterator[None]:
        """Add the wall time (s) of the ``with`` block to the timing field ``name`` (e.g. ``"verify_seconds"``);
        ``synchronize`` (e.g. ``target.synchronize``) is called at the end of the block first, so that queued device
        work is timed, not its launch."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if synchronize is not None:
                synchronize()
            setattr(self, name, getattr(self, name) + time.perf_counter() - t0)

    def record_position(self, position: int, accepted: bool) -> None:
        while len(self.drafted_by_position) <= position:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        self.drafted_by_position[position] += 1
        self.accepted_by_position[position] += int(accepted)

    def record_window(self, forced: list[bool], num_accepted: int) -> tuple[int, int]:
        """Count one verified draft window: ``forced[j]`` says whether draft token j was schema-forced, and the
        first ``num_accepted`` draft tokens were accepted. Drafter positions up to the first rejection are recorded
        by position (later ones were never judged). Returns ``(drafter tokens, drafter tokens accepted)``."""
        position = drafted = accepted = 0
        for j, is_forced in enumerate(forced):
            if is_forced:
                self.forced += int(j < num_accepted)
                continue
            drafted += 1
            accepted += int(j < num_accepted)
            if j <= num_accepted:
                self.record_position(position, j < num_accepted)
            position += 1
        self.drafted += drafted
        self.accepted += accepted
        return drafted, accepted

    def __add__(self, other: "DecodeStats") -> "DecodeStats":
        out = DecodeStats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, list):
                n = max(len(a), len(b))
                setattr(out, f.name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)])
            else:
                setattr(out, f.name, a + b)
        return out

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(tokens_per_forward=self.tokens_per_forward, acceptance_rate=self.acceptance_rate,
                 acceptance_by_position=self.acceptance_by_position, tokens_per_s=self.tokens_per_s)
        return d


@dataclass
class DecodeResult:
    """Output of one constrained decode.

    Attributes:
        tokens: emitted token ids (EOS excluded).
        text: ``tokens`` decoded.
        stop_reason: ``"eos"`` (model ended, grammar accepting), ``"grammar"`` (grammar complete, nothing else
            allowed), ``"length"`` (``max_new_tokens`` reached), ``"stop"`` (a stop condition) or ``"masked_end"``
            (the model asked to end where the grammar forbade it, and the caller's ``end_when`` stopped there).
        stats: :class:`DecodeStats`.
    """

    tokens: list[int]
    text: str
    stop_reason: str
    stats: DecodeStats

    @property
    def truncated(self) -> bool:
        """True when the output is cut (``max_new_tokens``, or ``"masked_end"``): never to be presented as a valid
        call as it stands."""
        return self.stop_reason in ("length", "masked_end")
