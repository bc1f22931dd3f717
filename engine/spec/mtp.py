"""qwen35's own multi-token-prediction block (`blk.N.nextn.*`) as a drafter, as llama.cpp's draft-mtp."""

from __future__ import annotations

import torch

from ..config import MAX_DRAFT
from ..errors import UserError
from ..model import NextN, graph_run_lengths
from ..model.nextn_graphs import DraftChainGraphs
from .drafter import DRAFT_TOP_K, Draft, Drafter, DraftRequest, draft_step

# Other GGUF architectures whose converters (llama.cpp convert_hf_to_gguf.py) can keep a
# multi-token-prediction ("NextN") head, stored as `blk.N.nextn.*` tensors and counted in
# `<arch>.nextn_predict_layers`; Hydra runs qwen35's.
MTP_ARCHS = ("glm4moe (GLM-4.5/4.6)", "deepseek2 (DeepSeek-V3/R1, when converted with the MTP layer)")


class MtpDrafter(Drafter):
    """Drafts with the target's own multi-token-prediction block (`model.NextN`, on the head), as
    llama.cpp's `draft-mtp` for qwen35 (common/speculative.cpp):

    - `observe` runs after every target forward (prefill, decode, verify) over all its tokens: the
      block's KV at position p is computed from token x_p and the trunk's normed hidden state of
      p - 1 (zeros at p = 0), so its cache always follows what the target has run. Rows the target
      rejected are rewritten by the next forward that reaches their positions, and attention never
      reads past the position it runs at.
    - `draft_batch` starts from the slot's last token x_n at position n with the trunk's h of
      n - 1, then feeds each drafted token at the next position with the block's own output h',
      for up to k tokens, stopping at the first whose probability (over the top 10) is below p-min.

    The trunk's h for the position before a slot's next run is the row the target computed there:
    the last `MAX_DRAFT + 1` rows of each slot's latest run are kept (a verify keeps all its rows;
    the next run starts right after the last accepted one).

    A slot that drafts nothing for now (`rest`: the adaptive policy's k = 0) does not pay for the
    block on each step: its rows' inputs (token, position, the h before) are kept, up to
    `CATCH_UP` of them, and the block runs over them all at once before its next draft (or before
    its state moves), so its KV is as if it had followed every step (older rows than that stay
    stale: poorer drafts, never wrong output)."""

    CATCH_UP = 256  # rows a resting slot keeps for its catch-up (adaptive.PROBE_MAX steps and more)

    def __init__(self, nextn, p_min: float = 0.75):
        self.nextn = nextn
        self.p_min = p_min
        # On a GPU the greedy chain replays from a graph per batch bucket and k (`nextn_graphs`).
        self.graphs = DraftChainGraphs(nextn) if nextn.block.graphs is not None else None
        self._rows: dict[int, tuple[int, torch.Tensor]] = {}  # slot -> (position of rows[0], trunk h rows)
        self._resting: set[int] = set()
        self._pending: dict[
            int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
        ] = {}  # (tokens, positions, h before)

    @property
    def device(self) -> torch.device:
        return self.nextn.head.device

    @property
    def kv_bytes(self) -> int:
        return self.nextn.kv_bytes

    def sync(self) -> None:
        """Nothing to send: the block is here (RemoteMtpDrafter's sends the resting slots)."""

    def start(self, slot: int, prompt: list[int]) -> None:
        self.release(slot)

    def release(self, slot: int) -> None:
        self._resting.discard(slot)
        self._pending.pop(slot, None)

    def clear(self, slot: int) -> None:
        """The target forgot `slot` (its KV cleared): so does the block (its pooled blocks go back)."""
        self.release(slot)
        self._rows.pop(slot, None)
        self.nextn.block.kv_clear(slot)

    def rest(self, slot: int, resting: bool) -> None:
        """Whether `slot` drafts nothing for now (the block then waits for its next draft to catch up)."""
        if resting:
            self._resting.add(slot)
        else:
            self._resting.discard(slot)

    def _catch_up(self, slots) -> None:
        """Run the block over the rows `slots` kept while resting, all of them in one batch."""
        parts = [(s, self._pending.pop(s)) for s in slots if s in self._pending]
        if not parts:
            return
        rows = [r for _, rs in parts for r in rs]
        n = [sum(len(t) for t, _, _ in rs) for _, rs in parts]
        slot_ids = torch.repeat_interleave(torch.tensor([s for s, _ in parts], dtype=torch.long), torch.tensor(n))
        tokens, positions, h_prev = (torch.cat([r[i] for r in rows]) for i in range(3))
        self.nextn.run(tokens, h_prev, slot_ids, positions)

    def _h_before(self, slot: int, pos: int) -> torch.Tensor:
        """The trunk's normed hidden state at `pos - 1` for `slot` (zeros at position 0 or when unknown)."""
        p0, rows = self._rows.get(slot, (0, None))
        if rows is not None and pos > 0 and 0 <= pos - 1 - p0 < rows.shape[0]:
            return rows[pos - 1 - p0]
        return torch.zeros(self.nextn.head.cfg.n_embd, device=self.nextn.head.device)

    # The slot's MTP state moves with the slot (contracts.slot_state `mtp.*`): the block's KV of the
    # positions moved, and the trunk's h at the last one (what the next run starts from).

    def state_out(self, slot: int, n: int) -> dict[str, torch.Tensor]:
        """The block's state for `slot`'s first n positions, by name; empty when the trunk's h at
        position n - 1 is no longer kept (the state then travels without it)."""
        self._catch_up([slot])
        p0, rows = self._rows.get(slot, (0, None))
        if rows is None or n == 0 or not 0 <= n - 1 - p0 < rows.shape[0]:
            return {}
        return {**self._kv_views(slot, n), "mtp.h": rows[n - 1 - p0 : n - p0].float()}

    def state_in(self, slot: int, n: int) -> dict[str, torch.Tensor]:
        """Where a moved slot's MTP state goes (`restored` then takes the h row in)."""
        h = torch.empty(1, self.nextn.head.cfg.n_embd, dtype=torch.float32, device=self.nextn.head.device)
        return {**self._kv_views(slot, n), "mtp.h": h}

    def restored(self, slot: int, n: int, views: dict[str, torch.Tensor] | None) -> None:
        """`slot` now holds a moved state of n positions; `views` (from `state_in`) were written,
        or None when the state had no MTP part: the block's KV there is stale, so drafts for the
        slot are poorer until it refills (the target's verification keeps output exact). Rows it
        kept while resting belong to what the slot held before: dropped."""
        self._pending.pop(slot, None)
        if views is None:
            self._rows.pop(slot, None)
        else:
            self._rows[slot] = (n - 1, views["mtp.h"])

    def _kv_views(self, slot: int, n: int) -> dict[str, torch.Tensor]:
        prefix = f"blk.{self.nextn.block.layer_range[0]}."
        return {"mtp." + name.removeprefix(prefix): view for name, view in self.nextn.block.slot_state(slot, n).items()}

    def observe(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """The target ran `tokens` (per slot contiguous) and returned their normed hidden states:
        the block runs over the following slots' rows now, the resting slots' wait for their catch-up."""
        if tokens.numel() == 0:
            return
        s, p = slots.tolist(), positions.tolist()
        starts = [i for i in range(len(s)) if i == 0 or s[i] != s[i - 1]]
        h_prev = torch.cat([hidden[:1], hidden[:-1]])
        for i in starts:
            h_prev[i] = self._h_before(s[i], p[i])
        resting = [(i, end) for i, end in zip(starts, starts[1:] + [len(s)]) if s[i] in self._resting]
        if not resting:
            self.nextn.run(tokens, h_prev, slots, positions)
        else:
            for i, end in resting:
                kept = self._pending.setdefault(s[i], [])
                kept.append((tokens[i:end], positions[i:end], h_prev[i:end].clone()))
                while sum(len(t) for t, _, _ in kept) > self.CATCH_UP:
                    kept.pop(0)
            follow = torch.ones(len(s), dtype=torch.bool)
            for i, end in resting:
                follow[i:end] = False
            if bool(follow.any()):
                idx = follow.nonzero().flatten()
                self.nextn.run(tokens[idx.to(tokens.device)], h_prev[idx.to(h_prev.device)], slots[idx], positions[idx])
        for i, end in zip(starts, starts[1:] + [len(s)]):
            keep = min(end - i, MAX_DRAFT + 1)
            self._rows[s[i]] = (p[end - keep], hidden[end - keep : end].clone())

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        self._catch_up([r.slot for r in requests])
        live = [i for i, r in enumerate(requests) if r.k > 0 and r.tokens]
        if live and all(requests[i].sampler is None or requests[i].sampler.params.greedy for i in live):
            return self._greedy_chain(requests, live)
        out = [Draft() for _ in requests]
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        toks = [requests[i].tokens[-1] for i in live]
        pos = [len(requests[i].tokens) - 1 for i in live]
        h = torch.stack([self._h_before(requests[i].slot, p) for i, p in zip(live, pos)]) if live else None
        while live:
            slots = torch.tensor([requests[i].slot for i in live], dtype=torch.long)
            hn = self.nextn.run(torch.tensor(toks, dtype=torch.long), h, slots, torch.tensor(pos, dtype=torch.long))
            logits = self.nextn.logits(hn)
            still, next_rows = [], []
            for row, i in enumerate(live):
                if draft_step(out[i], qs[i], requests[i], logits[row], self.p_min):
                    still.append(i)
                    next_rows.append(row)
            toks = [out[i].tokens[-1] for i in still]
            pos = [len(requests[i].tokens) - 1 + len(out[i].tokens) for i in still]
            h = hn[next_rows]
            live = still
        for i, q in qs.items():
            if q:
                out[i].q = torch.stack(q)
        return out

    def _greedy_chain(self, requests: list[DraftRequest], live: list[int]) -> list[Draft]:
        """Greedy drafts of the `live` requests (`greedy`)."""
        reqs = [requests[i] for i in live]
        drafts = self.greedy(
            [r.slot for r in reqs],
            [r.tokens[-1] for r in reqs],
            [len(r.tokens) - 1 for r in reqs],
            [r.k for r in reqs],
            [self.p_min if r.p_min is None else r.p_min for r in reqs],
        )
        out = [Draft() for _ in requests]
        for i, tokens in zip(live, drafts):
            out[i].tokens = tokens
        return out

    def greedy(self, slots: list[int], tokens: list[int], positions: list[int], ks: list[int], p_mins: list[float]):
        """Greedy drafts of distinct `slots`, each from its last token `tokens[i]` at `positions[i]`,
        chained on the device: each step's argmax feeds the next step's embedding with no round trip
        to the host, so k steps cost one synchronisation instead of two per row and step. Every row
        runs the longest k; each draft is then cut at its own k and before its first token whose
        top-10 probability is under its p-min, as `draft_step` decides (the block's KV written past
        that point is rewritten by the next forward that reaches those positions, as after a
        rejection). Returns the drafts' token lists."""
        self._catch_up(slots)
        toks = torch.tensor(tokens, dtype=torch.long, device=self.nextn.head.device)
        h = torch.stack([self._h_before(s, p) for s, p in zip(slots, positions)])
        k, top_k = max(ks), chain_top_k(p_mins)
        chained = self.graphs.run(toks, h, slots, positions, k, top_k) if self.graphs is not None else None
        if chained is None:
            slot_t, pos_t = torch.tensor(slots), torch.tensor(positions)
            chained = self.nextn.chain(
                toks, h, k, lambda step: lambda x: self.nextn.block.run_layers(x, slot_t, pos_t + step), top_k
            )
        picks, probs = chained
        out = []
        for row, ps, k_i, p_min in zip(picks.tolist(), probs.tolist(), ks, p_mins):
            n = next((j for j, p in enumerate(ps[:k_i]) if p < p_min), min(k_i, len(row)))
            out.append(row[:n])
        return out


def chain_top_k(p_mins: list[float]) -> int:
    """The logits a greedy chain's probabilities are taken over: none where no p-min can cut a draft."""
    return DRAFT_TOP_K if any(p > 0 for p in p_mins) else 0


def build_mtp(stage, k_max: int, p_min: float) -> MtpDrafter:
    """The MTP block beside `stage` (which holds the embedding and the output head: the head's, or
    with `--output-stage last` the last peer's), its graphs captured now: the block runs a row per
    slot for drafts and as many rows a slot as the stage's graphs for the target's forwards (their
    verifies padded to `k_max` + 1). Captured on first use they would land in the first requests'
    steps."""
    nextn = NextN(stage)
    nextn.block.warm_up(graph_run_lengths(1 + k_max))
    drafter = MtpDrafter(nextn, p_min=p_min)
    if drafter.graphs is not None:  # the greedy draft chains too, for every k up to k_max
        drafter.graphs.warm_up(k_max, chain_top_k([p_min]))
    return drafter


def check_mtp(g) -> None:
    """`--spec-type mtp` needs a qwen35 GGUF that kept its MTP ("NextN") block; say plainly what this file has."""
    arch = g.architecture
    n_nextn = int(g.metadata.get(f"{arch}.nextn_predict_layers", 0) or 0)
    has_tensors = any(".nextn." in name for name in g.tensors)
    if arch == "qwen35":
        if has_tensors and n_nextn <= 1:
            return
        if has_tensors:
            raise UserError(
                f"--spec-type mtp: this qwen35 GGUF has {n_nextn} MTP blocks; Hydra (like llama.cpp) runs exactly one"
            )
        raise UserError(
            "--spec-type mtp: this qwen35 GGUF has no MTP block (no blk.N.nextn.* tensors: it was converted "
            "without the multi-token-prediction layer). Use a GGUF that keeps it, or --spec-type ngram"
        )
    if n_nextn or has_tensors:
        raise UserError(
            f"this GGUF ({arch}) carries a multi-token-prediction head ({n_nextn or 'nextn'} layer(s)), "
            f"but Hydra runs the MTP head of qwen35 only; use --spec-type ngram or --spec-type draft --model-draft PATH"
        )
    raise UserError(
        f"--spec-type mtp: this GGUF ({arch}) has no multi-token-prediction head (no "
        f"'{arch}.nextn_predict_layers' key, no blk.*.nextn.* tensors). Hydra runs the MTP head of qwen35 "
        f"(Qwen3.5) GGUFs; other GGUF MTP heads exist for {', '.join(MTP_ARCHS)}. "
        f"Use --spec-type ngram (no extra model) or --spec-type draft --model-draft PATH"
    )
