"""Report: ``results.json``, ``results.md``, ``speedup.png`` and ``per_prompt.jsonl`` from a benchmark result, and
the machine information of the ``meta`` object."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

from .modes import BASELINE, BenchResult, baseline_of, is_valid


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
             f"split {meta.get('split') or 'whole file'}; "
             f"{meta.get('cpu')}, {meta.get('torch_threads')} threads; {meta.get('date')}"
             + (f"; llama.cpp modes on {meta['llamacpp_model']}" if meta.get("llamacpp_model") else ""), "",
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
    if meta.get("ratios"):
        lines += ["", "Speed ratios (per prompt, then the median): " + "; ".join(
            f"{pair} = {v:.2f}×" for pair, v in meta["ratios"].items())]
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
                base = res.runs[baseline_of(m)][p.id][0].tokens
                f.write(json.dumps({
                    "mode": m, "id": p.id, "prompt_tokens": len(p.ids), "tokens": len(rs[0].tokens),
                    "tokens_per_s": [round(r.tokens_per_s, 3) for r in rs], "truncated": rs[0].truncated,
                    "valid": is_valid(rs[0].text, rs[0].truncated, p),
                    "identical_to_constrained": rs[0].tokens == base,
                    "deterministic": all(r.tokens == rs[0].tokens for r in rs), "text": rs[0].text},
                    ensure_ascii=False) + "\n")
