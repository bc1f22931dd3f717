"""Regenerate tests/data/reference/gemma3-270m/embeddings.json: llama-server's embeddings of the
default model, the oracle of tests/test_embeddings.py.

llama.cpp's CPU kernels quantize activations to 8 bits for quantized weights, which moves an
embedding by ~0.2% (cosine ~0.998 against exact math). The reference is therefore taken on the
default model's weights dequantized to an F32 GGUF (same values, bit for bit, as our float32
path dequantizes them), so both sides compute in float32 and only summation order differs.

    python scripts/embedding_reference.py [--llama-server /work/llama-cpp/bin/llama-server]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import httpx
import numpy as np

from hydra_console.engine.default_model import default_model_path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "gemma3-270m" / "embeddings.json"
INPUTS = ["I believe the meaning of life is", "hello world", "The quick brown fox jumps over the lazy dog."]
TOKEN_INPUT = "hello hello hello"  # pooling none: every token's vector
POOLINGS = ("mean", "cls", "last", "none")
DIGITS = 6


def dequantized_copy(src: Path, dst: Path) -> None:
    """`src` with every tensor stored as F32 (metadata copied as is)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        skip = (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE)
        if field.name in skip or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_key_value("general.file_type", 0, gguf.GGUFValueType.UINT32)  # all F32
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def serve(binary: str, model: Path, pooling: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}
    argv = [
        binary,
        "-m",
        str(model),
        "--embedding",
        "--pooling",
        pooling,
        "--port",
        str(port),
        "-c",
        "512",
        "-np",
        "1",
        "-t",
        "2",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"llama-server --pooling {pooling} did not come up")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default="/work/llama-cpp/bin/llama-server")
    ap.add_argument("--port", type=int, default=18971)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    src = default_model_path()
    doc = {
        "model": src.name,
        "note": "llama-server on this model dequantized to F32 (scripts/embedding_reference.py)",
        "inputs": INPUTS,
        "token_input": TOKEN_INPUT,
        "embeddings": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32.gguf"
        dequantized_copy(src, f32)
        for pooling in POOLINGS:
            proc = serve(args.llama_server, f32, pooling, args.port)
            try:
                url = f"http://127.0.0.1:{args.port}"
                if pooling == "none":
                    r = httpx.post(f"{url}/embeddings", json={"input": TOKEN_INPUT}, timeout=120).json()
                    vectors = r[0]["embedding"]
                else:
                    r = httpx.post(f"{url}/v1/embeddings", json={"input": INPUTS}, timeout=120).json()
                    vectors = [d["embedding"] for d in r["data"]]
            finally:
                proc.terminate()
                proc.wait()
            doc["embeddings"][pooling] = [[round(x, DIGITS) for x in v] for v in vectors]
    args.out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
