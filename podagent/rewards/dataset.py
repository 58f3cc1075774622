"""Dataset mode: gold answers looked up by prompt, for trainers that send no labels."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("podagent.rewards")


class DatasetError(ValueError):
    """The file cannot serve as a gold table; the message says where and why."""


class GoldIndex:
    def __init__(self, golds: dict[str, str]):
        self._golds = {p: a for p, a in golds.items() if p}
        # Prefix lookup tries each distinct prompt length once, longest first: a dict probe
        # per length, instead of a startswith per prompt.
        self._lengths = sorted({len(p) for p in self._golds}, reverse=True)

    def __len__(self) -> int:
        return len(self._golds)

    @classmethod
    def load(cls, path: str, prompt_key: str = "prompt", answer_key: str = "answer") -> GoldIndex:
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
        except OSError as exc:
            raise DatasetError(f"cannot be read ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise DatasetError("is not UTF-8 text") from None
        if not golds:
            raise DatasetError(f"has no records with {prompt_key!r} and {answer_key!r}")
        if conflicts:
            log.warning("%s: %d repeated prompts with a different answer; the first answer "
                        "is used", Path(path).name, conflicts)
        return cls(golds)

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
