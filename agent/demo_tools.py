"""Three example tools for ``python -m agent demo``: weather from a local table, a calculator, a unit converter.

Each argument carries the constraints a careful user would give, so the grammar can enforce them: the city is one
of the table's (enum), the expression is arithmetic characters only (pattern, at most 64), the length is bounded.
"""
from __future__ import annotations

import ast
import operator
from typing import Annotated, Literal

from pydantic import Field

WEATHER = {
    "paris": {"temperature_c": 18, "condition": "cloudy"},
    "london": {"temperature_c": 14, "condition": "rain"},
    "tokyo": {"temperature_c": 24, "condition": "sunny"},
    "new york": {"temperature_c": 21, "condition": "windy"},
}


def get_weather(city: Literal["Paris", "London", "Tokyo", "New York"],
                unit: Literal["celsius", "fahrenheit"] = "celsius") -> dict:
    """Get the current weather in a city.

    Args:
        city: The city name.
        unit: Temperature unit.
    """
    row = WEATHER.get(city.strip().lower())
    if row is None:
        raise ValueError(f"no weather data for {city!r}; known cities: {', '.join(sorted(WEATHER))}")
    t = row["temperature_c"]
    return {"city": city, "temperature": t if unit == "celsius" else round(t * 9 / 5 + 32, 1), "unit": unit,
            "condition": row["condition"]}


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.Mod: operator.mod}


def calculate(expression: Annotated[str, Field(pattern=r"^[0-9 +*/%().-]{1,64}$")]) -> float:
    """Evaluate an arithmetic expression with + - * / ** % and parentheses.

    Args:
        expression: The arithmetic expression, digits and operators only.
    """
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")
    return ev(ast.parse(expression, mode="eval"))


# Unit names as a user writes them: with abbreviations ("km", "ft") Qwen2.5-Coder-0.5B answered "How many feet are
# in 5 km?" with calculate("5 * 1000.0") and "5000.0 feet"; with these names and this tool name it calls the converter.
_LENGTH_M = {"meters": 1.0, "kilometers": 1000.0, "centimeters": 0.01, "millimeters": 0.001, "miles": 1609.344,
             "feet": 0.3048, "inches": 0.0254}
LengthUnit = Literal["meters", "kilometers", "centimeters", "millimeters", "miles", "feet", "inches"]


def convert_length(value: Annotated[float, Field(ge=0, le=1e9)], from_unit: LengthUnit, to_unit: LengthUnit) -> dict:
    """Convert a length from one unit to another, e.g. kilometers to feet.

    Args:
        value: The length to convert, in from_unit.
        from_unit: The unit of the value.
        to_unit: The unit to convert to.
    """
    return {"value": round(value * _LENGTH_M[from_unit] / _LENGTH_M[to_unit], 6), "unit": to_unit}


TOOLS = [get_weather, calculate, convert_length]
PROMPTS = [
    "What's the weather like in Tokyo right now?",
    "What is (17 + 25) * 3?",
    "How many feet are in 5 km?",
]
