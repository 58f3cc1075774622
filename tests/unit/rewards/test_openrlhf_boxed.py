"""The openrlhf-boxed profile against upstream OpenRLHF's own math reward function.

openrlhf_boxed_corpus.jsonl holds (query, prompt, label) items and the reward that OpenRLHF's
`examples/python/math_reward_func.py` (with its `openrlhf/utils/math_utils.py`) gave each, at
OpenRLHF commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7, sympy 1.14.0, pylatexenc 2.11. The
rewards were not written by hand: make_openrlhf_boxed_corpus.py ran upstream's function,
unchanged, one item at a time in a worker thread as OpenRLHF's trainer calls it; only the
resulting data is committed. `covers` names what each item exercises.

Everything here runs the real sympy and pylatexenc; nothing is mocked.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from podagent.rewards.openrlhf_boxed import accuracy, boxed_answer, reward_func

HERE = Path(__file__).parent
CORPUS = [json.loads(line) for line in
          (HERE / "openrlhf_boxed_corpus.jsonl").read_text(encoding="utf-8").splitlines()]


def test_corpus_is_broad():
    groups = collections.Counter(case["covers"].split("/")[0] for case in CORPUS)
    assert len(CORPUS) >= 600
    assert len({case["id"] for case in CORPUS}) == len(CORPUS)
    # every family the corpus was built to cover is there, each with right and wrong verdicts
    assert groups.keys() >= {"box", "prompt", "cot", "int", "frac", "tuple", "unit", "latex",
                             "exp", "poly", "empty", "unicode", "gen"}
    assert {case["reward"] for case in CORPUS} == {0.0, 1.0}


def test_every_item_scores_as_upstream():
    differ = [(case["id"], case["covers"], case["reward"]) for case in CORPUS
              if accuracy(case["query"], case["prompt"], case["label"]) != case["reward"]]
    assert not differ, f"{len(differ)} items differ from upstream (id, covers, upstream): {differ}"


def test_reward_func_keeps_upstreams_contract_per_item():
    by_covers = {c["covers"]: c for c in CORPUS}
    cases = [by_covers[k] for k in ("box/several-last", "box/unclosed", "label/none")]
    result = reward_func([c["query"] for c in cases], [c["prompt"] for c in cases],
                         [c["label"] for c in cases], unused_keyword="ignored")
    expected = [c["reward"] for c in cases]
    assert expected == [1.0, 0.0, 0.0]
    assert result == {"rewards": expected, "scores": expected,
                      "extra_logs": {"math_accuracy": expected}}
    # upstream zips its lists: items past the shortest one are not scored
    assert reward_func(["\\boxed{1}", "\\boxed{2}"], [None], ["1", "2"])["rewards"] == [1.0]


# No "d" in the alphabet: no `\\boxed` can appear but the one the test writes.
_INNER = st.text(st.sampled_from("0123456789x+-/.,{} \\abfrcox"), max_size=12)


@settings(max_examples=150, deadline=None)
@given(before=_INNER, inner=_INNER, after=st.text(
    st.sampled_from("xyz .{"), max_size=6))
def test_the_last_closed_box_is_the_answer(before, inner, after):
    """A balanced box followed by text without braces closing it: its content is the answer."""
    if inner.count("{") != inner.count("}") or any(
            inner[:i].count("}") > inner[:i].count("{") for i in range(len(inner) + 1)):
        inner = inner.replace("{", "").replace("}", "")
    assert boxed_answer(f"{before}\\boxed{{{inner}}}{after}") == inner


def test_the_server_scores_the_corpus_as_upstream(tmp_path):
    """The profile as trainers meet it: every corpus item through a real server
    (`--scoring openrlhf-boxed`), in the verifier pool, with scores and extra_logs."""
    from .conftest import live_server

    groups = collections.defaultdict(list)  # a request cannot hold null prompts or labels
    for case in CORPUS:
        groups[(case["prompt"] is None, case["label"] is None)].append(case)
    differ = []
    with live_server(tmp_path, "--scoring", "openrlhf-boxed", "--workers", "2",
                     "--extra-logs", "1") as srv:
        for (no_prompt, no_label), cases in groups.items():
            payload = {"query": [c["query"] for c in cases]}
            if not no_prompt:
                payload["prompts"] = [c["prompt"] for c in cases]
            if not no_label:
                payload["labels"] = [c["label"] for c in cases]
            reply = srv.post(payload)
            assert reply.status_code == 200, reply.text
            body = reply.json()
            assert set(body) == {"rewards", "scores", "extra_logs"}
            assert body["scores"] == body["rewards"] == body["extra_logs"]["math_accuracy"]
            differ += [(c["id"], c["covers"]) for c, got in zip(cases, body["rewards"],
                                                                 strict=True)
                       if got != c["reward"]]
        health = srv.health()
    assert not differ, f"{len(differ)} items differ from upstream: {differ}"
    assert health["scoring"] == "openrlhf-boxed" and health["items"] == len(CORPUS)
    assert health["func_errors"] == 0 and health["timeouts"] == 0
