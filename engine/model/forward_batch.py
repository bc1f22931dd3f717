"""`ForwardBatch`: what one pass through a stage's layers needs besides the hidden states: each
row's slot and position, and the batch's mode, which picks the attention and recurrent paths.

A batch is a flat list of tokens, those of one slot contiguous with increasing positions. In
`Mode.RUNS` its slot runs are known on the host (any batch: prefill chunks, verifies, decode run
eagerly). The CUDA graphs capture batches that carry no host values, so their mode says what the
rows are: `Mode.BATCHED`, `per_slot` tokens for each slot, rows slot-major (decode and verifies);
`Mode.FRESH`, one slot's run from position 0 (a prompt's prefill); `Mode.PACKED`, runs known on
the device only, each at most `max_run` tokens (a recurrent stage's short steps, `PackedGraphs`).
`Stage.run_layers` builds the eager batch from the slots and positions it is given (their runs:
`slot_runs`); the graphs build theirs around their static buffers, once per capture.
"""

from __future__ import annotations

import enum
import functools
import itertools
from dataclasses import dataclass, field

import torch

from ..device import to_device
from ..errors import UserError

Run = tuple[int, int, int]  # (slot, first position, tokens)


class Mode(enum.Enum):
    RUNS = "runs"
    BATCHED = "batched"
    FRESH = "fresh"
    PACKED = "packed"


@dataclass(frozen=True, eq=False)
class RunTensors:
    """A RUNS batch's runs on its device, long [R] each: their slots, lengths and first rows."""

    slots: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    _windows: dict = field(default_factory=dict, repr=False)

    def window_steps(self, kernel: int, depth: int) -> torch.Tensor:
        """For j = 0..depth, where the last kernel - 1 inputs of each run's conv window j tokens before
        its end lie, as steps of the run [R, depth + 1, kernel - 1]: a negative step -i is the incoming
        conv state's i-th newest input (a window that reaches before the run; j past the run's start
        is its start). Every recurrent layer of a pass reads the same: built once."""
        if (kernel, depth) not in self._windows:
            dev = self.starts.device
            back = torch.minimum(torch.arange(depth + 1, device=dev)[None, :], self.lengths[:, None])
            ends = (self.lengths[:, None] - back)[:, :, None] - (kernel - 1)
            self._windows[kernel, depth] = ends + torch.arange(kernel - 1, device=dev)[None, None, :]
        return self._windows[kernel, depth]


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """`slots`, `positions`: long [T] on the stage's device. `runs` (RUNS): each slot's run, in row
    order; `per_row` (RUNS, `--deterministic`): attention takes a run's rows one at a time, as
    decode steps (`attention.attend_runs`). `per_slot` (BATCHED): tokens per slot. `kv_len` (BATCHED
    and PACKED off CUDA): the cache rows each slot's attention gathers, masked by position
    (`attention.decode_bias`). `max_run` (PACKED): the most tokens a run may have; `device_runs`
    (PACKED): its runs, on the device only."""

    slots: torch.Tensor
    positions: torch.Tensor
    mode: Mode
    runs: list[Run] = field(default_factory=list)
    per_slot: int = 1
    kv_len: int = 0
    per_row: bool = False
    max_run: int = 0
    device_runs: RunTensors | None = None

    @classmethod
    def of_runs(
        cls, slots: torch.Tensor, positions: torch.Tensor, runs: list[Run], per_row: bool = False
    ) -> ForwardBatch:
        return cls(slots, positions, Mode.RUNS, runs=runs, per_row=per_row)

    @functools.cached_property
    def run_tensors(self) -> RunTensors:
        """`runs` on the batch's device, sent once per pass through page-locked memory (every recurrent
        layer reads them): each layer's own `torch.tensor(..., device=)` was a pageable copy, which
        waits for the device's queue, so a prompt step's host never ran ahead of its kernels."""
        if self.device_runs is not None:
            return self.device_runs
        lengths = [n for _, _, n in self.runs]
        starts = list(itertools.accumulate(lengths[:-1], initial=0))
        host = torch.tensor([[slot for slot, _, _ in self.runs], lengths, starts], dtype=torch.long)
        return RunTensors(*to_device(host, self.slots.device))

    @classmethod
    def batched(cls, slots: torch.Tensor, positions: torch.Tensor, per_slot: int, kv_len: int) -> ForwardBatch:
        return cls(slots, positions, Mode.BATCHED, per_slot=per_slot, kv_len=kv_len)

    @classmethod
    def packed(
        cls, slots: torch.Tensor, positions: torch.Tensor, runs: RunTensors, max_run: int, kv_len: int
    ) -> ForwardBatch:
        return cls(slots, positions, Mode.PACKED, kv_len=kv_len, max_run=max_run, device_runs=runs)

    @classmethod
    def fresh(cls, slots: torch.Tensor, positions: torch.Tensor) -> ForwardBatch:
        return cls(slots, positions, Mode.FRESH)


def slot_runs(slots: torch.Tensor, positions: torch.Tensor, n_slots: int, n_ctx: int) -> list[Run]:
    """(slot, first position, length) of each slot's contiguous token run in host `slots` /
    `positions`; checks the batch against a stage of `n_slots` slots of `n_ctx` positions."""
    s, p = slots.tolist(), positions.tolist()
    runs, i = [], 0
    while i < len(s):
        j = i + 1
        while j < len(s) and s[j] == s[i]:
            if p[j] != p[j - 1] + 1:
                raise ValueError(f"positions of slot {s[i]} must increase by one within a batch")
            j += 1
        if not 0 <= s[i] < n_slots:
            raise UserError(f"slot {s[i]} does not exist (this stage has {n_slots} slots)")
        if p[i] < 0 or p[j - 1] >= n_ctx:
            raise UserError(f"prompt too long: position {p[j - 1]} is beyond the context of {n_ctx} tokens")
        runs.append((s[i], p[i], j - i))
        i = j
    return runs
