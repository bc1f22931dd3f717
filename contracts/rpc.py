"""The merged RPC port's bytes, declared once for the head, the peer and the console (DESIGN §4).

Like ggml-rpc's packed-struct block that both ends include: every command id, status code,
capability bit and request/response layout is here, and `engine/rpc` and `app/control_client`
import them. The JSON layouts are `Message` dataclasses (contracts/wire_json.py): the client builds
one and `encode`s it, the server `decode`s the payload into it before its handler runs, refusing a
wrong type, a missing or unknown key or a number out of bounds with the field named (compute:
ERROR, control: BAD_REQUEST). The control framing and the frame readers are `contracts/framing.py` (the console's
too); the compute framing is `engine/rpc/wire.py`.

Compute protocol (ggml-rpc framing): request `cmd u8 | size u64 LE | payload`, response
`size u64 LE | payload`. HELLO (14) first; with a token both sides prove it (contracts/auth.py):
the client's HELLO carries CAP_AUTH and its nonce after the struct, the server answers HELLO and
then a frame of its nonce, its 32-byte proof and its role, and the client answers AUTH with its
own proof. Before AUTH only HELLO, AUTH and PING
(control: AUTH) are read, in frames of at most PREAUTH_MAX_FRAME; anything else closes the
connection unanswered. Every reply to our commands (ids >= 32)
starts with a `ReplyStatus` byte, then JSON, raw bytes or an error message:

| cmd | request payload | reply after the status byte |
|---|---|---|
| HELLO 14 | `HELLO` (major, minor, patch, pad, caps) | (no status byte) `HELLO` of the server, then a refusal text if versions differ |
| AUTH 40 | the client's 32-byte proof | empty |
| CHECK 39 | JSON `CheckRequest` | JSON `CheckReply` |
| LOAD_STAGE 32 | JSON `LoadStageRequest` | JSON `LoadStageReply` |
| RESOLVE 33 | tensor name (UTF-8) | JSON {"found", "epoch", "dtype", "shape"} |
| FORWARD 34 | `FORWARD_HEADER` + int32 slots[T] + int32 positions[T] + hidden[T, d] raw | (own header) `FORWARD_REPLY` + hidden raw |
| FORWARD_IPC 42 | FORWARD without the hidden bytes | `FORWARD_REPLY` |
| FORWARD_ACK 47 | FORWARD (peers with `CAP_FORWARD_ACK`) | `FORWARD_REPLY` alone: the head needs no hidden states back |
| KV_TRIM 35 | `KV_TRIM` (slot i32, n u32) | empty |
| KV_CLEAR 36 | `KV_CLEAR` (slot i32; -1 = all) | empty |
| KV_SHIFT 48 | `KV_SHIFT` (slot i32, keep u32, discard u32, n u32) | empty: the slot's positions [keep + discard, n) moved down by discard, K re-rotated (the head's context shift) |
| STATS 37 | empty | JSON |
| PING 38 | up to 64 bytes | the same bytes |
| IPC_OPEN 41 | JSON `IpcOpenRequest` | JSON channel description |
| STATE_META 43 | `STATE_SLOT` (slot i32) | JSON `StateMeta` |
| STATE_GET 44 | JSON `StateGetRequest` | the slot's state in the slot-state format (contracts.slot_state), chunked and checksummed |
| STATE_PUT 45 | `STATE_SLOT` + a slot state (at most STATE_PUT_CAP; larger is drained in DRAIN_CHUNK pieces and refused) | JSON `StateMeta` of the placed slot |
| STATE_JOIN 46 | the 16 bytes of LOAD_STAGE's `state_key` (hex there) | empty: this session now owns the stage's slots too |
| PROBE 50 | JSON `ProbeRequest` | JSON `StageProbe` (the loading session only) |

STATE_GET and STATE_PUT touch a slot's KV: like FORWARD, only the session that loaded the stage
(its head) may send them, after AUTH, or a second session of that head that joined it with the
key only the loading session was given (STATE_JOIN): a state streams in there while the forwards
go on over the first; the peer takes its forward lock only for the final copy into the slot. A refused STATE_PUT (wrong fingerprint, layer range, dtype,
a chunk that fails its crc32, a stream that ends early) leaves the slot exactly as it was: the
state is staged whole and checked before its first byte reaches the slot.

Hydra control protocol (the fork's framing): request `CONTROL_HEADER` (magic, op, flags,
key_len, payload_len, trace_len) + key + trace + payload; response `CONTROL_RESPONSE`
(status u8 | meta_len u24, payload_len u64) + meta JSON + payload. The state ops, keyed by
slot id (ASCII), on a head's whole pipeline (its layers and its peers'):

| op | request payload | reply meta / payload |
|---|---|---|
| STATE_META 0x32 | empty | `StateMeta` / empty |
| STATE_GET 0x30 | empty | `StateMeta` / one slot state per stage, back to back, pipeline order |
| STATE_PUT 0x31 | slot states (any grouping of layers that covers the model) | `StateMeta` of the placed slot |
| PREFILL 0x42 | JSON `PrefillRequest` (key ignored) | `PrefillReply` / one slot state per requested range (none when the reply hands them over by CUDA IPC, or wrote them into the asker's shared memory) |
| PROBE 0x50 | JSON `PipelineProbeRequest` | `PipelineProbe` |
| CONFIGURE 0x40 | JSON `ConfigureRequest` (a live re-split) | {"ok", ...the re-split's timings} |
| INFO 0x41 | empty | the worker's identity, split, peers and ops |

PREFILL between a decode head and a prefill worker on one host: the head offers a file of its own
under SHM_DIR (`ShmOffer`: mode 0600, created exclusively, a name of SHM_NAME's form), holding its
`nonce` in the first bytes; a worker that opens that name, finds the nonce and has room writes the
states there, back to back from SHM_DATA_OFFSET, in the slot-state format (each chunk's crc32
included), and answers `PrefillReply.shm` with their sizes and no payload. Any other worker (another
host or mount namespace: no such file, or another nonce) answers bytes as it always did.

PROBE (compute 50, control 0x50) is the split advisor's measurement: on the control port the head
answers a `PipelineProbe` (a `PipelineProbeRequest` in) after timing its own layers and asking each
peer for a `StageProbe` over its compute session, on the positions no slot holds yet.

FORWARD_ACK pipelines a long prompt: a chunk whose output nobody reads (not the prompt's last) goes
to the last stage unawaited (to one whose MTP block follows every batch: FORWARD_OUT with no rows
and OUT_TOKENS), the head computing the next; the peer runs its frames in order, so the replies
(FORWARD_REPLY alone) are read later, before anything else on that connection, at most
`--prefill-pipeline` outstanding.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from .footprint import KV_VALUE_BYTES
from .wire_json import Message, WireError, spec

# --- framing ---------------------------------------------------------------------------------------

COMPUTE_FIRST_BYTE = 0x0E  # HELLO's command id: what a compute client always sends first
CONTROL_MAGIC = 0x4859  # b"YH" on the wire: control frames start with 0x59

COMPUTE_HEADER = struct.Struct("<BQ")
COMPUTE_SIZE = struct.Struct("<Q")
CONTROL_HEADER = struct.Struct("<HBBHQH")
CONTROL_RESPONSE = struct.Struct("<IQ")  # status u8 + meta_len u24 packed in one u32, payload_len
MAX_META = (1 << 24) - 1
DRAIN_CHUNK = 64 * 1024
STATE_PUT_CAP = 4 << 30  # 4 GiB of KV in one frame

# --- exposure limits (DESIGN §4): what a connection may cost before and after it proves the token ---

PREAUTH_MAX_FRAME = 4 << 10  # HELLO, AUTH, PING before AUTH: whole frame, header included
HEADER_DEADLINE_S = 10.0  # a connection's first frame (and each handshake frame) must arrive within this
FRAME_RATE = 1 << 20  # bytes/s: a frame must complete within HEADER_DEADLINE_S + size / FRAME_RATE
CONTROL_IDLE_S = 60.0  # control connections close after this long without a request
# Compute sessions of a head are pinged every few seconds by its watcher, so a long idle limit
# only ever closes abandoned ones; TCP keepalive (30/10/3) finds dead hosts sooner.
COMPUTE_IDLE_S = 300.0
BACKLOG = 128
MAX_CONNS = 1024  # open connections per port, handshaking or not
MAX_CONNS_PER_IP = 32  # per remote address; loopback is exempt (every local client shares it)


def frame_deadline(size: int) -> float:
    """Seconds a frame of `size` payload bytes may take to arrive once its header has (a size over
    every cap gets the largest cap's deadline: the frame is refused or drained, never read whole)."""
    return HEADER_DEADLINE_S + min(size, STATE_PUT_CAP) / FRAME_RATE


# --- compute protocol --------------------------------------------------------------------------------

VERSION = (72, 1, 0)  # major 72 ("H") never matches an upstream ggml-rpc major (1..3)
CAP_AUTH, CAP_FORWARD, CAP_RESOLVE, CAP_IPC, CAP_FORWARD_ACK, CAP_OUTPUT = 1, 2, 4, 8, 16, 32


class Cmd:
    HELLO = 14  # ggml-rpc's id
    LOAD_STAGE = 32
    RESOLVE = 33
    FORWARD = 34
    KV_TRIM = 35
    KV_CLEAR = 36
    STATS = 37
    PING = 38
    CHECK = 39
    AUTH = 40
    IPC_OPEN = 41
    FORWARD_IPC = 42
    STATE_META = 43
    STATE_GET = 44
    STATE_PUT = 45
    STATE_JOIN = 46
    FORWARD_ACK = 47  # FORWARD answered by its status alone: a pipelined prompt chunk
    KV_SHIFT = 48  # a slot's context shift (the head's --context-shift)
    FORWARD_OUT = 49  # FORWARD through the output held by the last stage (--output-stage last): logits back
    PROBE = 50  # time the resident layers one by one (the split advisor)
    DRAFT = 51  # drafts of the MTP block the last stage holds (--output-stage last)


class ReplyStatus:
    OK, ERROR, STALE_EPOCH = 0, 1, 2


HELLO = struct.Struct("<BBBBI")
HELLO_MAX = 64  # a HELLO payload longer than this is not a HELLO
FORWARD_HEADER = struct.Struct("<QIIB3x")  # epoch, n_tokens, n_embd, dtype code
FORWARD_REPLY = struct.Struct("<B3xI")  # status, peer compute µs
# FORWARD_OUT: a FORWARD payload, then this (logit rows R, drafts ahead A, flags), rows int32[R], with
# OUT_TOKENS the batch's token ids int32[T] (what the MTP block there follows), then A AHEAD entries.
# The reply: FORWARD_REPLY, float32 logits [R, n_vocab] (with OUT_ARGMAX each row's argmax int32 [R]
# instead: every row is read for it alone), with OUT_HIDDEN every row's normed hidden state float32
# [T, n_embd], then per AHEAD entry AHEAD_DRAFT and its tokens int32[count].
FORWARD_OUT = struct.Struct("<IIB3x")
OUT_HIDDEN, OUT_TOKENS, OUT_ARGMAX = 1, 2, 4
# A slot that verified `drafted` tokens greedily in this batch: the stage takes the target's argmax
# rows as the head will (the draft's matching prefix, then the target's token), and drafts up to k
# tokens from there with its MTP block at p-min: the next step's draft, with no DRAFT round trip.
AHEAD = struct.Struct("<iIIf")  # slot, drafted, k, p_min
AHEAD_DRAFT = struct.Struct("<iiI")  # position of the token drafted from, that token, count
KV_TRIM = struct.Struct("<iI")
KV_CLEAR = struct.Struct("<i")
KV_SHIFT = struct.Struct("<iIII")  # slot, keep, discard, n
PING_MAX = 64
STATE_SLOT = struct.Struct("<i")

# Hidden-state dtypes on the wire, by torch name (the engine maps names to torch dtypes).
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


MAX_SLOTS = 1024  # LOAD_STAGE bounds, before any memory estimate
MAX_CTX = 1 << 20
MAX_RUN = 64  # tokens per slot in one step (a speculative verify's draft + 1)
MAX_LAYERS = 1 << 16  # layer indices on the wire, before the model's own count judges them
MAX_TOKEN_ID = (1 << 31) - 1
MAX_BYTES = 1 << 62  # sizes and byte counts on the wire
PROBE_TOKENS, PROBE_REPS = 32, 3  # PROBE's defaults: a 32-token prefill probe, median of 3
MAX_PROBE_TOKENS, MAX_PROBE_REPS = 512, 20  # an operator's key press stays a short pause for the requests
IPC_ROWS = 1024  # IPC_OPEN's default rows per buffer; larger batches (long prefills) take the byte path
MAX_IPC_ROWS = 1 << 16

# --- the JSON layouts (contracts/wire_json.py: from_json refuses wrong types, missing or unknown
# keys and numbers out of bounds, naming the field) -------------------------------------------------

_PROBE_WHY = f"probe 'tokens' must be 1..{MAX_PROBE_TOKENS} and 'reps' 1..{MAX_PROBE_REPS}, both integers"
_SIZE_WHY = f"n_slots must be 1..{MAX_SLOTS} and n_ctx 1..{MAX_CTX}"
_SLOT = spec(lo=0, hi=MAX_SLOTS - 1)
_TOKENS = spec(lo=0, hi=MAX_TOKEN_ID, length=(0, MAX_CTX))
_RANGE = spec(lo=0, hi=MAX_LAYERS, length=(2, 2))  # [a, b)


@dataclass(frozen=True, kw_only=True)
class CheckRequest(Message):
    OP = "CHECK"
    fingerprint: str  # GGUF header + tensor table hash
    shapes: dict[str, list[int]] = spec(lo=0, hi=MAX_BYTES, length=(0, 8))  # every tensor's shape, torch order


@dataclass(frozen=True, kw_only=True)
class CheckReply(Message):
    OP = "CHECK reply"
    ok: bool
    fingerprint: str
    epoch: int = spec(lo=0, hi=MAX_BYTES)


@dataclass(frozen=True, kw_only=True)
class LoadStageRequest(Message):
    OP = "LOAD_STAGE"
    layers: list[int] = _RANGE
    dtype: str = spec("float32", choices=DTYPE_CODES)  # a DTYPE_CODES name
    n_slots: int = spec(lo=1, hi=MAX_SLOTS, why=_SIZE_WHY)
    n_ctx: int = spec(lo=1, hi=MAX_CTX, why=_SIZE_WHY)  # per slot
    # positions of a KV pool the slots share (--kv-unified); None: each reserves n_ctx
    kv_pool: int | None = spec(
        None, lo=1, hi=MAX_SLOTS * MAX_CTX, why=f"kv_pool must be 1..{MAX_SLOTS * MAX_CTX} positions"
    )
    # [K, V] cache types, the head's --cache-type-k/-v; None: the peer's own
    kv_types: list[str] | None = spec(
        None,
        length=(2, 2),
        choices=("auto", *KV_VALUE_BYTES),
        why=f"kv_types must be [K, V], each auto or one of {sorted(KV_VALUE_BYTES)}",
    )
    # tokens per slot of the head's steps (1 + draft max): decode graphs captured for each at load
    max_run: int = spec(1, lo=1, hi=MAX_RUN, why=f"max_run must be 1..{MAX_RUN} tokens per slot")
    # the head's --deterministic (engine/model/stage.py build_stage); None: the peer's own
    deterministic: bool | None = None
    # --output-stage last: this stage (the last: layers up to the model's end) holds the output norm
    # and head (FORWARD_OUT answers logits) and, with `mtp`, the MTP block and its KV (DRAFT)
    output: bool = False
    mtp: bool = False


@dataclass(frozen=True, kw_only=True)
class DraftAsk(Message):
    """Compute DRAFT, to the stage that holds the MTP block: the slots whose block state starts
    over (`released`: a new request), stops or resumes following the target (`resting`,
    `following`: the adaptive policy's k = 0), then one greedy draft per entry of `slots`: from
    token `tokens[i]` at `positions[i]`, at most `ks[i]` tokens, cut before the first whose
    top-10 probability is under `p_mins[i]`."""

    OP = "DRAFT"
    released: list[int] = spec([], lo=0, hi=MAX_SLOTS - 1, length=(0, MAX_SLOTS))
    resting: list[int] = spec([], lo=0, hi=MAX_SLOTS - 1, length=(0, MAX_SLOTS))
    following: list[int] = spec([], lo=0, hi=MAX_SLOTS - 1, length=(0, MAX_SLOTS))
    slots: list[int] = spec([], lo=0, hi=MAX_SLOTS - 1, length=(0, MAX_SLOTS))
    tokens: list[int] = spec([], lo=0, hi=MAX_TOKEN_ID, length=(0, MAX_SLOTS))
    positions: list[int] = spec([], lo=0, hi=MAX_CTX - 1, length=(0, MAX_SLOTS))
    ks: list[int] = spec([], lo=1, hi=MAX_RUN - 1, length=(0, MAX_SLOTS))
    p_mins: list[float] = spec([], lo=0, hi=1, length=(0, MAX_SLOTS))


@dataclass(frozen=True, kw_only=True)
class DraftReply(Message):
    OP = "DRAFT reply"
    counts: list[int] = spec([], lo=0, hi=MAX_RUN - 1, length=(0, MAX_SLOTS))  # tokens of each draft
    tokens: list[int] = spec([], lo=0, hi=MAX_TOKEN_ID, length=(0, MAX_SLOTS * MAX_RUN))  # the drafts, joined


@dataclass(frozen=True, kw_only=True)
class LoadStageReply(Message):
    OP = "LOAD_STAGE reply"
    epoch: int = spec(lo=0, hi=MAX_BYTES)
    layers: list[int] = _RANGE
    device: str = spec(length=(1, 64))
    load_s: float = spec(lo=0)
    state_key: str = spec(length=(32, 32))  # hex of the 16 bytes STATE_JOIN presents


@dataclass(frozen=True, kw_only=True)
class ProbeRequest(Message):
    """Compute PROBE: time the resident layers from `position` of `slot` (positions the slot does not
    hold yet: the next real token overwrites them first)."""

    OP = "PROBE"
    slot: int = _SLOT
    position: int = spec(lo=0, hi=MAX_CTX)
    tokens: int = spec(PROBE_TOKENS, lo=1, hi=MAX_PROBE_TOKENS, why=_PROBE_WHY)  # the prefill probe's length
    reps: int = spec(PROBE_REPS, lo=1, hi=MAX_PROBE_REPS, why=_PROBE_WHY)  # median of this many runs


@dataclass(frozen=True, kw_only=True)
class PipelineProbeRequest(Message):
    """Control PROBE: every stage of the head's pipeline times its layers."""

    OP = "PROBE"
    tokens: int = spec(PROBE_TOKENS, lo=1, hi=MAX_PROBE_TOKENS, why=_PROBE_WHY)
    reps: int = spec(PROBE_REPS, lo=1, hi=MAX_PROBE_REPS, why=_PROBE_WHY)


@dataclass(frozen=True, kw_only=True)
class StageProbe(Message):
    OP = "PROBE reply"
    layers: list[int] = _RANGE  # [a, b) timed
    device: str = spec(length=(1, 64))
    decode_ms: list[float] = spec(lo=0, length=(0, MAX_LAYERS))  # per layer of [a, b): one token
    prefill_ms: list[float] = spec(lo=0, length=(0, MAX_LAYERS))  # per layer: the `tokens`-long prefill
    # every layer of the model as this worker would hold it: weights + KV (its dtype, slots, context)
    layer_bytes: list[int] = spec(lo=0, hi=MAX_BYTES, length=(0, MAX_LAYERS))
    held_bytes: int = spec(lo=0, hi=MAX_BYTES)  # what its current layers take (freed by a re-split)
    free_bytes: int = spec(lo=0, hi=MAX_BYTES)  # free device memory now


@dataclass(frozen=True, kw_only=True)
class PipelineProbe(Message):
    OP = "PROBE reply"
    tokens: int = spec(lo=1, hi=MAX_PROBE_TOKENS)
    # StageProbe per stage (head first) + "name" and "hop_ms" (the wire's part of a FORWARD, peers)
    stages: list[dict] = spec(length=(1, MAX_LAYERS))
    fixed_ms: float = spec(lo=0)  # embedding + output head on the head: paid per token whatever the split
    step_ms: float = spec(lo=0)  # one whole decode step through every stage, measured


@dataclass(frozen=True, kw_only=True)
class StateMeta(Message):
    """A stage's slot (compute STATE_META / STATE_PUT); the head's control STATE_META adds "state",
    "n_ctx" and "stages" (one {"layers", "bytes"} per stage)."""

    OP = "STATE_META reply"
    slot: int = _SLOT
    n_tokens: int = spec(lo=0, hi=MAX_CTX)  # positions whose state the slot holds
    layers: list[list[int]] = spec(lo=0, hi=MAX_LAYERS, inner=2, length=(0, MAX_LAYERS))  # [a, b) of each stage
    bytes: int = spec(lo=0, hi=MAX_BYTES)  # body bytes a STATE_GET would move
    fingerprint: str = spec(length=(0, 256))
    dtype: str = spec(length=(1, 32))


@dataclass(frozen=True, kw_only=True)
class StateGetRequest(Message):
    OP = "STATE_GET"
    slot: int = _SLOT
    tokens: list[int] = _TOKENS  # the ids at positions 0..n-1 (the peer does not keep them): the header names them


SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"hydra-pd-([0-9]+)-[0-9a-f]{32}")  # the asker's pid, then 128 random bits
SHM_DATA_OFFSET = 64  # the nonce first, then the states


@dataclass(frozen=True, kw_only=True)
class ShmOffer(Message):
    """Its form is judged where it is opened (engine/rpc/shm.py: a name not of SHM_NAME's form, a
    size or nonce that does not match the file: not used, the states go over the socket)."""

    OP = "PREFILL"
    name: str = spec(length=(1, 255))  # a file under SHM_DIR, SHM_NAME's form
    size: int = spec(lo=0, hi=MAX_BYTES)  # its size in bytes: the states may take size - SHM_DATA_OFFSET
    nonce: str = spec(length=(0, 64))  # hex of its first bytes: a file of that name elsewhere holds other ones


@dataclass(frozen=True, kw_only=True)
class PrefillRequest(Message):
    OP = "PREFILL"
    tokens: list[int] = _TOKENS  # prefill these positions 0..n-1
    ranges: list[list[int]] = spec(lo=0, hi=MAX_LAYERS, inner=2, length=(1, MAX_LAYERS))  # one slot state per [a, b)
    fingerprint: str = spec(length=(0, 256))  # the asker's model: a worker of another model refuses before computing
    ipc: str | None = spec(None, length=(0, 128))  # the asker's GPU (uuid): a worker on it answers by CUDA IPC
    shm: ShmOffer | None = None  # the asker's shared memory: a worker on its host writes the states there


@dataclass(frozen=True, kw_only=True)
class PrefillReply(Message):
    OP = "PREFILL reply"
    n_tokens: int = spec(lo=0, hi=MAX_CTX)
    sizes: list[int] = spec(lo=0, hi=MAX_BYTES, length=(0, MAX_LAYERS))  # bytes of each slot state, back to back
    prefill_ms: float = spec(lo=0)
    collect_ms: float = spec(lo=0)
    ipc: list[dict] | None = None  # instead of the payload, on one GPU: contracts.slot_state.IpcSlotState per range
    shm: bool | None = None  # true: instead of the payload, the states lie in the offered file from SHM_DATA_OFFSET


@dataclass(frozen=True, kw_only=True)
class IpcOpenRequest(Message):
    OP = "IPC_OPEN"
    uuid: str = spec(length=(0, 128))  # the head's GPU; the peer refuses unless it computes on the same one
    rows: int = spec(IPC_ROWS, lo=1, hi=MAX_IPC_ROWS)
    dtype: str = spec("float32", choices=DTYPE_CODES)


@dataclass(frozen=True, kw_only=True)
class ConfigureRequest(Message):
    """CONFIGURE: a live re-split, as `split` (DESIGN §3 syntax, "12/6") or `layers` ([[0, 12], [12,
    18]]), exactly one; `by` names the requester in /status (`split_by`)."""

    OP = "CONFIGURE"
    split: str | None = spec(None, length=(0, 1024))
    layers: list[list[int]] | None = spec(None, lo=0, hi=MAX_LAYERS, inner=2, length=(1, MAX_LAYERS))
    by: str | None = spec(None, length=(0, 256))

    def validate(self) -> None:
        if (self.split is None) == (self.layers is None):
            given = [k for k in ("split", "layers") if getattr(self, k) is not None]
            raise WireError(f"CONFIGURE takes exactly one of 'split' or 'layers' (got {given})", "split")


# --- control protocol --------------------------------------------------------------------------------


class Status:
    OK, NOT_FOUND, ERROR, PARTIAL, BUSY, BAD_REQUEST, NOT_IMPLEMENTED = range(7)


STATUS_NAMES = {v: k for k, v in vars(Status).items() if k.isupper()}


class Op:
    STATE_GET = 0x30
    STATE_PUT = 0x31
    STATE_META = 0x32
    CONFIGURE = 0x40  # ConfigureRequest: {"split": "12/6"} or {"layers": [[0, 12], [12, 18]]}: live re-split
    INFO = 0x41
    PREFILL = 0x42
    DECODE = 0x43
    SET_EXPERT_MODE = 0x44
    SWAP_QUANT = 0x45
    PIPELINE_ATTACH = 0x46
    PROBE = 0x50  # PipelineProbeRequest -> PipelineProbe: the split advisor's timings
    AUTH = 0x4F  # ours: the client's nonce -> meta {auth, nonce, role, proof}; then the client's proof


KNOWN_OPS = frozenset(v for k, v in vars(Op).items() if k.isupper())

# --- errors both sides raise -------------------------------------------------------------------------


class StaleEpoch(Exception):
    """The head validated an older resident set than the one the peer holds now."""


class ControlError(Exception):
    """A control op refused with a `Status` (the connection lives on)."""

    def __init__(self, message: str, status: int = Status.ERROR):
        super().__init__(message)
        self.status = status
