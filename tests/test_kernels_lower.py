"""Triton kernels lower to Triton IR for a CUDA target without a GPU. The interpreter (how the kernel
tests run here) accepts Python the compiler refuses: a runtime `if` whose branches assign one name
with different shapes ran under the interpreter and failed to compile on an H200. Lowering to TTIR
runs the compiler's front end, the part that refuses it, on this machine. It runs in a process of
its own: under TRITON_INTERPRET (tests/conftest.py) `@triton.jit` gives interpreter wrappers, which
the compiler cannot call. The tensor-core GEMM goes on to PTX: its dots' layouts (Hopper's wgmma, or
mma.sync) are chosen and lowered after TTIR."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.unit

PREAMBLE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton._C.libtriton import ir

target = GPUTarget("cuda", 90, 32)  # an H100's
backend = make_backend(target)
context = ir.context()
ir.load_dialects(context)
backend.load_dialects(context)


def lower(fn, constexprs, floats=(), i64_pointers=(), pointers=None, until="ttir", **launch):
    \"\"\"fn's TTIR, or on to `until` ("ptx": no ptxas needed), with pointer types `pointers` (else
    *fp32, *i64 for `i64_pointers`) and launch options (num_warps, num_stages).\"\"\"
    options = backend.parse_options(launch)

    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name.endswith("_ptr"):
            return (pointers or {}).get(name, "*i64" if name in i64_pointers else "*fp32")
        return "fp32" if name in floats else "i32"

    source = ASTSource(
        fn=fn,
        signature={name: kind(name) for name in fn.arg_names},
        constexprs={(fn.arg_names.index(c),): v for c, v in constexprs.items()},
    )
    module = source.make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
    )
    stages, metadata = {}, {}
    backend.add_stages(stages, options, source.language)
    for stage in list(stages)[: list(stages).index(until) + 1]:
        module = stages[stage](module, metadata)
    return str(module)
"""

# One process lowers every case (each its own process cost ~2 s of imports for a fraction of that
# in lowering); each case's error, if any, is reported on a line of its own and read by its test.
RESULTS = """
import json, traceback


def report(case, lower_case):
    try:
        out = lower_case()
        print(json.dumps({"case": case, "error": None, "out": out}))
    except Exception:
        print(json.dumps({"case": case, "error": traceback.format_exc()[-3000:], "out": None}))
"""

STEP_CASES = [(m, depth) for depth in (1, 3) for m in (1, 2, 4)]

LOWER = (
    PREAMBLE
    + RESULTS
    + """
from hydra_console.engine.kernels import triton_gdn_step as k


def lower_step(m, depth):
    heads = dict(HK=16, DK=128, HV=48, DV=128)  # qwen35 27B's DeltaNet heads; conv kernel 4
    conv = dict(M=m, DEPTH=depth, **heads, NCK=min(m, depth), KW=4, BM=max(2, m), BD=128, BW=4, BH=64)
    lower(k._conv_step_kernel, conv, floats=("eps",), i64_pointers=("slot_ptr",))
    lower(k._rule_step_kernel, dict(M=m, DEPTH=depth, **heads, BK=128, BV=k.CONFIG["bv"]), i64_pointers=("slot_ptr",))


for case in json.loads(sys.argv[1]):
    report(case, lambda: lower_step(*case))
"""
)


def lowered(script: str, cases: list) -> dict:
    """{case: (error or None, output)} of `script` run once over `cases`, outside the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True, text=True)
    results = {tuple(r["case"]): (r["error"], r["out"]) for r in map(json.loads, run.stdout.splitlines())}
    assert run.returncode == 0 and len(results) == len(cases), run.stderr[-3000:]
    return results


@pytest.fixture(scope="module")
def step_kernels_lowered():
    return lowered(LOWER, STEP_CASES)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("depth", [1, 3])
def test_the_step_kernels_lower_for_a_cuda_card(m, depth, step_kernels_lowered):
    error, _ = step_kernels_lowered[(m, depth)]
    assert error is None, error


LOWER_QMMA = (
    PREAMBLE
    + RESULTS
    + """
from gguf.constants import GGMLQuantizationType as T
from hydra_console.engine.kernels import triton_qmma as k
from hydra_console.engine.kernels.qweight import LAYOUTS


def lower_qmma(qtype, x_type):
    qt, lay, out = T[qtype], LAYOUTS[T[qtype]], []
    block_m, block_n, block_k, warps, stages, _, swap = k.QMMA_CONFIGS[16]  # the tile verifies of 16 rows take
    planes = dict(q_ptr="*u8", h_ptr="*u8", d_ptr="*i64" if lay.has_mn else "*fp16", sc_ptr="*u8", m_ptr="*fp16")
    for swap in (True, False) if x_type == "bf16" else (swap,):
        consts = dict(BITS=lay.bits, OFFSET=lay.offset, SB=lay.sb, G=lay.g, HAS_M=lay.has_m, HAS_MN=lay.has_mn)
        consts |= dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap, UPCAST=False, ASM=True)
        consts["PRECISION"] = "ieee" if x_type == "fp32" else "tf32"
        pointers = planes | dict(x_ptr="*" + x_type, out_ptr="*fp32")
        ptx = lower(k._qmma_kernel, consts, pointers=pointers, until="ptx", num_warps=warps, num_stages=stages)
        mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"
        out.append(f"{qt.name} {x_type} {'swap' if swap else 'no swap'} {mma}")
    return out


for case in json.loads(sys.argv[1]):
    report(case, lambda: lower_qmma(*case))
"""
)

QMMA_TYPES = ["Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def qmma_lowered():
    return lowered(LOWER_QMMA, [(qtype, x_type) for qtype in QMMA_TYPES for x_type in ("bf16", "fp32")])


@pytest.mark.parametrize("qtype", QMMA_TYPES)
def test_the_tensor_core_gemm_lowers_to_ptx_for_a_cuda_card(qtype, qmma_lowered):
    """The 16-row tile, bf16 x in both orientations of the dot, float32 x ("ieee": no tensor cores): x @ w.T
    takes mma.sync; w @ x.T, the weight's 64 rows on the M side, Hopper's wgmma."""
    out = []
    for x_type in ("bf16", "fp32"):
        error, lines = qmma_lowered[(qtype, x_type)]
        assert error is None, error
        out += lines
    assert out[:2] == [f"{qtype} bf16 swap wgmma", f"{qtype} bf16 no swap mma.sync"]
    assert out[2].startswith(f"{qtype} fp32") and out[2].endswith(" fma")  # the table's orientation
