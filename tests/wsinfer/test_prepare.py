"""``wsinfer prepare`` (wsinfer/prepare.py): which kernel variants each switch builds,
the model conversion, and a failure that is one line and an exit status, with the
other step still done."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from wsinfer import prepare
from wsinfer.cli import build_parser, main
from wsinfer.engine import native_build


@pytest.mark.parametrize(
    ("argv", "kernels"),
    [([], None), (["--all"], "all"), (["--best"], "best"), (["--no-kernels"], "none")],
)
def test_the_switches_name_the_variants(argv: list[str], kernels: str | None) -> None:
    assert build_parser().parse_args(["prepare", *argv]).kernels == kernels


def test_the_switches_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prepare", "--all", "--best"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_no_switch_builds_every_variant_this_cpu_runs_and_converts_the_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WSINFER_CACHE_DIR", str(tmp_path))
    built: list[str] = []
    monkeypatch.setattr(native_build, "build", lambda cache, variant: built.append(variant.name))
    models: list[str | None] = []
    monkeypatch.setattr(prepare, "convert_model", lambda cache, spec: models.append(spec) or 0)
    assert main(["prepare", "--model", "some.gguf"]) == 0
    runs = native_build.runnable(native_build.variants_for(), native_build.cpu_flags())
    assert built == [variant.name for variant in runs] and models == ["some.gguf"]


def test_a_failed_build_is_one_line_and_the_model_still_converts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WSINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    models: list[str | None] = []
    monkeypatch.setattr(prepare, "convert_model", lambda cache, spec: models.append(spec) or 0)
    with structlog.testing.capture_logs() as logs:
        assert prepare.run(build_parser().parse_args(["prepare", "--best"])) == 1
    errors = [entry["event"] for entry in logs if entry["log_level"] == "error"]
    assert len(errors) == 1 and "no C++ compiler" in errors[0]
    assert models == [None]


def test_a_fake_model_needs_no_conversion(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        assert prepare.convert_model(tmp_path, "fake:10") == 0
    assert logs[0]["event"] == "nothing to convert: a fake model"
    assert not list(tmp_path.iterdir())
