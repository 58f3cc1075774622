"""Scoring one math response against its gold answer.

    reward = accuracy + FORMAT_WEIGHT × format        (FORMAT_WEIGHT defaults to 0.5)

* The final answer is the content of the last non-empty, brace-balanced `\\boxed{...}` (or
  `\\fbox{...}`) in the response; without one, the content of the last `<answer>...</answer>`;
  without either there is no answer. Empty boxes are skipped: prompt templates often say
  "put your final answer within \\boxed{}".
* format is 1 when the response gives its final answer in exactly one form: exactly one
  non-empty box (and no unbalanced, i.e. truncated, box), or no box and exactly one non-empty
  `<answer>` block. Otherwise 0.
* accuracy is 1 when the answer equals the gold. Both are first made canonical (`canonical`):
  spacing, `$`, `\\left`/`\\right`, a trailing `.`, unicode math symbols, prose such as "The
  answer is", scientific notation, repeating decimals and unit words are normalised.
  `quick_verdict` then decides without sympy where it can: equal canonical strings are
  correct; plain numbers, percentages and tuples, intervals and sets of plain numbers are
  compared by exact arithmetic under math-verify's rules (`50\\%` = `50` = `0.5`; values within
  6-place rounding of each other are left to math-verify); a few clear mismatches are wrong.
  Everything else goes to math-verify (`Verifier`), which compares symbolically: fractions =
  decimals (rounded to 6 places), LaTeX, sets, intervals, tuples, equations (`x=3` = `3`),
  percentages.
* Units: math-verify drops units (`5 cm` = `5` = `5 m`) and never converts them (`5 cm` is not
  `50 mm`). This layer adds one rule: when gold and answer both name a known unit and the units
  differ, the answer is wrong (`5 cm` vs `5 m`). A unit on one side only is ignored.

Extraction, canonical forms and quick verdicts are plain string work, run by the server's own
process; only `Verifier` (sympy) runs in the worker pool.
"""

from __future__ import annotations

import re
import unicodedata
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from podagent.config.fields import FORMAT_WEIGHT

# Longer "final answers" are not answers: they are scored wrong without parsing (math-verify's
# LaTeX parser is super-linear in nesting depth; a 200-deep parenthesis takes it seconds).
MAX_ANSWER_CHARS = 4096
GOLD_CACHE_SIZE = 4096  # parsed golds per worker

# --- extraction --------------------------------------------------------------------------------

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
# `\\` is a LaTeX line break and `\{` `\}` are literal braces: neither opens nor closes a group.
_BRACE = re.compile(r"\\\\|\\[{}]|[{}]")
_OPEN_TAG, _CLOSE_TAG = "<answer>", "</answer>"


@dataclass(frozen=True)
class Extraction:
    answer: str | None  # the final answer as written (stripped), None when there is none
    source: str | None  # "boxed", "answer" or None
    well_formed: bool  # the format rule in the module docstring


def _boxes(text: str) -> tuple[list[str], int]:
    """Contents of the balanced boxes in the order they open, and how many never close."""
    openers = {m.end() - 1 for m in _BOX_OPEN.finditer(text)}
    if not openers:
        return [], 0
    found: list[tuple[int, str]] = []
    stack: list[int] = []
    # One pass from the first box: a box's closing brace depends only on what follows it.
    for m in _BRACE.finditer(text, min(openers)):
        token = m.group()
        if token == "{":
            stack.append(m.start())
        elif token == "}" and stack:
            start = stack.pop()
            if start in openers:
                found.append((start, text[start + 1 : m.start()]))
    found.sort()
    return [content for _, content in found], sum(1 for s in stack if s in openers)


def _answer_blocks(text: str) -> list[str]:
    """Contents of the <answer>...</answer> blocks (str.find: linear even on a flood of tags,
    where a lazy regex would rescan the rest of the text from every unclosed tag)."""
    blocks: list[str] = []
    start = text.find(_OPEN_TAG)
    while start != -1:
        end = text.find(_CLOSE_TAG, start + len(_OPEN_TAG))
        if end == -1:
            break
        blocks.append(text[start + len(_OPEN_TAG) : end])
        start = text.find(_OPEN_TAG, end + len(_CLOSE_TAG))
    return blocks


def extract(response: str) -> Extraction:
    boxes, unbalanced = _boxes(response)
    filled = [b.strip() for b in boxes if b.strip()]
    blocks = _answer_blocks(response)
    if filled:
        ok = len(filled) == 1 and unbalanced == 0 and len(blocks) <= 1
        return Extraction(filled[-1], "boxed", ok)
    filled_blocks = [b.strip() for b in blocks if b.strip()]
    if filled_blocks:
        ok = len(blocks) == 1 and unbalanced == 0
        return Extraction(filled_blocks[-1], "answer", ok)
    return Extraction(None, None, False)


def split_response(query: str, prompt: str | None) -> str:
    """The model's response: the query after its prompt, or the whole query."""
    if prompt and query.startswith(prompt):
        return query[len(prompt) :]
    return query


# --- canonical form ----------------------------------------------------------------------------

_SUPERSCRIPTS = str.maketrans({"²": "^2", "³": "^3", "¹": "^1", "⁰": "^0", "⁻": "^-"})
_SYMBOLS = (
    ("⁄", "/"), ("−", "-"), ("–", "-"), ("∞", r"\infty "), ("π", r"\pi "), ("×", r"\times "),
    ("·", r"\cdot "), ("÷", r"\div "), ("≤", r"\le "), ("≥", r"\ge "), ("≠", r"\ne "),
    ("°", r"^{\circ}"), ("∅", r"\emptyset "), ("∪", r"\cup "), ("∩", r"\cap "), ("±", r"\pm "),
)
_SQRT_SYMBOL = re.compile(r"√\s*(\d+|[A-Za-z]|\{[^{}]*\}|\([^()]*\))")
# Maths spans in an answer: `$…$`, `$$…$$`, `\(…\)`, `\[…\]` (`math_spans`). An unescaped `$`
# (not after a backslash) opens or closes; `\(` and `\[` open, `\)` and `\]` close.
_SPAN_OPENER = re.compile(r"(?<!\\)\$|\\[(\[]")
_SPAN_CLOSERS = {"$": re.compile(r"(?<!\\)\$"), "(": re.compile(r"\\\)"),
                 "[": re.compile(r"\\\]")}
_PROSE_WORD = re.compile(r"[A-Za-z]{2}")
_LEAD_PROSE = re.compile(
    r"^(?:#+|(?:so\s*,?\s*)?(?:the\s+)?(?:final\s+)?answer\b\s*(?:is\b|:|=)?|therefore\s*,?)\s*:?\s*",
    re.IGNORECASE)
_WRAPPER = re.compile(r"^\\(?:textbf|mathbf|boldsymbol|displaystyle)\s*\{(.*)\}$"
                      r"|^\\(?:text|textrm|mbox|mathrm)\{([-+.\d][^{}]*)\}$", re.DOTALL)
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad\b|~|\\displaystyle\b")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])")
_DOLLAR = re.compile(r"(?<!\\)\$")
_WHITESPACE = re.compile(r"\s+")
_DIGIT_GROUP = re.compile(r"(?<=\d) (?=\d{3}(?!\d))")  # 1 000 000: a thousands separator
_PERCENT = re.compile(r"(?<!\\)%")
_SCIENTIFIC = re.compile(r"^([-+]?\d+(?:\.\d+)?)[eE]\+?(-?\d+)$")
_REPEATING = re.compile(r"^(-?)(\d*)\.(\d*)\\overline\{?(\d+)\}?$")
_WORDS = re.compile(r"^(?:\\text\{)?\(?([A-Za-z][A-Za-z ]*?)\)?\}?$")
_CHOICE = re.compile(r"^\\text\{\(?([A-Za-z])\)?\}$|^\(([A-Za-z])\)$")

_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\\times10\^\{-?\d+\})?|\\frac\{\d+\}\{\d+\}"
_UNIT_TAIL = re.compile(
    rf"^(?P<num>{_NUMBER})"
    r"(?:\\(?:text|mathrm|mbox|textrm|rm|operatorname)\{(?P<wrapped>[A-Za-z][A-Za-z. ]*)\}"
    r"|\s+(?P<bare>[A-Za-z][A-Za-z]*(?: [A-Za-z]+){0,2}))\.?(?:\^\{?(?P<pow>[23])\}?)?$")

# Known units: every spelling maps to one name. Two different known names on the gold and the
# answer make the answer wrong; unknown words ("apples") are kept as text and then ignored.
_UNIT_NAMES = {
    "mm": ("millimeter", "millimeters", "millimetre", "millimetres"),
    "cm": ("centimeter", "centimeters", "centimetre", "centimetres"),
    "m": ("meter", "meters", "metre", "metres"),
    "km": ("kilometer", "kilometers", "kilometre", "kilometres"),
    "in": ("inch", "inches"),
    "ft": ("foot", "feet"),
    "yd": ("yard", "yards"),
    "mi": ("mile", "miles"),
    "mg": ("milligram", "milligrams"),
    "g": ("gram", "grams"),
    "kg": ("kilogram", "kilograms", "kgs"),
    "lb": ("pound", "pounds", "lbs"),
    "oz": ("ounce", "ounces"),
    "s": ("sec", "secs", "second", "seconds"),
    "min": ("mins", "minute", "minutes"),
    "h": ("hr", "hrs", "hour", "hours"),
    "day": ("days",),
    "week": ("weeks",),
    "month": ("months",),
    "year": ("years", "yr", "yrs"),
    "ml": ("milliliter", "milliliters", "millilitre", "millilitres", "mL"),
    "l": ("liter", "liters", "litre", "litres", "L"),
    "dollar": ("dollars", "usd"),
    "cent": ("cents",),
}
_UNITS = {alias.lower(): name
          for name, aliases in _UNIT_NAMES.items() for alias in (name, *aliases)}
_NUMBER_WORDS = {word: str(n) for n, word in enumerate((
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty"))}
_DEGREE_WORDS = {"degree", "degrees", "deg"}
_PERCENT_WORDS = {"percent", "per cent"}
_UNIT_SUFFIX = re.compile(r"\\text\{([a-z ]+)\}(?:\^([23]))?$")


def _unicode(text: str) -> str:
    text = text.translate(_SUPERSCRIPTS)  # before NFKC, which would turn x² into x2
    text = unicodedata.normalize("NFKC", text)
    for old, new in _SYMBOLS:
        text = text.replace(old, new)
    return text


def normalise(text: str) -> str:
    """Strip spacing, `$`, `\\left`/`\\right` and one trailing `.`: the exact-match form.

    Whitespace goes except between two letters or digits, where it can carry meaning
    (`\\pi r`, `1 2`)."""
    text = _DOLLAR.sub("", text)
    text = _LEFT_RIGHT.sub("", text)
    text = _SPACING.sub(" ", text)
    text = text.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    text = text.replace(r"\lbrace", r"\{").replace(r"\rbrace", r"\}")
    text = text.replace(r"\varnothing", r"\emptyset").replace(r"^\circ", r"^{\circ}")
    text = text.replace(r"\leq", r"\le").replace(r"\geq", r"\ge").replace(r"\neq", r"\ne")
    text = _DIGIT_GROUP.sub("", text.strip())
    if any(c.isspace() for c in text):
        text = _WHITESPACE.sub(
            lambda m: " " if _keeps_space(text, m.start(), m.end()) else "", text)
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1].rstrip()
    return text


def _keeps_space(text: str, start: int, end: int) -> bool:
    return start > 0 and end < len(text) and text[start - 1].isalnum() and text[end].isalnum()


def _unit(raw: str, power: str | None) -> str | None:
    """`\\text{cm}`-style canonical suffix for a unit word, or None for a non-unit."""
    word = raw.strip().rstrip(".").strip()
    low = word.lower()
    if low in _DEGREE_WORDS:
        return r"^{\circ}"
    if low in _PERCENT_WORDS:
        return r"\%"
    name = _UNITS.get(low) or _UNITS.get(word)
    if name is None:
        if len(word) < 3:  # "3 pi", "2 x": maths, not a unit
            return None
        name = low
    return rf"\text{{{name}}}" + (f"^{power}" if power else "")


def math_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of each maths span, left to right. A span runs from an opener
    to the first closer of its kind with at least one character between them; an opener with
    no such closer is text, and the search goes on from the character after it. `$$` opens
    display maths (a closing `$` takes a second `$` with it); when no `$` closes it and a
    third `$` follows at once, the three are `$`, content `$`, `$`. These are the matches of
    the regular expression this replaces (the tests hold the two together).

    In linear time. That expression, on an opener with no closer after it, scanned to the end
    of the text, and did so again from every later opener: `\\(` repeated 2,048 times took
    0.1 s per answer, a minute per batch of them. Here each closer's position is found once,
    and looked up with a pointer per kind that only moves forward (openers come in order)."""
    closers = {kind: [m.start() for m in rx.finditer(text)] for kind, rx in _SPAN_CLOSERS.items()}
    at = dict.fromkeys(closers, 0)

    def first(kind: str, minimum: int) -> int:
        """The first closer of `kind` at or after `minimum`, or -1."""
        found, i = closers[kind], at[kind]
        while i < len(found) and found[i] < minimum:
            i += 1
        at[kind] = i
        return found[i] if i < len(found) else -1

    spans: list[tuple[int, int, str]] = []
    pos = 0
    while m := _SPAN_OPENER.search(text, pos):
        start = m.start()
        if text[start] == "$":
            body = start + 2 if text.startswith("$", start + 1) else start + 1
            close = first("$", body + 1)
            if close < 0 and body == start + 2 and text.startswith("$", start + 2):
                body, close = start + 1, start + 2  # `$$$` and nothing after: `$` `$` `$`
            end = close + 1 + text.startswith("$", close + 1)
        else:
            body = start + 2
            close = first(text[start + 1], body + 1)
            end = close + 2
        if close < 0:
            pos = start + 1
            continue
        spans.append((start, end, text[body:close]))
        pos = end
    return spans


def _outside(text: str, spans: list[tuple[int, int, str]]) -> str:
    """The text with the spans taken out."""
    ends = [0, *(end for _, end, _ in spans)]
    starts = [*(start for start, _, _ in spans), len(text)]
    return "".join(text[a:b] for a, b in zip(ends, starts, strict=True))


def _repeating(m: re.Match[str]) -> str:
    sign, whole, fixed, period = m.groups()
    value = Fraction(int(whole or "0")) + Fraction(int(fixed or "0"), 10 ** len(fixed))
    value += Fraction(int(period), (10 ** len(period) - 1) * 10 ** len(fixed))
    text = str(value.numerator) if value.denominator == 1 else (
        rf"\frac{{{value.numerator}}}{{{value.denominator}}}")
    return f"-{text}" if sign and value else text


def canonical(answer: str) -> str:
    """The form answers are compared, cached and verified in.

    Idempotent, so that a canonical gold and a canonical answer meet: the pass repeats until
    nothing changes (one step can expose another: `$The answer is$ 5`)."""
    if len(answer) > MAX_ANSWER_CHARS:
        return answer.strip()  # never parsed; only an identical gold can match it
    text = answer
    for _ in range(8):
        again = _canonical_pass(text)
        if again == text:
            break
        text = again
    return text


def _canonical_pass(answer: str) -> str:
    text = answer.strip()
    if not text.isascii():
        text = _unicode(text)
    spans = math_spans(text)
    if spans and _PROSE_WORD.search(_outside(text, spans)):
        text = spans[-1][2]  # prose around maths: the last formula is the answer
    while text[:1].isalpha() or text[:1] == "#":  # "The answer is", "Answer:", "####"
        shorter = _LEAD_PROSE.sub("", text, count=1)
        if shorter == text:
            break
        text = shorter
    text = normalise(text)
    if "√" in text:  # after normalise, which may drop a `$` between √ and its argument
        text = _SQRT_SYMBOL.sub(lambda m: r"\sqrt{" + m.group(1).strip("{}()") + "}", text)
    while m := _WRAPPER.match(text):  # \textbf{5}; \text{5 apples} (a number in text)
        text = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
    text = _PERCENT.sub(r"\\%", text)
    if m := _CHOICE.match(text):  # "(A)", "\text{(A)}": a choice, as math-verify reads it
        return (m.group(1) or m.group(2)).lower()
    if m := _WORDS.match(text):  # an answer in words ("North", "\text{yes}", "five")
        words = m.group(1).strip().lower()
        return _NUMBER_WORDS.get(words, words)
    if m := _UNIT_TAIL.match(text):
        suffix = _unit(m.group("wrapped") or m.group("bare"), m.group("pow"))
        if suffix is not None:
            text = m.group("num") + suffix
    if m := _SCIENTIFIC.match(text):
        text = rf"{m.group(1)}\times10^{{{m.group(2)}}}"
    elif m := _REPEATING.match(text):
        text = _repeating(m)
    return text


def canonical_gold(gold: str) -> str | None:
    """A gold answer's canonical form; a gold written as a solution gives its last box."""
    if _BOX_OPEN.search(gold):
        boxed = extract(gold)
        if boxed.source == "boxed" and boxed.answer:
            gold = boxed.answer
    gold = canonical(gold)
    return gold or None


# --- verdicts ----------------------------------------------------------------------------------


def _unit_name(text: str) -> str | None:
    m = _UNIT_SUFFIX.search(text)
    if m and m.group(1) in _UNIT_NAMES:
        return m.group(1) + (m.group(2) or "")
    return None


def _collection(text: str) -> str | None:
    """"set" for `\\{...\\}`, "ordered" for a bracketed list with a top-level comma."""
    if text.startswith(r"\{") and text.endswith(r"\}"):
        return "set"
    if len(text) > 2 and text[0] in "([" and text[-1] in ")]":
        depth = 0
        for c in text[1:-1]:
            depth += c in "([{"
            depth -= c in ")]}"
            if c == "," and depth == 0:
                return "ordered"
    return None


_RATIONAL = re.compile(
    r"^([-+]?)(?:(\d+(?:\.\d*)?|\.\d+)(?:\\times10\^\{([-+]?\d{1,3})\})?"
    r"|\\frac\{(-?\d{1,50})\}\{(-?\d{1,50})\}|(\d{1,50})/(\d{1,50}))$")
# math-verify compares a decimal with a number after rounding both to 6 places: numbers
# further apart than this can never round to the same value.
_ROUNDING = Fraction(1, 10**6)


def rational(text: str) -> Fraction | None:
    """The exact value of a plain number (integer, decimal, fraction, a×10^{e}), else None."""
    m = _RATIONAL.match(text)
    if not m or len(text) > 120:
        return None
    sign, decimal, exponent, num, den, snum, sden = m.groups()
    if decimal is not None:
        value = Fraction(decimal) * Fraction(10) ** int(exponent or 0)
    else:
        top, bottom = int(num or snum), int(den or sden)
        if bottom == 0:
            return None
        value = Fraction(top, bottom)
    return -value if sign == "-" else value


@dataclass(frozen=True)
class _Numeric:
    """A plain number, a percentage, or a tuple/interval/set of plain numbers."""

    kind: str  # "number", "percent" (values holds p/100) , "ordered" or "set"
    values: tuple[Fraction, ...]
    brackets: str = ""  # "()", "[)", ... for "ordered"
    integer: int | None = None  # a number or percentage written as a whole number: its value


_INTEGER = re.compile(r"[-+]?\d+")


def _numeric(text: str) -> _Numeric | None:
    if (value := rational(text)) is not None:
        return _Numeric("number", (value,), integer=int(text) if _INTEGER.fullmatch(text) else None)
    if text.endswith(r"\%") and (value := rational(text[:-2])) is not None:
        whole = int(text[:-2]) if _INTEGER.fullmatch(text[:-2]) else None
        return _Numeric("percent", (value / 100,), integer=whole)
    if text.startswith(r"\{") and text.endswith(r"\}"):
        kind, inner, brackets = "set", text[2:-2], ""
    elif len(text) > 2 and text[0] in "([" and text[-1] in ")]":
        kind, inner, brackets = "ordered", text[1:-1], text[0] + text[-1]
    else:
        return None
    parts = inner.split(",")  # no nesting: every element must be a plain number
    values = [rational(part) for part in parts]
    if (kind == "ordered" and len(parts) < 2) or any(v is None for v in values):
        return None
    return _Numeric(kind, tuple(v for v in values if v is not None), brackets)


def _close(a: Fraction, b: Fraction) -> bool | None:
    """Equal, surely different, or None: within rounding distance (math-verify decides)."""
    if a == b:
        return True
    return False if abs(a - b) > _ROUNDING else None


def _all_close(pairs: list[tuple[Fraction, Fraction]]) -> bool | None:
    verdicts = [_close(a, b) for a, b in pairs]
    if False in verdicts:
        return False
    return True if all(verdicts) else None


def _numeric_verdict(answer: _Numeric, gold: _Numeric) -> bool | None:
    """math-verify's verdict, by exact arithmetic, on plain-number answers; None if unsure."""
    scalar = ("number", "percent")
    if answer.kind in scalar and gold.kind in scalar:
        # math-verify: a percentage equals its fraction (12.5\% = 0.125, 100\% = 1). Whether a
        # whole-number one also equals that whole number (50\% = 50) depends on the release
        # (0.9: yes, 0.5.2: no): left to the installed one.
        if answer.kind != gold.kind and answer.integer is not None \
                and answer.integer == gold.integer:
            return None
        return _close(answer.values[0], gold.values[0])
    if answer.kind == gold.kind == "ordered":
        if len(answer.values) != len(gold.values):
            return False
        if any(len(x.values) == 2 and x.values[0] >= x.values[1] for x in (answer, gold)):
            return None  # sympy makes an empty interval of [2,1), and all of those are equal
        if answer.brackets != gold.brackets:  # [0,1) vs [0,1]; longer lists are left alone
            return False if len(gold.values) == 2 else None
        if len(gold.values) > 2 and gold.brackets != "()":
            return None
        return _all_close(list(zip(answer.values, gold.values, strict=True)))
    if answer.kind == gold.kind == "set":
        ours, theirs = set(answer.values), set(gold.values)
        if ours == theirs:
            return True
        near = any(_close(a, b) is None for a in ours - theirs for b in theirs - ours)
        return None if near else False
    return None


def quick_verdict(answer: str, gold: str) -> bool | None:
    """True or False without sympy where the canonical strings decide; None: ask math-verify."""
    if answer == gold:
        return True
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return False
    # Plain numbers, percentages and tuples, intervals and sets of plain numbers on both sides
    # (most math golds): exact arithmetic gives math-verify's verdict without sympy.
    numbers = _numeric(answer), _numeric(gold)
    if numbers[0] is not None and numbers[1] is not None:
        verdict = _numeric_verdict(numbers[0], numbers[1])
        if verdict is not None:
            return verdict
    units = _unit_name(answer), _unit_name(gold)
    if None not in units and units[0] != units[1]:
        return False
    # math-verify reads `(0,1)` as an interval and lets it equal the set `\{0,1\}`.
    kinds = {_collection(answer), _collection(gold)}
    if kinds == {"set", "ordered"}:
        return False
    return None


def short(text: str, limit: int = 60) -> str:
    """A repr for one log line: long inputs are cut, with their length."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}…({len(text)} chars)"


class LRU:
    """A bounded mapping that forgets the least recently used entry; counts hits and misses."""

    def __init__(self, size: int):
        self.size = size
        self.hits = self.misses = 0
        self._data: OrderedDict[Hashable, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Hashable) -> Any:
        """The value, or None when absent (None is never stored)."""
        value = self._data.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._data.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)


# Two or more words of prose: parse like free text (math-verify finds the formula), not as
# the content of a box, where "so it is 3/4" would be read as s·o·i·t·i·s·3/4.
_PROSE = re.compile(r"(?<![\\A-Za-z{])[A-Za-z]{2,}\s+[A-Za-z]{2,}(?![A-Za-z])")


class Verifier:
    """math-verify with parsed golds kept in an LRU. One per process (sympy is not shared).

    math-verify's own timeouts are off where the release allows it (`mvcompat`): they use
    SIGALRM, which fires only between bytecodes (a big-integer power in C is never
    interrupted), has whole-second granularity and restarts for every parse and comparison. The
    pool's per-item timeout kills the worker process instead, which always works.
    """

    def __init__(self, gold_cache_size: int = GOLD_CACHE_SIZE):
        import logging

        import math_verify

        from podagent.rewards import mvcompat

        self._mv = math_verify
        self._parse_kwargs = mvcompat.parse_no_timeout()
        # Set-relation comparison both ways: `x \le 2` answers `(-\infty, 2]` and vice versa
        # (math-verify 0.5.x cannot: docs/reward-server.md lists the verdicts that differ).
        self._verify_kwargs = mvcompat.verify_no_timeout(set_relation=True)
        # With timeouts off, math-verify warns once per process that we must bound it: we do.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        self._golds = LRU(gold_cache_size)
        self.gold_parses = 0
        self.verifications = 0

    def _parse(self, text: str) -> list[Any]:
        if _PROSE.search(text):
            return self._mv.parse(text, **self._parse_kwargs)
        return self._mv.parse("\\boxed{" + text + "}", **self._parse_kwargs)

    def parsed_gold(self, gold: str) -> list[Any]:
        parsed = self._golds.get(gold)
        if parsed is None:
            self.gold_parses += 1
            parsed = self._parse(gold)
            self._golds.put(gold, parsed)
        return parsed

    def check(self, answer: str, gold: str) -> bool:
        """Is the canonical answer equal to the canonical gold?"""
        quick = quick_verdict(answer, gold)
        return quick if quick is not None else self.by_math_verify(answer, gold)

    def by_math_verify(self, answer: str, gold: str) -> bool:
        """The verdict of math-verify alone (what quick_verdict must agree with)."""
        self.verifications += 1
        gold_parsed = self.parsed_gold(gold)
        answer_parsed = self._parse(answer)
        if not gold_parsed or not answer_parsed:
            return False
        return bool(self._mv.verify(gold_parsed, answer_parsed, **self._verify_kwargs))


@dataclass(frozen=True)
class Score:
    reward: float
    accuracy: float
    format: float
    answer: str | None  # canonical answer, None when there was none


def score(response: str, gold: str | None, verifier: Verifier,
          format_weight: float = FORMAT_WEIGHT) -> Score:
    """Score one response in this process (the server batches, caches and uses a pool)."""
    found = extract(response)
    fmt = 1.0 if found.well_formed else 0.0
    answer = canonical(found.answer) if found.answer is not None else None
    gold_c = canonical_gold(gold) if gold else None
    acc = 1.0 if answer and gold_c and verifier.check(answer, gold_c) else 0.0
    return Score(acc + format_weight * fmt, acc, fmt, answer)


# --- the worker side of the pool ---------------------------------------------------------------

_WORKER: Verifier | None = None


def worker_check(answer: str, gold: str) -> tuple[bool, int]:
    """Run in a pool worker: the verdict and how many golds this call parsed (0 or 1)."""
    global _WORKER
    if _WORKER is None:
        _WORKER = Verifier()
    before = _WORKER.gold_parses
    verdict = _WORKER.check(answer, gold)
    return verdict, _WORKER.gold_parses - before


# One of each kind of work: sympy imports much of itself on first use (simplify, sets,
# relations), which would otherwise land on a worker's first real items.
_WARM_UP = ((r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}"), ("(x+1)^2", "x^2+2x+1"),
            ("x=3", "3"), (r"x\le2", r"(-\infty,2]"), (r"\{1,\pi\}", r"\{\pi,1\}"),
            (r"\frac{\pi}{2}", r"2\pi"), ("0.3333333", r"\frac{1}{3}"))


def worker_warm() -> None:
    """Runs math-verify on a few pairs, so a worker's first real items are not slow.

    The pool's forkserver does this once (module `warm`) and every worker forked from it
    starts warm; the call in each worker then finds the work done."""
    global _WORKER
    if _WORKER is not None:
        return
    _WORKER = Verifier()
    for answer, gold in _WARM_UP:
        _WORKER.by_math_verify(answer, gold)
    _WORKER.gold_parses = _WORKER.verifications = 0
