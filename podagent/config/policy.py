"""Secret policy: which variables are secrets (never shown, never on a command line), which child
process keeps which secret, the cluster token's rules and file, and RunPod's API keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from podagent.errors import ConfigError, InputError

# Variables whose values must never be shown or put on a command line.
SECRET_NAMES = frozenset(
    {"WANDB_API_KEY", "RAY_AUTH_TOKEN", "PODAGENT_TOKEN", "RUNPOD_API_KEY", "HF_TOKEN",
     "PODAGENT_RUNPOD_API_KEY"}
)
SECRET_SUFFIXES = ("_TOKEN", "_KEY", "_SECRET", "_PASSWORD")


REDACTED_VALUE = "<redacted>"


def is_secret(name: str) -> bool:
    return name in SECRET_NAMES or name.upper().endswith(SECRET_SUFFIXES)


# --- RunPod's API keys --------------------------------------------------------------------------

RUNPOD_API_KEY = "RUNPOD_API_KEY"  # RunPod's own name; a secret, read from the environment
# An account key given to the pods of an `up` run (a RunPod secret) to terminate them all at
# its end; the pod-scoped RUNPOD_API_KEY may not be allowed to.
RUNPOD_ACCOUNT_KEY = "PODAGENT_RUNPOD_API_KEY"
RUNPOD_API_KEY_FILE = "RUNPOD_API_KEY_FILE"


def runpod_key(environ: Mapping[str, str], key_file: str | None = None,
               names: tuple[str, ...] = (RUNPOD_API_KEY,), from_file: bool = True) -> str | None:
    """RunPod's API key, the one place podagent reads one: from the first of `names` set in the
    environment, else (`from_file`) from a file (`key_file`, or RUNPOD_API_KEY_FILE), never from
    a command line, where every user of the machine could read it. None when there is none; a
    file that cannot be read is InputError."""
    for name in names:
        key = environ.get(name, "").strip()
        if key:
            return key
    path = (key_file or environ.get(RUNPOD_API_KEY_FILE, "").strip()) if from_file else ""
    if not path:
        return None
    try:
        key = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise InputError(f"--api-key-file {path!r}: cannot be read "
                         f"({exc.strerror or exc})") from None
    if not key:
        raise InputError(f"--api-key-file {path!r}: is empty (it should hold the key)")
    return key


# --- the cluster token and which child gets which secret ----------------------------------------

TOKEN_VARIABLES = ("RAY_AUTH_TOKEN", "PODAGENT_TOKEN")
TOKEN_PATH_VARIABLE = "RAY_AUTH_TOKEN_PATH"  # Ray's own: a file that holds the token
RAY_AUTH_MODE = "RAY_AUTH_MODE"  # Ray's own: podagent sets it on every node (ray_node.auth_env)
TOKEN_RULE = "at least 16 printable characters without spaces (`podagent token` makes one)"

# Which child gets which secret (docs/secrets.md). RUNPOD_API_KEY is podagent's alone (it stops
# the pod); Ray and the job keep every other one (the job's W&B key, the cluster token Ray
# needs); a reward server never talks to Ray, so never gets the cluster token, and the built-in
# one, which runs sympy on model output, gets no secret at all.
ONLY_PODAGENTS = (RUNPOD_API_KEY, RUNPOD_ACCOUNT_KEY)
CLUSTER_TOKEN = (*TOKEN_VARIABLES, TOKEN_PATH_VARIABLE)


def child_environ(environ: Mapping[str, str], also_drop: Callable[[str], bool] = lambda _: False
                  ) -> dict[str, str]:
    """The environment a child of podagent starts with: never ONLY_PODAGENTS's secrets, nor
    the variables `also_drop` names."""
    return {k: v for k, v in environ.items() if k not in ONLY_PODAGENTS and not also_drop(k)}


def _valid_token(value: str) -> bool:
    return len(value) >= 16 and not any(c.isspace() for c in value) and value.isprintable()


def read_token_file(env: Mapping[str, str]) -> str | None:
    """The token in the file RAY_AUTH_TOKEN_PATH names, read once; errors name the variable,
    the path and the rule, never the content."""
    raw = env.get(TOKEN_PATH_VARIABLE, "").strip()
    if not raw:
        return None
    try:
        # A token file is tiny; reading a few KiB at most keeps a wrong path (a device, a
        # huge log) from hanging or flooding podagent.
        with open(raw, "rb") as f:
            content = f.read(4096)
        value = content.decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not text"
        raise ConfigError(TOKEN_PATH_VARIABLE, raw,
                          f"must name a readable file that holds the cluster token ({why})"
                          ) from None
    if not _valid_token(value):
        raise ConfigError(TOKEN_PATH_VARIABLE, raw, f"must name a file that holds {TOKEN_RULE}")
    return value


def check_token(environ: Mapping[str, str], token_from_file: str | None) -> None:
    """The token variables set (and the token file's content, read by read_token_file) are
    valid and agree."""
    # Values are never shown: the message names the variable and the rule only.
    given = {n: environ[n].strip() for n in TOKEN_VARIABLES if environ.get(n, "").strip()}
    for name, value in given.items():
        if not _valid_token(value):
            raise ConfigError(name, REDACTED_VALUE, f"must be {TOKEN_RULE}")
    if len(set(given.values())) > 1:
        raise ConfigError("PODAGENT_TOKEN", REDACTED_VALUE,
                          "must equal RAY_AUTH_TOKEN when both are set")
    mode = environ.get(RAY_AUTH_MODE, "").strip().lower()
    if mode == "token" and not given and not token_from_file:
        raise ConfigError(RAY_AUTH_MODE, "token",
                          "needs the run's cluster token on every pod: set PODAGENT_TOKEN, "
                          "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH (podagent decides Ray's auth "
                          "for every node; a token file Ray would find by itself may be on one "
                          "pod only)")
    if token_from_file and given and token_from_file not in given.values():
        raise ConfigError(TOKEN_PATH_VARIABLE, environ[TOKEN_PATH_VARIABLE].strip(),
                          f"must name a file holding the same token as {', '.join(given)} "
                          f"when both are set")
