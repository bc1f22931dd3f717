"""The head's view of the whole model: its own Stage, then each peer in pipeline order.

The runtime only ever calls `Pipeline.forward`; whether layers run here or on peers is decided
here (solo = no peers). The pipeline also remembers, per slot, the tokens it has run, so that
whenever a stage's KV is lost or moved (live re-split, a peer re-attached) it rebuilds the KV
of the active slots by replaying them: running requests carry on instead of failing.

A long prompt flows through the stages chunk after chunk (llama.cpp's pipeline parallelism): a
forward whose output nobody reads (a prompt chunk before its last: no logit rows, no hidden
states) sends its hidden states (and token ids, when its MTP block follows every batch) to the
last peer without waiting (`RemoteStage.send_layers`) and returns, so the head computes the next
chunk while that peer computes this one. The peer runs its frames in order, and the forward that
needs an output reads the replies before its own: the math, chunk by chunk, is the unpipelined one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ..contracts.rpc import StaleEpoch
from ..contracts.slot_state import SlotStateError
from ..contracts.split import check_ranges
from ..contracts.status import StageInfo
from . import slot_state
from .errors import UserError
from .layer_probe import probe_pipeline
from .model import Stage
from .rpc.peer_errors import PeerUnavailable
from .rpc.peer_recovery import PeerRecovery
from .slot_history import SlotHistory

log = logging.getLogger("hydra.pipeline")

REPLAY_CHUNK = 256  # tokens per replay forward, like the runtime's prefill budget


class Pipeline:
    def __init__(self, local: Stage, remotes: list | None = None, *, ranges: list[tuple[int, int]] | None = None):
        self.local = (
            local  # this process's stage: the embedding, the first layers, the output (unless the last peer has it)
        )
        self.remotes = list(remotes or [])
        self.ranges = list(ranges) if ranges else [tuple(getattr(local, "layer_range", (0, local.cfg.n_layers)))]
        # Which slots hold a live request (the runtime's view); None = every slot seen so far.
        self.active_slots: Callable[[], set[int]] | None = None
        # Per-slot state kept beside the head stage's (the MTP drafter: `state_out`, `state_in`,
        # `restored`, `clear`), moved and cleared with it; set by the engine that owns it.
        self.side_state = None
        self.resplits = 0
        self.last_resplit: dict | None = None
        self._lock = threading.RLock()  # one forward, re-split or re-attach at a time
        # Held while this stage's layers change (re-split) and while a slot state is copied into
        # them: a placement waits for a re-split, never for a forward.
        self._layout = threading.Lock()
        self.history = SlotHistory()  # what a KV rebuild replays (a split pipeline's only)
        self._stale: int | None = None  # index of the last stage that lost KV: rebuild before the next forward
        # Bumped whenever a stage lost KV and only the active slots' was rebuilt, and when idle slots
        # are evicted: the prompt cache of idle slots is then gone (the KV manager drops it).
        self.kv_generation = 0
        # A lost peer: the forwards' pause while it comes back (--peer-grace), the watcher that re-attaches it.
        self.recovery = PeerRecovery(self.remotes, self._lock, self._lost_kv)

    @property
    def cfg(self):
        return self.local.cfg

    @property
    def output_remote(self):
        """The last peer when it holds the output head (--output-stage last), else None."""
        return self.remotes[-1] if self.remotes and self.remotes[-1].output else None

    @property
    def graph_run_lengths(self) -> tuple[int, ...] | None:
        """Tokens per slot this pipeline's decode graphs replay (the head stage's; its peers warmed
        up the same from LOAD_STAGE's `max_run` and run the head's rows): what verifies are padded to."""
        return getattr(self.local, "graph_run_lengths", None)

    def unavailable(self) -> str | None:
        """Why a forward would fail now (the peers not up), or None."""
        return self.recovery.unavailable()

    def forward(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        logit_rows: torch.Tensor | None,
        hidden: bool = False,
        meanwhile: Callable[[], None] | None = None,
        argmax: bool = False,
        ahead: tuple = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Flattened batch in, float32 logits of the rows in `logit_rows` (None: every row, no gather) out; with `hidden`, also
        every token's last hidden state after the output norm (what an MTP block drafts from and an
        embedding pools: the last stage's output, whichever worker ran it). `meanwhile` runs once,
        after this worker's layers are queued: with a peer, between its frame and its reply, so
        the caller's host work overlaps the peer's. It must not call the pipeline. For a last peer that
        holds the output (`RemoteStage.run_output`): `argmax`, every row is read for its argmax alone;
        `ahead`, the slots whose next draft its MTP block makes in the same exchange."""
        pipelined = (
            logit_rows is not None
            and logit_rows.numel() == 0
            and not hidden
            and bool(self.remotes)
            and self.remotes[-1].can_pipeline()
        )
        if meanwhile is not None:  # once, even when a lost peer makes the batch run again
            meanwhile = _once(meanwhile)
        out = None
        if self.output_remote is not None:
            rows = torch.arange(len(tokens)) if logit_rows is None else logit_rows
            out = (tokens, rows, hidden, argmax, ahead)
        with self._lock:
            h = self.recovery.through_loss(
                lambda: self._rebuilt_run(tokens, slots, positions, meanwhile, pipelined, out)
            )
            if self.remotes:  # only a split pipeline ever needs to rebuild KV
                self.history.record(tokens, slots, positions)
            if h is None:  # on its way through the last peer: no rows were asked for
                return torch.empty((0, self.cfg.n_vocab), dtype=torch.float32, device=self.local.device)
            if out is not None:  # the last peer's output: (logits, the normed hidden states or None)
                return h if hidden else h[0]
            if not hidden:
                return self.local.logits(h if logit_rows is None else h[logit_rows])
            x = self.local.final_norm(h)
            return self.local.project(x if logit_rows is None else x[logit_rows]), x

    def _rebuilt_run(self, tokens, slots, positions, meanwhile, pipelined, out=None):
        """The batch through every stage, once any KV a stage lost is rebuilt."""
        if self._stale is not None:
            self._rebuild(self._stale)
        return self._run(tokens, slots, positions, meanwhile, pipelined, out)

    def _run(self, tokens, slots, positions, meanwhile=None, pipelined=False, out=None):
        """The batch through every stage; `pipelined`: the last peer's output is not waited for (None).
        `out`: `RemoteStage.run_output`'s arguments, when the last peer holds the output (it answers it)."""
        h = self.local.run_layers(self.local.embed(tokens), slots, positions)
        if meanwhile is not None and not self.remotes:
            meanwhile()
        for i, remote in enumerate(self.remotes, 1):
            try:
                if pipelined and i == len(self.remotes):
                    remote.send_layers(h, slots, positions, tokens)
                    if meanwhile is not None and i == 1:
                        meanwhile()
                    return None
                if out is not None and i == len(self.remotes):
                    return remote.run_output(h, slots, positions, *out, meanwhile=meanwhile if i == 1 else None)
                h = remote.run_layers(h, slots, positions, meanwhile if i == 1 else None)
            except StaleEpoch:
                # Someone replaced the peer's resident set: re-validate, rebuild its KV (the
                # pipelined chunks before this batch are in the history it replays), redo the batch.
                log.warning("peer %s changed its resident set: re-attaching", remote.addr)
                remote.attach()
                self._rebuild(i)
                return self._run(tokens, slots, positions, pipelined=pipelined, out=out)
        return h

    def _settle(self) -> None:
        """The replies of pipelined prompt chunks still on their way, read: before a peer's KV is
        cleared, read out, probed or re-split (the caller holds the pipeline lock)."""
        for i, remote in enumerate(self.remotes, 1):
            try:
                remote.settle()
            except StaleEpoch:
                log.warning("peer %s changed its resident set: re-attaching", remote.addr)
                remote.attach()
                self._lost_kv(i)

    def _lost_kv(self, i: int) -> None:
        """Stage `i` lost its KV (a peer re-attached): stages 0..i are rebuilt before the next forward."""
        self._stale = i if self._stale is None else max(self._stale, i)

    def evict(self, slots: list[int]) -> None:
        """Clear idle `slots` on every stage: their KV's blocks go back to each stage's pool (the
        KV manager's `make_room` picks them). Every idle slot's prompt cache goes with them
        (`kv_generation`), also when a peer is lost midway; that pauses as a forward does."""
        with self._lock:
            try:
                self.recovery.through_loss(lambda: [self.clear_slot(slot) for slot in slots])
            finally:
                self.kv_generation += 1

    def slot_length(self, slot: int) -> int:
        """Tokens of `slot` whose KV every stage holds."""
        return self.history.lengths.get(slot, 0)

    def clear_slot(self, slot: int) -> None:
        with self._lock:
            self._settle()
            self.history.lengths.pop(slot, None)
            self.local.kv_clear(slot)
            if self.side_state is not None:  # its KV follows the head's: its blocks go back too
                self.side_state.clear(slot)
            for remote in self.remotes:
                remote.kv_clear(slot)

    def kv_shift(self, slot: int, keep: int, discard: int, n: int) -> None:
        """Context shift of `slot`, which holds `n` positions, on every stage: this one's
        (`Stage.kv_shift`), each peer's (KV_SHIFT), and the tokens a rebuild replays. A peer lost
        meanwhile is rebuilt from those before the next forward: shifted, as the others."""
        with self._lock:
            self._settle()
            if self.remotes:
                self.history.shift(slot, keep, discard, n)
            self.local.kv_shift(slot, keep, discard, n)
            for i, remote in enumerate(self.remotes, 1):
                try:
                    remote.kv_shift(slot, keep, discard, n)
                except PeerUnavailable:
                    self._lost_kv(i)

    def collect_state(self, slot: int, tokens: list[int]) -> list:
        """The state of `slot`'s `tokens`, one slot state (contracts.slot_state) per stage in
        pipeline order: the head's layers from here (with the MTP block's own state when
        `side_state` has it), each peer's through STATE_GET."""
        with self._lock:
            self._settle()  # the peers' KV must hold every chunk sent
            extra = self.side_state.state_out(slot, len(tokens)) if self.side_state is not None else None
            out = [slot_state.save(self.local, slot, tokens, self.local.g.fingerprint, extra)]
            return out + [remote.state_get(slot, tokens) for remote in self.remotes]

    def save_slot(self, slot: int, tokens: list[int], write) -> int:
        """Write the state of `slot`'s `tokens` through `write(bytes)`; returns the bytes written."""
        n = 0
        for state in self.collect_state(slot, tokens):
            write(state)
            n += len(state)
        return n

    def pack_states(
        self, slot: int, tokens: list[int], ranges: list[tuple[int, int]], into: memoryview | None = None
    ) -> list:
        """The state of `slot`'s `tokens` per range, packed (slot_state.save_ranges: in `into`, memory
        shared with the asker, when they fit); this stage must hold every layer asked for."""
        with self._lock:
            extra = self.side_state.state_out(slot, len(tokens)) if self.side_state is not None else None
            return slot_state.save_ranges(self.local, slot, tokens, self.local.g.fingerprint, ranges, extra, into)

    def device_states(self, slot: int, tokens: list[int], ranges: list[tuple[int, int]]) -> list:
        """The state of `slot`'s `tokens` per range in buffers on this stage's device, for a head on
        this GPU (CUDA IPC: slot_state.device_states); this stage must hold every layer asked for."""
        with self._lock:
            extra = self.side_state.state_out(slot, len(tokens)) if self.side_state is not None else None
            return slot_state.device_states(self.local, slot, tokens, self.local.g.fingerprint, ranges, extra)

    def prepare_state(self, data, tokens: list[int] | None = None) -> slot_state.PreparedState:
        """Slot states checked and regrouped to this pipeline's ranges without holding it: the costly
        half of a placement, off the forward's path (slot_state.prepare)."""
        return slot_state.prepare(self.local, self.ranges, data, tokens)

    def place_state(self, slot: int, data, tokens: list[int] | None = None) -> list[int]:
        """Place slot states (raw, or a `prepare_state`) into `slot`, each stage its layers (peers
        through STATE_PUT); returns the tokens they cover (which must be `tokens` when given).
        Every chunk and the model are checked before anything is placed, so a refused state leaves
        the slot as it was; a peer lost midway leaves the slot empty on every stage (nothing
        half-placed is used). The caller keeps `slot` out of every forward meanwhile: the copies run
        beside them, this stage's without the pipeline lock, the peers' over connections of their
        own (only a re-split waits); the lock is taken only to record the slot's tokens."""
        prepared = data if isinstance(data, slot_state.PreparedState) else self.prepare_state(data, tokens)
        fingerprint, header, n = self.local.g.fingerprint, prepared.header, len(prepared.header.tokens)
        generation = self.kv_generation
        try:
            with self._layout:  # the stages' layers stay as they are (a re-split waits), forwards go on
                if prepared.ranges != list(self.ranges):
                    raise SlotStateError(f"the pipeline was re-split to {self.ranges} while the state was checked")
                side = self.side_state if self.side_state is not None and slot_state.has_extra(header) else None
                extra = side.state_in(slot, n) if side is not None else None
                views = slot_state.check(self.local, slot, header, fingerprint, extra)
                slot_state.place_checked(self.local, slot, header, prepared.body, views)
                if isinstance(prepared.body, torch.Tensor) and prepared.body.is_cuda:  # another process's memory
                    torch.cuda.current_stream(prepared.body.device).synchronize()  # copied before it is let go
                if self.side_state is not None:
                    self.side_state.restored(slot, n, extra)
                for remote, part in zip(self.remotes, prepared.peer_states):
                    remote.settle()  # no earlier chunk for this slot may land after the state
                    remote.state_put(slot, part)
            if self.remotes:
                with self._lock:  # the slot history is the forwards' too
                    if self.kv_generation != generation:  # a stage's KV was rebuilt meanwhile, without this slot's
                        raise SlotStateError("the pipeline rebuilt its KV while the state was placed")
                    if n:  # a later KV rebuild replays them
                        self.history.flush()
                        self.history.write(torch.tensor(header.tokens), torch.full((n,), slot), torch.arange(n))
            self.history.lengths[slot] = n
        except Exception:
            with self._lock:
                self.history.lengths.pop(slot, None)
                self.local.kv_clear(slot)
                for remote in self.remotes:
                    with contextlib.suppress(PeerUnavailable):
                        remote.kv_clear(slot)
            raise
        return list(header.tokens)

    # --- KV rebuild ------------------------------------------------------------------------------

    def _rebuild(self, through: int) -> int:
        """Replay the active slots' tokens through stages 0..`through` (rewrites their KV; the
        stages after `through` kept theirs)."""
        active = self.active_slots() if self.active_slots is not None else set(self.history.lengths)
        self.kv_generation += 1
        self.history.flush()
        n_tokens = 0
        for slot in sorted(active):
            n = self.history.lengths.get(slot, 0)
            for start in range(0, n, REPLAY_CHUNK):
                end = min(n, start + REPLAY_CHUNK)
                tokens = self.history.tokens(slot, start, end)
                slots = torch.full((end - start,), slot, dtype=torch.long)
                positions = torch.arange(start, end, dtype=torch.long)
                h = self.local.run_layers(self.local.embed(tokens), slots, positions)
                for remote in self.remotes[:through]:
                    h = remote.run_layers(h, slots, positions)
                n_tokens += end - start
        self._stale = None
        return n_tokens

    # --- the split advisor's measurement --------------------------------------------------------

    def probe(self, tokens: int, reps: int) -> dict:
        """Every stage times its own layers (contracts.rpc.PipelineProbe, without the head's
        footprint, which its StageHost adds), then whole decode steps give each hop's wire time and
        the step as it runs. On the slot holding the fewest tokens, past them: nothing is lost."""
        if not self.remotes:
            raise UserError("a solo head has no split to tune: the split advisor needs peers")
        with self._lock:
            self._settle()
            if self._stale is not None:
                self._rebuild(self._stale)
            slot = min(range(self.local.n_slots), key=self.slot_length)
            position = self.slot_length(slot)
            return probe_pipeline(self.local, self.remotes, self.ranges[0], slot, position, tokens, reps)

    # --- live re-split --------------------------------------------------------------------------

    def resplit(self, ranges: list[tuple[int, int]]) -> dict:
        """Move layer boundaries without a restart: every stage loads its new range from its own
        file (in parallel), then the active slots' KV is rebuilt; a running request just pauses."""
        ranges = [tuple(map(int, r)) for r in ranges]
        check_ranges(ranges, self.cfg.n_layers, 1 + len(self.remotes))
        with self._lock:
            self._settle()
            down = [r.addr for r in self.remotes if r.state != "up"]
            if down:
                raise UserError(f"cannot re-split while peers are down: {', '.join(down)}")
            old = list(self.ranges)
            t0 = time.perf_counter()
            try:
                with self._layout:
                    self._assign_all(ranges)
            except Exception:
                log.exception("re-split to %s failed: restoring %s", ranges, old)
                with self._layout:
                    self._assign_all(old)
                self._stale = len(self.remotes)
                raise
            t_assign = time.perf_counter() - t0
            changed = [i for i, (a, b) in enumerate(zip(old, ranges)) if a != b]
            rebuilt = self._rebuild(changed[-1]) if changed else 0
            self.resplits += 1
            self.last_resplit = {
                "layers": [list(r) for r in ranges],
                "previous": [list(r) for r in old],
                "seconds": round(time.perf_counter() - t0, 4),
                "assign_s": round(t_assign, 4),
                "rebuilt_tokens": rebuilt,
            }
            log.info("re-split %s -> %s in %.3f s", old, ranges, self.last_resplit["seconds"])
            return self.last_resplit

    def _assign_all(self, ranges) -> None:
        stages = [self.local, *self.remotes]
        todo = [(s, r) for s, r, cur in zip(stages, ranges, self.ranges) if tuple(cur) != r]
        if todo:
            with ThreadPoolExecutor(len(todo)) as pool:
                for f in [pool.submit(s.assign, *r) for s, r in todo]:
                    f.result()
        self.ranges = list(ranges)

    # --- the head sleeps (--sleep-idle-seconds) ---------------------------------------------------

    def release(self) -> None:
        """Every slot cleared on every stage (a peer's pooled KV blocks go back; its stage stays
        loaded), then this stage let go (`local` is None until `restore`) with the drafter state
        beside it."""
        with self._lock:
            try:
                self.evict(list(range(self.local.n_slots)))
            except Exception as e:  # a lost peer loads a fresh stage on re-attach; another reuses its slots from 0
                log.warning("sleeping without clearing every peer's slots: %s", e)
            self.history = SlotHistory()
            self._device = self.local.device
            self.local = self.side_state = self.active_slots = None  # nothing of the engine's is kept

    def restore(self, local: Stage) -> None:
        """This stage again after `release`, built anew for `ranges[0]`."""
        with self._lock:
            self.local = local

    # --- peers: lost, re-attached ------------------------------------------------------------

    def interrupt(self) -> None:
        """The process is stopping: a forward paused for a lost peer fails now, the watcher ends."""
        self.recovery.interrupt()

    def stop(self) -> None:
        self.interrupt()
        for remote in self.remotes:
            remote.close()

    def stages(self) -> list[StageInfo]:
        """Explicit layer ranges of every stage, for /status."""
        local = self.local
        head = ("head", None, tuple(self.ranges[0]))
        if local is None:  # asleep: it holds nothing
            out = [StageInfo(*head, str(self._device), "sleeping", 0, 0)]
        else:
            out = [
                StageInfo(*head, str(local.device), "ok", local.kv_bytes, local.held_weight_bytes, dict(local.steps))
            ]
        for remote, r in zip(self.remotes, self.ranges[1:]):
            out.append(StageInfo("peer", remote.addr, tuple(r), str(remote.device), remote.state))
        return out


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            fn()

    return run
