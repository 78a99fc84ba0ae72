"""Does a prompt's cached prefix survive an unrelated request on a batching server? (docs/benchmarks.md, "The
prefix cache under --max-batch".) Times a 250-token tool-call request A alone, then A after each of: an unrelated
47-token request B completed, B again, and B streamed and dropped by its client after 2 s. Each line: seconds and
``prompt_tokens_details.cached_tokens`` of A.

Usage (a server on 127.0.0.1:8123)::

    python -m agent serve --threads 1 --port 8123 --max-batch 4 &
    python scripts/batch_prefix_keep.py [--url http://127.0.0.1:8123]
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.request

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
               "type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
A = {"model": "default", "messages": [{"role": "user", "content": "What's the weather in Tokyo?"}],
     "tools": [WEATHER, ADD], "tool_choice": "required", "temperature": 0, "max_tokens": 32}
B = {"model": "default", "messages": [{"role": "user", "content": "Write a very long story about a dragon, at least "
                                                                  "1000 words."}], "temperature": 0, "max_tokens": 40}


def post(url: str, body: dict):
    """An open HTTP response to ``body`` POSTed as JSON."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=300)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8123")
    url = ap.parse_args().url + "/v1/chat/completions"

    def timed(label: str) -> None:
        t = time.monotonic()
        with post(url, A) as r:
            usage = json.load(r)["usage"]
        print(f"{label}: {time.monotonic() - t:.2f} s, cached_tokens "
              f"{usage['prompt_tokens_details']['cached_tokens']} of {usage['prompt_tokens']}")

    timed("A alone (cold)")
    post(url, B).read()
    timed("A after B")
    post(url, B).read()
    timed("A after B again")
    with post(url, {**B, "stream": True, "max_tokens": 1500}) as r:
        t = time.monotonic()
        while r.readline() and time.monotonic() - t < 2:
            pass
    time.sleep(0.3)
    timed("A after B streamed, dropped at 2 s")


if __name__ == "__main__":
    main()
