"""The bearer-key check every API of ours shares: the gateway's API keys, its admin routes and
the controller's operator API (cluster/control/operator.py)."""

from __future__ import annotations

import hmac


def bearer_matches(header: bytes, keys: list[bytes]) -> bool:
    """``Authorization: Bearer <one of keys>`` (the raw header value)."""
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    given = token.strip()
    ok = False
    for key in keys:  # every key, so timing says nothing about which one is close
        ok |= hmac.compare_digest(given, key)
    return ok
