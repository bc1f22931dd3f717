"""Reranking (llama-server's `--reranking`, pooling `rank`): a query/document pair's relevance score
from a reranker's classification head, as llama.cpp computes it.

- The pair's prompt (`rerank_prompt`, llama.cpp's `format_prompt_rerank`): the GGUF's
  `tokenizer.chat_template.rerank` with `{query}` and `{document}` replaced, tokenized without
  BOS/EOS and with special tokens parsed. Without that template: [BOS] query [EOS] [SEP] document
  [EOS], each marker only where the vocabulary adds it (`add_bos_token`, `add_eos_token`,
  `add_sep_token`; EOS falls back to SEP), the two texts tokenized plainly.
- The score (`RankHead.score`, llama-graph.cpp's `build_pooling` for LLAMA_POOLING_TYPE_RANK): the
  last token's final-norm hidden state h (a causal model's pooled row is its last position), the
  logits `cls.output.weight @ h` ([n_cls, n_embd]: a Qwen3 reranker's LM-head rows of "yes" and
  "no"), a softmax over them on qwen3, and the first one is the score: P(yes). No normalisation
  beyond that.
- Which models: the architectures whose rerankers llama.cpp's loaders build and we run, with the head
  their loader reads (`RANK_HEADS`): qwen3 (`cls.output.weight` alone: no bias, no `cls.weight`).
  Any other model is not a reranker here (`NotAReranker`: /rerank answers 501 saying why), where
  llama.cpp would answer the first component of the last hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:
    import torch

    from ..gguf_file import GGUFFile
    from ..text.tokenizer import Tokenizer

RERANK_TEMPLATE_KEY = "tokenizer.chat_template.rerank"
CLS_OUT = "cls.output.weight"
# architecture -> whether the class logits go through a softmax (llama-graph.cpp: qwen3 and qwen3vl)
RANK_HEADS = {"qwen3": True}


class NotAReranker(UserError):
    """The model has no classification head Hydra scores with."""


@dataclass(frozen=True)
class RankHead:
    weight: torch.Tensor  # [n_cls, n_embd] float32: cls.output.weight
    softmax: bool

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> RankHead:
        import torch

        from ..quant import dequantize

        arch = g.architecture
        if arch not in RANK_HEADS:
            raise NotAReranker(
                f"this model ({arch}) is not a reranker: Hydra scores with the classification head of "
                f"{', '.join(RANK_HEADS)} rerankers ({CLS_OUT})"
            )
        t = g.tensors.get(CLS_OUT)
        if t is None:
            raise NotAReranker(
                f"this model is not a reranker: it has no classification head ({CLS_OUT}); "
                "a reranker GGUF has pooling_type rank and that tensor"
            )
        n_embd = int(g.metadata[f"{arch}.embedding_length"])
        if len(t.shape) != 2 or t.shape[1] != n_embd:
            raise UserError(f"{g.path}: {CLS_OUT} has shape {list(t.shape)}, expected [n_cls, {n_embd}]")
        raw = torch.from_numpy(g.raw(CLS_OUT).copy())  # a few KB, off the read-only mmap
        return cls(dequantize(raw, t.ggml_type, t.shape), RANK_HEADS[arch])

    def score(self, hidden: torch.Tensor) -> float:
        """A pair's score from its prompt's final-norm hidden states [T, n_embd]."""
        import torch

        logits = self.weight @ hidden[-1].float()
        if self.softmax:
            logits = torch.softmax(logits, dim=0)
        return float(logits[0])


def rerank_prompt(tok: Tokenizer, metadata: dict, query: str, document: str) -> list[int]:
    """The token ids llama-server scores for one query/document pair."""
    template = metadata.get(RERANK_TEMPLATE_KEY)
    if template is not None:
        text = str(template).replace("{query}", query).replace("{document}", document)
        return tok.encode(text, add_special=False, parse_special=True)
    sep = metadata.get("tokenizer.ggml.seperator_token_id")  # gguf's spelling
    eos = tok.eos_id if tok.eos_id is not None else sep
    ids = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    ids += tok.encode(query, add_special=False, parse_special=False)
    if tok.add_eos and eos is not None:
        ids.append(eos)
    if metadata.get("tokenizer.ggml.add_sep_token") and sep is not None:
        ids.append(int(sep))
    ids += tok.encode(document, add_special=False, parse_special=False)
    if tok.add_eos and eos is not None:
        ids.append(eos)
    return ids
