"""The `openrlhf-m` profile's accuracy: math-verify called exactly as OpenRLHF-M's server calls
it, plus the shortcuts that give its verdict without doing all of its work.

The seed's rule (`decide`, the slow path, run as the seed runs it):

* the gold is parsed with math-verify's default LaTeX extraction, first match only; if nothing
  comes out, the item is not checked at all: GOLD_UNPARSED (the seed scores it 1);
* the whole response is parsed with the seed's answer settings: LaTeX only, `\\boxed{}` tried
  before anything else, no anchor-free extraction (a bare `5` is not an answer; `$5$`, `\\(5\\)`,
  `\\[5\\]` and `\\boxed{5}` are), units dropped, no repair of malformed operators;
* `verify(answer, gold)` — in that order, as the seed has it — decides MATCH or MISMATCH; an
  exception from it is VERIFY_RAISED (the seed scores it 1);
* math-verify's own timeouts are left at their defaults, as in the seed's server.

The shortcuts (`Checker.check`, the fast path) rest on how math-verify's first-match
extraction works: of the extraction patterns, the group with the best priority that matches
anywhere wins, and within it the match that ends last; that one match alone is parsed, and
what comes out depends only on that match's normalized LaTeX (and whether a percent sign
followed it). So:

* the match is found with math-verify's own patterns and normalized with its own function,
  without parsing (`Checker.key`); parsed answers are cached by that key, and verdicts by
  (key, gold);
* no match at all: math-verify has nothing to compare, MISMATCH;
* math-verify keeps the normalized LaTeX as a string beside the parsed value, and `verify`
  compares every pair, strings too: when the answer's string equals the gold's, the verdict
  is MATCH whatever sympy would say;
* plain numbers, and sets, intervals and tuples of them, are built as latex2sympy builds them
  (`plain_value`) instead of by its ANTLR parser (tens of milliseconds each), and then
  compared by math-verify's own `verify`;
* `$\\boxed{X}$` (how models write answers): the seed's answer settings leave the box in what
  latex2sympy gets, and latex2sympy reads `\\boxed{X}` as a set of one element, whose value is
  X's; for an X of the few shapes that cannot separate elements or make a relation
  (`unboxed`), X alone is parsed: the same value, in a tenth to a twentieth of the time (its
  grammar tries every set reading of the box first), the string beside it unchanged;
* anything else is parsed and compared by math-verify, once per key.

Tests run the fast and the slow path over the whole parity corpus, and over generated numbers,
and require the same verdict every time; another checks `plain_value` against latex2sympy.
Runs in the verifier workers (math-verify and sympy are imported here).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any

from podagent.rewards.verify import LRU

MATCH, MISMATCH = "match", "mismatch"
GOLD_UNPARSED, VERIFY_RAISED = "gold-unparsed", "verify-raised"
# How the worker got there (for the server's counters).
BY_GOLD, BY_NO_ANSWER, BY_EQUAL_TEXT = "gold", "no-answer", "equal"
BY_CACHE, BY_MATH_VERIFY = "cache", "verified"

GOLD_CACHE_SIZE = 4096
ANSWER_CACHE_SIZE = 4096  # parsed answers, by what was parsed (the same text recurs)
VERDICT_CACHE_SIZE = 1 << 15
# A bare `\boxed{` match runs to the last `}` of the response: such long keys are not cached
# (they seldom repeat, and would make the cache's memory depend on what clients send).
MAX_CACHED_KEY_CHARS = 2048

log = logging.getLogger("podagent.rewards")


@dataclass(frozen=True)
class Gold:
    parsed: list[Any]
    text: str  # math-verify's string beside the parsed value ("" when none)


# What math-verify hands to latex2sympy for one matched expression: the normalized LaTeX and
# whether a percent sign followed it. Equal tuples of these parse to equal answers.
Key = tuple[tuple[str, bool], ...]

# Plain numbers (possibly negative), and sets, intervals and tuples of them, alone or in one
# \boxed{}: their parse is built here (`plain_value`) instead of by latex2sympy's ANTLR parser,
# which takes tens of milliseconds for each.
_BOXED = re.compile(r"\\boxed\{(.*)\}", re.DOTALL)
_DECIMAL = re.compile(r"(-?)(\d{1,30}(?:\.\d{1,20})?)")
_FRACTION = re.compile(r"(-?)\\frac\{(-?)(\d{1,30})\}\{(\d{1,30})\}")


def _scalar(text: str) -> Any:
    import sympy

    text = text.strip()
    if m := _DECIMAL.fullmatch(text):
        sign, digits = m.groups()
        # As latex2sympy reads a number: leading zeros dropped, then sympy's Number (which
        # for these strings is Integer or Float, without its slow string parser).
        digits = digits.lstrip("0") or "0"
        value = sympy.Float(digits) if "." in digits else sympy.Integer(int(digits))
        if sign and value.is_zero:
            return None  # "-0.0": the sign of a zero is latex2sympy's business
        return -value if sign else value
    if m := _FRACTION.fullmatch(text):
        outer, inner_sign, numerator, denominator = m.groups()
        if int(denominator) == 0 or int(numerator) == 0:
            return None
        negative = bool(outer) != bool(inner_sign)
        return sympy.Rational(-int(numerator) if negative else int(numerator), int(denominator))
    return None


def _scalars(inner: str) -> list[Any] | None:
    values = [_scalar(part) for part in inner.split(",")]
    return None if any(v is None for v in values) else values


# What may stand in a box for `unboxed`: digits, a point, the arithmetic operators, powers,
# parentheses and braces, spaces, lowercase letters other than e, i and j (Euler's number and
# the imaginary unit are read apart), and these commands; nothing that separates set elements
# (commas, semicolons, \pm), makes a relation (=, <, \le, \in, ...), or opens an interval.
_UNBOXED = re.compile(r"\\boxed\{((?:[0-9.+\-*/^(){} a-dfghk-z]|\\(?:sqrt|d?frac|tfrac|pi|cdot"
                      r"|times)(?![a-zA-Z])){1,200})\}")


# The box takes 10 to 30 times its content's parse: a content that takes longer than this
# goes the seed's way, under math-verify's own timeout.
UNBOXED_BUDGET = 0.1


def unboxed(text: str) -> str | None:
    """X, when `text` is `\\boxed{X}` and X is of the shapes latex2sympy reads the same alone
    (`_UNBOXED`, its braces balanced); None otherwise. A test compares the two parses over
    generated Xs and the corpus."""
    found = _UNBOXED.fullmatch(text)
    if found is None:
        return None
    inner, depth = found.group(1), 0
    for char in inner:
        depth += (char == "{") - (char == "}")
        if depth < 0:  # `\boxed{1}+\boxed{2}`-like: the box closed early
            return None
    return inner if depth == 0 else None


def plain_value(text: str) -> Any:
    """latex2sympy's value for a plain number (`12`, `-4.25`, `\\frac{3}{4}`), a set of them
    (`\\{1, 2\\}`), an interval (`[1, 2)`; `(2, 1)` is a pair, as latex2sympy reads it) or
    a tuple (`(1, 2, 3)`), each alone or in one `\\boxed{}`; None for anything else. A test
    compares it with latex2sympy's own result over many of these, on each supported
    math-verify."""
    import sympy
    from latex2sympy2_extended.sets import FiniteSet  # latex2sympy's own, not sympy's

    boxed = _BOXED.fullmatch(text)
    inner = (boxed.group(1) if boxed else text).strip()
    if (value := _scalar(inner)) is not None:
        return value
    if inner.startswith("\\{") and inner.endswith("\\}") and len(inner) > 4:
        values = _scalars(inner[2:-2])
        return None if values is None else FiniteSet(*values)
    if len(inner) < 5 or inner[0] not in "([" or inner[-1] not in ")]":
        return None
    values = _scalars(inner[1:-1])
    if values is None or len(values) < 2:
        return None
    if len(values) > 2:
        return sympy.Tuple(*values) if inner[0] + inner[-1] == "()" else None
    left, right = values
    left_open, right_open = inner[0] == "(", inner[-1] == ")"
    # latex2sympy's rule: an interval that would be empty is a pair instead.
    if (left_open and right_open and right <= left) or (
            not left_open and not right_open and right < left):
        return sympy.Tuple(left, right)
    return sympy.Interval(left, right, left_open=left_open, right_open=right_open)


class Checker:
    """One per worker process: math-verify's configurations, parsed golds and answers, cached
    verdicts."""

    def __init__(self) -> None:
        from latex2sympy2_extended import NormalizationConfig
        from latex2sympy2_extended.math_normalization import normalize_latex
        from math_verify import LatexExtractionConfig, parse, verify
        from math_verify.parser import get_extraction_regexes

        from podagent.rewards import mvcompat

        # The seed's answer settings uses a normalization flag that math-verify 0.9 warns
        # about on every parse; the warning says nothing about this item.
        logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
        self._parse, self._verify, self._normalize = parse, verify, normalize_latex
        # What this math-verify parses one match's LaTeX by (None: no shortcut for boxes).
        self._parse_latex = mvcompat.latex_parser()
        self.gold_config = LatexExtractionConfig()
        self.answer_config = LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                nits=False, malformed_operators=False, basic_latex=True, equations=True,
                boxed=True, units=True),
            boxed_match_priority=0, try_extract_without_anchor=False)

        def patterns(config: Any) -> list[tuple[re.Pattern[str], int]]:
            return sorted(((pattern, priority)
                           for found, _ in get_extraction_regexes([config])
                           for pattern, priority in found), key=lambda p: p[1])

        self._answer_patterns = patterns(self.answer_config)
        self._gold_patterns = patterns(self.gold_config)
        self._golds = LRU(GOLD_CACHE_SIZE)
        self._answers = LRU(ANSWER_CACHE_SIZE)
        self._verdicts = LRU(VERDICT_CACHE_SIZE)
        self.gold_parses = 0

    # --- the slow path: the seed's own calls ----------------------------------------------------

    def parse_gold(self, gold: str) -> list[Any]:
        return self._parse(gold, extraction_mode="first_match",
                           extraction_config=[self.gold_config])

    def parse_answer(self, response: str) -> list[Any]:
        return self._parse(response, extraction_config=[self.answer_config],
                           extraction_mode="first_match")

    def compare(self, answer_parsed: list[Any], gold_parsed: list[Any]) -> str:
        try:
            return MATCH if self._verify(answer_parsed, gold_parsed) else MISMATCH
        except Exception as exc:  # the seed scores this 1; the server applies --strict
            log.warning("math-verify raised %s comparing an answer", type(exc).__name__)
            return VERIFY_RAISED

    def decide(self, response: str, gold: str) -> str:
        """The seed's verdict, computed the seed's way, without any cache."""
        gold_parsed = self.parse_gold(gold)
        if not gold_parsed:
            return GOLD_UNPARSED
        return self.compare(self.parse_answer(response), gold_parsed)

    # --- the fast path ----------------------------------------------------------------------------

    def key(self, text: str, gold: bool = False) -> Key | None:
        """What the one match math-verify's first-match extraction would parse in `text` comes
        to (`Key`), or None when nothing matches."""
        found = _first_match(text, self._gold_patterns if gold else self._answer_patterns)
        if found is None:
            return None
        config = (self.gold_config if gold else self.answer_config).normalization_config
        groups = found.groupdict()
        key = []
        for name, value in groups.items():
            if "_latex" not in name or not value:
                continue
            prefix, kind = name.split("_", 1)
            # As math-verify does: a bare \boxed{...} match keeps only its last box.
            use = replace(config, boxed="last") if kind == "latexBoxed" else config
            key.append((self._normalize(value, config=use), bool(groups.get(f"{prefix}_percent"))))
        return tuple(key)

    def _plain(self, key: Key | None) -> list[Any] | None:
        """math-verify's parse, built here, for one plain value (`plain_value`) without a
        percent sign."""
        if key is None or len(key) != 1 or key[0][1] or not key[0][0]:
            return None
        value = plain_value(key[0][0])
        return None if value is None else [value, key[0][0]]

    def _unboxed(self, key: Key | None) -> list[Any] | None:
        """math-verify's parse of one boxed match (`unboxed`), built from its content's parse:
        the value latex2sympy gives X, beside the match's own string. None when it does not
        apply or X does not parse (the slow path then decides as the seed does)."""
        if key is None or len(key) != 1 or key[0][1] or self._parse_latex is None:
            return None
        inner = unboxed(key[0][0])
        if inner is None:
            return None
        started = time.monotonic()
        try:
            value = self._parse_latex(inner)
        except Exception:
            return None
        if time.monotonic() - started > UNBOXED_BUDGET:
            # math-verify gives up on a parse past its timeout (5 s; the seed's answer is then
            # no answer): a content this slow could make the box slower than that.
            return None
        return None if value is None else [value, key[0][0]]

    def gold(self, gold: str) -> Gold:
        found = self._golds.get(gold)
        if found is None:
            self.gold_parses += 1
            parsed = self._plain(self.key(gold, gold=True)) or self.parse_gold(gold)
            found = Gold(parsed, next((p for p in parsed if isinstance(p, str)), ""))
            self._golds.put(gold, found)
        return found

    def answer(self, key: Key, response: str) -> list[Any]:
        parsed = self._answers.get(key)
        if parsed is None:
            parsed = self._plain(key) or self._unboxed(key) or self.parse_answer(response)
            self._answers.put(key, parsed)
        return parsed

    def check(self, response: str, gold: str) -> tuple[str, str]:
        """(verdict, how): the seed's verdict by the cheapest route that gives it."""
        found = self.gold(gold)
        if not found.parsed:
            return GOLD_UNPARSED, BY_GOLD
        key = self.key(response)
        if key is None:  # math-verify would compare an empty list: no pair, no match
            return MISMATCH, BY_NO_ANSWER
        cacheable = sum(len(text) for text, _ in key) + len(gold) <= MAX_CACHED_KEY_CHARS
        cached = self._verdicts.get((key, gold)) if cacheable else None
        if cached is not None:
            return cached, BY_CACHE
        # verify() compares every pair, strings too: equal strings are a match.
        text = key[0][0].strip() if len(key) == 1 else ""
        if text and text == found.text.strip():
            verdict, how = MATCH, BY_EQUAL_TEXT
        else:
            verdict = self.compare(self.answer(key, response) if cacheable
                                   else self.parse_answer(response), found.parsed)
            how = BY_MATH_VERIFY
        if cacheable:
            self._verdicts.put((key, gold), verdict)
        return verdict, how


def _first_match(text: str, patterns: list[tuple[re.Pattern[str], int]]) -> re.Match[str] | None:
    """The match math-verify's first-match extraction parses: of the patterns, the best
    priority that matches anywhere; in it, the match that ends last; of those, the one that
    starts first; of those, the one found first."""
    for _, group in groupby(patterns, key=lambda p: p[1]):
        best = None
        for pattern, _ in group:
            for m in pattern.finditer(text):
                if best is None or (m.end(), -m.start()) > (best.end(), -best.start()):
                    best = m
        if best is not None:
            return best
    return None


# --- the worker side of the pool ---------------------------------------------------------------

_CHECKER: Checker | None = None


def checker() -> Checker:
    global _CHECKER
    if _CHECKER is None:
        _CHECKER = Checker()
    return _CHECKER


def worker_check_group(gold: str, responses: list[str]) -> tuple[list[tuple[str, str]], int]:
    """Run in a pool worker: one gold, several responses (GRPO's samples of one prompt).
    The verdicts and how many golds this call parsed (0 or 1)."""
    return worker_check_pairs([(gold, response) for response in responses])


def worker_check_pairs(pairs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], int]:
    """Run in a pool worker: (gold, response) pairs, a prompt's samples next to each other
    (each gold is parsed once). The verdicts and how many golds this call parsed."""
    c = checker()
    before = c.gold_parses
    verdicts = [c.check(response, gold) for gold, response in pairs]
    return verdicts, c.gold_parses - before


_WARM_UP = (("$\\frac{\\sqrt{2}}{2}$", "<think>x</think><answer>$\\frac{1}{\\sqrt{2}}$</answer>"),
            ("$x^2+2x+1$", "so \\boxed{(x+1)^2}"), ("$(-\\infty, 2]$", "\\boxed{x \\le 2}"),
            ("$\\{1, \\pi\\}$", "\\boxed{\\{\\pi, 1\\}}"), ("$3$", "\\boxed{x = 3}"))


_WARM = False


def worker_warm() -> None:
    """Runs the seed's calls on a few items so that a worker's first real ones are not slow
    (once per process: a worker forked from the warm forkserver finds it done)."""
    global _WARM
    if _WARM:
        return
    c = checker()
    for gold, response in _WARM_UP:
        c.decide(response, gold)
    _WARM = True
