"""The head's side of a new compute connection's opening: HELLO's version check, then the mutual
authentication when either side holds a token."""

from __future__ import annotations

from collections.abc import Callable

from ...contracts.auth import NONCE_BYTES, PROOF_BYTES, AuthError, ClientHandshake
from ...contracts.rpc import CAP_AUTH, HELLO, VERSION, Cmd
from ...contracts.rpc import ReplyStatus as R
from .compute import pack_hello
from .peer_errors import PeerMismatch
from .wire import reply_status


def open_session(
    addr: str, auth_token: str | None, exchange: Callable[[int, bytes], bytes], read_reply: Callable[[], bytes]
) -> int:
    """HELLO (and AUTH when the peer asks for it) over one connection's `exchange` / `read_reply`;
    returns the peer's capability bits. PeerMismatch: a peer we must not use."""
    hs = ClientHandshake(auth_token, "compute", ("peer",)) if auth_token else None
    reply = exchange(Cmd.HELLO, pack_hello(CAP_AUTH, nonce=hs.nonce) if hs else pack_hello())
    if len(reply) < HELLO.size:
        raise PeerMismatch(f"peer {addr} answered HELLO with {len(reply)} bytes: not a Hydra worker")
    major, minor, patch, _, caps = HELLO.unpack_from(reply)
    if (major, minor) != VERSION[:2]:
        detail = bytes(reply[HELLO.size :]).decode("utf-8", "replace")
        raise PeerMismatch(f"peer {addr} speaks compute protocol {major}.{minor}.{patch}, we {VERSION}: {detail}")
    if caps & CAP_AUTH and hs is None:
        raise PeerMismatch(f"peer {addr} requires a token: set --auth-token or HYDRA_TOKEN")
    if hs is None:
        return caps
    if not caps & CAP_AUTH:  # the peer proves the token before we send it anything
        raise PeerMismatch(
            f"peer {addr} offers no authentication and we hold a token: refused "
            "(start it with the same --auth-token / HYDRA_TOKEN)"
        )
    challenge = bytes(read_reply())
    nonce, proof, role = (
        challenge[:NONCE_BYTES],
        challenge[NONCE_BYTES : NONCE_BYTES + PROOF_BYTES],
        challenge[NONCE_BYTES + PROOF_BYTES :],
    )
    try:
        ours = hs.answer(nonce, role.decode("utf-8", "replace"), proof)
    except AuthError as e:
        raise PeerMismatch(
            f"peer {addr} failed to authenticate ({e}): a different --auth-token, or not one of our workers"
        ) from None
    status, body = reply_status(exchange(Cmd.AUTH, ours))
    if status != R.OK:
        raise PeerMismatch(f"peer {addr} rejected our token: {body.decode(errors='replace')}")
    return caps
