"""The fused GEMV's inner loop as an H200 runs it, without a GPU: instructions per weight.

    python benchmarks/gemv_sass.py [--types Q4_K,Q5_K,Q6_K,Q8_0] [--rows 1,4,8] [--qmma]

Compiles `_gemv_kernel` for sm_90 with the Triton wheel's own ptxas and disassembles it with its
nvdisasm, then counts the SASS of the K loop (the block that branches back to itself): all of
it per thread, per weight (times threads / weights per step), the barriers and shared-memory
accesses (a layout conversion inside the loop), the dp4a (IDP.4A) and global loads, and the
registers ptxas allots. At full bandwidth (~4.8 TB/s) an H200 issues about 3.3e13 thread
instructions a second: 4-bit weights leave ~3.9 instructions each, 6-bit ~5.6. Each row count
uses its GEMV_CONFIGS tile, the float-x variant and the int8-x one with x in 1 and 2 terms.
With --qmma, the tensor-core GEMM's loop (`triton_qmma.py`) at each row count's QMMA_CONFIGS tile
(rows 1-32), bf16 x: the loop holds the decode, the tile's trip through shared memory and the wgmma.
With --dequant, all of `triton_qdequant.py`'s kernel (no loop: one tile a program), into bf16.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from gguf.constants import GGMLQuantizationType as T
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hydra_console.engine.kernels.qweight import LAYOUTS
from hydra_console.engine.kernels.triton_qdequant import DEQUANT_TILE, _dequant_kernel
from hydra_console.engine.kernels.triton_qmatmul import GEMV_CONFIGS, _gemv_kernel
from hydra_console.engine.kernels.triton_qmma import QMMA_CONFIGS, _qmma_kernel

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SASS_LINE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def _layout(qt: T) -> tuple[dict, dict]:
    """A type's constexprs and plane pointer types, as `layout_args` passes them."""
    lay = LAYOUTS[qt]
    consts = dict(BITS=lay.bits, OFFSET=lay.offset, SB=lay.sb, G=lay.g, HAS_M=lay.has_m, HAS_MN=lay.has_mn)
    # The K-quants pass `dm` and `sm` as d and sc (triton_qplanes.scales).
    planes = dict(q_ptr="*u8", h_ptr="*u8", d_ptr="*i64" if lay.has_mn else "*fp16", m_ptr="*fp16")
    return consts, planes | dict(sc_ptr="*i8" if qt == T.Q6_K else "*u8")


def _compile(fn, consts: dict, pointers: dict, **options):
    """fn for sm_90 as a CUDA launch specializes it: pointers, strides, N, K and k_split 16-byte aligned."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    aligned = [n for n in names if n in pointers or n.endswith("stride") or n in ("N", "K", "k_split")]
    src = ASTSource(
        fn,
        signature,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_gemv(qt: T, mr: int, block_n: int, block_k: int, warps: int, x_terms: int):
    """The GEMV as qmm launches it."""
    consts, pointers = _layout(qt)
    consts |= dict(BLOCK_N=block_n, BLOCK_K=block_k, MR=mr, X_TERMS=x_terms, ASM=True)
    if mr == 1:
        consts["M"] = 1  # Triton specializes an int argument equal to 1
    pointers |= dict(x_ptr="*u8" if x_terms else "*bf16", mn_ptr="*u8", out_ptr="*fp32")
    return _compile(_gemv_kernel, consts, pointers, num_warps=warps)


def compile_qmma(qt: T, config: tuple):
    """The tensor-core GEMM as qmma launches it for bf16 x."""
    block_m, block_n, block_k, warps, stages, _, swap = config
    consts, pointers = _layout(qt)
    consts |= dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap, PRECISION="tf32")
    consts |= dict(UPCAST=False, ASM=True)
    pointers |= dict(x_ptr="*bf16", out_ptr="*fp32")
    return _compile(_qmma_kernel, consts, pointers, num_warps=warps, num_stages=stages)


def compile_dequant(qt: T):
    """The dequantization as qdequant launches it, into bf16 (a prefill's scratch)."""
    consts, pointers = _layout(qt)
    consts |= dict(HAS_IDS=False, BLOCK_N=DEQUANT_TILE[0], BLOCK_K=DEQUANT_TILE[1], ASM=True)
    pointers |= dict(out_ptr="*bf16", ids_ptr="*i64")
    return _compile(_dequant_kernel, consts, pointers, num_warps=4, enable_fp_fusion=False)


def _registers(cubin: bytes) -> str:
    """Registers a thread, from the cubin's resource usage (the bundled ptxas may be older than Triton's PTX)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+)", out.stdout)
    return found.group(1) if found else "?"


def _sass(cubin: bytes) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [os.path.join(TOOLS, "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout.splitlines()


def _ops(lines: list[str]) -> collections.Counter:
    return collections.Counter(m.group(1) for s in lines if (m := SASS_LINE.match(s)))


def loop_ops(cubin: bytes) -> collections.Counter:
    """Opcode counts of the loop: from the label a backward branch targets to that branch."""
    lines = _sass(cubin)
    for end, line in enumerate(lines):
        branch = re.search(r"@!?P\d+\s+BRA\s+`\((\.L_x_\d+)\)", line)
        if branch:
            start = next(i for i, s in enumerate(lines) if s.startswith(branch.group(1) + ":"))
            if start < end:
                return _ops(lines[start : end + 1])
    raise SystemExit("no loop found in the SASS")


def _loop_cells(cubin: bytes, warps: int, weights: int, *columns: tuple[str, ...]) -> list[str]:
    """A table row's counts for a kernel's loop: instructions a thread a step, a weight (threads over
    the `weights` a step covers), each of `columns` (opcode prefixes summed), registers."""
    ops = loop_ops(cubin)
    total = sum(ops.values())
    counts = [sum(c for op, c in ops.items() if op.startswith(prefixes)) for prefixes in columns]
    return [str(total), f"{total * 32 * warps / weights:.2f}", *map(str, counts), _registers(cubin)]


def _dequant_table(types: list[str]) -> None:
    """The dequantization kernel has no loop: all of its SASS, a program's tile, into bf16."""
    print("| type | (BLOCK_N, BLOCK_K), 4 warps | instr/thread | instr/weight | global loads | registers |")
    print("|---" * 6 + "|")
    for name in types:
        k = compile_dequant(T[name])
        ops = _ops(_sass(k.asm["cubin"]))
        total = sum(ops.values())
        loads = sum(c for op, c in ops.items() if op.startswith("LDG"))
        per_weight = total * 32 * 4 / (DEQUANT_TILE[0] * DEQUANT_TILE[1])
        print(f"| {name} | {DEQUANT_TILE} | {total} | {per_weight:.2f} | {loads} | {_registers(k.asm['cubin'])} |")


def _qmma_table(types: list[str], rows: list[int]) -> None:
    """qmma's loop per type at each row count's QMMA_CONFIGS tile (bf16 x on the tensor cores)."""
    print(
        "| type | rows | (BLOCK_M, BLOCK_N, BLOCK_K, warps) | instr/thread/step | instr/weight | barriers | shared ld/st | global loads | registers |"
    )
    print("|---" * 9 + "|")
    for name in types:
        for mr in rows:
            config = QMMA_CONFIGS[mr]
            block_m, block_n, block_k, warps = config[:4]
            cubin = compile_qmma(T[name], config).asm["cubin"]
            cells = _loop_cells(cubin, warps, block_n * block_k, ("BAR",), ("LDS", "STS"), ("LDG",))
            print(f"| {name} | {mr} | {(block_m, block_n, block_k, warps)} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--qmma", action="store_true", help="the tensor-core GEMM's loop instead (rows: 1-32)")
    ap.add_argument("--dequant", action="store_true", help="the dequantization kernel instead (rows unused)")
    args = ap.parse_args()
    if args.dequant:
        _dequant_table(args.types.split(","))
        return
    rows = sorted({triton.next_power_of_2(int(r)) for r in args.rows.split(",")})
    if args.qmma:
        _qmma_table(args.types.split(","), rows)
        return
    print(
        "| type | rows | (BLOCK_N, BLOCK_K, warps) | x | instr/thread/step | instr/weight | barriers | "
        "shared ld/st | dp4a | global loads | registers |"
    )
    print("|---" * 11 + "|")
    for name in args.types.split(","):
        for mr in rows:
            block_n, block_k, warps = GEMV_CONFIGS[mr][:3]
            for x_terms in (0, 1, 2):
                cubin = compile_gemv(T[name], mr, block_n, block_k, warps, x_terms).asm["cubin"]
                columns = ("BAR",), ("LDS", "STS"), ("IDP",), ("LDG",)
                cells = _loop_cells(cubin, warps, block_n * block_k, *columns)
                x = f"int8 x{x_terms}" if x_terms else "float"
                print(f"| {name} | {mr} | {(block_n, block_k, warps)} | {x} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
