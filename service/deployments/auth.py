"""API keys of the OpenAI ingress: `Authorization: Bearer KEY`, checked against SHA-256 hashes.

Keys come from a file (one key per line; blank lines and lines starting with `#` are ignored) and/or
the environment variable HYBRID_SERVE_API_KEYS (keys separated by commas or whitespace). Only their
hashes are kept. A presented key is hashed and compared with every stored hash by
`hmac.compare_digest` (no early exit), so the time taken does not depend on which key, or how much of
one, matched. A key is known to logs and metrics only by its id: the first 12 hex digits of its hash.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

API_KEYS_ENV = "HYBRID_SERVE_API_KEYS"
KEY_ID_HEX_DIGITS = 12
OPEN_KEY_ID = "anonymous"  # the caller's id when no keys are configured
MIN_KEY_CHARS = 8


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_id(key: str) -> str:
    """The id logs and metrics use for a key (a prefix of its SHA-256, not the key)."""
    return key_digest(key).hex()[:KEY_ID_HEX_DIGITS]


def parse_keys(text: str, source: str, one_per_line: bool) -> list[str]:
    """Keys in `text`: one per line (file) or separated by commas/whitespace (environment)."""
    if one_per_line:
        lines = [ln.strip() for ln in text.splitlines()]
        keys = [ln for ln in lines if ln and not ln.startswith("#")]
    else:
        keys = [k for k in text.replace(",", " ").split() if k]
    for k in keys:
        if len(k) < MIN_KEY_CHARS or any(c.isspace() for c in k):
            raise ValueError(
                f"{source}: an API key is shorter than {MIN_KEY_CHARS} characters or contains "
                f"whitespace; use long random keys (e.g. `openssl rand -hex 32`)"
            )
    return keys


@dataclass(frozen=True)
class ApiKeys:
    """The configured keys, as digests. Empty: authentication is off (every caller is `OPEN_KEY_ID`)."""

    digests: tuple[bytes, ...]  # SHA-256 of each key

    @classmethod
    def load(cls, keys_file: str | None, environ: Mapping[str, str] = os.environ) -> ApiKeys:
        """Keys from `keys_file` (if given: it must exist) and from HYBRID_SERVE_API_KEYS (if set)."""
        keys: list[str] = []
        if keys_file:
            path = Path(keys_file)
            if not path.is_file():
                raise ValueError(
                    f"api_keys_file {keys_file!r} does not exist or is not a file; "
                    f"create it (one key per line) or leave api_keys_file unset"
                )
            keys += parse_keys(path.read_text(encoding="utf-8"), f"api_keys_file {keys_file!r}", True)
            if not keys:
                raise ValueError(
                    f"api_keys_file {keys_file!r} holds no keys; an empty key file would leave the endpoint open"
                )
        keys += parse_keys(environ.get(API_KEYS_ENV, ""), API_KEYS_ENV, False)
        return cls(tuple(dict.fromkeys(key_digest(k) for k in keys)))

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def authenticate(self, authorization: str | None) -> str | None:
        """The key id for an `Authorization` header value, or None when it carries no valid key.
        With no keys configured every caller is `OPEN_KEY_ID`."""
        if not self.enabled:
            return OPEN_KEY_ID
        scheme, _, presented = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return None
        digest = key_digest(presented.strip())
        matched = False
        for stored in self.digests:  # every digest is compared: no early exit
            matched |= hmac.compare_digest(digest, stored)
        return digest.hex()[:KEY_ID_HEX_DIGITS] if matched else None
