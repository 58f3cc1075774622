"""Settings: built once (flags > environment > defaults) into one frozen object.

This package names only that object (Settings) and how it is built (build). One module per job
defines everything else, and callers import each other name from the module that defines it:
  parsers   the value parsers (each returns a value or raises ValueError(rule))
  fields    the declarations (FIELDS, REWARD_FIELDS), the Settings class, the README tables
  building  reading fields from flags and environment, derived defaults, rules between settings
  policy    secrets: which variables, which child keeps which, the cluster token, RunPod keys
  names     the other PODAGENT_* variables and the warnings for unknown ones
ConfigError and InputError are podagent.errors'.
`python -m podagent.config` prints the settings tables (docs/settings.md's and the README's).
"""

from podagent.config.building import build
from podagent.config.fields import Settings

__all__ = ["Settings", "build"]
