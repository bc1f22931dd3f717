"""Test support (not a test module): console profiles of stand-in workers and a Pilot wait."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from rpc_workers import free_ports

from hydra_console.app.config import Profile, SupervisorSettings, WorkerSpec, save_profile
from hydra_console.app.records import State
from hydra_console.app.split_plan import ModelShape
from hydra_console.app.supervisor import Supervisor
from hydra_console.contracts.footprint import ModelTensors, Tensor

FAKE = f"{shlex.quote(sys.executable)} -m hydra_console.app.fake_worker"


def port_pair() -> int:
    """A worker's HTTP port whose default RPC port (+1) is free too."""
    return free_ports(1, pairs=True)[0]


def fake_profile(peers: int = 1, **kw) -> Profile:
    return Profile(
        name="fake",
        engine_command=FAKE,
        head=WorkerSpec(name="head", port=port_pair()),
        peers=[WorkerSpec(name=f"peer{i + 1}", port=port_pair()) for i in range(peers)],
        supervisor=SupervisorSettings(poll_s=0.2, grace_s=5),
        **kw,
    )


def uniform_shape(n_layers: int, layer_elements: int, head_elements: int, kv_values_per_token_layer: int) -> ModelShape:
    """A made-up model for the split editor: equal F16 layers of one matrix each, a tied F16
    embedding of `head_elements` (hidden size 256), K and V of half `kv_values_per_token_layer` each, no RoPE."""
    layer = (Tensor("blk.w", "F16", (1024, layer_elements // 1024)),)
    return ModelShape(
        ModelTensors(
            n_layers,
            (layer,) * n_layers,
            Tensor("token_embd.weight", "F16", (head_elements // 256, 256)),
            None,
            (),
            (kv_values_per_token_layer // 2,) * 2,
            0,
            (True,) * n_layers,
        )
    )


async def until(pilot, cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.05)


def all_ready(sup: Supervisor) -> bool:
    return all(w.state == State.READY for w in sup.workers.values())


def kill_groups(pids) -> None:
    """SIGKILL each worker's process group: cleanup after a test that let a console go."""
    for p in pids:
        try:
            os.killpg(p, signal.SIGKILL)
        except OSError:
            pass


CONSOLE = """
import asyncio, sys
from hydra_console.app.config import load_profile
from hydra_console.app.records import State
from hydra_console.app.supervisor import Supervisor

async def main():
    sup = Supervisor(load_profile(sys.argv[1]), log_dir=sys.argv[2])
    await sup.start()
    while not all(w.state == State.READY for w in sup.workers.values()):
        await asyncio.sleep(0.1)
    print(' '.join(str(w.pid) for w in sup.workers.values()), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def console_process(profile: Profile, tmp_path: Path) -> subprocess.Popen:
    """Another console (a bare supervisor in its own process) running `profile`'s workers, logs
    under tmp_path/logs; it prints the workers' pids once they are ready."""
    path = save_profile(profile, tmp_path / "p.toml")
    script = tmp_path / "console.py"
    script.write_text(CONSOLE)
    return subprocess.Popen(
        [sys.executable, str(script), str(path), str(tmp_path / "logs")], stdout=subprocess.PIPE, text=True
    )
