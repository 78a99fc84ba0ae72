"""Where a several-call turn ends when the model's own end is not trusted.

Small models asked for several calls (``parallel_tool_calls=True``) end their turn after two calls where three or
four are asked for: Qwen2.5-Coder-0.5B's end-of-generation logit after ``</tool_call>\\n`` is 20–27 above
``<tool_call>``'s whether or not more calls are wanted (dev split, docs/benchmarks.md "Several calls in one turn"),
so no threshold on it can tell. With the end masked the model goes on writing calls; the right ones come first,
and what follows them either repeats an earlier call or recombines or invents values. :class:`ParallelCallsEnd`
ends the turn there, from the calls alone:

* **repeat**: the first call equal to an earlier one ends the turn (it is dropped: no call is returned twice);
* **nothing new from the conversation** (only where the model's end is masked: ``context`` given): a call past
  the first ``free_calls`` must bring a value no earlier call has that is not a boolean or null, and every value
  no earlier call has must be written in the conversation (``agent.grounding.Grounding``); the first call that
  does not ends the turn and is dropped; a call still being written ends it as soon as one of its finished
  values is such a value (the whole call would end it too), so a runaway invented value (a list of made-up names
  until the budget) cannot cut the turn;
* **cap**: the turn holds ``max_calls`` calls.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

from .formats import ToolFormat
from .grounding import Grounding, leaf_values, number_key


def _value_key(value: Any) -> str:
    """What makes two scalar values the same value (numbers by ``agent.grounding.number_key``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"n:{number_key(value)}"
    return json.dumps(value)


def _value_keys(calls: list[dict]) -> set[str]:
    """The keys (:func:`_value_key`) of every scalar the arguments of ``calls`` hold."""
    return {_value_key(v) for c in calls for v in leaf_values(c.get("arguments"))}


# JSON tokens of a call being written: strings, numbers, literals and punctuation (whitespace between)
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null|[\[\]{}:,]|\s+')


def finished_values(partial: str) -> Iterator[Any]:
    """The scalar argument values a call still being written has finished: those after its ``"arguments"`` key
    that a ``,``, ``]`` or ``}`` follows (a number or string at the end of the text may still grow; keys, followed
    by ``:``, are not values)."""
    i = partial.find('"arguments"')
    if i < 0:
        return
    tokens = [m.group() for m in _JSON_TOKEN.finditer(partial, i + len('"arguments"')) if not m.group().isspace()]
    for tok, nxt in zip(tokens, tokens[1:]):
        if nxt in (",", "]", "}") and tok not in ("[", "]", "{", "}", ":", ","):
            try:
                yield json.loads(tok)
            except ValueError:
                return


def brings_new_values(call: dict, earlier: list[dict], grounding: Grounding) -> bool:
    """Whether ``call`` holds a value no call of ``earlier`` has that is not a boolean or null, and every value no
    earlier call has is in ``grounding``. The tool's name does not count: a call of another tool with values
    already used is what the models add unasked (dev split: counting a new tool as new took Qwen2.5-Coder-0.5B's
    parallel_multiple from 19 to 16 of 30, the 1.5B's from 11 to 8 of 12); so a call without arguments past the
    second ends the turn."""
    seen = _value_keys(earlier)
    new = [v for v in leaf_values(call.get("arguments")) if _value_key(v) not in seen]
    return any(v is not None and not isinstance(v, bool) for v in new) and all(v in grounding for v in new)


class ParallelCallsEnd:
    """The end rule of a several-call turn (module docstring), passed to ``Generator.generate(stop_when=…)``.

    The decode stops at the first committed step whose text completes the call that ends the turn (or finishes one
    of its unwritten new values), so its token count (``stats``) includes the dropped call's text and whatever that
    step committed past it: a speculative step may commit more than one token per forward, so counts differ between
    drafters while the kept text does not.
    Streamed text (``on_text``) stops before that step; the start of the dropped call may have been streamed.

    Args:
        fmt: the tool format (its ``complete_calls`` / ``calls_text``).
        max_calls: the most calls the turn keeps.
        context: the conversation's text (:func:`conversation_text`) where the model's end is masked, so that a
            call bringing nothing new from it ends the turn; None: only the repeat and the cap end it (the model
            ends it otherwise).
        free_calls: the first calls kept whatever values they hold (the several-call layout asks for two).
    Attributes:
        text: the turn's text to keep once the rule fired (the calls before the one that ended it, or the first
            ``max_calls``, closed as the format needs); None while it has not.
    """

    def __init__(self, fmt: ToolFormat, max_calls: int, *, context: str | None = None, free_calls: int = 2):
        self.fmt, self.max_calls, self.free_calls = fmt, max_calls, free_calls
        self.grounding = Grounding(context) if context is not None else None
        self.text: str | None = None
        self._ends: list[bool] = []  # per whole call so far: does it end the turn (memoised: checked every step)
        self._seen: list[dict] = []

    def _ends_turn(self, calls: list[dict], i: int) -> bool:
        return calls[i] in calls[:i] or (self.grounding is not None and i >= self.free_calls
                                         and not brings_new_values(calls[i], calls[:i], self.grounding))

    def __call__(self, text: str) -> bool:
        found = self.fmt.complete_calls(text)
        calls = [c for c, _ in found]
        if len(self._ends) > len(calls) or any(calls[i] != c for i, c in enumerate(self._seen)):
            self._ends = []  # another text than the one seen before (the final check): judge it afresh
        self._ends += [self._ends_turn(calls, i) for i in range(len(self._ends), len(calls))]
        self._seen = calls
        keep = next((i for i in range(1, len(calls)) if self._ends[i]), None)
        if keep is None and len(calls) >= self.max_calls:
            keep = self.max_calls
        if keep is None and self.grounding is not None and len(calls) >= max(self.free_calls, 1):
            # the call being written holds a finished value no earlier call has and the conversation does not
            # write: whole, it would end the turn (brings_new_values); end it now
            seen = _value_keys(calls)
            partial = text[found[-1][1]:] if found else text
            if any(_value_key(v) not in seen and v not in self.grounding for v in finished_values(partial)):
                keep = len(calls)
        if keep is None:
            return False
        self.text = self.fmt.calls_text(text, found[keep - 1][1])
        return True
