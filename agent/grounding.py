"""Where a call's values come from: the conversation's own text, or the model.

Small models invent values. These rules judge a decoded call by whether its values are written in the conversation
(every ``system``, ``developer``, ``user`` and ``tool`` message: :func:`conversation_text`), all chosen on the
dev split (docs/benchmarks.md, "Values from the conversation" and the sections named below) and all off with
``EngineConfig(grounding=False)``:

* **optional arguments** (:func:`drop_unwritten_optional`): an argument the tool does not require is dropped when
  one of its strings or numbers is not written in the conversation (:class:`Grounding`), so the tool's own default
  applies. Qwen2.5-Coder-0.5B otherwise fills them with the description's example (``"mission": "Mission 1"``) or a
  guess (``"date_range": "2023-01-01 to 2023-01-31"`` where the question names no date).
* **percents and copied enum lists** (:func:`grounded_call`, docs/benchmarks.md "Percents and copied enum lists"): a
  ``number`` argument holding a number the conversation writes only as a percent becomes its fraction
  (``"interest_rate": 5`` for "5%" → 0.05), unless the field says it holds a percent (its name, description or
  tool's description says so, or its ``maximum`` is above 1); an array that lists every value of its items'
  ``enum`` in the schema's order (the model copying the schema) keeps the values the conversation asks for.
* **numbers run on** (:func:`runs_numbers_together`, :func:`zeros_appended_prefixes`): a call holding an integer
  that runs the items of a written list together (``510`` for "5,10 and 15") or a written number on in zeros
  (``500000`` for "$50") makes ``LocalEngine`` decode the turn again with integers starting so taken out of the
  grammar.
* **the tool choice** (:func:`takes_from_conversation`): a turn none of whose calls takes anything from the
  conversation (each holds strings or numbers, and none of them, nor a word of them, nor all the numbers of an
  expression such as ``"17 + 25 * 3"``, is written there) called a
  tool that does not fit: ``OpenWeatherMap(location="Seoul, South Korea", api_key="YOUR_API_KEY_HERE")`` for
  "who is park ji sung". ``LocalEngine`` decodes the turn again with those tools masked out of the grammar (the
  prompt is unchanged, so its KV cache is reused); under ``tool_choice="auto"`` with no tool left, or once the
  retries are spent, the turn is a text answer; under ``"required"`` the first call stands when no tool's call
  takes from the conversation.
* **items of a written list** (:func:`written_number_lists`, applied by
  ``agent.parallel_calls.with_written_list_items``): where several calls are asked for and the calls go over a
  list of numbers the user writes ("for 1,5 and 10 years"), an item no call holds gets its call; and
  (:func:`written_at`, applied by ``agent.parallel_calls.with_shared_list_split``) a list every call of a tool
  holds is shared out by where each item is written ("Netflix for 'Friends', and Hulu for 'The Office'").

The rules read text, not meaning: a value the model translates ("上海" → "Shanghai"), converts ("five" → 5) or
infers correctly from no words at all counts as not written.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from constraints import schema_compiles
from schemas import Tool, ToolCallError

# a number as people and JSON write it: 5, -4, 5,000 (thousands groups only: "1,2,3" is three numbers; a comma
# after the last group is punctuation: "$400,000, with" is 400000), 0.5, .5, 1e-05
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d|,\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
_WORD = re.compile(r"\w+")
# numbers people write as words (cardinals and ordinals): "two dice", "the third page"
_NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
_NUMBER_WORDS.update({w: 10 * i for i, w in enumerate("thirty forty fifty sixty seventy eighty ninety".split(), 3)})
_NUMBER_WORDS.update({w: i for i, w in enumerate(
    "first second third fourth fifth sixth seventh eighth ninth tenth".split(), 1)})
_NUMBER_WORDS.update({"hundred": 100, "thousand": 1000, "million": 10 ** 6, "billion": 10 ** 9, "dozen": 12,
                      "twice": 2, "once": 1})
_PERCENT = re.compile(r"\s*(?:%|per\s*cent\b)", re.IGNORECASE)
# the first number of a range of percents: "3-5%", "3 to 5%", "between 3 and 5%" (3 is a percent too; "and" only
# after "between": "buy 2 and get 5% off" is no range)
_PERCENT_RANGE = re.compile(r"\s*(?:-|\u2013|to\b)\s*\d+(?:\.\d+)?\s*(?:%|per\s*cent\b)", re.IGNORECASE)
_PERCENT_BETWEEN = re.compile(r"\s*and\s+\d+(?:\.\d+)?\s*(?:%|per\s*cent\b)", re.IGNORECASE)
_BETWEEN = re.compile(r"\bbetween\s*$", re.IGNORECASE)
# what says a field holds a percent: its name, its description or its tool's description
_SAYS_PERCENT = re.compile(r"percent|per\s*cent\b|(?<![a-z])pct(?![a-z])|%", re.IGNORECASE)
# a scale after a number: "$1M", "5k", "1.2 million", "3bn" (a letter attached, a word after a space or not)
_SCALE = re.compile(r"(?:([kKmMbB]|bn)|\s*(thousand|million|billion|trillion|bn))(?![^\W\d_])", re.IGNORECASE)
_SCALE_OF = {"k": 10 ** 3, "m": 10 ** 6, "b": 10 ** 9, "bn": 10 ** 9, "thousand": 10 ** 3, "million": 10 ** 6,
             "billion": 10 ** 9, "trillion": 10 ** 12}
# cardinals that combine into one number: "twenty-five", "two hundred and fifty", "three thousand"
_UNITS = {w: _NUMBER_WORDS[w] for w in "one two three four five six seven eight nine".split()}
_TEENS = {w: _NUMBER_WORDS[w] for w in "zero ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen "
                                           "nineteen".split()}
_TENS = {w: _NUMBER_WORDS[w] for w in "twenty thirty forty fifty sixty seventy eighty ninety".split()}
_SMALL = {**_UNITS, **_TEENS, **_TENS}
_SCALES = {"thousand": 1000, "million": 10 ** 6}
_CARDINAL = "|".join(sorted([*_UNITS, *_TEENS, *_TENS, "hundred", *_SCALES], key=len, reverse=True))
_CARDINAL_RUN = re.compile(rf"\b(?:{_CARDINAL})(?:(?:\s+and\s+|[\s-]+)(?:{_CARDINAL}))+\b")


def compound_numbers(text: str) -> set[int]:
    """The numbers that runs of cardinal words in ``text`` (case-folded) write: "twenty-five" 25, "two hundred and
    fifty" 250, "one thousand two hundred" 1200. A word that cannot continue the number before it ("five six")
    starts a new one; a lone word is not a run (``Grounding`` reads those one at a time)."""
    found: set[int] = set()
    for run in _CARDINAL_RUN.finditer(text):
        total, current, last = 0, 0, None  # last: the kind of the previous word
        for w in re.findall(r"[a-z]+", run.group()):
            if w == "and":
                continue
            kind = ("unit" if w in _UNITS else "teen" if w in _TEENS else "tens" if w in _TENS
                    else "hundred" if w == "hundred" else "scale")
            if (kind in ("unit", "teen", "tens") and last in ("unit", "teen")) or (
                    kind in ("teen", "tens") and last == "tens"):
                found.add(total + current)  # "five six": two numbers
                total, current = 0, 0
            if kind == "hundred":
                current = max(current, 1) * 100
            elif kind == "scale":
                total, current = total + max(current, 1) * _SCALES[w], 0
            else:
                current += _SMALL[w]
            last = kind
        found.add(total + current)
    return found


def conversation_text(messages: list[dict]) -> str:
    """The text a call's values may come from: every ``system``, ``developer``, ``user`` and ``tool`` message's
    content (text parts of a list content), joined by newlines."""
    return "\n".join(_content_text(m) for m in messages if m.get("role") in ("system", "developer", "user", "tool")
                     and isinstance(m.get("content"), (str, list)))


def last_user_text(messages: list[dict]) -> str:
    """The content of the last ``user`` message (its text parts joined by newlines); "" where there is none."""
    return next((_content_text(m) for m in reversed(messages) if m.get("role") == "user"), "")


def _content_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def leaf_values(value: Any) -> Iterator[Any]:
    """The scalars of a JSON value (strings, numbers, booleans, null), depth first."""
    if isinstance(value, dict):
        for v in value.values():
            yield from leaf_values(v)
    elif isinstance(value, list):
        for v in value:
            yield from leaf_values(v)
    else:
        yield value


def is_text_or_number(value: Any) -> bool:
    """A string or a number (not a boolean): the values a conversation can write. The strings ``"true"``,
    ``"false"`` and ``"null"`` are literals (tools that take source code, such as Java or JavaScript calls,
    write booleans so), not text."""
    if isinstance(value, str):
        return value.strip() not in ("true", "false", "null")
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_LETTER_WORD = re.compile(r"[^\W\d_]+")


def _in_order(letters: str, word: str) -> bool:
    """Whether ``letters`` appear in ``word`` in that order (a subsequence)."""
    rest = iter(word)
    return all(ch in rest for ch in letters)


class Grounding:
    """Which scalar values a conversation's text writes: a number equal to a number in the text (``5,000`` reads
    as 5000, ``95%`` as 95 and 0.95, ``$1.2M`` and "1.2 million" as 1.2 and 1200000, a number word as its number:
    "two", "third", "dozen", and a run of them as the number it writes: "twenty-five", "two hundred and fifty"), a
    string found in the text ignoring case and runs of whitespace, or an abbreviation of its words
    (:meth:`abbreviates`: "MSFT", "NYC"); booleans and null always (``value in grounding``). :meth:`mentions` is
    looser: a string one of whose words is written counts. ``percents_only``: the numbers written only as percents
    ("5%", "5 percent", nowhere a plain 5)."""

    def __init__(self, text: str):
        text = text.replace("\u2212", "-")  # the minus sign
        self.written = text  # as written: case and spacing kept
        self.text = plain_text(text)
        self.words = set(_WORD.findall(self.text))
        self._initials = "".join(w[0] for w in _LETTER_WORD.findall(self.text))  # of consecutive words, in order
        self.numbers = set()
        plain, percents = set(), set()
        for m in _NUMBER.finditer(text):
            x = float(m.group().replace(",", ""))
            self.numbers.add(number_key(x))
            if "," in m.group() and text.startswith(",", m.end()):  # "128,256, 512": a list too
                self.numbers |= {number_key(float(part)) for part in m.group().lstrip("-").split(",")}
            if scale := _SCALE.match(text, m.end()):  # "$1.2M" is also 1200000
                self.numbers.add(number_key(float(f"{x * _SCALE_OF[(scale[1] or scale[2]).lower()]:.15g}")))
            if (_PERCENT.match(text, m.end()) or _PERCENT_RANGE.match(text, m.end())  # "95%" is also 0.95
                    or (_PERCENT_BETWEEN.match(text, m.end()) and _BETWEEN.search(text, 0, m.start()))):
                self.numbers.add(number_key(x / 100))
                percents.add(number_key(x))
            else:
                plain.add(number_key(x))
        words = {_NUMBER_WORDS[w] for w in self.words if w in _NUMBER_WORDS} | compound_numbers(self.text)
        self.numbers |= words
        # numbers the text writes only as percents ("an interest rate of 5%", nowhere a plain 5 or "five")
        self.percents_only = percents - plain - words

    def __contains__(self, value: Any) -> bool:
        if value is None or isinstance(value, bool):
            return True
        if isinstance(value, (int, float)):
            return number_key(value) in self.numbers
        if isinstance(value, str):
            return plain_text(value) in self.text or self.abbreviates(value)
        return False

    def abbreviates(self, value: str) -> bool:
        """Whether ``value`` is an abbreviation of words the text writes: three to five upper-case ASCII letters
        that are the initials of consecutive words ("NYC": "New York City") or, in order, letters of one longer
        word starting with the same letter (a ticker: "MSFT" for "Microsoft", "GOOGL" for "Google"; not "AAPL"
        for "Apple"). Lenient by design: "USD" is read in "used" too. Qwen2.5-Coder-0.5B asked for the prices of
        "Apple Inc., Google LLC., and Microsoft Corporation" writes AAPL, GOOGL, then MSFT, which the several-call
        end rule took for an invented value (dev split, docs/benchmarks.md "Tickers and initials")."""
        if not (3 <= len(value) <= 5 and value.isascii() and value.isalpha() and value.isupper()):
            return False
        v = value.casefold()
        return v in self._initials or any(len(w) > len(v) and w[0] == v[0] and _in_order(v, w)
                                          for w in self.words)

    def mentions(self, value: Any) -> bool:
        """Whether the text writes ``value``: a number or a string of three or more characters as ``in`` reads it,
        a string holding two or more numbers all of which the text writes (``"17 + 25 * 3"``: short numbers are no
        words; a lone ``"7"`` is not enough: an ID invented from "Is 7 a prime?" is not a mention), or
        one word of the string: three or more ASCII letters or digits written as a word of the text, or a run
        of two or more non-ASCII ones (Korean, Chinese …) written anywhere in it (such scripts do not separate
        words by spaces). Booleans and null are not mentions."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value in self
        if not isinstance(value, str):
            return False
        if len(value.strip()) >= 3 and value in self:
            return True
        numbers = [float(m.group().replace(",", "")) for m in _NUMBER.finditer(value)]
        if len(numbers) >= 2 and all(number_key(x) in self.numbers for x in numbers):
            return True  # "17 + 25 * 3": every number of an expression is written in the text
        for w in _WORD.findall(value.casefold()):
            if w.isascii() and len(w) >= 3 and w in self.words:
                return True
            if not w.isascii() and len(w) >= 2 and w in self.text:
                return True
        return False


# what separates the items of a list of numbers: "5,10", "15, 20 and 30", "1980 and 2016", "2/3", "4 or 5"
_LIST_GAP = re.compile(r"\s*(?:[,;/&]\s*(?:(?:and|or)\s+)?|(?:and|or)\s+)", re.IGNORECASE)
_ASCII_INTEGER = re.compile(r"[1-9][0-9]*|0")
# past this many prefixes the rule is not applied (a tool result holding thousands of numbers): grammar size
MAX_RUN_TOGETHER_PREFIXES = 64


def _number_runs(text: str) -> list[list[str]]:
    """The runs of integers ``text`` writes as lists (a list separator between each and the next: ``,`` ``;``
    ``/`` ``&``, "and", "or"), each integer's ASCII digits with no grouping comma; an item with a leading zero or
    a sign, or any other number, ends a run ("1,00,000" and "3,05" are no lists); runs of two or more."""
    runs: list[list[str]] = []
    run: list[str] = []
    prev = None
    for m in _NUMBER.finditer(text):
        digits = m.group().replace(",", "")
        whole = (_ASCII_INTEGER.fullmatch(digits) is not None and not m.group().startswith("-")
                 and len(digits) <= MAX_LIST_DIGITS)
        if prev is not None and whole and _LIST_GAP.fullmatch(text, prev.end(), m.start()):
            run.append(digits)
        else:
            if len(run) >= 2:
                runs.append(run)
            run = [digits] if whole else []
        prev = m if whole else None
    if len(run) >= 2:
        runs.append(run)
    return runs


# what separates the items of a written list of numbers that several calls go over: "1,5 and 10", "15, 20 and
# 30", "2018 and 2020" (no "or", "/" or ";": alternatives, dates and fractions are no such lists)
_ITEM_GAP = re.compile(r"[ \t]*,[ \t]*(?:and[ \t]+)?[$€£]?|[ \t]+and[ \t]+[$€£]?", re.IGNORECASE)
_SIGNED_INTEGER = re.compile(r"-?\d+")
_SENTENCE_END = re.compile(r"[.;:!?\n](?:\s|$)")
_LETTER = re.compile(r"[^\W\d_]")
# words before a list's first item that make it a range: "between 5 and 12", "between the ages of roughly 5 and
# 12", "from 5 to 10, and 20", "from 5 through 12 and 15"
_RANGE_BEFORE = re.compile(r"\bbetween\b(?:\s+[^\s\d]+){0,6}\s*[$€£]?$|\b(?:to|through|thru|until)\s*[$€£]?$",
                           re.IGNORECASE)
MAX_LIST_DIGITS = 300  # a longer integer is no list item (past a float's range; Python parses 4300 digits at most)


@dataclass(frozen=True)
class WrittenList:
    """A list of numbers :func:`written_number_lists` read: its ``items``, and the text of its sentence within 40
    characters ``before`` its first item and ``after`` its last (the words that say what the numbers count: "a
    loan term of" 15, 20 and 30 "years")."""

    items: list
    before: str = ""
    after: str = ""


# a number joined to the next by "/", ":" or "-": part of a date, time, ratio or range ("12/25", "5:30", "5-10")
_JOINED_AFTER = re.compile(r"[/:-]\d")
# a month's name before a number: a date ("May 1, 2022"), whose day and year are no list
_MONTH_BEFORE = re.compile(r"\b(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|"
                           r"sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?\s*$", re.IGNORECASE)


def written_number_lists(text: str) -> list[WrittenList]:
    """The lists of two or more numbers ``text`` writes with a comma or "and" between each item and the next, the
    last gap holding "and" ("for 1,5 and 10 years" → ``[1, 5, 10]``; "15, 20 and 30"; "in 2018 and 2020"), each
    number as :func:`number_key` gives it (an integer literal exactly), a repeated item once. A number written as
    a percent, a scaled number ("$1.2M"), one out of a float's range, a date's day after its month ("May 1,
    2022": its year is no item either), a number joined to another by "/", ":" or "-" ("12/25", "5:30", "5-10")
    or to a letter ("15th"), or with anything else between it and the next ("2 apples and 3 pears", a line
    break; a currency sign may open an item: "$50, $75 and $100") ends a list; two numbers with a comma between
    ("In 2020, 15 employees", "40.7, -74.0", "order 12345, and 2 items") and a range ("between 5 and 10", "between
    the ages of 5 and 12", "from 5 to 10, and 20", "from 5 through 12 and 15") are no lists."""
    text = text.replace("\u2212", "-")
    lists: list[WrittenList] = []
    run: list[int | float] = []
    start, prev, day, anded, comma = 0, None, None, False, False
    seen: set = set()  # the items of the run (a repeated item once)
    written = 0  # the numbers the run writes, repeats counted

    def close() -> None:
        if (len(run) >= 2 and anded and not (written == 2 and comma)  # "12345, and 2 items": no list of two
                and not _RANGE_BEFORE.search(text, max(0, start - 60), start)):
            before = _SENTENCE_END.split(text[max(0, start - 40):start])[-1]
            lists.append(WrittenList(list(run), before, _SENTENCE_END.split(text[prev.end():prev.end() + 40])[0]))

    for m in _NUMBER.finditer(text):
        literal = m.group().replace(",", "")
        if len(literal) > MAX_LIST_DIGITS:
            value = float("inf")  # ends a list, as a number past a float's range does
        else:
            value = int(literal) if _SIGNED_INTEGER.fullmatch(literal) else number_key(float(literal))
        dated = _MONTH_BEFORE.search(text, max(0, m.start() - 12), m.start()) is not None
        year = day is not None and re.fullmatch(r"\s*,\s*", text[day.end():m.start()]) is not None
        day = m if dated else None
        joined = ((m.start() > 0 and text[m.start() - 1] in "/:-") or _JOINED_AFTER.match(text, m.end())
                  or _LETTER.match(text, m.end()))  # "15th", "3rd"
        plain = not (_PERCENT.match(text, m.end()) or _SCALE.match(text, m.end()) or dated or year or joined
                     or not math.isfinite(value))
        gap = _ITEM_GAP.fullmatch(text, prev.end(), m.start()) if prev is not None and plain else None
        if gap is not None:
            written += 1
            if value not in seen:
                run.append(value)
                seen.add(value)
            anded = "and" in gap.group().lower()
            comma = comma or "," in gap.group()
        else:
            if prev is not None:
                close()
            run, start, anded, comma = ([value] if plain else []), m.start(), False, False
            seen, written = set(run), len(run)
        prev = m if plain else None
    if prev is not None:
        close()
    return lists


def plain_text(text: str) -> str:
    """``text`` case-folded, each run of white space made one space: the text :func:`written_at` reads."""
    return " ".join(text.casefold().split())


def written_at(text: str, value: str | int | float, *, plain: bool = False) -> list[tuple[int, int]]:
    """Where ``text`` writes ``value`` as whole words, case and runs of white space aside: the ``(start, end)``
    offsets of each occurrence in :func:`plain_text` of ``text`` (``plain=True``: ``text`` is that already). A
    number as :func:`number_key` prints it (``2018``, ``2.5``), not inside a longer number (``5`` is not written
    in "2.5" or "-5"). ``[]`` for a string that is empty or only white space, a boolean, or a number past 4300
    digits."""
    if isinstance(value, bool):
        return []
    text = text if plain else plain_text(text)
    if isinstance(value, (int, float)):
        try:
            form = str(number_key(value))
        except ValueError:  # an integer past Python's digit limit for str()
            return []
        around = (r"(?<![\w.\-])", r"(?!\w|\.\d)")
    else:
        form = plain_text(value)
        around = (r"(?<!\w)", r"(?!\w)")
    if not form:
        return []
    return [m.span() for m in re.finditer(around[0] + re.escape(form) + around[1], text)]


def run_together_values(text: str, grounding: Grounding | None = None) -> set[int]:
    """The integers that running adjacent items of a list of integers ``text`` writes together gives, and that
    the text does not write itself (in digits or words: :class:`Grounding`): "the factorial of 5,10 and 15" →
    510, 1015, 51015. A decoded integer argument equal to one of them is the model copying the list's digits on
    past the item it meant (Qwen2.5-Coder-0.5B wrote 510, 15 and 1520 for "5,10 and 15", "1,5 and 10" and "15, 20
    and 30"; dev split, docs/benchmarks.md "Numbers written side by side"). ``grounding``: ``Grounding(text)``
    where the caller has it (else built here)."""
    written = (grounding or Grounding(text)).numbers
    out = set()
    for run in _number_runs(text):
        for i in range(len(run)):
            if run[i] == "0":
                continue
            for j in range(i + 2, min(len(run), i + 4) + 1):  # two to four items run together
                value = int("".join(run[i:j]))
                if value not in written:
                    out.add(value)
    return out


def _written_starts(grounding: Grounding) -> set[str]:
    """Every leading run of digits of a non-negative integer the conversation writes (in digits or words): a prefix
    among them is never taken out of the grammar, so a written number stays writable."""
    written = {str(n) for n in grounding.numbers if isinstance(n, int) and n >= 0}
    return {w[:i] for w in written for i in range(1, len(w) + 1)}


def run_together_prefixes(text: str, grounding: Grounding | None = None) -> frozenset[str]:
    """The prefixes that keep integers from running the items of a list ``text`` writes together: each item's
    digits and the next item's first digit (``"5,10 and 15"`` → ``{"51", "101"}``), less any prefix of a number
    the text writes itself, in digits or words (``"5, 10 and 51"``: 51 is written). Empty past
    :data:`MAX_RUN_TOGETHER_PREFIXES`. The engine decodes a turn again with integers starting so taken out of the
    grammar (``schemas.narrow.integers_without_prefixes``) where a call holds a :func:`run_together_values` value.
    ``grounding``: ``Grounding(text)`` where the caller has it (else built here)."""
    starts = _written_starts(grounding or Grounding(text))
    prefixes = {a + b[0] for run in _number_runs(text) for a, b in zip(run, run[1:])
                if a != "0" and a + b[0] not in starts}
    return frozenset(prefixes) if len(prefixes) <= MAX_RUN_TOGETHER_PREFIXES else frozenset()


def runs_numbers_together(calls: list[dict], text: str, grounding: Grounding | None = None) -> bool:
    """Whether one of ``calls`` holds a non-negative integer argument (at any depth) equal to a
    :func:`run_together_values` value of ``text`` (``grounding``: ``Grounding(text)`` where the caller has it)."""
    values = None
    for call in calls:
        for v in leaf_values(call.get("arguments")):
            if isinstance(v, int) and not isinstance(v, bool) and v >= 10:
                values = run_together_values(text, grounding) if values is None else values
                if v in values:
                    return True
    return False


def zeros_appended_prefixes(calls: list[dict], text: str, grounding: Grounding | None = None) -> frozenset[str]:
    """The prefixes that keep integers from running on in zeros past a number ``text`` writes: for each integer
    argument of ``calls`` (at any depth) that the text does not write (:class:`Grounding`) and that is a written
    integer of two or more digits followed by zeros (``500000`` for "a maximum cost of $50", ``100`` for "the
    next 10 years"), that integer's digits and a ``0`` (``"500"``, ``"100"``), less any prefix of a number the
    text writes itself. Qwen2.5-Coder-0.5B writes digits one token at a time and, after a number, sometimes goes on
    writing zeros (dev split: ``multiple_39``, ``parallel_23``, ``parallel_multiple_7``, docs/benchmarks.md "Zeros
    after a number"). The engine decodes such a turn again with integers starting so taken out of the grammar.
    ``grounding``: ``Grounding(text)`` where the caller has it (else built here when needed)."""
    found: set[str] = set()
    for call in calls:
        for v in leaf_values(call.get("arguments")):
            if not isinstance(v, int) or isinstance(v, bool) or v < 100:
                continue
            grounding = Grounding(text) if grounding is None else grounding
            if v in grounding:
                continue
            digits = str(v).rstrip("0")
            for k in range(len(digits), len(str(v))):
                head = str(v)[:k]
                if len(head) >= 2 and head[0] != "0" and int(head) in grounding.numbers:
                    found.add(head + "0")
    if not found:
        return frozenset()
    starts = _written_starts(grounding)
    return frozenset(x for x in found if x not in starts)


def number_key(x: int | float) -> int | float:
    """A number as one key whatever its JSON spelling (``1`` and ``1.0`` alike); integers beyond a float's range
    stay exact integers."""
    try:
        f = float(x)
    except OverflowError:
        return int(x)
    return int(f) if f.is_integer() and abs(f) < 2 ** 53 else f


def takes_from_conversation(call: dict, grounding: Grounding) -> bool:
    """Whether ``call`` (``{"name", "arguments"}``) takes a value from the conversation: it holds no string or
    number at all (nothing to judge), or one of them is mentioned (:meth:`Grounding.mentions`)."""
    values = [v for v in leaf_values(call.get("arguments")) if is_text_or_number(v)]
    return not values or any(grounding.mentions(v) for v in values)


def drop_unwritten_optional(call: dict, parameters: dict, grounding: Grounding) -> dict:
    """``call`` without the arguments that ``parameters`` (the tool's JSON Schema) does not require and that hold a
    string or number not written in the conversation (``value in grounding``, at any depth of the argument).

    Returns the same dict when nothing is dropped, else a new ``{"name", "arguments", ...}`` (other keys kept).
    Dropping only removes keys the schema does not require; the caller validates the result again (a schema may
    still constrain which keys appear, e.g. ``minProperties``).
    """
    args = call.get("arguments")
    if not isinstance(args, dict) or not isinstance(parameters, dict):
        return call
    required = set(parameters.get("required") or ())
    kept = {k: v for k, v in args.items()
            if k in required or all(v2 in grounding for v2 in leaf_values(v) if is_text_or_number(v2))}
    return call if len(kept) == len(args) else {**call, "arguments": kept}


def _map_arguments(call: dict, parameters: dict, rule: Callable[[str, Any, dict], Any]) -> dict:
    """``call`` with each top-level argument that ``parameters`` (the tool's JSON Schema) describes replaced by
    ``rule(name, value, its schema)`` where that is not None; the same dict when nothing changes."""
    args = call.get("arguments")
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(args, dict) or not isinstance(props, dict):
        return call
    changed = {k: new for k, v in args.items()
               if isinstance(props.get(k), dict) and (new := rule(k, v, props[k])) is not None}
    return {**call, "arguments": {**args, **changed}} if changed else call


def _json_types(spec: dict) -> set:
    """The JSON types a schema allows at its top: its ``type`` (one or a list) and its ``anyOf``/``oneOf``
    alternatives' (``Optional[float]`` is ``anyOf: [number, null]``)."""
    t = spec.get("type")
    types = set(t) if isinstance(t, list) else {t}
    for alt in (spec.get("anyOf") or []) + (spec.get("oneOf") or []):
        if isinstance(alt, dict):
            types |= _json_types(alt)
    return types


def fractions_for_percents(call: dict, parameters: dict, grounding: Grounding, tool_description: str = "") -> dict:
    """``call`` with each top-level argument that ``parameters`` types ``"number"`` (not ``"integer"``) holding a
    number the conversation writes only as a percent (``grounding.percents_only``: "5%", "3-5%", and nowhere a
    plain 5 or "five") as that number's fraction: ``"interest_rate": 5`` for "an interest rate of 5%" becomes 0.05.
    Not where the field says it holds a percent: its name, its description or ``tool_description`` says
    "percent", "per cent", "pct" or ``%`` ("Interest rate in percentage"), or its ``maximum`` (or
    ``exclusiveMaximum``) is above 1 (a 0-100 scale).

    Returns the same dict when nothing changes, else a new one; the caller validates it.
    """
    if _SAYS_PERCENT.search(tool_description or ""):
        return call

    def fraction(name: str, value: Any, spec: dict) -> float | None:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or number_key(value) not in grounding.percents_only):
            return None
        types, says = _json_types(spec), _SAYS_PERCENT.search(f"{name} {spec.get('description') or ''}")
        if "number" not in types or "integer" in types or says:
            return None
        top = [b for b in (spec.get("maximum"), spec.get("exclusiveMaximum")) if isinstance(b, (int, float))]
        return None if any(b > 1 for b in top) else float(f"{value / 100:.12g}")

    return _map_arguments(call, parameters, fraction)


# words that say nothing of what an enum item is ("Food and Beverages"): never a sign it was asked for
_STOP_WORDS = frozenset("and the for with from into all any not per are has have can you your our its out off "
                        "over under near only more less than that this".split())


def _item_words(item: str) -> list[str]:
    """The words of an enum item that can say what it is: three or more letters, not a stop word, case folded."""
    return [w for w in _WORD.findall(item.casefold()) if len(w) >= 3 and w not in _STOP_WORDS]


def _written_word(w: str, grounding: Grounding) -> bool:
    """Whether the conversation writes ``w`` or the same word in another form (one a prefix of the other, four
    letters or more)."""
    return w in grounding.words or (len(w) >= 4 and any(
        len(u) >= 4 and (u.startswith(w) or w.startswith(u)) for u in grounding.words))


def _asks_for(item: str, grounding: Grounding, others: Iterable[str] = ()) -> bool:
    """Whether the conversation writes a word of ``item`` (three or more letters, not a stop word), or the same word
    in another form (one a prefix of the other, four letters or more: "price"/"prices", "child"/"children"). A
    word that another of the enum's items ``others`` also holds does not tell them apart: it asks for the item
    only where no item holding it is asked for by a word of its own ("biking trails" asks for "Biking Trails", not
    "Hiking Trails"; "a pool" for both "Indoor Pool" and "Outdoor Pool"). An item with no such word ("TV", "A")
    cannot be judged by its words: it counts as asked for."""
    words = _item_words(item)
    if not words:
        return True
    rest = [_item_words(o) for o in others if o != item]
    shared = {w for r in rest for w in r}
    if any(_written_word(w, grounding) for w in words if w not in shared):
        return True
    # a shared word asks for every value holding it where none of them is asked for by a word of its own
    return any(w in shared and _written_word(w, grounding)
               and not any(_written_word(u, grounding) for r in rest if w in r for u in r if u not in words)
               for w in words)


def without_unasked_enum_items(call: dict, parameters: dict, grounding: Grounding) -> dict:
    """``call`` with each top-level array argument that lists every value of its items' ``enum`` (three or more),
    in the schema's order — the model copying the schema's list ("preferences": ``["Pet-friendly", "Disabled
    Access", "24 hours", "Cafe Inside"]`` for "a pet-friendly library with facilities for disabled people") —
    reduced to the values the conversation asks for (a word of the value written there, :func:`_asks_for`), where
    it asks for at least one and not all.

    Returns the same dict when nothing changes, else a new one; the caller validates it.
    """
    def asked(name: str, value: Any, spec: dict) -> list | None:
        items = spec.get("items")
        enum = items.get("enum") if isinstance(items, dict) else None
        if not isinstance(enum, list) or len(enum) < 3 or value != enum or not all(isinstance(x, str) for x in value):
            return None
        kept = [x for x in value if _asks_for(x, grounding, enum)]
        return kept if 0 < len(kept) < len(value) else None

    return _map_arguments(call, parameters, asked)


# words a name written in another order may hold besides its own ("Treaty of Tordesillas")
_LINK_WORDS = frozenset("of the de la del von van".split())
_NAME = re.compile(r"\w+(?: \w+)+")


def written_reordered(value: str, text: str) -> str | None:
    """Where ``text`` writes the words of ``value`` — a name: two or more distinct words, each starting with a
    capital letter or a digit, single spaces, nothing else — in another order as a name with a link word, one or
    two of "of", "the", "de", "la", "del", "von", "van" between them, single spaces only: that span of ``text`` as
    written ("Treaty of Tordesillas" for ``"Tordesillas Treaty"``), the first such; else None. Not read: a value
    with a lowercase word ("Boston to New York" for "New York to Boston": the order is the meaning), words
    reordered without a link word ("Smith John" for "John Smith": a stated order may be meant)."""
    if not _NAME.fullmatch(value) or not all(w[0].isupper() or w[0].isdigit() for w in value.split()):
        return None
    words = value.casefold().split()
    if len(set(words)) != len(words):
        return None
    tokens = [(m.group().casefold(), m.start(), m.end()) for m in _WORD.finditer(text)]
    for i, (first, _, _) in enumerate(tokens):
        if first not in words:
            continue
        for j in range(i + len(words) - 1, min(len(tokens), i + len(words) + 2)):
            span = tokens[i:j + 1]
            own = [w for w, _, _ in span if w in words]
            if (sorted(own) != sorted(words) or own == words or span[-1][0] not in words or len(own) == len(span)
                    or any(w not in words and w not in _LINK_WORDS for w, _, _ in span)
                    or any(text[a[2]:b[1]] != " " for a, b in zip(span, span[1:]))):
                continue
            return text[span[0][1]:span[-1][2]]
    return None


def names_as_written(call: dict, parameters: dict, grounding: Grounding) -> dict:
    """``call`` with each top-level string argument the conversation does not write but writes the words of in
    another order, as a name with a link word (:func:`written_reordered`), as the conversation writes it: ``"treaty_name": "Tordesillas
    Treaty"`` for "the signing of the Treaty of Tordesillas" becomes ``"Treaty of Tordesillas"``
    (Qwen2.5-Coder-0.5B, dev split, docs/benchmarks.md "Readings of the user's words").

    Returns the same dict when nothing changes, else a new one; the caller validates it.
    """
    def as_written(name: str, value: Any, spec: dict) -> str | None:
        if not isinstance(value, str) or value in grounding:
            return None
        return written_reordered(value, grounding.written)

    return _map_arguments(call, parameters, as_written)


def grounded_call(call: dict, tools: Iterable[Tool], grounding: Grounding) -> dict:
    """``call`` with its values read against the conversation, one rule after the other, each kept only where the
    call still validates against its tool among ``tools`` (else that rule's change is dropped):
    :func:`without_unasked_enum_items` (first, so an optional list the model copied whole keeps what was asked for
    rather than being dropped whole), :func:`names_as_written` (before the optional arguments are read, so a name
    written in another order is kept as written), :func:`drop_unwritten_optional`, :func:`fractions_for_percents`
    (the tool's description read too). A call naming a tool not in ``tools`` is returned as decoded."""
    return _with_rules(call, tools, (
        lambda c, tool: without_unasked_enum_items(c, tool.parameters, grounding),
        lambda c, tool: names_as_written(c, tool.parameters, grounding),
        lambda c, tool: drop_unwritten_optional(c, tool.parameters, grounding),
        lambda c, tool: fractions_for_percents(c, tool.parameters, grounding, tool.description)))


# words of a parameter's name that do not say which parameter it is ("max_results", "is_detailed", "item_id")
_NAME_STOP_WORDS = frozenset("max min num number type name value data list item items info the and for with from "
                             "use include has get set flag enable enabled option options param params".split())
_NAME_PART = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")


def name_words(name: str) -> list[str]:
    """The words of a parameter's ``name`` that can say which parameter it is: split at ``_``, ``-``, ``.``,
    digits and camelCase (``maxCost`` → max, cost), case folded, three or more letters, less generic words (max,
    min, number, type, name, value, data, list, item, info, include, flag …)."""
    return [w for w in (m.casefold() for m in _NAME_PART.findall(name))
            if len(w) >= 3 and w.isalpha() and w not in _NAME_STOP_WORDS]


def named_optional(parameters: dict, request: Grounding) -> list[str]:
    """The optional top-level parameters of ``parameters`` (a tool's JSON Schema) that the user's request names:
    the parameter's name is written in ``request`` (a :class:`Grounding` of the user's last message) as it stands
    ("set max_cost to 50"), or every word of it (:func:`name_words`; at least one) is, as a whole word or an
    inflection of it (:func:`_names_word`: "cost" in "a maximum cost of $50", "returned" for ``return_type``).
    Parameters whose schema is an object (or names neither a type nor values) are left out: their values are not
    read against the conversation.

    ``LocalEngine`` makes these required in the turn's grammar (not in the tool: a call is validated, and its
    optional arguments judged, against the tool as registered), so that the model, which otherwise closes the
    call without them ("Find a ride from New York to Philadelphia with maximum cost of $50" → no ``max_cost``),
    writes them; a value it writes that the conversation does not hold is dropped afterwards
    (:func:`drop_unwritten_optional`), and so is an empty one (:func:`without_empty_named`). The rule reads
    words, not whom they are about: in a several-call turn a parameter named for one call is required in every
    call of the tool ("moves a Pikachu can learn, and whether Bulbasaur can learn the move 'Solar Beam'" gives
    both calls ``move``). Chosen on the dev split
    (docs/benchmarks.md "Parameters the user names").
    """
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(props, dict):
        return []
    required = set(parameters.get("required") or ())
    out = []
    for name, spec in props.items():
        if name in required or not isinstance(spec, dict):
            continue
        types = _json_types(spec) - {"null", None}
        if "object" in types or not (types or "enum" in spec or "const" in spec):
            continue
        words = name_words(name)
        if name.casefold() in request.words or (words and all(_names_word(w, request) for w in words)):
            out.append(name)
    return out


_INFLECTIONS = ("s", "es", "ed", "d", "ing", "er", "ers")


# verbs and generic nouns a tool's name uses for what it does, not for what it is about
_TOOL_VERBS = frozenset("get find calculate calc compute search fetch retrieve buy check lookup query show create "
                        "make add update delete run execute estimate determine convert book display details "
                        "calculator".split())


# a clause holding one of these (or a word ending in n't) says what the user does not want or need
_NEGATED = re.compile(r"\b(?:no|not|never|except|neither|nor|already|skip|dont|cannot)\b|n't\b", re.IGNORECASE)
_CLAUSE_END = re.compile(r"[.;:!?,()]|\b(?:but|however|though|although)\b", re.IGNORECASE)


def affirmed_text(text: str) -> str:
    """``text`` less its clauses (split at punctuation and at but / however / though) that hold a negation: no,
    not, a word ending in n't, never, except, neither, nor, already, skip ("I don't need a hotel", "No need for
    the mode.", "the mode I already know"); "without" is left out: it qualifies a thing asked for ("a Caesar salad
    without anchovies") more often than it declines one."""
    return " . ".join(c for c in _CLAUSE_END.split(text.replace("\u2019", "'")) if not _NEGATED.search(c))


def named_tools(tools: Iterable[Tool], request: Grounding, *, declined: bool = False) -> list[str]:
    """The names of the ``tools`` that the user's request names, in the tools' order: every word
    (:func:`name_words`) of the last dotted part of the tool's name, less verbs such as get, find, calculate or
    display (``museum.get_waiting_time`` → waiting, time; ``statistics.mode`` → mode), or of the whole name where
    no other word is left (``painting.display`` → painting, display), is written in ``request`` (a
    :class:`Grounding` of the user's last message), as a whole word or an inflection of it (:func:`_names_word`),
    in a clause that holds no negation (:func:`affirmed_text`: "I don't need a hotel" names no ``book_hotel``).
    The rule reads words, not meaning: "a quiet mode" names ``set_mode``. ``declined=True`` reads the negated
    clauses too (the rule as first chosen: ``scripts/named_tools_questions.py`` compares the two).

    ``agent.parallel_calls.ParallelCallsEnd`` lets a call of such a tool that no earlier call of the turn used go
    on with values already used ("the median and variance of 3,4,5,2,8,5, and the mode" → ``statistics.mode``
    with the same data), where any other call that brings no new value ends the turn. Chosen on the dev split
    (docs/benchmarks.md "Tools the user names").
    """
    out, affirmed = [], request if declined else Grounding(affirmed_text(request.written))
    for tool in tools:
        words = [w for w in name_words(tool.name.rsplit(".", 1)[-1]) if w not in _TOOL_VERBS] or \
            name_words(tool.name)
        if words and all(_names_word(w, affirmed) for w in words):
            out.append(tool.name)
    return out


def _names_word(w: str, request: Grounding) -> bool:
    """Whether ``request`` writes the word ``w`` of a parameter's name, or an inflection of it ("returned" for
    "return", "sizes" for "size", "including" for "include"; or ``w`` is one of a written word: "size" for a
    parameter "sizes"). Stricter than a shared prefix: "count" is not in "country", nor "port" in "Portugal"."""
    if w in request.words:
        return True
    stems = {w, w[:-1]} if w.endswith("e") else {w}
    return any(u.startswith(stem) and u[len(stem):] in _INFLECTIONS for u in request.words for stem in stems) or \
        any(w.startswith(u) and w[len(u):] in _INFLECTIONS for u in request.words if len(u) >= 3)


def without_empty_optional(call: dict, parameters: dict) -> dict:
    """``call`` less its optional top-level arguments holding ``""``, ``[]`` or ``{}`` (the same dict where there
    are none). ``LocalEngine`` applies it to the calls of a tool whose parameters a request names
    (:func:`asking_named`): the grammar then makes the model write on past optional parameters it would have left
    out, and an empty value written there ("No need for a note." → ``"note": ""``) says nothing the tool's default
    does not."""
    args = call.get("arguments")
    if not isinstance(args, dict) or not isinstance(parameters, dict):
        return call
    required = set(parameters.get("required") or ())
    kept = {k: v for k, v in args.items() if k in required or not (isinstance(v, (str, list, dict)) and not v)}
    return call if len(kept) == len(args) else {**call, "arguments": kept}


def without_empty_named(calls: list[dict], tools: Iterable[Tool], request: Grounding) -> list[dict]:
    """``calls`` with :func:`without_empty_optional` applied to each call of a tool among ``tools`` (as registered)
    whose parameters ``request`` names (:func:`asking_named`), kept where the call still validates."""
    named = [t for t in tools if asking_named(t, request) is not t]
    if not named:
        return calls
    return [_with_rules(c, named, (lambda c2, tool: without_empty_optional(c2, tool.parameters),)) for c in calls]


def asking_named(tool: Tool, request: Grounding) -> Tool:
    """``tool`` with the optional parameters the request names (:func:`named_optional`) required, for the grammar
    of a turn; ``tool`` itself where it names none, or where its schema cannot hold them all (``maxProperties``,
    an ``enum`` with no value: the grammar engine's compile check, cached). The copy is for the grammar only (not
    validated again: calls are validated against the tool as registered)."""
    named = named_optional(tool.parameters, request)
    if not named:
        return tool
    parameters = {**tool.parameters, "required": list(tool.parameters.get("required") or ()) + named}
    if not schema_compiles(parameters, not tool.strict):
        return tool
    out = copy.copy(tool)
    out.parameters = parameters
    return out


def without_unwritten_optional(call: dict, tools: Iterable[Tool], grounding: Grounding) -> dict:
    """``call`` less its optional arguments the conversation does not write (:func:`drop_unwritten_optional`
    against its tool among ``tools``), where the result still validates against that tool (a key required only
    inside ``allOf``/``anyOf``, ``minProperties`` …); else, or for a tool not in ``tools``, ``call`` as decoded.
    The rule of before :func:`grounded_call` (``scripts/replay_grounding.py`` compares the two)."""
    return _with_rules(call, tools, (lambda c, tool: drop_unwritten_optional(c, tool.parameters, grounding),))


def _with_rules(call: dict, tools: Iterable[Tool], rules: tuple[Callable[[dict, Tool], dict], ...]) -> dict:
    """``call`` after ``rules`` (each ``rule(call, its tool) -> call``, the same dict when nothing changes) in
    order, each change kept only where the call still validates against its tool among ``tools``; a call naming a
    tool not in ``tools`` as decoded."""
    tool = next((t for t in tools if t.name == call.get("name")), None)
    if tool is None:
        return call
    for rule in rules:
        changed = rule(call, tool)
        if changed is call:
            continue
        try:
            tool.validate(changed["arguments"])
        except ToolCallError:  # the changed call is refused: the call before this rule stands
            continue
        call = changed
    return call
