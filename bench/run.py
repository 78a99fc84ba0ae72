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
    llamacpp_constrained     llama-cpp-python on the same GGUF, GBNF from the call schema (skipped without llama_cpp):
                             the peer a user would pick.
    llamacpp_unconstrained   llama-cpp-python on the same GGUF, greedy, no grammar (stops at EOS).
    llamacpp_lookup_constrained  llama-cpp-python's own speculative decoding (``LlamaPromptLookupDecoding``,
                             ``--peer-lookup-tokens`` per window) under the same GBNF: the fastest a llama.cpp user has.
    llamacpp_engine_<d>      our decoder on the llama.cpp backend (``decoding/llamacpp.py``, same GGUF) with drafter
                             <d>: ``llamacpp_engine_constrained`` (one token per forward: that engine's baseline of
                             identity), ``_forced``, ``_schema``, ``_lookup``, ``_best`` (the default drafter and γ).
    best                     the agent's default configuration (``decoding.DEFAULT_DRAFTER``, default γ) on torch.
    ``--modes llamacpp``     = llamacpp_unconstrained, llamacpp_constrained, llamacpp_lookup_constrained,
                             llamacpp_engine_constrained,
                             llamacpp_engine_lookup, llamacpp_engine_best, constrained, best.
    (any other row of ``decoding.DRAFTERS``, e.g. ``schema``, ``lookup_mtp``: speculative with that drafter; not in
    the default ``--modes``)

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
    valid                    fraction of prompts whose output parses (the tool format's ``parse``) into ≥ 1 call that
                             validates (``Tool.make_call``); a truncated output is invalid.
    identical_to_constrained fraction of prompts whose output token ids equal those of the constrained greedy of
                             the same engine (``constrained``; ``llamacpp_engine_constrained`` for llama.cpp backend
                             modes). llama.cpp's own grammar differs from ours (free whitespace), so its modes are
                             not expected to be identical.
``meta.ratios``: per-prompt speed ratios (median) of llamacpp_engine_best against llamacpp_constrained,
llamacpp_unconstrained and best, where they ran.
Values that cannot be measured for a mode are null. Also writes ``results.md``, ``speedup.png`` and
``per_prompt.jsonl`` (one line per mode and prompt).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from decoding import DEFAULT_DRAFTER, LoadedModel, ModelNotFoundError, MTPError, backend_of, load_model

from .aggregate import aggregate, median_speed_ratio, peak_rss_mb
from .bfcl import CATEGORIES, SPLITS, load_questions
from .modes import (BASELINE, DEFAULT_MODES, MODE_GROUPS, PEER_MODES, Bench, BenchPrompt, BenchResult, Run, SkipMode,
                    all_modes, baseline_of, build_prompts, is_baseline, our_modes)
from .report import machine_meta, write_outputs

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def load_rows(categories: list[str], data_dir: str | None, limit: int | None,
              split: str | None = None) -> list[tuple[str, dict]]:
    """``(category, row)`` for the first ``limit`` questions of each category (of its ``split``: ``dev`` = first
    half of the file, ``test`` = second half, None = the whole file; see ``bench.bfcl.load_questions``)."""
    out = []
    for cat in categories:
        if cat not in CATEGORIES:
            raise SystemExit(f"unknown BFCL category {cat!r}; choose from {', '.join(CATEGORIES)}")
        out.extend((cat, row) for row in load_questions(cat, data_dir, limit, split))
    return out


# -- the benchmark -----------------------------------------------------------------------------------------------------
def run_benchmark(loaded: LoadedModel, rows: list[tuple[str, dict]], modes: list[str], *, repeat: int = 1,
                  max_new_tokens: int = 384, num_draft_tokens: int = 4, draft_model: Any = None,
                  model_spec: str | None = None, mtp_checkpoint: str | None = None,
                  log: Callable[[str], None] = print, peer_lookup_tokens: int = 10) -> BenchResult:
    """Run ``modes`` on ``rows`` (``(category, BFCL row)``), interleaved per prompt, ``repeat`` times each.

    ``constrained`` is always run (it is the baseline of speedup and identity). Modes that cannot run are skipped
    with a printed reason (``BenchResult.skipped``).
    """
    unknown = [m for m in modes if m not in all_modes()]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {', '.join(all_modes())}")
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    modes = list(dict.fromkeys(modes))
    if BASELINE not in modes:
        log(f"note: adding mode {BASELINE!r}, the baseline of speedup_vs_constrained and identical_to_constrained")
        modes.insert(0, BASELINE)
    for base in dict.fromkeys(baseline_of(m) for m in modes):
        if base not in modes:
            log(f"note: adding mode {base!r}, its backend's baseline of identical_to_constrained")
            modes.insert(1, base)
    prompts = build_prompts(loaded.tokenizer, rows)
    if not prompts:
        raise ValueError("no prompts")
    bench = Bench(loaded, model_spec=model_spec, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
                  max_new_tokens=max_new_tokens, mtp_checkpoint=mtp_checkpoint, log=log,
                  peer_lookup_tokens=peer_lookup_tokens)
    skipped: dict[str, str] = {}
    active = []
    for m in modes:  # warm-up: one decode per mode on the first prompt, not counted; probes optional modes
        try:
            bench.check(m)
            bench.run(m, prompts[0])
            active.append(m)
        except SkipMode as e:
            skipped[m] = str(e)
        except (ModelNotFoundError, FileNotFoundError, NotImplementedError, MTPError) as e:
            skipped[m] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - optional modes (mtp/draft_model/llama.cpp) may fail to load
            backend, drafter = our_modes().get(m, (None, None))
            if m in PEER_MODES or drafter in ("mtp", "draft_model") or backend not in (None, backend_of(loaded).name):
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
            for m in list(active):  # interleaved: A B C A B C …
                try:
                    runs[m][p.id].append(bench.run(m, p))
                except Exception as e:  # noqa: BLE001 - a peer failing on one prompt drops that mode, not the run
                    if is_baseline(m):
                        raise
                    skipped[m] = f"failed on {p.id}: {type(e).__name__}: {str(e)[:200]}"
                    log(f"DROPPED {m}: {skipped[m]}")
                    active.remove(m)
                    del runs[m]
                    continue
                rss[m] = peak_rss_mb()
        line = "  ".join(f"{m} {statistics.median(r.tokens_per_s for r in runs[m][p.id]):.1f}" for m in active)
        log(f"[{i + 1}/{len(prompts)}] {p.id} ({len(runs[BASELINE][p.id][0].tokens)} tokens) tok/s: {line}")
    log(f"{len(prompts)} prompts x {repeat} repeats x {len(active)} modes in {time.perf_counter() - t0:.1f} s")
    results = {m: aggregate(runs[m], prompts, runs[BASELINE], rss[m], runs.get(baseline_of(m))) for m in active}
    return BenchResult(results, skipped, runs, prompts)


RATIOS = (("llamacpp_engine_best", "llamacpp_constrained"), ("llamacpp_engine_best", "llamacpp_unconstrained"),
          ("llamacpp_engine_best", "llamacpp_lookup_constrained"),
          ("llamacpp_engine_best", "best"), ("llamacpp_engine_constrained", "constrained"),
          ("best", "llamacpp_constrained"))


def speed_ratios(res: BenchResult) -> dict[str, float]:
    """``"A / B"`` → median over prompts of (A's tokens/s ÷ B's tokens/s on that prompt), for the pairs of
    :data:`RATIOS` that both ran (:func:`bench.aggregate.median_speed_ratio`)."""
    out = {}
    for a, b in RATIOS:
        if a in res.runs and b in res.runs:
            ratio = median_speed_ratio(res.runs[a], res.runs[b], res.prompts)
            if ratio is not None:
                out[f"{a} / {b}"] = round(ratio, 3)
    return out


def add_model_args(ap: argparse.ArgumentParser) -> None:
    # the benchmark stays on SmolLM2-135M: its MTP head and the published speed-ups are for that model
    ap.add_argument("--model", default="smollm2", help="alias, HF directory or .gguf path (default: smollm2)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of torch and llama.cpp (default: torch's)")
    ap.add_argument("--split", default=None, choices=SPLITS,
                    help="BFCL split: dev = first half of each file (tuned on), test = second half (never tuned "
                         "on); default: the whole file")
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
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma list of: {', '.join(all_modes())}, or a group: "
                         + "; ".join(f"{g} = {', '.join(ms)}" for g, ms in MODE_GROUPS.items())
                         + f" (default: {', '.join(DEFAULT_MODES)})")
    ap.add_argument("--num-draft-tokens", type=int, default=4, help="γ for forced/lookup/mtp/draft_model and HF's "
                                                                    "assistant (best uses the default γ)")
    ap.add_argument("--peer-lookup-tokens", type=int, default=10,
                    help="num_pred_tokens of llama-cpp-python's LlamaPromptLookupDecoding in the "
                         "llamacpp_lookup_constrained peer (default 10, its own default; its docs suggest 2 on CPU)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default bench/results/)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    modes = [x for m in modes for x in MODE_GROUPS.get(m, (m,))]
    rows = load_rows(categories(args), args.data_dir, args.limit, args.split)
    model_spec = None
    if loaded is None:
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
        model_spec = args.model
    res = run_benchmark(loaded, rows, modes, repeat=args.repeat, max_new_tokens=args.max_new_tokens,
                        num_draft_tokens=args.num_draft_tokens,
                        draft_model=draft_model if draft_model is not None else args.draft_model,
                        model_spec=model_spec, mtp_checkpoint=args.mtp_checkpoint,
                        peer_lookup_tokens=args.peer_lookup_tokens)
    meta = machine_meta(argv)
    meta.update(model=loaded.name, model_sha256=loaded.sha256, device=str(loaded.device),
                dtype=str(loaded.dtype).replace("torch.", ""), categories=categories(args), repeat=args.repeat,
                max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens, split=args.split,
                peer_lookup_tokens=args.peer_lookup_tokens,
                ratios=speed_ratios(res),
                default_drafter=DEFAULT_DRAFTER, n_prompts=len(res.prompts),
                prompts=[{"id": p.id, "prompt_tokens": len(p.ids)} for p in res.prompts],
                peak_rss_note="peak_rss_mb is process-wide (ru_maxrss after the mode's last run), not per mode")
    if model_spec is not None and any(m.startswith("llamacpp") for m in modes):
        from decoding.llamacpp import gguf_of  # the file the llama.cpp modes ran (the 0.5B alias: Q8_0)
        meta["llamacpp_model"] = gguf_of(model_spec)[1]
    out = Path(args.out)
    write_outputs(out, res, meta)
    print(Path(out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'speedup.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
