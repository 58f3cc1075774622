"""Prints the settings tables, generated from FIELDS: docs/settings.md's (one per group), then
the README's (the settings a first run needs)."""

from podagent.config.fields import first_run_table, settings_page

print(settings_page())
print()
print(first_run_table())
