"""API keys for the public gRPC API: `authorization: Bearer <key>` in the call's metadata.

Keys come from a file (one per line, `#` comments) and/or an environment variable
(comma-separated), read when the router starts; only their SHA-256 digests are kept and no
key is ever logged. No keys configured = no authentication (the router warns once).
Missing or malformed credentials: UNAUTHENTICATED; a key that is not known: PERMISSION_DENIED.
"""

from __future__ import annotations

import hashlib
import hmac
import os


class AuthError(Exception):
    def __init__(self, code_name: str, message: str):
        super().__init__(message)
        self.code_name, self.message = code_name, message


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_keys(path: str | None, env_var: str | None) -> list[bytes]:
    """Digests of the configured keys (ValueError when a named file holds none)."""
    keys: list[str] = []
    if path:
        with open(path) as f:
            keys += [line.strip() for line in f if line.strip() and not line.startswith("#")]
        if not keys:
            raise ValueError(f"api_keys_file {path} has no keys")
    if env_var and os.environ.get(env_var):
        keys += [k.strip() for k in os.environ[env_var].split(",") if k.strip()]
    return [_digest(k) for k in keys]


def check(metadata, digests: list[bytes]) -> None:
    """Raise AuthError unless the metadata carries one of the keys (no keys: allow all)."""
    if not digests:
        return
    header = next((v for k, v in metadata if k.lower() == "authorization"), None)
    if header is None:
        raise AuthError("UNAUTHENTICATED", "missing credentials: send the metadata "
                        "'authorization: Bearer <api key>'")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthError("UNAUTHENTICATED", "malformed authorization: use 'Bearer <api key>'")
    given = _digest(key.strip())
    if not any(hmac.compare_digest(given, d) for d in digests):  # constant time per key
        raise AuthError("PERMISSION_DENIED", "API key not accepted")
