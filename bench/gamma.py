"""γ sweep: ``python -m bench.gamma [--limit N] [--gammas 1-8] [--drafters lookup,mtp] [--out DIR]``.

For each drafter (``lookup``; ``mtp`` when ``decoding`` has it and its checkpoint loads) and each γ (drafter tokens
per window; schema-forced tokens ride along for free), on the same prompts as ``bench.run`` (interleaved per prompt
with the ``constrained`` baseline, one uncounted warm-up per configuration on the first prompt), measures:

    speedup      median over prompts of tokens/s ÷ the constrained (one token per forward) tokens/s, per prompt.
    alpha        α, acceptance rate of drafter tokens: Σ accepted_by_position / Σ drafted_by_position over positions
                 and prompts, i.e. accepted / *verified* drafter tokens. Tokens after the first rejection in a window
                 were never checked, so they do not count (accepted / drafted would bias α low, the more so the
                 larger γ). Forced tokens excluded; for ``lookup`` the drafter includes llguidance fast-forward
                 proposals.
    c            drafter cost per token ÷ target cost per forward:
                 (Σ draft_seconds / Σ drafted) ÷ (Σ verify_seconds / Σ target_forwards). ``draft_seconds`` includes
                 the grammar masks of the window, so c is not exactly 0 for lookup.
    predicted_speedup            Leviathan et al. 2023 (arXiv 2211.17192), §3.4, Theorem 3.8: the expected
                 walltime improvement factor (1 − α^(γ+1)) / ((1 − α)(γc + 1)), with the measured α and c at that γ
                 ((γ + 1) / (γc + 1) when α = 1).
    tokens_per_forward, predicted_tokens_per_forward   measured, and Leviathan et al. Eq. (1), the expected
                 tokens per target run (1 − α^(γ+1)) / (1 − α).

The prediction assumes i.i.d. acceptance with rate α and no free tokens; schema-forced tokens (accepted without a
drafter call) push measurements above it, and per-window overheads (masking, cache crops) below it.
Writes ``gamma.json`` and ``gamma.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from decoding import DRAFTERS, LoadedModel, load_model

from .aggregate import acceptance_by_position
from .modes import Bench, Run, SkipMode, build_prompts
from .report import machine_meta
from .run import DEFAULT_OUT, add_model_args, categories, load_rows


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime improvement factor, Leviathan et al. 2023, Thm 3.8: (1 − α^(γ+1)) / ((1 − α)(γc + 1))."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per target run, Leviathan et al. 2023, Eq. (1): (1 − α^(γ+1)) / (1 − α) (γ + 1 at α = 1)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def parse_gammas(text: str) -> list[int]:
    """``"1-8"`` or ``"1,2,4"`` -> γ list."""
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part.strip():
            out.append(int(part))
    if not out or min(out) < 1:
        raise SystemExit(f"--gammas needs positive integers, got {text!r}")
    return out


def summarize(drafter: str, gamma: int, runs: dict[str, list[Run]], base: dict[str, list[Run]], ids: list[str]) -> dict:
    """One row of the sweep (see the module docstring)."""
    flat = [r for i in ids for r in runs[i]]
    speedups = []
    for i in ids:
        b = statistics.median(r.tokens_per_s for r in base[i])
        if b > 0:
            speedups.append(statistics.median(r.tokens_per_s for r in runs[i]) / b)
    drafted = sum(r.drafted for r in flat)
    accepted = sum(r.accepted for r in flat)
    forwards = sum(r.forwards for r in flat)
    draft_s = sum(r.draft_seconds for r in flat)
    verify_s = sum(r.verify_seconds for r in flat)
    checked = sum(sum(r.drafted_by_position or []) for r in flat)
    alpha = sum(sum(r.accepted_by_position or []) for r in flat) / checked if checked else None
    c = (draft_s / drafted) / (verify_s / forwards) if drafted and forwards and verify_s > 0 else None
    row = {"drafter": drafter, "gamma": gamma,
           "speedup": round(statistics.median(speedups), 4) if speedups else None,
           "alpha": round(alpha, 4) if alpha is not None else None,
           "c": round(c, 5) if c is not None else None,
           "predicted_speedup": round(leviathan_speedup(alpha, gamma, c), 4) if alpha is not None and c is not None
           else None,
           "tokens_per_forward": round(sum(len(r.tokens) for r in flat) / forwards, 4) if forwards else None,
           "predicted_tokens_per_forward": round(expected_tokens(alpha, gamma), 4) if alpha is not None else None,
           "acceptance_by_position": acceptance_by_position(flat),
           "drafted": drafted, "accepted": accepted, "verified": checked,
           "identical_to_constrained": round(sum(runs[i][0].tokens == base[i][0].tokens for i in ids) / len(ids), 4)}
    return row


def run_sweep(loaded: LoadedModel, rows, drafters: list[str], gammas: list[int], *, repeat: int = 1,
              max_new_tokens: int = 384, mtp_checkpoint: str | None = None,
              log: Callable[[str], None] = print) -> tuple[list[dict], dict[str, str]]:
    """-> (one row per (drafter, γ), skipped drafters with the reason)."""
    prompts = build_prompts(loaded.tokenizer, rows)
    bench = Bench(loaded, max_new_tokens=max_new_tokens, mtp_checkpoint=mtp_checkpoint, log=log)
    skipped: dict[str, str] = {}
    active = []
    bench.run_ours("none", prompts[0], None)  # warm-up of the baseline
    for d in drafters:
        try:
            if d not in DRAFTERS:
                raise SkipMode(f"decoding has no {d!r} drafter (DRAFTERS = {', '.join(DRAFTERS)})")
            for g in gammas:  # warm-up per configuration; also probes the drafter (e.g. the MTP checkpoint)
                bench.run_ours(d, prompts[0], g)
            active.append(d)
        except SkipMode as e:
            skipped[d] = str(e)
        except Exception as e:  # noqa: BLE001 - an optional drafter that cannot load is skipped, not fatal
            if d == "lookup":
                raise
            skipped[d] = f"{type(e).__name__}: {e}"
        if d in skipped:
            log(f"SKIPPED {d}: {skipped[d]}")
    configs = [(d, g) for d in active for g in gammas]
    base: dict[str, list[Run]] = {p.id: [] for p in prompts}
    runs: dict[tuple[str, int], dict[str, list[Run]]] = {cfg: {p.id: [] for p in prompts} for cfg in configs}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        for _ in range(repeat):
            base[p.id].append(bench.run_ours("none", p, None))
            for d, g in configs:
                runs[(d, g)][p.id].append(bench.run_ours(d, p, g))
        log(f"[{i + 1}/{len(prompts)}] {p.id}")
    log(f"sweep done in {time.perf_counter() - t0:.1f} s")
    ids = [p.id for p in prompts]
    return [summarize(d, g, runs[(d, g)], base, ids) for d, g in configs], skipped


def write_markdown(path: Path, rows: list[dict], meta: dict) -> None:
    def f(v, nd=2):
        return "–" if v is None else f"{v:.{nd}f}"

    lines = [f"# γ sweep — {meta.get('model')} ({meta.get('device')}); {meta.get('n_prompts')} prompts", "",
             f"`{meta.get('command')}` — {meta.get('cpu')}, {meta.get('torch_threads')} threads, {meta.get('date')}",
             "", "Predicted: Leviathan et al. 2023 (arXiv 2211.17192) Thm 3.8, (1 − α^(γ+1)) / ((1 − α)(γc + 1)), "
             "with the measured α and c at each γ; tokens/forward predicted by their Eq. (1).", "",
             "| drafter | γ | speedup | predicted | α | c | tokens/forward | predicted tokens/forward | "
             "identical |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['drafter']} | {r['gamma']} | {f(r['speedup'])} | {f(r['predicted_speedup'])} | "
                     f"{f(r['alpha'], 3)} | {f(r['c'], 4)} | {f(r['tokens_per_forward'])} | "
                     f"{f(r['predicted_tokens_per_forward'])} | {f(r['identical_to_constrained'])} |")
    if meta.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"**{d}** ({why})" for d, why in meta["skipped"].items())]
    lines += ["", "Forced tokens (the grammar allows one token) are free and not counted in α; they lift the "
              "measured speedup above the prediction.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None, *, loaded: LoadedModel | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gamma", description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--gammas", default="1-8", help="γ values: 1-8 or 1,2,4")
    ap.add_argument("--drafters", default="lookup,mtp", help="comma list (mtp is skipped when unavailable)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = load_rows(categories(args), args.data_dir, args.limit)
    if loaded is None:
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    gammas = parse_gammas(args.gammas)
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    result, skipped = run_sweep(loaded, rows, drafters, gammas, repeat=args.repeat,
                                max_new_tokens=args.max_new_tokens, mtp_checkpoint=args.mtp_checkpoint)
    meta = machine_meta(argv, prog="bench.gamma")
    meta.update(model=loaded.name, device=str(loaded.device), dtype=str(loaded.dtype).replace("torch.", ""),
                categories=categories(args), n_prompts=len(rows), repeat=args.repeat,
                max_new_tokens=args.max_new_tokens, gammas=gammas, skipped=skipped,
                prompts=[r["id"] for _, r in rows])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gamma.json").write_text(json.dumps({"meta": meta, "rows": result}, indent=2, ensure_ascii=False))
    write_markdown(out / "gamma.md", result, meta)
    print((out / "gamma.md").read_text())
    print(f"wrote {out / 'gamma.json'}, {out / 'gamma.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
