"""The transformer, one concept per module; this package re-exports its public names."""

from .stage import ARCHITECTURES, RESCORE_TOP, DecodeGraphs, Linear, ModelConfig, Stage

__all__ = ["ARCHITECTURES", "RESCORE_TOP", "DecodeGraphs", "Linear", "ModelConfig", "Stage"]
