"""The per-stage memory estimate the split editor shows before applying a split.

Each stage is counted as its worker will hold it (contracts/footprint.py, the engine's own
accounting): weights in the worker's form (GGUF-quantized on a GPU, int8 terms and a bfloat16
prefill copy on a CPU at 16-bit compute, else the compute dtype), K and V in the worker's
`--cache-type-k/-v` for every slot at full context. The split advisor's PROBE answers with each
running worker's own per-layer footprint from the same contract.

The split arithmetic itself (counts, ranges, boundaries) is the shared contract in
`contracts.split`, so the editor previews exactly what the engine applies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..contracts.errors import UserError
from ..contracts.footprint import ROLLBACK, ModelTensors, StageBytes, model_tensors, rollback_depth
from ..contracts.gguf_header import GGUFHeader
from ..contracts.split import ranges, split_arg


@dataclass(frozen=True)
class WorkerMemory:
    """How one worker holds its stage: its device kind, the compute dtype (the head's `--dtype`,
    which LOAD_STAGE gives every peer), `--gpu-weights` and its own `--cache-type-k/-v`."""

    device: str = "cpu"  # "cpu" | "cuda"
    dtype: str = "auto"
    gpu_weights: str = "quantized"
    kv_types: tuple[str, str] = ("auto", "auto")
    # The running worker's own CUDA context and kernels (its /status `process`), which differ by GPU
    # and driver; None: the footprint's default, measured on an H200.
    runtime_bytes: int | None = None
    # The stage holds the MTP block (`--spec-type mtp`): the one with the output head.
    mtp: bool = False
    depth: int = ROLLBACK  # recurrent-state checkpoints: the head's longest draft (1 without speculation)
    output: bool | None = None  # the stage holds the output norm and head; None: the head's stage does


def output_stage_of(profile) -> str:
    """Where the output head (and the MTP block) lives: "head" or "last", the head's own
    --output-stage over the profile's `output_stage`."""
    return flag(profile.head.args, ("--output-stage",), profile.output_stage)


def worker_memory(profile, spec, status, *, output: bool, gpu: bool) -> WorkerMemory:
    """How the worker of `spec` (a config.WorkerSpec; `status` its last /status or None) will hold
    its stage: on a GPU or not (cards.on_gpu), the head's --dtype (LOAD_STAGE gives it to every
    peer), its --gpu-weights, its --cache-type-k/-v (its own args over the profile's), the output
    head where `output` (with the MTP block under the head's `--spec-type mtp`), the head's draft
    depth, and its CUDA runtime as its /status measures it, where it runs."""
    args, spec_type = spec.args, profile.speculative
    kv = (
        flag(args, ("--cache-type-k", "-ctk"), profile.cache_type_k),
        flag(args, ("--cache-type-v", "-ctv"), profile.cache_type_v),
    )
    runtime = status.process.runtime_bytes if status is not None and status.process is not None else None
    spec_kind = flag(profile.head.args, ("--spec-type",), spec_type.type)
    draft = int(flag(profile.head.args, ("--draft-max",), str(spec_type.draft_max)))
    return WorkerMemory(
        "cuda" if gpu else "cpu",
        flag(profile.head.args, ("--dtype",), "auto"),
        flag(args, ("--gpu-weights",), "quantized"),
        kv,
        runtime,
        mtp=output and spec_kind == "mtp",
        depth=rollback_depth(1 + (draft if spec_kind != "off" else 0)),
        output=output,
    )


def flag(args: list[str], names: tuple[str, ...], default: str) -> str:
    """The value of the last of `names` in `args` (argparse's: the last one wins), else `default`."""
    value = default
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(tuple(n + "=" for n in names)):
            value = a.split("=", 1)[1]
    return value


@dataclass(frozen=True)
class ModelShape:
    """A model's tensor table as the footprint needs it, read once (no tensor data is read)."""

    tensors: ModelTensors

    @property
    def n_layers(self) -> int:
        return self.tensors.n_layers

    @classmethod
    def from_gguf(cls, path: str | Path) -> "ModelShape":
        g = GGUFHeader(path)
        tensors = model_tensors(g.metadata, g.tensors)
        if tensors.n_layers < 1:
            raise UserError(f"{path}: no {g.architecture}.block_count in the GGUF metadata")
        return cls(tensors)

    def estimate(self, counts: list[int], n_ctx: int, n_slots: int, workers: list[WorkerMemory]) -> list[StageBytes]:
        """Per stage (head first): what worker i holds for layers counts[i] with `n_slots` x `n_ctx`."""
        if sum(counts) != self.n_layers:
            raise UserError(f"split {split_arg(counts)} covers {sum(counts)} layers, the model has {self.n_layers}")
        out = []
        for i, ((a, b), w) in enumerate(zip(ranges(counts), workers)):
            est = self.tensors.stage(
                a,
                b,
                head=i == 0,
                output=w.output,
                device=w.device,
                dtype=w.dtype,
                n_slots=n_slots,
                n_ctx=n_ctx,
                kv_types=w.kv_types,
                gpu_weights=w.gpu_weights,
                mtp=w.mtp,
                depth=w.depth,
            )
            measured = w.runtime_bytes is not None and est.runtime_bytes
            out.append(replace(est, runtime_bytes=w.runtime_bytes) if measured else est)
        return out
