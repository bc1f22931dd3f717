"""Shared fixtures: tiny synthetic models and the default model (free ports and worker processes: rpc_workers.py).

Markers: `unit` (no processes, sockets or model files) and `integration` (real worker processes,
sockets or the default model); `pytest -m unit` runs the fast half in seconds."""

from __future__ import annotations

import json
import os

import pytest

# Under xdist (addopts: three test files at once, on two cores in CI) each test process, and every
# process it starts, gets its share of the cores as OpenMP threads, at least one: torch's default of
# one per core oversubscribed them, and libgomp spins an idle thread ~3 ms after each parallel region
# (engine/openmp.py), so a tiny model's thousands of small ops burned several times their CPU time
# (test_speculative_engine on a loaded 2-core machine: 42 s of CPU with two threads, 22 with one).
# Set before torch loads libgomp, which reads it then; an exported OMP_NUM_THREADS wins.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))

import torch  # noqa: E402

# Without a GPU, the Triton kernels (tests/test_qkernels.py, test_decode_attention.py) run on CPU
# tensors under Triton's interpreter, set before any of them is imported; PyPI's CPU-installable
# `triton` is a test dependency for it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hydra_console.engine.default_model import default_model_path
from hydra_console.engine.synth import write_synthetic


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory `tiny_model(arch="llama", **shape) -> Path`: a synthetic GGUF, written once per argument set."""
    root = tmp_path_factory.mktemp("synthetic-models")
    cache = {}

    def make(arch: str = "llama", **kw):
        key = json.dumps([arch, sorted(kw.items())], default=str)
        if key not in cache:
            cache[key] = write_synthetic(root / f"{arch}-{len(cache)}.gguf", arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def default_model():
    """Path of the real Gemma 3 270M Q4_K_M GGUF."""
    return default_model_path()


# The longest files (seconds of tests each, `-n 0` on a two-core box, workers forked: zygote.py), first:
# xdist hands files out in collection order, and alphabetically these came last, so one worker ran
# them alone at the end.
LONGEST_FILES = (
    "test_console.py",
    "test_peer_restart.py",
    "test_bench_api.py",
    "test_console_real.py",
    "test_qkernels.py",
    "test_attacks_http.py",
    "test_deterministic.py",
    "test_gdn_step_kernel.py",
    "test_split.py",
    "test_pd.py",
    "test_supervisor.py",
    "test_api_fuzz.py",
    "test_speculative_engine.py",
    "test_embeddings.py",
    "test_fidelity.py",
    "test_idle_sleep.py",
    "test_link_faults.py",
    "test_rpc_port.py",
    "test_prefill_pipeline.py",
    "test_split_probe.py",
    "test_mtp.py",
    "test_kernels_lower.py",
    "test_output_stage.py",
    "test_kv_pool.py",
    "test_generate.py",
    "test_model.py",
    "test_context_shift.py",
    "test_llama_api.py",
    "test_requests_view.py",
)


def pytest_collection_modifyitems(items):
    """Everything not marked `unit` is `integration`, so `-m unit` / `-m integration` split the suite;
    the longest files first (`LONGEST_FILES`), the rest in their order."""
    for item in items:
        if item.get_closest_marker("unit") is None:
            item.add_marker(pytest.mark.integration)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _own_config_and_state(tmp_path_factory, monkeypatch):
    """Profiles and console state files (takeover) of a test never touch the user's, nor another test's."""
    root = tmp_path_factory.mktemp("xdg")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(root / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(root / "state"))
