"""The transformer: `config` (shape and per-architecture deltas), `weights` (GGUF tensors as
dense or int8 products, the prepared-weight cache), `rope`, `attention`, `deltanet` (Gated
DeltaNet layers and their recurrent state), `layer` (one block's weights and arithmetic),
`forward_batch` (what one forward needs: slots, positions, runs, mode), `recurrent_progress` (how
far each slot's recurrent state has run), `stage` (a layer range with its KV cache, built by
`build_stage`), `nextn` (Qwen3.5's MTP block, on the head), `rank` (a reranker's classification
head and its query/document prompt, on the head) and `graphs` (CUDA graphs of the decode step)."""

from .config import ARCHITECTURES, ModelConfig
from .deltanet import ROLLBACK
from .forward_batch import ForwardBatch, Mode
from .graphs import DecodeGraphs, graph_run_lengths
from .nextn import NextN, nextn_prefix
from .stage import RESCORE_TOP, Stage, build_stage
from .weights import Linear, Weights

__all__ = [
    "ARCHITECTURES",
    "RESCORE_TOP",
    "ROLLBACK",
    "DecodeGraphs",
    "ForwardBatch",
    "Linear",
    "Mode",
    "ModelConfig",
    "NextN",
    "Stage",
    "Weights",
    "build_stage",
    "graph_run_lengths",
    "nextn_prefix",
]
