"""Console profiles: defaults, TOML round trip, atomic writes, clear errors."""

from __future__ import annotations

import pytest

from hydra_console.app.config import (
    Profile,
    WorkerSpec,
    default_profile,
    load_profile,
    profile_from_dict,
    resolve_profile_path,
    save_profile,
)
from hydra_console.engine.errors import UserError

pytestmark = pytest.mark.unit


def test_default_profile_is_head_and_one_local_peer_on_documented_ports():
    p = default_profile()
    assert [(w.name, w.host, w.port, w.rpc) for w in p.workers] == [
        ("head", "127.0.0.1", 8080, 8081),
        ("peer1", "127.0.0.1", 8090, 8091),
    ]
    assert p.model == "" and p.split is None and all(w.is_local and not w.attach for w in p.workers)
    assert p.supervisor.grace_s == 40 and p.supervisor.backoff_initial_s == 1 and p.supervisor.backoff_max_s == 30


def test_round_trip_through_toml(tmp_path):
    p = Profile(
        name="lab",
        model="/models/x.gguf",
        split=[10, 4, 4],
        head=WorkerSpec(name="head", port=9000, device="cuda:0"),
        peers=[
            WorkerSpec(name="a", host="gpu2", port=9010, launcher="ssh {host} {command}", args=["--dtype", "bfloat16"]),
            WorkerSpec(name="b", host="gpu3", port=9020, attach=True),
        ],
        keys={"hydra.restart": "ctrl+r"},
    )
    p.speculative.type = "ngram"
    path = save_profile(p, tmp_path / "sub" / "lab.toml")
    assert load_profile(path) == p
    assert [f.name for f in path.parent.iterdir()] == ["lab.toml"]  # no temp file left behind


def test_save_replaces_atomically(tmp_path):
    path = tmp_path / "p.toml"
    save_profile(Profile(name="p", ctx=1024), path)
    inode = path.stat().st_ino
    save_profile(Profile(name="p", ctx=2048), path)
    assert load_profile(path).ctx == 2048
    assert path.stat().st_ino != inode  # a new file renamed over the old, never rewritten in place


@pytest.mark.parametrize(
    "text,needle",
    [
        ("ctx = [", "not valid TOML"),
        ("colour = 'red'", "colour"),
        ("[head]\nname = 'head'\nport = 99999", "head.port"),
        ("split = [9, 9, 9]", "split has 3 stages but there are 2 workers"),
        ("split = [18, 0]", "at least one layer"),
        ("[[peers]]\nname = 'head'\nport = 9000", "unique"),
    ],
)
def test_bad_profiles_are_user_errors_naming_the_problem(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError, match=needle):
        load_profile(path)


def test_missing_profile_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="profile not found"):
        load_profile(tmp_path / "nope.toml")


def test_profile_names_resolve_under_the_config_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert resolve_profile_path("lab") == tmp_path / "hydra-console" / "profiles" / "lab.toml"
    assert resolve_profile_path("./x.toml").name == "x.toml"


def test_profile_name_defaults_to_file_stem(tmp_path):
    path = tmp_path / "gpu-box.toml"
    path.write_text("ctx = 2048\n")
    assert load_profile(path).name == "gpu-box"


def test_assignment_is_validated():
    p = profile_from_dict({})
    with pytest.raises(ValueError):
        p.split = [1, 2, 3]
