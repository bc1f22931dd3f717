"""Speculative decoding: drafters that propose tokens, and the exact accept step that checks them.

A step with a draft of k tokens runs k+1 tokens of the slot through the target model in one
`Pipeline.forward` (through the split: one round trip per peer). Row i of those logits is the
target's distribution after the slot's history plus draft[:i]. The accept step keeps the draft
prefix the target agrees with and adds one token of the target's own, so every step emits at
least one token and the output follows the target exactly:

- greedy: accept while draft[i] equals the target's pick at row i; output is token for token
  the non-speculative greedy output.
- temperature > 0: rejection sampling (Leviathan et al. 2023 / Chen et al. 2023): accept x with
  probability min(1, p(x)/q(x)), on rejection sample from norm(max(0, p - q)). A drafter that
  proposes deterministically (n-gram lookup, greedy draft model) has q = point mass on x, which
  reduces to: accept with probability p(x), else sample from p with x removed.

KV rollback is implicit: the runtime advances the slot's length by accepted + 1, so the KV rows of
rejected draft tokens (head and peers) are overwritten by the next step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..contracts.status import Speculative
from .config import MAX_DRAFT, ModelSettings, SpecConfig
from .errors import UserError
from .gguf_file import GGUFFile
from .model import ROLLBACK, ModelConfig, NextN, Stage, build_stage
from .pipeline import Pipeline
from .sampling import Rows, Stream, distribution, draw, host_uniform, sample, uniform

# Other GGUF architectures whose converters (llama.cpp convert_hf_to_gguf.py) can keep a
# multi-token-prediction ("NextN") head, stored as `blk.N.nextn.*` tensors and counted in
# `<arch>.nextn_predict_layers`; Hydra runs qwen35's.
MTP_ARCHS = ("glm4moe (GLM-4.5/4.6)", "deepseek2 (DeepSeek-V3/R1, when converted with the MTP layer)")


@dataclass
class Draft:
    """Proposed tokens and, when they were sampled from a distribution, that distribution per token
    (`q[i]` over the vocabulary). `q is None` means each token was chosen deterministically."""

    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> Draft:
        return self if n >= len(self.tokens) else Draft(self.tokens[:n], None if self.q is None else self.q[:n])


@dataclass
class DraftRequest:
    """One slot's ask: its whole history (prompt + output so far), how many tokens at most, the
    request's sampler (a draft model samples through it when temperature > 0) and its p-min."""

    slot: int
    tokens: list[int]
    k: int
    sampler: object | None = None  # sampling.Sampler
    p_min: float | None = None


class Drafter:
    """Proposes up to k next tokens for a slot. Hooks: `start(slot, prompt)` when a request takes a
    slot, `release(slot)` when it leaves; `draft_batch` may batch slots (the draft model does)."""

    def start(self, slot: int, prompt: list[int]) -> None:
        """A new request took `slot`."""

    def release(self, slot: int) -> None:
        """The request in `slot` finished; drop anything kept for it."""

    def draft(self, slot: int, tokens: list[int], k: int) -> list[int]:
        return self.draft_batch([DraftRequest(slot, tokens, k)])[0].tokens

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        raise NotImplementedError


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the history's last n tokens (n = n_max
    down to 1) and propose the tokens that followed it. Needs no model; shines when the output
    repeats the prompt (code edits, summaries quoting the text, extraction)."""

    def __init__(self, n_max: int = 3, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min = n_max, n_min

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        hist = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.n_max, len(hist) - 1), self.n_min - 1, -1):
            # Windows starting at j with j + n < len(hist): an earlier occurrence with a follower.
            windows = np.lib.stride_tricks.sliding_window_view(hist[:-1], n)
            hits = np.flatnonzero((windows == hist[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return hist[start : start + k].tolist()
        return []

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self.lookup(r.tokens, r.k)) for r in requests]


class DraftModelDrafter(Drafter):
    """A smaller GGUF with the target's vocabulary drafts autoregressively on its own `Pipeline`
    (its own per-slot KV cache). All slots that ask in one step draft together: one draft forward
    per drafted position for the whole batch. Greedy requests draft the draft model's argmax (q is a
    point mass); sampled requests draw from the draft distribution under the request's sampling
    transforms and return it as q for rejection sampling. Drafting stops at the first token whose
    draft probability is below `p_min`. Called from the engine thread only."""

    def __init__(self, pipeline, p_min: float = 0.75):
        self.pipeline = pipeline
        self.p_min = p_min
        self._cached: dict[int, list[int]] = {}  # slot -> tokens whose KV the draft cache holds

    def start(self, slot: int, prompt: list[int]) -> None:
        self._cached.pop(slot, None)

    def release(self, slot: int) -> None:
        self._cached.pop(slot, None)

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        out = [Draft() for _ in requests]
        live = [i for i, r in enumerate(requests) if r.k > 0 and r.tokens]
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        # Feed per slot what its draft cache lacks (new prompt, accepted tokens, the last target
        # token); positions past the common prefix are simply overwritten.
        feeds: dict[int, tuple[list[int], int]] = {}
        for i in live:
            r = requests[i]
            cached = self._cached.get(r.slot, [])
            common = _common_prefix(cached, r.tokens)
            if common == len(r.tokens):  # always recompute the last position's logits
                common -= 1
            feeds[i] = (r.tokens[common:], common)
            self._cached[r.slot] = list(r.tokens)
        while live:
            toks, slots, pos, rows = [], [], [], []
            for i in live:
                feed, p0 = feeds[i]
                toks += feed
                slots += [requests[i].slot] * len(feed)
                pos += range(p0, p0 + len(feed))
                rows.append(len(toks) - 1)
            logits = self.pipeline.forward(
                torch.tensor(toks, dtype=torch.long),
                torch.tensor(slots, dtype=torch.long),
                torch.tensor(pos, dtype=torch.long),
                torch.tensor(rows, dtype=torch.long),
            )
            still = []
            for row, i in enumerate(live):
                r = requests[i]
                if _draft_step(out[i], qs[i], r, logits[row], self.p_min):
                    tok = out[i].tokens[-1]
                    feeds[i] = ([tok], len(r.tokens) + len(out[i].tokens) - 1)
                    self._cached[r.slot].append(tok)
                    still.append(i)
            live = still
        for i, q in qs.items():
            if q:
                out[i].q = torch.stack(q)
        return out


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
    the next run starts right after the last accepted one)."""

    TOP_K = 10

    def __init__(self, nextn, p_min: float = 0.75):
        self.nextn = nextn
        self.p_min = p_min
        self._rows: dict[int, tuple[int, torch.Tensor]] = {}  # slot -> (position of rows[0], trunk h rows)

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
        slot are poorer until it refills (the target's verification keeps output exact)."""
        if views is None:
            self._rows.pop(slot, None)
        else:
            self._rows[slot] = (n - 1, views["mtp.h"])

    def _kv_views(self, slot: int, n: int) -> dict[str, torch.Tensor]:
        prefix = f"blk.{self.nextn.block.layer_range[0]}."
        return {"mtp." + name.removeprefix(prefix): view for name, view in self.nextn.block.slot_state(slot, n).items()}

    def observe(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """The target ran `tokens` (per slot contiguous) and returned their normed hidden states."""
        if tokens.numel() == 0:
            return
        s, p = slots.tolist(), positions.tolist()
        starts = [i for i in range(len(s)) if i == 0 or s[i] != s[i - 1]]
        h_prev = torch.cat([hidden[:1], hidden[:-1]])
        for i in starts:
            h_prev[i] = self._h_before(s[i], p[i])
        self.nextn.run(tokens, h_prev, slots, positions)
        for i, end in zip(starts, starts[1:] + [len(s)]):
            keep = min(end - i, MAX_DRAFT + 1)
            self._rows[s[i]] = (p[end - keep], hidden[end - keep : end].clone())

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        out = [Draft() for _ in requests]
        live = [i for i, r in enumerate(requests) if r.k > 0 and r.tokens]
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
                if _draft_step(out[i], qs[i], requests[i], logits[row], self.p_min, self.TOP_K):
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


def _draft_step(draft: Draft, qs: list, req: DraftRequest, logits: torch.Tensor, p_min: float, top_k: int = 0) -> bool:
    """Append the next draft token unless its probability falls below p-min (the request's, else the
    drafter's); True while the draft goes on."""
    tok, prob, q = _pick(logits, req, req.tokens + draft.tokens, top_k)
    if prob < (p_min if req.p_min is None else req.p_min):
        return False
    draft.tokens.append(tok)
    if q is not None:
        qs.append(q)
    return len(draft.tokens) < req.k


def _pick(logits: torch.Tensor, req: DraftRequest, history: list[int], top_k: int = 0):
    """(token, its draft probability, the distribution it was drawn from or None for argmax).
    `top_k` > 0: a greedy pick's probability is over the top k logits only (llama.cpp's MTP
    drafter samples through a top-10 sampler and compares that candidate's p with p-min)."""
    s = req.sampler
    if s is not None and not s.params.greedy:
        rows = Rows.build([s], [history], logits.device)
        q = distribution(logits[None], rows)[0]
        tok = int(draw(q[None], uniform(rows, Stream.DRAFT))[0])
        return tok, float(q[tok]), q
    if top_k:
        top = logits.float().topk(min(top_k, logits.shape[-1]))
        return int(top.indices[0]), float(torch.softmax(top.values, dim=-1)[0]), None
    probs = torch.softmax(logits.float(), dim=-1)
    tok = int(torch.argmax(probs))
    return tok, float(probs[tok]), None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


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


def check_same_vocab(target, draft) -> None:
    """A draft model must share the target's token ids, or its proposals mean other text."""
    t_tokens = target.metadata.get("tokenizer.ggml.tokens")
    d_tokens = draft.metadata.get("tokenizer.ggml.tokens")
    if t_tokens is None or d_tokens is None:
        raise UserError("draft model check: a GGUF has no tokenizer.ggml.tokens vocabulary")
    if len(t_tokens) != len(d_tokens):
        raise UserError(
            f"draft model vocabulary has {len(d_tokens)} tokens, the target has {len(t_tokens)}: "
            "--model-draft must use the same tokenizer as --model"
        )
    if list(t_tokens) != list(d_tokens):
        first = next(i for i, (a, b) in enumerate(zip(t_tokens, d_tokens)) if a != b)
        raise UserError(
            f"draft model vocabulary differs from the target's at token {first} "
            f"({d_tokens[first]!r} vs {t_tokens[first]!r}): --model-draft must use the same tokenizer"
        )


# ---------------------------------------------------------------- verification (pure functions)


def accept_greedy(targets: list[int], draft: list[int]) -> list[int]:
    """Tokens to emit given the target's pick at each of the k+1 verified rows: the draft prefix
    that matches, then the target's token at the first mismatch (or after the whole draft)."""
    if len(targets) != len(draft) + 1:
        raise ValueError(f"need k+1={len(draft) + 1} target picks, got {len(targets)}")
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return draft[:m] + [targets[m]]


def accept_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor | None, u: torch.Tensor) -> list[int]:
    """Rejection sampling. `p[k+1, V]`: the target's probabilities (after the request's sampling
    transforms) at each verified row; `q[k, V]`: the drafter's, or None for a deterministic drafter
    (point mass on each draft token); `u[k+1, 2]`: independent uniforms in (0, 1), row i's accept
    test and its draw. Emitted tokens are distributed exactly as sampling from p."""
    k = len(draft)
    if p.shape[0] != k + 1:
        raise ValueError(f"need k+1={k + 1} target rows, got {p.shape[0]}")
    out: list[int] = []
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if qx > 0 and float(u[i, 0]) < min(1.0, px / qx):
            out.append(x)
            continue
        if q is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = torch.clamp(p[i] - q[i], min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any p-sample is right
            residual = p[i]
        out.append(int(draw(residual[None], u[i : i + 1, 1])))
        return out
    out.append(int(draw(p[k : k + 1], u[k : k + 1, 1])))
    return out


# ---------------------------------------------------------------- acceptance statistics


class SpecStats:
    """Counters behind /metrics and /status: drafts verified, tokens drafted, tokens accepted,
    accepted per draft position, and a recent window of drafts."""

    def __init__(self, window_s: float = 30.0, window_max: int = 1024):
        self._lock = threading.Lock()
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos: list[int] = []
        self.window_s = window_s
        self._recent: deque[tuple[float, int, int]] = deque(maxlen=window_max)

    def record(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted <= 0:
            return
        with self._lock:
            self.drafts += 1
            self.draft_tokens += n_drafted
            self.accepted += n_accepted
            while len(self.accepted_per_pos) < n_drafted:
                self.accepted_per_pos.append(0)
            for i in range(n_accepted):
                self.accepted_per_pos[i] += 1
            self._recent.append((time.monotonic(), n_drafted, n_accepted))

    def snapshot(self, spec: SpecConfig | None = None, kv_bytes: int = 0) -> Speculative:
        """The /status `speculative` section (`kv_bytes`: the drafter's own cache)."""
        with self._lock:
            cutoff = time.monotonic() - self.window_s
            recent = [(d, a) for t, d, a in self._recent if t >= cutoff]
            r_drafted = sum(d for d, _ in recent)
            r_accepted = sum(a for _, a in recent)
            return Speculative(
                type=spec.type if spec else "off",
                draft_max=spec.n_max if spec else 0,
                drafts=self.drafts,
                draft_tokens=self.draft_tokens,
                accepted=self.accepted,
                acceptance=self.accepted / self.draft_tokens if self.draft_tokens else None,
                mean_accepted_len=1 + self.accepted / self.drafts if self.drafts else None,
                recent_acceptance=r_accepted / r_drafted if r_drafted else None,
                accepted_per_pos=list(self.accepted_per_pos),
                kv_bytes=kv_bytes,
            )


# ---------------------------------------------------------------- the engine's side


class Speculator:
    """What the engine holds: the server's default `SpecConfig`, the drafters it can use (n-gram
    always, the draft model when loaded), and the acceptance counters. The engine asks `plan` for
    drafts of its decoding sequences, runs them in its one forward, and asks `verify` what to emit."""

    def __init__(
        self,
        config: SpecConfig | None = None,
        draft_pipeline=None,
        max_draft: int = MAX_DRAFT,
        nextn: NextN | None = None,
    ):
        """`max_draft` caps every draft: a recurrent target verifies at most `model.ROLLBACK` tokens,
        the positions its state checkpoints can take back. `nextn`: the target's MTP block."""
        self.config = config or SpecConfig()
        self.max_draft = max_draft
        self.drafters: dict[str, Drafter] = {"ngram": NgramDrafter()}
        if draft_pipeline is not None:
            self.drafters["draft"] = DraftModelDrafter(draft_pipeline, p_min=self.config.p_min)
        self.mtp = MtpDrafter(nextn, p_min=self.config.p_min) if nextn is not None else None
        if self.mtp is not None:
            self.drafters["mtp"] = self.mtp
        self.stats = SpecStats()

    @property
    def wants_hidden(self) -> bool:
        """Whether the engine must hand every forward's hidden states to `observe` (the MTP drafter's input)."""
        return self.mtp is not None

    def observe(self, tokens, slots, positions, hidden) -> None:
        """The target ran this batch: the MTP block follows it (its KV, the trunk's last hidden rows)."""
        self.mtp.observe(tokens, slots, positions, hidden)

    @property
    def drafter_kv_bytes(self) -> int:
        """The drafters' own caches: the MTP block's KV, or the draft model's KV."""
        if self.mtp is not None:
            return self.mtp.nextn.kv_bytes
        draft = self.drafters.get("draft")
        return draft.pipeline.local.kv_bytes if draft is not None else 0

    def request_config(self, body: dict) -> SpecConfig | None:
        """A request's override (None: the server's config); a type this server cannot run is a UserError."""
        cfg = self.config.with_request(body)
        if cfg is self.config:
            return None
        if cfg.active and cfg.type not in self.drafters:
            raise UserError(
                f"speculative type {cfg.type!r} is not available on this server (a draft model needs: "
                "hydra-engine serve --spec-type draft --model-draft PATH; MTP needs --spec-type mtp on a qwen35 "
                "GGUF with its MTP block)"
            )
        return cfg

    def start(self, slot: int, prompt: list[int]) -> None:
        for d in self.drafters.values():
            d.start(slot, prompt)

    def release(self, slot: int) -> None:
        for d in self.drafters.values():
            d.release(slot)

    def plan(self, seqs: list, n_ctx: int) -> list[Draft | None]:
        """A draft (or None) per decoding sequence (sequence.Sequence: slot, tokens, n_gen, req.spec,
        req.max_tokens, req.constraint, sampler). k is capped so that the k+1 emitted tokens fit
        max_tokens and the k+1 verified positions fit the context; a constrained sequence's draft
        ends before the first token its grammar refuses."""
        out: list[Draft | None] = [None] * len(seqs)
        by_type: dict[str, list[tuple[int, DraftRequest, SpecConfig]]] = {}
        for i, seq in enumerate(seqs):
            cfg = seq.req.spec or self.config
            if not cfg.active or cfg.type not in self.drafters:
                continue
            k = min(cfg.n_max, self.max_draft, seq.req.max_tokens - seq.n_gen - 1, n_ctx - len(seq.tokens))
            if k < max(cfg.n_min, 1):
                continue
            req = DraftRequest(seq.slot, seq.tokens, k, seq.sampler, cfg.p_min)
            by_type.setdefault(cfg.type, []).append((i, req, cfg))
        for kind, items in by_type.items():
            drafts = self.drafters[kind].draft_batch([r for _, r, _ in items])
            for (i, _, cfg), d in zip(items, drafts):
                constraint = seqs[i].req.constraint
                if constraint is not None:  # past a token its grammar refuses, a draft is rejected anyway
                    d = d.prefix(constraint.valid_prefix(d.tokens))
                if len(d) >= max(cfg.n_min, 1):
                    out[i] = d
        return out

    def verify(self, logits: torch.Tensor, draft: Draft, sampler, history: list[int]) -> list[int]:
        """Tokens to emit after verifying `draft` against the target's `logits[k+1, V]` (row i follows
        `history + draft[:i]`), with the request's own sampler so its bias, transforms and penalties
        hold (and its seed: row i's randomness is that of the token at its index)."""
        k = len(draft)
        params = sampler.params
        if params.greedy and not params.penalised and not params.logit_bias:
            emitted = accept_greedy(logits.argmax(-1).tolist(), draft.tokens)
        else:
            rows = Rows.build([sampler] * (k + 1), [history + draft.tokens[:i] for i in range(k + 1)], logits.device)
            if params.greedy:
                emitted = accept_greedy(sample(logits, rows).tokens.tolist(), draft.tokens)
            else:
                u = torch.from_numpy(
                    np.stack([host_uniform(rows.samplers, rows.counters, s) for s in (Stream.ACCEPT, Stream.SAMPLE)], 1)
                )
                emitted = accept_sampled(distribution(logits, rows), draft.tokens, draft.q, u)
        self.stats.record(k, len(emitted) - 1)
        return emitted


def check_speculative(config: SpecConfig, draft_path: str | None, g) -> None:
    """The `--spec-type` / `--model-draft` combination against the target GGUF `g`, before anything loads."""
    if config.type == "mtp":
        check_mtp(g)
    if config.type == "draft" and not draft_path:
        raise UserError("--spec-type draft needs --model-draft PATH (a smaller GGUF with the same vocabulary)")
    if draft_path and config.type != "draft":
        raise UserError(f"--model-draft is only used with --spec-type draft (got --spec-type {config.type})")


def build_speculator(
    config: SpecConfig, draft_path: str | None, g, model: ModelSettings, n_slots: int, head: Stage | None = None
) -> Speculator:
    """The head's Speculator from its settings (`--spec-type`, `--model-draft`, `--draft-*`); `g` is
    the target GGUF, `head` the head's Stage (`--spec-type mtp` builds the MTP block beside it).
    Loads the draft model for `--spec-type draft`."""
    check_speculative(config, draft_path, g)
    max_draft = ROLLBACK if ModelConfig.from_gguf(g).recurrent else MAX_DRAFT
    if config.type == "mtp":
        if head is None:
            raise ValueError("--spec-type mtp builds the MTP block on the head's stage: pass head=")
        return Speculator(config, max_draft=max_draft, nextn=NextN(head))
    if not draft_path:
        return Speculator(config, max_draft=max_draft)
    dg = GGUFFile(draft_path)
    check_same_vocab(g, dg)
    if ModelConfig.from_gguf(dg).recurrent:  # it would re-run its own last drafts every round
        raise UserError(
            f"--model-draft: a recurrent model ({dg.architecture}) cannot draft yet; use a transformer of the same vocabulary"
        )
    stage = build_stage(
        dg,
        device=model.device,
        dtype=model.dtype,
        n_slots=n_slots,
        n_ctx=model.ctx,
        cache_dir=model.cache_dir,
        quantized=model.quantized,
        kv_pool=model.kv_pool,
    )
    return Speculator(config, draft_pipeline=Pipeline(stage), max_draft=max_draft)
