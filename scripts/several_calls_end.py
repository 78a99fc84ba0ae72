"""Where should a several-call turn end? Record once, simulate every end rule exactly (dev split only).

``record``: decodes BFCL several-call questions (``parallel_tool_calls=True``) with the model's end masked, so the
model goes on writing calls until a repeat, the cap (8) or the budget; beside each call boundary it stores the
model's end-of-generation logit (the largest of its EOG tokens) and ``<tool_call>``'s logit after
``</tool_call>\\n``, from one teacher-forced pass of a separate llama.cpp context over prompt + output. Greedy
decoding makes every rule below a prefix of that one output, so ``simulate`` scores them all with BFCL's checker:

* ``masked``: the end masked, every call kept (repeat and cap only);
* ``model``: at least two calls, then the model ends it where its end logit beats ``<tool_call>``'s;
* ``new values``: the end masked, the turn ends at the first call past the second that brings no new value from
  the conversation (``agent.parallel_calls.brings_new_values``; what the engine does);
* ``grounded only``: as ``new values``, but a call whose new values are only booleans (a recombination) is kept;
* ``a new tool counts``: as ``new values``, but a call of a tool no earlier call used is kept when its new values
  are all written in the conversation;
* ``new values from call 2``: as ``new values``, applied from the second call on;
* ``new for its tool``: as ``new values``, but a call of a tool an earlier call used is kept when it holds a value
  no earlier call *of that tool* has, every such value written (:func:`new_for_its_tool`);
* ``named tool``: as ``new values``, but a call of a new tool a word of whose name the conversation writes (and no
  earlier tool's name holds) is kept when its new values are all written (:func:`named_new_tool`);
* ``skip unwritten`` (``, named tool``): a call past the first holding a new value the conversation does not write
  is skipped and the turn goes on (:func:`skipping`);
* ``new values mentioned``: as ``new values``, but a new string counts where a word of it is written
  (:func:`brings_new_mentioned`).

Every variant's calls pass the engine's optional-argument rule before they are scored
(``agent.grounding.without_unwritten_optional``).

Usage::

    python scripts/several_calls_end.py record --model qwen2.5-coder-0.5b --limit 30 --out rec.jsonl
    python scripts/several_calls_end.py simulate rec.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CATEGORIES = ("parallel", "parallel_multiple")


def record(args) -> None:
    import llama_cpp
    import numpy as np

    from agent.agent import Agent
    from agent.engine import EngineConfig, LocalEngine
    from bench.bfcl import MAX_DECIMALS, MAX_STRING_LENGTH, bfcl_turn, load_questions
    from decoding.llamacpp import gguf_of

    import agent.engine

    # the end masked (the grammar asks for cap + 1 calls) and no new-values rule: only a repeat, the cap (8) or the
    # budget end the turn, so every rule simulated is a prefix of this output
    end_rule = agent.engine.ParallelCallsEnd
    agent.engine.ParallelCallsEnd = lambda fmt, max_calls, context=None: end_rule(fmt, max_calls, context=None)
    engine = LocalEngine(args.model, backend="llamacpp", threads=1)
    prompts = {}
    prepare = engine._prepare

    def keep_prompt(*a, **k):  # the prompt ids the turn decodes after
        out = prepare(*a, **k)
        prompts["last"] = list(out[0])
        return out

    engine._prepare = keep_prompt
    config = EngineConfig(max_string_length=MAX_STRING_LENGTH, max_decimals=MAX_DECIMALS,
                          max_new_tokens=args.max_new_tokens, grounding=False)  # raw calls: simulate drops
    llm = llama_cpp.Llama(str(gguf_of(args.model)[0]), n_ctx=4096, n_threads=1, logits_all=True, verbose=False)
    eog = [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, i)]
    open_id, close_id, nl = (llm.tokenize(s, add_bos=False, special=True)[0]
                             for s in (b"<tool_call>", b"</tool_call>", b"\n"))
    with open(args.out, "a") as out:
        for category in args.category.split(","):
            for row in load_questions(category, None, args.limit, "dev")[args.start:]:
                turn = bfcl_turn(row, category)
                t0 = time.perf_counter()
                agent = Agent(engine, turn.tools, config=config, strict=False)
                res = agent.run(turn.messages, tool_choice="required", max_steps=1, parallel_tool_calls=True,
                                max_new_tokens=args.max_new_tokens)
                text = res.raw_turns[-1] if res.raw_turns else ""
                prompt = prompts["last"]
                toks = llm.tokenize(text.encode(), add_bos=False, special=True)
                llm.reset()
                llm.eval(prompt + toks + [nl])
                bounds = []
                for j, t in enumerate(toks):
                    if t == close_id:  # the row after "</tool_call>\n" chooses between another block and the end
                        if j + 1 < len(toks) and toks[j + 1] != nl:
                            continue
                        row_logits = np.asarray(llm.scores[len(prompt) + j + 1])  # after that "\n
                        bounds.append({"eog": float(row_logits[eog].max()), "open": float(row_logits[open_id])})
                rec = {"id": row["id"], "category": category, "text": text, "truncated": bool(res.truncated),
                       "bounds": bounds, "seconds": round(time.perf_counter() - t0, 1)}
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(row["id"], len(bounds), [round(b["eog"] - b["open"], 1) for b in bounds], flush=True)


def named_new_tool(call: dict, earlier: list[dict], grounding) -> bool:
    """A call of a tool no earlier call used, a word of whose name (three or more letters, split at ``.``, ``_``
    and case changes) the conversation writes and no earlier call's tool name holds, every new value written."""
    import re

    from agent.grounding import leaf_values

    def words(name: str) -> set[str]:
        return {w.casefold() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", name) if len(w) >= 3}

    if call["name"] in {c["name"] for c in earlier}:
        return False
    seen = {json.dumps(v) for c in earlier for v in leaf_values(c["arguments"])}
    if not all(v in grounding for v in leaf_values(call["arguments"]) if json.dumps(v) not in seen):
        return False
    used = set().union(*(words(c["name"]) for c in earlier)) if earlier else set()
    return any(w in grounding.words for w in words(call["name"]) - used)


def new_for_its_tool(call: dict, earlier: list[dict], grounding) -> bool:
    """A call of a tool an earlier call used, holding a value (not a boolean or null) no earlier call of that tool
    has, every such value written in the conversation: ``gdp(year=1950)`` after ``life_expectancy(1900)``,
    ``gdp(1900)``, ``life_expectancy(1950)``."""
    from agent.parallel_calls import brings_new_values

    same = [c for c in earlier if c["name"] == call["name"]]
    return bool(same) and brings_new_values(call, same, grounding)


def brings_new_mentioned(call: dict, earlier: list[dict], grounding) -> bool:
    """As ``agent.parallel_calls.brings_new_values``, but a new string counts where the conversation mentions it
    (``Grounding.mentions``: a word of it written, "trial_date" for "scheduled trial date") rather than writes it
    whole."""
    from agent.grounding import leaf_values, number_key

    def key(v):  # as brings_new_values compares values: numbers by number_key
        return f"n:{number_key(v)}" if isinstance(v, (int, float)) and not isinstance(v, bool) else json.dumps(v)

    seen = {key(v) for c in earlier for v in leaf_values(c["arguments"])}
    new = [v for v in leaf_values(call["arguments"]) if key(v) not in seen]
    return any(v is not None and not isinstance(v, bool) for v in new) and all(
        v in grounding or grounding.mentions(v) for v in new)


def skipping(calls: list[dict], grounding, *, mentioned_tool: bool) -> list[dict]:
    """Calls past the first holding a new value the conversation does not write are skipped (the turn goes on);
    past the second kept call, one that brings no new value ends the turn (or, ``mentioned_tool``, is kept when
    :func:`named_new_tool`)."""
    from agent.grounding import leaf_values
    from agent.parallel_calls import brings_new_values

    kept: list[dict] = []
    for c in calls:
        if kept:
            seen = {json.dumps(v) for k in kept for v in leaf_values(k["arguments"])}
            if not all(v in grounding for v in leaf_values(c["arguments"]) if json.dumps(v) not in seen):
                continue
        if len(kept) >= 2 and not brings_new_values(c, kept, grounding) and not (
                mentioned_tool and named_new_tool(c, kept, grounding)):
            break
        kept.append(c)
    return kept


def simulate(args) -> None:
    from agent.formats.hermes import HermesFormat
    from agent.grounding import Grounding, conversation_text, leaf_values, without_unwritten_optional
    from agent.parallel_calls import brings_new_values
    from bench.bfcl import bfcl_turn, load_questions

    rows = {r["id"]: (r, c) for c in CATEGORIES for r in load_questions(c, None, None, "dev")}
    totals: dict[str, dict[str, int]] = {}
    for path in args.records:
        for line in open(path):
            rec = json.loads(line)
            row, category = rows[rec["id"]]
            turn = bfcl_turn(row, category)
            calls = [c for c, _ in HermesFormat(None).complete_calls(rec["text"])]
            grounding = Grounding(conversation_text(turn.messages))
            bounds = rec["bounds"]
            check = turn.check
            turn = SimpleNamespace(ground_truth=turn.ground_truth, check=lambda kept, check=check, turn=turn: check(
                [without_unwritten_optional(c, turn.tools, grounding) for c in kept]))

            def model_ends(k: int) -> bool:  # after call k (1-based)
                return k > len(bounds) or bounds[k - 1]["eog"] > bounds[k - 1]["open"]

            model = next((k for k in range(2, len(calls) + 1) if model_ends(k)), len(calls))
            def first_failing(rule, start: int) -> int:  # calls kept: up to the first one past `start` that fails
                k = start
                while k < len(calls) and rule(calls[k], calls[:k]):
                    k += 1
                return k

            def grounded_only(call, earlier):  # every new value written in the conversation; booleans may recombine
                seen = {json.dumps(v) for c in earlier for v in leaf_values(c["arguments"])}
                return all(v in grounding for v in leaf_values(call["arguments"]) if json.dumps(v) not in seen)

            new = first_failing(lambda c, e: brings_new_values(c, e, grounding), 2)
            verdicts = {"masked": turn.check(calls), "model": turn.check(calls[:model]),
                        "new values": turn.check(calls[:new]),
                        "grounded only": turn.check(calls[:first_failing(grounded_only, 2)]),
                        "a new tool counts": turn.check(calls[:first_failing(
                            lambda c, e: brings_new_values(c, e, grounding) or (
                                c["name"] not in {x["name"] for x in e} and grounded_only(c, e)), 2)]),
                        "new values from call 2": turn.check(
                            calls[:first_failing(lambda c, e: brings_new_values(c, e, grounding), 1)])}
            verdicts["skip unwritten"] = turn.check(skipping(calls, grounding, mentioned_tool=False))
            verdicts["skip unwritten, named tool"] = turn.check(skipping(calls, grounding, mentioned_tool=True))
            verdicts["new for its tool"] = turn.check(calls[:first_failing(
                lambda c, e: brings_new_values(c, e, grounding) or new_for_its_tool(c, e, grounding), 2)])
            verdicts["new values mentioned"] = turn.check(calls[:first_failing(
                lambda c, e: brings_new_mentioned(c, e, grounding), 2)])
            verdicts["named tool"] = turn.check(calls[:first_failing(
                lambda c, e: brings_new_values(c, e, grounding) or named_new_tool(c, e, grounding), 2)])
            t = totals.setdefault(f"{Path(path).name} {category}", {"n": 0, **{k: 0 for k in verdicts}})
            t["n"] += 1
            for k, v in verdicts.items():
                t[k] += v
            print(rec["id"], f"ground truth {len(turn.ground_truth)} calls; kept: masked {len(calls)}, "
                  f"model {model}, new values {new}", {k: int(v) for k, v in verdicts.items()})
    names = ["masked", "model", "new values", "grounded only", "a new tool counts", "new values from call 2",
             "new for its tool", "named tool", "skip unwritten", "skip unwritten, named tool", "new values mentioned"]
    print("\n| records, category | n | " + " | ".join(names) + " |\n|---|---:|" + "---:|" * len(names))
    for name, t in totals.items():
        print(f"| {name} | {t['n']} | " + " | ".join(str(t[k]) for k in names) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--model", default="qwen2.5-coder-0.5b")
    r.add_argument("--category", default=",".join(CATEGORIES))
    r.add_argument("--limit", type=int, default=30)
    r.add_argument("--start", type=int, default=0, help="skip the first START of those questions (split a run)")
    r.add_argument("--max-new-tokens", type=int, default=512)
    r.add_argument("--out", required=True)
    s = sub.add_parser("simulate")
    s.add_argument("records", nargs="+")
    args = ap.parse_args()
    record(args) if args.cmd == "record" else simulate(args)


if __name__ == "__main__":
    main()
