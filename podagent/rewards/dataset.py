"""Dataset mode: gold answers looked up by prompt, for trainers that send no labels."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from podagent.rewards import similar
from podagent.rewards.similar import Steps, finish
from podagent.rewards.verify import LRU, short

log = logging.getLogger("podagent.rewards")
CLOSEST_CACHE_SIZE = 4096


class DatasetError(ValueError):
    """The file cannot serve as a gold table; the message says where and why."""


class GoldIndex:
    """Gold answers by prompt: the exact prompt, the longest one that starts the query, or
    the most similar one."""

    def __init__(self, golds: dict[str, str]):
        self._all = golds  # in the file's order (closest-prompt ties go to the earlier one)
        self._golds = {p: a for p, a in golds.items() if p}
        # Prefix lookup tries each distinct prompt length once, longest first: a dict probe
        # per length, instead of a startswith per prompt.
        self._lengths = sorted({len(p) for p in self._golds}, reverse=True)
        self._prompts = list(golds)
        self._by_length = similar.by_length(self._prompts)
        self._closest = LRU(CLOSEST_CACHE_SIZE)

    def __len__(self) -> int:
        return len(self._all)

    @classmethod
    def load(cls, path: str, prompt_key: str = "prompt", answer_key: str = "answer",
             repeated: str = "first") -> GoldIndex:
        """`repeated`: which answer a prompt that appears more than once keeps, "first" or
        "last" (OpenRLHF-M's server: its place is the first one's, its answer the last's)."""
        golds: dict[str, str] = {}
        conflicts = 0
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    prompt, answer = _record(line, number, prompt_key, answer_key)
                    if golds.setdefault(prompt, answer) != answer:
                        conflicts += 1
                        if repeated == "last":
                            golds[prompt] = answer
        except OSError as exc:
            raise DatasetError(f"cannot be read ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise DatasetError("is not UTF-8 text") from None
        if not golds:
            raise DatasetError(f"has no records with {prompt_key!r} and {answer_key!r}")
        if conflicts:
            log.warning("%s: %d repeated prompts with a different answer; the %s answer "
                        "is used", Path(path).name, conflicts, repeated)
        return cls(golds)

    def answers(self) -> list[str]:
        """The distinct gold answers, in the file's order."""
        return list(dict.fromkeys(self._all.values()))

    def lookup(self, prompt: str | None, query: str) -> tuple[str | None, str | None]:
        """(gold, the dataset prompt it was found by): the exact prompt, else the longest
        dataset prompt that starts the query; (None, None) when neither."""
        if prompt is not None and (gold := self._golds.get(prompt)) is not None:
            return gold, prompt
        size = len(query)
        for length in self._lengths:
            if length <= size and (gold := self._golds.get(query[:length])) is not None:
                return gold, query[:length]
        return None, None

    def nearest(self, prompt: str) -> tuple[str, str]:
        """(gold, the dataset prompt it was found by): the exact prompt, else the most similar
        one (`similar`), as OpenRLHF-M's server looks up the request's prompt."""
        return finish(self.nearest_steps(prompt))

    def nearest_steps(self, prompt: str) -> Steps[tuple[str, str]]:
        """`nearest` in steps (`similar.closest_steps`): the server runs it a slice at a time."""
        gold = self._all.get(prompt)
        if gold is not None:
            return gold, prompt
        index = self._closest.get(prompt)
        if index is None:
            index = yield from similar.closest_steps(prompt, self._prompts, self._by_length)
            assert index is not None  # a loaded index is never empty
            self._closest.put(prompt, index)
            # Once per prompt (later lookups come from the cache): the seed prints every time.
            log.warning("prompt not in the dataset; using the most similar one (similarity "
                        "%.3f): %s -> %s", float(similar.ratio(prompt, self._prompts[index])),
                        short(prompt), short(self._prompts[index]))
        found = self._prompts[index]
        return self._all[found], found


def _record(line: str, number: int, prompt_key: str, answer_key: str) -> tuple[str, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"line {number} is not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise DatasetError(f"line {number} is not a JSON object")
    prompt, answer = record.get(prompt_key), record.get(answer_key)
    if not isinstance(prompt, str):
        raise DatasetError(f"line {number} has no string {prompt_key!r} (--prompt-key)")
    # Numeric answers are common (GSM8K-style); their JSON text is the gold.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"line {number} has no string or number {answer_key!r} (--answer-key)")
    return prompt, answer if isinstance(answer, str) else json.dumps(answer)
