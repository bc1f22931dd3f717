"""Mutual authentication on both RPC protocols: each side proves the token, never sends it.

The client opens with a nonce of its own; the server answers with its nonce, its role and its proof;
the client checks that proof before it sends anything else, then answers with its own proof. A
proof is HMAC-SHA256(token, label + client nonce + server nonce), the label naming the protocol,
the direction and the server's role, so:
- a proof made for one connection is useless on another (both nonces are in it, one chosen by
  each side);
- a server's proof never passes as a client's, nor a control proof as a compute one;
- a proof from a worker of another role fails where the client expects a peer or a prefill
  worker (a fake prefill worker relaying a head's own control port, say);
- a server refuses a client nonce its own process issued as a client (a fake handing a head's
  challenge back to the head, to have the head prove itself to itself).
A counterpart that offers no authentication while we hold a token is refused (no downgrade).
What the handshake does not give: confidentiality or integrity of the frames after it (see the
threat model in docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import threading

NONCE_BYTES = 16
PROOF_BYTES = 32
ROLES = ("head", "prefill", "peer")
OWN_NONCES_KEPT = 4096  # client nonces this process issued, for the reflection check

_own: collections.OrderedDict[bytes, None] = collections.OrderedDict()
_own_lock = threading.Lock()


class AuthError(Exception):
    """The counterpart did not prove the token (or offered no way to)."""


def _proof(token: str, protocol: str, direction: str, role: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    label = f"hydra-auth/2/{protocol}/{direction}/{role}\0".encode()
    return hmac.new(token.encode(), label + bytes(client_nonce) + bytes(server_nonce), hashlib.sha256).digest()


def _issued_here(nonce: bytes) -> bool:
    with _own_lock:
        return nonce in _own


class ClientHandshake:
    """The dialling side: `nonce` goes out first; `answer` checks the server's proof and returns ours."""

    def __init__(self, token: str, protocol: str, expect: tuple[str, ...]):
        self.token, self.protocol, self.expect = token, protocol, expect
        self.nonce = os.urandom(NONCE_BYTES)
        with _own_lock:
            _own[self.nonce] = None
            while len(_own) > OWN_NONCES_KEPT:
                _own.popitem(last=False)

    def answer(self, server_nonce: bytes, role: str, server_proof: bytes) -> bytes:
        """Our proof, once the server proved the token as a worker of a role we expect; else AuthError."""
        if role not in self.expect:
            raise AuthError(f"it is a {role!r} worker, not a {' or '.join(self.expect)}")
        if len(server_nonce) != NONCE_BYTES:
            raise AuthError(f"its nonce has {len(server_nonce)} bytes, not {NONCE_BYTES}")
        expected = _proof(self.token, self.protocol, "server", role, self.nonce, server_nonce)
        if not hmac.compare_digest(expected, bytes(server_proof)):
            raise AuthError("it did not prove the token")
        return _proof(self.token, self.protocol, "client", role, self.nonce, server_nonce)


class ServerHandshake:
    """The accepting side, built from the client's nonce: `nonce` and `proof` go back with `role`;
    `check` takes the client's proof."""

    def __init__(self, token: str, protocol: str, role: str, client_nonce: bytes):
        client_nonce = bytes(client_nonce)
        if len(client_nonce) != NONCE_BYTES:
            raise AuthError(f"the client nonce must have {NONCE_BYTES} bytes, not {len(client_nonce)}")
        if _issued_here(client_nonce):
            raise AuthError("the client nonce is one this process issued: a reflected handshake")
        self.token, self.protocol, self.role, self.client_nonce = token, protocol, role, client_nonce
        self.nonce = os.urandom(NONCE_BYTES)
        self.proof = _proof(token, protocol, "server", role, client_nonce, self.nonce)

    def check(self, client_proof: bytes) -> bool:
        expected = _proof(self.token, self.protocol, "client", self.role, self.client_nonce, self.nonce)
        return hmac.compare_digest(expected, bytes(client_proof))


def control_login(token: str, expect: tuple[str, ...], exchange) -> None:
    """The control protocol's AUTH pair over `exchange(payload) -> (ok, meta)`: our nonce, the
    server's proof checked, ours sent. AuthError when the server offers no authentication (a
    downgrade), fails its proof or refuses ours."""
    hs = ClientHandshake(token, "control", expect)
    ok, meta = exchange(hs.nonce)
    if not ok:
        raise AuthError(f"it refused our nonce: {meta.get('error', 'no reason')}")
    if not meta.get("auth"):
        raise AuthError("it offers no authentication and we hold a token (start it with the same token)")
    try:
        ours = hs.answer(bytes.fromhex(meta["nonce"]), str(meta.get("role")), bytes.fromhex(meta["proof"]))
    except (KeyError, ValueError, TypeError):
        raise AuthError("its AUTH answer is malformed") from None
    ok, meta = exchange(ours)
    if not ok:
        raise AuthError(f"it rejected our proof: {meta.get('error', 'no reason')} (a different token?)")
