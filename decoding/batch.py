"""Continuous batching of constrained speculative decodes on the llama.cpp backend.

One llama.cpp context holds ``max_batch`` sequences (:class:`decoding.llamacpp.SequenceBatchContext`: ``n_seq_max =
max_batch``, one KV stream of ``seq_ctx`` positions per sequence). Each request is a sequence with its own seq_id
(a *slot*), KV cache, grammar state, drafter and window: a :class:`decoding.speculative.SpeculativeSequence`, the
very step :func:`decoding.speculative.speculative_decode` runs. One scheduler thread loops::

    admit:   waiting requests take free slots (the slot whose cached tokens share the longest prefix with the
             prompt: per-slot prefix caching, as llama.cpp's server; or a copy of another slot's KV stream holding
             more of it, llama_memory_seq_cp); the rest of the prompt is prefilled (big parts in decodes of their own,
             small chunks inside the steps' decodes, as rows without logits)
    compact: the sequences holding a slot move to the lowest seq_ids (a KV stream copy, llama_memory_seq_cp):
             llama.cpp runs a decode in one micro-batch only over consecutive seq_ids
    draft:   every running sequence drafts its window (draft_window), within the step's row cap
    verify:  ALL sequences' verify rows [cur, d1 … dk] in ONE llama_decode (per-token seq_id, pos, logits flags);
             the logits are split back per sequence and masked with its own bitmask (verify_logits)
    commit:  each sequence accepts (accept_greedy / accept_sampled), commits (grammar rollback, its own KV crop:
             llama_memory_seq_rm(mem, seq_id, p0, -1)), reports (on_step) — and leaves when done

A sequence whose ``on_step`` raises (a client gone, a timeout) or whose decode fails leaves at once: its KV cache is
removed (``seq_rm`` of the whole sequence), its slot freed, the exception re-raised in the caller's thread; the other
sequences go on untouched. A finished sequence keeps its KV cache in its slot for the next request's prefix.

Identity: with ``threads=1`` (and no repacking, the backend's default) a row's logits depend only on its own
sequence and on whether that sequence had fewer than 64 tokens in the micro-batch (:data:`SMALL_UBATCH`: llama.cpp's
CPU attention takes another path from 64 on), never on the other sequences (separate KV streams keep each
sequence's cells in order). Verify rows are always fewer (``max_window + 1 <= 33``); prompt tokens are computed in
the class a one-sequence context gives them when it prefills the prompt from an empty cache (one decode of up to
:data:`PREFILL_BATCH` tokens: >= 64 tokens alone in their decode, the rest in any chunks of < 64), and a slot's
cached prefix is reused only where its classes agree. So greedy output of every request equals its output decoded
alone from an empty cache, whatever else is in the batch, whatever the row cap (which only shortens windows) and
whatever the slot held before; sampled output has its distribution (the same draws when no window is shortened).
``tests/test_batching.py`` checks it.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from constraints import ConstraintState
from schemas.errors import SpecAgentError

from .drafters import Drafter
from .llamacpp import (PREFILL_BATCH, SMALL_UBATCH, LlamaCppModel, SequenceBatchContext,  # noqa: F401 (re-exported)
                       common_prefix, equal_pieces, prefill_classes)
from .sampling import SamplingParams
from .speculative import SpeculativeSequence, verify_end_rows, verify_inputs, verify_logits
from .stats import DecodeResult

DEFAULT_SEQ_CTX = 2048  # KV positions per sequence (prompt + new tokens of one request)
DEFAULT_MAX_ROWS = 128  # tokens per step's llama_decode, all sequences together (verify rows + prefill chunks)


NO_HIDDEN_STATES = "the llama.cpp backend does not expose hidden states under continuous batching"


class KVCacheFullError(SpecAgentError, ValueError):
    """A request does not fit one sequence's KV cache (prompt + new tokens > ``seq_ctx``): refused, never started."""


class SchedulerClosedError(SpecAgentError, RuntimeError):
    """The scheduler was closed: no new sequence is admitted."""


class SlotTarget:
    """The :class:`decoding.backends.TargetModel` of one slot (seq_id) of a :class:`SequenceBatchContext`: what the
    decoders and drafters see of the target for one sequence. Its own ``forward`` is a one-sequence
    ``llama_decode`` (chunks of ``n_batch``); the scheduler verifies many slots in one decode instead.
    Used in the scheduler's thread only."""

    def __init__(self, ctx: SequenceBatchContext, seq_id: int):
        self.ctx, self.seq_id = ctx, seq_id
        self.device = torch.device("cpu")
        self.vocab_size = ctx.vocab_size

    @property
    def length(self) -> int:
        """Tokens whose keys/values are in this slot's KV cache."""
        return len(self.ctx.tokens[self.seq_id])

    def forward(self, tokens: list[int], *, num_logits: int | None = None, hidden: bool = False,
                logit_rows: list[int] | None = None) -> tuple[torch.Tensor, None]:
        """As :meth:`decoding.llamacpp.LlamaCppLM.forward`, on this slot: ``(logits float32 [rows, V], None)``.

        Raises:
            ValueError: ``hidden=True``, no tokens, or the slot's ``seq_ctx`` positions would overflow.
            RuntimeError: ``llama_decode`` failed (the slot is cropped back).
        """
        if hidden:
            raise ValueError(NO_HIDDEN_STATES)
        if not tokens:
            raise ValueError("forward needs at least one token")
        if self.length + len(tokens) > self.ctx.seq_ctx:
            raise KVCacheFullError(f"{self.length + len(tokens)} positions do not fit one sequence's KV cache "
                                   f"({self.ctx.seq_ctx})")
        if logit_rows is None:
            n = len(tokens) if num_logits is None else num_logits
            logit_rows = list(range(len(tokens) - n, len(tokens)))
        out = []
        for a in range(0, len(tokens), self.ctx.n_batch):
            chunk = tokens[a:a + self.ctx.n_batch]
            rows = [r - a for r in logit_rows if a <= r < a + len(chunk)]
            out.append(self.ctx.decode([(self.seq_id, chunk, rows)])[0])
        return torch.from_numpy(out[0] if len(out) == 1 else np.concatenate(out)), None

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (``llama_memory_seq_rm``); ``ValueError`` beyond the cache."""
        if length < self.length:
            self.ctx.crop(self.seq_id, length)
        elif length > self.length:
            raise ValueError(f"cannot crop the KV cache to {length}: it holds {self.length}")

    def reset(self) -> None:
        self.ctx.crop(self.seq_id, 0)

    def reuse_prefix(self, prompt: list[int], hidden: bool = False) -> int:
        """Keep the longest prefix of ``prompt[:-1]`` this slot still holds, drop the rest; returns its length.
        ``hidden=True`` is refused (no hidden states under batching: ``ValueError``)."""
        if hidden:
            raise ValueError(NO_HIDDEN_STATES)
        n = common_prefix(self.ctx.tokens[self.seq_id], prompt[:-1])
        self.ctx.crop(self.seq_id, n)
        return n

    def cached_hidden(self, n: int) -> torch.Tensor:
        """No hidden states under batching: ``ValueError``."""
        raise ValueError(NO_HIDDEN_STATES)

    def synchronize(self) -> None:
        """Nothing to wait for: ``llama_decode`` returns when its logits are ready."""


@dataclass
class _Request:
    """One sequence from submission to result (fields touched by the scheduler thread, ``done`` set once)."""

    prompt: list[int]
    state: ConstraintState
    drafter: Drafter | None
    kwargs: dict
    slot: int = -1
    fed: int = 0  # prompt tokens already in the slot's KV cache (prefill progress; the last one is never fed)
    big: int = 0  # prompt[:big] are computed in >= SMALL_UBATCH-token decodes of their own (prefill_classes)
    cached: int = 0  # of which were there when the request took the slot
    prefill_seconds: float = 0.0
    run: SpeculativeSequence | None = None
    result: DecodeResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class BatchScheduler:
    """Continuous batching on one llama.cpp context (module docstring). Thread-safe :meth:`decode`: each caller's
    thread blocks until its sequence is done; the scheduler's own thread runs every llama.cpp call.

    Args:
        model: the loaded GGUF model (``threads=1`` is the identity configuration).
        max_batch: sequences decoded together (slots, llama.cpp's ``n_seq_max``); more requests wait in line.
        seq_ctx: KV positions per sequence (prompt + new tokens of one request; the context holds
            ``max_batch × seq_ctx``, like llama.cpp's server splitting ``-c`` across ``-np`` slots; default
            :data:`DEFAULT_SEQ_CTX`, at most the model's context).
        max_rows: tokens per step's ``llama_decode`` over all sequences (verify rows + small prefill chunks), >= 1:
            a sequence's window is shortened (never below ``cur`` alone) and, past it, a sequence waits a step
            (round-robin). Default :data:`DEFAULT_MAX_ROWS`. A joining prompt's big part (>= 64 tokens, see
            :func:`prefill_classes`) is prefilled in decodes of its own (up to :data:`PREFILL_BATCH` tokens each)
            between two steps.
        exact_prefill: compute every prompt token in the class an empty-cache prefill gives it (the identity with
            a request decoded alone from an empty cache; a joining request prefills at least SMALL_UBATCH tokens
            unless its whole prompt is cached). False: reuse the longest cached prefix as is and prefill only the
            rest, in small chunks inside the steps (fewer rows; output always valid, but at a near-tie it may differ
            from an empty-cache decode, as the one-sequence backend's own prefix cache may).
    Raises:
        ValueError: a size below 1.
        RuntimeError: llama.cpp could not create the context.
    """

    def __init__(self, model: LlamaCppModel, *, max_batch: int = 8, seq_ctx: int | None = None,
                 max_rows: int = DEFAULT_MAX_ROWS, exact_prefill: bool = True):
        for name, value in (("max_batch", max_batch), ("max_rows", max_rows), ("seq_ctx", seq_ctx)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        seq_ctx = min(seq_ctx or DEFAULT_SEQ_CTX, model.context_length)
        self.model, self.max_batch, self.max_rows, self.exact_prefill = model, max_batch, max_rows, exact_prefill
        self.ctx = SequenceBatchContext(model, max_batch, seq_ctx, n_batch=max(max_rows, PREFILL_BATCH))
        self.seq_ctx = self.ctx.seq_ctx
        self.targets = [SlotTarget(self.ctx, s) for s in range(max_batch)]
        self._cond = threading.Condition()
        self._waiting: list[_Request] = []
        self._slots: list[_Request | None] = [None] * max_batch
        self._last_used = [0.0] * max_batch
        self._big = [0] * max_batch  # per slot: its cached tokens[:big] were computed in big prefill decodes
        self._rotate = itertools.count()
        self._closed = False
        self.steps = 0  # llama_decode calls of the steps (tests, metrics)
        self.max_rows_seen = 0  # the most tokens one step decoded
        self.max_sequences_seen = 0  # the most sequences one step decoded
        self.copies = 0  # prompt prefixes copied from another slot (seq_cp) instead of prefilled
        self.moves = 0  # sequences moved to a lower slot (_compact)
        self.step_tokens = 0  # tokens of all steps' decodes (verify rows + prefill chunks; metrics: per step)
        self.step_sequences = 0  # sequences of all steps' decodes (metrics: sequences per step)
        self.aborted = 0  # sequences that left unfinished (on_step raised: cancelled, timed out; or failed)
        self._thread = threading.Thread(target=self._loop, name="batch-scheduler", daemon=True)
        self._thread.start()

    # -- the callers' side ------------------------------------------------------------------------------------------
    def decode(self, prompt: list[int], state: ConstraintState, drafter: Drafter | None, *,
               num_draft_tokens: int = 4, max_new_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
               adaptive: bool = False, max_num_draft_tokens: int = 8, max_window: int = 32,
               eos_token_id: int | None = None, tokenizer=None,
               on_step: Callable[[list[int]], bool | None] | None = None,
               end_when: Callable[[list[int]], bool] | None = None) -> DecodeResult:
        """:func:`decoding.speculative.speculative_decode` of one sequence, batched with the others; blocks until it
        is done. ``max_window=0`` with no drafter is one token per forward (the reference decode). ``end_when``:
        as there (called in the scheduler's thread).

        ``on_step`` runs in the scheduler's thread after each committed step; an exception from it ends this
        sequence (its KV cache removed, its slot freed) and is re-raised here.

        Raises:
            KVCacheFullError: ``len(prompt) + max_new_tokens`` exceeds ``seq_ctx`` (nothing decoded).
            ValueError: an empty prompt, ``num_draft_tokens < 0``.
            SchedulerClosedError: the scheduler is closed.
            RuntimeError: ``llama_decode`` failed.
        """
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        if len(prompt) + max_new_tokens > self.seq_ctx:
            raise KVCacheFullError(f"{len(prompt)} prompt + {max_new_tokens} new tokens do not fit one sequence's "
                                   f"KV cache ({self.seq_ctx} positions per sequence, max_batch "
                                   f"{self.max_batch})")
        req = _Request(list(prompt), state, drafter, dict(
            num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens, sampling=sampling, adaptive=adaptive,
            max_num_draft_tokens=max_num_draft_tokens, max_window=max_window, eos_token_id=eos_token_id,
            tokenizer=tokenizer, on_step=on_step, end_when=end_when))
        with self._cond:
            if self._closed:
                raise SchedulerClosedError("the batch scheduler is closed")
            self._waiting.append(req)
            self._cond.notify_all()
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.result

    @property
    def active(self) -> int:
        """Sequences holding a slot now (decoding, or prefilling their prompt)."""
        return sum(r is not None for r in self._slots)

    @property
    def held_slots(self) -> list[int]:
        """The seq_ids of the sequences holding a slot, increasing: ``0 … active - 1`` whenever a step decodes
        (``_compact``)."""
        return [s for s, r in enumerate(list(self._slots)) if r is not None]

    @property
    def waiting(self) -> int:
        """Sequences waiting for a free slot."""
        return len(self._waiting)

    @property
    def kv_positions(self) -> int:
        """KV cache positions held by the sequences holding a slot (a free slot's cached prefix not counted); of
        ``max_batch × seq_ctx``. Read from any thread (Python-side bookkeeping, no llama.cpp call)."""
        return sum(len(self.ctx.tokens[s]) for s, r in enumerate(list(self._slots)) if r is not None)

    def close(self, timeout: float = 10.0) -> None:
        """Stop admitting; sequences in flight finish, waiting ones fail with :class:`SchedulerClosedError`."""
        with self._cond:
            self._closed = True
            for req in self._waiting:
                self._end(req, error=SchedulerClosedError("the batch scheduler was closed"))
            self._waiting.clear()
            self._cond.notify_all()
        self._thread.join(timeout)

    # -- the scheduler thread ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and self.active == 0 and not self._closed:
                    self._cond.wait()
                if self._closed and self.active == 0:
                    return
                self._admit()
                self._compact()
            try:
                self._step()
            except BaseException as e:  # noqa: BLE001 - a failed step fails its sequences, never the thread
                for s, req in enumerate(self._slots):
                    if req is not None:
                        self._leave(s, error=RuntimeError(f"batched decode failed: {e}"))

    def _admit(self) -> None:
        """Waiting requests take free slots: the one whose cached tokens share the longest (class-compatible)
        prefix with the prompt, where that is at least SMALL_UBATCH tokens or half the prompt; else the one holding
        the fewest cached tokens (an empty one first), so a prompt that shares little does not wipe another
        prompt's cache (a helper saw a 250-token prompt re-prefilled after each unrelated request: 4.1 s instead of
        1.0 s); ties: least recently used. Where another slot, busy or not, holds at least SMALL_UBATCH more of the
        prompt, its KV stream is copied into the free slot (``seq_cp``) instead of prefilling again. Under the
        lock."""
        while self._waiting and None in self._slots:
            req = self._waiting.pop(0)
            plans = [prefill_classes(req.prompt, self.ctx.tokens[s], self._big[s]) if self.exact_prefill else
                     (0, common_prefix(self.ctx.tokens[s], req.prompt[:-1])) for s in range(self.max_batch)]
            free = [s for s, r in enumerate(self._slots) if r is None]

            def choice(s: int) -> tuple:
                shares = plans[s][1] >= min(SMALL_UBATCH, len(req.prompt) // 2)
                return (plans[s][1] if shares else 0, 0 if shares else -len(self.ctx.tokens[s]),
                        -self._last_used[s])

            slot = max(free, key=choice)
            src = max(range(self.max_batch), key=lambda s: plans[s][1])
            req.slot = slot
            self._slots[slot] = req
            if src != slot and plans[src][1] >= plans[slot][1] + SMALL_UBATCH:
                req.big, keep = plans[src]
                self.ctx.copy(src, slot, keep)
                self.copies += 1
            else:
                req.big, keep = plans[slot]
                self.ctx.crop(slot, keep)
            self._big[slot] = req.big  # prefill_classes' plan, or the slot is cleared (_leave)
            req.fed = req.cached = keep

    def _compact(self) -> None:
        """Keep the sequences holding a slot on the lowest seq_ids: each one above ``active - 1`` moves to a free
        slot below it (:meth:`SequenceBatchContext.move`; its :class:`SlotTarget` goes with it). llama.cpp runs a
        decode's sequences in one micro-batch only where their seq_ids follow one another (``split_equal``; see
        :class:`SequenceBatchContext`): without this, the last sequences of a burst, left on scattered slots, cost
        one graph run each. The keys/values move bit for bit, so no output changes. A finished request's cached
        prompt in the free slot below moves first to a free slot above: an empty one, else the least recently
        used one where that was used before it. Under the lock."""
        n = self.active
        holes = [p for p in range(n) if self._slots[p] is None]
        above = [q for q in range(self.max_batch - 1, n - 1, -1) if self._slots[q] is not None]
        for p, q in zip(holes, above):
            # the hole's cached prompt (a finished request's) goes first to a free slot above (an empty one, else
            # the least recently used one where older), so that the next request with that prompt still finds it
            spares = [e for e in range(self.max_batch - 1, n - 1, -1) if e != q and self._slots[e] is None]
            spare = min(spares, key=lambda e: (bool(self.ctx.tokens[e]), self._last_used[e]), default=None)
            if self.ctx.tokens[p] and spare is not None and (
                    not self.ctx.tokens[spare] or self._last_used[spare] < self._last_used[p]):
                self.ctx.move(p, spare)
                self._big[spare], self._big[p] = self._big[p], 0
                self._last_used[spare] = self._last_used[p]
            self.ctx.move(q, p)
            req = self._slots[q]
            self._slots[p], self._slots[q] = req, None
            req.slot = p
            moved, freed = self.targets[q], self.targets[p]
            moved.seq_id, freed.seq_id = p, q
            self.targets[p], self.targets[q] = moved, freed
            self._big[p], self._big[q] = self._big[q], 0
            self._last_used[q] = time.monotonic()
            self.moves += 1

    def _step(self) -> None:
        """One step: draft every running sequence (round-robin within the row cap), then one ``llama_decode`` over
        their verify rows and the prefill chunks of joining ones, then accept/commit each."""
        budget = self.max_rows
        running = [s for s, r in enumerate(self._slots) if r is not None and r.fed >= len(r.prompt) - 1]
        joining = [s for s, r in enumerate(self._slots) if r is not None and r.fed < len(r.prompt) - 1]
        if running and joining:  # joining sequences get a share of every step: a long prompt never stalls the rest
            budget -= min(budget - 1, max(1, self.max_rows // 4))
        start = next(self._rotate) % max(1, len(running))
        parts, plans = [], []
        for s in running[start:] + running[:start]:
            req = self._slots[s]
            if req.run is None and not self._start(s, req):
                continue
            if budget < 1:
                continue  # waits for the next step (round-robin start)
            try:
                draft = req.run.draft(budget)
            except BaseException as e:  # noqa: BLE001 - a grammar or drafter error ends this sequence only
                self._leave(s, error=e)
                continue
            if draft is None:
                self._leave(s)
                continue
            tokens, needed, n_rows = verify_inputs(req.run.cur, draft)
            parts.append((s, tokens, list(range(len(tokens))) if needed is None else needed))
            plans.append((s, needed, n_rows))
            budget -= len(tokens)
        budget = self.max_rows - sum(len(p[1]) for p in parts)
        for s in joining:
            req = self._slots[s]
            if req.fed < req.big and not self._prefill_alone(s, req):
                continue
            if budget < 1 or req.fed >= len(req.prompt) - 1:
                continue
            chunk = req.prompt[req.fed:min(len(req.prompt) - 1, req.fed + budget, req.fed + SMALL_UBATCH - 1)]
            parts.append((s, chunk, []))
            budget -= len(chunk)
        if not parts:
            return
        t0 = time.perf_counter()
        try:
            outs = self.ctx.decode(parts)
        except BaseException as e:  # noqa: BLE001 - every sequence of this decode fails, cleanly
            for s, _, _ in parts:
                self._leave(s, error=e)
            return
        seconds = time.perf_counter() - t0
        self.steps += 1
        step_rows = sum(len(p[1]) for p in parts)
        self.step_tokens += step_rows
        self.step_sequences += len(parts)
        self.max_rows_seen = max(self.max_rows_seen, step_rows)
        self.max_sequences_seen = max(self.max_sequences_seen, len(parts))
        for (s, needed, n_rows), out in zip(plans, outs):
            req = self._slots[s]
            run = req.run
            try:
                t1 = time.perf_counter()
                raw = torch.from_numpy(out)
                ends = [] if run.end_when is None else verify_end_rows(raw, needed, n_rows, run.setup.bitmask,
                                                                        run.setup.eos)
                verdict = run.accept(verify_logits(raw, needed, n_rows, run.setup.bitmask), ends)
                run.stats.verify_seconds += seconds + time.perf_counter() - t1  # this sequence waited for it all
                run.commit(verdict)
            except BaseException as e:  # noqa: BLE001 - on_step raised (client gone, timeout): this one leaves
                self._leave(s, error=e)
                continue
            if run.done:
                self._leave(s)
        for s, chunk, rows in parts[len(plans):]:
            req = self._slots[s]
            req.fed += len(chunk)
            req.prefill_seconds += seconds

    def _prefill_alone(self, s: int, req: _Request) -> bool:
        """Prefill ``prompt[fed:big]`` (>= SMALL_UBATCH tokens) in decodes of this sequence alone, in equal chunks of
        at most PREFILL_BATCH (each >= SMALL_UBATCH). False when that failed (the sequence left)."""
        t0 = time.perf_counter()
        a = req.fed
        try:
            for size in equal_pieces(req.big - req.fed, PREFILL_BATCH):
                self.ctx.decode([(s, req.prompt[a:a + size], [])])
                a += size
        except BaseException as e:  # noqa: BLE001
            self._leave(s, error=e)
            return False
        req.fed = req.big
        req.prefill_seconds += time.perf_counter() - t0
        return True

    def _start(self, s: int, req: _Request) -> bool:
        """Set up a fully prefilled sequence (its prompt's KV all cached: ``start_decode`` feeds nothing). False
        when that failed (the sequence left)."""
        try:
            req.run = SpeculativeSequence(self.targets[s], req.prompt, req.state, req.drafter, **req.kwargs)
        except BaseException as e:  # noqa: BLE001
            self._leave(s, error=e)
            return False
        stats = req.run.stats  # the prefill ran inside the steps: count it as a one-sequence prefill would
        stats.prompt_tokens_cached = req.cached
        stats.prefill_seconds += req.prefill_seconds
        return True

    def _leave(self, s: int, error: BaseException | None = None) -> None:
        """Sequence in slot ``s`` leaves: its result (or ``error``: its KV cache is removed) is handed over and
        the slot freed."""
        req = self._slots[s]
        if req is None:
            return
        if error is None:
            try:
                req.result = req.run.finish()
            except BaseException as e:  # noqa: BLE001
                error = e
        if error is not None:
            self.ctx.crop(s, 0)  # llama_memory_seq_rm of the whole sequence: nothing of it stays
            self._big[s] = 0
            self.aborted += 1
        with self._cond:
            self._slots[s] = None
            self._last_used[s] = time.monotonic()
            self._cond.notify_all()
        self._end(req, error=error)

    @staticmethod
    def _end(req: _Request, error: BaseException | None = None) -> None:
        req.error = error
        req.done.set()
