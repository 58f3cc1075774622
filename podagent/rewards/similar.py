"""The closest prompt, as OpenRLHF-M's server picks it for a prompt not in its dataset.

Its similarity is the Levenshtein package's `ratio`: the normalized indel similarity,
2·LCS(a, b) / (len(a) + len(b)) (1 for two empty strings), where LCS is the length of the longest
common subsequence. The closest prompt is the one with the highest ratio; of equals, the first
in the dataset's order. Ratios are compared exactly (as fractions), so ties are real ties.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Generator, Mapping, Sequence
from fractions import Fraction
from typing import TypeVar

T = TypeVar("T")
# Work in steps: a generator that yields (None) between steps and returns its result. The
# server prepares requests this way, a slice of steps at a time, so that requests take turns
# on its one prep thread (`scorer.Scorer.score_body`); the closest-prompt lookup is the longest
# such work.
Steps = Generator[None, None, T]


def finish(steps: Steps[T]) -> T:
    """Runs `steps` to the end and returns the result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def lcs_length(a: str, b: str) -> int:
    """Longest common subsequence, bit-parallel (Allison-Dix / Hyyrö): one pass over `a` with
    an integer as wide as `b`, so O(len(a) · len(b) / 64) word operations."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return 0
    masks: dict[str, int] = {}
    for i, ch in enumerate(b):
        masks[ch] = masks.get(ch, 0) | 1 << i
    full = (1 << len(b)) - 1
    v = full
    for ch in a:
        m = masks.get(ch)
        if m:
            u = v & m
            v = ((v + u) | (v - u)) & full
    return len(b) - v.bit_count()


def ratio(a: str, b: str) -> Fraction:
    total = len(a) + len(b)
    return Fraction(2 * lcs_length(a, b), total) if total else Fraction(1)


def _bound(size: int, other: int) -> Fraction:
    """The best ratio two strings of these lengths can have."""
    total = size + other
    return Fraction(2 * min(size, other), total) if total else Fraction(1)


def by_length(candidates: Sequence[str]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for index, text in enumerate(candidates):
        groups[len(text)].append(index)
    return dict(groups)


def closest(prompt: str, candidates: Sequence[str],
            lengths: Mapping[int, list[int]] | None = None) -> int | None:
    """Index of the candidate most similar to `prompt` (the first of equals), None if there
    are none. `lengths`: `by_length(candidates)`, if kept."""
    return finish(closest_steps(prompt, candidates, lengths))


def closest_steps(prompt: str, candidates: Sequence[str],
                  lengths: Mapping[int, list[int]] | None = None) -> Steps[int | None]:
    """`closest`, one candidate's ratio per step: a lookup against a large dataset takes
    a while (0.1 s to 0.4 s per 2,000 prompts of a few hundred characters), and the server's
    other requests take their turns between steps.

    Candidates are tried in order of the best ratio their length allows, so the search stops
    once no untried one can win."""
    groups: dict[Fraction, list[int]] = defaultdict(list)
    for size, indices in (lengths if lengths is not None else by_length(candidates)).items():
        groups[_bound(len(prompt), size)].extend(indices)
    best_index: int | None = None
    best = Fraction(-1)
    for top in sorted(groups, reverse=True):
        if top < best:
            break
        for index in sorted(groups[top]):
            if top == best and best_index is not None and index > best_index:
                break  # at best a tie, and the earlier one wins ties
            value = ratio(prompt, candidates[index])
            if value > best or (value == best and best_index is not None
                                and index < best_index):
                best, best_index = value, index
            yield
    return best_index
