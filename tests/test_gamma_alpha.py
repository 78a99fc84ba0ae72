"""bench/gamma.py: α counts only drafter tokens the target verified (Σ accepted_by_position / Σ drafted_by_position)."""
from __future__ import annotations

from bench.gamma import summarize
from bench.modes import Run


def _run(tokens_per_s, drafted, accepted, by_position_drafted, by_position_accepted):
    return Run(tokens=[1, 2, 3], text="", truncated=False, seconds=1.0, tokens_per_s=tokens_per_s, forwards=2,
               drafted_by_position=by_position_drafted, accepted_by_position=by_position_accepted,
               draft_seconds=0.01, verify_seconds=0.2, drafted=drafted, accepted=accepted)


def test_alpha_ignores_draft_tokens_after_the_first_rejection():
    # two windows of γ = 4: [accept, reject, -, -] and [accept, accept, accept, reject]: 8 drafted, 4 accepted,
    # 6 verified (the two tokens after the first rejection were never checked)
    runs = {"p": [_run(10.0, 8, 4, [2, 2, 1, 1], [2, 1, 1, 0])]}
    base = {"p": [_run(5.0, 0, 0, None, None)]}
    row = summarize("lookup", 4, runs, base, ["p"])
    assert row["alpha"] == round(4 / 6, 4)
    assert row["verified"] == 6 and row["drafted"] == 8
