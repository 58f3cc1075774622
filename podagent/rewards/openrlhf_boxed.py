"""The `openrlhf-boxed` profile: upstream OpenRLHF's math reward function, item for item.

OpenRLHF's GRPO recipes can score with a Python file instead of a server
(`--remote_rm_url examples/python/math_reward_func.py`); that file's rule, which this module
reproduces verdict for verdict:

    reward = accuracy (1 or 0; no format term), and scores = rewards

* The response: when the prompt is a string found anywhere in the query, the query without
  its first len(prompt) characters. The cut is by length, not at the place the prompt was
  found, so a prompt found further in leaves its own last characters in the response.
  Otherwise (prompt absent, or not a string) the whole query is the response.
* The answer: the text inside the last `\\boxed` of the response, which must be followed at once
  by `{`, up to the `}` that closes it (braces counted, escapes not recognised). There is no
  answer when there is no `\\boxed`, when the last one is not followed by `{` (`\\boxed 5`,
  `\\boxed {5}`) or when its brace never closes; earlier boxes are never fallen back on.
  `\\fbox{...}` is never an answer (upstream looks for it when there is no `\\boxed`, then
  rejects it).
* The grade: no answer, or no label, scores 0. Otherwise the answer is right when either
  - both, put in the MATH dataset's normal form (`_mathd_form`: spacing, `\\left`/`\\right`,
    degrees, dollars, percent signs, a trailing `\\text{ unit}`, `\\dfrac`, braces of `\\frac` and
    `\\sqrt`, `x=` prefixes of one or two characters, `0.5` and `a/b` as fractions), are the
    same string; or
  - both, put in a looser form (`_loose_form`: unit words, million/billion, `or`/`and` as
    commas, LaTeX rendered as text by pylatexenc, lower case, whole numbers as integers), are
    the same string, or split the same way into elements (a tuple or interval in `()`/`[]`
    splits at commas; when the label has several elements the answer must open and close with
    the same brackets) each of which agrees: two plain fractions `a/b` must be the same string,
    a whole number never equals a non-whole one, and anything else must make
    `sympy.simplify((label) - (answer))` zero, tried only when that expression has at most two
    distinct letters and no exponent of the forms `^{`, `^(`, `^12` or `^2^`.
  As upstream: the normal form leaves a text it cannot handle as it came (a `\\frac` or `\\sqrt`
  with nothing after it, two `\\text{ ` units), and whatever sympy cannot parse or simplify
  is a mismatch.

Departures: none in verdicts; tests/unit/rewards/openrlhf_boxed_corpus.jsonl holds items with
the reward upstream's own function gave each, and test_openrlhf_boxed.py requires the same from
this module for every one. Timing differs: upstream bounds sympy with a 120 s SIGALRM, which
only works in the main thread, so in its trainer (which calls the function in a worker thread)
nothing bounds it; the server runs `accuracy` in its pool, whose per-item time limit kills the
worker instead. Upstream also prints a line per item; this module prints nothing.

Needs sympy and pylatexenc (the server's reward extra). `accuracy` is pure and may take long on
adversarial input, so it belongs in a killable worker, never in the event loop.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

# --- the response and its answer -------------------------------------------------------------

_BOX = "\\boxed"


def response_of(query: str, prompt: Any) -> str:
    """What is graded: see the module docstring (the cut is by the prompt's length)."""
    if isinstance(prompt, str) and prompt in query:
        return query[len(prompt):]
    return query


def boxed_answer(response: str) -> str | None:
    """The content of the last `\\boxed{...}`, or None (see the module docstring)."""
    start = response.rfind(_BOX)
    # No `\boxed`: upstream then finds the last `\fbox`, but only ever accepts `\boxed{`, so an
    # `\fbox` can never give an answer.
    if start < 0 or not response.startswith("{", start + len(_BOX)):
        return None
    depth = 0
    for at in range(start + len(_BOX), len(response)):
        char = response[at]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return response[start + len(_BOX) + 1:at]
    return None


# --- the first test: the MATH dataset's normal form ------------------------------------------

class _Malformed(Exception):
    """Input the normal form cannot handle: upstream then compares the text as it came."""


# Applied in this order; order matters (e.g. `\\!` goes before `\\\\` becomes `\\`).
_MATHD_BEFORE_UNITS = (
    ("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
    ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""),
)
# `\\%` goes twice, as upstream writes it twice: a `\\%` that the first removal forms goes too.
_MATHD_AFTER_UNITS = (("\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0."))
_UNIT_TEXT = "\\text{ "  # `5\text{ cm}`: everything from here on is a unit
# Plain integers only, written as Python writes them (no `+`, no leading zeros, no `-0`).
_INT_SLASH_INT = re.compile(r"(-?[1-9][0-9]*|0)/(-?[1-9][0-9]*|0)")
# Both normal forms unwrap an answer that is a single `\text{...}`. `$` also matches before a
# final newline, which the loose form (whose input is not stripped) inherits.
_WHOLE_TEXT = re.compile(r"\\text\{(.+?)\}$")


def _replace_all(text: str, pairs: Sequence[tuple[str, str]]) -> str:
    for old, new in pairs:
        text = text.replace(old, new)
    return text


def _drop_unit_text(text: str) -> str:
    pieces = text.split(_UNIT_TEXT)
    if len(pieces) > 2:
        raise _Malformed("more than one \\text{ unit}")
    return pieces[0]


def _brace_sqrt(text: str) -> str:
    """`\\sqrt2` -> `\\sqrt{2}` (one character)."""
    head, *pieces = text.split("\\sqrt")
    out = [head]
    for piece in pieces:
        if not piece:
            raise _Malformed("\\sqrt with nothing after it")
        out.append("\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:]))
    return "".join(out)


def _brace_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`; a `\\frac` followed by a
    single character leaves the whole text as it was."""
    head, *pieces = text.split("\\frac")
    out = [head]
    for piece in pieces:
        if not piece:
            raise _Malformed("\\frac with nothing after it")
        if piece[0] == "{":
            out.append("\\frac" + piece)
        elif len(piece) == 1:
            return text
        elif piece[1] == "{":
            out.append("\\frac{" + piece[0] + "}" + piece[1:])
        else:
            out.append("\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:])
    return "".join(out)


def _mathd_rewrite(text: str) -> str:
    text = _replace_all(text, _MATHD_BEFORE_UNITS)
    text = _replace_all(_drop_unit_text(text), _MATHD_AFTER_UNITS)
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `x=3`, `y =3`: keep the value
        text = sides[1]
    text = _brace_fracs(_brace_sqrt(text).replace(" ", ""))
    if text == "0.5":  # the only decimal this form turns into a fraction
        return "\\frac{1}{2}"
    whole = _INT_SLASH_INT.fullmatch(text)
    return f"\\frac{{{whole[1]}}}{{{whole[2]}}}" if whole else text


def _mathd_form(answer: str) -> str:
    answer = answer.strip()
    inner = _WHOLE_TEXT.match(answer)
    if inner:
        answer = inner[1].strip()
    try:
        return _mathd_rewrite(answer)
    except _Malformed:
        return answer


# --- the second test: a looser form, element by element, sympy -------------------------------

_LOOSE_WORDS = (
    ("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
    ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"),
)
# Removed one after another, anywhere (also inside longer words), with plural endings and an
# exponent: order matters, as removing one word can join the letters of another.
_UNIT_WORDS = tuple(
    re.compile(word + r"(?:es)?s? *(?:\^[0-9]+)?")
    for word in ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day",
                 "week", "month", "year", "foot", "feet", "inch", "yard"))
_DEGREE_SIGN = re.compile(r"\^ *\\circ")
_THIN_SPACE_COMMA = re.compile(r",\\! *")
_MINUS_SPACE = re.compile(r"- +")
# `2 1/2` -> `2+1/2`. Each match consumes both digits, so `1 2 3` becomes `1+2 3` (then `1+23`).
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")
_THOUSANDS_COMMA = re.compile(r"(\d),(\d{3})(?!\d)")
_UNICODE_MATH = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))
_BRACKETS = "()[]"
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")  # `.` is any character, as upstream
_EXPONENT_REFUSED = (re.compile(r"\^\{|\^\("), re.compile(r"\^[0-9]+\^|\^[0-9][0-9]+"))
_MAX_LETTERS = 2

_latex_renderer = None


def _latex_as_text(text: str) -> str:
    global _latex_renderer
    if _latex_renderer is None:  # imported on first use: a worker that never needs it never pays
        from pylatexenc.latex2text import LatexNodes2Text
        _latex_renderer = LatexNodes2Text()  # holds only its options: one serves every call
        # It warns on each malformed macro (`\\frac1`): model output would flood the log.
        logging.getLogger("pylatexenc.latex2text").setLevel(logging.ERROR)
    text = text.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    text = _latex_renderer.latex_to_text(text.replace("\\frac", " \\frac"))
    return _replace_all(text, _UNICODE_MATH).strip()


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)  # Python's float: spaces, `1_000`, `inf`, `1e3` all parse
    except ValueError:
        return None


def _near_integer(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and abs(value - round(value)) <= 1e-7


def _without_thousands_commas(text: str) -> str:
    while True:
        text, changed = _THOUSANDS_COMMA.subn(r"\1\2", text)
        if not changed:
            return text


def _whole(text: str) -> bool:
    return _near_integer(_float_or_none(_without_thousands_commas(text)))


def _loose_form(text: str) -> str:
    inner = _WHOLE_TEXT.match(text)
    if inner:
        text = inner[1]
    text = _replace_all(text, _LOOSE_WORDS)
    for unit in _UNIT_WORDS:
        text = unit.sub("", text)
    text = _DEGREE_SIGN.sub("", text)
    if text[:1] == "{" and text[-1:] == "}":
        text = text[1:-1]
    text = _THIN_SPACE_COMMA.sub("", text)
    number = _float_or_none(text)
    if _near_integer(number):
        text = str(round(number))
    if "\\" in text:
        with contextlib.suppress(Exception):  # upstream keeps the text as it was
            text = _latex_as_text(text)
    text = _MIXED_NUMBER.sub(r"\1+\2", _MINUS_SPACE.sub("-", text))
    text = text.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _whole(text):  # truncated, not rounded: `1,000.99999999` becomes 1000
        text = str(int(float(text.replace(",", ""))))
    return text


def _elements(form: str) -> list[str]:
    """A tuple or interval in `()`/`[]` with no other bracket inside: its comma-separated
    parts; anything else is one element."""
    form = _without_thousands_commas(form)
    if not form:
        return []
    if len(form) > 2 and form[0] in _BRACKETS and form[-1] in _BRACKETS \
            and not any(b in form[1:-1] for b in _BRACKETS):
        return [part.strip() for part in form[1:-1].split(",")]
    return [form]


def _evaluable(expression: str) -> bool:
    """Upstream's guard before sympy: few letters, no exponents that may blow up. (A `**`
    written as such passes it: that is what the pool's per-item limit is for.)"""
    stripped = expression.replace("sqrt", "").replace("frac", "")
    if len({c for c in stripped if c.isalpha()}) > _MAX_LETTERS:
        return False
    return not any(p.search(expression) for p in _EXPONENT_REFUSED)


@functools.cache
def _sympy() -> tuple[Callable[[str], Any], Callable[[Any], Any]]:
    """sympy's parser (with implicit multiplication: `2x`, `sqrt2`) and simplify, imported on
    first use."""
    import sympy
    from sympy.parsing import sympy_parser
    rules = (*sympy_parser.standard_transformations,
             sympy_parser.implicit_multiplication_application)
    return functools.partial(sympy_parser.parse_expr, transformations=rules), sympy.simplify


def _difference_is_zero(label: str, answer: str) -> bool:
    expression = f"({label})-({answer})"
    if not _evaluable(expression):
        return False
    parse, simplify = _sympy()
    try:
        # No alarm here, unlike upstream's main-thread branch: the pool's kill bounds this.
        return bool(simplify(parse(expression.replace("^", "**"))) == 0)
    except Exception:  # anything sympy cannot parse or simplify is a mismatch, as upstream
        return False


def _element_agrees(label: str, answer: str) -> bool:
    if _FRACTION.search(label) and _FRACTION.search(answer):
        return label == answer
    if _whole(label) != _whole(answer):
        return False
    return _difference_is_zero(label, answer)


def _loosely_equal(answer: str, label: str) -> bool:
    gold, given = _loose_form(label), _loose_form(answer)
    if gold == given:
        return True
    if not given:
        return False
    gold_parts, given_parts = _elements(gold), _elements(given)
    if len(gold_parts) > 1 and (gold[0], gold[-1]) != (given[0], given[-1]):
        return False  # `(1,2)` is not `[1,2]`
    return len(gold_parts) == len(given_parts) and all(
        _element_agrees(g, a) for g, a in zip(gold_parts, given_parts, strict=True))


# --- the verdict -----------------------------------------------------------------------------

def matches(answer: str | None, label: Any) -> bool:
    """Whether an extracted answer is right for the label (the grade in the module docstring)."""
    if answer is None or label is None:
        return False
    label = str(label)  # a dataset may hold numbers; upstream compares their text
    return _mathd_form(answer) == _mathd_form(label) or _loosely_equal(answer, label)


def accuracy(query: str, prompt: str | None, label: str | None) -> float:
    """1.0 when the query's last boxed answer is right for the label, else 0.0. Pure; meant for
    a killable worker (see the module docstring on time limits)."""
    return 1.0 if matches(boxed_answer(response_of(query, prompt)), label) else 0.0


def reward_func(queries: Sequence[str], prompts: Sequence[Any], labels: Sequence[Any],
                **kwargs: Any) -> dict[str, Any]:
    """Upstream's contract with plain lists. `math_accuracy` is per item, not upstream's batch
    mean: the server answers item by item, and a mean over items that arrived together is no
    fact of any one of them. Like upstream, items beyond the shortest list are ignored."""
    rewards = [accuracy(q, p, g) for q, p, g in zip(queries, prompts, labels, strict=False)]
    return {"rewards": rewards, "scores": list(rewards),
            "extra_logs": {"math_accuracy": list(rewards)}}
