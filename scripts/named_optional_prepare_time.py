"""What the named-optional rule costs a turn's preparation (docs/benchmarks.md "Parameters the user names").

40 tools of 14 optional string parameters each; six requests, each naming three parameters no earlier one named
(so every turn builds a new grammar); ``LocalEngine._prepare`` (prompt + turn grammar) timed with the rule on and
off (``agent.engine.asking_named`` replaced by the identity), on the default model's engine.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python scripts/named_optional_prepare_time.py``
"""
from __future__ import annotations

import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agent.engine as engine_module  # noqa: E402
from agent import Agent  # noqa: E402
from agent.engine import EngineConfig  # noqa: E402
from schemas import Tool  # noqa: E402

WORDS = ["limit", "offset", "format", "unit", "sort", "order", "language", "timeout", "region", "currency", "city",
         "country", "date", "page"]


def main() -> int:
    tools = [Tool.from_schema(f"tool_{i}", {"type": "object", "required": ["q"], "properties": {
        "q": {"type": "string"}, **{w: {"type": "string"} for w in WORDS}}}) for i in range(40)]
    engine = Agent(tools=tools, threads=1).engine
    named = engine_module.asking_named
    for on in (True, False):
        engine_module.asking_named = named if on else (lambda tool, request: tool)
        times = []
        for combo in itertools.islice(itertools.combinations(WORDS, 3), 6):
            messages = [{"role": "user", "content": f"Search with {', '.join(combo)} {on}"}]
            start = time.perf_counter()
            engine._prepare(messages, tools, "required", None, None, EngineConfig())
            times.append(time.perf_counter() - start)
        print(f"rule {'on ' if on else 'off'}: median {statistics.median(times) * 1000:.0f} ms per turn "
              f"({', '.join(f'{t * 1000:.0f}' for t in times)})")
    engine_module.asking_named = named
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
