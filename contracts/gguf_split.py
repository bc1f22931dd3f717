"""Split GGUF models as llama.cpp's `llama-gguf-split` writes them: `NAME-00001-of-0000N.gguf`, ...

Every part is a valid GGUF; the first holds all the metadata, each holds its share of the tensors
and the keys `split.no` (0-based), `split.count` and `split.tensors.count` (after the model's keys
in the first part, in that order). A model is loaded from its first part (llama.cpp's
`llama_get_list_splits`: the others are found by name).
"""

from __future__ import annotations

import re
from pathlib import Path

from gguf.constants import Keys

SPLIT_NO = Keys.Split.LLM_KV_SPLIT_NO
SPLIT_COUNT = Keys.Split.LLM_KV_SPLIT_COUNT
SPLIT_TENSORS_COUNT = Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
SPLIT_KEYS = (SPLIT_NO, SPLIT_TENSORS_COUNT, SPLIT_COUNT)  # gguf-split's order

_PART_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def split_path(prefix: str | Path, no: int, count: int) -> Path:
    """Part `no` (0-based) of `count`: llama.cpp's `llama_split_path`."""
    return Path(f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf")


def split_prefix(path: str | Path, no: int, count: int) -> str | None:
    """The prefix of part `no` of `count` named `path`, or None when its name is not that part's
    (llama.cpp's `llama_split_prefix`)."""
    name = str(path)
    m = _PART_NAME.search(name)
    if m is None or (int(m[1]), int(m[2])) != (no + 1, count) or m.start() == 0:
        return None
    return name[: m.start()]
