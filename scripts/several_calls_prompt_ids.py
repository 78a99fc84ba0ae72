"""Do the prompts of several-call turns render as they were measured? (docs/benchmarks.md, "An example of several
calls in the prompt".) The dev runs that chose ``SEVERAL_CALLS_EXAMPLE`` encoded message text with the plain-text
encoder of before ``b717ea4``, which left non-special added tokens such as ``<tool_call>`` whole; the example is the
format's own text, so the product encodes its markers as control tokens (``encode_chat(format_suffix=…)``). This
re-encodes every several-call BFCL prompt (dev and test; parallel, parallel_multiple and the live ones) both ways
and counts the identical ones.

Usage: ``python scripts/several_calls_prompt_ids.py``
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers import Tokenizer  # noqa: E402

import agent.formats.base as base  # noqa: E402
from agent.engine import LocalEngine  # noqa: E402
from agent.formats.base import openai_tools, template_chat  # noqa: E402
from bench.bfcl import bfcl_turn, load_questions  # noqa: E402


def main() -> int:
    fmt = LocalEngine("qwen2.5-coder-0.5b", backend="llamacpp", threads=1).format
    measured = Tokenizer.from_str(fmt.tokenizer.backend_tokenizer.to_str())
    measured.encode_special_tokens = True  # the encoder of the dev runs: added tokens with special=False kept whole
    same = differ = 0
    for split in ("dev", "test"):
        for category in ("parallel", "parallel_multiple", "live_parallel", "live_parallel_multiple"):
            for row in load_questions(category, None, None, split):
                turn = bfcl_turn(row, category)
                now = fmt.render(turn.messages, turn.tools, several=True)
                product = base.plain_text_encoder
                base.plain_text_encoder = lambda _tok: (lambda text: measured.encode(text,
                                                                                     add_special_tokens=False).ids)
                try:
                    then = fmt.encode_chat(fmt._with_several_calls_example(template_chat(turn.messages)),
                                           tools=openai_tools(turn.tools))
                finally:
                    base.plain_text_encoder = product
                same += now == then
                differ += now != then
                if now != then:
                    print("differs:", row["id"])
    print(f"identical {same}, different {differ}")
    return 0 if differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
