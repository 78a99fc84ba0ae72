"""The transformers peers of the benchmark: plain ``model.generate`` and assisted ``generate`` under an llguidance
logits processor (what a user would pick today for constrained tool calls with speculation).

HF's assisted decoding (``GenerationMixin._assisted_decoding``, transformers 5.x) calls the logits processors once
per verified position ``i = 0 … k`` with the prefix ``candidate_input_ids[:, :cur_len + i]``, after a single target
forward over ``k`` candidates; ``PromptLookupCandidateGenerator`` also calls them, on fake all-ones logits, to drop
candidates the processor forbids (``-inf``); an assistant model's own ``generate`` calls them on its prefixes. So
the processor cannot assume one call per new token: :class:`GrammarLogitsProcessor` keeps one llguidance matcher
(:class:`constraints.ConstraintState`) and syncs it to whatever prefix it is given by longest common prefix
(rollback, then consume), then masks the scores.

Timing is read from forward hooks on the target (:class:`ForwardTracer`): the first forward (the prompt, plus any
first candidates) counts as prefill and is excluded from decode time, as our decoders exclude theirs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from constraints import ConstraintError, ConstraintState, allocate_bitmask, apply_bitmask


class GrammarLogitsProcessor:
    """A transformers ``LogitsProcessor`` enforcing a turn grammar with one llguidance matcher.

    Args:
        state: a fresh grammar state (``Generator.new_state(grammar)``), advanced by the processor.
        prompt_len: prompt length in tokens; only ``input_ids[0, prompt_len:]`` is the output.
        eos_token_ids: the end-of-generation tokens (the state's ``eog_tokens``); allowed only when the grammar
            accepts (the state's mask sets them then), the only allowed tokens when the grammar is stopped.

    Attributes:
        seconds: wall time spent inside the processor (sync + mask + apply), s.
        calls: processor calls.
        desyncs: calls whose prefix the grammar rejects (possible only for rows HF never uses: after a rejected
            candidate); such rows are returned unmasked.
    """

    def __init__(self, state: ConstraintState, prompt_len: int, eos_token_ids: frozenset[int]):
        self.state = state
        self.prompt_len = prompt_len
        self.eos = sorted(eos_token_ids)
        self.tokens: list[int] = []  # output tokens the matcher has consumed
        self.bitmask = allocate_bitmask(1, state.vocab_size)
        self.seconds = 0.0
        self.calls = 0
        self.desyncs = 0

    def sync(self, out: list[int]) -> bool:
        """Bring the matcher to ``out`` (output tokens) by longest common prefix; False when ``out`` holds EOS or
        a token the grammar forbids (the matcher then stands at the longest valid prefix)."""
        k = 0
        n = min(len(out), len(self.tokens))
        while k < n and out[k] == self.tokens[k]:
            k += 1
        if k < len(self.tokens):
            self.state.rollback(len(self.tokens) - k)
            del self.tokens[k:]
        for t in out[k:]:
            if t in self.eos:
                return False
            try:
                self.state.consume(t)
            except ConstraintError:
                return False
            self.tokens.append(t)
        return True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids`` ``int64 [1, L]`` (prompt + output so far), ``scores`` ``float [1, V]`` -> masked copy."""
        t0 = time.perf_counter()
        self.calls += 1
        if input_ids.shape[0] != 1:
            raise ValueError("GrammarLogitsProcessor supports batch size 1 (as HF assisted decoding does)")
        ok = self.sync(input_ids[0, self.prompt_len:].tolist())
        if not ok:
            self.desyncs += 1
            self.seconds += time.perf_counter() - t0
            return scores
        scores = scores.clone()  # PLD reuses one fake-logits tensor across calls: never mask in place
        if self.state.is_stopped():
            eos = scores[:, self.eos].clone()
            scores.fill_(float("-inf"))
            scores[:, self.eos] = eos
        else:
            self.state.fill_bitmask(self.bitmask, 0)
            scores = apply_bitmask(scores, self.bitmask.to(scores.device))
        self.seconds += time.perf_counter() - t0
        return scores


@dataclass
class ForwardTracer:
    """Counts and times the forwards of ``module`` through hooks; records ``(cached, fed, seconds)`` per forward.

    ``cached`` = tokens in the KV cache before the forward (``past_key_values.get_seq_length()``, -1 if unknown),
    ``fed`` = input tokens of the forward. ``sync``: CUDA-synchronise around each forward so times are real.
    """

    module: torch.nn.Module
    sync: bool = False
    calls: list[tuple[int, int, float]] = field(default_factory=list)

    def __enter__(self) -> "ForwardTracer":
        self.calls = []
        self._t0 = 0.0
        self._cur = (-1, 0)
        self._hooks = [self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
                       self.module.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        pkv = kwargs.get("past_key_values")
        cached = -1
        if pkv is not None and hasattr(pkv, "get_seq_length"):
            try:
                cached = int(pkv.get_seq_length())
            except Exception:  # noqa: BLE001 - a cache type without a length: acceptance becomes unknown
                cached = -1
        self._cur = (cached, int(ids.shape[1]) if ids is not None else 0)
        if self.sync:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        if self.sync:
            torch.cuda.synchronize()
        self.calls.append((*self._cur, time.perf_counter() - self._t0))

    @property
    def forwards(self) -> int:
        return len(self.calls)

    @property
    def seconds(self) -> float:
        return sum(c[2] for c in self.calls)

    def acceptance(self, prompt_len: int, final_len: int) -> tuple[list[int], list[int]] | None:
        """``(drafted_by_position, accepted_by_position)`` of assisted decoding, rebuilt from the forwards.

        Forward j feeds ``[last accepted, c1 … ck]`` over a cache of ``cur_len − 1`` tokens (forward 0: the
        prompt and ``c1 … ck``); the next forward starts at ``cur_len + n + 1`` with ``n`` candidates accepted. As
        in our decoder, positions up to and including the first rejected one count as drafted. None when the
        cache lengths are unknown or inconsistent.
        """
        if not self.calls or any(c[0] < 0 for c in self.calls):
            return None
        windows = []  # (cur_len, k)
        for j, (cached, fed, _) in enumerate(self.calls):
            if j == 0:
                if cached != 0:
                    return None
                windows.append((prompt_len, fed - prompt_len))
            else:
                windows.append((cached + 1, fed - 1))
        drafted: list[int] = []
        accepted: list[int] = []
        for j, (cur, k) in enumerate(windows):
            nxt = windows[j + 1][0] if j + 1 < len(windows) else final_len
            n = nxt - cur - 1
            if k < 0 or n < 0 or (n > k and j + 1 < len(windows)):
                return None
            n = min(n, k)
            for p in range(min(k, n + 1)):
                while len(drafted) <= p:
                    drafted.append(0)
                    accepted.append(0)
                drafted[p] += 1
                accepted[p] += int(p < n)
        return drafted, accepted


@dataclass
class HFRun:
    """One HF decode.

    Attributes:
        tokens: output ids up to (excluding) the first EOS, at most ``max_new_tokens``.
        truncated: no EOS within ``max_new_tokens``.
        seconds: wall time of ``generate`` (s), prefill included; ``prefill_seconds`` = the first target forward.
        forwards: target forwards (the first included).
        forward_seconds: time inside target forwards after the first (s).
        mask_seconds: llguidance mask computation inside the processor (s); None without a grammar.
        processor_seconds: total processor time (sync + mask + apply) (s); None without a grammar.
        drafted_by_position / accepted_by_position: assisted decoding only (None otherwise or when unknown).
    """

    tokens: list[int]
    truncated: bool
    seconds: float
    prefill_seconds: float
    forwards: int
    forward_seconds: float
    mask_seconds: float | None = None
    processor_seconds: float | None = None
    drafted_by_position: list[int] | None = None
    accepted_by_position: list[int] | None = None


def hf_generate(loaded, prompt: list[int], *, max_new_tokens: int, state: ConstraintState | None = None,
                prompt_lookup_num_tokens: int | None = None, assistant_model=None,
                num_assistant_tokens: int = 4) -> HFRun:
    """Greedy ``model.generate`` on ``prompt`` (batch 1), optionally under ``state``'s grammar and assisted by
    prompt lookup (``prompt_lookup_num_tokens``) or by ``assistant_model`` (``num_assistant_tokens`` per window,
    constant schedule: HF's default "heuristic" schedule stores γ in the assistant's generation config between
    calls, so repeated runs would not be independent).

    ``max_new_tokens + 1`` new tokens are allowed so that an output of exactly ``max_new_tokens`` tokens can still
    end with EOS (our decoders count EOS out of the budget); the output is cut back to ``max_new_tokens``.
    """
    from transformers import GenerationConfig, LogitsProcessorList

    model = loaded.model
    eog = sorted(state.eog_tokens if state is not None else loaded.eog_token_ids)  # every end token ends it
    device = loaded.device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    processors = LogitsProcessorList()
    proc = None
    mask0 = 0.0
    if state is not None:
        proc = GrammarLogitsProcessor(state, len(prompt), frozenset(eog))
        processors.append(proc)
        mask0 = state.mask_seconds
    cfg = GenerationConfig(max_new_tokens=max_new_tokens + 1, do_sample=False, eos_token_id=eog, pad_token_id=eog[0],
                           use_cache=True)
    kwargs = {}
    if assistant_model is not None:
        kwargs["assistant_model"] = assistant_model
        cfg.num_assistant_tokens = num_assistant_tokens
        cfg.num_assistant_tokens_schedule = "constant"
    elif prompt_lookup_num_tokens:
        cfg.prompt_lookup_num_tokens = prompt_lookup_num_tokens
    sync = device.type == "cuda"
    with ForwardTracer(model, sync=sync) as tracer, torch.inference_mode():
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg,
                             logits_processor=processors, **kwargs)
        if sync:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    seq = out[0].tolist()
    new = seq[len(prompt):]
    end = next((i for i, t in enumerate(new) if t in eog), None)
    truncated = end is None
    tokens = new[:end] if not truncated else new
    truncated = truncated or len(tokens) > max_new_tokens
    tokens = tokens[:max_new_tokens]
    calls = tracer.calls
    run = HFRun(tokens, truncated, seconds, calls[0][2] if calls else 0.0, len(calls),
                sum(c[2] for c in calls[1:]))
    if proc is not None:
        run.mask_seconds = state.mask_seconds - mask0
        run.processor_seconds = proc.seconds
    if prompt_lookup_num_tokens or assistant_model is not None:
        acc = tracer.acceptance(len(prompt), len(seq))
        if acc is not None:
            run.drafted_by_position, run.accepted_by_position = acc
    return run
