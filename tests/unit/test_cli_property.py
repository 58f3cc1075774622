"""Generated bad input through the real CLI entry: every combination of settings either runs
the dry configuration path (exit 0) or exits 2 with exactly one line naming a variable.
Never a traceback, never exit 1."""

from __future__ import annotations

import os

from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from podagent import cli
from podagent.config.fields import FIELDS

ROLE_VARIABLES = ["RAY_WORKER", "HEAD_POD_ID", "RUNPOD_POD_ID", "NODE_RANK", "PRIMARY_ADDR",
                  "NUM_NODES", "NODE_ADDR", "EXPECTED_WORKERS", "DEBUG_RAY"]
VARIABLES = sorted({f.env for f in FIELDS} | set(ROLE_VARIABLES))

hostile = st.one_of(
    st.text(max_size=40),  # any unicode, control characters, whitespace
    st.integers(min_value=-10**12, max_value=10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["", " ", "\t", "0", "1", "2", "-1", "yes", "auto", "none", "cmd",
                     "builtin", "bogus", "runpod-global", "infiniband", "10.0.0.1",
                     "10.0.0.1:5353", "10.0.0", "host:1:2", "a b", "a/b", "'", '"',
                     "abc123", "ABC_123", "x" * 70, "9" * 30, "1e309", "٣", "１２"]),
).filter(lambda value: "\x00" not in value)  # an environment cannot hold NUL

environments = st.dictionaries(st.sampled_from(VARIABLES), hostile, min_size=1, max_size=5)


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(env=environments, command=st.sampled_from([[], ["head"], ["worker"]]))
def test_any_settings_dry_run_or_one_line_exit_2(tmp_path_factory, env, command):
    # A clean slate, then only the generated variables (and a log dir that must stay empty).
    base = {k: None for k in os.environ if k in VARIABLES or k.startswith("PODAGENT_")}
    logs = tmp_path_factory.mktemp("logs")
    environ = {**base, **env}
    environ.setdefault("PODAGENT_LOG_DIR", str(logs))
    result = CliRunner().invoke(cli.main, [*command, "--dry-run"], env=environ)

    assert isinstance(result.exception, SystemExit) or result.exception is None, (
        f"{type(result.exception).__name__}: {result.exception} for {env!r}")
    assert result.exit_code in (0, 2), (result.exit_code, env, result.output)
    event(f"exit {result.exit_code}")
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (env, result.stderr)
        named = [name for name in [*VARIABLES, *(f.flag for f in FIELDS)]
                 if name in lines[0]]
        assert named, (env, lines[0])
    assert not any(logs.iterdir()), "the dry run wrote into the log dir"
