"""A job that is a shell command, read as the shell reads it: `bash -c STRING` behind the
wrappers users put in front of it (`env -i A=1`, `timeout 1d`, `nohup`, `nice -n 5`), the
shell's own options (`-euo pipefail`, `--login`), and the STRING's simple commands: the text
between `;` `&` `|` `&&` `||` `(` `)` and newlines, with quotes, `$( )`, `<( )`, `>( )`,
backquotes, `[[ ]]` and redirections (`2>&1`, `&>`, `>|`) honoured and comments cut off.

Why: an argument after the command string is bash's `$0`, never one of the trainer's, so the
resume flag must go inside the string, at the end of the simple command that runs the trainer.
Where the string cannot be read with certainty (a here-document, quotes that do not close) it
is `Unreadable`, and the caller leaves the job as it is, saying why.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})
# Programs put in front of a command: (their options that take an argument, how many
# positional arguments come before the command). `env` also takes NAME=VALUE words.
WRAPPERS: dict[str, tuple[frozenset[str], int]] = {
    "env": (frozenset({"-u", "--unset", "-C", "--chdir", "-S", "--split-string"}), 0),
    "timeout": (frozenset({"-s", "--signal", "-k", "--kill-after"}), 1),
    "nohup": (frozenset(), 0),
    "nice": (frozenset({"-n", "--adjustment"}), 0),
    "setsid": (frozenset(), 0),
    "stdbuf": (frozenset({"-i", "-o", "-e", "--input", "--output", "--error"}), 0),
    "taskset": (frozenset(), 1),
    "numactl": (frozenset({"-C", "-N", "-m", "-p", "--physcpubind", "--cpunodebind",
                           "--membind", "--preferred"}), 0),
}
_SHELL_LONG_WITH_ARG = frozenset({"--rcfile", "--init-file"})
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# Words that start a simple command without being the program it runs.
PREFIX_WORDS = frozenset({"exec", "time", "then", "else", "elif", "do", "{", "!", "command",
                          "builtin", *WRAPPERS})


class Unreadable(ValueError):
    """A shell command string (or the shell's command line) that cannot be read with
    certainty; its message says why."""


@dataclass(frozen=True)
class Segment:
    """One simple command of a command string: where it is, its words from the program on."""
    start: int
    end: int  # the offset of the operator that ends it (or the string's end)
    words: tuple[str, ...]


def _basename(word: str) -> str:
    return os.path.basename(word)


def _after_wrappers(job: Sequence[str], i: int = 0) -> int:
    """The index of the program behind the wrappers and assignments starting at `i`."""
    while i < len(job):
        name = _basename(job[i])
        if ASSIGNMENT.match(job[i]):
            i += 1
            continue
        if name not in WRAPPERS:
            return i
        with_arg, positional = WRAPPERS[name]
        i += 1
        while i < len(job) and job[i].startswith("-") and job[i] != "-":
            if job[i] == "--":
                i += 1
                break
            i += 2 if job[i] in with_arg else 1
        while name == "env" and i < len(job) and (ASSIGNMENT.match(job[i]) or job[i] == "-"):
            i += 1
        i += positional
    return i


def command_string_index(job: Sequence[str]) -> int | None:
    """Where the command string of a shell job is (`bash -c STRING`, `bash -euo pipefail -c
    STRING`, `env -i A=1 timeout 1d sh -ec STRING`); None when the job runs no shell with
    `-c`. Raises Unreadable for a shell with `-c` whose string cannot be found."""
    i = _after_wrappers(job)
    if i >= len(job) or _basename(job[i]) not in SHELLS:
        return None
    i += 1
    command_string = False
    while i < len(job):
        arg = job[i]
        if arg in ("--", "-"):
            i += 1
            break
        if arg.startswith("--"):
            i += 2 if arg in _SHELL_LONG_WITH_ARG else 1
            continue
        if arg[:1] in "-+" and len(arg) > 1:
            letters = arg[1:]
            command_string = command_string or (arg[0] == "-" and "c" in letters)
            # -o NAME / -O NAME, alone or last of a cluster (-euo pipefail): NAME is taken.
            i += 2 if letters[-1] in "oO" else 1
            continue
        break
    if not command_string:
        return None
    if i >= len(job):
        raise Unreadable("the shell is given -c but no command string")
    return i


def segments(script: str) -> list[Segment]:
    """The simple commands of a command string, in order (empty ones left out). Raises
    Unreadable for a here-document or quoting that does not close."""
    out: list[Segment] = []
    start, i, n = 0, 0, len(script)

    def close(end: int) -> None:
        found = command_words(script[start:end])
        if found:
            out.append(Segment(start, end, tuple(found)))

    while i < n:
        ch = script[i]
        if ch == "\\":
            i += 2
        elif ch == "$" and script.startswith("'", i + 1):  # $'...': backslashes escape
            i = _after_ansi_c(script, i + 2)
        elif ch == "'":
            i = _after(script, "'", i + 1, "a single quote does not close")
        elif ch == '"':
            i = _after_double(script, i + 1)
        elif ch == "`":
            i = _after(script, "`", i + 1, "a backquote does not close")
        elif ch in "$<>" and script.startswith("(", i + 1):  # $( ), <( ), >( )
            i = _after_parens(script, i + 2)
        elif script.startswith("<<<", i):  # a here-string: a word follows
            i += 3
        elif script.startswith("<<", i):
            raise Unreadable("it holds a here-document")
        elif script.startswith("[[", i) and _word_starts(script, i):
            end = script.find("]]", i + 2)
            if end < 0:
                raise Unreadable("a [[ does not close")
            i = end + 2
        elif ch == "#" and _word_starts(script, i):
            close(i)
            j = script.find("\n", i)
            i = start = n if j < 0 else j
        elif ch == "&" and (script[i - 1:i] in ("<", ">") or script[i + 1:i + 2] == ">"):
            i += 1  # a redirection (2>&1, &>log), not an operator
        elif ch == "|" and script[i - 1:i] == ">":
            i += 1  # >| (clobber), a redirection
        elif ch in ";&|()\n":
            close(i)
            i += 1
            start = i
        else:
            i += 1
    close(n)
    return out


def _word_starts(script: str, i: int) -> bool:
    return i == 0 or script[i - 1].isspace() or script[i - 1] in ";&|()"


def _after(script: str, closing: str, i: int, why: str) -> int:
    j = script.find(closing, i)
    if j < 0:
        raise Unreadable(why)
    return j + 1


def _after_ansi_c(script: str, i: int) -> int:
    """The offset after the quote that closes a `$'` opened before `i`."""
    while i < len(script):
        if script[i] == "\\":
            i += 2
        elif script[i] == "'":
            return i + 1
        else:
            i += 1
    raise Unreadable("a $' does not close")


def _after_double(script: str, i: int) -> int:
    """The offset after the double quote that closes one opened before `i`."""
    while i < len(script):
        ch = script[i]
        if ch == "\\":
            i += 2
        elif ch == '"':
            return i + 1
        elif ch == "$" and script.startswith("(", i + 1):
            i = _after_parens(script, i + 2)
        else:
            i += 1
    raise Unreadable("a double quote does not close")


def _after_parens(script: str, i: int) -> int:
    """The offset after the `)` that closes a `$(`, `<(` or `>(` opened before `i`."""
    depth = 1
    while i < len(script):
        ch = script[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "'":
            i = _after(script, "'", i + 1, "a single quote does not close")
            continue
        if ch == '"':
            i = _after_double(script, i + 1)
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        i += 1
        if depth == 0:
            return i
    raise Unreadable("a $( does not close")


def split_words(text: str) -> list[str]:
    """The shell words of one simple command (segments() cut off its operators and comments):
    split at unquoted blanks and redirections (`>`, `2>&1`, `<` a word of their own), each
    word unquoted, except one holding a substitution (`$( )`, `<( )`, backquotes), whose
    value only the shell knows: it is kept as written. A line continuation joins its lines.
    Raises Unreadable where quoting does not close."""
    text = text.replace("\\\n", "")
    raw: list[str] = []
    word, i, n = "", 0, len(text)

    def end_word() -> None:
        nonlocal word
        if word:
            raw.append(word)
        word = ""

    while i < n:
        ch = text[i]
        if ch.isspace():
            end_word()
            i += 1
            continue
        if ch in "<>" and not text.startswith("(", i + 1):
            fd = word if word.isdigit() else ""
            if not fd:
                end_word()
            j = i
            while j < n and text[j] in "<>&|" and not text.startswith("(", j + 1):
                j += 1
            if text[j - 1] == "&":  # a duplication: 2>&1, >&-
                while j < n and (text[j].isdigit() or text[j] == "-"):
                    j += 1
            word = ""
            raw.append(fd + text[i:j])
            i = j
            continue
        if ch == "&" and text.startswith(">", i + 1):  # &> and &>>
            end_word()
            j = i + 1
            while j < n and text[j] in ">":
                j += 1
            raw.append(text[i:j])
            i = j
            continue
        j = _after_quoted(text, i)
        word += text[i:j]
        i = j
    end_word()
    return [_unquoted(w) for w in raw]


def _after_quoted(text: str, i: int) -> int:
    """The offset after the character at `i`, or after the quoted or substituted part that
    starts there."""
    ch = text[i]
    if ch == "\\":
        return min(i + 2, len(text))
    if ch == "$" and text.startswith("'", i + 1):
        return _after_ansi_c(text, i + 2)
    if ch == "'":
        return _after(text, "'", i + 1, "a single quote does not close")
    if ch == '"':
        return _after_double(text, i + 1)
    if ch == "`":
        return _after(text, "`", i + 1, "a backquote does not close")
    if ch in "$<>" and text.startswith("(", i + 1):
        return _after_parens(text, i + 2)
    return i + 1


def _unquoted(word: str) -> str:
    if "$(" in word or "<(" in word or ">(" in word or "`" in word or "$'" in word:
        return word
    try:
        found = shlex.split(word)
    except ValueError:
        return word
    return found[0] if len(found) == 1 else word


def command_words(text: str) -> list[str]:
    """The words of one simple command from the program on (assignments, wrappers and `exec`,
    `time`, `then`... before it left out); [] when it has none."""
    try:
        found = split_words(text)
    except ValueError:
        return []
    i = 0
    while i < len(found) and (found[i] in PREFIX_WORDS or ASSIGNMENT.match(found[i])):
        i = max(i + 1, _after_wrappers(found, i)) if _basename(found[i]) in WRAPPERS else i + 1
    return found[i:]


def end_of_words(script: str, segment: Segment) -> int:
    """The offset after a command's last word: its trailing blanks and line continuations
    (a backslash before a newline) left after the insertion point."""
    end = segment.end
    while end > segment.start:
        blank = script[end - 1] in " \t\n"
        continued = (script[end - 1] == "\\" and end < len(script) and script[end] == "\n")
        if not (blank or continued):
            break
        end -= 1
    return end


def piped(script: str, segment: Segment) -> bool:
    """Whether the command's output goes into a pipe (`|` or `|&`, not `||`)."""
    return script[segment.end:segment.end + 1] == "|" and \
        script[segment.end + 1:segment.end + 2] != "|"
