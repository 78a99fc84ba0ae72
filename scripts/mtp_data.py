"""Self-distillation data for the MTP head (decoding/mtp.py): one target forward per sequence, no sampling loop.

    .venv/bin/python scripts/mtp_data.py --out data/mtp-smollm2 --seconds 2400   # then scripts/train_mtp.py --data …

Sequences, each a prompt rendered exactly as the agent renders it (``bench.bfcl.bfcl_turn`` + the model's own tool
format from ``agent.formats.make_format``) followed by an answer:

* BFCL **dev split** (``load_questions(cat, split="dev")``: the first half of each shared file) of every category:
  the target's own constrained greedy turn (the distribution the head has to predict: forced tokens in one batch,
  each free token the argmax of the masked logits) and, where the row has one, the ground-truth call rendered in
  the tool format (first acceptable value of each argument; optional ones left out). The test split is never read.
* MaskBench valid instances (``github``, ``glaive``, ``other``; never ``bfcl``, whose instances are BFCL ground
  truths of questions of both splits) as the arguments of a tool built from the instance's schema.
* JSONSchemaBench schemas (the shared first half of each subset; object schemas up to ``--max-schema-chars``) as
  tools, with the instance the target itself generates under the tool-call grammar (its constrained greedy turn).

``--sources`` picks the sources and their priority (the budget may run out); ``--skip-items N`` skips the first N
items of the plan (to continue a run whose budget ran out into another directory, with the same ``--sources`` and
``--seed``: N is the ``next_item`` of the first run's ``summary.json``).

The prompt of a question is fed once: its answers continue from the cached prompt (KV cache cropped back), and
consecutive prompts share their common prefix (the system prompt) the same way.

Stored per sequence (``torch.save`` shards): ``tokens int32 [n]``, the target's last-layer hidden states
``float16 [n, d]`` (after the final norm, as ``CausalLM.forward(hidden=True)`` returns them), the target's top-k
logits of each row (row j predicts token j+1) ``topk_ids int32 [n, K]`` / ``topk_logits float16 [n, K]``,
``label int64 [n]`` (the token the target picks after position j: the greedy turn's own token on its answer
positions, else the row's argmax), ``answer bool [n]`` (answer position), ``free bool [n]`` (answer token the
grammar did not force), ``prompt_len``, ``group`` (question / schema id: the validation split is drawn by group),
``kind`` (``greedy`` | ``truth`` | ``instance``).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# in priority order (the budget may run out): short prompts first, live_multiple (long tool lists) after MaskBench
BFCL_CALL_CATEGORIES = ("simple_python", "multiple", "live_simple", "parallel", "parallel_multiple", "simple_java",
                        "simple_javascript", "live_parallel", "live_parallel_multiple")
BFCL_LONG_CATEGORIES = ("live_multiple",)
BFCL_TEXT_CATEGORIES = ("irrelevance", "live_irrelevance")
MASKBENCH_FILES = ("glaive", "other", "github")  # never maskbench/bfcl.jsonl
SOURCES = ("bfcl", "maskbench", "jsonschemabench", "bfcl_long", "bfcl_text")  # default priority order
SHARED = ROOT.parent / "shared" / "data"


# the questions of tests/fixtures (the model tests measure the shipped head's acceptance on them): never trained on
ALWAYS_HELD_OUT = frozenset(f"simple_python_{i}" for i in range(10))


def is_validation(group: str, every: int = 12) -> bool:
    """The validation split, by question / schema id: about 1 in ``every``, plus :data:`ALWAYS_HELD_OUT`."""
    return group in ALWAYS_HELD_OUT or zlib.crc32(group.encode()) % every == 0


def truth_calls(ground_truth: list[dict]) -> list[dict]:
    """BFCL ground truth ``[{name: {param: [acceptable values]}}]`` -> calls ``[{"name", "arguments"}]`` with the
    first acceptable value of each argument (an optional argument whose first value is ``""`` is left out)."""
    calls = []
    for gt in ground_truth:
        (name, params), = gt.items()
        args = {k: v[0] for k, v in params.items() if isinstance(v, list) and v and v[0] != ""}
        calls.append({"name": name, "arguments": args})
    return calls


def answer_ids(fmt, messages: list[dict], tools, prompt: list[int], calls: list[dict], eos: int) -> list[int] | None:
    """The token ids of an assistant turn holding ``calls``, in the tool format's own rendering (the chat with the
    turn added, minus the prompt; up to and including the end-of-turn token). None when the rendering of the chat
    with the turn does not start with ``prompt``."""
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for i, c in enumerate(calls)]}
    full = fmt.render(messages + [turn, {"role": "user", "content": "ok"}], tools)
    if full[: len(prompt)] != prompt:
        return None
    rest = full[len(prompt):]
    return rest[: rest.index(eos) + 1] if eos in rest else None


class PrefixForward:
    """Target forwards that reuse the KV cache of the longest common prefix with the previous sequence.

    ``run(tokens)`` returns ``(hidden float32 [n, d], logits_topk (ids, values) [n, K])`` for the whole sequence.
    """

    def __init__(self, loaded, k: int):
        from decoding import CausalLM

        self.lm = CausalLM(loaded, cache="dynamic")
        self.k = min(k, self.lm.vocab_size)
        self.tokens: list[int] = []
        self.hidden: list[torch.Tensor] = []  # per position [d]
        self.ids: list[torch.Tensor] = []
        self.vals: list[torch.Tensor] = []
        self.fed = 0  # target token-forwards actually computed

    def _lcp(self, tokens: list[int]) -> int:
        n = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            n += 1
        return n

    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` after the cached ones; returns the logits ``[len(tokens), V]``."""
        logits, h = self.lm.forward(tokens, hidden=True)
        self.fed += len(tokens)
        top = logits.topk(self.k, dim=-1)
        self.tokens += tokens
        self.hidden += list(h.float())
        self.ids += list(top.indices.int())
        self.vals += list(top.values.half())
        return logits

    def crop(self, length: int) -> None:
        if length < len(self.tokens):
            self.lm.crop(length)
            del self.tokens[length:], self.hidden[length:], self.ids[length:], self.vals[length:]

    def start(self, tokens: list[int]) -> torch.Tensor:
        """The sequence becomes ``tokens`` (common prefix kept, at least the last token fed again); returns the
        logits of the last position ``[V]``."""
        n = min(self._lcp(tokens), len(tokens) - 1)
        if n == 0:
            self.lm.reset()
            self.tokens, self.hidden, self.ids, self.vals = [], [], [], []
        else:
            self.crop(n)
        return self.extend(tokens[n:])[-1]

    def record(self, prompt_len: int, answer_free: list[bool], label_answer: list[int] | None, **meta) -> dict:
        n = len(self.tokens)
        ids = torch.stack(self.ids)
        label = ids[:, 0].long().clone()
        if label_answer is not None:  # the greedy turn: the target's masked choice is the token itself
            label[prompt_len - 1: prompt_len - 1 + len(label_answer)] = torch.tensor(label_answer)
        answer = torch.zeros(n, dtype=torch.bool)
        answer[prompt_len:] = True
        free = torch.zeros(n, dtype=torch.bool)
        free[prompt_len: prompt_len + len(answer_free)] = torch.tensor(answer_free, dtype=torch.bool)
        return {"tokens": torch.tensor(self.tokens, dtype=torch.int32), "hidden": torch.stack(self.hidden).half(),
                "topk_ids": ids, "topk_logits": torch.stack(self.vals), "label": label, "answer": answer,
                "free": free, "prompt_len": prompt_len, **meta}


def greedy_turn(pf: PrefixForward, state, last_logits: torch.Tensor, eos: int, max_new_tokens: int
                ) -> tuple[list[int], list[bool]]:
    """Constrained greedy continuation of ``pf``'s sequence: forced tokens are fed together with the next free
    decision's forward. Returns ``(tokens, free flags)``; every output token ends up fed (hidden states known)."""
    from constraints import allocate_bitmask, apply_bitmask, single_allowed

    bitmask = allocate_bitmask(1, pf.lm.vocab_size)
    out: list[int] = []
    free: list[bool] = []
    pending: list[int] = []
    while len(out) < max_new_tokens and not state.is_stopped():
        state.fill_bitmask(bitmask, 0)
        tok = single_allowed(bitmask[0])
        if tok is None:
            if pending:
                last_logits = pf.extend(pending)[-1]
                pending = []
            tok = int(torch.argmax(apply_bitmask(last_logits[None].clone(), bitmask[:1])[0]))
        if tok == eos:
            break
        state.consume(tok)
        out.append(tok)
        free.append(single_allowed(bitmask[0]) is None)
        pending.append(tok)
    if pending:
        pf.extend(pending)
    return out, free


def forced_flags(new_state, grammar, tokens: list[int], vocab: int) -> list[bool]:
    """Free flags of ``tokens`` under ``grammar`` (replayed); tokens past one the grammar rejects count as free."""
    from constraints import allocate_bitmask, single_allowed

    try:
        state = new_state(grammar)
    except Exception:  # noqa: BLE001 - a schema the grammar cannot take: every token counts as free
        return [True] * len(tokens)
    bitmask = allocate_bitmask(1, vocab)
    free = []
    for i, t in enumerate(tokens):
        if state.is_stopped():
            return free + [True] * (len(tokens) - i)
        state.fill_bitmask(bitmask, 0)
        free.append(single_allowed(bitmask[0]) is None)
        try:
            state.consume(t)
        except Exception:  # noqa: BLE001
            return free + [True] * (len(tokens) - i - 1)
    return free


def bfcl_items(data_dir: Path, categories) -> list[tuple[str, dict]]:
    from bench.bfcl import load_questions

    items = []
    for cat in categories:
        try:
            items += [(cat, r) for r in load_questions(cat, data_dir, split="dev")]
        except FileNotFoundError:
            continue
    return items


def maskbench_items(data_dir: Path, max_schema_chars: int, max_instances: int) -> list[dict]:
    items = []
    for name in MASKBENCH_FILES:
        path = data_dir / f"{name}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            schema = row.get("schema")
            inst = [t["data"] for t in row.get("tests", []) if t.get("valid") and isinstance(t.get("data"), dict)]
            if not isinstance(schema, dict) or not inst or len(json.dumps(schema)) > max_schema_chars:
                continue
            items.append({"id": f"maskbench/{name}/{row['id']}", "schema": schema, "instances": inst[:max_instances]})
    return items


def jsonschemabench_items(data_dir: Path, max_schema_chars: int) -> list[dict]:
    """Object schemas of the shared JSONSchemaBench first halves (``*.first_half.jsonl``), up to
    ``max_schema_chars`` of JSON each."""
    items = []
    for path in sorted(data_dir.glob("*.first_half.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            schema = row.get("schema")
            if (not isinstance(schema, dict) or schema.get("type", "object") != "object"
                    or len(json.dumps(schema)) > max_schema_chars):
                continue
            items.append({"id": f"jsonschemabench/{row['subset']}/{row['id']}", "schema": schema})
    return items


def schema_tool(item: dict):
    """``(tool, user message)`` for a MaskBench / JSONSchemaBench schema item."""
    from schemas import Tool

    name = item["id"].rsplit("/", 1)[-1].replace("-", "_").replace(".", "_")[:48]
    tool = Tool.from_schema(name, item["schema"], description=str(item["schema"].get("description", "")),
                            strict=False)
    user = item["schema"].get("title") or item["schema"].get("description") or f"Use {name}."
    return tool, {"role": "user", "content": str(user)[:300]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", required=True, help="directory for the shards")
    ap.add_argument("--seconds", type=float, default=2400, help="wall-clock budget; stops cleanly when spent")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--max-prompt-tokens", type=int, default=1400, help="skip longer prompts")
    ap.add_argument("--max-schema-chars", type=int, default=1500)
    ap.add_argument("--max-instances", type=int, default=3)
    ap.add_argument("--shard-size", type=int, default=200)
    ap.add_argument("--sources", default=",".join(SOURCES),
                    help=f"comma-separated, in priority order (of {', '.join(SOURCES)})")
    ap.add_argument("--skip-items", type=int, default=0, help="skip the first N items of the plan")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sources = [x.strip() for x in args.sources.split(",") if x.strip()]
    if unknown := sorted(set(sources) - set(SOURCES)):
        ap.error(f"--sources: unknown {unknown}; choose from {list(SOURCES)}")
    torch.set_num_threads(args.threads)
    t_start = time.time()
    from bench.bfcl import MAX_DECIMALS, MAX_STRING_LENGTH, bfcl_turn
    from agent.formats import make_format
    from decoding import Generator, load_model

    loaded = load_model(args.model)
    gen = Generator(loaded)
    fmt = make_format(loaded.tokenizer)
    eos = loaded.tokenizer.eos_token_id
    vocab = loaded.model.config.vocab_size
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pf = PrefixForward(loaded, args.topk)
    shard: list[dict] = []
    totals = {"sequences": 0, "tokens": 0, "answer_tokens": 0, "free_answer_tokens": 0, "fed_tokens": 0,
              "by_kind": {}, "skipped": 0, "shards": 0}

    def flush():
        if shard:
            torch.save(shard, out / f"shard{totals['shards']:04d}.pt")
            totals["shards"] += 1
            shard.clear()

    def add(rec: dict):
        shard.append(rec)
        n, a = len(rec["tokens"]), int(rec["answer"].sum())
        totals["sequences"] += 1
        totals["tokens"] += n
        totals["answer_tokens"] += a
        totals["free_answer_tokens"] += int(rec["free"].sum())
        k = totals["by_kind"].setdefault(rec["kind"], {"sequences": 0, "answer_tokens": 0})
        k["sequences"] += 1
        k["answer_tokens"] += a
        if len(shard) >= args.shard_size:
            flush()

    rng = random.Random(args.seed)
    calls = bfcl_items(SHARED / "bfcl", BFCL_CALL_CATEGORIES)  # category order kept (priority)
    longs = bfcl_items(SHARED / "bfcl", BFCL_LONG_CATEGORIES)
    rng.shuffle(longs)
    texts = bfcl_items(SHARED / "bfcl", BFCL_TEXT_CATEGORIES)
    rng.shuffle(texts)
    masks = maskbench_items(SHARED / "maskbench", args.max_schema_chars, args.max_instances)
    rng.shuffle(masks)
    jsbs = jsonschemabench_items(SHARED / "jsonschemabench", args.max_schema_chars)
    rng.shuffle(jsbs)
    by_source = {"bfcl": [("bfcl", x) for x in calls], "maskbench": [("maskbench", x) for x in masks],
                 "jsonschemabench": [("jsonschemabench", x) for x in jsbs],
                 "bfcl_long": [("bfcl", x) for x in longs], "bfcl_text": [("bfcl", x) for x in texts]}
    # the order is the priority when the budget runs out
    plan = [x for src in sources for x in by_source[src]][args.skip_items:]
    print(f"plan ({', '.join(sources)}; {args.skip_items} skipped): {len(calls)} + {len(longs)} BFCL dev call "
          f"questions, {len(masks)} MaskBench schemas, {len(jsbs)} JSONSchemaBench schemas, {len(texts)} BFCL dev "
          f"irrelevance questions; {len(plan)} items to go", flush=True)
    done = 0
    next_item = args.skip_items + len(plan)  # where a later run continues (--skip-items)
    for i, (source, item) in enumerate(plan):
        if time.time() - t_start > args.seconds:
            print("budget spent", flush=True)
            next_item = args.skip_items + i
            break
        try:
            if source == "bfcl":
                cat, row = item
                turn = bfcl_turn(row, cat)
                prompt = turn.prompt_ids(loaded.tokenizer, fmt)
                if len(prompt) > args.max_prompt_tokens:
                    totals["skipped"] += 1
                    continue
                grammar = turn.grammar(fmt=fmt, max_string_length=MAX_STRING_LENGTH, max_decimals=MAX_DECIMALS)
                meta = {"group": row["id"], "category": cat}
                last = pf.start(prompt)
                budget = 48 if cat in BFCL_TEXT_CATEGORIES else args.max_new_tokens
                toks, free = greedy_turn(pf, gen.new_state(grammar), last, eos, budget)
                add(pf.record(len(prompt), free, toks, kind="greedy", **meta))
                if turn.ground_truth and cat not in BFCL_TEXT_CATEGORIES:
                    ans = answer_ids(fmt, turn.messages, turn.tools, prompt, truth_calls(turn.ground_truth), eos)
                    if ans and ans[:-1] != toks:
                        pf.crop(len(prompt))
                        pf.extend(ans)
                        add(pf.record(len(prompt), forced_flags(gen.new_state, grammar, ans, vocab), None,
                                      kind="truth", **meta))
            elif source == "jsonschemabench":
                tool, message = schema_tool(item)
                prompt = fmt.render([message], [tool])
                if len(prompt) > args.max_prompt_tokens:
                    totals["skipped"] += 1
                    continue
                grammar = fmt.turn_grammar([tool], "required", parallel=False, max_string_length=MAX_STRING_LENGTH,
                                           max_decimals=MAX_DECIMALS)
                last = pf.start(prompt)
                toks, free = greedy_turn(pf, gen.new_state(grammar), last, eos, args.max_new_tokens)
                add(pf.record(len(prompt), free, toks, kind="greedy", group=item["id"], category="jsonschemabench"))
            else:
                tool, message = schema_tool(item)
                name, messages = tool.name, [message]
                prompt = fmt.render(messages, [tool])
                if len(prompt) > args.max_prompt_tokens:
                    totals["skipped"] += 1
                    continue
                try:
                    grammar = fmt.turn_grammar([tool], "required", parallel=False, max_string_length=None,
                                               max_decimals=None)
                except Exception:  # noqa: BLE001 - flags only; the instance is still a sequence
                    grammar = None
                pf.start(prompt)
                for inst in item["instances"]:
                    ans = answer_ids(fmt, messages, [tool], prompt, [{"name": name, "arguments": inst}], eos)
                    if not ans:
                        continue
                    pf.crop(len(prompt))
                    pf.extend(ans)
                    free = forced_flags(gen.new_state, grammar, ans, vocab) if grammar else [True] * len(ans)
                    add(pf.record(len(prompt), free, None, kind="instance", group=item["id"], category="maskbench"))
        except Exception as e:  # noqa: BLE001 - one odd row must not end the run; counted
            totals["skipped"] += 1
            print(f"skip {source} {item[1]['id'] if source == 'bfcl' else item['id']}: {type(e).__name__}: "
                  f"{str(e)[:160]}", flush=True)
            pf.lm.reset()
            pf.tokens, pf.hidden, pf.ids, pf.vals = [], [], [], []
            continue
        done += 1
        if done % 25 == 0:
            el = time.time() - t_start
            print(f"{done} items, {totals['sequences']} sequences, {totals['tokens']} tokens "
                  f"({totals['answer_tokens']} answer, {totals['free_answer_tokens']} free), fed {pf.fed}, "
                  f"{el:.0f} s, {pf.fed / el:.0f} fed tok/s", flush=True)
    flush()
    totals["fed_tokens"] = pf.fed
    totals["seconds"] = round(time.time() - t_start)
    totals["items_done"] = done
    totals["skip_items"] = args.skip_items
    totals["next_item"] = next_item
    totals["command"] = "python scripts/mtp_data.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "summary.json").write_text(json.dumps(totals, indent=2) + "\n")
    print(json.dumps(totals), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
