"""A peer on the head's own GPU: the CUDA IPC channel its hidden states take instead of the socket
(cuda_ipc.py), mapped when the peer offers it (CAP_IPC) and our GPU is its."""

from __future__ import annotations

import json
import logging

import torch

from ...contracts.rpc import CAP_IPC, Cmd, IpcOpenRequest
from ...contracts.rpc import ReplyStatus as R
from .cuda_ipc import IPC_TOKENS, IpcChannel, gpu_uuid
from .resident import DTYPES
from .wire import reply_status

log = logging.getLogger("hydra.rpc.client")


class IpcChannelOps:
    """`RemoteStage`'s CUDA IPC channel: it uses its lock, `_exchange`, `_lost_on_error`, `_caps`,
    `_head_device`, `_ipc` and `_retired`."""

    def open_ipc(self) -> None:
        """`attach(ipc=False)`'s channel, mapped later: a head attaching its peers beside its graphs'
        captures maps no CUDA memory meanwhile (a CUDA call on another thread invalidates a capture)."""
        with self._lock, self._lost_on_error("failed opening CUDA IPC"):
            if self.state == "up":
                self._open_ipc()

    def _open_ipc(self) -> None:
        """Map the peer's CUDA IPC channel when it computes on our GPU; otherwise (another GPU or
        host, a CPU peer, a driver that refuses the mapping) the hidden states go in the frames."""
        dev = self._head_device
        if dev is None or dev.type != "cuda":
            return
        if self._retired and torch.cuda.current_stream(dev).query():
            self._retired.clear()  # nothing queued can touch them any more: unmap
        if not self._caps & CAP_IPC:
            return
        request = IpcOpenRequest(uuid=gpu_uuid(dev), rows=IPC_TOKENS, dtype="float32")
        status, body = reply_status(self._exchange(Cmd.IPC_OPEN, request.encode()))
        if status != R.OK:
            log.info("peer %s: hidden states go over the socket (%s)", self.addr, body.decode("utf-8", "replace"))
            return
        try:
            self._ipc = IpcChannel.open(json.loads(body), DTYPES[request.dtype], dev)
        except (RuntimeError, KeyError, ValueError) as e:
            log.warning(
                "peer %s shares our GPU but its CUDA IPC channel could not be mapped (%s): using the socket",
                self.addr,
                e,
            )

    @property
    def transport(self) -> str:
        return "cuda-ipc" if self._ipc is not None else "socket"
