"""Speculative decoding: drafters (n-gram, a draft model, qwen35's MTP block), the exact accept
step, stats, and the `Speculator` the runtime calls. One drafter per module; `accept.py` says how
a draft is checked."""

from ..config import SpecConfig
from .accept import accept_greedy, accept_sampled
from .draft_model import DraftModelDrafter, check_same_vocab
from .drafter import Draft, Drafter, DraftRequest
from .mtp import MtpDrafter, check_mtp
from .ngram import NgramDrafter
from .speculator import Speculator, build_speculator, check_speculative
from .stats import SpecStats

__all__ = [
    "Draft",
    "DraftRequest",
    "Drafter",
    "DraftModelDrafter",
    "MtpDrafter",
    "NgramDrafter",
    "SpecConfig",
    "SpecStats",
    "Speculator",
    "accept_greedy",
    "accept_sampled",
    "build_speculator",
    "check_mtp",
    "check_same_vocab",
    "check_speculative",
]
