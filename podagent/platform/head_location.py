"""Where a worker looks for the head: the one order, read by the worker's discovery, the
preflight check, the dry run and the role rules. Pure: settings in, no lookups.

The first that is set wins: an explicit PODAGENT_HEAD_ADDR, then HEAD_POD_ID's DNS name
(<HEAD_POD_ID>.<PODAGENT_DNS_SUFFIX>), then the Instant Cluster's PRIMARY_ADDR.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from podagent.config import Settings
from podagent.errors import NoHeadLocation

# The settings that can name the head, as the error for none of them says it.
OTHER_WAYS = "(or PODAGENT_HEAD_ADDR, or PRIMARY_ADDR)"


@dataclass(frozen=True)
class HeadTarget:
    target: str  # the address, or the DNS name to look up
    setting: str  # the variable (or flag) that gave it
    how: str  # how it is found: the setting, or "DNS" for a name made from it

    @property
    def is_address(self) -> bool:
        """An IP address: nothing to look up."""
        try:
            ipaddress.ip_address(self.target)
        except ValueError:
            return False
        return True


def head_location(settings: Settings) -> HeadTarget | None:
    """Which setting gives the head and what to resolve; None when none is set."""
    if settings.head_addr:
        given = settings.source_name("head_addr")
        return HeadTarget(settings.head_addr, given, given)
    if settings.head_dns_name:
        return HeadTarget(settings.head_dns_name, "HEAD_POD_ID", "DNS")
    if settings.primary_addr:
        return HeadTarget(settings.primary_addr, "PRIMARY_ADDR", "PRIMARY_ADDR")
    return None


def require_head_location(settings: Settings) -> HeadTarget:
    """As head_location; a worker without any raises NoHeadLocation (bad input)."""
    found = head_location(settings)
    if found is None:
        raise NoHeadLocation("HEAD_POD_ID", "", f"must be set on a worker {OTHER_WAYS}")
    return found
