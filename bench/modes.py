"""Decoding modes of the benchmark: every mode runs one prompt and returns a :class:`Run` (see ``bench/run.py`` for
the list of modes and the result fields). Our modes are rows of :data:`decoding.DRAFTERS` run through
``Generator.generate``; peers live in ``bench/hf_peer.py`` and ``bench/llamacpp_peer.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from agent.formats import make_format
from decoding import (BACKENDS, DRAFTERS, Generator, LlamaCppUnavailableError, LoadedModel,
                      ModelNotFoundError, backend_of)
from constraints import schema_compiles
from schemas import SpecAgentError, ToolRegistry, call_schema

from .bfcl import MAX_DECIMALS, MAX_STRING_LENGTH, BfclTurn, bfcl_turn

BASELINE = "constrained"
PEER_MODES = ("hf_unconstrained", "hf_assisted_constrained", "llamacpp_unconstrained", "llamacpp_constrained",
              "llamacpp_lookup_constrained")
DEFAULT_MODES = ("hf_unconstrained", "constrained", "forced", "lookup", "mtp", "draft_model",
                 "hf_assisted_constrained", "llamacpp_constrained", "best")
# llama.cpp against its own peers and the torch backend (``make bench-llamacpp``; ``--modes llamacpp``)
MODE_GROUPS = {"llamacpp": ("llamacpp_unconstrained", "llamacpp_constrained", "llamacpp_lookup_constrained",
                            "llamacpp_engine_constrained",
                            "llamacpp_engine_lookup", "llamacpp_engine_best", "constrained", "best")}


def our_modes() -> dict[str, tuple[str, str | None]]:
    """Our decoding modes, read from the tables now: ``mode -> (backend, drafter)`` for every row of
    ``decoding.BACKENDS`` × every row of ``decoding.DRAFTERS`` the backend supports (``none`` is named
    ``constrained``, the baseline), plus ``best`` (drafter None: the Generator's default ``auto`` and γ) per
    backend. Mode names carry the backend row's ``bench_prefix`` (``""`` for torch, ``llamacpp_engine_``)."""
    modes: dict[str, tuple[str, str | None]] = {}
    for backend in BACKENDS.values():
        for drafter, row in DRAFTERS.items():
            if backend.supports(row.needs):
                modes[backend.bench_prefix + (BASELINE if drafter == "none" else drafter)] = (backend.name, drafter)
        modes[backend.bench_prefix + "best"] = (backend.name, None)
    return modes


def all_modes() -> tuple[str, ...]:
    """Every mode ``--modes`` accepts: ours (:func:`our_modes`) and the peers (:data:`PEER_MODES`)."""
    return (*our_modes(), *PEER_MODES)


def baseline_of(mode: str) -> str:
    """The mode whose output ``mode``'s ``identical_to_constrained`` compares with: the constrained greedy of the
    same backend (``llamacpp_engine_constrained`` for the llama.cpp backend); ``constrained`` for the peers."""
    ours = our_modes().get(mode)
    return BASELINE if ours is None else BACKENDS[ours[0]].bench_prefix + BASELINE


def is_baseline(mode: str) -> bool:
    """``mode`` is some backend's constrained greedy (a baseline of ``identical_to_constrained``)."""
    return baseline_of(mode) == mode


class SkipMode(SpecAgentError):
    """A mode cannot run here (missing optional dependency, checkpoint or model); the message says why."""


# -- prompts -----------------------------------------------------------------------------------------------------------
@dataclass
class BenchPrompt:
    """One BFCL question as the bfcl CLI decodes it.

    Attributes:
        ids: prompt token ids (chat template applied, generation prompt added).
        grammar: the turn grammar (``tool_choice="required"``, one call, bounded strings and numbers).
        call_schema: the bounded call schema inside the grammar (for llama.cpp's GBNF).
        fmt: the tool format the prompt is rendered in.
        gbnf_root: llama.cpp's GBNF around the call (``call`` = the call schema's rule), in the format's layout
            (``fmt.gbnf_root()``).
    """

    id: str
    category: str
    turn: BfclTurn
    registry: ToolRegistry
    ids: list[int]
    grammar: Any
    call_schema: dict
    fmt: Any
    gbnf_root: str


def build_prompts(tokenizer, rows: list[tuple[str, dict]], tool_format: str | None = None) -> list[BenchPrompt]:
    """Tools, prompt ids and turn grammar per row, exactly as ``bench.bfcl.run_bfcl`` with the bfcl CLI's Agent
    (:func:`bench.bfcl.bfcl_turn`), in the model's own tool format (detected from its chat template unless
    ``tool_format`` names a row of ``agent.formats.FORMATS``)."""
    fmt = make_format(tokenizer, tool_format)
    prompts = []
    for cat, row in rows:
        turn = bfcl_turn(row, cat)
        schema = call_schema(turn.tools, max_string_length=MAX_STRING_LENGTH, max_decimals=MAX_DECIMALS,
                             compiles=schema_compiles)
        prompts.append(BenchPrompt(turn.id, cat, turn, turn.registry(), turn.prompt_ids(tokenizer, fmt),
                                   turn.grammar(fmt=fmt), schema, fmt, fmt.gbnf_root()))
    return prompts


def is_valid(text: str, truncated: bool, p: BenchPrompt) -> bool:
    """The output parses into at least one call and every call validates (``BfclTurn.judge``)."""
    return p.turn.judge(text, truncated, p.registry, p.fmt)[0]


# -- one decode --------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One decode of one mode on one prompt (times in s; None = not measurable for this mode).

    Attributes:
        tokens: emitted ids, EOS excluded.
        seconds: wall time of the decode, prefill included.
        tokens_per_s: see the module docstring (prefill excluded).
        forwards: target forwards (None: unknown).
    """

    tokens: list[int]
    text: str
    truncated: bool
    seconds: float
    tokens_per_s: float
    forwards: int | None
    drafted_by_position: list[int] | None = None
    accepted_by_position: list[int] | None = None
    mask_seconds: float | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    draft_forward_seconds_per_token: float | None = None  # for gamma.py: draft_seconds / drafted
    verify_seconds_per_forward: float | None = None
    drafted: int = 0
    accepted: int = 0


@dataclass
class BenchResult:
    """What :func:`bench.run.run_benchmark` returns (here, beside :class:`Run`, so ``bench/report.py`` and
    ``bench/run.py`` both import it from this module)."""

    results: dict[str, dict]  # mode -> FIELDS
    skipped: dict[str, str]  # mode -> why
    runs: dict[str, dict[str, list[Run]]] = field(default_factory=dict)  # mode -> prompt id -> repeats
    prompts: list[BenchPrompt] = field(default_factory=list)


def _decode_tps(n_tokens: int, seconds: float, prefill_seconds: float) -> float:
    """Tokens/s after the first forward (which is the prefill and also yields the first token)."""
    t = seconds - prefill_seconds
    return (n_tokens - 1) / t if n_tokens > 1 and t > 0 else 0.0


class Bench:
    """Runs any mode on any prompt with one loaded model (and its optional draft model / llama.cpp peer).

    Args:
        loaded: the target model.
        model_spec: the spec it was loaded from (for llama.cpp's GGUF); None: llama.cpp is skipped.
        draft_model: ``LoadedModel`` or spec for ``draft_model`` and HF's ``assistant_model``; None: none.
        num_draft_tokens: γ for the speculative modes (``best`` uses the Generator's default γ).
        max_new_tokens: output budget per decode.
        prompt_lookup_num_tokens: HF prompt-lookup candidates per window.
        peer_lookup_tokens: ``num_pred_tokens`` of llama-cpp-python's ``LlamaPromptLookupDecoding`` in the
            ``llamacpp_lookup_constrained`` peer (its default: 10).
    """

    def __init__(self, loaded: LoadedModel, *, model_spec: str | None = None, draft_model: Any = None,
                 num_draft_tokens: int = 4, max_new_tokens: int = 384, prompt_lookup_num_tokens: int = 4,
                 mtp_checkpoint: str | None = None, log: Callable[[str], None] = print, peer_lookup_tokens: int = 10):
        self.loaded = loaded
        self.model_spec = model_spec
        self.max_new_tokens = max_new_tokens
        self.num_draft_tokens = num_draft_tokens
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.log = log
        self.gen = Generator(loaded, draft_model=draft_model)  # defaults: DEFAULT_DRAFTER, default γ
        self.draft_spec = draft_model
        self.draft_loaded = None  # the draft on the loaded model's backend (also HF's assistant_model on torch)
        self.draft_error: str | None = "no --draft-model given" if draft_model is None else None
        if draft_model is not None:
            try:
                self.draft_loaded = self.gen.draft_model()  # loaded and tokenizer-checked by the product
            except (ModelNotFoundError, ValueError, OSError) as e:
                self.draft_error = f"draft model {draft_model!r} cannot be loaded: {e}"
        if mtp_checkpoint is not None:
            self.gen.mtp_checkpoint = mtp_checkpoint  # read by Generator.mtp_head() (decoding/mtp.py)
        self._llamacpp: dict[bool, Any] = {}  # prompt lookup on? -> its llama.cpp peer
        self.peer_lookup_tokens = peer_lookup_tokens
        self.generators: dict[str, Generator] = {backend_of(loaded).name: self.gen}  # backend -> its Generator
        self.threads = torch.get_num_threads()

    # -- per-mode setup (raises SkipMode) ------------------------------------------------------------------------------
    def check(self, mode: str) -> None:
        """Raise :class:`SkipMode` when ``mode`` cannot run here."""
        backend, drafter = our_modes().get(mode, (None, None))
        if drafter == "draft_model" and backend == backend_of(self.loaded).name and self.draft_loaded is None:
            raise SkipMode(self.draft_error or "no draft model")
        if backend is not None and backend not in self.generators:
            if self.model_spec is None:
                raise SkipMode(f"the {backend} backend loads the model from its spec; the model was passed in "
                               f"already loaded")
            try:
                self.generators[backend] = Generator(self.model_spec, backend=backend, threads=self.threads,
                                                     draft_model=self.draft_spec if isinstance(self.draft_spec, str)
                                                     else None)
            except (LlamaCppUnavailableError, ModelNotFoundError) as e:
                raise SkipMode(str(e)) from None
        if drafter == "draft_model":  # the draft loads on the mode's backend, beside its target
            if self.draft_spec is None:
                raise SkipMode("no --draft-model given")
            try:
                self.generators[backend].draft_model()
            except (LlamaCppUnavailableError, ModelNotFoundError, ValueError, OSError) as e:
                raise SkipMode(f"draft model {self.draft_spec!r} cannot be loaded on the {backend} backend: "
                               f"{e}") from None
        lookup = mode == "llamacpp_lookup_constrained"
        if mode in ("llamacpp_constrained", "llamacpp_unconstrained", "llamacpp_lookup_constrained") and \
                self._llamacpp.get(lookup) is None:
            from .llamacpp_peer import LlamaCppPeer, LlamaCppUnavailable

            if self.model_spec is None:
                raise SkipMode("llama.cpp needs the model's GGUF; the model was passed in already loaded")
            try:
                self._llamacpp[lookup] = LlamaCppPeer(self.model_spec, n_threads=self.threads,
                                                      gpu=self.loaded.device.type == "cuda",
                                                      draft_tokens=self.peer_lookup_tokens if lookup else None)
            except (LlamaCppUnavailable, ModelNotFoundError) as e:
                raise SkipMode(str(e)) from None

    # -- one decode ----------------------------------------------------------------------------------------------------
    def run(self, mode: str, p: BenchPrompt) -> Run:
        ours = our_modes()
        if mode in ours:
            backend, drafter = ours[mode]
            return self.run_ours(drafter, p, None if drafter is None else self.num_draft_tokens,
                                 gen=self.generators[backend])
        if mode == "llamacpp_unconstrained":
            return self._run_llamacpp(p, constrained=False)
        if mode == "hf_unconstrained":
            return self._run_hf(p, constrained=False)
        if mode == "hf_assisted_constrained":
            return self._run_hf(p, constrained=True)
        if mode == "llamacpp_constrained":
            return self._run_llamacpp(p)
        if mode == "llamacpp_lookup_constrained":
            return self._run_llamacpp(p, lookup=True)
        raise ValueError(f"unknown mode {mode!r}")

    def run_ours(self, drafter: str | None, p: BenchPrompt, num_draft_tokens: int | None,
                 gen: Generator | None = None, window: str | None = None) -> Run:
        """``Generator.generate`` greedy with ``drafter`` (None: the default), γ (None: the default) and ``window``
        (None: the Generator's), on the Generator of the loaded model's backend or ``gen``."""
        gen = gen or self.gen
        res = gen.generate(p.ids, p.grammar, max_new_tokens=self.max_new_tokens, drafter=drafter,
                           num_draft_tokens=num_draft_tokens, window=window)
        s = res.stats
        speculative = (drafter or gen.drafter) != "none"
        return Run(res.tokens, res.text, res.truncated, s.seconds, s.tokens_per_s, s.target_forwards,
                   list(s.drafted_by_position) if speculative else None,
                   list(s.accepted_by_position) if speculative else None,
                   s.mask_seconds, s.draft_seconds, s.verify_seconds,
                   s.draft_seconds / s.drafted if s.drafted else None,
                   s.verify_seconds / s.target_forwards if s.target_forwards else None,
                   s.drafted, s.accepted)

    def _run_hf(self, p: BenchPrompt, *, constrained: bool) -> Run:
        from .hf_peer import hf_generate

        if constrained:
            assistant = self.draft_loaded if isinstance(self.draft_loaded, LoadedModel) else None  # torch only
            r = hf_generate(self.loaded, p.ids, max_new_tokens=self.max_new_tokens, state=self.gen.new_state(p.grammar),
                            prompt_lookup_num_tokens=None if assistant else self.prompt_lookup_num_tokens,
                            assistant_model=assistant.model if assistant else None,
                            num_assistant_tokens=self.num_draft_tokens)
        else:
            r = hf_generate(self.loaded, p.ids, max_new_tokens=self.max_new_tokens)
        text = self.loaded.tokenizer.decode(r.tokens, skip_special_tokens=False)
        drafted = sum(r.drafted_by_position) if r.drafted_by_position else 0
        accepted = sum(r.accepted_by_position) if r.accepted_by_position else 0
        return Run(r.tokens, text, r.truncated, r.seconds, _decode_tps(len(r.tokens), r.seconds, r.prefill_seconds),
                   r.forwards, r.drafted_by_position, r.accepted_by_position,
                   r.mask_seconds if constrained else 0.0, None if constrained else 0.0, r.forward_seconds,
                   drafted=drafted, accepted=accepted)

    def _run_llamacpp(self, p: BenchPrompt, constrained: bool = True, lookup: bool = False) -> Run:
        from .llamacpp_peer import call_gbnf

        r = self._llamacpp[lookup].generate(p.ids, call_gbnf(p.call_schema, p.gbnf_root) if constrained else None,
                                            max_new_tokens=self.max_new_tokens)
        text = self.loaded.tokenizer.decode(r.tokens, skip_special_tokens=False)
        return Run(r.tokens, text, r.truncated, r.seconds, _decode_tps(len(r.tokens), r.seconds, r.prefill_seconds),
                   r.forwards, None, None, None, 0.0, None)
