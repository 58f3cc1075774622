"""A job's shell command read as the shell reads it: where the command string is behind
wrappers and options, and its simple commands (the trainer's is found and given the flag in
tests/unit/test_trainers.py, through a real bash)."""

from __future__ import annotations

import pytest

from podagent import shell_command
from podagent.shell_command import Unreadable


@pytest.mark.parametrize(("job", "at"), [
    (("bash", "-c", "s"), 2),
    (("bash", "-euo", "pipefail", "-c", "s"), 4),
    (("bash", "-ceo", "pipefail", "s"), 3),
    (("bash", "-o", "pipefail", "-ec", "s", "arg0"), 4),
    (("bash", "--login", "--rcfile", "r", "-c", "s"), 5),
    (("/bin/sh", "-c", "--", "s"), 3),
    (("env", "-i", "-u", "X", "A=1", "timeout", "-s", "KILL", "1d", "nohup", "nice", "-n",
      "5", "bash", "-c", "s"), 15),
    (("bash", "script.sh", "-c"), None),  # a script file: its arguments are its own
    (("python", "-c", "print(1)"), None),
    (("bash",), None),
])
def test_the_command_string_is_found_behind_wrappers_and_options(job, at):
    assert shell_command.command_string_index(job) == at


def test_a_shell_given_c_but_no_string_is_unreadable():
    with pytest.raises(Unreadable, match="no command string"):
        shell_command.command_string_index(("bash", "-euo", "pipefail", "-c"))


@pytest.mark.parametrize(("script", "commands"), [
    ("cd /w && python a.py | tee l; echo ok", [["cd", "/w"], ["python", "a.py"], ["tee", "l"],
                                              ["echo", "ok"]]),
    ("python a.py 2>&1 >| l &> m", [["python", "a.py", "2>&1", ">|", "l", "&>", "m"]]),
    ("python a.py --p=/c>l", [["python", "a.py", "--p=/c", ">", "l"]]),
    ("python a.py > >(tee l) --x <(zcat d)", [["python", "a.py", ">", ">(tee l)", "--x",
                                                 "<(zcat d)"]]),
    ("python a.py --name \"Qwen 7B\" --x 'a b'", [["python", "a.py", "--name", "Qwen 7B",
                                                   "--x", "a b"]]),
    ("[[ -f x && -n y ]] || python a.py", [["[[", "-f", "x", "&&", "-n", "y", "]]"],
                                           ["python", "a.py"]]),
    ("python a.py <<< 'x y' # it's a comment\nexec b", [["python", "a.py", "<<<", "x y"],
                                                        ["b"]]),
    ("X=$(echo \"a)b\") timeout 9 python a.py", [["python", "a.py"]]),
    ("python a.py \\\n  --lr 1", [["python", "a.py", "--lr", "1"]]),
])
def test_a_command_string_splits_into_its_simple_commands(script, commands):
    assert [list(s.words) for s in shell_command.segments(script)] == commands


@pytest.mark.parametrize(("script", "why"), [
    ("python a.py <<EOF\nx\nEOF", "here-document"),
    ("python a.py 'unclosed", "single quote"),
    ('python a.py "unclosed', "double quote"),
    ("python $(echo a", r"\$\( does not close"),
    ("[[ -f x", r"\[\[ does not close"),
])
def test_what_cannot_be_read_with_certainty_is_unreadable(script, why):
    with pytest.raises(Unreadable, match=why):
        shell_command.segments(script)
