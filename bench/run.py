"""Decoding benchmark: ``python -m bench.run [--limit N] [--modes a,b,…] [--repeat R] [--out DIR]``.

Same prompts (BFCL questions, rendered exactly as ``python -m agent bfcl`` renders them: tools in the system
message, ``tool_choice="required"``, one call, strings capped at 200 characters and numbers at 8 decimals in the
grammar), same model, one process. Modes are interleaved per prompt (A B C A B C …, ``--repeat`` times per
prompt); one warm-up decode per mode on the first prompt is not counted.

Modes:
    hf_unconstrained         transformers ``model.generate``, greedy, no grammar (stops at EOS).
    constrained              our constrained greedy, one token per target forward (``drafter="none"``): the baseline.
    forced                   speculative, schema-forced tokens only.
    lookup                   speculative, forced + schema fast-forward + prompt lookup.
    mtp                      speculative with the MTP head drafter (skipped without it or its checkpoint).
    draft_model              speculative with ``--draft-model`` (skipped without one).
    hf_assisted_constrained  ``generate`` with prompt lookup (``prompt_lookup_num_tokens=4``; an ``assistant_model``
                             with ``--draft-model``) and an llguidance logits processor (bench/hf_peer.py).
    llamacpp_constrained     llama-cpp-python on the same GGUF, GBNF from the call schema (skipped without llama_cpp).
    best                     the agent's default configuration (``decoding.DEFAULT_DRAFTER``, default γ).

Per mode (``results.json``, one object per mode, plus ``meta``):
    tokens_per_s             median over prompts of the per-prompt median over repeats; tokens = emitted tokens
                             (EOS excluded) / decode time (prefill excluded; for HF and llama.cpp the first forward /
                             time to first token is the prefill and that first token is not counted).
    speedup_vs_constrained   median over prompts of (tokens/s of the mode ÷ tokens/s of ``constrained``), per prompt.
    tokens_per_forward       emitted tokens / target forwards, summed over prompts (HF: forwards counted by hooks).
    acceptance_by_position   accepted / drafted per drafter position in the window (0 = first drafted token),
                             summed over prompts; positions after the first rejection are not drafted.
                             Schema-forced tokens are not drafter tokens. HF assisted: rebuilt from cache lengths.
    mask_time_share          grammar mask time / decode wall time (prefill included), summed over runs.
    draft_time_share, verify_time_share   likewise (draft includes its own mask time; verify = target forwards
                             + masking the logits + acceptance).
    peak_rss_mb              ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (MB) after the mode's last run: the
                             PROCESS-WIDE peak so far (all modes share one process and one model), not the mode's own.
    valid                    fraction of prompts whose output parses (``agent.format.parse_turn``) into ≥ 1 call that
                             validates (``Tool.make_call``); a truncated output is invalid.
    identical_to_constrained fraction of prompts whose output token ids equal ``constrained``'s.
Values that cannot be measured for a mode are null. Also writes ``results.md``, ``speedup.png`` and
``per_prompt.jsonl`` (one line per mode and prompt).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from agent.bfcl import CATEGORIES, load_questions
from agent.format import parse_turn, render_prompt, turn_grammar
from decoding import DEFAULT_DRAFTER, DEFAULT_MODEL, DRAFTERS, Generator, LoadedModel, ModelNotFoundError, load_model
from schemas import ToolRegistry, call_schema
from schemas.bfcl import tool_from_bfcl
from schemas.errors import SpecAgentError, ToolCallError

MODES = ("hf_unconstrained", "constrained", "forced", "lookup", "mtp", "draft_model", "hf_assisted_constrained",
         "llamacpp_constrained", "best")
OUR_DRAFTERS = {"constrained": "none", "forced": "forced", "lookup": "lookup", "mtp": "mtp",
                "draft_model": "draft_model", "best": None}  # None: the Generator's default (DEFAULT_DRAFTER)
FIELDS = ("tokens_per_s", "speedup_vs_constrained", "tokens_per_forward", "acceptance_by_position",
          "mask_time_share", "draft_time_share", "verify_time_share", "peak_rss_mb", "valid",
          "identical_to_constrained")
BASELINE = "constrained"
MAX_STRING_LENGTH = 200  # as ``python -m agent bfcl``
MAX_DECIMALS = 8
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


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
    registry: ToolRegistry
    ids: list[int]
    grammar: Any
    call_schema: dict


def load_rows(categories: list[str], data_dir: str | None, limit: int | None) -> list[tuple[str, dict]]:
    """``(category, row)`` for the first ``limit`` questions of each category."""
    out = []
    for cat in categories:
        if cat not in CATEGORIES:
            raise SystemExit(f"unknown BFCL category {cat!r}; choose from {', '.join(CATEGORIES)}")
        out.extend((cat, row) for row in load_questions(cat, data_dir, limit))
    return out


def build_prompts(tokenizer, rows: list[tuple[str, dict]]) -> list[BenchPrompt]:
    """Tools, prompt ids and turn grammar per row, exactly as ``agent.bfcl.run_bfcl`` with the bfcl CLI's Agent."""
    from agent.format import bound_scalars

    prompts = []
    for cat, row in rows:
        code_strings = cat in ("simple_java", "simple_javascript")
        registry = ToolRegistry(strict=False)
        for fn in row["function"]:
            registry.register(tool_from_bfcl(fn, code_strings=code_strings))
        tools = list(registry)
        messages = [m for turn in row["question"] for m in turn]
        ids = render_prompt(tokenizer, messages, tools)
        grammar = turn_grammar(tools, "required", parallel=False, max_string_length=MAX_STRING_LENGTH,
                               max_decimals=MAX_DECIMALS)
        schema = bound_scalars(call_schema(tools), MAX_STRING_LENGTH, MAX_DECIMALS)
        prompts.append(BenchPrompt(row["id"], cat, registry, ids, grammar, schema))
    return prompts


def is_valid(text: str, truncated: bool, registry: ToolRegistry) -> bool:
    """The output parses into at least one call and every call validates against its tool's schema."""
    if truncated:
        return False
    try:
        calls, _ = parse_turn(text)
        if not calls:
            return False
        for c in calls:
            if not isinstance(c, dict) or "name" not in c or "arguments" not in c:
                return False
            registry.get(c["name"]).make_call(c["arguments"])
        return True
    except (ValueError, TypeError, ToolCallError):
        return False


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
        self.draft_loaded: LoadedModel | None = None
        self.draft_error: str | None = None
        if draft_model is None:
            self.draft_error = "no --draft-model given"
        else:
            try:
                self.draft_loaded = draft_model if isinstance(draft_model, LoadedModel) else load_model(
                    draft_model, device=str(loaded.device), dtype=loaded.dtype)
                if self.draft_loaded.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
                    raise ValueError("the draft model's tokenizer differs from the target's")
            except (ModelNotFoundError, ValueError, OSError) as e:
                self.draft_error = f"draft model {draft_model!r} cannot be loaded: {e}"
                self.draft_loaded = None
        self.gen = Generator(loaded, draft_model=self.draft_loaded)  # defaults: DEFAULT_DRAFTER, default γ
        if mtp_checkpoint is not None:
            self.gen.mtp_checkpoint = mtp_checkpoint  # read by Generator.mtp_head() (decoding/mtp.py)
        self._llamacpp = None

    # -- per-mode setup (raises SkipMode) ------------------------------------------------------------------------------
    def check(self, mode: str) -> None:
        """Raise :class:`SkipMode` when ``mode`` cannot run here."""
        if mode == "mtp" and "mtp" not in DRAFTERS:
            raise SkipMode(f"decoding has no 'mtp' drafter (DRAFTERS = {', '.join(DRAFTERS)})")
        if mode == "draft_model" and self.draft_loaded is None:
            raise SkipMode(self.draft_error or "no draft model")
        if mode == "llamacpp_constrained" and self._llamacpp is None:
            from .llamacpp_peer import LlamaCppPeer, LlamaCppUnavailable

            if self.model_spec is None:
                raise SkipMode("llama.cpp needs the model's GGUF; the model was passed in already loaded")
            try:
                self._llamacpp = LlamaCppPeer(self.model_spec, n_threads=torch.get_num_threads(),
                                              gpu=self.loaded.device.type == "cuda")
            except (LlamaCppUnavailable, ModelNotFoundError) as e:
                raise SkipMode(str(e)) from None

    # -- one decode ----------------------------------------------------------------------------------------------------
    def run(self, mode: str, p: BenchPrompt) -> Run:
        if mode in OUR_DRAFTERS:
            return self.run_ours(OUR_DRAFTERS[mode], p, None if mode == "best" else self.num_draft_tokens)
        if mode == "hf_unconstrained":
            return self._run_hf(p, constrained=False)
        if mode == "hf_assisted_constrained":
            return self._run_hf(p, constrained=True)
        if mode == "llamacpp_constrained":
            return self._run_llamacpp(p)
        raise ValueError(f"unknown mode {mode!r}")

    def run_ours(self, drafter: str | None, p: BenchPrompt, num_draft_tokens: int | None) -> Run:
        """``Generator.generate`` greedy with ``drafter`` (None: the default) and γ (None: the default)."""
        res = self.gen.generate(p.ids, p.grammar, max_new_tokens=self.max_new_tokens, drafter=drafter,
                                num_draft_tokens=num_draft_tokens)
        s = res.stats
        speculative = (drafter or self.gen.drafter) != "none"
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

    def _run_llamacpp(self, p: BenchPrompt) -> Run:
        from .llamacpp_peer import call_gbnf

        r = self._llamacpp.generate(p.ids, call_gbnf(p.call_schema), max_new_tokens=self.max_new_tokens)
        text = self.loaded.tokenizer.decode(r.tokens, skip_special_tokens=False)
        return Run(r.tokens, text, r.truncated, r.seconds, _decode_tps(len(r.tokens), r.seconds, r.prefill_seconds),
                   len(r.tokens) + (0 if r.truncated else 1), None, None, None, 0.0, None)


# -- aggregation -------------------------------------------------------------------------------------------------------
def peak_rss_mb() -> float:
    """Process-wide peak resident set size so far (MB; ``ru_maxrss`` is KB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def acceptance_by_position(runs: list[Run]) -> list[float] | None:
    """Accepted / drafted per draft position, summed over ``runs`` (None when no run reports it)."""
    drafted: list[int] = []
    accepted: list[int] = []
    known = False
    for r in runs:
        if r.drafted_by_position is None:
            continue
        known = True
        for i, (d, a) in enumerate(zip(r.drafted_by_position, r.accepted_by_position)):
            while len(drafted) <= i:
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
    if not known:
        return None
    return [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)]


def _share(runs: list[Run], attr: str) -> float | None:
    vals = [getattr(r, attr) for r in runs]
    if any(v is None for v in vals):
        return None
    total = sum(r.seconds for r in runs)
    return round(sum(vals) / total, 4) if total > 0 else None


def aggregate(runs: dict[str, list[Run]], prompts: list[BenchPrompt], baseline: dict[str, list[Run]] | None,
              rss_mb: float) -> dict:
    """The result fields of one mode. ``runs[prompt id]`` = that prompt's repeats; ``baseline`` the same for
    ``constrained`` (None: speedup and identity are null)."""
    flat = [r for p in prompts for r in runs[p.id]]
    tps = {p.id: statistics.median(r.tokens_per_s for r in runs[p.id]) for p in prompts}
    speedups, identical = [], []
    if baseline is not None:
        for p in prompts:
            base = statistics.median(r.tokens_per_s for r in baseline[p.id])
            if base > 0:
                speedups.append(tps[p.id] / base)
            identical.append(runs[p.id][0].tokens == baseline[p.id][0].tokens)
    forwards = [r.forwards for r in flat]
    tpf = None if any(f is None for f in forwards) or not sum(forwards) else \
        round(sum(len(r.tokens) for r in flat) / sum(forwards), 4)
    valid = [is_valid(runs[p.id][0].text, runs[p.id][0].truncated, p.registry) for p in prompts]
    out = {
        "tokens_per_s": round(_median(list(tps.values())), 3),
        "speedup_vs_constrained": round(_median(speedups), 4) if speedups else None,
        "tokens_per_forward": tpf,
        "acceptance_by_position": acceptance_by_position(flat),
        "mask_time_share": _share(flat, "mask_seconds"),
        "draft_time_share": _share(flat, "draft_seconds"),
        "verify_time_share": _share(flat, "verify_seconds"),
        "peak_rss_mb": round(rss_mb, 1),
        "valid": round(sum(valid) / len(valid), 4) if valid else None,
        "identical_to_constrained": round(sum(identical) / len(identical), 4) if identical else None,
    }
    assert tuple(out) == FIELDS
    return out


# -- the benchmark -----------------------------------------------------------------------------------------------------
@dataclass
class BenchResult:
    results: dict[str, dict]  # mode -> FIELDS
    skipped: dict[str, str]  # mode -> why
    runs: dict[str, dict[str, list[Run]]] = field(default_factory=dict)  # mode -> prompt id -> repeats
    prompts: list[BenchPrompt] = field(default_factory=list)


def run_benchmark(loaded: LoadedModel, rows: list[tuple[str, dict]], modes: list[str], *, repeat: int = 1,
                  max_new_tokens: int = 384, num_draft_tokens: int = 4, draft_model: Any = None,
                  model_spec: str | None = None, mtp_checkpoint: str | None = None,
                  log: Callable[[str], None] = print) -> BenchResult:
    """Run ``modes`` on ``rows`` (``(category, BFCL row)``), interleaved per prompt, ``repeat`` times each.

    ``constrained`` is always run (it is the baseline of speedup and identity). Modes that cannot run are skipped
    with a printed reason (``BenchResult.skipped``).
    """
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    modes = list(dict.fromkeys(modes))
    if BASELINE not in modes:
        log(f"note: adding mode {BASELINE!r}, the baseline of speedup_vs_constrained and identical_to_constrained")
        modes.insert(0, BASELINE)
    prompts = build_prompts(loaded.tokenizer, rows)
    if not prompts:
        raise ValueError("no prompts")
    bench = Bench(loaded, model_spec=model_spec, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
                  max_new_tokens=max_new_tokens, mtp_checkpoint=mtp_checkpoint, log=log)
    skipped: dict[str, str] = {}
    active = []
    for m in modes:  # warm-up: one decode per mode on the first prompt, not counted; probes optional modes
        try:
            bench.check(m)
            bench.run(m, prompts[0])
            active.append(m)
        except SkipMode as e:
            skipped[m] = str(e)
        except (ModelNotFoundError, FileNotFoundError, NotImplementedError) as e:
            skipped[m] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - optional modes (mtp/draft_model/llama.cpp) may fail to load
            if m in ("mtp", "draft_model", "llamacpp_constrained"):
                skipped[m] = f"{type(e).__name__}: {e}"
            else:
                raise
        if m in skipped:
            log(f"SKIPPED {m}: {skipped[m]}")
    runs: dict[str, dict[str, list[Run]]] = {m: {p.id: [] for p in prompts} for m in active}
    rss: dict[str, float] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        for _ in range(repeat):
            for m in active:  # interleaved: A B C A B C …
                runs[m][p.id].append(bench.run(m, p))
                rss[m] = peak_rss_mb()
        line = "  ".join(f"{m} {statistics.median(r.tokens_per_s for r in runs[m][p.id]):.1f}" for m in active)
        log(f"[{i + 1}/{len(prompts)}] {p.id} ({len(runs[BASELINE][p.id][0].tokens)} tokens) tok/s: {line}")
    log(f"{len(prompts)} prompts x {repeat} repeats x {len(active)} modes in {time.perf_counter() - t0:.1f} s")
    results = {m: aggregate(runs[m], prompts, runs[BASELINE], rss[m]) for m in active}
    return BenchResult(results, skipped, runs, prompts)


# -- outputs -----------------------------------------------------------------------------------------------------------
def machine_meta(argv: list[str] | None = None, prog: str = "bench.run") -> dict:
    """Machine and run information for the ``meta`` object (CPU model from /proc/cpuinfo, threads, command, date)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    meta = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "command": " ".join([sys.executable.split("/")[-1], "-m", prog] + list(
                sys.argv[1:] if argv is None else argv)),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
    return meta


def write_markdown(path: Path, results: dict[str, dict], meta: dict) -> None:
    def fmt(v, pct=False):
        if v is None:
            return "–"
        if isinstance(v, list):
            return " ".join(f"{x:.2f}" for x in v[:8]) or "–"
        return f"{100 * v:.1f}%" if pct else (f"{v:.2f}" if isinstance(v, float) else str(v))

    lines = [f"# Decoding benchmark — {meta.get('model')} ({meta.get('device')}, {meta.get('dtype')})", "",
             f"{meta.get('n_prompts')} prompts ({', '.join(meta.get('categories', []))}), {meta.get('repeat')} "
             f"repeat(s), max_new_tokens {meta.get('max_new_tokens')}, γ {meta.get('num_draft_tokens')}; "
             f"{meta.get('cpu')}, {meta.get('torch_threads')} torch threads; {meta.get('date')}", "",
             f"`{meta.get('command')}`", "",
             "| mode | tokens/s | speedup vs constrained | tokens/forward | acceptance by position | mask | draft | "
             "verify | peak RSS MB | valid | identical to constrained |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for m, r in results.items():
        lines.append(f"| {m} | {fmt(r['tokens_per_s'])} | {fmt(r['speedup_vs_constrained'])} | "
                     f"{fmt(r['tokens_per_forward'])} | {fmt(r['acceptance_by_position'])} | "
                     f"{fmt(r['mask_time_share'], True)} | {fmt(r['draft_time_share'], True)} | "
                     f"{fmt(r['verify_time_share'], True)} | {fmt(r['peak_rss_mb'])} | {fmt(r['valid'], True)} | "
                     f"{fmt(r['identical_to_constrained'], True)} |")
    if meta.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"**{m}** ({why})" for m, why in meta["skipped"].items())]
    lines += ["", "tokens/s: median over prompts (each the median of its repeats), prefill excluded. Speedup: per "
              "prompt, then the median. Mask/draft/verify: shares of decode wall time. Peak RSS is process-wide "
              "(ru_maxrss after the mode's last run; every mode shares the process). – = not measurable.", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, results: dict[str, dict], title: str = "") -> None:
    """``speedup.png``: speedup vs constrained per mode (bars) and acceptance by draft position per mode (lines)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [m for m, r in results.items() if r["speedup_vs_constrained"] is not None]
    vals = [results[m]["speedup_vs_constrained"] for m in names]
    bars = ax1.bar(range(len(names)), vals, color=["#888" if m == BASELINE else "#3b75af" for m in names])
    ax1.axhline(1.0, color="k", lw=0.8, ls="--")
    ax1.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax1.set_ylabel("speedup vs constrained (median tokens/s ratio)")
    ax1.bar_label(bars, fmt="%.2f")
    ax1.set_title("speedup by mode")
    any_line = False
    for m, r in results.items():
        acc = r["acceptance_by_position"]
        if acc:
            ax2.plot(range(len(acc)), acc, marker="o", label=m)
            any_line = True
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2.set_xlabel("draft position in the window (0 = first drafted token)")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("acceptance by draft position")
    if any_line:
        ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out_dir: Path, res: BenchResult, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(meta, skipped=res.skipped)
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, **res.results}, indent=2, ensure_ascii=False))
    write_markdown(out_dir / "results.md", res.results, meta)
    plot(out_dir / "speedup.png", res.results, f"{meta.get('model')} — {meta.get('n_prompts')} prompts")
    with open(out_dir / "per_prompt.jsonl", "w") as f:
        for m, by_prompt in res.runs.items():
            for p in res.prompts:
                rs = by_prompt[p.id]
                base = res.runs[BASELINE][p.id][0].tokens
                f.write(json.dumps({
                    "mode": m, "id": p.id, "prompt_tokens": len(p.ids), "tokens": len(rs[0].tokens),
                    "tokens_per_s": [round(r.tokens_per_s, 3) for r in rs], "truncated": rs[0].truncated,
                    "valid": is_valid(rs[0].text, rs[0].truncated, p.registry),
                    "identical_to_constrained": rs[0].tokens == base,
                    "deterministic": all(r.tokens == rs[0].tokens for r in rs), "text": rs[0].text},
                    ensure_ascii=False) + "\n")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=DEFAULT_MODEL, help="alias, HF directory or .gguf path (default: smollm2)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--data-dir", default=None, help="folder with *BFCL_v4_<category>* files "
                                                     "(default ../shared/data/bfcl)")
    ap.add_argument("--category", nargs="+", default=["simple_python"],
                    help="BFCL categories (several allowed, space or comma separated)")
    ap.add_argument("--limit", type=int, default=None, help="first N questions per category")
    ap.add_argument("--repeat", type=int, default=1, help="decodes per prompt and mode (median taken)")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--draft-model", default=None, help="draft model spec (same tokenizer) for draft_model and "
                                                        "HF's assistant_model")
    ap.add_argument("--mtp-checkpoint", default=None, help="MTP head directory for the mtp drafter "
                                                           "(default: decoding's checkpoints/ for this model)")


def categories(args) -> list[str]:
    return [c for arg in args.category for c in arg.split(",") if c]


def main(argv: list[str] | None = None, *, loaded: LoadedModel | None = None,
         draft_model: LoadedModel | None = None) -> int:
    """CLI entry point. ``loaded`` / ``draft_model``: already loaded models (tests) instead of ``--model`` /
    ``--draft-model``."""
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of: {', '.join(MODES)}")
    ap.add_argument("--num-draft-tokens", type=int, default=4, help="γ for forced/lookup/mtp/draft_model and HF's "
                                                                    "assistant (best uses the default γ)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default bench/results/)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows = load_rows(categories(args), args.data_dir, args.limit)
    model_spec = None
    if loaded is None:
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
        model_spec = args.model
    res = run_benchmark(loaded, rows, modes, repeat=args.repeat, max_new_tokens=args.max_new_tokens,
                        num_draft_tokens=args.num_draft_tokens,
                        draft_model=draft_model if draft_model is not None else args.draft_model,
                        model_spec=model_spec, mtp_checkpoint=args.mtp_checkpoint)
    meta = machine_meta(argv)
    meta.update(model=loaded.name, model_sha256=loaded.sha256, device=str(loaded.device),
                dtype=str(loaded.dtype).replace("torch.", ""), categories=categories(args), repeat=args.repeat,
                max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                default_drafter=DEFAULT_DRAFTER, n_prompts=len(res.prompts),
                prompts=[{"id": p.id, "prompt_tokens": len(p.ids)} for p in res.prompts],
                peak_rss_note="peak_rss_mb is process-wide (ru_maxrss after the mode's last run), not per mode")
    out = Path(args.out)
    write_outputs(out, res, meta)
    print(Path(out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'speedup.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
