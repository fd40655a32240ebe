"""The command line: engine settings reach the engine, from flags or WSINFER_* variables,
and `wsinfer serve` hands its engine the same settings."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from wsinfer.cli import _engine_argv, build_parser, engine_configs, model_name
from wsinfer.engine.resolve import DEFAULT_HUB_MODEL, default_gguf_path


def engine_args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["engine", *argv])


def test_engine_flags_reach_the_engine_configs() -> None:
    config, core = engine_configs(
        engine_args(
            "--max-batch-size", "32", "--prefill-chunk", "256", "--kv-cache-mb", "100",
            "--kv-offload-cpu", "--idle-pause", "7", "--engine-id", "gpu0",
        )
    )  # fmt: skip
    assert (config.max_batch_size, config.idle_pause_s, config.engine_id) == (32, 7.0, "gpu0")
    assert core.max_batch_size == 32 and core.prefill_chunk_tokens == 256
    assert core.kv_cache_bytes == 100 << 20 and core.kv_offload_cpu is True


def test_defaults_keep_kv_on_the_device_within_two_gib() -> None:
    _, core = engine_configs(engine_args())
    assert core.kv_cache_bytes == 2 << 30 and core.kv_offload_cpu is False
    assert core.prefill_chunk_tokens == 512 and core.max_batch_size == 16


def test_environment_variables_set_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WSINFER_KV_CACHE_MB", "64")
    monkeypatch.setenv("WSINFER_KV_OFFLOAD_CPU", "true")
    monkeypatch.setenv("WSINFER_MAX_BATCH_SIZE", "8")
    _, core = engine_configs(engine_args())
    assert (core.kv_cache_bytes, core.kv_offload_cpu, core.max_batch_size) == (64 << 20, True, 8)


def test_serve_hands_its_engine_the_same_settings() -> None:
    serve = build_parser().parse_args(
        ["serve", "--kv-cache-mb", "10", "--kv-offload-cpu", "--prefill-chunk", "64",
         "--max-batch-size", "4", "--model", "/models/m"]
    )  # fmt: skip
    engine = engine_args(*_engine_argv(serve))
    assert engine.model == "/models/m"
    assert engine_configs(engine)[1] == engine_configs(
        engine_args("--kv-cache-mb", "10", "--kv-offload-cpu", "--prefill-chunk", "64",
                    "--max-batch-size", "4")
    )[1]  # fmt: skip


@pytest.mark.parametrize("flag", ["--kv-cache-mb", "--prefill-chunk", "--max-batch-size"])
@pytest.mark.parametrize("value", ["0", "-5", "lots"])
def test_bad_sizes_are_refused_with_a_message(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        engine_args(flag, value)
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("variable", "value", "flag"),
    [
        ("WSINFER_SESSION_TTL", "soon", "--session-ttl"),
        ("WSINFER_SESSION_TTL", "0", "--session-ttl"),  # EXPIRE 0 would delete every session
        ("WSINFER_LEASE_MS", "0", "--lease-ms"),  # every turn would look abandoned
        ("WSINFER_IDLE_PAUSE", "a minute", "--idle-pause"),
        ("WSINFER_PORT", "http", "--port"),
    ],
)
def test_a_bad_environment_value_is_refused_like_a_bad_flag(
    variable: str,
    value: str,
    flag: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(variable, value)
    command = "frontend" if flag in ("--session-ttl", "--port") else "engine"
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_numeric_environment_values_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WSINFER_SESSION_TTL", "120")
    monkeypatch.setenv("WSINFER_PORT", "0")
    frontend = build_parser().parse_args(["frontend"])
    assert (frontend.session_ttl, frontend.port) == (120, 0)
    monkeypatch.setenv("WSINFER_IDLE_PAUSE", "2.5")
    monkeypatch.setenv("WSINFER_LEASE_MS", "500")
    config, _ = engine_configs(engine_args())
    assert (config.idle_pause_s, config.lease_ms, config.session_ttl_s) == (2.5, 500, 120)


def test_serve_hands_its_engine_its_session_ttl() -> None:
    serve = build_parser().parse_args(["serve", "--session-ttl", "60"])
    assert engine_configs(engine_args(*_engine_argv(serve)))[0].session_ttl_s == 60


def test_serve_hands_its_engine_the_model_revision_and_chat_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "template.jinja").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)
    serve = build_parser().parse_args(
        ["serve", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--revision", "v1",
         "--chat-template", "template.jinja"]
    )  # fmt: skip
    engine = engine_args(*_engine_argv(serve))
    assert (engine.model, engine.revision) == ("Qwen/Qwen2.5-0.5B-Instruct", "v1")
    assert engine.chat_template == str(tmp_path / "template.jinja")


def test_a_missing_chat_template_file_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        engine_args("--chat-template", str(tmp_path / "nope.jinja"))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and "No such file or directory" in err


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["serve", "frontend", "engine", "chat"])
def test_every_flag_has_a_help_line_and_shows_its_default(command: str) -> None:
    parser = subcommands()[command]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue  # internal (--exit-with-parent): not for people
        assert action.help, f"{command} {action.option_strings} has no help"
    text = parser.format_help()
    if command != "chat":
        assert "(default: 60)" in text  # --idle-pause
    if command in ("serve", "frontend"):
        assert "(default: 8000)" in text and "(default: 127.0.0.1)" in text
        assert "(default: 256)" in text  # --max-queued-turns


def test_the_top_level_help_is_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "WSINFER_<FLAG>" in text
    assert "argparse" not in text and "``" not in text  # no notes from the source


def test_help_never_prints_a_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WSINFER_API_KEYS", "key-one")
    monkeypatch.setenv("WSINFER_REDIS_URL", "redis://:hunter2@redis:6379/0")
    text = subcommands()["frontend"].format_help()
    assert "key-one" not in text and "hunter2" not in text
    assert "redis://:***@redis:6379/0" in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"wsinfer {version('wsinfer-stream')}"


def test_a_busy_port_is_reported_before_anything_heavy_is_imported(tmp_path: Path) -> None:
    """`wsinfer serve --model X` on a busy port: one line, exit 1, and torch never
    imported (that import alone took seconds before the port was even tried)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "wsinfer", "serve",
             "--port", str(port), "--model", "Qwen/Qwen2.5-0.5B-Instruct"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )  # fmt: skip
    lines = (done.stdout + done.stderr).splitlines()
    imported = [line.split("|")[-1].strip() for line in lines if line.startswith("import time:")]
    errors = [line for line in lines if "[error" in line]
    assert done.returncode == 1
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0]
    assert "address already in use" in errors[0]
    assert "torch" not in imported and "transformers" not in imported


def test_serve_with_the_fake_model_does_not_import_torch_either() -> None:
    # Its flags are checked in the supervisor, where torch's import of numpy would
    # swallow a Ctrl-C that lands in it (serve then never stopped).
    check = (
        "import sys; from wsinfer.cli import build_parser; "
        "build_parser().parse_args(['serve', '--model', 'fake:100:stamp']); "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)


def test_quantized_cpu_weights_are_the_default_and_opting_out_reaches_serves_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert engine_configs(engine_args())[1].quantized_cpu_weights is True
    off = engine_args("--no-quantized-cpu-weights")
    assert engine_configs(off)[1].quantized_cpu_weights is False
    for flag, expected in [
        ("--no-quantized-cpu-weights", False),
        ("--quantized-cpu-weights", True),
    ]:
        serve = build_parser().parse_args(["serve", flag])
        core = engine_configs(engine_args(*_engine_argv(serve)))[1]
        assert core.quantized_cpu_weights is expected
    monkeypatch.setenv("WSINFER_QUANTIZED_CPU_WEIGHTS", "0")
    assert engine_configs(engine_args())[1].quantized_cpu_weights is False
    monkeypatch.setenv("WSINFER_QUANTIZED_CPU_WEIGHTS", "1")
    assert engine_configs(off)[1].quantized_cpu_weights is False  # the flag wins


def test_prefix_caching_is_the_default_and_opting_out_reaches_serves_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert engine_configs(engine_args())[1].prefix_caching is True
    for flag, expected in [("--no-prefix-caching", False), ("--prefix-caching", True)]:
        serve = build_parser().parse_args(["serve", flag])
        core = engine_configs(engine_args(*_engine_argv(serve)))[1]
        assert core.prefix_caching is expected
    monkeypatch.setenv("WSINFER_PREFIX_CACHING", "0")
    assert engine_configs(engine_args())[1].prefix_caching is False


def test_the_kv_dtype_reaches_serves_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_configs(engine_args())[1].kv_dtype == "auto"
    serve = build_parser().parse_args(["serve", "--kv-dtype", "float16"])
    assert engine_configs(engine_args(*_engine_argv(serve)))[1].kv_dtype == "float16"
    monkeypatch.setenv("WSINFER_KV_DTYPE", "float32")
    assert engine_configs(engine_args())[1].kv_dtype == "float32"
    with pytest.raises(SystemExit):
        engine_args("--kv-dtype", "int8")


def test_dash_capital_v_is_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["-V"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("wsinfer ")


def test_an_unknown_flag_shows_the_commands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--bogus"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("usage: wsinfer serve ") and "unrecognized arguments: --bogus" in err


@pytest.mark.parametrize(
    ("variable", "value", "command", "said"),
    [
        ("WSINFER_LOG_FORMAT", "xml", "serve", "invalid choice (choose from console, json)"),
        ("WSINFER_DTYPE", "int8", "engine", "invalid choice"),
        ("WSINFER_PREFIX_CACHING", "maybe", "engine", "expected one of 1, true"),
        ("WSINFER_PORT", "abc", "serve", "invalid int value: 'abc'"),
    ],
)
def test_a_bad_environment_value_is_refused_as_the_flag_would_be(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    value: str,
    command: str,
    said: str,
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"wsinfer {command}: error:" in err and said in err


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("YES", True)])
def test_an_environment_switch_reads_yes_and_no(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    monkeypatch.setenv("WSINFER_PREFIX_CACHING", value)
    assert build_parser().parse_args(["engine"]).prefix_caching is on


@pytest.mark.slow
def test_a_file_that_is_not_gguf_and_cuda_without_cuda_are_one_line(
    tmp_path: Path, redis_url: str
) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a model at all")
    for extra, said in [
        (["--model", str(bad)], "is not a GGUF file"),
        (["--device", "cuda", "--model", str(bad)], "--device cuda: this torch"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "wsinfer", "engine", "--redis-url", redis_url, *extra],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        errors = [line for line in done.stderr.splitlines() if "[error" in line]
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr and len(errors) == 1 and said in errors[0]


def test_not_gguf_and_no_cuda_are_refused_before_anything_loads(tmp_path: Path) -> None:
    import torch

    from wsinfer.engine.defaults import resolve_device
    from wsinfer.engine.model import ModelLoadError, converted_gguf_dir

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, say")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        converted_gguf_dir(bad, tmp_path / "cache")
    assert not (tmp_path / "cache" / "models").exists()  # nothing began
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda:1: this torch is a CPU build"):
            resolve_device("cuda:1")


def test_serve_lists_its_model_by_the_name_its_engine_reports(tmp_path: Path) -> None:
    """A GGUF file's stem, a directory's name, a Hub id as given; ``--model-name`` wins,
    and a frontend on its own (which is not told the model) keeps ``wsinfer``."""
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"")
    (tmp_path / "my-model").mkdir()
    cases = {
        ("serve", "--model", str(gguf)): "SmolLM2-135M-Instruct.Q4_1",
        ("serve", "--model", str(tmp_path / "my-model")): "my-model",
        ("serve", "--model", "org/some-model"): "org/some-model",
        ("serve", "--model", "fake:100"): "fake:100",
        ("serve", "--model", "org/m", "--model-name", "alias"): "alias",
        ("frontend",): "wsinfer",
    }
    for argv, name in cases.items():
        assert model_name(build_parser().parse_args(list(argv))) == name, argv
    default = model_name(build_parser().parse_args(["serve"]))
    gguf_default = default_gguf_path()
    assert default == (gguf_default.stem if gguf_default else DEFAULT_HUB_MODEL)
