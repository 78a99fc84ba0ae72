"""Decoding modes of the benchmark: every mode runs one prompt and returns a :class:`Run` (see ``bench/run.py`` for
the list of modes and the result fields). Our modes are rows of :data:`decoding.DRAFTERS` run through
``Generator.generate``; peers live in ``bench/hf_peer.py`` and ``bench/llamacpp_peer.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from agent.bfcl import MAX_DECIMALS, MAX_STRING_LENGTH, BfclTurn, bfcl_turn
from agent.formats import make_format
from decoding import DRAFTERS, Generator, LlamaCppUnavailableError, LoadedModel, ModelNotFoundError
from decoding.generator import TORCH_DRAFTERS
from constraints import schema_compiles
from schemas import SpecAgentError, ToolRegistry, call_schema

BASELINE = "constrained"
# one mode per row of decoding's drafter table (``none`` is the baseline), and ``best``: the Generator's default
OUR_DRAFTERS: dict[str, str | None] = {**{BASELINE if name == "none" else name: name for name in DRAFTERS},
                                       "best": None}
# the same decoder on the llama.cpp engine (decoding/llamacpp.py): drafters that need no torch weights
LLAMACPP_ENGINE = "llamacpp_engine_"
LLAMACPP_BASELINE = LLAMACPP_ENGINE + BASELINE
LLAMACPP_DRAFTERS: dict[str, str | None] = {LLAMACPP_ENGINE + m: d for m, d in OUR_DRAFTERS.items()
                                            if d not in TORCH_DRAFTERS}
MODES = ("hf_unconstrained", *(m for m in OUR_DRAFTERS if m != "best"), "hf_assisted_constrained",
         "llamacpp_unconstrained", "llamacpp_constrained", *LLAMACPP_DRAFTERS, "best")
DEFAULT_MODES = ("hf_unconstrained", "constrained", "forced", "lookup", "mtp", "draft_model",
                 "hf_assisted_constrained", "llamacpp_constrained", "best")
# llama.cpp against its own peers and the torch engine (``make bench-llamacpp``)
LLAMACPP_MODES = ("llamacpp_unconstrained", "llamacpp_constrained", LLAMACPP_BASELINE, "llamacpp_engine_lookup",
                  "llamacpp_engine_best", "constrained", "best")


def baseline_of(mode: str) -> str:
    """The mode whose output ``mode``'s ``identical_to_constrained`` compares with: the constrained greedy of the
    same engine (``llamacpp_engine_constrained`` for the llama.cpp engine, ``constrained`` otherwise)."""
    return LLAMACPP_BASELINE if mode.startswith(LLAMACPP_ENGINE) else BASELINE


GENERIC_GBNF_ROOT = '"<tool_call>[" call "]</tool_call>"'


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
    """

    id: str
    category: str
    turn: BfclTurn
    registry: ToolRegistry
    ids: list[int]
    grammar: Any
    call_schema: dict
    fmt: Any = None
    gbnf_root: str = GENERIC_GBNF_ROOT


# llama.cpp's GBNF around the call (``call`` = the call schema's rule), in the layout of the model's tool format
GBNF_ROOTS = {"generic": GENERIC_GBNF_ROOT, "hermes": '"<tool_call>\\n" call "\\n</tool_call>" | call',
              "llama3_json": "call"}


def build_prompts(tokenizer, rows: list[tuple[str, dict]]) -> list[BenchPrompt]:
    """Tools, prompt ids and turn grammar per row, exactly as ``agent.bfcl.run_bfcl`` with the bfcl CLI's Agent
    (:func:`agent.bfcl.bfcl_turn`), in the model's own tool format (detected from its chat template)."""
    fmt = make_format(tokenizer)
    prompts = []
    for cat, row in rows:
        turn = bfcl_turn(row, cat)
        schema = call_schema(turn.tools, max_string_length=MAX_STRING_LENGTH, max_decimals=MAX_DECIMALS,
                             compiles=schema_compiles)
        prompts.append(BenchPrompt(turn.id, cat, turn, turn.registry(), turn.prompt_ids(tokenizer, fmt),
                                   turn.grammar(fmt=fmt), schema, fmt, GBNF_ROOTS.get(fmt.name, "call")))
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
    """

    def __init__(self, loaded: LoadedModel, *, model_spec: str | None = None, draft_model: Any = None,
                 num_draft_tokens: int = 4, max_new_tokens: int = 384, prompt_lookup_num_tokens: int = 4,
                 mtp_checkpoint: str | None = None, log: Callable[[str], None] = print):
        self.loaded = loaded
        self.model_spec = model_spec
        self.max_new_tokens = max_new_tokens
        self.num_draft_tokens = num_draft_tokens
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.log = log
        self.gen = Generator(loaded, draft_model=draft_model)  # defaults: DEFAULT_DRAFTER, default γ
        self.draft_loaded: LoadedModel | None = None
        self.draft_error: str | None = "no --draft-model given" if draft_model is None else None
        if draft_model is not None:
            try:
                self.draft_loaded = self.gen.draft_model()  # loaded and tokenizer-checked by the product
            except (ModelNotFoundError, ValueError, OSError) as e:
                self.draft_error = f"draft model {draft_model!r} cannot be loaded: {e}"
        if mtp_checkpoint is not None:
            self.gen.mtp_checkpoint = mtp_checkpoint  # read by Generator.mtp_head() (decoding/mtp.py)
        self._llamacpp = None
        self._llamacpp_engine: Generator | None = None
        self.threads = torch.get_num_threads()

    # -- per-mode setup (raises SkipMode) ------------------------------------------------------------------------------
    def check(self, mode: str) -> None:
        """Raise :class:`SkipMode` when ``mode`` cannot run here."""
        if mode == "draft_model" and self.draft_loaded is None:
            raise SkipMode(self.draft_error or "no draft model")
        if mode in LLAMACPP_DRAFTERS and self._llamacpp_engine is None:
            if self.model_spec is None:
                raise SkipMode("the llama.cpp engine needs the model's GGUF; the model was passed in already loaded")
            try:
                self._llamacpp_engine = Generator(self.model_spec, engine="llamacpp", threads=self.threads)
            except (LlamaCppUnavailableError, ModelNotFoundError) as e:
                raise SkipMode(str(e)) from None
        if mode in ("llamacpp_constrained", "llamacpp_unconstrained") and self._llamacpp is None:
            from .llamacpp_peer import LlamaCppPeer, LlamaCppUnavailable

            if self.model_spec is None:
                raise SkipMode("llama.cpp needs the model's GGUF; the model was passed in already loaded")
            try:
                self._llamacpp = LlamaCppPeer(self.model_spec, n_threads=self.threads,
                                              gpu=self.loaded.device.type == "cuda")
            except (LlamaCppUnavailable, ModelNotFoundError) as e:
                raise SkipMode(str(e)) from None

    # -- one decode ----------------------------------------------------------------------------------------------------
    def run(self, mode: str, p: BenchPrompt) -> Run:
        if mode in OUR_DRAFTERS:
            return self.run_ours(OUR_DRAFTERS[mode], p, None if mode == "best" else self.num_draft_tokens)
        if mode in LLAMACPP_DRAFTERS:
            return self.run_ours(LLAMACPP_DRAFTERS[mode], p, None if mode.endswith("best") else self.num_draft_tokens,
                                 gen=self._llamacpp_engine)
        if mode == "llamacpp_unconstrained":
            return self._run_llamacpp(p, constrained=False)
        if mode == "hf_unconstrained":
            return self._run_hf(p, constrained=False)
        if mode == "hf_assisted_constrained":
            return self._run_hf(p, constrained=True)
        if mode == "llamacpp_constrained":
            return self._run_llamacpp(p)
        raise ValueError(f"unknown mode {mode!r}")

    def run_ours(self, drafter: str | None, p: BenchPrompt, num_draft_tokens: int | None,
                 gen: Generator | None = None) -> Run:
        """``Generator.generate`` greedy with ``drafter`` (None: the default) and γ (None: the default), on the torch
        engine's Generator or ``gen``."""
        gen = gen or self.gen
        res = gen.generate(p.ids, p.grammar, max_new_tokens=self.max_new_tokens, drafter=drafter,
                           num_draft_tokens=num_draft_tokens)
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
            r = hf_generate(self.loaded, p.ids, max_new_tokens=self.max_new_tokens, state=self.gen.new_state(p.grammar),
                            prompt_lookup_num_tokens=None if self.draft_loaded else self.prompt_lookup_num_tokens,
                            assistant_model=self.draft_loaded.model if self.draft_loaded else None,
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

    def _run_llamacpp(self, p: BenchPrompt, constrained: bool = True) -> Run:
        from .llamacpp_peer import call_gbnf

        r = self._llamacpp.generate(p.ids, call_gbnf(p.call_schema, p.gbnf_root) if constrained else None,
                                    max_new_tokens=self.max_new_tokens)
        text = self.loaded.tokenizer.decode(r.tokens, skip_special_tokens=False)
        return Run(r.tokens, text, r.truncated, r.seconds, _decode_tps(len(r.tokens), r.seconds, r.prefill_seconds),
                   len(r.tokens) + (0 if r.truncated else 1), None, None, None, 0.0, None)
