"""Chains of calls with the default model, stepped by the caller (README, Limitations; docs/benchmarks.md "Chains
of calls, stepped"). Three two-step requests over four tools: each is run with ``tool_choice="required"`` and
``max_steps=1`` (the first call), again on the returned messages with ``"required"`` (the second call: a turn that
must call lists the tools), then once more under ``"auto"`` for the answer. Prints each step's calls and the answer.

    python scripts/chain_steps.py [--model qwen2.5-coder-0.5b] [--threads 1]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent import Agent  # noqa: E402


def get_user_city(username: str) -> str:
    """Find the city a user lives in.

    Args:
        username: The user's login name.
    """
    return "Lisbon"


def get_weather(city: str) -> dict:
    """Get the current weather in a city.

    Args:
        city: The city name.
    """
    return {"city": city, "temperature": 21}


def convert_currency(amount: float, from_currency: str, to_currency: str) -> float:
    """Convert money between currencies.

    Args:
        amount: The amount.
        from_currency: ISO code to convert from.
        to_currency: ISO code to convert to.
    """
    return round(amount * 1.1, 2)


def get_price(item: str) -> dict:
    """Price of an item in euros.

    Args:
        item: The item name.
    """
    return {"item": item, "price_eur": 120.0}


REQUESTS = ["Find alice's city, then get the weather there.",
            "What does a bike cost in US dollars? Look up its price, then convert it.",
            "Where does bob live, and what's the weather in his city?"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    agent = Agent(args.model, tools=[get_user_city, get_weather, convert_currency, get_price], threads=args.threads,
                  max_steps=1)
    for prompt in REQUESTS:
        first = agent.run(prompt, tool_choice="required")
        second = agent.run(first.messages, tool_choice="required")
        answer = agent.run(second.messages)
        print(prompt)
        for label, res in (("step 1", first), ("step 2", second)):
            print(f"  {label}: {[(r.call.name, r.call.arguments) for r in res.tool_calls]}")
        print(f"  answer: {answer.final_answer!r} ({answer.stop_reason})")


if __name__ == "__main__":
    main()
