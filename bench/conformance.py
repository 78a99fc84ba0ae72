"""Schema conformance: does the grammar accept exactly the instances the schema allows?

``python -m bench.conformance --suite maskbench|test-suite|jsonschemabench [--data DIR] [--out DIR] [--limit N]``

For every schema the runner registers it strictly (meta-schema and ``$ref`` check, then the llguidance compile that
rejects keywords it cannot enforce). For every instance of a compiled schema it serialises the value the way the
generator emits it (compact separators, no free whitespace, non-ASCII characters unescaped, object keys in schema
order with undeclared keys after the declared ones), tokenizes it with the default model's tokenizer (SmolLM2; the
tokenizer only, the model is never loaded), feeds the tokens to a fresh :class:`constraints.ConstraintState` and
records whether the state accepts at the end.

Each instance is judged by jsonschema against the ORIGINAL schema, with ``format`` as an assertion (the grammar
enforces the formats it knows), not by its label: an instance is valid when jsonschema says so (disagreements with
the suite's label are counted in ``label_disagreements``). A defect (``invalid_accepted``) is a serialisation the
grammar accepts whose parsed value jsonschema rejects. A value can have several serialisations the generator could
emit (e.g. ``1.0`` and ``1`` for an integral number); a valid instance counts as accepted when one of them is.

jsonschemabench has no instances: the runner reports the compile rate per subset, the compile time (meta-schema
check + llguidance compile + matcher construction, ms) and the mask time (ms per next-token mask, along a seeded
random walk of up to 16 tokens per schema), p50 and p99.

Writes ``OUT/conformance.json`` (counts) and ``OUT/details.jsonl`` (one line per rejected schema and per defect).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data"
SUITES = ("maskbench", "test-suite", "jsonschemabench")
MASK_WALK_STEPS = 16


# -- data -------------------------------------------------------------------------------------------------------
def load_cases(suite: str, data: Path, limit: int | None = None) -> Iterator[dict]:
    """Yield ``{"id", "subset", "schema", "tests": [{"data", "valid", "description"}]}`` for a suite.

    ``data`` is the folder holding ``maskbench/``, ``json-schema-test-suite/`` and ``jsonschemabench/`` (or the
    suite's own folder). ``limit`` caps the schemas per file (per subset). Raises FileNotFoundError when the suite's
    files are missing.
    """
    sub = {"maskbench": "maskbench", "test-suite": "json-schema-test-suite", "jsonschemabench": "jsonschemabench"}
    folder = data / sub[suite] if (data / sub[suite]).is_dir() else data
    if suite == "test-suite":
        files = sorted((folder / "draft2020-12").glob("*.json")) or sorted(folder.glob("*.json"))
    else:
        files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no {suite} files under {folder}")
    for path in files:
        if suite == "test-suite":
            groups = json.loads(path.read_text())
            for i, g in enumerate(groups[:limit]):
                yield {"id": f"{path.stem}/{i}", "subset": path.stem, "description": g.get("description", ""),
                       "schema": g["schema"], "tests": g.get("tests", [])}
            continue
        with path.open() as f:
            for i, line in enumerate(f):
                if limit is not None and i >= limit:
                    break
                row = json.loads(line)
                subset = row.get("subset") or path.name.split(".")[0]
                yield {"id": row["id"], "subset": subset, "schema": row["schema"], "tests": row.get("tests", [])}


# -- serialisation (what the generator emits) ----------------------------------------------------------------------
def _views(schema: Any, root: Any, value: Any, validator, depth: int = 0) -> list[dict]:
    """The schema objects that apply to ``value``: the node, its local ``$ref`` targets, ``allOf`` members and the
    first ``anyOf``/``oneOf`` branch ``value`` satisfies (the branch the generator would have taken)."""
    from schemas.check import MISSING, resolve_local_ref

    if not isinstance(schema, dict) or depth > 40:
        return []
    out = [schema]
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = resolve_local_ref(root, ref)
        if target is not MISSING:
            out += _views(target, root, value, validator, depth + 1)
    for sub in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        out += _views(sub, root, value, validator, depth + 1)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            pick = next((b for b in branches if _fits(validator, b, value)), None)
            if pick is not None:
                out += _views(pick, root, value, validator, depth + 1)
    return out


def _fits(validator, schema: Any, value: Any) -> bool:
    try:
        return validator.evolve(schema=schema).is_valid(value)
    except Exception:
        return False


def _matches(pattern: str, key: str) -> bool:
    try:
        return re.search(pattern, key) is not None
    except re.error:
        return False


def schema_order(value: Any, schema: Any, root: Any, validator, depth: int = 0) -> Any:
    """A copy of ``value`` whose objects list keys in the order the grammar emits them: declared ``properties`` in
    schema order (``$ref`` targets and ``allOf`` members after the node's own), then the other keys as given.
    A value equal to an object ``const``/``enum`` member takes that member's key order."""
    if depth > 200 or not isinstance(value, (dict, list)):
        return value
    views = _views(schema, root, value, validator)
    for v in views:
        members = [v["const"]] if "const" in v else v.get("enum") if isinstance(v.get("enum"), list) else []
        for m in members:
            if isinstance(m, (dict, list)) and type(m) is type(value) and m == value:
                return m
    if isinstance(value, dict):
        order: list[str] = []
        for v in views:
            props = v.get("properties")
            if isinstance(props, dict):
                order += [k for k in props if k in value and k not in order]
        order += [k for k in value if k not in order]
        out = {}
        for k in order:
            subs = [v["properties"][k] for v in views if isinstance(v.get("properties"), dict) and k in v["properties"]]
            if not subs:
                for v in views:
                    pp = v.get("patternProperties")
                    if isinstance(pp, dict):
                        subs += [s for p, s in pp.items() if _matches(p, k)]
            if not subs:
                subs = [v["additionalProperties"] for v in views if isinstance(v.get("additionalProperties"), dict)]
            out[k] = schema_order(value[k], {"allOf": subs} if subs else {}, root, validator, depth + 1)
        return out
    out_list = []
    for i, item in enumerate(value):
        subs = []
        for v in views:
            prefix = v.get("prefixItems")
            items = v.get("items")
            if isinstance(prefix, list):
                if i < len(prefix):
                    subs.append(prefix[i])
                elif isinstance(items, dict):
                    subs.append(items)
            elif isinstance(items, list):
                if i < len(items):
                    subs.append(items[i])
                elif isinstance(v.get("additionalItems"), dict):
                    subs.append(v["additionalItems"])
            elif isinstance(items, dict):
                subs.append(items)
        out_list.append(schema_order(item, {"allOf": subs} if subs else {}, root, validator, depth + 1))
    return out_list


def _intify(value: Any) -> Any:
    """Integral floats as ints (the generator writes ``1`` where an integer is expected)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _intify(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_intify(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """The project's serialisation: compact separators, non-ASCII unescaped (the grammar emits raw UTF-8)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def serialisations(value: Any, schema: Any, validator) -> list[str]:
    """Texts the generator could emit for ``value``, most likely first (schema key order; integral floats as
    ints; then the instance's own key order). Values JSON cannot carry (NaN) give no text."""
    out: list[str] = []
    try:
        ordered = schema_order(value, schema, schema, validator)
    except RecursionError:
        ordered = value
    for v in (ordered, _intify(ordered), value, _intify(value)):
        try:
            text = dumps(v)
        except ValueError:
            continue
        if text not in out:
            out.append(text)
    return out


# -- matching ------------------------------------------------------------------------------------------------------
class Matcher:
    """The default model's tokenizer (HF + llguidance); accepts(grammar, text) feeds tokens to a fresh state."""

    def __init__(self, model: str = "smollm2"):
        from transformers import AutoTokenizer

        from constraints import llg_tokenizer
        from decoding.loader import resolve_model

        directory = resolve_model(model)[0]
        self.hf = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        config = json.loads((Path(directory) / "config.json").read_text())
        self.vocab_size = int(config.get("vocab_size", len(self.hf)))
        self.llt = llg_tokenizer(self.hf, self.vocab_size, self.hf.eos_token_id)

    def state(self, grammar):
        from constraints import ConstraintState

        return ConstraintState(self.llt, grammar)

    def accepts(self, grammar, text: str) -> bool:
        """True when the tokens of ``text`` are all allowed and the state accepts after the last one.

        Raises:
            constraints.ConstraintError: llguidance failed while matching (e.g. a lexer too complex).
        """
        st = self.state(grammar)
        ids = self.hf.encode(text, add_special_tokens=False)
        if st.valid_prefix_len(ids) != len(ids):
            st.raise_if_error("validating tokens")
            return False
        st.consume_many(ids)
        return st.is_accepting()


def register(schema: Any) -> tuple[Any, str | None, list[str], str]:
    """Register ``schema`` strictly: -> (grammar or None, "invalid"/"unsupported"/None, keywords, message)."""
    from constraints import json_schema_grammar
    from schemas.check import check_valid
    from schemas.errors import SchemaError

    try:
        check_valid(schema)
    except SchemaError as e:
        return None, "invalid", sorted({str(p[1]) for p in e.problems}), str(e)
    try:
        return json_schema_grammar(schema), None, [], ""
    except SchemaError as e:
        kws = sorted({str(p[1]) for p in e.problems if p[1]}) or ["(other)"]
        return None, "unsupported", kws, str(e)
    except RecursionError:
        return None, "unsupported", ["(nesting too deep)"], "schema nesting too deep"


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def mask_walk(matcher: Matcher, grammar, rng: random.Random, steps: int = MASK_WALK_STEPS
              ) -> tuple[list[float], str | None]:
    """Mask times (ms) along a seeded random walk through the grammar (up to ``steps`` tokens), and the error
    message when llguidance fails mid-walk (e.g. ``lexer error: too many expressions constructed``), else None."""
    from constraints import ConstraintError, allocate_bitmask, allowed_tokens

    st = matcher.state(grammar)
    row = allocate_bitmask(1, matcher.vocab_size)
    times: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            st.fill_bitmask(row, 0)
        except ConstraintError as e:
            return times, str(e).split("\n")[0]
        times.append((time.perf_counter() - t0) * 1000)
        allowed = allowed_tokens(row[0], matcher.vocab_size).tolist()
        if not allowed or st.is_stopped():
            break
        tok = rng.choice(allowed)
        if tok == st.eos_token:
            break
        st.consume(tok)
    return times, None


# -- the run -------------------------------------------------------------------------------------------------------
def run(suite: str, data: Path, out: Path, limit: int | None = None, log=sys.stderr) -> dict:
    """Run one suite; write ``out/conformance.json`` and ``out/details.jsonl``; return the counts."""
    from constraints import ConstraintError
    from schemas.check import instance_validator

    matcher = Matcher()
    rng = random.Random(0)
    t_start = time.perf_counter()
    c: dict[str, Any] = {"suite": suite, "schemas": 0, "compiled": 0, "rejected_unsupported": 0,
                         "rejected_unsupported_by_keyword": Counter(), "rejected_invalid": 0,
                         "valid_total": 0, "valid_accepted": 0, "invalid_total": 0, "invalid_accepted": 0,
                         "label_disagreements": 0, "instances_skipped": 0, "runtime_errors": 0}
    subsets: dict[str, dict] = {}
    out.mkdir(parents=True, exist_ok=True)
    details = (out / "details.jsonl").open("w")

    def note(**row):
        details.write(json.dumps(row, ensure_ascii=False, default=str)[:4000] + "\n")

    for case in load_cases(suite, data, limit):
        if c["schemas"] % 200 == 0 and c["schemas"]:
            print(f"[{suite}] {c['schemas']} schemas, {time.perf_counter() - t_start:.0f} s", file=log, flush=True)
        c["schemas"] += 1
        sub = subsets.setdefault(case["subset"], {"schemas": 0, "compiled": 0, "compile_ms": [], "mask_ms": [],
                                                     "runtime_errors": 0})
        sub["schemas"] += 1
        schema = case["schema"]
        t0 = time.perf_counter()
        grammar, why, keywords, message = register(schema)
        if grammar is not None:
            try:
                matcher.state(grammar)
            except Exception as e:  # a grammar that compiles but does not load counts as unsupported
                grammar, why, keywords, message = None, "unsupported", ["(grammar load)"], str(e)
        compile_ms = (time.perf_counter() - t0) * 1000
        if grammar is None:
            if why == "invalid":
                c["rejected_invalid"] += 1
            else:
                c["rejected_unsupported"] += 1
                c["rejected_unsupported_by_keyword"].update(keywords)
            note(id=case["id"], kind="rejected_" + why, keywords=keywords, message=message[:500])
            continue
        c["compiled"] += 1
        sub["compiled"] += 1
        sub["compile_ms"].append(compile_ms)
        if suite == "jsonschemabench":
            times, err = mask_walk(matcher, grammar, rng)
            sub["mask_ms"] += times
            if err:
                c["runtime_errors"] += 1
                sub["runtime_errors"] += 1
                note(id=case["id"], kind="runtime_error", message=err)
            continue
        validator = instance_validator(schema)
        for test in case["tests"]:
            data_value = test["data"]
            try:
                judged_valid = validator.is_valid(data_value)
                texts = serialisations(data_value, schema, validator)
            except Exception as e:  # the validator cannot judge it (e.g. a pattern Python's re cannot compile)
                c["instances_skipped"] += 1
                note(id=case["id"], kind="skipped", test=test.get("description"), message=repr(e)[:300])
                continue
            if not texts:
                c["instances_skipped"] += 1
                continue
            if bool(test.get("valid")) != judged_valid:
                c["label_disagreements"] += 1
            try:
                accepted = [t for t in texts if matcher.accepts(grammar, t)]
            except ConstraintError as e:
                c["runtime_errors"] += 1
                note(id=case["id"], kind="runtime_error", test=test.get("description"), message=str(e)[:300])
                accepted = []
            if judged_valid:
                c["valid_total"] += 1
                if accepted:
                    c["valid_accepted"] += 1
                else:
                    note(id=case["id"], kind="valid_rejected", test=test.get("description"), text=texts[0],
                         schema=schema)
                continue
            c["invalid_total"] += 1
            bad = [t for t in accepted if not validator.is_valid(json.loads(t))]
            if bad:
                c["invalid_accepted"] += 1
                note(id=case["id"], kind="invalid_accepted", test=test.get("description"), text=bad[0],
                     errors=[e.message for e in validator.iter_errors(json.loads(bad[0]))][:3], schema=schema)
    details.close()

    c["rejected_unsupported_by_keyword"] = dict(c["rejected_unsupported_by_keyword"].most_common())
    c["valid_accept_rate"] = round(c["valid_accepted"] / c["valid_total"], 4) if c["valid_total"] else None
    c["compile_rate"] = round(c["compiled"] / c["schemas"], 4) if c["schemas"] else None
    c["subsets"] = {}
    for name, s in sorted(subsets.items()):
        c["subsets"][name] = {
            "schemas": s["schemas"], "compiled": s["compiled"],
            "compile_rate": round(s["compiled"] / s["schemas"], 4) if s["schemas"] else None,
            "compile_ms_p50": _pct(s["compile_ms"], 0.5), "compile_ms_p99": _pct(s["compile_ms"], 0.99)}
        if suite == "jsonschemabench":
            c["subsets"][name].update(mask_ms_p50=_pct(s["mask_ms"], 0.5), mask_ms_p99=_pct(s["mask_ms"], 0.99),
                                      masks=len(s["mask_ms"]), runtime_errors=s["runtime_errors"])
    if suite == "jsonschemabench":
        all_compile = [x for s in subsets.values() for x in s["compile_ms"]]
        all_mask = [x for s in subsets.values() for x in s["mask_ms"]]
        c.update(compile_ms_p50=_pct(all_compile, 0.5), compile_ms_p99=_pct(all_compile, 0.99),
                 mask_ms_p50=_pct(all_mask, 0.5), mask_ms_p99=_pct(all_mask, 0.99))
    c["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "conformance.json").write_text(json.dumps(c, indent=2) + "\n")
    return c


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints the counts as JSON. Returns 1 when a compiled schema accepted an invalid
    instance (a defect), else 0."""
    p = argparse.ArgumentParser(prog="python -m bench.conformance", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=SUITES, required=True)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="folder with maskbench/, json-schema-test-suite/, jsonschemabench/ (default ../shared/data)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default bench/results/conformance-<suite>)")
    p.add_argument("--limit", type=int, default=None, help="at most N schemas per file / subset")
    args = p.parse_args(argv)
    out = args.out or ROOT / "bench" / "results" / f"conformance-{args.suite}"
    counts = run(args.suite, args.data, out, args.limit)
    print(json.dumps(counts, indent=2))
    return 1 if counts["invalid_accepted"] else 0


if __name__ == "__main__":
    sys.exit(main())
