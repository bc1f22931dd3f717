"""Regenerate the qwen35 reference logits from upstream llama.cpp (see README.md in this folder).

usage: make_reference.py REFDUMP_F32KV MTPDUMP   (builds of refdump_f32kv.c and mtpdump.cpp beside this file)
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.synth import write_synthetic

HERE = Path(__file__).resolve().parent
# Four layers (DeltaNet, attention, DeltaNet, attention); 2 K heads for 4 V heads (head tiling);
# 16 rotary dims so IMROPE's fourth section leaves two pairs unrotated.
SHAPE = dict(n_layers=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, n_rot=16, seed=35)
# K-quant rows are 256-wide blocks: every product's input width is a multiple of 256 there.
WIDE = dict(SHAPE, n_embd=256, head_dim=64, n_ff=512, ssm_state=64)
MODELS = {"f32": dict(SHAPE, qtype="F32"), "q4_k": dict(WIDE, qtype="Q4_K")}
N_PROMPT, TOP_K, N_GREEDY = 300, 10, 16
# The same f32 trunk with its MTP block: llama.cpp's MTP logits for every prompt position and a
# greedy chain of N_DRAFT draft steps from the target's next token (mtpdump.cpp).
MTP_MODEL, N_DRAFT = dict(SHAPE, qtype="F32", nextn=True), 3


def prompt(n_vocab: int) -> list[int]:
    return np.random.default_rng(7).integers(0, n_vocab - 3, N_PROMPT).tolist()  # no control tokens


def main(refdump: str, mtpdump: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in MODELS.items():
            path = write_synthetic(Path(tmp) / f"{name}.gguf", "qwen35", **shape)
            ids = prompt(GGUFFile(path).tensors["token_embd.weight"].shape[0])
            ids_path = Path(tmp) / "ids.bin"
            ids_path.write_bytes(np.array(ids, dtype=np.int32).tobytes())
            lines = subprocess.run(
                [refdump, str(path), str(ids_path), str(TOP_K), str(N_GREEDY)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.splitlines()
            rows = [json.loads(line) for line in lines]
            out = {
                "model": {"arch": "qwen35", **shape},
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "ids": ids,
                "top10": [r for r in rows if "pos" in r],
                "greedy": next(r["greedy"] for r in rows if "greedy" in r),
            }
            (HERE / f"logits_{name}.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
            print(name, len(out["top10"]), "positions, greedy", out["greedy"])
        path = write_synthetic(Path(tmp) / "mtp.gguf", "qwen35", **MTP_MODEL)
        ids = prompt(GGUFFile(path).tensors["token_embd.weight"].shape[0])
        ids_path = Path(tmp) / "ids.bin"
        ids_path.write_bytes(np.array(ids, dtype=np.int32).tobytes())
        lines = subprocess.run(
            [mtpdump, str(path), str(ids_path), str(TOP_K), str(N_DRAFT)], check=True, capture_output=True, text=True
        ).stdout.splitlines()
        rows = [json.loads(line) for line in lines]
        out = {
            "model": {"arch": "qwen35", **MTP_MODEL},
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "ids": ids,
            "top10": [r for r in rows if "pos" in r],
            "target_next": next(r["target_next"] for r in rows if "target_next" in r),
            "drafts": [r for r in rows if "draft" in r],
        }
        (HERE / "mtp_f32.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
        print("mtp", len(out["top10"]), "positions, drafts", [r["top"][0][0] for r in out["drafts"]])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
