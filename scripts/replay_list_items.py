"""Replay the written-list rules (``agent.parallel_calls.with_written_lists``: the items of a list of numbers, a
list every call of a tool holds shared out) over recorded BFCL outputs (docs/benchmarks.md, "Items of a written
list", "A list shared out").

Each row of a ``python -m agent bfcl`` TSV holds the turn's decoded text. For every question where several calls
are asked for (``parallel_tool_calls=True``: the parallel categories), this parses the calls, grounds them as
``LocalEngine.turn`` does (``agent.engine.returned_calls`` without the list rules), completes them over the
lists the user's last message writes, scores both with the bfcl command's checker (BFCL's own where installed)
and prints every question whose calls the rules change, with both verdicts, then the counts. The rules act after
the decodes, so on a run made with them the verdicts "after" are the run's own.

Usage: ``python scripts/replay_list_items.py OUT.tsv [OUT.tsv …]`` (a question in several files: the first row).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.engine import DEFAULT_MAX_PARALLEL_CALLS, returned_calls  # noqa: E402
from agent.grounding import Grounding, conversation_text, last_user_text  # noqa: E402
from agent.parallel_calls import with_written_lists  # noqa: E402
from replay_grounding import Tally, recorded_turns  # noqa: E402 (this folder)


def main(paths: list[str]) -> int:
    turns = 0
    tally = Tally()
    for qid, _, turn, calls in recorded_turns(paths):
        if turn.parallel is not True:
            continue
        turns += 1
        grounding = Grounding(conversation_text(turn.messages))
        # the engine's calls without the written-list rules, then with them
        before = returned_calls(calls, turn.tools, turn.messages, grounding, several=False,
                                max_calls=DEFAULT_MAX_PARALLEL_CALLS)
        asked = last_user_text(turn.messages)
        tally.add(qid, turn, before, with_written_lists(before, turn.tools, asked, DEFAULT_MAX_PARALLEL_CALLS))
    print(f"turns asked for several calls {turns}; the rule changes the calls of {tally.changed}: "
          f"won {tally.won}, lost {tally.lost}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
