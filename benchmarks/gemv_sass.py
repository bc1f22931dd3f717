"""The fused GEMV's inner loop as an H200 runs it, without a GPU: instructions per weight.

    python benchmarks/gemv_sass.py [--types Q4_K,Q5_K,Q6_K,Q8_0] [--rows 1,4,8]

Compiles `_gemv_kernel` for sm_90 with the Triton wheel's own ptxas and disassembles it with its
nvdisasm, then counts the SASS of the K loop (the block that branches back to itself): all of
it per thread, per weight (times threads / weights per step), the barriers and shared-memory
accesses (a layout conversion inside the loop), the dp4a (IDP.4A) and global loads, and the
registers ptxas allots. At full bandwidth (~4.8 TB/s) an H200 issues about 3.3e13 thread
instructions a second: 4-bit weights leave ~3.9 instructions each, 6-bit ~5.6. Each row count
uses its GEMV_CONFIGS tile, the float-x variant and the int8-x one with x in 1 and 2 terms.
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
from hydra_console.engine.kernels.triton_qmatmul import GEMV_CONFIGS, _gemv_kernel
from hydra_console.engine.kernels.triton_qmma import QMMA_CONFIGS, _qmma_kernel

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SASS_LINE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def compile_gemv(qt: T, mr: int, block_n: int, block_k: int, warps: int, x_terms: int):
    """The kernel as qmm launches it on CUDA (pointers and strides 16-byte aligned, as Triton specializes)."""
    lay = LAYOUTS[qt]
    consts = dict(
        BITS=lay.bits,
        OFFSET=lay.offset,
        SB=lay.sb,
        G=lay.g,
        HAS_M=lay.has_m,
        HAS_MN=lay.has_mn,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        MR=mr,
        X_TERMS=x_terms,
        ASM=True,
    )
    if mr == 1:
        consts["M"] = 1  # Triton specializes an int argument equal to 1
    pointers = {
        "x_ptr": "*u8" if x_terms else "*bf16",
        "q_ptr": "*u8",
        "h_ptr": "*u8",
        "d_ptr": "*fp16",
        "sc_ptr": "*i8" if qt == T.Q6_K else "*u8",
        "m_ptr": "*fp16",
        "mn_ptr": "*u8",
        "out_ptr": "*fp32",
    }
    names = _gemv_kernel.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    aligned = [n for n in names if n in pointers or n.endswith("stride") or n in ("N", "K", "k_split")]
    src = ASTSource(
        _gemv_kernel,
        signature,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def compile_qmma(qt: T, config: tuple):
    """The tensor-core GEMM as qmma launches it on CUDA for bf16 x (16-byte aligned pointers and strides)."""
    lay = LAYOUTS[qt]
    block_m, block_n, block_k, warps, stages, _, swap = config
    consts = dict(BITS=lay.bits, OFFSET=lay.offset, SB=lay.sb, G=lay.g, HAS_M=lay.has_m, HAS_MN=lay.has_mn)
    consts |= dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap, PRECISION="tf32", UPCAST=False, ASM=True
    )
    pointers = dict(x_ptr="*bf16", q_ptr="*u8", h_ptr="*u8", sc_ptr="*i8" if qt == T.Q6_K else "*u8")
    pointers |= dict(d_ptr="*i64" if lay.has_mn else "*fp16", m_ptr="*fp16", out_ptr="*fp32")
    names = _qmma_kernel.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    aligned = [n for n in names if n in pointers or n.endswith("stride") or n in ("N", "K", "k_split")]
    src = ASTSource(
        _qmma_kernel,
        signature,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def _registers(cubin: bytes) -> str:
    """Registers a thread, from the cubin's resource usage (the bundled ptxas may be older than Triton's PTX)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+)", out.stdout)
    return found.group(1) if found else "?"


def loop_ops(cubin: bytes) -> collections.Counter:
    """Opcode counts of the loop: from the label a backward branch targets to that branch."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run(
            [os.path.join(TOOLS, "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout.splitlines()
    for end, line in enumerate(lines):
        branch = re.search(r"@!?P\d+\s+BRA\s+`\((\.L_x_\d+)\)", line)
        if branch:
            start = next(i for i, s in enumerate(lines) if s.startswith(branch.group(1) + ":"))
            if start < end:
                return collections.Counter(m.group(1) for s in lines[start : end + 1] if (m := SASS_LINE.match(s)))
    raise SystemExit("no loop found in the SASS")


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
            k = compile_qmma(T[name], config)
            ops = loop_ops(k.asm["cubin"])
            total = sum(ops.values())
            count = lambda *prefixes: sum(c for op, c in ops.items() if op.startswith(prefixes))  # noqa: E731
            print(
                f"| {name} | {mr} | {(block_m, block_n, block_k, warps)} | {total} | "
                f"{total * 32 * warps / (block_n * block_k):.2f} | {count('BAR')} | {count('LDS', 'STS')} | "
                f"{count('LDG')} | {_registers(k.asm['cubin'])} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--qmma", action="store_true", help="the tensor-core GEMM's loop instead (rows: 1-32)")
    args = ap.parse_args()
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
                k = compile_gemv(T[name], mr, block_n, block_k, warps, x_terms)
                ops = loop_ops(k.asm["cubin"])
                total = sum(ops.values())
                count = lambda *prefixes: sum(c for op, c in ops.items() if op.startswith(prefixes))  # noqa: E731
                print(
                    f"| {name} | {mr} | {(block_n, block_k, warps)} | {f'int8 x{x_terms}' if x_terms else 'float'} | {total} | "
                    f"{total * 32 * warps / (block_n * block_k):.2f} | {count('BAR')} | {count('LDS', 'STS')} | "
                    f"{count('IDP')} | {count('LDG')} | {_registers(k.asm['cubin'])} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
