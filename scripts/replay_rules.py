"""Every recorded BFCL turn's verdict after the rules that act on parsed calls, one line per question, so that two
checkouts' rules can be compared on the same recorded outputs (docs/benchmarks.md "Readings of the user's words").

Each row of a ``python -m agent bfcl`` TSV holds the turn's decoded text. This parses its calls and applies what
``LocalEngine.turn`` applies after its decodes (``agent.engine.returned_calls``: ``agent.grounding.grounded_call``
and ``distinct_calls``, then, where several calls are asked for, ``parallel_tool_calls=True`` in the parallel
categories, ``agent.parallel_calls.with_written_lists``) — scores them with the bfcl command's checker (BFCL's
own where installed) and prints ``ID  RECORDED  NOW  CALLS`` (verdicts 0/1, the calls as JSON). Rules that decide a decode
(a retry, the end of a several-call turn) are not replayed: a line here equals a run of the same checkout where
those decide alike.

Usage: ``python scripts/replay_rules.py OUT.tsv [OUT.tsv …]`` (a question in several files: the first row); run
it in two checkouts and ``diff`` the outputs to see what a change of the rules wins and loses.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.engine import DEFAULT_MAX_PARALLEL_CALLS, returned_calls  # noqa: E402
from agent.grounding import Grounding, conversation_text  # noqa: E402
from replay_grounding import recorded_turns  # noqa: E402 (this folder)


def main(paths: list[str]) -> int:
    right = turns = 0
    for qid, verdict, turn, calls in recorded_turns(paths):
        grounding = Grounding(conversation_text(turn.messages))
        out = returned_calls(calls, turn.tools, turn.messages, grounding, several=turn.parallel is True,
                             max_calls=DEFAULT_MAX_PARALLEL_CALLS)
        now = int(bool(turn.check(out)))
        right += now
        turns += 1
        print(f"{qid}\t{verdict}\t{now}\t{json.dumps(out)}")
    print(f"turns {turns}; right now {right}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
