"""Regenerate the Qwen3 reranker reference scores from upstream llama.cpp (see README.md in this folder).

usage: make_reference.py RERANKDUMP   (a build of rerankdump.c beside this file)
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra_console.engine.synth import write_synthetic

HERE = Path(__file__).resolve().parent
MODEL = dict(arch="qwen3", reranker=True)  # write_synthetic's defaults otherwise: what tests/test_rerank.py serves
# (query, documents): tests/test_rerank.py's, and llama.cpp's tools/server/tests/unit/test_rerank.py's
# (non-ASCII text: the byte-level BPE's bytes)
GROUPS = [
    ("the quick fox", ["a lazy dog", "the quick brown fox jumps", "hello world", "water fire earth light"]),
    (
        "Machine learning is",
        [
            "A machine is a physical system that uses power to apply forces and control movement to perform an "
            "action. The term is commonly applied to artificial devices, such as those employing engines or motors, "
            "but also to natural biological macromolecules, such as molecular machines.",
            "Learning is the process of acquiring new understanding, knowledge, behaviors, skills, values, "
            "attitudes, and preferences. The ability to learn is possessed by humans, non-human animals, and some "
            "machines; there is also evidence for some kind of learning in certain plants.",
            "Machine learning is a field of study in artificial intelligence concerned with the development and "
            "study of statistical algorithms that can learn from data and generalize to unseen data, and thus "
            "perform tasks without explicit instructions.",
            "Paris, capitale de la France, est une grande ville européenne et un centre mondial de l'art, de la "
            "mode, de la gastronomie et de la culture. Son paysage urbain du XIXe siècle est traversé par de larges "
            "boulevards et la Seine.",
        ],
    ),
]


def main(rerankdump: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        shape = {k: v for k, v in MODEL.items() if k != "arch"}
        path = write_synthetic(Path(tmp) / "reranker.gguf", MODEL["arch"], **shape)
        groups = []
        for query, docs in GROUPS:
            lines = subprocess.run(
                [rerankdump, str(path), query, *docs], check=True, capture_output=True, text=True
            ).stdout.splitlines()
            rows = [json.loads(line) for line in lines]
            groups.append(
                {
                    "query": query,
                    "documents": docs,
                    "scores": [r["score"] for r in rows],
                    "ids": [r["ids"] for r in rows],
                }
            )
            print(query, [r["score"] for r in rows])
        out = {"model": MODEL, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "groups": groups}
        (HERE / "scores.json").write_text(json.dumps(out, separators=(",", ":"), ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
