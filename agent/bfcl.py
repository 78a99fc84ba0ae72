"""BFCL runner and scorer: ``python -m agent bfcl --category simple_python --limit N``.

Scoring follows BFCL's AST checker (``bfcl_eval/eval_checker/ast_eval/ast_checker.py``) in simplified form:
    * exactly the expected number of calls, each with the expected function name;
    * every argument the model gives must be a ground-truth parameter, and its value one of the acceptable values;
    * a ground-truth parameter the model omits must list ``""`` among its values (optional);
    * strings compare after BFCL's standardisation (lower-case; spaces and ``,./-_*^`` removed);
    * an int is accepted where a float is expected (BFCL's auto-conversion for Python), lists compare element-wise,
      dicts recursively with the same rules, tuples as lists.
    * Java/JavaScript (``code_strings``): ``any`` parameters are source-code strings; a string value and a typed
      ground-truth value (or the reverse) match when the string equals the typed value's JSON or ``str`` form after
      the same standardisation (``"true"`` ~ ``true``, ``"50"`` ~ ``50``).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from schemas.bfcl import tool_from_bfcl

CATEGORIES = ("simple_python", "simple_java", "simple_javascript", "multiple")
DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "bfcl"


def find_file(category: str, data_dir: str | Path | None = None) -> Path:
    """The JSON-lines file for ``category`` in ``data_dir`` (any file whose name contains ``BFCL_v4_<cat>``)."""
    d = Path(data_dir) if data_dir else DEFAULT_DATA_DIR
    hits = sorted(p for p in d.glob(f"*BFCL_v4_{category}*") if p.is_file()) if d.is_dir() else []
    if not hits:
        raise FileNotFoundError(f"no file matching *BFCL_v4_{category}* in {d}; pass --data-dir DIR")
    return hits[0]


def load_questions(category: str, data_dir: str | Path | None = None, limit: int | None = None) -> list[dict]:
    rows = []
    with open(find_file(category, data_dir)) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit and len(rows) >= limit:
                    break
    return rows


_STD = re.compile(r"[ ,./\-_*^]")


def _std(s: str) -> str:
    return _STD.sub("", s).lower().replace("'", '"')


def value_matches(value: Any, expected: Any, code_strings: bool = False) -> bool:
    """One model value against one acceptable ground-truth value."""
    if code_strings and isinstance(expected, str) != isinstance(value, str):
        # Java/JS: a value may come as code ("true", "50", "[1, 2]") where the truth is typed, or the reverse
        code, typed = (value, expected) if isinstance(value, str) else (expected, value)
        return _std(code) in (_std(json.dumps(typed)), _std(str(typed)))
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(expected, bool) and value == expected
    if isinstance(expected, float) and isinstance(value, (int, float)):
        return float(value) == expected
    if isinstance(expected, int) and isinstance(value, int):
        return value == expected
    if isinstance(expected, str):
        return isinstance(value, str) and _std(value) == _std(expected)
    if isinstance(expected, (list, tuple)):
        return (isinstance(value, (list, tuple)) and len(value) == len(expected)
                and all(value_matches(v, e, code_strings) for v, e in zip(value, expected)))
    if isinstance(expected, dict):
        return isinstance(value, dict) and args_match(value, {k: (v if isinstance(v, list) else [v])
                                                              for k, v in expected.items()}, code_strings)
    return value == expected


def args_match(args: dict, truth: dict[str, list], code_strings: bool = False) -> bool:
    for k in args:
        if k not in truth:
            return False
    for k, acceptable in truth.items():
        if k not in args:
            if "" not in acceptable:
                return False
            continue
        if not any(value_matches(args[k], e, code_strings) for e in acceptable if e != ""):
            return False
    return True


def score(calls: list[dict], ground_truth: list[dict], code_strings: bool = False) -> bool:
    """BFCL AST-style match of decoded calls ``[{"name", "arguments"}]`` against ``ground_truth``."""
    if len(calls) != len(ground_truth):
        return False
    for call, truth in zip(calls, ground_truth):
        (name, expected), = truth.items()
        if call.get("name") != name or not args_match(call.get("arguments", {}), expected, code_strings):
            return False
    return True


def run_bfcl(agent_factory, category: str, *, limit: int | None = None, data_dir: str | None = None,
             drafter: str | None = None, max_new_tokens: int = 256, out=print) -> dict:
    """Run BFCL questions; print ``ID<TAB>VALID<TAB>CORRECT<TAB>OUTPUT`` per question and return the summary.

    ``agent_factory(tools) -> Agent``. Each question is a required tool call (BFCL expects one), one call per turn.
    """
    from schemas.errors import ToolCallError

    from .format import parse_turn

    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; choose one of {', '.join(CATEGORIES)}")
    code_strings = category in ("simple_java", "simple_javascript")
    rows = load_questions(category, data_dir, limit)
    n_valid = n_correct = 0
    total_stats = None
    t0 = time.perf_counter()
    for row in rows:
        tools = [tool_from_bfcl(fn, code_strings=code_strings) for fn in row["function"]]
        agent = agent_factory(tools)
        messages = [m for turn in row["question"] for m in turn]
        res = agent.run(messages, tool_choice="required", parallel_tool_calls=False, max_steps=1,
                        max_new_tokens=max_new_tokens, drafter=drafter)
        text = res.raw_turns[-1] if res.raw_turns else ""
        valid = correct = False
        if not res.truncated:
            try:
                calls, _ = parse_turn(text)
                calls = calls or []
                for c in calls:
                    agent.registry.parse_call(c)
                valid = bool(calls)
                correct = valid and score(calls, row["ground_truth"], code_strings)
            except (ValueError, ToolCallError):
                valid = False
        n_valid += valid
        n_correct += correct
        total_stats = res.stats if total_stats is None else total_stats + res.stats
        out(f"{row['id']}\t{int(valid)}\t{int(correct)}\t{json.dumps(text, ensure_ascii=False)}")
    n = len(rows)
    s = total_stats
    summary = {"n": n, "valid": n_valid / n if n else 0.0, "accuracy": n_correct / n if n else 0.0,
               "tokens_per_s": round(s.tokens_per_s, 2) if s else 0.0,
               "tokens_per_forward": round(s.tokens_per_forward, 3) if s else 0.0,
               "acceptance_rate": round(s.acceptance_rate, 3) if s else 0.0,
               "acceptance_by_position": [round(a, 3) for a in s.acceptance_by_position[:8]] if s else [],
               "forced_share": round(s.forced / s.new_tokens, 3) if s and s.new_tokens else 0.0,
               "seconds": round(time.perf_counter() - t0, 1)}
    out(json.dumps(summary))
    return summary
