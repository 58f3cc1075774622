"""Settings: built once (flags > environment > defaults) into one frozen object.

One module per job; this package's names are theirs, so callers import from podagent.config:
  parsers   the value parsers (each returns a value or raises ValueError(rule))
  fields    the declarations (FIELDS, REWARD_FIELDS), the Settings class, the README tables
  building  reading fields from flags and environment, derived defaults, rules between settings
  policy    secrets: which variables, which child keeps which, the cluster token, RunPod keys
  names     the other PODAGENT_* variables and the warnings for unknown ones
`python -m podagent.config` prints the README's settings table.
"""

from podagent.config.building import build, derived_run_name, read_fields
from podagent.config.fields import (
    AFTER_RUN,
    FIELD_BY_ATTR,
    FIELDS,
    FORMAT_WEIGHT,
    ON_NODE_LOSS,
    REWARD_ENV_PREFIX,
    REWARD_FIELD_BY_ATTR,
    REWARD_FIELDS,
    RUN_NAME_FROM_HEAD_POD_ID,
    RUN_NAME_FROM_POD_ID,
    RUN_NAME_FROM_PRIMARY_ADDR,
    RUNPOD_API_URL,
    Field,
    RewardField,
    Settings,
    markdown_table,
    reward_setting,
    settings_class,
    settings_table,
)
from podagent.config.names import (
    OTHER_VARIABLES,
    PREFIX,
    RAY_OWNER,
    RETIRED_VARIABLES,
    REWARD_PRELOAD,
    UP_RUN_LABEL,
    known_variables,
    ray_owner,
    unknown_settings,
)
from podagent.config.parsers import (
    REWARD_FUNC_RULE,
    choice,
    command_line,
    directory,
    dns_suffix,
    existing_file,
    host,
    host_port,
    http_url,
    ipv4,
    key,
    number,
    path,
    pod_id,
    port,
    preset_dir,
    preset_name,
    preset_names,
    reward_func_file,
    run_name,
    seconds,
    seconds_or_zero,
    short_path,
    size,
    whole,
    zero_one,
)
from podagent.config.policy import (
    CLUSTER_TOKEN,
    ONLY_PODAGENTS,
    REDACTED_VALUE,
    RUNPOD_ACCOUNT_KEY,
    RUNPOD_API_KEY,
    RUNPOD_API_KEY_FILE,
    SECRET_NAMES,
    SECRET_SUFFIXES,
    TOKEN_PATH_VARIABLE,
    TOKEN_RULE,
    TOKEN_VARIABLES,
    child_environ,
    is_secret,
    runpod_key,
)
from podagent.errors import ConfigError, InputError

__all__ = [
    "AFTER_RUN", "CLUSTER_TOKEN", "FIELDS", "FIELD_BY_ATTR", "FORMAT_WEIGHT", "ONLY_PODAGENTS",
    "ON_NODE_LOSS", "OTHER_VARIABLES", "PREFIX", "RAY_OWNER", "REDACTED_VALUE",
    "RETIRED_VARIABLES", "REWARD_ENV_PREFIX", "REWARD_FIELDS", "REWARD_FIELD_BY_ATTR",
    "REWARD_FUNC_RULE", "REWARD_PRELOAD", "RUNPOD_ACCOUNT_KEY", "RUNPOD_API_KEY",
    "RUNPOD_API_KEY_FILE", "RUNPOD_API_URL", "RUN_NAME_FROM_HEAD_POD_ID",
    "RUN_NAME_FROM_POD_ID", "RUN_NAME_FROM_PRIMARY_ADDR", "SECRET_NAMES", "SECRET_SUFFIXES",
    "TOKEN_PATH_VARIABLE", "TOKEN_RULE", "TOKEN_VARIABLES", "UP_RUN_LABEL", "ConfigError",
    "Field", "InputError", "RewardField", "Settings", "build", "child_environ", "choice",
    "command_line", "derived_run_name", "directory", "dns_suffix", "existing_file", "host",
    "host_port", "http_url", "ipv4", "is_secret", "key", "known_variables", "markdown_table",
    "number", "path", "pod_id", "port", "preset_dir", "preset_name", "preset_names",
    "ray_owner", "read_fields", "reward_func_file", "reward_setting", "run_name", "runpod_key",
    "seconds", "seconds_or_zero", "settings_class", "settings_table", "short_path", "size",
    "unknown_settings", "whole", "zero_one",
]
