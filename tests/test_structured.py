"""Structured output and logit bias below the API: the bitmask applied on the logits' device, grammar
errors naming their field, a constraint's draft masks and rollback, and the Engine on a real tiny
model: constrained greedy output follows the grammar and is the same with n-gram speculation."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.serving.runtime import Engine, Request
from hydra_console.engine.serving.sampling import Rows, distribution
from hydra_console.engine.serving.sampling_params import InvalidParam, Sampler, SamplingParams
from hydra_console.engine.spec import SpecConfig
from hydra_console.engine.text.structured import Grammars, apply_bitmask, compile_grammar
from hydra_console.engine.text.tokenizer import Tokenizer

N_SLOTS, N_CTX = 3, 256
GREEDY = SamplingParams(temperature=0.0)
YES_NO = 'root ::= ("yes" | "no")'
SCHEMA = {
    "type": "object",
    "properties": {
        "flag": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "word": {"type": "string", "maxLength": 6},
    },
    "required": ["flag", "count", "word"],
    "additionalProperties": False,
}


def _bits(allowed: torch.Tensor) -> torch.Tensor:
    """Pack a bool row set [B, V] into llguidance's int32 words (bit j of word w = token 32w + j)."""
    B, V = allowed.shape
    W = (V + 31) // 32
    padded = torch.zeros(B, W * 32, dtype=torch.int64)
    padded[:, :V] = allowed.long()
    words = (padded.view(B, W, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.unit
def test_apply_bitmask_bans_exactly_the_zero_bits():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    allowed = torch.rand(3, 70) < 0.3
    allowed[:, 31] = True  # the sign bit of a word
    out = apply_bitmask(logits, _bits(allowed))
    assert torch.equal(out[allowed], logits[allowed])
    assert torch.isneginf(out[~allowed]).all()
    # a model vocabulary wider than the mask (padded embeddings): the tail is banned
    wide = apply_bitmask(torch.randn(3, 100), _bits(allowed))
    assert torch.isneginf(wide[:, 96:]).all()


@pytest.mark.unit
def test_logit_bias_adds_and_bans_per_row():
    logits = torch.zeros(3, 8)
    params = [
        SamplingParams(logit_bias=((2, 5.0), (4, float("-inf")))),
        SamplingParams(),
        SamplingParams(logit_bias=((7, -1.5),)),
    ]
    p = distribution(logits, Rows.build([Sampler(x) for x in params], [[]] * 3, torch.device("cpu")))
    assert p[0, 4] == 0 and float(p[0, 2] / p[0, 0]) == pytest.approx(math.exp(5.0), rel=1e-5)
    assert torch.allclose(p[0, [0, 1, 3, 5, 6, 7]], p[0, 0].expand(6))
    assert torch.allclose(p[1], torch.full((8,), 1 / 8))  # no bias: untouched
    assert float(p[2, 7] / p[2, 0]) == pytest.approx(math.exp(-1.5), rel=1e-5)
    with pytest.raises(InvalidParam) as e:
        SamplingParams(logit_bias=((1, float("nan")),))
    assert e.value.param == "logit_bias"


@pytest.mark.unit
@pytest.mark.parametrize(
    "kind, source, field",
    [
        ("gbnf", 'root ::= ("yes" | ', "grammar"),
        ("gbnf", "root ::= missing", "grammar"),
        ("gbnf", "", "grammar"),
        ("json_schema", {"type": "nope"}, "json_schema"),
        ("json_schema", {"$ref": "#/none"}, "response_format"),
        ("json_schema", [1, 2], "json_schema"),
    ],
)
def test_bad_grammars_name_their_field(kind, source, field):
    with pytest.raises(InvalidParam) as e:
        compile_grammar(kind, source, field)
    assert e.value.param == field and field in str(e.value)


@pytest.fixture(scope="module")
def target(tiny_model):
    path = tiny_model("llama")
    return path, Tokenizer.from_gguf(GGUFFile(path))


@pytest.mark.unit
def test_draft_masks_follow_the_draft_and_roll_back(target):
    _, tok = target
    grammars = Grammars(tok)
    c = grammars.constraint(compile_grammar("gbnf", YES_NO, "grammar"), "grammar")
    yes = tok.encode("yes", add_special=False, space_prefix=False)
    before = grammars.bitmask([c], pinned=False)
    allowed = lambda row: {t for t in range(tok.vocab_size) if row[t // 32] >> (t % 32) & 1}  # noqa: E731
    assert yes[0] in allowed(before[0]) and tok.encode("maybe", add_special=False, space_prefix=False)[
        0
    ] not in allowed(before[0])
    refused = tok.encode("x", add_special=False, space_prefix=False)[0]
    draft = yes + [refused, yes[0]]
    masks = torch.empty((len(draft) + 1, grammars.words), dtype=torch.int32)
    c.draft_bitmask(draft, masks)
    for i, t in enumerate(yes):
        assert t in allowed(masks[i])  # each draft token is allowed after the ones before it
    assert refused not in allowed(masks[len(yes)])  # ... until the grammar is complete: only the end
    assert allowed(masks[len(yes)]) <= tok.eog_ids
    assert (masks[len(yes) + 1 :] == -1).all()  # never read: the refused token stops the accept step
    assert torch.equal(grammars.bitmask([c], pinned=False), before)  # rolled back
    for t in yes:
        c.advance(t)
    assert c.finished


def _run(eng: Engine, prompt: list[int], constraint=None, spec=None, params=GREEDY, n=60):
    ids, final = [], None
    req = Request(prompt, params, max_tokens=n, spec=spec, constraint=constraint)
    for ev in eng.generate(req, timeout=120):
        ids += [t.id for t in ev.tokens]
        final = ev
    return ids, final


def test_engine_constrained_output_with_and_without_speculation(target):
    path, tok = target
    pipeline = Pipeline(build_stage(GGUFFile(path), device="cpu", dtype="float32", n_slots=N_SLOTS, n_ctx=N_CTX))
    eng = Engine(pipeline, tok, N_SLOTS, N_CTX).start()
    try:
        grammar = compile_grammar("json_schema", SCHEMA, "json_schema")
        # the prompt holds JSON for the n-gram drafter to propose from: some drafts fit the schema, some not
        prompt = tok.encode('{"flag": true, "count": 12, "word": "cat"} {"flag":false,"count":3,"word":"dog"} {"flag":')
        plain_ids, plain = _run(eng, prompt, eng.grammars.constraint(grammar, "json_schema"))
        spec_ids, spec = _run(
            eng, prompt, eng.grammars.constraint(grammar, "json_schema"), SpecConfig("ngram", n_max=4)
        )
        assert spec_ids == plain_ids and plain.finish_reason == spec.finish_reason == "stop"
        assert spec.timings["draft_n"] > 0
        value = json.loads(tok.decode(plain_ids))
        assert set(value) == {"flag", "count", "word"} and isinstance(value["flag"], bool)
        assert isinstance(value["count"], int) and 0 <= value["count"] <= 99 and len(value["word"]) <= 6

        # a grammar request batched with unconstrained ones leaves their output alone
        free_alone, _ = _run(eng, prompt, n=20)
        results = {}
        jobs = {
            "yes_no": lambda: _run(
                eng, prompt, eng.grammars.constraint(compile_grammar("gbnf", YES_NO, "grammar"), "grammar")
            ),
            "free": lambda: _run(eng, prompt, n=20),
        }
        threads = [threading.Thread(target=lambda k=k, f=f: results.__setitem__(k, f())) for k, f in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results["free"][0] == free_alone
        assert tok.decode(results["yes_no"][0]) in ("yes", "no") and results["yes_no"][1].finish_reason == "stop"
    finally:
        eng.stop()
