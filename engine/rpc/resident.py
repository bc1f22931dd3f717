"""The resident-tensor registry: the layers a worker holds for its head, from its own GGUF.

Weights never cross the wire: the head names a layer range, this worker materialises it from
its own mmap. The registry's `epoch` is bumped whenever the resident set is replaced or cleared,
so a head that validated epoch N notices (FORWARD refuses a stale epoch) and re-validates.
A stage and its slots belong to the compute session that loaded it: another session's FORWARD
or KV_CLEAR is refused, so a second client cannot corrupt a running head's KV.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from ...contracts.footprint import (
    DEFAULT_PROMPT_ROWS,
    PACKED_TOKENS,
    ROLLBACK,
    model_tensors,
    rollback_depth,
    weight_form,
)
from ...contracts.rpc import (
    DTYPE_CODES,
    CheckReply,
    CheckRequest,
    DraftAsk,
    DraftReply,
    LoadStageReply,
    LoadStageRequest,
    ProbeRequest,
    StageProbe,
    StaleEpoch,
)
from ..device import fit_here, free_bytes
from ..errors import UserError
from ..layer_probe import probe_stage
from ..model import build_stage, graph_run_lengths
from ..spec.mtp import check_mtp
from .compute_error import ComputeError
from .output_stage import StageOutput, check_ahead, check_draft
from .resident_state import StageStateOps

# Torch dtypes of the wire's dtype names (contracts.rpc.DTYPE_CODES).
DTYPES = {name: getattr(torch, name) for name in DTYPE_CODES}


def layer_of(name: str) -> int | None:
    """Layer index of a `blk.N.*` tensor, None for embeddings / output / norms."""
    if not name.startswith("blk."):
        return None
    idx = name.split(".", 2)[1]
    return int(idx) if idx.isdigit() else None


def tensor_shapes(g) -> dict[str, list[int]]:
    return {name: list(t.shape) for name, t in g.tensors.items()}


class StageHost(StageStateOps):
    """One worker's resident stage. `assignable=False` on the head: its range follows its own split.
    `cache_dir`: the prepared-weight cache for the stages it loads (None: convert on every load)."""

    def __init__(
        self,
        g,
        cfg,
        device,
        *,
        stage=None,
        assignable: bool = True,
        cache_dir: Path | None = None,
        quantized: bool | None = None,
        compile_decode: bool = False,
        kv_types: tuple[str, str] = ("auto", "auto"),
        deterministic: bool = False,
        layer_delay_s: float = 0.0,
        headroom: int = 0,
    ):
        self.g, self.cfg, self.device = g, cfg, torch.device(device)
        self.headroom = headroom  # bytes a loaded stage must leave free (--headroom-gb)
        self.layer_delay_s = layer_delay_s  # a test flag: a peer slowed on purpose, per layer run
        self.cache_dir = cache_dir
        self.quantized = quantized if quantized is not None else self.device.type == "cuda"  # as build_stage decides
        self.compile_decode, self.kv_types = compile_decode, kv_types
        self.deterministic = deterministic  # this worker's --deterministic: a LOAD_STAGE without the field
        self.n_layers = cfg.n_layers
        self.tensors = model_tensors(g.metadata, g.tensors)
        self.stage = stage
        self.output: StageOutput | None = None  # the output head and MTP block (--output-stage last)
        self.assignable = assignable
        self.epoch = 1 if stage is not None else 0
        self.lock = threading.Lock()  # one forward or stage swap at a time
        self._load_lock = threading.Lock()
        self.owner = 0  # the compute session that loaded the stage owns its slots
        # Given to the loading session only: its second session presents it (STATE_JOIN) to move
        # slot states while the first runs forwards.
        self.state_key = os.urandom(16)
        self.on_change = lambda: None  # called after a stage swap (the peer's /health follows it)
        self._params: tuple | None = None
        self.forwards = self.tokens = 0
        self.drafts_asked = self.drafts_ahead = 0  # MTP drafts by DRAFT, and made in a FORWARD_OUT
        self.lengths: dict[int, int] = {}  # per slot: the positions it has run (STATE_META)
        self.state_bytes_in = self.state_bytes_out = 0
        self.staging = 0  # STATE_PUTs streaming in or being checked now, outside the forward lock
        self.compute_s = 0.0
        self.load_s = 0.0

    @property
    def layers(self) -> tuple[int, int]:
        return tuple(self.stage.layer_range) if self.stage is not None else (0, 0)

    @property
    def fingerprint(self) -> str:
        return self.g.fingerprint

    def check(self, request: CheckRequest) -> CheckReply:
        """Identity guard: same model fingerprint and every tensor the same shape."""
        theirs = request.fingerprint
        if theirs != self.fingerprint:
            raise ComputeError(
                f"model fingerprint mismatch: head has {theirs}, this worker has {self.fingerprint} ({self.g.path}); "
                "start both with the same GGUF file"
            )
        shapes = request.shapes
        ours = tensor_shapes(self.g)
        bad = [
            f"{name}: head {shape} vs here {ours.get(name, 'missing')}"
            for name, shape in shapes.items()
            if ours.get(name) != shape
        ]
        bad += [f"{name}: missing on the head" for name in ours.keys() - shapes.keys()]
        if bad:
            raise ComputeError(f"tensor shape mismatch ({len(bad)}): " + "; ".join(sorted(bad)[:5]))
        return CheckReply(ok=True, fingerprint=self.fingerprint, epoch=self.epoch)

    def load(self, request: LoadStageRequest, owner: int = 0) -> LoadStageReply:
        """Build the requested stage beside the current one, then swap: a refused or failed load
        leaves the old stage, its epoch and its owner as they were. The session `owner` owns
        every slot of the new stage. The request's fields are bounded (contracts.rpc); the layer
        range is judged here, against this model."""
        if not self.assignable:
            raise ComputeError("this worker is a head: its layer range follows its own --split (use CONFIGURE)")
        a, b = request.layers
        dtype, n_slots, n_ctx, kv_pool = DTYPES[request.dtype], request.n_slots, request.n_ctx, request.kv_pool
        kv_types = tuple(request.kv_types) if request.kv_types is not None else self.kv_types
        max_run = request.max_run
        deterministic = request.deterministic if request.deterministic is not None else self.deterministic
        if not 0 <= a < b <= self.n_layers:
            raise ComputeError(f"layer range [{a},{b}) outside the model's 0..{self.n_layers}")
        if request.output and b != self.n_layers:
            raise ComputeError(
                f"LOAD_STAGE output: only the last stage holds it, [{a},{b}) ends before {self.n_layers}"
            )
        if request.mtp and not request.output:
            raise ComputeError("LOAD_STAGE mtp: the MTP block goes with the output head (output: true)")
        if request.mtp:
            try:
                check_mtp(self.g)
            except UserError as e:
                raise ComputeError(f"LOAD_STAGE refused: {e}") from None
        depth = rollback_depth(max_run)  # checkpoints of the recurrent states: the head's longest draft
        params = (dtype, n_slots, n_ctx, kv_pool, kv_types, depth, deterministic, request.output, request.mtp)
        t0 = time.perf_counter()
        with self._load_lock:  # one load at a time; forwards go on meanwhile on the old stage
            if self.stage is not None and self._params == params and self.layers == (a, b):
                stage, output = (
                    self.stage,
                    self.output,
                )  # same stage: only its KV starts over (the swap below clears it)
            else:
                need = self.stage_bytes(
                    a, b, dtype, n_slots, n_ctx, kv_pool, kv_types, depth, request.output, request.mtp
                )
                fit = fit_here("peer", (a, b), need, self.headroom, self.device, mtp=request.mtp)
                if not fit.fits:
                    kv = f"{n_slots}x{n_ctx}" if kv_pool is None else f"a {kv_pool}-position pool of"
                    raise ComputeError(
                        f"LOAD_STAGE with {kv} KV refused before loading: {fit.reason()}; the current stage stays"
                    )
                try:
                    stage = build_stage(
                        self.g,
                        (a, b),
                        embed=request.mtp,  # the MTP block embeds each draft
                        head=request.output,
                        device=self.device,
                        dtype=dtype,
                        n_slots=n_slots,
                        n_ctx=n_ctx,
                        cache_dir=self.cache_dir,
                        quantized=self.quantized,
                        compile_decode=self.compile_decode,
                        kv_types=kv_types,
                        kv_pool=kv_pool,
                        depth=depth,
                        deterministic=deterministic,
                    )
                except UserError as e:  # e.g. q8_0 on a head size it cannot block
                    raise ComputeError(f"LOAD_STAGE refused: {e}") from None
                # Before the swap: the old stage serves meanwhile. The head's run lengths (its verifies
                # are padded to them), longest first: the head's order
                # reversed: a head on this host warms up at the same time (workers/head.py), and its
                # layers trace to the same graphs, so each process compiles half of them and finds the
                # other half in inductor's cache, which both share (docs/PERF.md, session 21).
                stage.warm_up(graph_run_lengths(max_run)[::-1])
                if stage.packed_graphs is not None:  # a recurrent stage's short steps: captured now, not mid-prompt
                    stage.packed_graphs.warm_up(PACKED_TOKENS)
                output = StageOutput.build(stage, request.mtp, max_run) if request.output else None
            with self.lock:
                if stage is self.stage:
                    for slot in range(n_slots):
                        self._clear(slot)
                self.stage, self.output, self._params, self.owner = stage, output, params, owner
                self.state_key = os.urandom(16)
                self.lengths = {}
                self.epoch += 1
                key = self.state_key.hex()
        self.load_s = time.perf_counter() - t0
        self.on_change()
        return LoadStageReply(
            epoch=self.epoch, layers=[a, b], device=str(self.device), load_s=round(self.load_s, 4), state_key=key
        )

    def stage_bytes(
        self,
        a: int,
        b: int,
        dtype: torch.dtype,
        n_slots: int,
        n_ctx: int,
        kv_pool: int | None,
        kv_types: tuple[str, str],
        depth: int = ROLLBACK,
        output: bool = False,
        mtp: bool = False,
    ) -> int:
        """What a stage of layers [a, b) costs: its weights as they will be held plus its KV (every
        slot's context, or a pool of `kv_pool` positions) and recurrent state; on a GPU also the new
        stage's dequantization scratch and graphs' pool (the process's cuBLAS workspaces exist already);
        with `output` the output head (and with `mtp` the MTP block and its KV) as the footprint has them."""
        held = sum(self.layer_footprint(dtype, n_slots, n_ctx, kv_pool, kv_types, depth)[a:b])
        name = str(dtype).removeprefix("torch.")
        if output:
            kw = dict(head=False, device=self.device.type, dtype=name, n_slots=n_slots, n_ctx=n_ctx, kv_types=kv_types)
            kw.update(kv_pool=kv_pool, depth=depth, gpu_weights="quantized" if self.quantized else "dense")
            held += self.tensors.stage(a, b, output=True, mtp=mtp, **kw).total - self.tensors.stage(a, b, **kw).total
        if self.device.type != "cuda":
            return held
        scratch = self.tensors.scratch_bytes(a, b, output=False, dtype=name) if self.quantized else 0
        return (
            held
            + scratch
            + self.tensors.graph_bytes(
                a, b, output=False, n_slots=n_slots, n_ctx=n_ctx, prompt_rows=DEFAULT_PROMPT_ROWS, depth=depth
            )
        )

    def layer_footprint(
        self,
        dtype: torch.dtype,
        n_slots: int,
        n_ctx: int,
        kv_pool: int | None,
        kv_types: tuple[str, str],
        depth: int = ROLLBACK,
    ) -> list[int]:
        """Bytes of every layer of the model as this worker would hold it (contracts/footprint.py):
        weights in this worker's form + its cache (KV in the given cache types, or recurrent state)."""
        name = str(dtype).removeprefix("torch.")
        form = "quantized" if self.quantized else weight_form(self.device.type, name, "dense")
        gpu = self.device.type == "cuda"
        return [
            self.tensors.layer_weights(il, form, name)
            + self.tensors.layer_cache(il, n_slots, n_ctx, kv_types, name, gpu=gpu, kv_pool=kv_pool, depth=depth)
            for il in range(self.n_layers)
        ]

    def probe(self, request: ProbeRequest, owner: int = 0) -> StageProbe:
        """PROBE: time the resident layers one by one (a `StageProbe`); only the loading session,
        on the slot positions it names (past what the slot holds)."""
        slot, position, tokens, reps = request.slot, request.position, request.tokens, request.reps
        with self.lock:
            if not self.assignable:  # the head's stage runs under its pipeline: the control op PROBE times it
                raise ComputeError("this worker is a head: use the control op PROBE")
            if self.stage is None:
                raise ComputeError("no stage assigned here: nothing to probe")
            self._own(owner)
            stage = self.stage
            try:
                timings = probe_stage(stage, slot, position, tokens, reps, self.layer_delay_s)
            except UserError as e:
                raise ComputeError(str(e)) from None
        a, b = self.layers
        footprint = self.layer_footprint(
            stage.dtype, stage.n_slots, stage.n_ctx, stage.kv_pool, stage.kv_types, stage.depth
        )
        return StageProbe(
            layers=[a, b],
            device=str(self.device),
            decode_ms=timings["decode_ms"],
            prefill_ms=timings["prefill_ms"],
            layer_bytes=footprint,
            held_bytes=sum(footprint[a:b]),
            free_bytes=free_bytes(self.device),
        )

    def _own(self, owner: int) -> None:
        if self.owner != owner:
            raise ComputeError("these slots belong to another session (the head that sent LOAD_STAGE): refused")

    def resident(self, name: str) -> bool:
        layer = layer_of(name)
        return self.stage is not None and layer is not None and self.layers[0] <= layer < self.layers[1]

    def resolve(self, name: str) -> dict:
        t = self.g.tensors.get(name)
        if t is None or not self.resident(name):
            return {"found": False, "epoch": self.epoch}
        return {"found": True, "epoch": self.epoch, "dtype": t.ggml_type.name, "shape": list(t.shape)}

    def forward(
        self, epoch: int, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, owner: int = 0
    ) -> torch.Tensor:
        """The stage's output on its device (on CUDA possibly still being computed: `compute_s`
        then counts the time to queue the work). Only the session that loaded the stage may run it."""
        with self.lock:
            return self._run(epoch, hidden, slots, positions, owner)

    def forward_out(self, epoch: int, hidden, slots, positions, rows, tokens, want_hidden: bool, ahead, owner: int = 0):
        """FORWARD_OUT: `forward`, then the output this last stage holds (`StageOutput.outputs`):
        (logits, normed hidden states or None, the drafts ahead)."""
        with self.lock:
            self._own(owner)
            if self.output is None:
                raise ComputeError("FORWARD_OUT: this stage holds no output head (LOAD_STAGE with output: true)")
            if (tokens is None) != (self.output.mtp is None):
                raise ComputeError(
                    "FORWARD_OUT: token ids come with the batch exactly when this stage holds the MTP block"
                )
            if tokens is not None and tokens.numel() and int(tokens.max()) >= self.cfg.n_vocab:
                raise ComputeError(f"FORWARD_OUT token id out of range 0..{self.cfg.n_vocab - 1}")
            if ahead and self.output.mtp is None:
                raise ComputeError("FORWARD_OUT drafts ahead: this stage holds no MTP block")
            why = check_ahead(ahead, slots, rows, self.stage.n_slots) if ahead else None
            if why is not None:
                raise ComputeError(why)
            h = self._run(epoch, hidden, slots, positions, owner)
            self.drafts_ahead += len(ahead)
            return self.output.outputs(h, tokens, slots, positions, rows, want_hidden, ahead)

    def draft(self, ask: DraftAsk, owner: int = 0) -> DraftReply:
        """DRAFT: the MTP block's drafts (this stage's, --output-stage last)."""
        with self.lock:
            self._own(owner)
            if self.output is None or self.output.mtp is None:
                raise ComputeError("DRAFT: this stage holds no MTP block (LOAD_STAGE with mtp: true)")
            why = check_draft(ask, self.stage.n_slots, self.stage.n_ctx, self.cfg.n_vocab)
            if why is not None:
                raise ComputeError(why)
            self.drafts_asked += len(ask.slots)
            return self.output.draft(ask)

    def _run(self, epoch: int, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, owner: int):
        """The layers over a batch (the caller holds the lock)."""
        if not self.assignable:
            raise ComputeError("no stage assigned here: this worker is a head")
        if self.stage is None:  # stale for any head: it re-attaches, which loads one
            raise StaleEpoch(f"no stage assigned here (epoch {self.epoch}): send LOAD_STAGE first")
        if epoch != self.epoch:
            raise StaleEpoch(f"resident set is at epoch {self.epoch}, request validated epoch {epoch}")
        self._own(owner)
        if hidden.shape[1] != self.cfg.n_embd:
            raise ComputeError(f"hidden states of width {hidden.shape[1]}, this model's is {self.cfg.n_embd}")
        t0 = time.perf_counter()
        try:
            # Slots and positions stay on the host: the stage reads them there (a device copy
            # would cost a sync per read on CUDA).
            out = self.stage.run_layers(hidden, slots, positions)
        except (UserError, ValueError) as e:  # a batch with slots or positions this stage cannot take
            raise ComputeError(str(e)) from None
        if self.layer_delay_s:
            time.sleep(self.layer_delay_s * len(self.stage.layers))
        self.compute_s += time.perf_counter() - t0
        for slot, pos in zip(slots.tolist(), positions.tolist()):  # a slot's run ends at its last position
            self.lengths[slot] = pos + 1
        self.forwards += 1
        self.tokens += hidden.shape[0]
        return out

    def kv_clear(self, slot: int, owner: int = 0) -> None:
        with self.lock:
            if self.stage is None or not self.assignable:
                return
            self._own(owner)
            n_slots = self._params[1]
            if slot >= n_slots:
                raise ComputeError(f"slot {slot} does not exist ({n_slots} slots)")
            for s in range(n_slots) if slot < 0 else [slot]:
                self._clear(s)

    def _clear(self, slot: int) -> None:
        """`slot` forgotten: its KV, its MTP block's state (the caller holds the lock)."""
        self.stage.kv_clear(slot)
        if self.output is not None:
            self.output.clear(slot)
        self.lengths.pop(slot, None)

    def kv_shift(self, slot: int, keep: int, discard: int, n: int, owner: int = 0) -> None:
        """KV_SHIFT: the head's context shift of `slot`, which holds `n` positions (`Stage.kv_shift`)."""
        with self.lock:
            stage = self._state_stage(slot, owner)
            if not keep + discard <= n <= self.lengths.get(slot, 0):
                raise ComputeError(
                    f"slot {slot} holds {self.lengths.get(slot, 0)} positions: cannot shift [{keep + discard}, {n}) "
                    f"down by {discard}"
                )
            try:
                stage.kv_shift(slot, keep, discard, n)
            except ValueError as e:  # a recurrent stage
                raise ComputeError(str(e)) from None
            self.lengths[slot] = n - discard

    def stats(self) -> dict:
        return {
            "layers": list(self.layers) if self.stage is not None else None,
            "epoch": self.epoch,
            "fingerprint": self.fingerprint,
            "device": str(self.device),
            "forwards": self.forwards,
            "tokens": self.tokens,
            "drafts_asked": self.drafts_asked,
            "drafts_ahead": self.drafts_ahead,
            "compute_s": round(self.compute_s, 6),
            "load_s": round(self.load_s, 4),
            "state_bytes_in": self.state_bytes_in,
            "state_bytes_out": self.state_bytes_out,
            "staging": self.staging,
        }
