"""BFCL runner and scorer: ``python -m agent bfcl --category simple_python --limit N`` (BFCL's function-doc dialect
is converted in ``bench/bfcl_dialect.py``; ``--runtime parse-only`` decodes as vLLM's hermes parser would,
``bench/parse_only.py``).

Correctness comes from BFCL's own AST checker (``bfcl-eval``'s ``ast_checker``, ``bench/bfcl_checker.py``) when it is
installed (``make setup`` installs it with ``--no-deps``); the summary says which scorer ran (``"checker":
"official"`` or ``"ours"``). Ours, :func:`score`, is the fallback: a re-implementation of that checker's rules
(``tests/test_bfcl_checker.py`` holds the two equal on every ground truth and on perturbed answers):
    * exactly the expected number of calls; in order, or for parallel categories each ground-truth call taking the
      first unused decoded call that matches it (BFCL's greedy ``no_order`` matching);
    * the expected function name; every required parameter present; every argument declared and in the ground
      truth; a ground-truth parameter the model omits must list ``""`` among its values (optional);
    * the declared type checked (an int accepted for a Python float), or the ground truth's own type (a value written
      as a variable name); strings compare after BFCL's standardisation (lower-case; spaces and ``,./-_*^``
      removed), lists element-wise, dicts key by key;
    * Java/JavaScript: every value must be a string (source code, as BFCL declares every parameter), read by its
      declared type as BFCL's converters do (``"true"``, ``"42L"`` for a Java long, ``"new int[]{1, 2}"``,
      JS ``"[1, 2]"``).
Irrelevance categories are not AST-checked (BFCL's relevance rule): right = no call.
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

from .bfcl_checker import language_of, official_checker, official_verdict
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
# grammar cap on the items of arrays that set no maxItems (``--max-items``; schemas.bound_arrays): 4x the longest
# array of any dev-split ground truth (7 items), so no answer BFCL holds is cut, and a runaway list closes
MAX_ITEMS = 32
# grammar bound on numbers (decimals, |x| <= 1e15) of the speed benchmark's grammars (bench.run, MTP data); the
# bfcl command leaves numbers unbounded unless ``--max-decimals N`` (llguidance admits no exponent in a bounded
# number, and BFCL's ground truth writes some in exponent form: dev split, docs/benchmarks.md)
MAX_DECIMALS = 8


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
    """BFCL's ``standardize_string``: spaces and ``,./-_*^`` removed, lower case, ``'`` -> ``"``."""
    return _STD.sub("", s).lower().replace("'", '"')


# Declared BFCL type -> the Python type a value must have, per language (BFCL's PYTHON_TYPE_MAPPING,
# JAVA_TYPE_CONVERSION, JS_TYPE_CONVERSION); an unknown type name: no type check.
_PY_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list,
             "dict": dict, "any": str}
_JAVA_TYPES = {"byte": int, "short": int, "integer": int, "float": float, "double": float, "long": int,
               "boolean": bool, "char": str, "Array": list, "ArrayList": list, "HashMap": dict, "String": str,
               "any": str}
_JS_TYPES = {"String": str, "integer": int, "float": float, "Bigint": int, "Boolean": bool, "dict": dict,
             "array": list, "any": str}
_LANG_TYPES = {"python": _PY_TYPES, "java": _JAVA_TYPES, "javascript": _JS_TYPES}
_NESTED = {"python": ("array", "tuple"), "java": ("Array", "ArrayList"), "javascript": ("array",)}


def _num(s: str, pattern: str, cast, suffix: str = ""):
    return cast(s[:-1] if suffix else s) if re.fullmatch(pattern + suffix, s) else s


def _code_scalar(s: str, t: str | None, language: str) -> Any:
    """A Java/JavaScript source-code value as BFCL's type converters read it (left a string when it does not parse:
    then it can only match as a variable name)."""
    s = s.strip()
    if t in ("integer", "byte", "short"):
        return _num(s, r"-?\d+", int)
    if t == "long":
        return _num(s, r"-?\d+", int, "[lL]")
    if t == "Bigint":
        return _num(s, r"-?\d+", int, "n")
    if t == "float":
        return (_num(s, r"-?\d+(\.\d+)?([eE][+-]?\d+)?", float, "[fF]") if language == "java"
                else _num(s, r"-?\d+(\.\d+)?", float))
    if t == "double":
        return _num(s, r"-?\d+(\.\d+)?([eE][+-]?\d+)?", float)
    if t in ("boolean", "Boolean"):
        return s == "true" if s in ("true", "false") else s
    if t == "String" and language == "javascript" and len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    if t is None:  # an element of unknown type (BFCL's parse_java_value / parse_js_value)
        if s in ("true", "false"):
            return s == "true"
        if len(s) >= 2 and s[0] == s[-1] and s[0] in ("\"'" if language == "javascript" else "\""):
            return s[1:-1]
        if language == "java" and re.fullmatch(r"-?\d+[lL]", s):
            return int(s[:-1])
        if language == "java" and re.fullmatch(r"-?\d+(\.\d+)?([eE][+-]?\d+)?[fF]", s):
            return float(s[:-1])
        for cast in (int, float):
            try:
                return cast(s)
            except ValueError:
                pass
    return s


def _code_value(s: str, t: str, items: str | None, language: str) -> Any:
    """A Java/JavaScript parameter value (always a string in BFCL's prompt) converted by its declared type, as
    BFCL's ``java_type_converter`` / ``js_type_converter`` do for the forms they know (``new int[]{1, 2}``,
    ``new ArrayList<>(Arrays.asList(1, 2))``, ``new HashMap<...>() {{ put("k", v); }}``, JS ``[1, 2]``,
    ``{k: v}``); anything else stays a string."""
    def element(e: str):  # an ArrayList element
        e = e.strip()
        return e[1:-1] if items in ("String", "char") else _code_scalar(e, items, language)

    if language == "java" and t == "Array":
        m = re.search(r"new\s+\w+\[\]\s*\{(.*?)\}", s)
        return [(_code_scalar(x.strip(), items, language) if items else _code_scalar(x, None, language))
                for x in m.group(1).split(",") if x.strip()] if m else s
    if language == "java" and t == "ArrayList":
        m = re.search(r"new\s+ArrayList<\w*>\(Arrays\.asList\((.+?)\)\)", s)
        if m:
            return [element(x) for x in m.group(1).split(",")]
        return [] if re.search(r"new\s+ArrayList<\w*>\(\)$", s.strip()) else s
    if language == "java" and t == "HashMap":
        m = re.search(r"new\s+HashMap<.*?>\s*\(\)\s*\{\s*\{?\s*(.*?)\s*\}?\s*\}", s, re.DOTALL)
        if m:
            return {k: _code_scalar(v.strip(), None, language)
                    for k, v in re.findall(r"put\(\"(.*?)\",\s*(.*?)\)", m.group(1))}
        return {} if re.search(r"new\s+HashMap<.*?>\s*\(\)", s) else s
    if language == "javascript" and t in ("array", "dict"):
        return _js_collection(s.strip(), t, items)
    return _code_scalar(s, t, language)


def _js_collection(code: str, t: str, items: str | None = None) -> Any:
    """A JS array / object literal as BFCL's ``parse_js_collection`` reads it (same regular expressions)."""
    if t == "array":
        two_d = re.match(r"\[\s*\[.*?\]\s*(,\s*\[.*?\]\s*)*\]|\bnew\s+Array\(\s*\[.*?\]\s*(,\s*\[.*?\]\s*)*\)", code)
        if two_d:
            out = []
            for idx, inner in enumerate(re.findall(r"\[(.*?)\]", two_d.group(0))):
                inner = inner.strip()
                if idx == 0 and inner.startswith("["):
                    inner = inner[1:]
                out.append([_code_scalar(e.strip(), None, "javascript") for e in inner.split(",")])
            return out
        m = re.match(r"\[(.*?)\]|\bnew\s+Array\((.*?)\)", code)
        if not m:
            return code
        body = (m.group(1) if m.group(1) is not None else m.group(2) or "").strip()
        elements = body.split(",") if body else []
        if items:
            return [_code_value(e.strip(), items, None, "javascript") if not e.strip()[:1] in ("'", '"')
                    else e.strip()[1:-1] if items == "String" else e.strip() for e in elements]
        return [_code_scalar(e.strip(), None, "javascript") for e in elements]
    if code == "{}":
        return {}
    m = re.match(r"\{(.*?)\}", code)
    if not m:
        return code
    out = {}
    for key, value in re.findall(r"([^:]+):\s*(.*?)(?:,\s*(?=[^,]+:)|$)", m.group(1)):
        key, value = key.strip().strip("'\""), value.strip()
        if value.startswith("[") and value.endswith("]"):
            out[key] = _js_collection(value, "array")
        elif value.startswith("{") and value.endswith("}"):
            out[key] = _js_collection(value, "dict")
        else:
            out[key] = _code_scalar(value.strip("'\""), None, "javascript")
    return out


def _first_type(acceptable: list):
    return next((type(a) for a in acceptable if a != ""), None)


def _type_ok(value: Any, acceptable: list, expected: type | None, nested: type | None) -> tuple[bool, bool]:
    """``(ok, is_variable)`` as BFCL's ``type_checker``: the declared type, or the ground truth's own type (a value
    written as a variable name), one level of list items checked."""
    truth_type = _first_type(acceptable)
    if expected is None:
        return True, False
    is_variable = truth_type is not None and truth_type != expected
    if type(value) is expected:
        if nested is None:
            return True, is_variable
        for item in acceptable:
            if not isinstance(item, list) or all(_type_ok(v, item, nested, None)[0] for v in value):
                return True, is_variable
    if truth_type is not None and type(value) is truth_type:
        return True, True
    return False, False


def _std_all(xs) -> list:
    return [_std(x) if isinstance(x, str) else x for x in xs]


def _dict_ok(value: dict, acceptable: list) -> bool:
    for truth in acceptable:
        if truth == "":
            continue
        if all(k in truth and (_std(v) if isinstance(v, str) else v) in _std_all(truth[k]) for k, v in value.items()) \
                and all(k in value or "" in vs for k, vs in truth.items()):
            return True
    return False


def _param_ok(value: Any, acceptable: list, spec: dict | None, language: str) -> bool:
    """One argument against its acceptable ground-truth values, following BFCL's ``simple_function_checker``."""
    t = spec.get("type") if isinstance(spec, dict) else None
    items = (spec.get("items") or {}).get("type") if isinstance(spec, dict) and t in _NESTED[language] else None
    types = _LANG_TYPES[language]
    if spec is None:  # no function doc (callers without one): the ground truth's own type
        expected, nested = _first_type(acceptable), None
        t = next((k for k, v in _PY_TYPES.items() if v is expected and k != "any"), None)
    else:
        expected, nested = types.get(t), types.get(items) if items else None
    if language != "python":
        if not isinstance(value, str):
            return False  # BFCL: type_error:java / type_error:js (every parameter is a string in the prompt)
        if t in types:
            value = _code_value(value, t, items, language)
    if t == "tuple" and isinstance(value, tuple):
        value = list(value)
    if language == "python" and t == "float" and type(value) is int:
        value = float(value)
    ok, is_variable = _type_ok(value, acceptable, expected, nested)
    if not ok:
        return False
    if not is_variable:
        if expected is dict:
            return _dict_ok(value, acceptable)
        if expected is list and nested is dict:
            return any(isinstance(truth, list) and len(truth) == len(value)
                       and all(isinstance(v, dict) and _dict_ok(v, [d]) for v, d in zip(value, truth))
                       for truth in acceptable)
        if expected is str:
            return _std(value) in [_std(a) for a in acceptable if isinstance(a, str)]
        if expected is list:
            # a "" alternative reads as [] (BFCL iterates it as an empty list): [] matches an optional list
            return _std_all(value) in [_std_all(a) for a in acceptable if isinstance(a, (list, str))]
    return value in acceptable


def _function_doc(functions: list[dict] | None, name: str) -> dict | None:
    return next((f for f in functions or [] if f.get("name") == name), None)


def call_matches(call: dict, truth: dict, code_strings: bool = False, *, function: dict | None = None,
                 language: str | None = None) -> bool:
    """One decoded call ``{"name", "arguments"}`` against one ground-truth call ``{name: {param: [values]}}``.

    ``function``: the BFCL function doc of that name (declared types, required parameters); None checks against
    the ground truth alone. ``language``: ``python`` / ``java`` / ``javascript`` (None: ``java`` when
    ``code_strings``, else ``python``).
    """
    (name, expected), = truth.items()
    language = language or ("java" if code_strings else "python")
    args = call.get("arguments")
    if call.get("name") != name or not isinstance(args, dict):
        return False
    props = ((function or {}).get("parameters") or {}).get("properties") or {}
    if function is not None and any(r not in args for r in function["parameters"].get("required", [])):
        return False
    for k, v in args.items():
        if k not in expected or (function is not None and k not in props):
            return False
        if not _param_ok(v, expected[k], props.get(k) if function is not None else None, language):
            return False
    return all(k in args or "" in vs for k, vs in expected.items())


def score(calls: list[dict], ground_truth: list[dict], code_strings: bool = False, any_order: bool = False, *,
          functions: list[dict] | None = None, language: str | None = None) -> bool:
    """Our AST-style match of decoded calls ``[{"name", "arguments"}]`` against ``ground_truth`` (the fallback when
    BFCL's own checker, ``bench.bfcl_checker``, is not installed; ``tests/test_bfcl_checker.py`` holds them equal).

    ``functions``: the question's BFCL function docs (declared types, required and declared parameters; None: the
    ground truth alone). ``any_order``: parallel categories, where each ground-truth call, in order, takes the first
    unused decoded call that matches it (BFCL's ``parallel_function_checker_no_order``, greedy); otherwise calls
    match in order.
    """
    if len(calls) != len(ground_truth):
        return False

    def match(c, t):
        return call_matches(c, t, code_strings, function=_function_doc(functions, next(iter(t))) if functions
                            else None, language=language)

    if not any_order:
        return all(match(c, t) for c, t in zip(calls, ground_truth))
    used: set[int] = set()
    for t in ground_truth:
        j = next((j for j in range(len(calls)) if j not in used and match(calls[j], t)), None)
        if j is None:
            return False
        used.add(j)
    return True


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
        code_strings: Java/JavaScript: every parameter is a source-code string (see :func:`score`).
        functions: the BFCL function docs as in the data file (what the checkers read: declared types, required).
    """

    id: str
    category: str
    tools: list[Tool]
    messages: list[dict]
    ground_truth: list[dict] | None
    code_strings: bool
    functions: list[dict] | None = None

    @property
    def language(self) -> str:
        return language_of(self.category)

    def check(self, calls: list[dict]) -> bool:
        """Whether decoded ``calls`` match the ground truth: BFCL's official checker when installed, else
        :func:`score` (see :func:`checker_name`)."""
        if self.ground_truth is None:
            return False
        if official_checker() is not None and self.functions is not None:
            return official_verdict(self.functions, calls, self.ground_truth, self.category)[0]
        return score(calls, self.ground_truth, self.code_strings, any_order=is_parallel(self.category),
                     functions=self.functions, language=self.language)

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
        return fmt.render(self.messages, self.tools, several=self.parallel is True)

    def grammar(self, tool_choice: str | None = None, *, fmt: ToolFormat | None = None,
                max_string_length: int | None = MAX_STRING_LENGTH, max_decimals: int | None = MAX_DECIMALS):
        """The turn grammar ``Agent.run`` builds for this question, in the tool format ``fmt`` (None: ``generic``,
        markers as text)."""
        fmt = fmt or GenericFormat(None)
        return fmt.turn_grammar(self.tools, tool_choice or self.tool_choice, parallel=self.parallel,
                                max_string_length=max_string_length, max_decimals=max_decimals)

    def judge(self, text: str, truncated: bool, registry: ToolRegistry,
              fmt: ToolFormat | None = None, calls: list[dict] | None = None) -> tuple[bool, bool]:
        """``(valid, correct)`` of one decoded turn in the tool format ``fmt`` (None: ``generic``; any object with
        ``is_call(text)`` and ``parse(text) -> (calls | None, text)``, such as ``bench.parse_only``'s parsers).
        ``calls``: the calls the agent returned for the turn (``{"name", "arguments"}``; the agent's grounding
        rules may drop optional arguments the text holds), judged instead of the text's; None: parsed from it.

        valid = not cut by the token budget, parses into at least one call and every call validates against its
        tool; correct = not cut, parses into at least one call and :meth:`check` passes (BFCL's checker does not
        validate against the schema: a call may be correct and not valid). Irrelevance: a text answer (cut or not)
        is valid and correct; a call (even a cut or broken one) is never correct.
        """
        fmt = fmt or GenericFormat(None)
        if is_irrelevance(self.category) and not fmt.is_call(text):
            return True, True
        if truncated:
            return False, False
        if calls is None:
            try:
                calls, _ = fmt.parse(text)
            except (ValueError, KeyError, TypeError, ToolCallError):
                return False, False
        calls = calls or []
        try:
            for c in calls:
                registry.parse_call(c)
            valid = bool(calls)
        except (ValueError, KeyError, TypeError, ToolCallError):
            valid = False
        if is_irrelevance(self.category):
            return valid, False
        return valid, bool(calls) and all(isinstance(c, dict) and "name" in c for c in calls) and self.check(calls)


def checker_name() -> str:
    """``"official"`` when BFCL's checker (``bfcl-eval``) is installed and scores the turns, else ``"ours"``."""
    return "official" if official_checker() is not None else "ours"


def bfcl_turn(row: dict, category: str) -> BfclTurn:
    """The :class:`BfclTurn` of one BFCL JSON-lines ``row`` of ``category``."""
    language = language_of(category)
    return BfclTurn(row["id"], category, [tool_from_bfcl(fn, language=language) for fn in row["function"]],
                    [m for turn in row["question"] for m in turn], row.get("ground_truth"), language != "python",
                    row["function"])


def run_bfcl(agent_factory, category: str, *, limit: int | None = None, data_dir: str | None = None,
             drafter: str | None = None, max_new_tokens: int = 256, split: str | None = None, out=print,
             runtime: str = "ours") -> dict:
    """Run BFCL questions; print ``ID<TAB>VALID<TAB>CORRECT<TAB>OUTPUT`` per question and return the summary.

    ``agent_factory(tools) -> Agent`` (or ``bench.parse_only.ParseOnlyAgent``; ``runtime`` labels the rows). One
    turn per question: a required call (several in any order for the parallel categories), or
    ``tool_choice="auto"`` for irrelevance, where right = no call.

    Returns:
        ``{"category", "split", "n", "valid", "accuracy", "truncated", tokens_per_s, ...}``: ``valid`` = share of
        turns that finished (not cut by the budget) and whose calls all parse and validate (for irrelevance, a
        text answer counts too, cut or not); ``accuracy`` = share matching the ground truth (irrelevance: share
        answered without a call); ``truncated`` = turns cut by the budget (irrelevance: at
        ``IRRELEVANCE_MAX_NEW_TOKENS``, text answers included); ``cut_masked_end`` = of those, the turns where
        the model's argmax was an end-of-generation token the grammar forbade (None: not counted, i.e. the agents'
        ``EngineConfig.count_masked_ends`` is off, or no grammar); ``closed_at_end`` = turns whose last call the
        engine closed where the model asked to end inside it (``EngineConfig.close_at_model_end``);
        ``checker`` = ``"official"`` (BFCL's ``ast_checker``, ``bench/bfcl_checker.py``) or ``"ours"`` (:func:`score`, when bfcl-eval is not installed);
        ``runtime`` and ``parser`` (how calls were read from the text); ``time_to_valid_call_{cold,warm}_p{50,95}``
        (s): prefill + decode of the turn, over the questions answered with valid calls: *warm* where the previous
        question had the same tools (the system prompt and tool list come from the prefix cache), *cold* otherwise
        (``warm_questions`` counts the warm ones); ``prefill_tokens_per_s``: prompt tokens not found in the cache
        per second of prefill.
    """
    from constraints import GrammarError
    from schemas.errors import SchemaError

    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; choose one of {', '.join(CATEGORIES)}")
    irrelevance = is_irrelevance(category)
    rows = load_questions(category, data_dir, limit, split)
    n_valid = n_correct = n_truncated = rows_failed = cut_masked_end = n_closed = 0
    total_stats = None
    parser = None
    t0 = time.perf_counter()
    counted_masked_ends = False
    call_seconds = {"cold": [], "warm": []}  # per question answered with valid calls: prefill + decode (s)
    previous_tools = None
    for row in rows:
        turn = bfcl_turn(row, category)
        agent = agent_factory(turn.tools)
        config = getattr(agent, "config", None)
        counted_masked_ends = runtime == "ours" and getattr(config, "count_masked_ends", False)
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
        cut_masked_end += bool(res.truncated and res.stats.masked_end_argmax)
        n_closed += bool(res.stats.closed_at_end)
        # the calls the agent returned (BFCL's tools are call-only: pending), as its grounding rules left them
        returned = [{"name": c.name, "arguments": c.arguments} for c in getattr(res, "pending_calls", None) or []]
        valid, correct = turn.judge(text, res.truncated, agent.registry, agent.format, returned or None)
        parser = getattr(agent.format, "name", None)
        n_valid += valid
        n_correct += correct
        total_stats = res.stats if total_stats is None else total_stats + res.stats
        if valid and not is_irrelevance(category):  # warm: the previous question had the same tools
            call_seconds["warm" if row["function"] == previous_tools else "cold"].append(res.stats.seconds)
        previous_tools = row["function"]
        out(f"{row['id']}\t{int(valid)}\t{int(correct)}\t{json.dumps(text, ensure_ascii=False)}")
    n = len(rows)
    s = total_stats
    summary = {"category": category, "split": split or "all", "n": n, "valid": n_valid / n if n else 0.0,
               "accuracy": n_correct / n if n else 0.0, "truncated": n_truncated,
               "cut_masked_end": cut_masked_end if counted_masked_ends else None,
               "closed_at_end": n_closed,
               "errors": rows_failed,
               "tokens_per_s": round(s.tokens_per_s, 2) if s else 0.0,
               "tokens_per_forward": round(s.tokens_per_forward, 3) if s else 0.0,
               "acceptance_rate": round(s.acceptance_rate, 3) if s else 0.0,
               "acceptance_by_position": [round(a, 3) for a in s.acceptance_by_position[:8]] if s else [],
               "forced_share": round(s.forced / s.new_tokens, 3) if s and s.new_tokens else 0.0,
               **{f"time_to_valid_call_{kind}_p{q}": _percentile(call_seconds[kind], q)
                  for kind in ("cold", "warm") for q in (50, 95)},
               "warm_questions": len(call_seconds["warm"]),
               "prefill_tokens_per_s": round((s.prompt_tokens - s.prompt_tokens_cached) / s.prefill_seconds, 1)
               if s and s.prefill_seconds else 0.0,
               "seconds": round(time.perf_counter() - t0, 1), "checker": checker_name(), "runtime": runtime,
               "parser": parser}
    out(json.dumps(summary))
    return summary


def summary_table(summaries: list[dict]) -> str:
    """A Markdown table of per-category summaries (accuracy, valid, cut by the budget, tokens/s), one row per
    category and runtime (ours vs parse-only side by side when both ran), and the checker that scored them."""
    columns = ["category", "runtime", "split", "n", "accuracy", "valid", "cut", "cut, end masked",
               "closed at the model's end", "tokens/s", "valid call p50 s cold / warm", "checker"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for s in summaries:
        runtime = s.get("runtime", "ours")
        if "error" in s:
            lines.append(f"| {s['category']} | {runtime} | {s['split']} | " + "– | " * (len(columns) - 4)
                         + f"{s['error']} |")
            continue
        lines.append(f"| {s['category']} | {runtime} | {s['split']} | {s['n']} | {s['accuracy']:.3f} | "
                     f"{s['valid']:.3f} | {s['truncated']} | {_or_dash(s.get('cut_masked_end'))} | "
                     f"{_or_dash(s.get('closed_at_end'))} | "
                     f"{s['tokens_per_s']:.1f} | {_or_dash(s.get('time_to_valid_call_cold_p50'))} / "
                     f"{_or_dash(s.get('time_to_valid_call_warm_p50'))} | {s.get('checker', '')} |")
    return "\n".join(lines)


def _or_dash(value) -> str:
    return "–" if value is None else str(value)


def _percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (numpy's linear interpolation) of ``values`` rounded to ms, None when empty."""
    import numpy as np

    return round(float(np.percentile(values, q)), 3) if values else None
