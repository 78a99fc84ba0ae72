"""Tools for ``python -m agent run --tools examples.my_tools:TOOLS "..."``."""
from pydantic import BaseModel


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First addend.
        b: Second addend.
    """
    return a + b


class SendEmail(BaseModel):
    """Send an email (call-only: the agent returns the validated call to you)."""

    to: str
    subject: str


TOOLS = [add, SendEmail]
