"""Token proof shared by both protocols: HMAC-SHA256(token, server nonce), never the token itself."""

from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 16


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def prove(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


def verify(token: str, nonce: bytes, proof: bytes) -> bool:
    return hmac.compare_digest(prove(token, nonce), bytes(proof))
