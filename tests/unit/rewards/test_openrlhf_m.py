"""The openrlhf-m profile against OpenRLHF-M's own reward server: the parity corpus.

parity_corpus.jsonl holds 618 (template, query, prompt, gold) items and the (format, accuracy)
that OpenRLHF-M's server gives each. The expected values were not written by hand: the
server's own module (`openrlhf/models/remote_rm/math_verifier.py`, from a copy fetched outside
this repository and never committed) was imported and its response, format and math
functions were run over the items once, under math-verify 0.5.2 (what OpenRLHF-M pins) and
again under 0.9.0; only the resulting data is committed. `acc` is 0.5.2's value; where 0.9.0
gives another, `math_verify_0.9` has it and the reason (the README lists these). `seed_quirk`
marks the items the seed scored 1 because the gold does not parse.

parity_lookup.json is the same for the dataset lookup: a dataset (with a prompt given twice)
and request prompts, each with the dataset prompt the seed's server found for it (exact, else
the most similar by the Levenshtein package's ratio).

Everything here runs the real math-verify; nothing is mocked.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podagent.rewards import mvcompat, openrlhf_m, similar
from podagent.rewards import openrlhf_m_verify as seed
from podagent.rewards.dataset import GoldIndex

HERE = Path(__file__).parent
CORPUS = [json.loads(line) for line in
          (HERE / "parity_corpus.jsonl").read_text(encoding="utf-8").splitlines()]
LOOKUP = json.loads((HERE / "parity_lookup.json").read_text(encoding="utf-8"))
FORMAT_WEIGHT = 0.5


def expected_accuracy(case: dict[str, Any]) -> float | None:
    """The seed's accuracy under the installed math-verify; None where the releases differ
    and this one is neither 0.5.x nor 0.9.x (no recorded verdict)."""
    newer = case.get("math_verify_0.9")
    if newer is None or mvcompat.VERSION.startswith("0.5."):
        return case["acc"]
    if mvcompat.VERSION.startswith("0.9."):
        return newer["acc"]
    return None


def accuracy(verdict: str, strict: bool = False) -> float:
    if verdict in (seed.GOLD_UNPARSED, seed.VERIFY_RAISED):
        return 0.0 if strict else 1.0
    return 1.0 if verdict == seed.MATCH else 0.0


@pytest.fixture(scope="module")
def checker() -> seed.Checker:
    return seed.Checker()


def _gold(case: dict[str, Any]) -> str:
    gold = openrlhf_m.gold_form(case["gold"])
    assert gold is not None
    return gold


# --- the corpus ----------------------------------------------------------------------------------


def test_the_corpus_covers_what_the_rule_turns_on():
    assert len(CORPUS) >= 300
    assert [c["id"] for c in CORPUS] == list(range(len(CORPUS)))
    covers = collections.Counter(c["covers"].split("/")[0] for c in CORPUS)
    for part in ("math", "shape", "pick", "format", "prefix", "end", "gold", "unparsed-gold"):
        assert covers[part] >= 15, part
    tags = {c["covers"] for c in CORPUS}
    for tag in ("prefix/missing", "prefix/twice-first-wins", "end/composite", "end/only-end",
                "format/nested-think", "format/two-answers", "format/space-between",
                "format/lead-space-stripped", "pick/boxed-in-think-beats-answer",
                "shape/answer-plain", "shape/answer-boxed"):
        assert tag in tags, tag
    assert {c["template"] for c in CORPUS} == set(openrlhf_m.TEMPLATES)
    outcomes = collections.Counter((c["format"], c["acc"]) for c in CORPUS)
    assert min(outcomes[(f, a)] for f in (0.0, 0.5) for a in (0.0, 1.0)) >= 40
    assert sum("seed_quirk" in c for c in CORPUS) >= 30
    golds = " ".join(c["gold"] for c in CORPUS)
    for needle in (r"\frac", r"\text{ cm}", r"\%", r"\sqrt", r"\pi", r"\infty", "\n"):
        assert needle in golds, needle


def test_format_and_response_match_the_seed_on_every_item():
    wrong = []
    for case in CORPUS:
        response = openrlhf_m.response_of(case["query"], case["template"])
        got = FORMAT_WEIGHT if openrlhf_m.well_formed(response) else 0.0
        if got != case["format"]:
            wrong.append((case["id"], case["covers"], got, case["format"]))
    assert not wrong, wrong[:20]


def test_accuracy_matches_the_seed_on_every_item(checker):
    wrong, skipped = [], 0
    for case in CORPUS:
        expected = expected_accuracy(case)
        if expected is None:
            skipped += 1
            continue
        response = openrlhf_m.response_of(case["query"], case["template"])
        verdict, _ = checker.check(response, _gold(case))
        if accuracy(verdict) != expected:
            wrong.append((case["id"], case["covers"], verdict, expected))
    assert not wrong, f"math-verify {mvcompat.VERSION}: {wrong[:20]}"
    assert skipped <= 10


def test_the_fast_path_and_math_verify_alone_agree_on_every_item():
    """Each item twice through the shortcuts (the second time from the cache) and once through
    the seed's own calls with nothing cached: the same verdict, every item."""
    fast, slow = seed.Checker(), seed.Checker()
    routes: collections.Counter[str] = collections.Counter()
    disagree = []
    for case in CORPUS:
        response = openrlhf_m.response_of(case["query"], case["template"])
        gold = _gold(case)
        first, how = fast.check(response, gold)
        again, _ = fast.check(response, gold)
        reference = slow.decide(response, gold)
        routes[how] += 1
        if not first == again == reference:
            disagree.append((case["id"], first, again, reference))
    assert not disagree, disagree[:20]
    # The agreement means something only if the shortcuts were taken.
    for how in (seed.BY_NO_ANSWER, seed.BY_EQUAL_TEXT, seed.BY_CACHE, seed.BY_GOLD):
        assert routes[how] >= 20, routes
    assert routes[seed.BY_MATH_VERIFY] >= 100, routes


def test_strict_scores_the_seeds_quirks_zero(checker):
    quirky = [c for c in CORPUS if "seed_quirk" in c]
    for case in quirky:
        response = openrlhf_m.response_of(case["query"], case["template"])
        verdict, _ = checker.check(response, _gold(case))
        assert verdict == seed.GOLD_UNPARSED, case["id"]
        assert (accuracy(verdict), accuracy(verdict, strict=True)) == (1.0, 0.0)


# --- pieces of the rule --------------------------------------------------------------------------


@pytest.mark.parametrize(("query", "template", "response"), [
    ("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n A <|im_end|>", "chatml", "A"),
    ("no prefix <|im_end|>", "chatml", "no prefix <|im_end|>"),  # untouched, ends and all
    ("Q<｜Assistant｜>A<｜end▁of▁sentence｜>", "qwen1", "A"),
    ("User: Q\n\nAssistant: A<|endoftext|>", "base", "A"),
    ("Q Assistant: <|endoftext|>  ", "base", "Q Assistant: <|endoftext|>  "),  # empty: the query
    ("Assistant: one Assistant: two", "base", "one Assistant: two"),  # the first prefix
    ("Assistant: x<|endof<|im_end|>text|>", "base", "x"),  # removed in order
    ("Assistant: x<|im_<|endoftext|>end|>", "base", "x<|im_end|>"),
])
def test_response_of(query, template, response):
    assert openrlhf_m.response_of(query, template) == response


def test_gold_form():
    assert openrlhf_m.gold_form(" 5 ") == "$5$"
    assert openrlhf_m.gold_form("$5$") == "$5$"
    assert openrlhf_m.gold_form("$5") == "$5"  # starts with $: left as it is
    assert openrlhf_m.gold_form(" \n") is None


_TAGGED = st.lists(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "x", " ",
                                    "\n", "<", ">", "/", "think", "answer"]),
                   max_size=14).map("".join)


@settings(max_examples=600, deadline=None)
@given(_TAGGED)
def test_well_formed_is_the_documented_rule(text):
    """The rule as the README states it, written another way (a full match), must agree."""
    m = re.fullmatch(r"<think>(.*?)</think><answer>(.*)</answer>", text, re.DOTALL)
    expected = bool(m) and "</answer>" not in m.group(2) and text.count("<think>") == 1 \
        and text.count("<answer>") == 1
    assert openrlhf_m.well_formed(text) == expected


# --- the dataset lookup --------------------------------------------------------------------------


def test_dataset_lookup_finds_what_the_seed_finds(tmp_path):
    path = tmp_path / "golds.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in LOOKUP["dataset"]))
    golds = GoldIndex.load(str(path), repeated="last")
    for request in LOOKUP["requests"]:
        answer, found = golds.nearest(request["prompt"])
        assert found == request["found"], request
        assert openrlhf_m.gold_form(answer) == request["gold"], request


@settings(max_examples=300, deadline=None)
@given(st.text("abc ", max_size=14), st.text("abc ", max_size=14))
def test_lcs_length_is_the_longest_common_subsequence(a, b):
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1],
                                                                       table[i + 1][j])
    assert similar.lcs_length(a, b) == table[-1][-1]


@settings(max_examples=200, deadline=None)
@given(st.text("ab ", max_size=6), st.lists(st.text("ab ", max_size=6), min_size=1,
                                              max_size=8, unique=True))
def test_closest_is_the_first_best_ratio(prompt, candidates):
    ratios = [similar.ratio(prompt, c) for c in candidates]
    assert similar.closest(prompt, candidates) == ratios.index(max(ratios))


# --- plain values without latex2sympy ------------------------------------------------------------

_DIGITS = st.text("0123456789", min_size=1, max_size=22)
_NUMBER = st.one_of(
    _DIGITS, st.builds(lambda a, b: f"{a}.{b}", _DIGITS, _DIGITS),
    st.builds(lambda a, b, s: f"\\frac{{{s}{a}}}{{{b}}}", _DIGITS, _DIGITS,
              st.sampled_from(["", "-"])),
    st.sampled_from(["0", "00", "0.0", "007", "1.50", "100", "0.333333", "12.5", "1e3", "1,000",
                     r"\frac{0}{3}", r"\frac{3}{0}", r"\dfrac{1}{2}", "3.", ".5"]))


@st.composite
def _scalar_texts(draw) -> str:
    return draw(st.sampled_from(["", "-"])) + draw(_NUMBER)


@st.composite
def _number_texts(draw) -> str:
    """Plain numbers, and sets, intervals and tuples of them, maybe boxed, maybe spaced."""
    parts = draw(st.lists(_scalar_texts(), min_size=1, max_size=4))
    space = draw(st.sampled_from(["", " "]))
    inner = f",{space}".join(parts)
    text = draw(st.sampled_from([
        parts[0], f"\\{{{inner}\\}}", f"({inner})", f"[{inner})", f"({inner}]",
        f"[{inner}]", f"{space}{parts[0]}{space}"]))
    return f"\\boxed{{{text}}}" if draw(st.booleans()) else text


@settings(max_examples=400, deadline=None)
@given(_number_texts())
def test_plain_values_are_built_as_latex2sympy_parses_them(text):
    """The value is math-verify's own call's (latex2sympy with math-verify's arguments)."""
    from latex2sympy2_extended.latex2sympy2 import latex2sympy
    from math_verify.grader import should_treat_as_complex

    built = seed.plain_value(text)
    if built is None:
        return
    real = latex2sympy(text, is_real=not should_treat_as_complex(text), convert_degrees=False,
                       normalization_config=None)
    assert _same(built, real), (built, real)


def _same(a: Any, b: Any) -> bool:
    """Equal, of the very same classes all the way down (sympy's FiniteSet and latex2sympy's
    print alike and compare unequal), and printed alike."""
    from sympy import Basic, srepr

    if type(a) is not type(b) or a != b:
        return False
    if not isinstance(a, Basic):
        return True
    return srepr(a) == srepr(b) and len(a.args) == len(b.args) and all(
        _same(x, y) for x, y in zip(a.args, b.args, strict=True))


def test_plain_values_cover_the_common_shapes():
    for text in ("12", "-7", "0.75", "-4.25", r"\frac{3}{4}", r"-\frac{6}{8}", r"\boxed{42}",
                 r"\boxed{-\frac{1}{2}}", "123456789012345678901234567890"):
        assert seed.plain_value(text) is not None, text
    for text in (r"\{1, 2\}", "(1, 2)", "(2, 1)", "[-3, 4)", r"\boxed{(1, 2, 3)}"):
        assert seed.plain_value(text) is not None, text
    for text in (r"\frac{\pi}{2}", "x", "1,000", r"50\%", r"\boxed{1}\boxed{2}", "(1)",
                 "[1, 2, 3]", r"\{\}", "(1, x)"):
        assert seed.plain_value(text) is None, text


_SHAPES = (lambda a: f"<think>t</think><answer>${a}$</answer>",
           lambda a: f"<think>t</think><answer>The final answer is $\\boxed{{{a}}}$.</answer>",
           lambda a: f"<think>t</think><answer>\\[{a}\\]</answer>", lambda a: f"so \\boxed{{{a}}}")


@settings(max_examples=100, deadline=None)
@given(_number_texts(), _number_texts(), st.sampled_from(_SHAPES))
def test_the_fast_path_agrees_with_math_verify_on_numbers(answer, gold, shape):
    """Numbers are where the fast path builds values itself: it must still give math-verify's
    verdict, whatever the two numbers."""
    response, wrapped = shape(answer), openrlhf_m.gold_form(gold)
    assert wrapped is not None
    fast, slow = seed.Checker(), seed.Checker()
    assert fast.check(response, wrapped)[0] == slow.decide(response, wrapped)


# --- a boxed answer parsed from its content (`unboxed`) ----------------------------------------

_ATOMS = st.one_of(_DIGITS, st.sampled_from(["x", "y", "n", "t", "ab", "2x", r"\pi", "3.5", "0"]))


def _unboxed_expressions() -> st.SearchStrategy[str]:
    """Expressions of the shapes `unboxed` lets through, nested, spaced or not."""
    def grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.builds(lambda a, op, b: f"{a}{op}{b}", inner,
                      st.sampled_from(["+", "-", " + ", " - ", "*", "/", r"\cdot ", r"\times ",
                                       ""]), inner),
            st.builds(lambda a, b: f"{a}^{{{b}}}", inner, inner),
            st.builds(lambda a, b: f"{a}^{b}", inner, _DIGITS),
            st.builds(lambda a: f"\\sqrt{{{a}}}", inner),
            st.builds(lambda c, a, b: f"\\{c}{{{a}}}{{{b}}}", st.sampled_from(
                ["frac", "dfrac", "tfrac"]), inner, inner),
            st.builds(lambda a: f"({a})", inner), st.builds(lambda a: f"-{a}", inner),
            st.builds(lambda a: f"{{{a}}}", inner))
    return st.recursive(_ATOMS, grow, max_leaves=6)


def _parse_or_none(latex: str) -> Any:
    """The installed math-verify's own parse of one match's LaTeX (what the slow path runs)."""
    from podagent.rewards import mvcompat

    parse = mvcompat.latex_parser()
    assert parse is not None
    try:
        return parse(latex)
    except Exception:
        return None


@settings(max_examples=150, deadline=None)
@given(st.one_of(_unboxed_expressions(),
                 st.text("0123456789.+-*/^(){} abcxyz", min_size=1, max_size=12)))
def test_a_box_and_its_content_parse_alike(inner):
    """Where `unboxed` lets a box through, math-verify's parse of the content is its parse of
    the box: the same value, of the same classes (or no value either way)."""
    boxed = f"\\boxed{{{inner}}}"
    if seed.unboxed(boxed) is None:
        return
    assert seed.unboxed(boxed) == inner
    alone, whole = _parse_or_none(inner), _parse_or_none(boxed)
    assert (alone is None) == (whole is None), (inner, alone, whole)
    if alone is not None:
        assert _same(alone, whole), (inner, alone, whole)


def test_unboxed_lets_through_only_what_cannot_make_a_set_or_a_relation():
    for inner in ("x^2 + 5x + 6", r"2\sqrt{3}", r"\frac{3\pi}{4}", r"-\dfrac{\sqrt{3}}{2}",
                  "(x+2)(x+3)", r"\pi", "12", "{x}^{2}"):
        assert seed.unboxed(f"\\boxed{{{inner}}}") == inner
    for text in (r"\boxed{1, 2}", r"\boxed{1; 2}", r"\boxed{x \pm 1}", r"\boxed{x = 2}",
                 r"\boxed{x < 2}", r"\boxed{x \le 2}", r"\boxed{[1, 2)}", r"\boxed{1}+\boxed{2}",
                 r"\boxed{}", r"\boxed{e^x}", r"\boxed{2i}", r"\boxed{\sqrt[3]{2}}",
                 r"\boxed{\pie}", r"\boxed{x}}", r"\boxed{{x}", r"\boxed{\text{yes}}",
                 r"\boxed{x_1}", "x^2", r"\boxed{" + "1+" * 100 + "1}"):
        assert seed.unboxed(text) is None, text


@settings(max_examples=60, deadline=None)
@given(_unboxed_expressions(), st.sampled_from([0, 1]), st.sampled_from(
    ["x^2 + 5x + 6", r"2\sqrt{3}", r"\frac{3\pi}{4}", "7", "(x+2)(x+3)"]))
def test_the_fast_path_agrees_with_math_verify_on_boxed_expressions(answer, same, gold):
    """The whole verdict, fast path against math-verify alone, for boxed answers (the gold
    itself, so that some match, or a generated one)."""
    response = _SHAPES[1](gold if same else answer)
    wrapped = openrlhf_m.gold_form(gold)
    assert wrapped is not None
    fast, slow = seed.Checker(), seed.Checker()
    assert fast.check(response, wrapped)[0] == slow.decide(response, wrapped)


def test_a_boxed_answer_is_parsed_from_its_content_not_through_the_box():
    """The shortcut is taken: the seed's whole-response parse is never called for a boxed
    polynomial, and the verdict is still math-verify's."""
    response = _SHAPES[1]("(x+2)(x+3)")
    fast = seed.Checker()

    def no_slow_path(_: str) -> Any:
        raise AssertionError("the box went through the seed's whole-response parse")

    fast.parse_answer = no_slow_path  # type: ignore[method-assign]
    assert fast.check(response, "$x^2 + 5x + 6$")[0] == seed.Checker().decide(
        response, "$x^2 + 5x + 6$") == seed.MATCH
