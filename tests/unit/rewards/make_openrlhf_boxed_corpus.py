"""Writes openrlhf_boxed_corpus.jsonl: items scored by upstream OpenRLHF's own math reward function.

    python tests/unit/rewards/make_openrlhf_boxed_corpus.py --upstream DIR [--out FILE]

DIR is a checkout of OpenRLHF, or any directory holding its `examples/python/math_reward_func.py`
and `openrlhf/utils/math_utils.py`. The corpus committed here was made from OpenRLHF commit
3c3be6234e0cb353e76bb8019947db9dfe99fca7 (2026-08-13), with sympy 1.14.0 and pylatexenc 2.11.

Nothing of upstream is imported from this repository or copied into it: `math_utils.py` is loaded
by path, a stand-in `openrlhf.utils` module hands its `extract_boxed_answer` and `grade_answer`
to `math_reward_func.py`, which then runs unchanged (it needs torch). Each item is scored on its
own, by `reward_func([query], [prompt], [label])` called in a worker thread as OpenRLHF's trainer
calls it (so upstream's SIGALRM branch is off, as in the field), with its per-item print
silenced. The threads run in a pool of processes that are killed when an item takes longer than
--timeout; such an item would hang upstream's trainer and is left out of the corpus (named on
stderr). Only the resulting rewards are kept, as data.

The items are hand-written edge cases plus a generator with a fixed seed; `covers` says what
each exercises. At the end, podagent's own `openrlhf_boxed.accuracy` is run over the corpus and
any item where it differs is named (the test then fails on it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import io
import json
import random
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "openrlhf_boxed_corpus.jsonl"
SEED = 20240613
GENERATED = 330  # items drawn by the seeded generator

REWARD_FILE = Path("examples/python/math_reward_func.py")
UTILS_FILE = Path("openrlhf/utils/math_utils.py")


# --- upstream, run as shipped ------------------------------------------------------------------

def load_upstream(root: Path) -> Callable[..., dict]:
    """Upstream's `reward_func`, its `openrlhf.utils` import served by a stand-in module."""
    spec = importlib.util.spec_from_file_location("upstream_math_utils", root / UTILS_FILE)
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    package = types.ModuleType("openrlhf")
    package.__path__ = []
    stand_in = types.ModuleType("openrlhf.utils")
    stand_in.extract_boxed_answer = utils.extract_boxed_answer
    stand_in.grade_answer = utils.grade_answer
    package.utils = stand_in
    sys.modules.update({"openrlhf": package, "openrlhf.utils": stand_in})
    spec = importlib.util.spec_from_file_location("upstream_math_reward_func", root / REWARD_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward_func


_upstream: Callable[..., dict] | None = None


def _start_worker(root: str) -> None:
    global _upstream
    _upstream = load_upstream(Path(root))


def upstream_reward(query: str, prompt: str | None, label: str | None) -> float:
    """One item through upstream's function, in a thread (runs inside a pool worker)."""
    result: dict = {}

    def call() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            result.update(_upstream([query], [prompt], [label]))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join()
    if "rewards" not in result:
        raise RuntimeError("upstream's reward_func raised (see the worker's stderr)")
    (reward,) = result["rewards"].tolist()
    return float(reward)


# --- the items ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    covers: str
    query: str
    prompt: str | None
    label: str | None


SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
QUESTIONS = (
    "What is the value of the expression?", "Find the answer to the problem below.",
    "Compute the requested quantity.", "Solve for the unknown.", "Simplify the expression.",
)


def chat_prompt(question: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def reasoning(rng: random.Random) -> str:
    """A short, plausible chain of thought with numbers in it (none boxed)."""
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    steps = [f"First, note that {a} + {b} = {a + b}.", f"Then {a} \\times {b} = {a * b}.",
             "We check the boundary cases separately.", f"Dividing, we get $\\frac{{{a}}}{{{b}}}$.",
             "<think>\nLet me reconsider the second step.\n</think>", "So the sum simplifies."]
    return "\n".join(rng.sample(steps, rng.randint(1, 4)))


def with_answer(rng: random.Random, box: str) -> str:
    """A response that ends in `box` (already written as `\\boxed{...}` or not)."""
    style = rng.randrange(4)
    body = reasoning(rng)
    if style == 0:
        return f"{body}\nTherefore, the final answer is $\\boxed{{{box}}}$."
    if style == 1:
        return f"{body}\n\n**Final Answer**\n\\[\n\\boxed{{{box}}}\n\\]"
    if style == 2:
        return f"{body}\nThe answer is \\boxed{{{box}}}.<|im_end|>"
    return f"\\boxed{{{box}}}"


def framed(rng: random.Random, covers: str, response: str, label: str | None,
           mode: str = "chat") -> Item:
    """`response` placed in a query the way `mode` says, with a prompt to match."""
    prompt = chat_prompt(rng.choice(QUESTIONS))
    if mode == "chat":  # what the trainer sends: the query starts with the prompt
        return Item(covers, prompt + response, prompt, label)
    if mode == "null":
        return Item(covers, prompt + response, None, label)
    if mode == "absent":  # the prompt as sent differs from the one in the query
        return Item(covers, prompt + response, prompt.replace("\n", " \n"), label)
    if mode == "later":  # found further in: the cut by length leaves its tail in the response
        return Item(covers, "<|endoftext|>" + prompt + response, prompt, label)
    raise ValueError(mode)


# (covers, label, what the model boxed): graded in a framed query.
PAIRS: tuple[tuple[str, str, str], ...] = (
    # integers
    ("int/equal", "42", "42"), ("int/wrong", "42", "43"), ("int/leading-zero", "42", "042"),
    ("int/trailing-zero-decimal", "42", "42.0"), ("int/plus-sign", "42", "+42"),
    ("int/negative", "-3", "-3"), ("int/negative-space", "-3", "- 3"),
    ("int/sign-wrong", "-3", "3"), ("int/unicode-minus", "-3", "−3"),
    ("int/near-float", "3", "3.0000000001"), ("int/near-float-below", "3", "2.99999999"),
    ("int/float-off", "3", "3.001"), ("int/scientific", "1000", "1e3"),
    ("int/underscore", "1000", "1_000"), ("int/braced", "7", "{7}"),
    ("int/double-braced", "7", "{{7}}"), ("int/zero-neg", "0", "-0"),
    # thousands separators
    ("comma/thousands", "1000", "1,000"), ("comma/millions", "1000000", "1,000,000"),
    ("comma/label-has", "1,000", "1000"), ("comma/decimal", "1234", "1,234.0"),
    ("comma/misplaced", "123", "1,23"), ("comma/truncation", "1000", "1,000.99999999"),
    ("comma/thin-space", "1000", "1,\\!000"), ("comma/wrong-value", "12345", "12,346"),
    ("comma/space-group", "1000000", "1 000 000"),
    # decimals and one half
    ("half/frac12", "0.5", "\\frac12"), ("half/frac-braced", "0.5", "\\frac{1}{2}"),
    ("half/label-frac", "\\frac{1}{2}", "0.5"), ("half/slash", "0.5", "1/2"),
    ("half/dot5", ".5", "0.5"), ("half/dot5-answer", "0.5", ".5"),
    ("half/trailing-zero", "0.5", "0.50"), ("half/label-slash", "1/2", "0.5"),
    ("half/label-unit", "\\frac{1}{2}\\text{ liters}", "0.5"),  # only `0.5` -> 1/2 decides
    ("decimal/quarter-frac", "0.25", "\\frac14"), ("decimal/quarter-slash", "0.25", "1/4"),
    ("decimal/equal", "3.14", "3.14"), ("decimal/trailing-zero", "3.14", "3.140"),
    ("decimal/three-halves", "1.5", "\\frac{3}{2}"), ("decimal/three-halves-slash", "1.5", "3/2"),
    ("decimal/rounded", "0.333", "\\frac{1}{3}"), ("decimal/third", "\\frac{1}{3}", "0.3333"),
    ("decimal/repeating", "0.\\overline{3}", "\\frac{1}{3}"),
    # fractions
    ("frac/dfrac", "\\frac{3}{4}", "\\dfrac{3}{4}"),
    ("frac/tfrac-short", "\\frac{3}{4}", "\\tfrac34"),
    ("frac/slash", "\\frac{3}{4}", "3/4"), ("frac/label-slash", "3/4", "\\frac{3}{4}"),
    ("frac/unreduced", "\\frac{6}{8}", "\\frac{3}{4}"), ("frac/unreduced-slash", "6/8", "3/4"),
    ("frac/neg-numerator", "\\frac{-1}{2}", "-\\frac{1}{2}"),
    ("frac/neg-slash", "-1/2", "-\\frac12"), ("frac/neg-denominator", "\\frac{1}{-2}", "-1/2"),
    ("frac/equal-value", "\\frac{1}{2}", "\\frac{2}{4}"),
    ("frac/reciprocal", "\\frac{3}{4}", "\\frac{4}{3}"),
    ("frac/short-one-brace", "\\frac{1}{2}", "\\frac1{2}"),
    ("frac/dangling", "\\frac{1}{2}", "\\frac1"),
    ("frac/trailing-frac", "5", "5\\frac"),
    ("frac/nested", "\\frac{\\frac{1}{2}}{3}", "\\frac{1}{6}"),
    ("frac/slash-spaces", "3/4", "3 / 4"), ("frac/slash-leading-zero", "3/4", "03/4"),
    ("frac/a-over-b-letters", "\\frac{a}{b}", "a/b"),
    # mixed numbers
    ("mixed/latex", "2\\frac{1}{2}", "\\frac{5}{2}"), ("mixed/space", "2 1/2", "5/2"),
    ("mixed/label-improper", "\\frac{22}{3}", "7\\frac{1}{3}"),
    ("mixed/plus", "2\\frac{1}{2}", "2+\\frac{1}{2}"),
    ("mixed/three-numbers", "123", "1 2 3"), ("mixed/decimal", "2\\frac{1}{2}", "2.5"),
    # percentages, dollars, degrees
    ("percent/latex", "50\\%", "50"), ("percent/answer-only", "50", "50\\%"),
    ("percent/vs-fraction", "50\\%", "0.5"), ("percent/decimal", "12.5\\%", "12.5"),
    ("percent/plain-sign", "25%", "25"), ("percent/wrong", "50\\%", "5"),
    ("percent/escaped-twice", "50", "50\\\\\\%%\\text{ of total}"),
    ("percent/double-backslash", "50", "50\\\\%"),
    ("dollar/latex", "\\$5", "5"), ("dollar/cents", "5", "\\$5.00"),
    ("dollar/thousands", "\\$1,000", "1000"),
    ("dollar/math-mode", "$5$", "5"), ("dollar/decimal", "\\$4.50", "4.5"),
    ("dollar/wrong", "\\$5", "\\$6"),
    ("degree/circ", "90^\\circ", "90"), ("degree/circ-braced", "90", "90^{\\circ}"),
    ("degree/circ-answer", "45", "45^\\circ"), ("degree/word", "30 degrees", "30"),
    ("degree/text-word", "30", "30^\\circ\\text{ degrees}"),
    ("degree/wrong", "60^\\circ", "30^\\circ"),
    ("degree/space-circ", "60", "60 ^ \\circ"),
    # unit words
    ("unit/cm", "5 cm", "5"), ("unit/text-cm", "5", "5\\text{ cm}"),
    ("unit/meters", "12", "12 meters"),
    ("unit/hours", "3", "3 hours"), ("unit/text-inches", "10", "10\\text{ inches}"),
    ("unit/feet", "4", "4 feet"), ("unit/squared", "25\\text{ cm}^2", "25"),
    ("unit/cm2", "6", "6 cm^2"),
    ("unit/text-miles", "100", "100 \\text{ miles}"), ("unit/days", "2", "2 days"),
    ("unit/weeks", "7", "7 weeks"), ("unit/two-texts", "5", "5\\text{ m}\\text{ s}"),
    ("unit/different", "5 cm", "5 meters"), ("unit/inside-word", "Monday", "Mon"),
    ("unit/joined-after-removal", "5", "5 mimeterles"),  # `meter` goes, then `miles`
    ("unit/yards", "9", "9 yards"), ("unit/seconds", "2.5", "2.5 seconds"),
    ("unit/unknown-word", "5", "5 kg"), ("unit/minutes-wrong", "15", "20 minutes"),
    # \text
    ("text/choice", "\\text{(A)}", "(A)"), ("text/word", "\\text{Monday}", "Monday"),
    ("text/answer", "A", "\\text{A}"), ("text/yes", "\\text{yes}", "yes"),
    ("text/case", "Yes", "yes"),
    ("text/choice-letter", "\\text{(C)}", "C"), ("text/textbf", "\\textbf{(B)}", "(B)"),
    ("text/mbox", "5", "\\mbox{5}"), ("text/space-unit-only", "\\text{ cm}", "\\text{ m}"),
    ("text/inner-spaces", "\\text{ even }", "even"),
    # large numbers in words
    ("million/word", "3 million", "3000000"), ("million/text", "3000000", "3\\text{ million}"),
    ("million/billion-times", "2 billion", "2\\times10^9"),
    ("million/trillion", "1 trillion", "10^{12}"),
    # roots
    ("sqrt/short", "\\sqrt{2}", "\\sqrt2"), ("sqrt/coefficient", "2\\sqrt{3}", "2\\sqrt3"),
    ("sqrt/simplified", "\\sqrt{8}", "2\\sqrt{2}"),
    ("sqrt/over-two", "\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"),
    ("sqrt/slash", "\\sqrt{3}/2", "\\frac{\\sqrt{3}}{2}"),
    ("sqrt/decimal", "\\sqrt{2}", "1.41421356"),
    ("sqrt/cube-root", "\\sqrt[3]{2}", "\\sqrt{2}"), ("sqrt/dangling", "2", "2\\sqrt"),
    ("sqrt/dangling-after-equals", "y=\\sqrt", "\\sqrt"),
    ("sqrt/word", "\\sqrt{5}", "sqrt(5)"), ("sqrt/wrong", "\\sqrt{5}", "\\sqrt{6}"),
    ("sqrt/rationalized", "\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
    # pi, infinity
    ("pi/word", "\\pi", "pi"), ("pi/coefficient", "2\\pi", "2pi"),
    ("pi/half", "\\frac{\\pi}{2}", "\\pi/2"),
    ("pi/decimal", "\\pi", "3.14159"), ("pi/unicode", "π", "\\pi"),
    ("pi/times-r2", "4\\pi", "4 \\cdot \\pi"),
    ("inf/equal", "\\infty", "\\infty"), ("inf/word", "\\infty", "infinity"),
    ("inf/unicode", "∞", "\\infty"),
    ("inf/negative", "-\\infty", "-\\infty"),
    # intervals, tuples, sets
    ("interval/spaces", "(-\\infty, 3)", "(-\\infty,3)"),
    ("interval/half-open", "[2,\\infty)", "[2, \\infty)"),
    ("interval/bracket-mismatch", "(-\\infty, 3)", "(-\\infty, 3]"),
    ("interval/closed", "[1,2]", "[1, 2]"),
    ("interval/union", "(-\\infty,1)\\cup(2,\\infty)", "(-\\infty,1) \\cup (2,\\infty)"),
    ("interval/x-in", "[1,2]", "x \\in [1,2]"), ("tuple/spaces", "(1,2)", "(1, 2)"),
    ("tuple/brackets", "(1,2)", "[1,2]"), ("tuple/order", "(1,2)", "(2,1)"),
    ("tuple/bare", "(1,2)", "1,2"),
    ("tuple/label-bare", "1,2", "(1,2)"), ("tuple/left-right", "(3, -1)", "\\left(3,-1\\right)"),
    ("tuple/length", "(1,2,3)", "(1,2)"), ("tuple/fraction-element", "(0.5, 1)", "(\\frac12, 1)"),
    ("tuple/frac-elements", "(\\frac{1}{2}, 3)", "(1/2, 3)"), ("tuple/letters", "(a, b)", "(a,b)"),
    ("tuple/expression", "(2, 2\\sqrt{2})", "(2, \\sqrt{8})"),
    ("tuple/close-mismatch", "(1,2)", "(1,2]"),
    ("tuple/nested", "((1,2),(3,4))", "((1,2),(3,4))"),
    ("tuple/nested-spaces", "((1,2),(3,4))", "((1, 2), (3, 4))"),
    ("tuple/decimal-int", "(1,2)", "(1.0, 2)"), ("tuple/thousands", "(1,000, 2)", "(1000, 2)"),
    ("set/braces", "\\{1,2\\}", "\\{1, 2\\}"), ("set/order", "\\{1,2\\}", "\\{2,1\\}"),
    ("set/bare-order", "1, 2", "2, 1"), ("set/bare", "1,2,3", "1, 2, 3"),
    ("set/vs-tuple", "\\{1,2\\}", "(1,2)"),
    # or / and lists
    ("list/or", "2 or 3", "2, 3"), ("list/and", "2, 3", "2 and 3"),
    ("list/x-equals", "x=2 or x=3", "2,3"),
    ("list/or-order", "2 or 3", "3, 2"), ("list/text-and", "2 \\text{ and } 3", "2, 3"),
    # equations
    ("eq/x-label", "x=3", "3"), ("eq/x-answer", "3", "x=3"), ("eq/y-line", "y=2x+1", "2x+1"),
    ("eq/spaced", "y = 2x+1", "y=2x+1"), ("eq/long-left", "abc=5", "5"),
    ("eq/sum-left", "x+y=5", "5"),
    ("eq/two-equals", "3", "x=y=3"), ("eq/wrong", "x=3", "x=4"), ("eq/space-left", "3", "x =3"),
    ("eq/swapped", "x=3", "3=x"), ("eq/f-of-x", "f(x)=x^2", "x^2"),
    # expressions with letters
    ("poly/square", "x^2+2x+1", "(x+1)^2"), ("poly/square-braced", "x^2+2x+1", "(x+1)^{2}"),
    ("poly/commute", "2x+3", "3+2x"), ("poly/two-letters", "a+b", "b+a"),
    ("poly/three-letters", "a+b+c", "c+b+a"),
    ("poly/difference", "x^2-1", "(x-1)(x+1)"), ("poly/wrong", "x^2-1", "(x-1)^2"),
    ("poly/implicit-times", "2xy", "2yx"), ("poly/frac-letters", "\\frac{x}{2}", "x/2"),
    ("poly/letter-case", "X+1", "x+1"), ("poly/function-name", "\\sin x", "sin(x)"),
    ("poly/cos-pi", "-1", "\\cos(\\pi)"), ("poly/log", "3", "\\log_2 8"),
    ("poly/ln", "\\ln 2", "ln(2)"),
    ("poly/e", "e^2", "e*e"),
    # exponents: some refused before sympy
    ("exp/power-ok", "256", "2^8"), ("exp/two-digit", "1024", "2^10"),
    ("exp/braced", "1024", "2^{10}"),
    ("exp/paren", "8", "2^(3)"), ("exp/tower", "16", "2^2^2"),
    ("exp/letter-two-digit", "x^{10}", "x^10"),
    ("exp/double-star", "8", "2**3"), ("exp/scientific", "3\\times10^5", "300000"),
    ("exp/label-braced", "2^{8}", "256"), ("exp/e-power", "e^{i\\pi}", "-1"),
    # LaTeX pylatexenc renders oddly
    ("latex/binom", "10", "\\binom{5}{2}"), ("latex/binom-digits", "52", "\\binom{5}{2}"),
    ("latex/mathbf", "5", "\\mathbf{5}"), ("latex/overline", "3", "\\overline{3}"),
    ("latex/displaystyle", "5", "\\displaystyle 5"), ("latex/le", "x \\le 3", "x \\leq 3"),
    ("latex/cdot", "6", "2 \\cdot 3"), ("latex/times", "6", "2\\times 3"),
    ("latex/dots", "1,2,\\dots", "1,2,\\ldots"),
    ("latex/double-backslash", "\\\\frac{1}{2}", "\\frac{1}{2}"),
    ("latex/thin-space", "1000", "1\\,000"),
    ("latex/boxed-inside", "5", "\\boxed{5}"), ("latex/angle", "\\angle A", "A"),
    ("latex/circ-word", "\\circ", "o"), ("latex/emph", "\\emph{even}", "even"),
    ("latex/input", "0", "\\input{answer}"), ("latex/unknown-macro", "5", "\\foo{5}"),
    ("latex/escaped-brace", "\\{5\\}", "5"),
    # empty and None-like
    ("empty/both", "", ""), ("empty/label", "", "5"), ("empty/answer", "5", ""),
    ("empty/spaces-label", " ", ""), ("empty/dollar-percent", "$", "\\%"),
    ("none/word-both", "None", "None"), ("none/case", "none", "None"),
    ("none/null", "null", "null"),
    ("none/nan", "nan", "nan"), ("none/inf", "inf", "inf"), ("none/nan-case", "NaN", "nan"),
    ("none/label-word", "None", "0"),
    # unicode
    ("unicode/half", "½", "1/2"), ("unicode/sqrt", "√2", "\\sqrt{2}"),
    ("unicode/fullwidth", "３", "3"),
    ("unicode/arabic-digit", "٣", "3"), ("unicode/superscript", "x²", "x^2"),
    ("unicode/times", "2×3", "6"),
    ("unicode/cdot", "2·3", "6"), ("unicode/union", "A∪B", "A \\cup B"),
    ("unicode/chinese", "三", "3"),
    ("unicode/letters-count", "αβγ", "αβγ"),
    # whitespace and newlines
    ("space/padded", " 5 ", "5"), ("space/newline-label", "5\n", "5"),
    ("space/newline-answer", "5", "\n5\n"),
    ("space/frac-newline", "\\frac{1}\n{2}", "\\frac12"), ("space/tab", "5", "5\t"),
    ("space/text-newline", "\\text{yes}\n", "yes"),
    ("space/inner", "x + 1", "x+1"),
    ("space/text-newline-unit", "\\text{2--3 cm}\n", "2--3"),  # `$` matches before a final \n
)

COT = ("Let's think step by step.\nThe store sells pencils in packs of 4, and Ana buys 3 packs, "
       "so she has $3 \\times 4 = 12$ pencils.\nShe gives away none of them, so the count stays "
       "at 12.\nLet me verify: $4 + 4 + 4 = 12$. Correct.\n\nTherefore, the final answer is "
       "{final}.")

# (covers, response, label, mode): where the answer is, or is not, found.
EXTRACTION: tuple[tuple[str, str, str, str], ...] = (
    ("box/none", "The answer is 5.", "5", "chat"),
    ("box/none-dollar", "So we get $5$.", "5", "chat"),
    ("box/fbox", "So \\fbox{5}.", "5", "chat"),
    ("box/fbox-after-boxed", "First \\boxed{5}, then \\fbox{6}.", "5", "chat"),
    ("box/fbox-after-boxed-wrong", "First \\boxed{4}, then \\fbox{5}.", "5", "chat"),
    ("box/boxed-after-fbox", "\\fbox{4} then \\boxed{5}", "5", "chat"),
    ("box/nested-braces", "\\boxed{\\frac{1}{2}}", "\\frac12", "chat"),
    ("box/nested-deep", "\\boxed{\\left(\\frac{1}{2}, \\sqrt{3}\\right)}", "(\\frac12, \\sqrt3)",
     "chat"),
    ("box/unclosed", "So \\boxed{5", "5", "chat"),
    ("box/unclosed-inner", "So \\boxed{{5}", "5", "chat"),
    ("box/extra-close", "So \\boxed{5}}.", "5", "chat"),
    ("box/several-last", "Maybe \\boxed{3}. No: \\boxed{5}.", "5", "chat"),
    ("box/several-first", "Maybe \\boxed{3}. No: \\boxed{5}.", "3", "chat"),
    ("box/last-unclosed", "So \\boxed{5}. Wait, \\boxed{", "5", "chat"),
    ("box/last-empty", "So \\boxed{5}. Put it in \\boxed{}", "5", "chat"),
    ("box/space-no-brace", "So \\boxed 5.", "5", "chat"),
    ("box/space-then-brace", "So \\boxed {5}.", "5", "chat"),
    ("box/no-brace-later-brace", "\\boxed 5 and {5}", "5", "chat"),
    ("box/bare-word", "\\boxed5", "5", "chat"),
    ("box/longer-macro", "\\boxedx{5}", "5", "chat"),
    ("box/boxed-in-boxed", "\\boxed{\\boxed{5}}", "5", "chat"),
    ("box/double-backslash", "\\\\boxed{5}", "5", "chat"),
    ("box/escaped-brace", "\\boxed{a\\}b}", "a\\", "chat"),
    ("box/close-before-open", "\\boxed}{5}", "5", "chat"),
    ("box/in-dollars", "$\\boxed{5}$", "5", "chat"),
    ("box/display-math", "\\[\\boxed{x=5}\\]", "5", "chat"),
    ("box/text-unit", "\\boxed{\\text{5 cm}}", "5", "chat"),
    ("box/multiline", "\\boxed{\n5\n}", "5", "chat"),
    ("box/empty", "\\boxed{}", "", "chat"),
    ("box/empty-wrong", "\\boxed{}", "0", "chat"),
    ("box/answer-tags", "<answer>5</answer>", "5", "chat"),
    ("box/answer-tags-boxed", "<think>t</think><answer>\\boxed{5}</answer>", "5", "chat"),
    ("box/unicode-text", "答案是 \\boxed{5}。", "5", "chat"),
    ("box/long-tail", "\\boxed{5}" + " and more text" * 40, "5", "chat"),
    ("label/none", "\\boxed{5}", None, "chat"),
    # chains of thought as a GRPO rollout writes them
    ("cot/right", COT.format(final="\\boxed{12}"), "12", "chat"),
    ("cot/wrong", COT.format(final="\\boxed{13}"), "12", "chat"),
    ("cot/fraction", COT.format(final="\\boxed{\\dfrac{24}{2}}"), "12", "chat"),
    ("cot/unboxed-final", COT.format(final="12"), "12", "chat"),
    ("cot/intermediate-box", "We have \\boxed{7} so far. " + COT.format(final="12"), "12", "chat"),
    ("cot/think-box", "<think>\n" + COT.format(final="\\boxed{11}") + "\n</think>\n"
     "The answer is $\\boxed{12}$.", "12", "chat"),
    ("cot/truncated", COT.format(final="\\boxed{1")[:-40], "12", "chat"),
    ("cot/unit-answer", COT.format(final="\\boxed{12 \\text{ apples}}"), "12", "chat"),
    ("cot/null-prompt", COT.format(final="\\boxed{12}"), "12", "null"),
)


def prompt_cases(rng: random.Random) -> Iterator[Item]:
    """Where the response starts: prompt at the start, found further in, absent, null."""
    right, wrong = "\\boxed{5}", "\\boxed{4}"
    for mode in ("chat", "null", "absent", "later"):
        yield framed(rng, f"prompt/{mode}-right", f"So {right}.", "5", mode)
        yield framed(rng, f"prompt/{mode}-wrong", f"So {wrong}.", "5", mode)
        yield framed(rng, f"prompt/{mode}-no-box", "So it is 5.", "", mode)
    # The instruction's empty box: outside the response unless the whole query is graded.
    example = ("<|im_start|>user\nAnswer in \\boxed{5} form, e.g. 5.<|im_end|>\n"
               "<|im_start|>assistant\n")
    for covers, query, prompt, label in (
        ("prompt/box-in-prompt-start", example + "It is 5.", example, "5"),
        ("prompt/box-in-prompt-absent", example + "It is 5.", example + " ", "5"),
        ("prompt/box-in-prompt-null", example + "It is 5.", None, "5"),
        ("prompt/box-in-prompt-empty", "It is 5. " + example, "", "5"),
        # found further in: the cut keeps the prompt's last 80 characters, with its box
        ("prompt/box-in-prompt-later", "x" * 80 + example + "It is 5.", example, "5"),
        ("prompt/system-box-later", "x" * 200 + chat_prompt("Q") + "So 5.", chat_prompt("Q"), ""),
        ("prompt/box-in-prompt-later-short", "x" + example + "It is 5.", example, "5"),
        ("prompt/twice", example + example + "It is 4.", example, "5"),
        ("prompt/is-query", example, example, "5"),
        ("prompt/longer-than-query", "\\boxed{5}", "\\boxed{5} and more", "5"),
        ("prompt/system-box", chat_prompt("Q") + "So 5.", chat_prompt("Q"), ""),
        ("prompt/system-box-null", chat_prompt("Q") + "So 5.", None, ""),
    ):
        yield Item(covers, query, prompt, label)


def hand_cases(rng: random.Random) -> Iterator[Item]:
    modes = ("chat", "chat", "chat", "null", "absent", "later")
    for n, (covers, label, box) in enumerate(PAIRS):
        yield framed(rng, covers, with_answer(rng, box), label, modes[n % len(modes)])
    for covers, response, label, mode in EXTRACTION:
        yield framed(rng, covers, response, label, mode)
    yield from prompt_cases(rng)


# --- the seeded generator ----------------------------------------------------------------------

def _int_item(rng: random.Random) -> tuple[str, str, str]:
    n = rng.choice((rng.randint(-50, 50), rng.randint(100, 999), rng.randint(1000, 10**7)))
    label = str(n)
    forms = {
        "same": str(n), "off-by-one": str(n + rng.choice((-1, 1))), "commas": f"{n:,}",
        "point-zero": f"{n}.0", "dollar": f"\\${n}", "percent": f"{n}\\%", "unit": f"{n} cm",
        "x-equals": f"x = {n}", "text": f"\\text{{{n}}}", "negated": str(-n) if n else "1",
        "frac-over-one": f"\\frac{{{n}}}{{1}}", "times-ten": str(n * 10),
    }
    kind = rng.choice(sorted(forms))
    if rng.random() < 0.3:  # labels as datasets write them
        label = rng.choice((f"{n:,}", f"\\${n}", f"{n}^\\circ", str(n)))
    return f"gen/int-{kind}", label, forms[kind]


def _fraction_item(rng: random.Random) -> tuple[str, str, str]:
    q = rng.randint(2, 12)
    p = rng.choice([k for k in range(1, 3 * q) if k % q])
    label = rng.choice((f"\\frac{{{p}}}{{{q}}}", f"{p}/{q}", f"\\dfrac{{{p}}}{{{q}}}"))
    k = rng.randint(2, 4)
    forms = {
        "same": f"\\frac{{{p}}}{{{q}}}", "dfrac": f"\\dfrac{{{p}}}{{{q}}}", "slash": f"{p}/{q}",
        "decimal": f"{p / q:.4f}".rstrip("0"), "unreduced": f"\\frac{{{p * k}}}{{{q * k}}}",
        "reciprocal": f"\\frac{{{q}}}{{{p}}}", "negative": f"-\\frac{{{p}}}{{{q}}}",
        "short": f"\\frac{p}{q}" if p < 10 and q < 10 else f"\\frac{{{p}}}{{{q}}}",
    }
    kind = rng.choice(sorted(forms))
    return f"gen/frac-{kind}", label, forms[kind]


def _tuple_item(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(-9, 9), rng.randint(-9, 9)
    label = f"({a}, {b})"
    forms = {
        "same": f"({a},{b})", "square": f"[{a},{b}]", "swapped": f"({b},{a})", "bare": f"{a}, {b}",
        "left-right": f"\\left({a}, {b}\\right)", "one-off": f"({a},{b + 1})",
        "decimal": f"({a}.0, {b})",
    }
    kind = rng.choice(sorted(forms))
    return f"gen/tuple-{kind}", label, forms[kind]


def _root_item(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(2, 6), rng.choice((2, 3, 5, 6, 7))
    label = f"{a}\\sqrt{{{b}}}"
    forms = {
        "same": f"{a}\\sqrt{{{b}}}", "short": f"{a}\\sqrt{b}", "inside": f"\\sqrt{{{a * a * b}}}",
        "wrong": f"{a + 1}\\sqrt{{{b}}}", "times": f"{a} \\cdot \\sqrt{{{b}}}",
    }
    kind = rng.choice(sorted(forms))
    return f"gen/sqrt-{kind}", label, forms[kind]


def _poly_item(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(1, 5), rng.randint(1, 5)
    label = f"x^2+{a + b}x+{a * b}"
    forms = {
        "factored": f"(x+{a})(x+{b})", "same": label, "reordered": f"{a * b}+{a + b}x+x^2",
        "wrong": f"(x+{a})(x+{b + 1})", "other-letter": f"(y+{a})(y+{b})",
    }
    kind = rng.choice(sorted(forms))
    return f"gen/poly-{kind}", label, forms[kind]


def _decimal_item(rng: random.Random) -> tuple[str, str, str]:
    cents = rng.randint(1, 999)
    value = f"{cents / 100:.2f}"
    forms = {"same": value, "fraction": f"\\frac{{{cents}}}{{100}}", "dollar": f"\\${value}",
             "rounded": f"{cents / 100:.1f}", "percent": f"{cents}\\%"}
    kind = rng.choice(sorted(forms))
    return f"gen/decimal-{kind}", value, forms[kind]


GENERATORS = (_int_item, _int_item, _fraction_item, _tuple_item, _root_item, _poly_item,
              _decimal_item)


def generated_cases(rng: random.Random) -> Iterator[Item]:
    modes = ("chat",) * 6 + ("null", "absent", "later")
    for _ in range(GENERATED):
        covers, label, box = rng.choice(GENERATORS)(rng)
        mode = rng.choice(modes)
        shape = rng.random()
        if shape < 0.08:  # truncated mid-answer: no closing brace
            response = f"{reasoning(rng)}\nSo the answer is \\boxed{{{box}"
            covers += "/truncated"
        elif shape < 0.16:  # the model revised itself: the last box counts
            response = f"{with_answer(rng, box)}\nWait, let me double check.\n" \
                       f"Actually it is \\boxed{{{label}}}."
            covers += "/revised"
        else:
            response = with_answer(rng, box)
        yield framed(rng, covers, response, label, mode)


def all_items() -> list[Item]:
    rng = random.Random(SEED)
    return [*hand_cases(rng), *generated_cases(rng)]


# --- scoring and writing -----------------------------------------------------------------------

def score_upstream(root: Path, items: list[Item], jobs: int,
                   timeout: float) -> dict[int, float]:
    """Upstream's reward for each item index; items that time out or raise are absent."""
    import pebble  # the server's own pool library, used here for its killable workers

    rewards: dict[int, float] = {}
    with pebble.ProcessPool(max_workers=jobs, initializer=_start_worker,
                            initargs=(str(root),)) as pool:
        futures = {i: pool.schedule(upstream_reward, (it.query, it.prompt, it.label),
                                    timeout=timeout) for i, it in enumerate(items)}
        for i, future in futures.items():
            try:
                rewards[i] = future.result()
            except Exception as error:  # TimeoutError, or upstream raising
                print(f"dropped ({type(error).__name__}): {items[i].covers}: "
                      f"{items[i].query[-80:]!r} / {items[i].label!r}", file=sys.stderr)
    return rewards


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=CORPUS)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per item")
    args = parser.parse_args()

    items = all_items()
    rewards = score_upstream(args.upstream, items, args.jobs, args.timeout)
    kept = [(it, rewards[i]) for i, it in enumerate(items) if i in rewards]
    rows = [{"id": n, "covers": it.covers, "query": it.query, "prompt": it.prompt,
             "label": it.label, "reward": reward} for n, (it, reward) in enumerate(kept)]
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                        encoding="utf-8")
    print(f"{len(rows)} items ({len(items) - len(rows)} dropped) -> {args.out}")

    from podagent.rewards.openrlhf_boxed import accuracy
    differ = [r["id"] for r in rows if accuracy(r["query"], r["prompt"], r["label"]) != r["reward"]]
    print(f"podagent's openrlhf_boxed differs on {len(differ)} items: {differ}")
    by_group = collections.Counter(r["covers"].split("/")[0] for r in rows)
    print(", ".join(f"{k} {v}" for k, v in sorted(by_group.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
