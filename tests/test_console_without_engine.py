"""The console needs only `contracts/` (and its UI libraries): in a process where importing `torch` or
`hydra_console.engine` fails, every console module imports, the split editor reads a model's shape,
the control client talks to a head's control framing, the app runs, and `--once --json` reports."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

from consoles import all_ready, fake_profile

from hydra_console.app.config import save_profile
from hydra_console.app.split_plan import ModelShape, WorkerMemory
from hydra_console.app.supervisor import Supervisor
from hydra_console.contracts.rpc import Op, Status
from hydra_console.engine.rpc.wire import SocketReader, pack_control_response, read_control_request

# Installed first on sys.meta_path at interpreter start: the engine and torch are "not installed".
BLOCKER = """
import sys

BLOCKED = ("torch", "hydra_console.engine")


class NoEngine:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{name} is not installed here (tests/test_console_without_engine.py)")
        return None


sys.meta_path.insert(0, NoEngine())
"""

CONSOLE = """
import asyncio, importlib, json, pkgutil, sys

for name in ("torch", "hydra_console.engine"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        sys.exit(f"{name} imported: the blocker is not in place")

import hydra_console.app

for m in pkgutil.walk_packages(hydra_console.app.__path__, "hydra_console.app."):
    importlib.import_module(m.name)

from hydra_console.app import control_client
from hydra_console.app.config import load_profile
from hydra_console.app.split_plan import ModelShape, WorkerMemory
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole
from hydra_console.contracts.rpc import Op

model, control_port, profile_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
shape = ModelShape.from_gguf(model)
estimate = shape.estimate([2, 2], 256, 2, [WorkerMemory()] * 2)
reply = control_client.request_sync("127.0.0.1", control_port, Op.CONFIGURE, b'{"split": "2/2"}')


async def run_app():
    app = HydraConsole(Supervisor(load_profile(profile_path), attach=True))
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(400):
            if app.model_shape is not None:
                break
            await pilot.pause(0.05)
        return app.model_shape is not None and app.model_shape.n_layers


loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith("hydra_console.engine"))
print(json.dumps({
    "n_layers": shape.n_layers,
    "estimate": [e.total for e in estimate],
    "reply": [reply.status, reply.meta],
    "app_shape_layers": asyncio.run(run_app()),
    "loaded": loaded,
}))
"""


def without_engine(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """`python *args` where importing torch or hydra_console.engine raises ImportError."""
    hook = tmp_path / "no-engine"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env)


def control_server() -> tuple[int, threading.Thread]:
    """One control exchange served with the engine's framing: answers the request's op and payload."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)

    def serve():
        with listener, listener.accept()[0] as conn:
            reader = SocketReader(conn)
            req = read_control_request(reader)
            payload = bytes(reader.read_exact(req.payload_len))
            conn.sendall(pack_control_response(Status.OK, {"op": req.op, "payload": payload.decode()}))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


def test_console_imports_reads_models_and_runs_without_the_engine(tmp_path, tiny_model):
    model = tiny_model("llama", n_layers=4, n_embd=64, n_ff=128)
    profile = fake_profile(model=str(model))
    path = save_profile(profile, tmp_path / "p.toml")
    port, server = control_server()
    proc = without_engine(tmp_path, "-c", CONSOLE, str(model), str(port), str(path))
    server.join(5)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.splitlines()[-1])
    shape = ModelShape.from_gguf(model)  # here, beside the engine
    assert doc["n_layers"] == shape.n_layers == 4 and doc["app_shape_layers"] == 4
    assert doc["estimate"] == [e.total for e in shape.estimate([2, 2], 256, 2, [WorkerMemory()] * 2)]
    assert doc["reply"] == [Status.OK, {"op": Op.CONFIGURE, "payload": '{"split": "2/2"}'}]
    assert doc["loaded"] == []


async def test_once_json_without_the_engine(tmp_path):
    profile = fake_profile()
    path = save_profile(profile, tmp_path / "p.toml")
    sup = Supervisor(profile, log_dir=tmp_path)
    await sup.start()
    try:
        deadline = time.monotonic() + 20
        while not all_ready(sup) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        proc = await asyncio.to_thread(
            without_engine, tmp_path, "-m", "hydra_console.app.main", "--profile", str(path), "--once", "--json"
        )
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert [(w["name"], w["state"], w["pid"]) for w in doc["workers"]] == [
            ("head", "ready", sup.head.pid),
            ("peer1", "ready", sup.workers["peer1"].pid),
        ]
    finally:
        await sup.shutdown()
