"""The wire vocabulary is defined once (podagent/wire.py) and used by name everywhere: no event
is said or read as a string literal, every event is said somewhere, every state is defined in
one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from podagent import wire
from podagent.launch import up

PACKAGE = Path(wire.__file__).parent
SOURCES = {p: ast.parse(p.read_text(encoding="utf-8"), str(p))
           for p in sorted(PACKAGE.rglob("*.py")) if p.name != "wire.py"}


def _calls(method: str):
    for path, tree in SOURCES.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == method and node.args):
                yield path, node


def test_no_event_is_said_as_a_string():
    literal = [f"{p.relative_to(PACKAGE.parent)}:{n.lineno}: {ast.unparse(n)[:60]}"
               for method in ("event", "step", "gather") for p, n in _calls(method)
               if isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)
               and (method != "step" or "reporter" in ast.unparse(n.func))]
    assert not literal, "events named by a string, not by wire.Event:\n" + "\n".join(literal)


def test_every_event_is_said_somewhere():
    used = {node.attr for tree in SOURCES.values() for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "Event"}
    unused = {e.name for e in wire.Event} - used
    assert not unused, f"events no podagent module says: {sorted(unused)}"


def test_each_name_and_state_is_defined_once():
    for enum in (wire.Event, wire.HeadState, wire.WorkerState, wire.GangPhase,
                 wire.MemberState):
        values = [m.value for m in enum]
        assert len(values) == len(set(values)), enum
    text = "\n".join(p.read_text(encoding="utf-8") for p in SOURCES)
    for name in ("Event", "HeadState", "WorkerState", "GangPhase", "MemberState"):
        assert not re.search(rf"^class {name}\b", text, re.M), f"{name} defined again"


def test_up_follows_only_states_a_head_has():
    heads = {s.value for s in wire.HeadState} | {p.value for p in wire.GangPhase}
    assert set(up._HEAD_PHASES) <= heads


def test_an_event_prints_as_its_name():
    assert str(wire.Event.RUN_OVER) == "run_over" == f"{wire.Event.RUN_OVER}"
    assert wire.Event("run_over") is wire.Event.RUN_OVER
