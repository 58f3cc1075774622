"""Prints the README's settings table, generated from FIELDS."""

from podagent.config.fields import settings_table

print(settings_table())
