"""Aggregation: the result fields of one mode from its runs (definitions in ``bench/run.py``)."""
from __future__ import annotations

import resource
import statistics
import sys

from decoding import DecodeStats

from .modes import BenchPrompt, Run, is_valid

FIELDS = ("tokens_per_s", "speedup_vs_constrained", "tokens_per_forward", "acceptance_by_position",
          "mask_time_share", "draft_time_share", "verify_time_share", "peak_rss_mb", "valid",
          "identical_to_constrained")


def peak_rss_mb() -> float:
    """Process-wide peak resident set size so far (MB; ``ru_maxrss`` is KB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def acceptance_by_position(runs: list[Run]) -> list[float] | None:
    """Accepted / drafted per draft position, summed over ``runs`` (None when no run reports it)."""
    known = [r for r in runs if r.drafted_by_position is not None]
    if not known:
        return None
    total = sum((DecodeStats(drafted_by_position=list(r.drafted_by_position),
                             accepted_by_position=list(r.accepted_by_position)) for r in known), DecodeStats())
    return [round(a, 4) for a in total.acceptance_by_position]


def _share(runs: list[Run], attr: str) -> float | None:
    vals = [getattr(r, attr) for r in runs]
    if any(v is None for v in vals):
        return None
    total = sum(r.seconds for r in runs)
    return round(sum(vals) / total, 4) if total > 0 else None


def median_speed_ratio(runs: dict[str, list[Run]], base: dict[str, list[Run]],
                       prompts: list[BenchPrompt]) -> float | None:
    """Median over prompts of (tokens/s of ``runs`` ÷ tokens/s of ``base`` on that prompt), each side the median of
    its repeats; prompts where ``base`` is 0 tokens/s are left out (None when none is left)."""
    ratios = []
    for p in prompts:
        b = statistics.median(r.tokens_per_s for r in base[p.id])
        if b > 0:
            ratios.append(statistics.median(r.tokens_per_s for r in runs[p.id]) / b)
    return _median(ratios)


def aggregate(runs: dict[str, list[Run]], prompts: list[BenchPrompt], baseline: dict[str, list[Run]] | None,
              rss_mb: float, same_engine: dict[str, list[Run]] | None = None) -> dict:
    """The result fields of one mode. ``runs[prompt id]`` = that prompt's repeats; ``baseline`` the same for
    ``constrained`` (None: speedup and identity are null); ``same_engine``: the constrained greedy of the mode's own
    engine, which ``identical_to_constrained`` compares with (default ``baseline``)."""
    same_engine = baseline if same_engine is None else same_engine
    flat = [r for p in prompts for r in runs[p.id]]
    tps = {p.id: statistics.median(r.tokens_per_s for r in runs[p.id]) for p in prompts}
    speedup = None if baseline is None else median_speed_ratio(runs, baseline, prompts)
    identical = [] if baseline is None else [runs[p.id][0].tokens == same_engine[p.id][0].tokens for p in prompts]
    forwards = [r.forwards for r in flat]
    tpf = None if any(f is None for f in forwards) or not sum(forwards) else \
        round(sum(len(r.tokens) for r in flat) / sum(forwards), 4)
    valid = [is_valid(runs[p.id][0].text, runs[p.id][0].truncated, p) for p in prompts]
    out = {
        "tokens_per_s": round(_median(list(tps.values())), 3),
        "speedup_vs_constrained": None if speedup is None else round(speedup, 4),
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
