"""BFCL scored as BFCL scores it: our reported verdict (``BfclTurn.judge``, and our fallback ``score``) equals the
official checker's (``bfcl-eval``'s ``ast_checker``) on every ground truth in ``../shared/data/bfcl`` and on perturbed
answers; Java/JavaScript parameters are declared as BFCL's FC harness declares them (strings), and the ground truths
written as strings pass; the parse-only runtime's parsers."""
from __future__ import annotations

import copy
import json
import random

import pytest

from conftest import SHARED

pytest.importorskip("bfcl_eval")

from agent.formats import GenericFormat  # noqa: E402
from agent.formats.generic import render_call_text  # noqa: E402
from bench.bfcl import (CATEGORIES, bfcl_turn, checker_name, is_irrelevance, is_parallel, language_of,  # noqa: E402
                        load_questions, score)
from bench.bfcl_checker import official_verdict  # noqa: E402
from bench.bfcl_dialect import language_specific_pre_processing, tool_from_bfcl  # noqa: E402
from bench.parse_only import FormatParser, HermesToolParser, free_grammar  # noqa: E402

DATA = SHARED / "bfcl"
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason="no ../shared/data/bfcl")
SCORED = [c for c in CATEGORIES if not is_irrelevance(c)]  # the categories with a possible_answer


def _resolve(value):
    """A ground-truth value as one answer: nested dicts are in BFCL's alternatives form ({k: [alternatives]})."""
    if isinstance(value, dict):
        out = {}
        for k, alts in value.items():
            alts = alts if isinstance(alts, list) else [alts]
            v = next((a for a in alts if a != ""), "")
            if v != "":
                out[k] = _resolve(v)
        return out
    if isinstance(value, list):
        return [_resolve(v) if isinstance(v, dict) else v for v in value]
    return value


def _code_literal(value, spec: dict, language: str) -> str:
    """A typed ground-truth value written as the Java/JavaScript source string a model writes in BFCL (a long with
    ``L``, ``new int[]{...}``, ``new HashMap<...>() {{ put(...); }}``, JS ``[...]`` / ``{k: v}``)."""
    t, items = spec.get("type"), (spec.get("items") or {}).get("type")

    def scalar(v, t=None):
        if isinstance(v, bool):
            return "true" if v else "false"
        if language == "java" and isinstance(v, int) and t == "long":
            return f"{v}L"
        if language == "java" and isinstance(v, float) and t == "float":
            return f"{v}f"
        return str(v)

    if language == "java" and t == "Array":
        return f"new {items or 'Object'}[]{{{', '.join(scalar(v, items) for v in value)}}}"
    if language == "java" and t == "ArrayList":
        quote = (lambda v: f'"{v}"' if items == "String" or (items is None and isinstance(v, str))
                 else scalar(v, items))
        return f"new ArrayList<>(Arrays.asList({', '.join(quote(v) for v in value)}))"
    if language == "java" and t == "HashMap":
        puts = " ".join(f'put("{k}", {json.dumps(v) if isinstance(v, str) else scalar(v)});'
                        for k, v in value.items())
        return f"new HashMap<String, Object>() {{{{ {puts} }}}}"
    if language == "javascript" and isinstance(value, list):
        return "[" + ", ".join(f"'{v}'" if isinstance(v, str) else scalar(v, items) for v in value) + "]"
    if language == "javascript" and isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_code_literal(v, {}, language) if isinstance(v, (list, dict)) else scalar(v)}"
                               for k, v in value.items()) + "}"
    return scalar(value, t)


def written_calls(row: dict, category: str) -> list[dict]:
    """The ground truth's first answer per parameter, written as our grammar writes it (Java/JS: every value a
    string)."""
    language = language_of(category)
    docs = {f["name"]: f["parameters"].get("properties", {}) for f in row["function"]}
    calls = []
    for truth in row["ground_truth"]:
        (name, params), = truth.items()
        args = {}
        for k, alts in params.items():
            v = next((a for a in alts if a != ""), None)
            if v is None:
                continue
            v = _resolve(v)
            if language != "python" and not isinstance(v, str):
                v = _code_literal(v, docs.get(name, {}).get(k, {}), language)
            args[k] = v
        calls.append({"name": name, "arguments": args})
    return calls


# Ground truths BFCL's own checker rejects however they are written (data issues, first half of each file):
UNPASSABLE = {
    # the answer omits a required parameter
    "live_simple_106-63-0": "simple_function_checker:missing_required",
    "live_simple_112-68-0": "simple_function_checker:missing_required",
    "live_multiple_507-149-4": "simple_function_checker:missing_required",
    # the answer has a parameter the function does not declare (permeability, type)
    "parallel_multiple_12": "parallel_function_checker_no_order:cannot_find_match",
    "parallel_multiple_26": "parallel_function_checker_no_order:cannot_find_match",
    # an ArrayList of `any`: the converter reads every element as a string, the answer holds 42 and True
    "simple_java_36": "value_error:list/tuple",
}


@pytest.fixture(scope="module")
def rows():
    return {c: load_questions(c, DATA) for c in SCORED}


def test_the_official_checker_is_the_one_reporting():
    assert checker_name() == "official"


def test_every_ground_truth_gets_the_official_verdict_from_judge_and_from_our_scorer(rows):
    fmt = GenericFormat(None)
    mismatched, failing, n = [], {}, 0
    for cat, qs in rows.items():
        for row in qs:
            calls = written_calls(row, cat)
            official, err = official_verdict(row["function"], calls, row["ground_truth"], cat)
            turn = bfcl_turn(row, cat)
            _, reported = turn.judge(render_call_text(calls), False, turn.registry(), fmt)
            ours = score(calls, row["ground_truth"], any_order=is_parallel(cat), functions=row["function"],
                         language=language_of(cat))
            n += 1
            if not (reported == ours == official):
                mismatched.append((row["id"], reported, ours, official, err))
            if not official:
                failing[row["id"]] = err
    assert n > 1000 and not mismatched, mismatched
    # what the official checker rejects in BFCL's own ground truths (scored the same by both): see UNPASSABLE
    assert failing == UNPASSABLE, failing


# Java collections whose ground truth is a plain string, not the expression BFCL's converter reads as a collection:
# the grammar writes collections as Java expressions (bench/bfcl_dialect.py, java_collection_syntax), so it cannot
# write these (a byte[] given as "user:online:both").
PLAIN_STRING_COLLECTIONS = {"simple_java_35": "destination"}


def test_java_and_javascript_ground_truths_written_as_strings_pass_the_official_checker(rows):
    from schemas import ToolCallError

    for cat in ("simple_java", "simple_javascript"):
        for row in rows[cat]:
            calls = written_calls(row, cat)
            assert all(isinstance(v, str) for c in calls for v in c["arguments"].values())
            turn = bfcl_turn(row, cat)
            for c in calls:
                if row["id"] in PLAIN_STRING_COLLECTIONS:
                    with pytest.raises(ToolCallError, match=f"/{PLAIN_STRING_COLLECTIONS[row['id']]} fails keyword "
                                                            f"'pattern'"):
                        turn.registry().parse_call(c)
                else:
                    turn.registry().parse_call(c)  # the declared tool takes them (every parameter a string)
            ok, err = official_verdict(row["function"], calls, row["ground_truth"], cat)
            assert ok or row["id"] in UNPASSABLE, (row["id"], err, calls)


def test_every_function_doc_is_declared_as_bfcl_declares_it(rows):
    from bfcl_eval.utils import _func_doc_language_specific_pre_processing

    for cat in rows:
        for row in rows[cat]:
            for fn in row["function"]:
                theirs = _func_doc_language_specific_pre_processing([copy.deepcopy(fn)], cat)[0]
                assert language_specific_pre_processing(fn, language_of(cat)) == theirs
                tool = tool_from_bfcl(fn, language=language_of(cat))
                assert tool.description == theirs["description"]  # Python's hint too: "... in Python 3 syntax."
                if language_of(cat) != "python":
                    props = tool.parameters["properties"]
                    assert all(p["type"] == "string" for p in props.values()), (fn["name"], props)
    fn = rows["simple_python"][0]["function"][0]
    assert language_specific_pre_processing(fn, "python")["description"].endswith("Python 3 syntax.")


def test_the_grammar_writes_only_strings_for_java_parameters(smol_tokenizer, rows):
    from constraints import llg_tokenizer, ConstraintState

    row = next(r for r in rows["simple_java"] if r["id"] == "simple_java_6")  # three boolean parameters
    turn = bfcl_turn(row, "simple_java")
    fmt = GenericFormat(smol_tokenizer)
    llt = llg_tokenizer(smol_tokenizer, len(smol_tokenizer), smol_tokenizer.eos_token_id)
    good = render_call_text(written_calls(row, "simple_java"))
    typed = good.replace('"true"', "true")
    assert typed != good
    for text, accepted in ((good, True), (typed, False)):
        state = ConstraintState(llt, turn.grammar(fmt=fmt))
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        assert (state.valid_prefix_len(ids) == len(ids)) is accepted, text


def _perturbations(row: dict, cat: str, rng: random.Random):
    """(label, calls) variants of the written ground truth."""
    base = written_calls(row, cat)
    java_js = language_of(cat) != "python"
    for i, call in enumerate(base):
        (_, truth), = row["ground_truth"][i].items()
        for k, v in call["arguments"].items():
            wrong = (not v if isinstance(v, bool) else v + 1 if isinstance(v, (int, float))
                     else v + "x" if isinstance(v, str) else v[:-1] if isinstance(v, list) and v
                     else [1] if isinstance(v, list) else None)
            if wrong is not None:
                yield "wrong value", _replace(base, i, k, wrong)
            if "" in truth[k]:
                yield '"" for an optional param', _replace(base, i, k, "")
                yield "[] for an optional param", _replace(base, i, k, [])
            if java_js:
                typed = next((a for a in truth[k] if a != "" and not isinstance(a, str)), None)
                if typed is None:
                    typed = {"true": True, "false": False}.get(v, int(v) if v.lstrip("-").isdigit() else None)
                if typed is not None:
                    yield "typed value for a Java/JS param", _replace(base, i, k, typed)
        optional = [k for k, alts in truth.items() if "" in alts and k not in call["arguments"]]
        for k in optional[:1]:
            alts = [a for a in truth[k] if a != ""]
            if alts:
                yield "optional param given", _replace(base, i, k, _resolve(alts[0]))
        if call["arguments"]:
            k = rng.choice(sorted(call["arguments"]))
            yield "param dropped", [c if j != i else {**c, "arguments": {a: b for a, b in c["arguments"].items()
                                                                         if a != k}} for j, c in enumerate(base)]
        yield "undeclared param", _replace(base, i, "zz_extra", "1")
    if len(base) > 1:
        yield "reordered parallel calls", list(reversed(base))
        yield "one call missing", base[:-1]
    yield "call duplicated", base + base[:1]


def _replace(calls, i, k, v):
    out = copy.deepcopy(calls)
    out[i]["arguments"][k] = v
    return out


def test_perturbed_answers_get_the_same_verdict_from_our_scorer_and_the_official_checker(rows):
    rng = random.Random(1234)
    mismatched, seen = [], {}
    for cat, qs in rows.items():
        sample = qs if len(qs) <= 120 else rng.sample(qs, 120)
        for row in sample:
            for label, calls in _perturbations(row, cat, rng):
                official, err = official_verdict(row["function"], calls, row["ground_truth"], cat)
                ours = score(calls, row["ground_truth"], any_order=is_parallel(cat), functions=row["function"],
                             language=language_of(cat))
                seen.setdefault(label, [0, 0])[official] += 1
                if ours != official:
                    mismatched.append((row["id"], label, ours, official, err, json.dumps(calls)[:200]))
    assert not mismatched, mismatched[:10]
    # every kind of perturbation ran; typed Java/JS values are always rejected, reordering parallel calls never is
    assert {"wrong value", '"" for an optional param', "[] for an optional param", "reordered parallel calls",
            "typed value for a Java/JS param"} <= set(seen)
    assert seen["typed value for a Java/JS param"][1] == 0
    assert seen["reordered parallel calls"][1] > 0


def test_hermes_parser_reads_calls_as_vllm_does():
    p = HermesToolParser()
    assert p.parse("No tool fits.") == (None, "No tool fits.") and not p.is_call("No tool fits.")
    text = ('Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": "{\\"y\\": 2}"}')  # the second one unclosed
    calls, content = p.parse(text)
    assert calls == [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"y": 2}}]
    assert content == "Sure."
    for bad in ('<tool_call>{"name": "f", "arguments": {"x": </tool_call>', '<tool_call>{"x": 1}</tool_call>'):
        with pytest.raises(ValueError):
            p.parse(bad)


def test_parse_only_judging_counts_a_broken_call_invalid_and_a_text_answer_per_category(rows):
    row = rows["simple_python"][0]
    turn = bfcl_turn(row, "simple_python")
    p = HermesToolParser()
    good = "<tool_call>\n" + json.dumps(written_calls(row, "simple_python")[0]) + "\n</tool_call>"
    assert turn.judge(good, False, turn.registry(), p) == (True, True)
    assert turn.judge("The area is 25.", False, turn.registry(), p) == (False, False)
    assert turn.judge('<tool_call>{"name": ', False, turn.registry(), p) == (False, False)
    irr = bfcl_turn({**row, "id": "irrelevance_0", "ground_truth": []}, "irrelevance")
    assert irr.judge("The area is 25.", False, irr.registry(), p) == (True, True)
    assert irr.judge(good, False, irr.registry(), p) == (True, False)
    assert FormatParser(GenericFormat(None)).parse("hi") == (None, "hi")


def test_free_grammar_admits_any_text_up_to_eos(smol_tokenizer):
    from constraints import llg_tokenizer, ConstraintState

    llt = llg_tokenizer(smol_tokenizer, len(smol_tokenizer), smol_tokenizer.eos_token_id)
    state = ConstraintState(llt, free_grammar(smol_tokenizer))
    ids = smol_tokenizer.encode('Hi <tool_call>[{"name": "f"}]</tool_call>\n\n{ broken', add_special_tokens=False)
    assert state.valid_prefix_len(ids) == len(ids)
    state.consume_many(ids)
    assert state.is_accepting()


def test_run_bfcl_reports_the_checker_and_the_runtime(tmp_path, smol_tokenizer):
    from types import SimpleNamespace

    from bench.bfcl import run_bfcl, summary_table
    from decoding import DecodeStats
    from schemas import ToolRegistry

    row = load_questions("simple_java", DATA, limit=1)[0]
    (tmp_path / "BFCL_v4_simple_java.jsonl").write_text(json.dumps(row))
    calls = written_calls(row, "simple_java")

    class FakeAgent:
        format = HermesToolParser()

        def __init__(self, tools):
            self.registry = ToolRegistry(tools, strict=False)

        def run(self, messages, **kwargs):
            text = "<tool_call>\n" + json.dumps(calls[0]) + "\n</tool_call>"
            return SimpleNamespace(raw_turns=[text], truncated=False, stats=DecodeStats())

    s = run_bfcl(FakeAgent, "simple_java", data_dir=tmp_path, out=lambda s: None, runtime="parse-only")
    assert (s["checker"], s["runtime"], s["accuracy"], s["valid"]) == ("official", "parse-only", 1.0, 1.0)
    assert s["parser"].startswith("hermes")
    assert "| simple_java | parse-only |" in summary_table([s])


def test_run_bfcl_times_valid_calls_cold_and_warm_and_counts_masked_ends_of_cut_turns(tmp_path):
    """Warm = the previous question had the same tools; a cut turn whose end the grammar masked is counted."""
    from types import SimpleNamespace

    from bench.bfcl import run_bfcl
    from decoding import DecodeStats
    from schemas import ToolRegistry

    rows = load_questions("simple_python", DATA, limit=3)
    rows = [rows[0], {**rows[1], "function": rows[0]["function"], "ground_truth": rows[0]["ground_truth"]}, rows[2]]
    (tmp_path / "BFCL_v4_simple_python.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    seconds = iter([1.0, 0.25, 2.0])

    class FakeAgent:
        format = HermesToolParser()
        config = SimpleNamespace(count_masked_ends=True)

        def __init__(self, tools):
            self.registry = ToolRegistry(tools, strict=False)

        def run(self, messages, **kwargs):
            row = next(r for r in rows if r["question"][0] == [messages[-1]] or
                       r["question"][0][-1]["content"] == messages[-1]["content"])
            if row is rows[2]:  # cut by the budget where the model wanted to end
                return SimpleNamespace(raw_turns=["<tool_call>\n{"], truncated=True,
                                       stats=DecodeStats(seconds=next(seconds), masked_end_argmax=3))
            text = "<tool_call>\n" + json.dumps(written_calls(row, "simple_python")[0]) + "\n</tool_call>"
            return SimpleNamespace(raw_turns=[text], truncated=False, stats=DecodeStats(seconds=next(seconds)))

    s = run_bfcl(FakeAgent, "simple_python", data_dir=tmp_path, out=lambda s: None)
    assert (s["truncated"], s["cut_masked_end"], s["warm_questions"]) == (1, 1, 1)
    assert (s["time_to_valid_call_cold_p50"], s["time_to_valid_call_warm_p50"]) == (1.0, 0.25)


def test_a_python_any_parameter_is_a_string_as_the_official_checker_reads_it(rows):
    """BFCL's checker takes a Python ``any`` only as a ``str`` (``PYTHON_TYPE_MAPPING["any"] = str``) and its FC
    harness declares it ``"string"``: the grammar writes a string there (before, free JSON: the default model wrote
    ``{"data": [1, 2, 3, …]}`` for ``simple_python_109`` until the budget, which no checker takes)."""
    found = 0
    for cat, qs in rows.items():
        if language_of(cat) != "python":
            continue
        for row in qs:
            for fn in row["function"]:
                for k, v in fn["parameters"].get("properties", {}).items():
                    if v.get("type") != "any":
                        continue
                    found += 1
                    tool = bfcl_turn(row, cat).registry().get(fn["name"])
                    assert tool.parameters["properties"][k]["type"] == "string"
                    truth = next((t[fn["name"]] for t in row["ground_truth"] if fn["name"] in t), None)
                    if truth is None:
                        continue
                    calls = written_calls(row, cat)
                    assert official_verdict(row["function"], calls, row["ground_truth"], cat)[0]
                    typed = [{**c, "arguments": {**c["arguments"], k: {"data": [1, 2]}}} if c["name"] == fn["name"]
                             else c for c in calls]
                    assert not official_verdict(row["function"], typed, row["ground_truth"], cat)[0]
    assert found >= 3
