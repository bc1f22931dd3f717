"""`Speculator`: what the runtime asks (plan the step's drafts, verify them), and how a worker builds it
from its flags (`check_speculative`, `build_speculator`)."""

from __future__ import annotations

import numpy as np
import torch

from ..config import MAX_DRAFT, ModelSettings, SpecConfig
from ..errors import UserError
from ..gguf_file import GGUFFile
from ..model import ROLLBACK, ModelConfig, Stage, build_stage
from ..pipeline import Pipeline
from ..serving.sampling import Rows, Stream, distribution, host_uniform, sample
from .accept import accept_greedy, accept_sampled
from .adaptive import AdaptiveDrafts
from .draft_model import DraftModelDrafter, check_same_vocab
from .drafter import Draft, Drafter, DraftRequest
from .mtp import MtpDrafter, build_mtp, check_mtp
from .ngram import NgramDrafter
from .remote_mtp import RemoteMtpDrafter
from .stats import SpecStats


class Speculator:
    """What the engine holds: the server's default `SpecConfig`, the drafters it can use (n-gram
    always, the draft model when loaded), and the acceptance counters. The engine asks `plan` for
    drafts of its decoding sequences, runs them in its one forward, and asks `verify` what to emit."""

    def __init__(
        self,
        config: SpecConfig | None = None,
        draft_pipeline=None,
        max_draft: int = MAX_DRAFT,
        mtp: MtpDrafter | RemoteMtpDrafter | None = None,
    ):
        """`max_draft` caps every draft: a recurrent target verifies at most its stages' `depth` tokens,
        the positions its state checkpoints can take back. `mtp`: the drafter of the target's MTP
        block, beside the head's stage or on the last peer's (`--output-stage last`)."""
        self.config = config or SpecConfig()
        self.max_draft = max_draft
        self.drafters: dict[str, Drafter] = {"ngram": NgramDrafter()}
        if draft_pipeline is not None:
            self.drafters["draft"] = DraftModelDrafter(draft_pipeline, p_min=self.config.p_min)
        self.mtp = mtp
        if mtp is not None:
            self.drafters["mtp"] = self.mtp
        self.stats = SpecStats()
        self.adaptive = AdaptiveDrafts(min(max_draft, MAX_DRAFT))
        self.adapt_auto = mtp is None or mtp.device.type == "cpu"
        # Tokens per slot the target's decode graphs replay (the engine sets it from its pipeline's
        # head stage; the peers warmed up the same): a verify of another length is padded to the next
        # of them. None: no graphs, so no padding (on CPU a filler row costs as much as a draft's).
        self.verify_lengths: tuple[int, ...] | None = None

    def verified(self, k: int) -> int:
        """Tokens the verify of a k-token draft runs after the slot's last one: k, or the draft and
        its filler up to the next run length the graphs replay (`verify_lengths`)."""
        if k == 0 or not self.verify_lengths:
            return k
        return next((n - 1 for n in self.verify_lengths if n - 1 >= k), k)

    @property
    def wants_hidden(self) -> bool:
        """Whether the engine must hand every forward's hidden states to `observe` (the MTP drafter's
        input, when the block is here; on the last peer it follows the forwards there)."""
        return isinstance(self.mtp, MtpDrafter)

    @property
    def side_state(self) -> MtpDrafter | None:
        """Per-slot state kept beside the head stage's, moved and cleared with it (Pipeline.side_state)."""
        return self.mtp if isinstance(self.mtp, MtpDrafter) else None

    def observe(self, tokens, slots, positions, hidden) -> None:
        """The target ran this batch: the MTP block follows it (its KV, the trunk's last hidden rows)."""
        self.mtp.observe(tokens, slots, positions, hidden)

    @property
    def drafter_kv_bytes(self) -> int:
        """The drafters' own caches: the MTP block's KV, or the draft model's KV."""
        if self.mtp is not None:
            return self.mtp.kv_bytes
        draft = self.drafters.get("draft")
        return draft.pipeline.local.kv_bytes if draft is not None else 0

    def request_config(self, cfg: SpecConfig) -> SpecConfig | None:
        """A request's override `cfg` (None when it is the server's config itself); a type this
        server cannot run is a UserError."""
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
        self.adaptive.start(slot)

    def release(self, slot: int) -> None:
        for d in self.drafters.values():
            d.release(slot)
        self.adaptive.release(slot)

    def plan(self, seqs: list, n_ctx: int) -> list[Draft | None]:
        """A draft (or None) per decoding sequence (sequence.Sequence: slot, tokens, n_gen, req.spec,
        req.max_tokens, req.constraint, sampler). k is capped so that the k+1 emitted tokens fit
        max_tokens and the k+1 verified positions fit the context; a constrained sequence's draft
        ends before the first token its grammar refuses."""
        out: list[Draft | None] = [None] * len(seqs)
        by_type: dict[str, list[tuple[int, DraftRequest, SpecConfig]]] = {}
        caps: list[tuple[int, int, SpecConfig]] = []  # (sequence index, its most k, its config)
        for i, seq in enumerate(seqs):
            cfg = seq.req.spec or self.config
            if not cfg.active or cfg.type not in self.drafters:
                continue
            k = min(cfg.n_max, self.max_draft, seq.req.max_tokens - seq.n_gen - 1, n_ctx - len(seq.tokens))
            if k >= max(cfg.n_min, 1):
                caps.append((i, k, cfg))
        # `auto` adapts MTP drafts where the policy was measured to pay: on the CPU. On a GPU its first
        # run drafted nothing (docs/PERF.md, session 19): `--draft-adaptive on` there, until measured.
        adapting = [c for c in caps if c[2].adapts and (c[2].adaptive is not None or self.adapt_auto)]
        ks = dict(
            zip(
                (i for i, _, _ in adapting),
                self.adaptive.plan([seqs[i].slot for i, _, _ in adapting], [k for _, k, _ in adapting], self.verified),
            )
        )
        for i, k, cfg in caps:
            k = ks.get(i, k)
            if k < max(cfg.n_min, 1):
                continue
            seq = seqs[i]
            req = DraftRequest(seq.slot, seq.tokens, k, seq.sampler if cfg.probabilistic else None, cfg.p_min)
            by_type.setdefault(cfg.type, []).append((i, req, cfg))
        if self.mtp is not None:  # a slot that drafts nothing this step leaves the block's run for later
            drafting = {seqs[i].slot for items in by_type.values() for i, _, _ in items}
            for seq in seqs:
                self.mtp.rest(seq.slot, seq.slot not in drafting)
            if "mtp" not in by_type:  # a block on the last peer hears of its resting slots before the forward
                self.mtp.sync()
        for kind, items in by_type.items():
            drafts = self.drafters[kind].draft_batch([r for _, r, _ in items])
            for (i, _, cfg), d in zip(items, drafts):
                constraint = seqs[i].req.constraint
                if constraint is not None:  # past a token its grammar refuses, a draft is rejected anyway
                    d = d.prefix(constraint.valid_prefix(d.tokens))
                if len(d) >= max(cfg.n_min, 1):
                    out[i] = self._padded(d, n_ctx - len(seqs[i].tokens))
        return out

    def _padded(self, d: Draft, room: int) -> Draft:
        """`d` with the filler its verify runs to a replayed length (`verified`), when the slot's
        context has `room` for those positions (else it runs as it is, eagerly)."""
        n = self.verified(len(d))
        if len(d) < n <= min(room, self.max_draft):
            d.filler = n - len(d)
        return d

    def verify(
        self, logits: torch.Tensor, draft: Draft, sampler, history: list[int], slot: int | None = None
    ) -> list[int]:
        """Tokens to emit after verifying `draft` against the target's `logits[k+1, V]` (row i follows
        `history + draft[:i]`), with the request's own sampler so its bias, transforms and penalties
        hold (and its seed: row i's randomness is that of the token at its index). `slot`'s
        acceptance feeds the adaptive draft lengths."""
        k = len(draft)
        params = sampler.params
        if params.greedy and not params.penalised and not params.logit_bias:
            emitted = accept_greedy(logits.argmax(-1).tolist(), draft.tokens)
        else:
            rows = Rows.build([sampler] * (k + 1), [history + draft.tokens[:i] for i in range(k + 1)], logits.device)
            if params.greedy or draft.q is None:
                # The target's own draw at each row (its seeded randomness at that index), kept while
                # the draft agrees (llama.cpp's sample-and-match). For a draft chosen without a q, that
                # is rejection sampling's rule (accept x with p(x), else a draw of p without x), and
                # the text is token for token the one the same seed gives without speculation.
                emitted = accept_greedy(sample(logits, rows).tokens.tolist(), draft.tokens)
            else:
                u = torch.from_numpy(
                    np.stack([host_uniform(rows.samplers, rows.counters, s) for s in (Stream.ACCEPT, Stream.SAMPLE)], 1)
                )
                emitted = accept_sampled(distribution(logits, rows), draft.tokens, draft.q, u)
        self.stats.record(k, len(emitted) - 1)
        if slot is not None:
            self.adaptive.record(slot, k, len(emitted) - 1)
        return emitted

    def ahead(self, chunks: list) -> tuple:
        """(slot, drafted, k, p_min) of the chunks whose greedy MTP draft this step verifies, when the
        block is the last peer's: it drafts their next step from the outcome in the same exchange
        (`RemoteMtpDrafter`), instead of a DRAFT round trip then."""
        if not isinstance(self.mtp, RemoteMtpDrafter):
            return ()
        out = []
        for c in chunks:
            cfg = c.seq.req.spec or self.config
            if c.draft and cfg.type == "mtp" and c.greedy_rows:
                out.append((c.seq.slot, len(c.draft), min(cfg.n_max, self.max_draft), cfg.p_min))
        return tuple(out)

    def timed(self, chunks: list, seconds: float) -> None:
        """A decode step (every chunk one sequence's next token, some with drafts) took `seconds`,
        its drafting included: the adaptive policy's cost of (sequences, tokens verified), a draft's
        filler counted (the step ran it)."""
        if chunks and not any(c.prefill or c.hidden for c in chunks):
            self.adaptive.timed(len(chunks), sum(1 + (len(c.draft.run) if c.draft else 0) for c in chunks), seconds)


def check_speculative(config: SpecConfig, draft_path: str | None, g) -> None:
    """The `--spec-type` / `--model-draft` combination against the target GGUF `g`, before anything loads."""
    if config.type == "mtp":
        check_mtp(g)
    if config.type == "draft" and not draft_path:
        raise UserError("--spec-type draft needs --model-draft PATH (a smaller GGUF with the same vocabulary)")
    if draft_path and config.type != "draft":
        raise UserError(f"--model-draft is only used with --spec-type draft (got --spec-type {config.type})")


def build_speculator(
    config: SpecConfig,
    draft_path: str | None,
    g,
    model: ModelSettings,
    n_slots: int,
    head: Stage | None = None,
    remote_output=None,
) -> Speculator:
    """The head's Speculator from its settings (`--spec-type`, `--model-draft`, `--draft-*`); `g` is
    the target GGUF, `head` the head's Stage (`--spec-type mtp` builds the MTP block beside it), or
    `remote_output` the last peer's RemoteStage that holds the output and the block. Loads the draft
    model for `--spec-type draft`."""
    check_speculative(config, draft_path, g)
    # A recurrent target verifies at most what its states can take back (the head's, as its peers').
    depth = head.depth if head is not None else ROLLBACK
    max_draft = depth if ModelConfig.from_gguf(g).recurrent else MAX_DRAFT
    if config.type == "mtp":
        if remote_output is not None:  # the block is the last peer's (--output-stage last), loaded with its stage
            return Speculator(
                config, max_draft=max_draft, mtp=RemoteMtpDrafter(remote_output, config.p_min, head.device)
            )
        if head is None:
            raise ValueError("--spec-type mtp builds the MTP block on the head's stage: pass head=")
        k_max = min(config.n_max, max_draft)
        return Speculator(config, max_draft=max_draft, mtp=build_mtp(head, k_max, config.p_min))
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
