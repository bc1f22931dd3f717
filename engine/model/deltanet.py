"""Gated DeltaNet linear attention (Qwen3.5's recurrent layers), as llama.cpp's qwen35 graph computes it.

Per token: one projection gives the conv input (Q, K, V), the output gate z, β and α. A causal
depthwise conv1d of `conv_kernel` taps (the last kernel-1 inputs are the conv state) and SiLU give
Q, K, V; Q and K are L2-normalised; V head h reads Q/K head h % n_k_heads. The gated delta rule
then updates a [head_k_dim, head_v_dim] state per V head:

    g = softplus(α + dt_bias) * ssm_a          (ssm_a = -exp(A_log), so exp(g) in (0, 1))
    S = exp(g) S;   S += k ⊗ β (v - Sᵀk);      o = Sᵀq / sqrt(head_k_dim)

and the output is RMSNorm(o) * ssm_norm * SiLU(z) through ssm_out. Both states live per slot in
float32, beside the attention layers' KV cache.

The recurrence runs token by token (the reference form); `step` is its one-token-per-slot form
with no host values, which the decode graphs capture. A batch's runs (one per slot) go through
it together, padded to the longest: a padded step has g = 0 and β = 0, which leaves the state
exactly as it was, so prefill chunks, verify batches and decode share one code path. Long runs
(prefill) take their first CHUNK-multiple of steps in the chunked form (`_chunked`, equal to the
token-by-token one to float32 rounding), the rest token by token. On CUDA (`TRITON_PREFILL`) every
run of a batch goes whole through the Triton kernels instead (`kernels/triton_gdn_conv.py`, then
`kernels/triton_delta_rule.py`: the same chunked form, one launch per stage of it, with the final
state and the checkpoints; a batch with decode or verify runs among them, such as a PACKED batch, the
CUDA graph of a short mixed step, `graphs.PackedGraphs`, at float32's accuracy), and `step` through
the step kernels (`kernels/triton_gdn_step.py`: the conv and gates, then the recurrence with each
state tile held in registers for all the slot's tokens); the torch forms stay the reference and the
CPU path.

Unlike KV, recurrent state cannot be overwritten to roll back, so each run also checkpoints the
states of its last `ROLLBACK` positions (and the one before them): a rejected speculative draft
restores the state at the first rejected position (`restore`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ...contracts.footprint import ROLLBACK
from .config import ModelConfig
from .forward_batch import ForwardBatch, Mode, RunTensors

# Steps per chunk of the chunked (prefill) form: llama.cpp's chunk size.
CHUNK = 64
# A batch's runs through the Triton chunked kernels, and steps (`step`) through the step kernels: None = on
# CUDA tensors; True = everywhere (on CPU under Triton's interpreter, TRITON_INTERPRET=1: the tests);
# False = never (the torch forms only).
TRITON_PREFILL: bool | None = None

if TYPE_CHECKING:
    from .weights import Weights


class DeltaNet:
    """Weights and per-slot recurrent state (conv + SSM) of one Gated DeltaNet layer."""

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, n_slots: int, depth: int, padding: bool):
        self.cfg, self.shape = cfg, cfg.deltanet
        s = self.shape
        # One product for everything the input feeds: conv input, z, β, α (in this order).
        names = ["attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight"]
        self.w_in = w.linear([prefix + n for n in names])
        self.w_out = w.linear([prefix + "ssm_out.weight"])
        self.conv = w.vector(prefix + "ssm_conv1d.weight")  # [channels, taps]
        self.dt_bias = w.vector(prefix + "ssm_dt.bias")
        self.a = w.vector(prefix + "ssm_a")
        self.norm = w.vector(prefix + "ssm_norm.weight")
        # One buffer per kind: the slots' states, then (`padding`: the CUDA graphs) the padding slot's
        # row, then the checkpoints `[slot, j - 1]`: the state j tokens before the end of the slot's
        # last run (1 <= j <= depth; j = 0 is the state itself). `depth` (<= ROLLBACK): the longest
        # draft the worker verifies, so a 27B's 3.1 MiB state per slot and layer is copied
        # --draft-max times, not ROLLBACK. The padding slot's checkpoints all land on its own state
        # row (`_ckpt_rows`): it holds nothing anyone reads, so it costs one row, not depth + 1.
        self.n_slots, self.depth = n_slots, depth
        self.rows = n_slots + padding
        conv = (s.conv_channels, s.conv_kernel - 1)
        ssm = (s.n_v_heads, s.head_k_dim, s.head_v_dim)
        self.conv_rows = torch.zeros(self.rows + n_slots * depth, *conv, device=w.device)
        self.ssm_rows = torch.zeros(self.rows + n_slots * depth, *ssm, device=w.device)
        self.conv_state, self.ssm_state = self.conv_rows[: self.rows], self.ssm_rows[: self.rows]
        self.conv_ckpt = self.conv_rows[self.rows :].view(n_slots, depth, *conv)
        self.ssm_ckpt = self.ssm_rows[self.rows :].view(n_slots, depth, *ssm)

    @property
    def nbytes(self) -> int:
        return self.w_in.nbytes + self.w_out.nbytes

    def _ckpt_rows(self, slots: torch.Tensor, j: int | torch.Tensor) -> torch.Tensor:
        """Rows of `conv_rows`/`ssm_rows` holding checkpoint j (>= 1; broadcast with `slots`) of each
        slot; the padding slot's (a graph's unused rows) is its own state row, overwritten by the
        step's end anyway."""
        real = slots < self.n_slots
        return torch.where(real, self.rows + slots * self.depth + (j - 1), slots)

    def clear(self, slot: int) -> None:
        self.conv_state[slot].zero_()
        self.ssm_state[slot].zero_()

    def restore(self, slot: int, back: int) -> None:
        """Take the slot's state back `back` tokens (at most `depth` and its last run's length)."""
        self.conv_state[slot] = self.conv_ckpt[slot, back - 1]
        self.ssm_state[slot] = self.ssm_ckpt[slot, back - 1]

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Normed hidden states [T, n_embd] (compute dtype) of a flat batch -> layer output [T, n_embd]
        float32; advances the state of each run's slot by its tokens."""
        # On the kernels every run goes whole through the chunked form (the token loop below launches
        # ~8 kernels a token and layer); with a decode or verify run among them (up to ROLLBACK + 1
        # tokens: the step kernels' results are float32's) the rule's products at float32's accuracy.
        if batch.mode is Mode.PACKED:
            return self._prefill(x, batch, batch.max_run, "tf32x3")
        runs = batch.runs
        lengths = [n for _, _, n in runs]
        if _triton(x):
            precise = min(lengths) <= ROLLBACK + 1
            return self._prefill(x, batch, max(lengths), "tf32x3" if precise else _precision(x.dtype))
        s = self.shape
        C, Hv, dv = s.conv_channels, s.n_v_heads, s.head_v_dim
        on_device = batch.run_tensors
        long_run = CHUNK + ROLLBACK
        proj = self.w_in(x).float()
        mixed, z, beta, alpha = proj.split([C, Hv * dv, Hv, Hv], dim=-1)

        # Flat tokens -> runs padded to the longest: [R, L, ...]; `valid` maps back.
        R, L, dev = len(runs), max(lengths), x.device
        n, slots = on_device.lengths, on_device.slots
        steps = torch.arange(L, device=dev)
        valid = steps[None, :] < n[:, None]  # [R, L]
        index = (on_device.starts[:, None] + steps[None, :]).clamp(max=x.shape[0] - 1)

        def padded(t: torch.Tensor) -> torch.Tensor:
            return t[index] * valid.view(R, L, *([1] * (t.dim() - 1)))

        conv = self._conv(padded(mixed), slots, n, _checkpoints(lengths, self.depth))
        nk = s.n_k_heads * s.head_k_dim
        q = _l2norm(conv[..., :nk].unflatten(-1, (s.n_k_heads, s.head_k_dim)), self.cfg.rms_eps)
        k = _l2norm(conv[..., nk : 2 * nk].unflatten(-1, (s.n_k_heads, s.head_k_dim)), self.cfg.rms_eps)
        v = conv[..., 2 * nk :].unflatten(-1, (Hv, dv))
        g = padded(F.softplus(alpha + self.dt_bias) * self.a)  # padded steps: g = 0, β = 0
        b = padded(torch.sigmoid(beta))
        # Runs long enough for chunks go apart from the rest (decode, drafts, short chunks): one
        # long prefill batched with decoding slots still takes the chunked form.
        long = [r for r, m in enumerate(lengths) if m > long_run]
        short = [r for r, m in enumerate(lengths) if m <= long_run]
        if long and short:
            out = torch.empty(R, L, Hv, dv, device=dev)
            for rows in (long, short):
                steps = max(lengths[r] for r in rows)
                idx = torch.tensor(rows, device=dev)
                part = (x[idx, :steps] for x in (q, k, v, g, b))
                out[idx, :steps] = self._delta_rule(*part, slots[idx], [lengths[r] for r in rows])
        else:
            out = self._delta_rule(q, k, v, g, b, slots, lengths)

        return self._output(out[valid], z, x.dtype)  # [T, Hv, dv], back in batch order

    def _prefill(self, x: torch.Tensor, batch: ForwardBatch, L: int, precision: str) -> torch.Tensor:
        """`__call__` on the kernels for runs of up to L tokens each: the conv, SiLU, L2 norms and gates
        in one Triton kernel (`kernels/triton_gdn_conv.py`), then the chunked rule's
        (`kernels/triton_delta_rule.py`), whose last kernel also applies the output side (scale, gated
        RMSNorm) to each head; the same arithmetic, states and checkpoints as the torch forms, to
        float32 rounding (`precision`: the rule's products). Host values: L alone (a PACKED batch's
        graph replays it for any runs within it)."""
        from ..kernels.triton_delta_rule import chunk_gated_delta_rule
        from ..kernels.triton_gdn_conv import gdn_conv_gates

        s = self.shape
        C, Hv, dv = s.conv_channels, s.n_v_heads, s.head_v_dim
        proj = self.w_in(x)  # the kernel reads it in float32, as `.float()` would give it
        runs = batch.run_tensors
        n, starts, slots = runs.lengths, runs.starts, runs.slots
        heads = (s.n_k_heads, s.head_k_dim, Hv, dv)
        state = self.conv_state[slots]
        q, k, v, g, b = gdn_conv_gates(
            proj, state, self.conv, self.dt_bias, self.a, starts, n, L, *heads, self.cfg.rms_eps
        )
        # [R, depth]: where each run's checkpoints 1..depth go.
        ckpt_rows = self._ckpt_rows(slots[:, None], torch.arange(1, self.depth + 1, device=slots.device))
        self._keep_windows(proj[:, :C], state, runs, ckpt_rows)
        # The rule, and the output side (scale, gated RMSNorm) as its kernel writes each head's rows.
        z = proj[:, C : C + Hv * dv]
        out, state, ckpt = chunk_gated_delta_rule(
            *(q, k, v, g, b, self.ssm_state[slots], n, self.depth, precision),
            *(z, self.norm, starts, s.head_k_dim**-0.5, self.cfg.rms_eps),
        )
        self.ssm_state[slots] = state
        self.ssm_rows[ckpt_rows] = ckpt
        return self.w_out(out).float()

    def _keep_windows(self, mixed: torch.Tensor, state: torch.Tensor, runs: RunTensors, ckpt_rows) -> None:
        """The new conv state of each run's slot and its checkpoints (into `ckpt_rows`): the last K - 1
        conv inputs j = 0..depth tokens before the run's end, from the batch's rows `mixed` [T, C] or,
        where the window reaches before the run, from the incoming state [R, C, K - 1]."""
        K, C = self.shape.conv_kernel, self.shape.conv_channels
        steps = runs.window_steps(K, self.depth)  # [R, depth + 1, K - 1]
        from_run = mixed[(runs.starts[:, None, None] + steps).clamp(0, mixed.shape[0] - 1)].float()
        cols = (steps + K - 1).clamp(0, K - 2).flatten(1)[..., None].expand(-1, -1, C)
        from_state = state.transpose(1, 2).gather(1, cols).view_as(from_run)
        windows = torch.where(steps[..., None] >= 0, from_run, from_state).transpose(-1, -2)  # [R, depth+1, C, K-1]
        self.conv_state[runs.slots] = windows[:, 0]
        self.conv_rows[ckpt_rows] = windows[:, 1:]

    def step(self, x: torch.Tensor, slots: torch.Tensor, per_slot: int = 1) -> torch.Tensor:
        """`per_slot` tokens for each slot (decode: 1; a speculative verify: k + 1), rows slot-major:
        x [B * per_slot, n_embd] -> same shape float32, with no host values (CUDA-graph capturable;
        rows of a graph's padding slot may repeat). The same arithmetic as `__call__` on runs of
        `per_slot` tokens, checkpoints included (before token t of the run: j = per_slot - t)."""
        s = self.shape
        C, Hv, dv, K = s.conv_channels, s.n_v_heads, s.head_v_dim, s.conv_kernel
        B, m = x.shape[0] // per_slot, per_slot
        if _triton(x):  # the whole recurrent part in two kernels, state read and written once
            from ..kernels.triton_gdn_step import gated_delta_step

            proj = self.w_in(x)  # the kernels read it in float32, as `.float()` would give it
            o = gated_delta_step(
                *(proj, slots, self.conv_rows, self.ssm_rows, self.conv, self.dt_bias, self.a, m),
                *(self.n_slots, self.rows, self.depth, s.n_k_heads, self.cfg.rms_eps),
            )
            return self._output(o, proj[:, C : C + Hv * dv].float(), x.dtype)
        slots = slots[::m]
        mixed, z, beta, alpha = self.w_in(x).float().split([C, Hv * dv, Hv, Hv], dim=-1)
        mixed, beta, alpha = mixed.view(B, m, C), beta.view(B, m, Hv), alpha.view(B, m, Hv)
        window, convs = self.conv_state[slots], []  # [B, C, K - 1]
        for t in range(m):
            conv_in = torch.cat([window, mixed[:, t, :, None]], dim=2)  # [B, C, K]
            convs.append(F.silu(sum(conv_in[:, :, i] * self.conv[:, i] for i in range(K))))
            if m - 1 - t < self.depth:  # the state before a whole run is never restored beyond depth
                self.conv_rows[self._ckpt_rows(slots, m - t)] = window
            window = conv_in[:, :, 1:]
        self.conv_state[slots] = window
        conv = torch.stack(convs, 1)  # [B, m, C]
        nk = s.n_k_heads * s.head_k_dim
        q = _l2norm(conv[..., :nk].unflatten(-1, (s.n_k_heads, s.head_k_dim)), self.cfg.rms_eps)
        k = _l2norm(conv[..., nk : 2 * nk].unflatten(-1, (s.n_k_heads, s.head_k_dim)), self.cfg.rms_eps)
        v = conv[..., 2 * nk :].unflatten(-1, (Hv, dv))
        repeat = Hv // s.n_k_heads
        q, k = q.repeat(1, 1, repeat, 1), k.repeat(1, 1, repeat, 1)
        g = F.softplus(alpha + self.dt_bias) * self.a
        b = torch.sigmoid(beta)
        state, outs = self.ssm_state[slots], []
        for t in range(m):
            if m - 1 - t < self.depth:
                self.ssm_rows[self._ckpt_rows(slots, m - t)] = state
            state = state * torch.exp(g[:, t, :, None, None])
            delta = (v[:, t] - (k[:, t, :, None, :] @ state).squeeze(-2)) * b[:, t, :, None]
            state = state + k[:, t, :, :, None] * delta[:, :, None, :]
            outs.append((q[:, t, :, None, :] @ state).squeeze(-2))
        self.ssm_state[slots] = state
        return self._output(torch.stack(outs, 1).flatten(0, 1), z, x.dtype)

    def _output(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Sᵀq per token [T, Hv, dv] -> the layer's output: scaled, gated RMSNorm, ssm_out."""
        s = self.shape
        o = o / s.head_k_dim**0.5
        o = F.rms_norm(o, (s.head_v_dim,), self.norm, self.cfg.rms_eps) * F.silu(z.view(-1, s.n_v_heads, s.head_v_dim))
        return self.w_out(o.flatten(1).to(dtype)).float()

    def _conv(self, mixed, slots, n, keep) -> torch.Tensor:
        """Causal depthwise conv + SiLU over [state | run] per run: mixed [R, L, C] -> [R, L, C];
        keeps the new conv states (the last kernel-1 inputs) and the checkpoints."""
        K, C, L, dev = self.shape.conv_kernel, self.shape.conv_channels, mixed.shape[1], mixed.device
        conv_in = torch.cat([self.conv_state[slots], mixed.transpose(1, 2)], dim=2)  # [R, C, K-1+L]
        # A few taps: K multiply-adds beat conv1d's grouped kernel at decode on CPU.
        conv = sum(conv_in[:, :, i : i + L] * self.conv[:, i, None] for i in range(K))
        kr, kj = (torch.tensor(x, device=dev) for x in zip(*keep))
        cols = (n[kr] - kj)[:, None] + torch.arange(K - 1, device=dev)[None, :]
        states = conv_in[kr].gather(2, cols[:, None, :].expand(-1, C, -1))
        back = kj > 0
        self.conv_ckpt[slots[kr[back]], kj[back] - 1] = states[back]
        self.conv_state[slots] = states[kj == 0]
        return F.silu(conv).transpose(1, 2)

    def _delta_rule(self, q, k, v, g, b, slots, lengths) -> torch.Tensor:
        """Sᵀq per step [R, L, Hv, dv] (unscaled), from each slot's state (q, k [R, L, n_k_heads, dk]);
        keeps the new states and the checkpoints.
        Chunked up to where the shortest run's checkpoints begin (they need per-token states), token
        by token after that."""
        R, L, Hv, dv = v.shape
        dev = v.device
        repeat = Hv // k.shape[2]  # V head h reads Q/K head h % n_k_heads (ggml's repeat tiles)
        q, k = q.repeat(1, 1, repeat, 1), k.repeat(1, 1, repeat, 1)
        # The state after step t is checkpoint j = length - 1 - t of its run; the incoming one is j = length.
        saves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        keep = [(r, j) for r, j in _checkpoints(lengths, self.depth) if j]  # j = 0 is the final state itself
        for t in {lengths[r] - 1 - j for r, j in keep}:
            rows, js = zip(*[(r, j) for r, j in keep if lengths[r] - 1 - j == t])
            saves[t] = torch.tensor(rows, device=dev), torch.tensor(js, device=dev)
        state = self.ssm_state[slots]  # [R, Hv, dk, dv]
        out = torch.empty(R, L, Hv, dv, device=dev)

        def save(t: int) -> None:
            if t in saves:
                rows, js = saves[t]
                self.ssm_ckpt[slots[rows], js - 1] = state[rows]

        save(-1)
        n_chunked = CHUNK * max(0, (min(lengths) - ROLLBACK - 1) // CHUNK)
        if n_chunked:
            out[:, :n_chunked], state = _chunked(*(x[:, :n_chunked] for x in (q, k, v, g, b)), state)
        for t in range(n_chunked, L):
            state = state * torch.exp(g[:, t, :, None, None])
            kv = (k[:, t, :, None, :] @ state).squeeze(-2)  # Sᵀk  [R, Hv, dv]
            delta = (v[:, t] - kv) * b[:, t, :, None]
            state = state + k[:, t, :, :, None] * delta[:, :, None, :]
            out[:, t] = (q[:, t, :, None, :] @ state).squeeze(-2)
            save(t)
        self.ssm_state[slots] = state
        return out


def _triton(t: torch.Tensor) -> bool:
    """Whether a batch's runs and steps take the Triton kernels (`TRITON_PREFILL`)."""
    return t.is_cuda if TRITON_PREFILL is None else TRITON_PREFILL


def _precision(dtype: torch.dtype) -> str:
    """The Triton kernels' products: float32's accuracy for a float32 model (three TF32 products each:
    as "ieee" to 1e-7, several times faster); TF32 for a 16-bit one (its inputs come from 16-bit products)."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _checkpoints(lengths: list[int], depth: int) -> list[tuple[int, int]]:
    """The checkpoints a batch keeps: (run r, j tokens before its end) for j <= min(length, depth);
    j = 0 is the new state, j = length the incoming one."""
    return [(r, j) for r, m in enumerate(lengths) for j in range(min(m, depth) + 1)]


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dim (llama.cpp's build_gdn_l2_norm: rms_norm with eps/n)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _chunked(q, k, v, g, b, state):
    """The same recurrence over L (a multiple of CHUNK) steps, a chunk at a time: q, k [R, L, H, dk],
    v [R, L, H, dv], g, b [R, L, H], state [R, H, dk, dv] -> (Sᵀq [R, L, H, dv], final state).

    Within a chunk the delta rule's sequential updates form a unit lower-triangular system (the WY
    form: T = (I + tril(diag(β) K Kᵀ ⊙ decay, -1))⁻¹), so one chunk costs a few matrix products and
    one triangular solve; the state carries from chunk to chunk. As llama.cpp's
    build_delta_net_chunking and transformers' torch_chunk_gated_delta_rule."""
    R, L, H, _ = k.shape
    n = L // CHUNK

    def chunks(x):  # [R, L, H, ...] -> [R, H, n, CHUNK, ...]
        return x.transpose(1, 2).reshape(R, H, n, CHUNK, *x.shape[3:])

    q, k, v, g, b = map(chunks, (q, k, v, g, b))
    gc = g.cumsum(-1)  # log decay from the chunk's start, through each step
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=k.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # step j -> i
    kb = k * b[..., None]
    eye = torch.eye(CHUNK, device=k.device)
    lower = eye + ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    T = torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False, unitriangular=True)
    values = T @ (v * b[..., None])  # each step's correction, before the incoming state's part
    k_decayed = T @ (kb * gc.exp()[..., None])  # what the incoming state predicts of them
    qk = (q @ k.transpose(-1, -2)) * decay
    out = torch.empty(*values.shape, device=k.device)
    for c in range(n):
        v_new = values[:, :, c] - k_decayed[:, :, c] @ state
        out[:, :, c] = (q[:, :, c] * gc[:, :, c, :, None].exp()) @ state + qk[:, :, c] @ v_new
        last = gc[:, :, c, -1]
        k_last = k[:, :, c] * (last[..., None] - gc[:, :, c]).exp()[..., None]
        state = state * last.exp()[..., None, None] + k_last.transpose(-1, -2) @ v_new
    return out.reshape(R, H, L, -1).transpose(1, 2), state
