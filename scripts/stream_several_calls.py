"""Several-call streams and the ``discard`` event (docs/benchmarks.md, "Several-call streams without a discard").

Streams four questions that ask for several calls (``parallel_tool_calls=True``) on the default model (llama.cpp,
one thread) and prints, per stream, the ``discard`` events, the ``token`` events, the calls returned, and whether the
``token`` text after the last ``discard`` is the turn's decoded text.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python scripts/stream_several_calls.py``
"""
from agent import Agent


def get_weather(city: str) -> str:
    """Current weather.

    Args:
        city: the city
    """
    return f"sunny in {city}"


def get_time(city: str) -> str:
    """Local time.

    Args:
        city: the city
    """
    return "12:00"


agent = Agent(model="qwen2.5-coder-0.5b", tools=[get_weather, get_time], backend="llamacpp", threads=1)
QUESTIONS = ("What is the weather in Paris, London and Tokyo?", "Weather and local time in Berlin and in Rome, please.",
             "Get the weather for Oslo, Madrid, Lisbon and Vienna.", "What time is it in Sydney and in Toronto?")
for question in QUESTIONS:
    events = list(agent.stream(question, tool_choice="required", parallel_tool_calls=True, max_steps=1))
    kinds = [e.type for e in events]
    text: list[str] = []
    for e in events:
        if e.type == "discard":
            text.clear()
        elif e.type == "token":
            text.append(e.text)
    result = events[-1].result
    print(f"{question[:45]:45s} discards={kinds.count('discard')} tokens={kinds.count('token')} "
          f"calls={len(result.tool_calls)} text_is_the_turn={''.join(text) == result.raw_turns[-1]}")
