"""The `openrlhf-m` profile (the default): OpenRLHF-M's reward rule, item for item.

OpenRLHF-M's own reward server (`openrlhf/models/remote_rm/math_verifier.py`) is what its GRPO
recipes train against; a server that scores differently trains a different objective. Its rule,
as this module and `openrlhf_m_verify` implement it:

    reward = accuracy + FORMAT_WEIGHT × format          (FORMAT_WEIGHT 0.5)

* The response is the query after the first occurrence of the template's assistant prefix
  (`TEMPLATES`), with every end token (`END_TOKENS`) removed, in that order, then stripped of
  surrounding whitespace. No prefix in the query, or nothing left after it: the whole query,
  unchanged, is the response.
* format is 1 when the response is exactly `<think>T</think><answer>A</answer>`: nothing
  before, between or after, `T` without `</think>`, `A` without `</answer>`, and `<think>` and
  `<answer>` each once in the whole response. Otherwise 0.
* The gold answer is stripped and, unless it starts with `$`, wrapped in `$…$` (`gold_form`).
* accuracy comes from math-verify, called as the seed calls it (`openrlhf_m_verify`): the whole
  response is searched, `\\boxed{}` first; an unparseable gold scores 1 (the seed skips such
  items that way), as does a comparison that raises, unless --strict 1.

This module is plain string work and runs in the server's own process.
"""

from __future__ import annotations

import re

from podagent.choices import PROMPT_TEMPLATES

# The seed's --prompt-template values (named in choices) and the assistant prefix each one
# looks for; a name added there without a prefix here fails at import.
CHATML, QWEN1, BASE = PROMPT_TEMPLATES
TEMPLATES = {
    CHATML: "<|im_start|>assistant\n",
    QWEN1: "<｜Assistant｜>",
    BASE: "Assistant: ",
}
# Removed from the response in this order (removing one can complete another).
END_TOKENS = ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|endoftext|>")

_THINK, _THINK_END = "<think>", "</think>"
_ANSWER, _ANSWER_END = "<answer>", "</answer>"
_BETWEEN = _THINK_END + _ANSWER


def response_of(query: str, template: str) -> str:
    """The model's response in a chat-templated query (the rule in the module docstring)."""
    start = query.find(TEMPLATES[template])
    if start < 0:
        return query
    response = query[start + len(TEMPLATES[template]) :]
    for token in END_TOKENS:
        response = response.replace(token, "")
    return response.strip() or query


def well_formed(response: str) -> bool:
    """One `<think>` block, then one `<answer>` block, and nothing else (linear time)."""
    if not response.startswith(_THINK) or response.count(_THINK) != 1 \
            or response.count(_ANSWER) != 1:
        return False
    close = response.find(_THINK_END, len(_THINK))  # the thought ends at its first close tag
    if close < 0 or not response.startswith(_BETWEEN, close):
        return False
    body = close + len(_BETWEEN)
    end = response.find(_ANSWER_END, body)  # likewise the answer
    return end >= 0 and end + len(_ANSWER_END) == len(response)


def gold_form(answer: str) -> str | None:
    """The gold as math-verify gets it: stripped, in `$…$` unless it starts with `$`. None for
    an empty answer (the seed's server cannot load one; here the item scores accuracy 0)."""
    answer = answer.strip()
    if not answer:
        return None
    return answer if answer.startswith("$") else f"${answer}$"


# For log lines: chat-template markers make them unreadable.
_MARKERS = re.compile(r"<\|[^|<>]{0,40}\|>|<｜[^｜<>]{0,40}｜>")


def readable(text: str) -> str:
    return _MARKERS.sub("", text)
