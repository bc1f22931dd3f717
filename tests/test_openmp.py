"""Split workers shorten OpenMP's idle spin (engine/openmp.py); solo workers and operators' own
settings are left alone."""

from __future__ import annotations

import importlib
import os

import pytest

from hydra_console.engine import cli, openmp


@pytest.fixture
def clean_env(monkeypatch):
    for var in openmp.WAIT_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_split_worker_gets_a_short_spin(clean_env):
    assert openmp.configure_split_worker()
    assert os.environ["GOMP_SPINCOUNT"] == openmp.SPLIT_SPINCOUNT


@pytest.mark.parametrize("var", openmp.WAIT_VARIABLES)
def test_an_exported_wait_setting_wins(clean_env, var):
    clean_env.setenv(var, "PASSIVE" if var == "OMP_WAIT_POLICY" else "123")
    assert not openmp.configure_split_worker()
    assert os.environ.get("GOMP_SPINCOUNT") in (None, "123")


@pytest.mark.parametrize(
    ("argv", "module", "name", "short_spin"),
    [
        (["peer"], "hydra_console.engine.workers.peer", "PeerWorker", True),
        (["serve", "--peer", "127.0.0.1:9"], "hydra_console.engine.workers.head", "HeadWorker", True),
        (["serve"], "hydra_console.engine.workers.head", "HeadWorker", False),
        (["generate", "-p", "x"], "hydra_console.engine.generate", "main", False),
    ],
)
def test_cli_applies_it_to_split_workers_only(clean_env, argv, module, name, short_spin):
    seen = {}

    class Worker:  # stands in for the worker (or the generate subcommand) the CLI starts
        def __init__(self, *_):
            seen.update(spin=os.environ.get("GOMP_SPINCOUNT"))

        def serve(self):
            return 0

    stand_in = Worker if name != "main" else lambda *_: Worker() and None
    clean_env.setattr(importlib.import_module(module), name, stand_in)
    assert cli.main(argv) == 0
    assert seen["spin"] == (openmp.SPLIT_SPINCOUNT if short_spin else None)
