"""Reranking (`--reranking`, /rerank): real `hydra-engine serve` processes over raw HTTP on a synthetic
Qwen3 reranker (engine/synth's `reranker=True`: what llama.cpp's converter writes). The oracle is a
direct float32 forward of the same file through llama.cpp's formula: the last token's final-norm
hidden state, `cls.output.weight` (read with the `gguf` package), softmax, the first class."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
from rpc_workers import head, running

from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.model.rank import NotAReranker, RankHead, rerank_prompt
from hydra_console.engine.quant import dequantize
from hydra_console.engine.synth import QWEN3_RERANK_TEMPLATE
from hydra_console.engine.text.tokenizer import Tokenizer

REFERENCE = Path(__file__).resolve().parent / "data" / "reference" / "qwen3-reranker" / "scores.json"
QUERY = "the quick fox"
DOCS = ["a lazy dog", "the quick brown fox jumps", "hello world", "water fire earth light"]
CTX = 512


def post(url: str, body, path: str = "/rerank") -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


@pytest.fixture(scope="module")
def reranker(tiny_model):
    return tiny_model("qwen3", reranker=True)


@pytest.fixture(scope="module")
def rank_server(reranker, tmp_path_factory):
    """`--embedding` alone: the pooling (rank) is the file's own."""
    w = head(reranker, tmp_path_factory.mktemp("rerank"), (), "--dtype", "float32", "--embedding", ctx=CTX)
    with running(w):
        yield w.url


def reference_scores(path, query: str, docs: list[str]) -> tuple[list[float], list[int]]:
    """(score, prompt length) per document: the template filled, a forward from position 0, the
    classification head as llama.cpp's graph applies it."""
    g = GGUFFile(path)
    tok = Tokenizer.from_gguf(g)
    stage = build_stage(g, device="cpu", dtype="float32", n_slots=1, n_ctx=CTX)
    (cls,) = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == "cls.output.weight"]
    weight = torch.from_numpy(np.array(cls.data, dtype=np.float32))  # [2, n_embd]: "yes", "no"
    scores, lengths = [], []
    for doc in docs:
        text = QWEN3_RERANK_TEMPLATE.replace("{query}", query).replace("{document}", doc)
        ids = tok.encode(text, add_special=False, parse_special=True)
        n = len(ids)
        h = stage.run_layers(stage.embed(torch.tensor(ids)), torch.zeros(n, dtype=torch.long), torch.arange(n))
        last = stage.final_norm(h)[-1]
        scores.append(float(torch.softmax(weight @ last, dim=0)[0]))
        lengths.append(n)
    return scores, lengths


# ---- the file and the prompt --------------------------------------------------------------------


@pytest.mark.unit
def test_synthetic_reranker_carries_what_llama_cpp_reads(reranker, tiny_model):
    g = GGUFFile(reranker)
    md = g.metadata
    assert md["qwen3.pooling_type"] == int(gguf.PoolingType.RANK)
    assert list(md["qwen3.classifier.output_labels"]) == ["yes", "no"]  # n_cls_out = 2
    assert md["tokenizer.chat_template.rerank"] == QWEN3_RERANK_TEMPLATE
    assert g.tensors["cls.output.weight"].shape == (2, md["qwen3.embedding_length"])
    plain = GGUFFile(tiny_model("qwen3"))  # the same trunk: the head is written last
    for name in ("token_embd.weight", "blk.1.ffn_down.weight", "output.weight"):
        assert bytes(g.raw(name)) == bytes(plain.raw(name))


@pytest.mark.unit
def test_prompt_is_the_template_or_the_separated_pair(reranker, tiny_model):
    g = GGUFFile(reranker)
    tok = Tokenizer.from_gguf(g)
    ids = rerank_prompt(tok, g.metadata, "q {x}", "d")
    im_start = tok.find_token("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3  # special tokens parsed, no BOS added
    assert tok.decode(ids) == QWEN3_RERANK_TEMPLATE.replace("{query}", "q {x}").replace("{document}", "d")
    # No template: [BOS] query [EOS] [SEP] document [EOS], each where the vocabulary adds it
    spm = dict(GGUFFile(tiny_model("llama")).metadata)
    tok = Tokenizer.from_metadata({**spm, "tokenizer.ggml.add_eos_token": True})
    q, d = (tok.encode(t, add_special=False, parse_special=False) for t in ("hello <eos>", "world"))
    assert rerank_prompt(tok, spm, "hello <eos>", "world") == [tok.bos_id, *q, tok.eos_id, *d, tok.eos_id]
    sep = {**spm, "tokenizer.ggml.seperator_token_id": 3, "tokenizer.ggml.add_sep_token": True}
    assert rerank_prompt(tok, sep, "hello <eos>", "world") == [tok.bos_id, *q, tok.eos_id, 3, *d, tok.eos_id]


@pytest.mark.unit
def test_only_a_classification_head_makes_a_reranker(reranker, tiny_model, tmp_path):
    head_ = RankHead.from_gguf(GGUFFile(reranker))
    assert head_.weight.shape == (2, 64) and head_.softmax
    with pytest.raises(NotAReranker, match="cls.output.weight"):
        RankHead.from_gguf(GGUFFile(tiny_model("qwen3")))
    with pytest.raises(NotAReranker, match="gemma3"):
        RankHead.from_gguf(GGUFFile(tiny_model("gemma3")))
    # a quantized head is dequantized as its type says
    g = GGUFFile(tiny_model("qwen3", reranker=True, qtype="Q8_0"))
    t = g.tensors["cls.output.weight"]
    assert t.ggml_type.name == "Q8_0"
    expected = gguf.quants.dequantize(np.array(g.raw(t.name)), t.ggml_type).reshape(t.shape)
    assert torch.equal(RankHead.from_gguf(g).weight, torch.from_numpy(expected))
    assert torch.equal(RankHead.from_gguf(g).weight, dequantize(np.array(g.raw(t.name)), t.ggml_type, t.shape))


# ---- the server ---------------------------------------------------------------------------------


def test_scores_equal_a_direct_forward_through_the_head(rank_server, reranker):
    r = post(rank_server, {"query": QUERY, "documents": DOCS, "model": "m"})
    assert r.status_code == 200, r.text
    body = r.json()
    expected, lengths = reference_scores(reranker, QUERY, DOCS)
    assert body["model"] == "m" and body["object"] == "list"
    assert body["usage"] == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}
    results = body["results"]
    assert sorted(d["index"] for d in results) == list(range(len(DOCS)))
    got = {d["index"]: d["relevance_score"] for d in results}
    for i, score in enumerate(expected):
        assert got[i] == pytest.approx(score, abs=2e-6), i
    assert [d["index"] for d in results] == sorted(range(len(DOCS)), key=lambda i: -expected[i])  # best first
    assert len(set(got.values())) == len(DOCS)  # distinct scores: the order is the scores'


def test_prompts_and_scores_are_llama_cpps(rank_server, reranker):
    """llama.cpp's own scores and prompt tokens on this file (tests/data/reference/qwen3-reranker)."""
    ref = json.loads(REFERENCE.read_text())
    assert hashlib.sha256(reranker.read_bytes()).hexdigest() == ref["sha256"], "the synthetic reranker changed"
    g = GGUFFile(reranker)
    tok = Tokenizer.from_gguf(g)
    worst = 0.0
    for group in ref["groups"]:
        query, docs = group["query"], group["documents"]
        assert [rerank_prompt(tok, g.metadata, query, d) for d in docs] == group["ids"]
        body = post(rank_server, {"query": query, "documents": docs}).json()
        assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in group["ids"])
        got = {d["index"]: d["relevance_score"] for d in body["results"]}
        worst = max(worst, *(abs(got[i] - s) for i, s in enumerate(group["scores"])))
    print(f"worst |score - llama.cpp's|: {worst:.2e}")
    assert worst < 1e-6


def test_shapes_top_n_and_returned_texts(rank_server):
    full = post(rank_server, {"query": QUERY, "documents": DOCS}).json()["results"]
    order = [d["index"] for d in full]
    for top_n, n in ((None, 4), (2, 2), (4, 4), (99, 4), (0, 0)):
        body = {"query": QUERY, "documents": DOCS} | ({} if top_n is None else {"top_n": top_n})
        assert [d["index"] for d in post(rank_server, body).json()["results"]] == order[:n]
        tei = post(rank_server, {"query": QUERY, "texts": DOCS} | ({} if top_n is None else {"top_n": top_n}))
        assert [d["index"] for d in tei.json()] == order[:n]  # TEI: a bare list, "score"
    tei = post(rank_server, {"query": QUERY, "texts": DOCS, "return_text": True}).json()
    assert [set(d) for d in tei] == [{"index", "score", "text"}] * 4
    assert [d["text"] for d in tei] == [DOCS[i] for i in order]
    assert [d["score"] for d in tei] == [d["relevance_score"] for d in full]
    plain = post(rank_server, {"query": QUERY, "documents": DOCS, "return_text": True}).json()["results"]
    assert [set(d) for d in plain] == [{"index", "relevance_score"}] * 4  # Jina's shape ignores it, as upstream
    objects = [{"text": t} for t in DOCS]
    docs = post(rank_server, {"query": QUERY, "documents": objects, "return_documents": True}).json()["results"]
    assert [d["document"] for d in docs] == [{"text": DOCS[i]} for i in order]
    for path in ("/reranking", "/v1/rerank", "/v1/reranking"):
        r = post(rank_server, {"query": QUERY, "documents": DOCS}, path)
        assert r.status_code == 200 and r.json()["results"] == full, path


@pytest.mark.parametrize(
    "body, param",
    [
        ({"documents": DOCS}, "query"),
        ({"query": 1, "documents": DOCS}, "query"),
        ({"query": QUERY, "documents": []}, "documents"),
        ({"query": QUERY, "documents": None}, "documents"),
        ({"query": QUERY, "documents": 123}, "documents"),
        ({"query": QUERY, "documents": [1, 2, 3]}, "documents"),
        ({"query": QUERY, "documents": [{"txt": "a"}]}, "documents"),
        ({"query": QUERY}, "documents"),
        ({"query": QUERY, "texts": "a"}, "texts"),
        ({"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ({"query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n"),
        ({"query": QUERY, "documents": DOCS, "top_n": True}, "top_n"),
        ({"query": QUERY, "documents": DOCS, "return_documents": "yes"}, "return_documents"),
        ({"query": QUERY, "documents": ["word " * 400]}, "documents"),
        ([QUERY], None),
    ],
)
def test_bad_requests_are_400_naming_the_field(rank_server, body, param):
    r = post(rank_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_a_model_that_is_not_a_reranker_says_so(tiny_model, tmp_path):
    """`--reranking` on a model without a classification head: it serves, /rerank answers 501 saying
    why, embeddings too (pooling rank pools nothing); generation is untouched."""
    with running(head(tiny_model("llama"), tmp_path, (), "--reranking", ctx=64)) as w:
        r = post(w.url, {"query": QUERY, "documents": DOCS}, "/v1/rerank")
        assert r.status_code == 501, r.text
        err = r.json()["error"]
        assert err["type"] == "not_supported_error" and "not a reranker" in err["message"]
        r = post(w.url, {"input": "hi"}, "/v1/embeddings")
        assert r.status_code == 501 and "/rerank" in r.json()["error"]["message"]
        r = post(w.url, {"prompt": "hi", "max_tokens": 2}, "/v1/completions")
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
