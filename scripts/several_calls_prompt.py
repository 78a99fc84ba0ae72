"""What the prompt of a several-call turn says (dev split only): the bfcl command with the product's own example
of several calls (``agent.formats.hermes.SEVERAL_CALLS_EXAMPLE``) replaced by a variant.

Variants (``--variant``), each added to the system message of every question asked for several calls (a system
message holding Qwen2.5's default text where the question has none, as the product does):

* ``none``: nothing (the prompt before the example);
* ``instruction``: an instruction to make one call per thing asked, without an example;
* ``weather``: the instruction and a worked example (two cities' weather, one city's time);
* ``stocks``: the same with another example (two companies' stock price, one company's news) — what the product
  adds (``SEVERAL_CALLS_EXAMPLE``).

Usage (every other argument goes to ``python -m agent bfcl``)::

    python scripts/several_calls_prompt.py --variant weather --model qwen2.5-coder-0.5b --backend llamacpp \\
        --threads 1 --split dev --limit 50 --category parallel_multiple,parallel

docs/benchmarks.md, "An example of several calls in the prompt".
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.bfcl as bfcl  # noqa: E402
from agent.__main__ import main  # noqa: E402
from agent.formats.hermes import SEVERAL_CALLS_EXAMPLE, HermesFormat  # noqa: E402

BASE = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
ASK = "The user may ask for several things in one message. Make one function call for each of them."
VARIANTS = {
    "none": None,
    "instruction": "The user may ask for several things in one message. Make one function call for each of them: "
                   "call a function once for every value it is asked about (each place, year, item or person), "
                   "and call every function the request needs.",
    "weather": ASK + " For example, for \"What is the weather in Paris and in Rome, and the local time in Paris?\" "
               "with functions get_weather(city) and get_time(city), answer:\n"
               "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
               "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>\n"
               "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "stocks": SEVERAL_CALLS_EXAMPLE,
}


def with_variant(text: str | None):
    """``bench.bfcl.bfcl_turn`` adding ``text`` to the system message of questions asked for several calls."""
    plain = bfcl.bfcl_turn

    def turn(row: dict, category: str):
        t = plain(row, category)
        if t.parallel and text is not None:
            if t.messages and t.messages[0]["role"] == "system":
                first = {"role": "system", "content": t.messages[0]["content"] + "\n\n" + text}
                t.messages = [first] + t.messages[1:]
            else:
                t.messages = [{"role": "system", "content": BASE + "\n\n" + text}] + t.messages
        return t
    return turn


if __name__ == "__main__":
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--variant", choices=list(VARIANTS), required=True)
    args, rest = ap.parse_known_args()
    HermesFormat._with_several_calls_example = lambda self, chat: chat  # the product's own example off
    bfcl.bfcl_turn = with_variant(VARIANTS[args.variant])
    sys.exit(main(["bfcl"] + rest))
