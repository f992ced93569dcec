"""API keys: `Authorization: Bearer <key>`, compared in constant time against every configured key."""
from __future__ import annotations

import hmac


class ApiKeyAuth:
    def __init__(self, api_keys: tuple[str, ...]) -> None:
        self._keys = tuple(k.encode() for k in api_keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> bool:
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for key in self._keys:  # no early exit: the time taken does not say which key came close
            ok |= hmac.compare_digest(presented, key)
        return ok and bool(presented)
