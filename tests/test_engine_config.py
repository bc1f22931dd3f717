"""Worker configuration (engine/config.py): built once from argv and the environment."""

from __future__ import annotations

import pytest

from hydra_console.contracts.footprint import CUBLAS_WORKSPACE_BYTES
from hydra_console.engine.cli import build_parser
from hydra_console.engine.cli_config import head_config, peer_config
from hydra_console.engine.config import ENVIRONMENT, GPU_SPIN_S, RpcSettings, cuda_env
from hydra_console.engine.errors import UserError

pytestmark = pytest.mark.unit


def serve(*argv, env=None):
    return head_config(build_parser().parse_args(["serve", *argv]), env or {})


def test_head_config_from_argv_and_environment(tmp_path):
    cfg = serve(
        "--port",
        "9000",
        "--peer",
        "h:1",
        "--split",
        "3/1",
        "--spec-type",
        "ngram",
        env={"HYDRA_TOKEN": "s3cret", "HYDRA_CACHE_DIR": str(tmp_path), "HYDRA_CUDA_IPC": "0", "HYDRA_SHM": "0"},
    )
    assert (cfg.rpc.port, cfg.peers, cfg.split, cfg.spec.type) == (9001, ("h:1",), "3/1", "ngram")
    assert (
        cfg.rpc.auth_token == "s3cret" and not cfg.rpc.cuda_ipc and not cfg.rpc.shm and cfg.model.cache_dir == tmp_path
    )
    doc = cfg.redacted()
    assert doc["rpc"]["auth_token"] == "***" and "s3cret" not in repr(cfg) + repr(doc)
    assert serve("--auth-token", "flag", env={"HYDRA_TOKEN": "env"}).rpc.auth_token == "flag"
    assert serve(env={"HYDRA_CACHE_DIR": "off"}).model.cache_dir is None
    # Adaptive draft lengths: on for MTP unless pinned; forced on for another drafter.
    assert serve("--spec-type", "mtp").spec.adapts and not serve("--spec-type", "ngram").spec.adapts
    assert not serve("--spec-type", "mtp", "--draft-adaptive", "off").spec.adapts
    assert serve("--spec-type", "ngram", "--draft-adaptive", "on").spec.adapts


def test_llama_server_spellings_of_speculative_and_template_flags(tmp_path):
    """A llama-server command line runs as written: its --spec-type names and --spec-draft-*
    flags, and --jinja, which makes a --chat-template that is no built-in name jinja source."""
    cfg = serve("--spec-type", "draft-simple", "-md", "d.gguf", "--spec-draft-n-max", "8", "--spec-draft-n-min", "4")
    assert (cfg.spec.type, cfg.model_draft, cfg.spec.n_max, cfg.spec.n_min) == ("draft", "d.gguf", 8, 4)
    assert serve("--spec-type", "ngram-mod").spec.type == "ngram" and serve("--spec-type", "none").spec.type == "off"
    assert serve("--spec-draft-p-min", "0.5").spec.p_min == 0.5
    assert serve().spec.probabilistic and not serve("--spec-draft-sampling", "greedy").spec.probabilistic
    with pytest.raises(SystemExit):
        serve("--spec-type", "draft-eagle3")  # a drafter we do not have is refused, not guessed
    assert serve("--jinja", "--chat-template", "x").chat_template_source
    assert not serve("--no-jinja", "--chat-template", "x").chat_template_source and not serve().chat_template_source
    (tmp_path / "t.jinja").write_text("plain text")
    assert serve("--chat-template-file", str(tmp_path / "t.jinja")).chat_template_source


def test_http_limits_of_the_head():
    cfg = serve(env={"HYDRA_API_KEY": "k3y"})
    assert (cfg.max_body, cfg.max_queue, cfg.n_predict, cfg.api_key) == (1 << 20, 64, 1024, "k3y")
    assert cfg.redacted()["api_key"] == "***" and "k3y" not in repr(cfg) + repr(cfg.redacted())
    assert serve("--ctx", "32768").max_body == 32768 * 64  # a full-context prompt fits
    assert serve("--api-key", "flag", env={"HYDRA_API_KEY": "env"}).api_key == "flag"
    assert serve().api_key is None and serve().redacted()["api_key"] is None


def test_fair_admission_bounded_responses_and_connection_limits_of_the_head():
    from hydra_console.engine.config import DEFAULT_MAX_RESPONSE, descriptor_limit

    cfg = serve("--parallel", "3")
    assert (cfg.max_n, cfg.max_response) == (3, DEFAULT_MAX_RESPONSE)  # n up to the slots
    nofile = descriptor_limit()
    assert cfg.http.max_connections == max(16, min(4096, nofile // 2)) < nofile
    assert cfg.http.max_client_connections == max(8, cfg.http.max_connections // 4)
    assert (cfg.http.header_timeout, cfg.http.body_timeout) == (10.0, 60.0)
    assert serve("--max-n", "8").max_n == 8 and cfg.redacted()["http"]["max_connections"] == cfg.http.max_connections
    limits = serve(
        "--max-connections", "100", "--max-client-connections", "500", "--header-timeout", "2", "--body-timeout", "3"
    ).http
    assert (limits.max_connections, limits.max_client_connections, limits.header_timeout, limits.body_timeout) == (
        100,
        100,  # never above the total
        2.0,
        3.0,
    )
    for argv in (
        ("--max-n", "0"),
        ("--max-n", "129"),
        ("--max-response", "10"),
        ("--max-connections", "0"),
        ("--max-connections", str(nofile)),
        ("--max-client-connections", "0"),
        ("--header-timeout", "0"),
        ("--body-timeout", "-1"),
    ):
        with pytest.raises(UserError):
            serve(*argv)


def test_llama_server_flags_of_the_head():
    cfg = serve()
    assert (cfg.embedding, cfg.pooling, cfg.embd_normalize, cfg.cors_origins, cfg.slots, cfg.metrics) == (
        False,
        None,
        2,
        "*",
        True,
        True,
    )
    assert (cfg.aliases, cfg.tags) == ((), ())
    cfg = serve(
        "--embeddings",
        "--pooling",
        "last",
        "--embd-normalize",
        "-1",
        "--cors-origins",
        " localhost ",
        "--no-slots",
        "--no-metrics",
        "-a",
        "b, a,,b",
        "--tags",
        "x",
    )
    assert (cfg.embedding, cfg.pooling, cfg.embd_normalize, cfg.cors_origins, cfg.slots, cfg.metrics) == (
        True,
        "last",
        -1,
        "localhost",
        False,
        False,
    )
    assert (cfg.aliases, cfg.tags) == (("a", "b"), ("x",))  # sorted: the first is the model's id
    assert (serve().overlap, serve("--overlap").overlap, serve("--no-overlap").overlap) == (None, True, False)
    with pytest.raises(SystemExit):
        serve("--pooling", "max")
    for flag in ("--reranking", "--rerank"):  # llama-server's: embeddings on, pooling rank
        assert (serve(flag).embedding, serve(flag, "--pooling", "rank").pooling) == (True, "rank")


def test_peer_config_defaults():
    cfg = peer_config(build_parser().parse_args(["peer"]), {})
    assert (cfg.port, cfg.rpc.port, cfg.rpc.host, cfg.rpc.auth_token) == (8090, 8091, "127.0.0.1", None)


@pytest.mark.parametrize(
    "argv, env, key",
    [
        (["--parallel", "0"], {}, "--parallel"),
        (["--ctx", "0"], {}, "--ctx"),
        (["--rpc-queue", "-1"], {}, "--rpc-queue"),
        (["--max-queue", "-1"], {}, "--max-queue"),
        (["--max-body", "10"], {}, "--max-body"),
        (["-n", "-2"], {}, "--n-predict"),
        (["--draft-max", "99", "--spec-type", "ngram"], {}, "draft max"),
        ([], {"HYDRA_RPC_SPIN_MS": "fast"}, "HYDRA_RPC_SPIN_MS"),
        (["--slot-save-path", "/nonexistent/slots"], {}, "--slot-save-path"),
        ([], {"HYDRA_RPC_SPIN_MS": "-3"}, "HYDRA_RPC_SPIN_MS"),
        (["--cors-origins", " "], {}, "--cors-origins"),
        (["--reranking", "--pooling", "mean"], {}, "--reranking"),
        (["--sleep-idle-seconds", "0"], {}, "--sleep-idle-seconds"),
        (["--sleep-idle-seconds", "-2"], {}, "--sleep-idle-seconds"),
    ],
)
def test_bad_settings_name_their_key(argv, env, key):
    with pytest.raises(UserError, match=key):
        serve(*argv, env=env)


@pytest.mark.parametrize(
    ("value", "device", "seconds"),
    [
        (None, "cpu", 0.0),
        ("", "cpu", 0.0),
        ("50", "cpu", 0.05),
        (None, "cuda:0", GPU_SPIN_S),
        ("", "cuda", GPU_SPIN_S),
        ("0", "cuda", 0.0),
        ("5", "cuda", 0.005),
    ],
)
def test_spin_budget_from_env_and_device(value, device, seconds):
    env = {} if value is None else {"HYDRA_RPC_SPIN_MS": value}
    assert serve(env=env).rpc.spin_seconds(device) == pytest.approx(seconds)
    assert RpcSettings(spin_ms=None).spin_seconds("cpu") == 0.0


def test_every_environment_variable_is_documented_in_the_readme():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert all(name in readme for name in ENVIRONMENT)


def test_every_subcommand_help_names_each_default_once():
    import argparse

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in subparsers.choices.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
                continue
            help_text = formatter._get_help_string(action) % {"default": action.default}
            has_default = action.default not in (None, False, [])
            assert help_text, (name, action.option_strings)  # every flag says what it does
            assert help_text.count("default") == (1 if has_default or "default" in (action.help or "") else 0), (
                name,
                help_text,
            )
        assert "(default: None)" not in parser.format_help()


def test_prompt_batch_defaults_to_one_gpu_ubatch_and_the_flag_wins(monkeypatch, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert serve("--model", str(model), "--device", "cpu").batch_tokens == 256
    assert serve("--model", str(model), "--device", "cpu", "-b", "64").batch_tokens == 64
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # "auto" resolves to the GPU
    assert serve("--model", str(model)).batch_tokens == 512
    assert serve("--model", str(model), "-b", "300").batch_tokens == 300


def test_the_cublas_workspace_workers_set_is_what_the_memory_estimate_counts():
    """CUBLAS_WORKSPACE_CONFIG is ":KiB per chunk:chunks" (read by torch); the estimate counts
    CUBLAS_WORKSPACE_BYTES per stream."""
    kib, chunks = (int(x) for x in cuda_env()["CUBLAS_WORKSPACE_CONFIG"].split(":")[1:])
    assert kib * 1024 * chunks == CUBLAS_WORKSPACE_BYTES
