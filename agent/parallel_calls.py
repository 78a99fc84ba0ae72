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
  until the budget) cannot cut the turn; the turn's first call of a tool the user's request names
  (``named``: ``agent.grounding.named_tools``) is the exception, since it is asked for even with values already
  used ("the median and variance of 3,4,5,2,8,5, and the mode");
* **cap**: the turn holds ``max_calls`` calls.

After the decode, :func:`with_written_list_items` completes a turn where several calls were asked for over a list
of numbers the user's last message writes: where the calls of one tool differ only in one argument, each holding
an item of the list, a call is added per item no call of the tool holds (the model asked for "a loan term of 15,
20 and 30 years" writes the 15-year call and then repeats it), and :func:`with_shared_list_split` shares out a
list every call of a tool holds by where each item is written; where the message says "respectively",
:func:`with_respective_pairs` drops the calls that pair two written lists other than item by item
(:func:`with_written_lists` applies the three).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Iterator

from schemas import Tool, ToolCallError

from .formats import ToolFormat
from .grounding import Grounding, leaf_values, number_key, plain_text, written_at, written_number_lists


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


def new_values(call: dict, earlier: list[dict]) -> list[Any]:
    """The scalar argument values of ``call`` that no call of ``earlier`` has (by :func:`_value_key`)."""
    seen = _value_keys(earlier)
    return [v for v in leaf_values(call.get("arguments")) if _value_key(v) not in seen]


def brings_new_values(call: dict, earlier: list[dict], grounding: Grounding) -> bool:
    """Whether ``call`` holds a value no call of ``earlier`` has that is not a boolean or null, and every value no
    earlier call has is in ``grounding``. The tool's name does not count: a call of another tool with values
    already used is what the models add unasked (dev split: counting a new tool as new took Qwen2.5-Coder-0.5B's
    parallel_multiple from 19 to 16 of 30, the 1.5B's from 11 to 8 of 12); so a call without arguments past the
    second ends the turn."""
    new = new_values(call, earlier)
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
        named: the tools the user's request names (``agent.grounding.named_tools``): the first call of one of them
            goes on with values already used (it is asked for), where another call bringing nothing new ends the
            turn.
    Attributes:
        text: the turn's text to keep once the rule fired (the calls before the one that ended it, or the first
            ``max_calls``, closed as the format needs); None while it has not.
    """

    def __init__(self, fmt: ToolFormat, max_calls: int, *, context: str | None = None, free_calls: int = 2,
                 named: frozenset[str] = frozenset()):
        self.fmt, self.max_calls, self.free_calls, self.named = fmt, max_calls, free_calls, named
        self.grounding = Grounding(context) if context is not None else None
        self.text: str | None = None
        self._ends: list[bool] = []  # per whole call so far: does it end the turn (memoised: checked every step)
        self._seen: list[dict] = []

    def _ends_turn(self, calls: list[dict], i: int) -> bool:
        return calls[i] in calls[:i] or (self.grounding is not None and i >= self.free_calls
                                         and not brings_new_values(calls[i], calls[:i], self.grounding)
                                         and not self._first_of_named(calls, i))

    def _first_of_named(self, calls: list[dict], i: int) -> bool:
        """Whether ``calls[i]`` is the turn's first call of a tool the request names (``named``), holding no value
        the conversation does not write."""
        name = calls[i].get("name")
        return (name in self.named and all(c.get("name") != name for c in calls[:i])
                and all(v in self.grounding for v in new_values(calls[i], calls[:i])))

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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number_keys(value: Any) -> set:
    """The keys (``number_key``) of every number ``value`` holds at any depth, a string that is only a number
    (``"10"``) too."""
    keys = set()
    for v in leaf_values(value):
        if isinstance(v, str):
            try:
                v = float(v.strip())
            except ValueError:
                continue
            if not math.isfinite(v):
                continue
        if _is_number(v):
            keys.add(number_key(v))
    return keys


def _words(text: str) -> set[str]:
    """The words of ``text`` (an argument's name split at ``_`` and case changes too), lower case, a final "s"
    dropped, three letters or more."""
    return {w.lower().removesuffix("s") for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", text) if len(w) >= 3}


def with_written_list_items(calls: list[dict], tools: list[Tool], text: str, max_calls: int) -> list[dict]:
    """``calls`` (a turn where several calls were asked for) completed over the lists of numbers ``text`` writes
    (the last user message: :func:`agent.grounding.written_number_lists`, "for 1,5 and 10 years"). A group is the
    calls of one tool whose arguments are equal but for one top-level argument, a number in each; it goes over a
    list where that list is the only one holding all of those numbers, no call of the group holds an item of it
    in another argument (``add(a=1, b=2)`` for "the sum of 1, 2 and 3"), and no other call of the tool holds an
    item of it in that argument. A lone call goes over a list only where its number is the list's first item and
    a word of the argument's name is written beside the list in its sentence (``WrittenList.before``/``after``:
    "a loan term of 15, 20 and 30" for ``loan_term``; not "hour 2. Days 1, 2 and 3" for ``hour``). For each item
    of that list no call of the tool holds anywhere (at any depth; a string that is only a number counts), a call
    is added: the group's last call with that argument set to the item (an integer where that call held one),
    placed before the group's first call of an item later in the list (else after the group), where it validates
    against its tool among ``tools``, until the turn holds ``max_calls`` calls. Qwen2.5-Coder-0.5B asked for
    several calls writes the first item's call and then repeats it, or skips the middle item ("1,5 and 10" → the
    1- and 10-year calls; dev split, docs/benchmarks.md "Items of a written list"). Calls naming a tool not in
    ``tools``, and anything not a call object, are left alone.

    The rule reads text, not meaning: a list the user says to leave ("pages 1, 2 and 3 I have read; show me page
    1") is completed all the same."""
    lists = written_number_lists(text)
    if not lists or len(calls) >= max_calls:
        return calls
    by_name = {t.name: t for t in tools}
    out = list(calls)
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
            continue
        args, tool = call["arguments"], by_name.get(call.get("name"))
        if tool is None:
            continue
        for key, value in args.items():
            if not _is_number(value):
                continue
            same_tool = [c for c in out if isinstance(c, dict) and c.get("name") == call.get("name")
                         and isinstance(c.get("arguments"), dict)]
            group = [c for c in same_tool if c["arguments"].keys() == args.keys() and _is_number(c["arguments"][key])
                     and all(c["arguments"][k] == v for k, v in args.items() if k != key)]
            values = {number_key(c["arguments"][key]) for c in group}
            fits = [x for x in lists if values <= set(x.items)]
            if len(group) == 1:
                fits = [x for x in fits if x.items[0] == number_key(value)
                        and _words(key) & _words(x.before + " " + x.after)]
            if len(fits) != 1:
                continue  # no list, or more than one: no one way to go on
            items = fits[0].items
            if any(_number_keys({k: v for k, v in c["arguments"].items() if k != key}) & set(items) for c in group):
                continue  # the group's calls take other items of the list in other arguments
            if any(c not in group and _is_number(c["arguments"].get(key)) and number_key(c["arguments"][key]) in items
                   for c in same_tool):
                continue  # another call of the tool holds an item there
            held = set().union(*(_number_keys(c["arguments"]) for c in same_tool))
            for item in items:
                if item in held or len(out) >= max_calls:
                    continue
                last = group[-1]["arguments"]
                new = {**group[-1], "arguments": {**last, key: item if isinstance(last[key], int) else float(item)}}
                if not _validates(tool, [new]):
                    continue
                # before the group's first call of an item later in the list, else after the group
                rank = items.index(item)
                later = [out.index(c) for c in group if items.index(number_key(c["arguments"][key])) > rank]
                out.insert(min(later) if later else max(out.index(c) for c in group) + 1, new)
                group.append(new)
                held.add(item)
    return out


def _groups(calls: list[dict], tools: list[Tool]) -> Iterator[tuple[Tool, list[dict]]]:
    """``(tool, calls)`` for each tool of ``tools`` that two or more of ``calls`` call, all with the same argument
    names, in the order of each tool's first call."""
    by_name = {t.name: t for t in tools}
    names = []
    for c in calls:
        if isinstance(c, dict) and isinstance(c.get("arguments"), dict) and isinstance(c.get("name"), str) \
                and c["name"] in by_name and c["name"] not in names:
            names.append(c["name"])
    for name in names:
        group = [c for c in calls if isinstance(c, dict) and c.get("name") == name]
        if len(group) >= 2 and all(isinstance(c.get("arguments"), dict)
                                   and c["arguments"].keys() == group[0]["arguments"].keys() for c in group):
            yield by_name[name], group


def _differing(group: list[dict]) -> list[str]:
    """The top-level arguments whose values differ between the calls ``group`` (one tool, the same argument names:
    :func:`_groups`), in the first call's order."""
    return [k for k in group[0]["arguments"] if len({_value_key(c["arguments"][k]) for c in group}) > 1]


def _validates(tool: Tool, calls: list[dict]) -> bool:
    try:
        for c in calls:
            tool.validate(c["arguments"])
    except ToolCallError:
        return False
    return True


def _shared_out(items: list[str], where: dict[str, list[int]], calls: int,
                owner: Callable[[int], int | None]) -> list[list[str]] | None:
    """Each item given to the call ``owner`` picks for each place it is written; None where an item is written
    nowhere, ``owner`` picks no call for a place, or a call gets no item."""
    given: list[list[str]] = [[] for _ in range(calls)]
    for item in items:
        owners = [owner(p) for p in where[item]]
        if not owners or None in owners:
            return None
        for i in owners:
            if item not in given[i]:
                given[i].append(item)
    return given if all(given) else None


def with_shared_list_split(calls: list[dict], tools: list[Tool], text: str) -> list[dict]:
    """``calls`` (a turn where several calls were asked for) with a list the calls of one tool all hold shared out
    among them by where ``text`` (the last user message) writes each item: where the calls of a tool differ in
    exactly one top-level string argument, a string written once in ``text`` in each call
    (:func:`agent.grounding.written_at`; other arguments may differ where they hold numbers or booleans: "around
    Berkeley within 10 kilometers … one around Tokyo within 5"), and hold the same top-level array of two or
    more strings, each written in
    ``text`` (not only inside another item: "Frozen" in "Frozen II"), every item goes to the call whose string is
    written last before it ("on Netflix for 'Friends', and Hulu for 'The Office' and 'Stranger Things'" →
    ``["Friends"]`` for Netflix, ``["The Office", "Stranger Things"]`` for Hulu; Qwen2.5-Coder-0.5B gave both
    calls all three: dev split, docs/benchmarks.md "A list shared out"), where every item is written after some
    call's string and every call gets one or more items; else, read the other way, to the call whose string is
    written first after it ("Sushi in Seattle and Indian and Korean in Chicago"), where every item is written
    before some call's string and every call gets one; where the calls then validate. Otherwise the calls stand
    ("Friends and The Office on Netflix and Hulu": every item before both strings, Hulu gets none either way).

    The rule reads where words stand, not what they say: "Netflix for 'Friends', and Hulu for 'Dark'; check both
    for 'Lost'" gives 'Lost' to Hulu only."""
    out = list(calls)
    plain = plain_text(text)
    for tool, group in list(_groups(calls, tools)):
        args = group[0]["arguments"]
        differ = _differing(group)
        shared = [k for k in args if isinstance(args[k], list) and len(args[k]) >= 2
                  and all(isinstance(x, str) for x in args[k]) and all(c["arguments"][k] == args[k] for c in group)]
        strings = [k for k in differ if all(isinstance(c["arguments"][k], str) for c in group)]
        # besides the one string that tells the calls apart, only numbers or booleans may differ ("within 10
        # kilometers", "within 5")
        if len(strings) != 1 or len(shared) != 1 or not all(
                all(_is_number(c["arguments"][k]) or isinstance(c["arguments"][k], bool) for c in group)
                for k in differ if k not in strings):
            continue
        key, items = strings[0], args[shared[0]]
        anchors = [written_at(plain, c["arguments"][key], plain=True) if isinstance(c["arguments"][key], str)
                   else [] for c in group]
        if any(len(a) != 1 for a in anchors) or len({a[0] for a in anchors}) != len(anchors):
            continue
        starts = [a[0][0] for a in anchors]
        spans = {item: written_at(plain, item, plain=True) for item in items}
        # an occurrence inside a longer item's ("Frozen" in "Frozen II") is that item's
        where = {item: [p for p, end in spans[item] if not any(q <= p and end <= q_end and (q, q_end) != (p, end)
                                                                for other in items if other != item
                                                                for q, q_end in spans[other])] for item in items}

        def last_before(p: int, starts: list[int] = starts) -> int | None:
            return max((i for i, a in enumerate(starts) if a < p), key=starts.__getitem__, default=None)

        def first_after(p: int, starts: list[int] = starts) -> int | None:
            return min((i for i, a in enumerate(starts) if a > p), key=starts.__getitem__, default=None)

        given = (_shared_out(items, where, len(group), last_before)
                 or _shared_out(items, where, len(group), first_after))
        if given:
            new = [{**c, "arguments": {**c["arguments"], shared[0]: g}} for c, g in zip(group, given)]
            if _validates(tool, new):
                instead = {id(c): n for c, n in zip(group, new)}
                out = [instead.get(id(c), c) for c in out]
    return out


_RESPECTIVELY = re.compile(r"\brespectively\b")
_SENTENCE_END = re.compile(r"[.?!;](?= |$)")
_WORD = re.compile(r"\w+")


def _scalar(value: Any) -> bool:
    return isinstance(value, str) or _is_number(value)


def _respective_pairs(group: list[dict], plain: str, start: int,
                      at: int) -> tuple[list[str], set[tuple[str, str]]] | None:
    """The two arguments the calls ``group`` of one tool differ in, and the pairs of their values (``_value_key``)
    that "respectively" at offset ``at`` of ``plain`` makes, reading its sentence from ``start``; None where it does
    not speak of them (:func:`with_respective_pairs`)."""
    differ = _differing(group)
    if len(differ) != 2 or not all(_scalar(c["arguments"][k]) for c in group for k in differ):
        return None
    orders, last_end = [], start
    for k in differ:
        last: dict[str, int] = {}  # each value's last place in the sentence before "respectively"
        for c in group:
            spans = [(p, e) for p, e in written_at(plain, c["arguments"][k], plain=True) if start <= p and e <= at]
            if not spans:
                return None
            last[_value_key(c["arguments"][k])] = spans[-1][0]
            last_end = max(last_end, spans[-1][1])
        orders.append(sorted(last, key=last.__getitem__))
    if len(orders[0]) != len(orders[1]) or len(orders[0]) < 2 or len(_WORD.findall(plain[last_end:at])) > 3:
        return None  # lists of different lengths, or "respectively" not right after them
    return differ, set(zip(*orders))


def with_respective_pairs(calls: list[dict], tools: list[Tool], text: str) -> list[dict]:
    """``calls`` (a turn where several calls were asked for) less the calls that pair two written lists other than
    item by item where ``text`` (the last user message) says so with "respectively": where the calls of one tool
    differ in exactly two top-level arguments, each a string or number written (:func:`agent.grounding.written_at`)
    in the sentence of a "respectively" (not "not respectively") before it, the last value no more than three words
    before it, and as many distinct values of one as of the other (two or more), the i-th value of one (in the
    order of their last places there) goes with the i-th of the other. Where every such pair is among the calls,
    the calls that hold another pair are dropped ("Barcelona and Manchester United in the UEFA Champions League and
    La Liga respectively": Qwen2.5-Coder-0.5B added Manchester United in the Champions League; dev split,
    docs/benchmarks.md "Readings of the user's words"). Otherwise the calls stand: the rule only drops calls, and
    only where all the pairs the user wrote are there ("… every combination. My wife and I are 30 and 32
    respectively" speaks of no call)."""
    plain = plain_text(text)
    dropped: set[int] = set()
    for m in _RESPECTIVELY.finditer(plain):
        if _WORD.findall(plain[max(0, m.start() - 8):m.start()])[-1:] == ["not"]:
            continue
        start = max((e.end() for e in _SENTENCE_END.finditer(plain, 0, m.start())), default=0)
        for _, group in _groups(calls, tools):
            found = _respective_pairs(group, plain, start, m.start())
            if found is None:
                continue
            differ, pairs = found
            pair_of = {id(c): (_value_key(c["arguments"][differ[0]]), _value_key(c["arguments"][differ[1]]))
                       for c in group}
            if pairs <= set(pair_of.values()):
                dropped |= {i for i, pair in pair_of.items() if pair not in pairs}
    return [c for c in calls if id(c) not in dropped] if dropped else calls


def with_written_lists(calls: list[dict], tools: list[Tool], text: str, max_calls: int) -> list[dict]:
    """``calls`` (a turn where several calls were asked for) completed over the lists ``text`` (the last user
    message) writes: :func:`with_written_list_items` (the items of a list of numbers), then
    :func:`with_shared_list_split` (a list every call of a tool holds, shared out), then
    :func:`with_respective_pairs` (two lists paired item by item where the message says "respectively"). The
    rules read text, not meaning."""
    return with_respective_pairs(with_shared_list_split(with_written_list_items(calls, tools, text, max_calls),
                                                        tools, text), tools, text)
