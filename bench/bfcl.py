"""BFCL runner and scorer: ``python -m agent bfcl --category simple_python --limit N`` (BFCL's function-doc dialect
is converted in ``bench/bfcl_dialect.py``).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.formats import GenericFormat, ToolFormat
from schemas import Tool, ToolCallError, ToolRegistry

from .bfcl_dialect import tool_from_bfcl

CATEGORIES = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
              "irrelevance", "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
              "live_irrelevance")
SPLITS = ("dev", "test")
# Irrelevance turns are cut at this many tokens: whether the model calls is decided at the first token (a text
# answer may not start a call), and small models otherwise write several hundred tokens of text.
IRRELEVANCE_MAX_NEW_TOKENS = 48
DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "bfcl"
MAX_STRING_LENGTH = 200  # grammar cap on unbounded argument strings (characters): ``--max-string-length``
MAX_DECIMALS = 8  # grammar bound on numbers (decimals, |x| <= 1e15): ``--max-decimals``


def is_parallel(category: str) -> bool:
    """Several calls expected in one turn (matched in any order)."""
    return "parallel" in category


def is_irrelevance(category: str) -> bool:
    """No tool fits the question: right = no call (run with ``tool_choice="auto"``)."""
    return category.endswith("irrelevance")


def find_file(category: str, data_dir: str | Path | None = None) -> Path:
    """The JSON-lines file for ``category`` in ``data_dir`` (any file whose name contains ``BFCL_v4_<cat>.``)."""
    d = Path(data_dir) if data_dir else DEFAULT_DATA_DIR
    hits = sorted(p for p in d.glob(f"*BFCL_v4_{category}.*") if p.is_file()) if d.is_dir() else []
    if not hits:
        raise FileNotFoundError(f"no file matching *BFCL_v4_{category}.* in {d}; pass --data-dir DIR")
    return hits[0]


def load_questions(category: str, data_dir: str | Path | None = None, limit: int | None = None,
                   split: str | None = None) -> list[dict]:
    """The questions of ``category``, in file order.

    Args:
        split: ``"dev"`` = the first half of the file (``n // 2`` rows; prompts, examples and caps are tuned there
            only), ``"test"`` = the rest (only ever measured), None = the whole file.
        limit: the first ``limit`` questions of the split.
    """
    if split not in (None, *SPLITS):
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    with open(find_file(category, data_dir)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if split is not None:
        half = len(rows) // 2
        rows = rows[:half] if split == "dev" else rows[half:]
    return rows[:limit] if limit else rows


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


def call_matches(call: dict, truth: dict, code_strings: bool = False) -> bool:
    """One decoded call ``{"name", "arguments"}`` against one ground-truth call ``{name: {param: [values]}}``."""
    (name, expected), = truth.items()
    return call.get("name") == name and args_match(call.get("arguments", {}), expected, code_strings)


def score(calls: list[dict], ground_truth: list[dict], code_strings: bool = False, any_order: bool = False) -> bool:
    """BFCL AST-style match of decoded calls ``[{"name", "arguments"}]`` against ``ground_truth``.

    ``any_order``: parallel categories, where each ground-truth call must match a different decoded call in any
    order (BFCL's parallel checker); otherwise calls match in order.
    """
    if len(calls) != len(ground_truth):
        return False
    if not any_order:
        return all(call_matches(c, t, code_strings) for c, t in zip(calls, ground_truth))

    def assign(i: int, used: frozenset) -> bool:  # backtracking matching (a handful of calls)
        if i == len(ground_truth):
            return True
        return any(j not in used and call_matches(calls[j], ground_truth[i], code_strings)
                   and assign(i + 1, used | {j}) for j in range(len(calls)))

    return assign(0, frozenset())


@dataclass
class BfclTurn:
    """One BFCL question as the CLI, the benchmark and MTP training decode it: one turn of required calls (several,
    in any order, for the parallel categories; ``tool_choice="auto"`` and right = no call for irrelevance),
    strings and numbers bounded in the grammar.

    Attributes:
        id: the question id (``simple_python_0``).
        category: its BFCL category.
        tools: its functions as tools (BFCL's dialect converted; lenient: every output is validated).
        messages: the chat messages of the question (all turns flattened).
        ground_truth: BFCL's acceptable calls (None when the row has none).
        code_strings: Java/JavaScript: ``any`` parameters are source-code strings (see :func:`score`).
    """

    id: str
    category: str
    tools: list[Tool]
    messages: list[dict]
    ground_truth: list[dict] | None
    code_strings: bool

    @property
    def tool_choice(self) -> str:
        return "auto" if is_irrelevance(self.category) else "required"

    @property
    def parallel(self) -> bool | None:
        """``parallel_tool_calls`` for this question (None: as the tool format allows, for irrelevance)."""
        return None if is_irrelevance(self.category) else is_parallel(self.category)

    def registry(self) -> ToolRegistry:
        """The tools registered leniently (as the bfcl CLI's Agent registers them)."""
        return ToolRegistry(self.tools, strict=False)

    def prompt_ids(self, tokenizer, fmt: ToolFormat | None = None) -> list[int]:
        """Prompt token ids as ``Agent.run`` renders them, in the tool format ``fmt`` (None: ``generic`` on
        ``tokenizer``)."""
        fmt = fmt or GenericFormat(tokenizer)
        return fmt.render(self.messages, self.tools)

    def grammar(self, tool_choice: str | None = None, *, fmt: ToolFormat | None = None,
                max_string_length: int | None = MAX_STRING_LENGTH, max_decimals: int | None = MAX_DECIMALS):
        """The turn grammar ``Agent.run`` builds for this question, in the tool format ``fmt`` (None: ``generic``,
        markers as text)."""
        fmt = fmt or GenericFormat(None)
        return fmt.turn_grammar(self.tools, tool_choice or self.tool_choice, parallel=self.parallel,
                                max_string_length=max_string_length, max_decimals=max_decimals)

    def judge(self, text: str, truncated: bool, registry: ToolRegistry,
              fmt: ToolFormat | None = None) -> tuple[bool, bool]:
        """``(valid, correct)`` of one decoded turn in the tool format ``fmt`` (None: ``generic``).

        valid = not cut by the token budget, parses into at least one call and every call validates against its
        tool; correct = valid and :func:`score` matches the ground truth (any order for parallel categories).
        Irrelevance: a text answer (cut or not) is valid and correct; a call is never correct.
        """
        fmt = fmt or GenericFormat(None)
        if is_irrelevance(self.category) and not fmt.is_call(text):
            return True, True
        if truncated:
            return False, False
        try:
            calls, _ = fmt.parse(text)
            calls = calls or []
            for c in calls:
                registry.parse_call(c)
            valid = bool(calls)
            if is_irrelevance(self.category):
                return valid, False
            return valid, valid and self.ground_truth is not None and score(
                calls, self.ground_truth, self.code_strings, any_order=is_parallel(self.category))
        except (ValueError, KeyError, TypeError, ToolCallError):
            return False, False


def bfcl_turn(row: dict, category: str) -> BfclTurn:
    """The :class:`BfclTurn` of one BFCL JSON-lines ``row`` of ``category``."""
    code_strings = category in ("simple_java", "simple_javascript")
    return BfclTurn(row["id"], category, [tool_from_bfcl(fn, code_strings=code_strings) for fn in row["function"]],
                    [m for turn in row["question"] for m in turn], row.get("ground_truth"), code_strings)


def run_bfcl(agent_factory, category: str, *, limit: int | None = None, data_dir: str | None = None,
             drafter: str | None = None, max_new_tokens: int = 256, split: str | None = None, out=print) -> dict:
    """Run BFCL questions; print ``ID<TAB>VALID<TAB>CORRECT<TAB>OUTPUT`` per question and return the summary.

    ``agent_factory(tools) -> Agent``. One turn per question: a required call (several in any order for the
    parallel categories), or ``tool_choice="auto"`` for irrelevance, where right = no call.

    Returns:
        ``{"category", "split", "n", "valid", "accuracy", "truncated", tokens_per_s, ...}``: ``valid`` = share of
        turns that finished (not cut by the budget) and whose calls all parse and validate (for irrelevance, a
        text answer counts too, cut or not); ``accuracy`` = share matching the ground truth (irrelevance: share
        answered without a call); ``truncated`` = turns cut by the budget (irrelevance: at
        ``IRRELEVANCE_MAX_NEW_TOKENS``, text answers included).
    """
    from constraints import GrammarError
    from schemas.errors import SchemaError

    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; choose one of {', '.join(CATEGORIES)}")
    irrelevance = is_irrelevance(category)
    rows = load_questions(category, data_dir, limit, split)
    n_valid = n_correct = n_truncated = rows_failed = 0
    total_stats = None
    t0 = time.perf_counter()
    for row in rows:
        turn = bfcl_turn(row, category)
        agent = agent_factory(turn.tools)
        try:
            res = agent.run(turn.messages, tool_choice=turn.tool_choice, max_steps=1,
                            parallel_tool_calls=turn.parallel, drafter=drafter,
                            max_new_tokens=min(max_new_tokens, IRRELEVANCE_MAX_NEW_TOKENS) if irrelevance
                            else max_new_tokens)
        except (SchemaError, GrammarError) as e:  # a function doc the grammar cannot take: invalid, not a crash
            out(f"{row['id']}\t0\t0\t{json.dumps(f'error: {e}'[:300], ensure_ascii=False)}")
            rows_failed += 1
            continue
        text = res.raw_turns[-1] if res.raw_turns else ""
        n_truncated += res.truncated
        valid, correct = turn.judge(text, res.truncated, agent.registry, agent.format)
        n_valid += valid
        n_correct += correct
        total_stats = res.stats if total_stats is None else total_stats + res.stats
        out(f"{row['id']}\t{int(valid)}\t{int(correct)}\t{json.dumps(text, ensure_ascii=False)}")
    n = len(rows)
    s = total_stats
    summary = {"category": category, "split": split or "all", "n": n, "valid": n_valid / n if n else 0.0,
               "accuracy": n_correct / n if n else 0.0, "truncated": n_truncated, "errors": rows_failed,
               "tokens_per_s": round(s.tokens_per_s, 2) if s else 0.0,
               "tokens_per_forward": round(s.tokens_per_forward, 3) if s else 0.0,
               "acceptance_rate": round(s.acceptance_rate, 3) if s else 0.0,
               "acceptance_by_position": [round(a, 3) for a in s.acceptance_by_position[:8]] if s else [],
               "forced_share": round(s.forced / s.new_tokens, 3) if s and s.new_tokens else 0.0,
               "seconds": round(time.perf_counter() - t0, 1)}
    out(json.dumps(summary))
    return summary


def summary_table(summaries: list[dict]) -> str:
    """A Markdown table of per-category summaries (accuracy, valid, cut by the budget, tokens/s)."""
    lines = ["| category | split | n | accuracy | valid | cut | tokens/s |", "|---|---|---|---|---|---|---|"]
    for s in summaries:
        if "error" in s:
            lines.append(f"| {s['category']} | {s['split']} | – | – | – | – | {s['error']} |")
            continue
        lines.append(f"| {s['category']} | {s['split']} | {s['n']} | {s['accuracy']:.3f} | {s['valid']:.3f} | "
                     f"{s['truncated']} | {s['tokens_per_s']:.1f} |")
    return "\n".join(lines)
