"""Triton kernels lower to Triton IR for a CUDA target without a GPU. The interpreter (how the kernel
tests run here) accepts Python the compiler refuses: a runtime `if` whose branches assign one name
with different shapes ran under the interpreter and failed to compile on an H200. Lowering to TTIR
runs the compiler's front end, the part that refuses it, on this machine. It runs in a process of
its own: under TRITON_INTERPRET (tests/conftest.py) `@triton.jit` gives interpreter wrappers, which
the compiler cannot call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.unit

LOWER = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton._C.libtriton import ir
from hydra_console.engine.kernels import triton_gdn_step as k

target = GPUTarget("cuda", 90, 32)  # an H100's
backend = make_backend(target)
options = backend.parse_options({})
context = ir.context()
ir.load_dialects(context)
backend.load_dialects(context)


def lower(fn, constexprs, floats=(), i64_pointers=()):
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name.endswith("_ptr"):
            return "*i64" if name in i64_pointers else "*fp32"
        return "fp32" if name in floats else "i32"

    source = ASTSource(
        fn=fn,
        signature={name: kind(name) for name in fn.arg_names},
        constexprs={(fn.arg_names.index(c),): v for c, v in constexprs.items()},
    )
    source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


m, depth = int(sys.argv[1]), int(sys.argv[2])
heads = dict(HK=16, DK=128, HV=48, DV=128)  # qwen35 27B's DeltaNet heads; conv kernel 4
conv = dict(M=m, DEPTH=depth, **heads, NCK=min(m, depth), KW=4, BM=max(2, m), BD=128, BW=4, BH=64)
lower(k._conv_step_kernel, conv, floats=("eps",), i64_pointers=("slot_ptr",))
lower(k._rule_step_kernel, dict(M=m, DEPTH=depth, **heads, BK=128, BV=k.CONFIG["bv"]), i64_pointers=("slot_ptr",))
"""


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("depth", [1, 3])
def test_the_step_kernels_lower_for_a_cuda_card(m, depth):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", LOWER, str(m), str(depth)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
