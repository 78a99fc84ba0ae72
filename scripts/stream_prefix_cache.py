"""Consecutive ``Agent.stream`` calls and the prefix cache (docs/benchmarks.md, "Streams reuse the prefix cache").

Streams the same question three times on the default model (llama.cpp, one thread) and prints each stream's time
and how many prompt tokens came from the KV cache.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python scripts/stream_prefix_cache.py``
"""
import time
from agent import Agent
def get_weather(city: str) -> str:
    """Weather in a city."""
    return "sunny"
a = Agent(model="qwen2.5-coder-0.5b", tools=[get_weather], backend="llamacpp", threads=1, max_steps=1)
for i in range(3):
    t0 = time.perf_counter()
    ev = list(a.stream("What is the weather in Paris?", tool_choice="required"))
    r = ev[-1].result
    print(i, f"{time.perf_counter()-t0:.2f}s", "prompt", r.stats.prompt_tokens, "cached", r.stats.prompt_tokens_cached)
