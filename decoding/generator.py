"""Generator: one model, its grammar tokenizer and a drafting mode; ``generate`` decodes one constrained sequence.

Drafting modes (``drafter=``, the rows of :data:`decoding.registry.DRAFTERS`):
    ``none``         non-speculative reference: one token per target forward.
    ``forced``       speculative with schema-forced tokens only (the mask allows exactly one token).
    ``schema``       forced + llguidance fast-forward tokens proposed as drafts.
    ``lookup``       forced + fast-forward + prompt lookup.
    ``draft_model``  forced + fast-forward + a smaller draft model with the same tokenizer.
    ``mtp``          forced + the model's trained MTP head (``decoding/mtp.py``) drafting every other token.
    ``lookup_mtp``   forced + fast-forward + prompt lookup, and the MTP head where lookup finds nothing.
    ``auto``         the default: what the model's MTP card names (``resolve_drafter``), else ``lookup``.

Each ``generate`` call builds its own KV caches and drafter state, so one Generator serves several threads.
"""
from __future__ import annotations

import importlib
import threading
from typing import Callable

import torch

from constraints import ConstraintState, Grammar, is_allowed_row, llg_tokenizer
from schemas.errors import SpecAgentError

from .backends import BACKENDS, HIDDEN_STATES, Backend, backend_name, backend_of
from .decoder import decode, prefill
from .drafters import Drafter
from .loader import DEFAULT_MODEL, LoadedModel
from .model import check_cache
from .mtp import MTPError, card_drafter, load_head, read_card
from . import registry
from .registry import AUTO, DEFAULT_DRAFTER, DEFAULT_NUM_DRAFT_TOKENS, DRAFTERS, FALLBACK_DRAFTER, card_drafters, \
    check_drafter
from .sampling import SamplingParams
from .speculative import speculative_decode
from .stats import DecodeResult, DecodeStats

__all__ = ["ContextLengthError", "DEFAULT_DRAFTER", "DEFAULT_NUM_DRAFT_TOKENS", "DRAFTERS", "Generator"]


WINDOWS = ("cost", "fixed")  # how speculative windows are sized (Generator's ``window``)


def check_window(window: str) -> None:
    """Raise ``ValueError`` naming the choices unless ``window`` is one of :data:`WINDOWS`."""
    if window not in WINDOWS:
        raise ValueError(f"unknown window {window!r}; choose one of {', '.join(WINDOWS)}")


class ContextLengthError(SpecAgentError, ValueError):
    """The prompt does not fit the model's context (``max_position_embeddings``) with room for one new token."""


class Generator:
    """Constrained (speculative) generation with one target model.

    Args:
        model: a loaded model of some backend (:class:`LoadedModel`, :class:`decoding.llamacpp.LlamaCppModel`; its
            backend is the row whose ``model_type`` it is) or a spec for that backend's loader.
        drafter: default drafting mode (see module docstring).
        num_draft_tokens: γ, drafter tokens per window (at most).
        adaptive: adapt γ online from acceptance.
        window: ``"cost"`` (default): where the backend measures what a verify row costs (llama.cpp:
            ``Backend.row_cost``), a token is drafted only where its expected gain pays for its row
            (:mod:`decoding.window`); ``"fixed"``: γ drafter tokens whenever the drafter has them. The output is the
            same either way (greedy: token for token; sampled: in distribution); only the speed differs.
        draft_model: the draft model for ``drafter="draft_model"``: a spec (loaded on the target's backend) or a
            loaded model of that backend (the target's own loaded model is loaded again from its file where the
            backend keeps the KV cache in the loaded model: llama.cpp).
        device, dtype: used when ``model`` is a spec (torch backend).
        kv_cache: ``"dynamic"`` or ``"static"`` KV cache for the target and draft model (``decoding.model``, torch
            backend); None: static on CUDA, dynamic elsewhere.
        backend: a row of :data:`decoding.backends.BACKENDS`, used when ``model`` is a spec (None:
            :func:`decoding.backends.choose_backend`: llama.cpp for a GGUF on the CPU where it is installed, else
            torch); ``engine`` is its alias.
        threads: CPU threads of the llama.cpp backend (default: the physical cores this process may use,
            :func:`decoding.llamacpp.default_threads`; ``1`` is the identity configuration, batch-invariant rows).
        ctx_size: KV cache positions per sequence of the llama.cpp backend, prompt + output (llama.cpp's ``-c`` /
            ``--ctx-size``; default :data:`decoding.llamacpp.DEFAULT_N_CTX`, capped by the model's training
            context); a prompt that does not fit is refused with a ``ValueError`` naming both lengths.

    Raises:
        ValueError: unknown backend or drafter, a drafter the backend cannot run, ``device``/``dtype``/``ctx_size``
            that do not apply to the backend.
        LlamaCppUnavailableError: ``backend="llamacpp"`` without llama-cpp-python installed.
    """

    def __init__(self, model: LoadedModel | str = DEFAULT_MODEL, *, drafter: str = DEFAULT_DRAFTER,
                 num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS, adaptive: bool = False, draft_model: LoadedModel | str | None = None,
                 device: str = "cpu", dtype: str = "float32", backend: str | None = None, engine: str | None = None,
                 threads: int | None = None, kv_cache: str | None = None, ctx_size: int | None = None,
                 window: str = "cost"):
        check_window(window)
        self.window = window
        self.batcher = None  # a decoding.batch.BatchScheduler once enable_batching was called
        name = backend_name(backend, engine, model=model if isinstance(model, str) else None, device=device,
                            dtype=dtype, needs=DRAFTERS[drafter].needs if drafter in DRAFTERS else frozenset())
        if isinstance(model, str):
            self.backend: Backend = BACKENDS[name]
            self.loaded = self.backend.load(model, device=device, dtype=dtype, threads=threads,
                                            **({} if ctx_size is None else {"ctx_size": ctx_size}))
        else:
            self.backend = backend_of(model)
            self.loaded = model
        self.tokenizer = self.loaded.tokenizer
        self.llg_tokenizer = llg_tokenizer(self.tokenizer, self.loaded.vocab_size, self.loaded.eos_token_id)
        self.eog_token_ids: frozenset[int] = self.loaded.eog_token_ids
        check_drafter(drafter)
        if drafter != AUTO:
            self.check_supported(drafter)
        self.drafter = drafter
        self.kv_cache = check_cache(kv_cache)
        self.num_draft_tokens = num_draft_tokens
        self.adaptive = adaptive
        self._draft_spec = draft_model
        self._draft_loaded = None  # the loaded draft model (the target backend's model type)
        self._mtp_head = None
        self._mtp_card: dict = {}
        self._auto: str | None = None  # what ``auto`` resolved to (once per generator)
        self.mtp_checkpoint = None  # directory of the MTP head (None: checkpoints/ default for this model)
        self._lock = threading.Lock()

    @property
    def engine(self) -> str:
        """The backend's name (``engine`` is the older word for it, kept as an alias)."""
        return self.backend.name

    def supports(self, drafter: str) -> bool:
        """Whether this generator's backend provides what drafter row ``drafter`` needs."""
        return self.backend.supports(DRAFTERS[drafter].needs)

    def check_supported(self, drafter: str) -> None:
        """Raise ``ValueError`` when the backend lacks what drafter row ``drafter`` needs, naming what it lacks
        and the drafters it can run."""
        if self.batcher is not None and HIDDEN_STATES in DRAFTERS[drafter].needs:
            raise ValueError(f"the {drafter} drafter needs the target's hidden states, which continuous batching "
                             f"(Generator.enable_batching; the server's --max-batch) does not give; use lookup, "
                             f"or decode without batching")
        if not self.supports(drafter):
            missing = sorted(DRAFTERS[drafter].needs - self.backend.provides)
            usable = [d for d in DRAFTERS if self.supports(d)]
            raise ValueError(f"the {drafter} drafter needs {', '.join(missing)}, which backend "
                             f"{self.backend.name!r} does not provide; use one of {', '.join(usable)}, or a backend "
                             f"that provides it (backend='torch', --backend torch)")

    def new_state(self, grammar: Grammar) -> ConstraintState:
        """A fresh grammar state for one sequence; every end-of-generation token of the model
        (``loaded.eog_token_ids``) is allowed wherever the grammar accepts, and ends the decode."""
        return ConstraintState(self.llg_tokenizer, grammar, self.eog_token_ids)

    def draft_model(self):
        """The draft model for ``drafter="draft_model"``, loaded once on the target's backend the way the target was
        (``Backend.draft_args``: the same device and dtype on torch; the same threads and context size on llama.cpp).

        Raises:
            ValueError: no ``draft_model=`` was given, a loaded draft model of another backend, or a tokenizer that
                differs from the target's.
            ModelNotFoundError: the draft model's files are missing.
        """
        self.check_supported("draft_model")
        with self._lock:
            if self._draft_loaded is None:
                if self._draft_spec is None:
                    raise ValueError("drafter 'draft_model' needs draft_model=... (a smaller model with the same "
                                     "tokenizer)")
                spec = self._draft_spec
                if isinstance(spec, str):
                    loaded = self.backend.load(spec, **self.backend.draft_args(self.loaded))
                elif isinstance(spec, self.backend.model_type):
                    loaded = spec
                    source = self.backend.portable(spec)[0]
                    if spec is self.loaded and source is not spec:
                        # the target's own loaded model, on a backend that keeps its KV cache in the loaded model
                        # (llama.cpp: one context per model and thread): the draft would write its tokens into the
                        # target's cache; it gets a copy of its own, loaded from the same file
                        loaded = self.backend.load(source, **self.backend.draft_args(self.loaded))
                else:
                    raise ValueError(f"the draft model is a {type(spec).__name__}; the target runs on backend "
                                     f"{self.backend.name!r}, whose models are {self.backend.model_type.__name__} "
                                     f"(pass a spec to load it there)")
                if loaded.tokenizer.get_vocab() != self.tokenizer.get_vocab():
                    raise ValueError("the draft model's tokenizer differs from the target's")
                self._draft_loaded = loaded
            return self._draft_loaded

    def new_draft_target(self):
        """A fresh KV-cached forward wrapper of the draft model (:meth:`draft_model`) for one sequence, on the
        target's backend (a :class:`decoding.backends.TargetModel`; llama.cpp: this thread's context of the draft,
        so its prefix cache carries over from turn to turn)."""
        return self.backend.new_target(self.draft_model(), self.kv_cache)

    def mtp_head(self):
        """The model's MTP head (loaded once; raises FileNotFoundError / MTPError when none fits)."""
        self.check_supported("mtp")
        with self._lock:
            if self._mtp_head is None:
                self._mtp_head, self._mtp_card = load_head(self.loaded, self.mtp_checkpoint,
                                                           target=self.backend.mtp_target(self.loaded))
            return self._mtp_head

    def resolve_drafter(self, name: str) -> str:
        """The drafter mode ``name`` stands for: itself, or for ``auto`` the ``"drafter"`` named in the card of the
        model's MTP head (e.g. ``lookup_mtp`` for Qwen2.5-Coder-0.5B, measured fastest on the benchmark's test
        split) when the backend runs the head and a head loads, else ``lookup``. Resolved once per generator.

        Raises:
            MTPError: the card names something other than one of ``decoding.registry.card_drafters()``.
        """
        if name != AUTO:
            return name
        if self._auto is None:
            choice = FALLBACK_DRAFTER
            if self.supports("mtp"):
                try:
                    _, card = read_card(self.loaded, self.mtp_checkpoint)
                except FileNotFoundError:  # no head for this model: lookup
                    card = {}
                choice = card_drafter(card, self.backend.name) or FALLBACK_DRAFTER
                if choice not in card_drafters():
                    raise MTPError(f"the MTP card of {self.loaded.name} names drafter {choice!r}; a card may name "
                                   f"{', '.join(card_drafters())}")
                if DRAFTERS[choice].needs:
                    self.mtp_head()  # the head the card names must load
            self._auto = choice
        if self.batcher is not None and HIDDEN_STATES in DRAFTERS[self._auto].needs:
            return FALLBACK_DRAFTER  # no hidden states under continuous batching
        return self._auto

    def enable_batching(self, max_batch: int, *, seq_ctx: int | None = None, max_rows: int | None = None,
                        exact_prefill: bool = True):
        """Decode every later :meth:`generate` call (from any number of threads) through one continuous-batching
        scheduler (:class:`decoding.batch.BatchScheduler`, llama.cpp backend): up to ``max_batch`` sequences verified
        in one ``llama_decode`` per step, ``seq_ctx`` KV positions each (:attr:`context_length` becomes that),
        ``max_rows`` tokens per step; ``exact_prefill``: see the scheduler. Returns the scheduler.

        Raises:
            ValueError: a backend row with no ``batcher`` (only llama.cpp batches), batching already enabled, or a
                size below 1.
        """
        from .batch import DEFAULT_MAX_ROWS

        if self.backend.batcher is None:
            batching = [name for name, row in BACKENDS.items() if row.batcher is not None]
            raise ValueError(f"continuous batching runs on the {', '.join(batching)} backend, not "
                             f"{self.backend.name!r}")
        if self.batcher is not None:
            raise ValueError("batching is already enabled on this generator")
        factory = self.backend.batcher
        if isinstance(factory, str):  # "module:name", imported now
            module, _, name = factory.partition(":")
            factory = getattr(importlib.import_module(module), name)
        self.batcher = factory(self.loaded, max_batch=max_batch, seq_ctx=seq_ctx,
                               max_rows=DEFAULT_MAX_ROWS if max_rows is None else max_rows,
                               exact_prefill=exact_prefill)
        return self.batcher

    @property
    def context_length(self) -> int | None:
        """Positions one decode may hold (prompt + new tokens): the model's context, or with batching enabled one
        sequence's KV cache (``seq_ctx``)."""
        if self.batcher is not None:
            return self.batcher.seq_ctx
        return self.loaded.context_length

    def new_target(self):
        """A fresh KV-cached forward wrapper of the target for one decode (a
        :class:`decoding.backends.TargetModel` from the backend's row)."""
        return self.backend.new_target(self.loaded, self.kv_cache)

    def make_drafter(self, name: str) -> Drafter | None:
        """A fresh drafter for mode ``name`` from :data:`decoding.registry.DRAFTERS` (None for ``none`` /
        ``forced``). Raises ``ValueError`` for an unknown name."""
        return registry.make_drafter(name, self)

    def masked_end_argmax(self, prompt: list[int], tokens: list[int], grammar: Grammar, *,
                          chunk: int = 64) -> list[int]:
        """Positions where the model wanted to end and the grammar forbade it: the indices ``j`` of ``tokens`` (an
        output decoded after ``prompt`` under ``grammar``) where the target's *unmasked* argmax is one of its
        end-of-generation tokens (``eog_token_ids``) and the grammar's mask at ``j`` forbids it.

        A diagnostic for turns cut by the budget (``EngineConfig.count_masked_ends``): a non-empty list means the
        grammar kept the model going past where it would have stopped. One teacher-forced replay: the prompt, then
        ``tokens`` in chunks of ``chunk`` positions (logits ``float32 [chunk, V]`` each); the prompt's prefix still in
        the backend's KV cache is reused, as by a decode.

        Raises:
            ConstraintError: ``tokens`` is not an output the grammar allows.
        """
        if not tokens:
            return []
        state = self.new_state(grammar)
        target = self.new_target()
        fed = [prefill(target, list(prompt), DecodeStats())] + tokens[:-1]  # logits of fed[j] decide tokens[j]
        argmax = torch.cat([target.forward(fed[a:a + chunk])[0].argmax(dim=-1)
                            for a in range(0, len(fed), chunk)]).tolist()
        found = []
        for j, tok in enumerate(tokens):
            if argmax[j] in self.eog_token_ids and not is_allowed_row(state.next_mask(), argmax[j]):
                found.append(j)
            if tok in self.eog_token_ids:
                break
            state.consume(tok)
        return found

    def continuation_logprobs(self, prompt: list[int], continuations: list[list[int]], *,
                              prefix: list[int] = (), floor: float | None = None,
                              then: torch.Tensor | None = None) -> list[float]:
        """The target's log-probability of each continuation after ``prompt + prefix``, teacher-forced, no grammar:
        for continuation ``c``, ``sum_j log softmax(logits_j)[c[j]]`` (natural log, ``float``). One prefill of
        ``prompt`` (the prefix still in the backend's KV cache is reused, as by a decode of ``prompt``), one
        forward of ``prefix`` and the last prompt token (logits of its last row: every continuation's first
        token), then one forward per continuation of its tokens (all of them with ``then``, else all but the
        last). ``prefix``: tokens a decode after ``prompt`` wrote (fed as the decode fed them, after the prompt's
        prefill, so the prompt's cached keys/values are reused whole). Runs on this thread's target, not on the
        continuous-batching scheduler.

        Args:
            floor: a continuation whose first token's log-probability is below it gets ``-inf`` without a forward
                of its own (None: every continuation is scored).
            then: ``bool [V]``: the continuation is followed by any one of these tokens; adds the log of their
                summed probability after its last token (e.g. every token whose text starts with ``"``: a name
                ends there however the model goes on, ``"`` or ``",``).
        Raises:
            ValueError: ``prompt`` or a continuation is empty.
            ContextLengthError: the prompt, ``prefix`` and the longest continuation do not fit the model's context.
        """
        if not prompt or not all(continuations):
            raise ValueError("continuation_logprobs needs a non-empty prompt and non-empty continuations")
        limit = self.loaded.context_length
        longest = max((len(c) for c in continuations), default=0)
        if limit is not None and len(prompt) + len(prefix) + longest > limit:
            raise ContextLengthError(f"the prompt is {len(prompt)} tokens, the prefix {len(prefix)} and a "
                                     f"continuation {longest}; {self.loaded.name} takes at most {limit}")
        target = self.new_target()
        cur = prefill(target, list(prompt), DecodeStats())
        first = torch.log_softmax(target.forward([cur] + list(prefix), num_logits=1)[0][0].float(), dim=-1)
        if then is not None:  # to the logits' width V (it may exceed the tokenizer's)
            mask = torch.zeros(first.shape[-1], dtype=torch.bool)
            mask[:min(len(then), len(mask))] = then[:len(mask)]
        base, out = target.length, []
        for cont in continuations:
            value = float(first[cont[0]])
            if floor is not None and value < floor:
                out.append(float("-inf"))
                continue
            fed = list(cont) if then is not None else list(cont[:-1])
            if fed:
                target.crop(base)
                logp = torch.log_softmax(target.forward(fed)[0].float(), dim=-1)
                value += float(logp[torch.arange(len(cont) - 1), torch.tensor(cont[1:], dtype=torch.long)].sum())
                if then is not None:
                    value += float(torch.logsumexp(logp[-1][mask], dim=0))
            out.append(value)
        return out

    def row_cost(self, window: str | None = None):
        """The :class:`decoding.window.RowCost` the speculative step sizes windows by under ``window`` (default
        :attr:`window`): the backend's measured curve with ``"cost"`` (measured once per machine, model and threads:
        a few seconds the first time), None with ``"fixed"``, on a backend without one, or under continuous
        batching (a row's cost is shared with the other sequences there)."""
        window = self.window if window is None else window
        check_window(window)
        if window == "fixed" or self.backend.row_cost is None or self.batcher is not None:
            return None
        return self.backend.row_cost(self.loaded)

    def generate(self, prompt: list[int], grammar: Grammar | ConstraintState, *, max_new_tokens: int = 256,
                 sampling: SamplingParams = SamplingParams(), drafter: str | None = None,
                 num_draft_tokens: int | None = None, adaptive: bool | None = None,
                 on_text: Callable[[str], None] | None = None,
                 stop_when: Callable[[str], bool] | None = None, window: str | None = None,
                 end_when: Callable[[str], bool] | None = None) -> DecodeResult:
        """Decode one sequence after ``prompt`` under ``grammar`` (or an existing state, advanced in place).

        Args:
            max_new_tokens: output budget (tokens, >= 1); an output the grammar completes on its last allowed
                token stops with ``"grammar"``, not ``"length"``.
            on_text: called with each new piece of decoded text as tokens are committed (streaming).
            stop_when: called with the whole text so far after each committed step; True ends the decode there
                (``stop_reason == "stop"``; a speculative step may have committed a few tokens past the point the
                caller looks for, so the caller trims the text it keeps).
            end_when: called with the text so far at each position where the model's unmasked argmax is one of
                its end-of-generation tokens and the grammar forbids it there (a position that allows more than
                one token: ``decoding.decoder.masked_end_rows``); True ends the decode before that position
                (``stop_reason == "masked_end"``), in every decode path at the same position (the engine closes
                the call being written there: ``agent.engine``).
        Raises:
            ContextLengthError: ``prompt`` leaves no room in the model's context; ``max_new_tokens`` is otherwise
                cut to what fits.
            ValueError: ``max_new_tokens`` is not an integer >= 1, or the drafter or ``window`` is unknown.
        """
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if window is not None:
            check_window(window)
        limit = self.context_length
        if limit is not None:
            if len(prompt) >= limit:
                raise ContextLengthError(f"the prompt is {len(prompt)} tokens; {self.loaded.name} takes at most "
                                         f"{limit} (prompt + new tokens): shorten the messages or the tool list")
            max_new_tokens = min(max_new_tokens, limit - len(prompt))
        state = grammar if isinstance(grammar, ConstraintState) else self.new_state(grammar)
        mode = self.resolve_drafter(drafter or self.drafter)
        check_drafter(mode)
        self.check_supported(mode)
        on_step = None if on_text is None and stop_when is None else _TextDeltas(self.tokenizer, on_text, stop_when)
        at_end = None if end_when is None else \
            (lambda tokens: bool(end_when(self.tokenizer.decode(tokens, skip_special_tokens=False))))
        if self.batcher is not None:  # continuous batching: the same step, verified with the other sequences'
            result = self.batcher.decode(
                prompt, state, None if mode == "none" else self.make_drafter(mode),
                num_draft_tokens=self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens,
                max_new_tokens=max_new_tokens, sampling=sampling, tokenizer=self.tokenizer, on_step=on_step,
                adaptive=self.adaptive if adaptive is None else adaptive, end_when=at_end,
                **({"max_window": 0} if mode == "none" else {}))  # none: one token per forward
        elif mode == "none":
            result = decode(self.new_target(), prompt, state, max_new_tokens=max_new_tokens, sampling=sampling,
                            tokenizer=self.tokenizer, on_step=on_step, end_when=at_end)
        else:
            cost = self.row_cost(window)  # before the target: a first calibration runs on this thread's context
            result = speculative_decode(
                self.new_target(), prompt, state, self.make_drafter(mode),
                num_draft_tokens=self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens,
                max_new_tokens=max_new_tokens, sampling=sampling,
                adaptive=self.adaptive if adaptive is None else adaptive, tokenizer=self.tokenizer, on_step=on_step,
                row_cost=cost, end_when=at_end)
        if on_step is not None:
            on_step.finish(result.text)
        return result


class _TextDeltas:
    """Turns "tokens so far" callbacks into new-text callbacks (holds back an incomplete UTF-8 character) and asks
    ``stop_when`` about the text so far (the decoders stop when the callback returns True)."""

    def __init__(self, tokenizer, emit: Callable[[str], None] | None, stop_when: Callable[[str], bool] | None = None):
        self.tokenizer = tokenizer
        self.emit = emit
        self.stop_when = stop_when
        self.sent = ""

    def __call__(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return False
        if self.stop_when is not None and self.stop_when(text):
            return True  # the caller trims this step's text: not streamed
        if self.emit is not None and text.startswith(self.sent) and len(text) > len(self.sent):
            self.emit(text[len(self.sent):])
            self.sent = text
        return False

    def finish(self, text: str) -> None:
        if self.stop_when is not None and self.stop_when(text):
            return
        if self.emit is not None and text.startswith(self.sent) and len(text) > len(self.sent):
            self.emit(text[len(self.sent):])
            self.sent = text
