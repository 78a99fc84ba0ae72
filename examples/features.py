"""Every agent feature on the default model, one runnable example each.

    .venv/bin/python examples/features.py
"""
import time

from pydantic import BaseModel

from agent import Agent
from agent.demo_tools import TOOLS, calculate, get_weather


def banner(title):
    print(f"\n=== {title}")


agent = Agent(tools=TOOLS, max_steps=3, tool_timeout=5.0, max_string_length=48, max_decimals=6)

banner("multi-step loop: call -> result -> answer; the transcript is OpenAI-style")
res = agent.run("What's the weather in Paris?", tool_choice="required")
for m in res.messages:
    print(" ", m["role"], m.get("tool_calls") or m.get("content"))

banner("tool_choice: auto / required / {'name': ...} / none (enforced by the grammar)")
for choice in ["auto", "required", {"name": "calculate"}, "none"]:
    r = agent.run("What is 12 times 7?", tool_choice=choice, max_new_tokens=48, max_steps=1)
    print(f"  {choice!s:24} -> {[c.call.name for c in r.tool_calls] or repr((r.final_answer or '')[:60])}")

banner("parallel calls in one turn (an array of calls; thread-safe tools run concurrently, results in order)")
msgs = [{"role": "user", "content": "Weather in Paris and in Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"temperature": 18}'},
        {"role": "tool", "tool_call_id": "call_b", "content": '{"temperature": 24}'}]
print("  a prior turn with two calls, fed back as messages ->", agent.run(msgs, max_new_tokens=48).final_answer)


class Forecast(BaseModel):
    city: str
    temperature_c: float
    sunny: bool


banner("structured final output: response_format=PydanticModel -> a validated instance")
r = agent.run("Tokyo is 24 degrees and sunny. Fill in the forecast.", tool_choice="none", response_format=Forecast)
print("  ", repr(r.output))

banner("streaming events")
for ev in Agent(tools=[get_weather]).stream("Weather in London?", tool_choice="required", max_new_tokens=64):
    if ev.type == "token":
        print(ev.text, end="", flush=True)
    elif ev.type == "discard":  # the turn is decoded again: the text above is void
        print("\n  [decoded again]")
    elif ev.type == "tool_call_started":
        print(f"\n  [tool_call_started {ev.call.name} {ev.call.arguments}]")
    elif ev.type == "tool_call_finished":
        print(f"  [tool_call_finished -> {ev.record.result or ev.record.error}]")
    elif ev.type == "done":
        print(f"\n  [done: {ev.result.stats.tokens_per_forward:.2f} tokens/forward]")

banner("batches and threads: run_batch keeps order; each run has its own caches and grammar state")
t = time.perf_counter()
batch = agent.run_batch(["What is 2+2?", "Weather in Tokyo?"], max_workers=2, tool_choice="required", max_steps=1)
print("  ", [[c.call.name for c in r.tool_calls] for r in batch], f"{time.perf_counter() - t:.1f} s")

banner("limits: per-turn max_new_tokens, total token budget, per-tool timeout")
r = Agent(tools=[calculate]).run("What is 3+4?", tool_choice="required", max_new_tokens=5)
print("  cut mid-call -> truncated:", r.truncated, "calls:", r.tool_calls)
r = agent.run("Weather in Paris?", tool_choice="required", max_total_tokens=40)
print("  total budget 40 ->", r.stats.new_tokens, "tokens, truncated:", r.truncated)
