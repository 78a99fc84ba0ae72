"""Which optional arguments should a call keep? Simulate rules on recorded BFCL outputs (dev split only).

Small models fill optional parameters nobody asked for (an invented ``unit``, a ``limit`` of 10, a ``location`` the
question never names), and BFCL's checker counts such a call wrong. A rule that drops an optional argument is a
function of the decoded call alone (the turn's text is unchanged, single-turn questions), so it is simulated
exactly on the output of ``python -m agent bfcl`` (one ``ID<TAB>VALID<TAB>CORRECT<TAB>OUTPUT`` line per question):

* ``as decoded``: every argument kept;
* ``grounded`` (what ``agent.grounding`` does): an optional argument (not in the tool's ``required``) is dropped when
  one of its string or number values is not written in the conversation's system, developer, user or tool
  messages (``agent.grounding.drop_unwritten_optional``); booleans and null count as written;
* ``grounded, strings only`` / ``grounded, numbers only``: the same, judging only string / only number values;
* ``grounded, not enums``: as ``grounded``, but a value from the parameter's ``enum`` is kept;
* ``grounded, enumerated``: as ``grounded``, but a value the parameter's schema enumerates is kept: one of its
  ``enum``, or an array every item of which is one of its ``items``' ``enum`` (``add_ons: ["Backstage Pass"]``):
  the model chose it from the schema's options, it did not invent it (tried 2026-12-06);
* ``grounded or default``: as ``grounded``, but a value equal to the parameter's ``default`` is kept;
* ``grounded, enum items``: as ``grounded``, and in every argument (required too) an array of ``enum`` strings
  keeps only its items written in the conversation, where at least one is (and ``minItems`` still holds):
  ``specific_info: ["overview", "causalities", "date"]`` for "find an overview" becomes ``["overview"]``
  (:func:`written_enum_items`; tried 2026-12-04, not adopted);
* ``grounded, nested``: as ``grounded``, and inside every argument's objects (at any depth, arrays' items too) a
  key the object's schema does not require is dropped by the same test (:func:`nested_unwritten_dropped`);
* ``no optional``: every optional argument dropped.

Beside them, ``takes nothing (right / wrong)`` counts the turns none of whose calls takes a value from the
conversation (``agent.grounding.takes_from_conversation``: the turns ``LocalEngine`` decodes again without those
tools), and how many of them were right as decoded; what the retry decodes cannot be simulated from one output.

Usage::

    python -m agent bfcl --model qwen2.5-coder-0.5b --backend llamacpp --threads 1 --category multiple \\
        --split dev --limit 30 --no-grounding > dev_multiple.tsv
    python scripts/optional_values.py dev_multiple.tsv [more.tsv ...]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RULES = ("as decoded", "grounded", "grounded, strings only", "grounded, numbers only", "grounded, not enums",
         "grounded, enumerated", "grounded or default", "grounded, enum items", "grounded, nested", "no optional")


def _category(question_id: str) -> str:
    from bench.bfcl import CATEGORIES

    return max((c for c in CATEGORIES if question_id.startswith(c + "_")), key=len)


def keep(rule: str, value, spec: dict, grounding) -> bool:
    """Whether ``rule`` keeps an optional argument of value ``value`` (``spec``: its parameter schema)."""
    from agent.grounding import leaf_values

    def judged(v) -> bool:
        if rule == "grounded, strings only":
            return isinstance(v, str)
        if rule == "grounded, numbers only":
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        return True

    if rule == "as decoded":
        return True
    if rule == "no optional":
        return False
    if rule in ("grounded, not enums", "grounded, enumerated") and value in (spec.get("enum") or []):
        return True
    items = spec.get("items")
    if (rule == "grounded, enumerated" and isinstance(value, list) and value and isinstance(items, dict)
            and all(v in (items.get("enum") or []) for v in value)):
        return True
    if rule == "grounded or default" and "default" in spec and spec["default"] == value:
        return True
    return all(v in grounding for v in leaf_values(value) if judged(v))


def written_enum_items(value, spec: dict, grounding):
    """``value`` with each array of ``enum`` strings (``spec``: its schema; nested objects' ``properties``
    followed) reduced to its items written in the conversation (``item in grounding``), where at least one item is
    written and the reduced array still has ``minItems``; else unchanged."""
    if not isinstance(spec, dict):
        return value
    if isinstance(value, dict):
        props = spec.get("properties") or {}
        return {k: written_enum_items(v, props.get(k) or {}, grounding) for k, v in value.items()}
    items = spec.get("items")
    if (isinstance(value, list) and value and all(isinstance(x, str) for x in value) and isinstance(items, dict)
            and isinstance(items.get("enum"), list)):
        written = [x for x in value if x in grounding]
        if written and len(written) >= spec.get("minItems", 0):
            return written
    return value


def nested_unwritten_dropped(value, spec: dict, grounding):
    """``value`` with, in each object below it whose schema (``spec``, ``properties`` and ``items`` followed)
    declares properties, the keys it does not require dropped where one of their strings or numbers is not
    written in the conversation (``agent.grounding``'s test for optional arguments, one level down)."""
    from agent.grounding import drop_unwritten_optional

    if not isinstance(spec, dict):
        return value
    if isinstance(value, list) and isinstance(spec.get("items"), dict):
        return [nested_unwritten_dropped(v, spec["items"], grounding) for v in value]
    props = spec.get("properties")
    if not isinstance(value, dict) or not isinstance(props, dict):
        return value
    kept = drop_unwritten_optional({"arguments": value}, spec, grounding)["arguments"]  # the engine's rule
    return {k: nested_unwritten_dropped(v, props.get(k) or {}, grounding) for k, v in kept.items()}


def simulate(paths: list[str], split: str) -> None:
    from agent.formats.hermes import HermesFormat
    from agent.grounding import Grounding, conversation_text, takes_from_conversation
    from bench.bfcl import bfcl_turn, is_irrelevance, load_questions

    rows: dict[str, tuple[dict, str]] = {}
    totals: dict[str, dict[str, int]] = {}
    fmt = HermesFormat(None)
    for path in paths:
        for line in open(path):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 4 or parts[1] not in ("0", "1"):
                continue
            qid, valid, _, text = parts[0], parts[1] == "1", parts[2], json.loads(parts[3])
            category = _category(qid)
            if is_irrelevance(category):
                continue
            if category not in {c for _, c in rows.values()}:
                rows.update({r["id"]: (r, category) for r in load_questions(category, None, None, split)})
            row, _ = rows[qid]
            turn = bfcl_turn(row, category)
            grounding = Grounding(conversation_text(turn.messages))
            calls = (fmt.parse(text)[0] or []) if valid else None
            verdicts = {}
            for rule in RULES:
                if calls is None:
                    verdicts[rule] = False
                    continue
                kept = []
                for c in calls:
                    tool = next((t for t in turn.tools if t.name == c.get("name")), None)
                    schema = tool.parameters if tool is not None else {}
                    required = set(schema.get("required", []))
                    props = schema.get("properties", {})
                    args = c.get("arguments") or {}
                    if rule == "grounded, enum items":
                        args = written_enum_items(args, schema, grounding)
                    if rule == "grounded, nested":  # one level down from the arguments, then every level
                        args = {k: nested_unwritten_dropped(v, props.get(k) or {}, grounding) for k, v in args.items()}
                    args = {k: v for k, v in args.items()
                            if k in required or keep(rule, v, props.get(k) or {}, grounding)}
                    kept.append({"name": c.get("name"), "arguments": args})
                verdicts[rule] = turn.check(kept)
            t = totals.setdefault(category, {"n": 0, **{r: 0 for r in RULES}, "flagged": 0, "flagged right": 0})
            t["n"] += 1
            if calls and not any(takes_from_conversation(c, grounding) for c in calls):
                t["flagged"] += 1
                t["flagged right"] += verdicts["as decoded"]
            for r, v in verdicts.items():
                t[r] += v
            if len(set(verdicts.values())) > 1:
                print(qid, {r: int(v) for r, v in verdicts.items()}, text[:300].replace("\n", " "))
    print("\n| category | n | " + " | ".join(RULES) + " | takes nothing (right / wrong) |\n|---|---:|"
          + "---:|" * (len(RULES) + 1))
    for name, t in totals.items():
        print(f"| {name} | {t['n']} | " + " | ".join(str(t[r]) for r in RULES)
              + f" | {t['flagged right']} / {t['flagged'] - t['flagged right']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outputs", nargs="+", help="files of `python -m agent bfcl` output lines")
    ap.add_argument("--split", default="dev", choices=("dev", "test"))
    args = ap.parse_args()
    simulate(args.outputs, args.split)


if __name__ == "__main__":
    main()
