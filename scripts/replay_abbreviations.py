"""Replay the reading of abbreviations (``agent.grounding.Grounding.abbreviates``: "MSFT", "NYC" count as written)
over recorded BFCL outputs (docs/benchmarks.md, "Tickers and initials count as written").

For every recorded turn with calls, grounds them (``agent.grounding.grounded_call``) and asks whether they take
from the conversation (``takes_from_conversation``, the tool-choice rule that decodes a turn again) with the
reading off and on, scores both with the bfcl command's checker, and prints every turn where either differs, then
the counts. Rules that decide a decode (the several-call end rule) are not replayed here: see
``scripts/several_calls_end.py simulate``.

Usage: ``python scripts/replay_abbreviations.py OUT.tsv [OUT.tsv …]`` (a question in several files: the first row).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.grounding import Grounding, conversation_text, grounded_call, takes_from_conversation  # noqa: E402
from replay_grounding import Tally, recorded_turns  # noqa: E402 (this folder)


class _Unread(Grounding):
    """The grounding with no abbreviation read."""

    def abbreviates(self, value: str) -> bool:
        return False


def main(paths: list[str]) -> int:
    turns = choice = 0
    tally = Tally()
    for qid, _, turn, calls in recorded_turns(paths):
        turns += 1
        text = conversation_text(turn.messages)
        off, on = _Unread(text), Grounding(text)
        if any(takes_from_conversation(c, off) for c in calls) != any(takes_from_conversation(c, on) for c in calls):
            choice += 1
            print(qid, "tool choice differs:", json.dumps(calls)[:200])
        tally.add(qid, turn, [grounded_call(c, turn.tools, off) for c in calls],
                  [grounded_call(c, turn.tools, on) for c in calls])
    print(f"turns with calls {turns}; calls changed in {tally.changed}: won {tally.won}, lost {tally.lost}; tool "
          f"choice differs in {choice}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
