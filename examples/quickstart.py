"""Register typed Python functions, run the agent, read validated calls and the answer.

    .venv/bin/python examples/quickstart.py
"""
from typing import Literal

from agent import Agent


def get_stock_price(ticker: str, currency: Literal["USD", "EUR"] = "USD") -> dict:
    """Get the latest price of a stock.

    Args:
        ticker: Stock ticker symbol, e.g. AAPL.
        currency: Currency of the price.
    """
    prices = {"AAPL": 231.5, "MSFT": 415.2}
    return {"ticker": ticker, "price": prices.get(ticker.upper(), 100.0), "currency": currency}


agent = Agent(tools=[get_stock_price])  # default model Qwen2.5-Coder-0.5B-Instruct, drafter auto
result = agent.run("What is the price of AAPL in USD?", tool_choice="required")
for rec in result.tool_calls:
    print("call:", rec.call.name, rec.call.arguments, "->", rec.result)
print("answer:", result.final_answer)
print(f"{result.stats.tokens_per_s:.1f} tok/s, {result.stats.tokens_per_forward:.2f} tokens per target forward")
