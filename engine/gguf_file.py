"""A GGUF model file as the engine reads it: the header (contracts/gguf_header.py, shared with the
console) and zero-copy views of the tensors' data."""

from __future__ import annotations

import numpy as np

from ..contracts.gguf_header import DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFError, GGUFHeader, TensorInfo

__all__ = ["DEFAULT_ALIGNMENT", "GGUF_MAGIC", "GGUFError", "GGUFFile", "TensorInfo"]


class GGUFFile(GGUFHeader):
    """An open GGUF file: `metadata` (key -> value), `tensors` (name -> TensorInfo), zero-copy data views."""

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of its file's mmap (no copy), whichever part
        of a split model holds it."""
        t = self.tensors[name]
        return np.frombuffer(self.parts[t.part].buffer, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def __repr__(self) -> str:
        parts = f", parts={len(self.parts)}" if len(self.parts) > 1 else ""
        return f"GGUFFile({str(self.path)!r}, arch={self.architecture!r}, tensors={len(self.tensors)}{parts})"
