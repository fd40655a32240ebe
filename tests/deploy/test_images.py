"""The frontend image carries no torch: its requirements are pyproject's minus the
engine's, the manifests run frontends from it, and a frontend really runs without
torch or transformers importable."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib
import yaml

from tests.stack import port_from_banner

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ENGINE_ONLY = {"torch", "transformers", "accelerate", "gguf", "huggingface-hub"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def test_frontend_requirements_are_pyprojects_without_the_engines() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {r for r in project["dependencies"] if _name(r) not in ENGINE_ONLY}
    wanted |= set(project["optional-dependencies"]["grpc"])  # the image serves --grpc-port
    lines = (DEPLOY / "frontend-requirements.txt").read_text().splitlines()
    listed = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert listed == wanted
    assert {_name(r) for r in project["dependencies"]} >= ENGINE_ONLY  # still split right


def test_frontends_run_from_the_image_without_torch() -> None:
    dockerfile = (DEPLOY / "Dockerfile.frontend").read_text()
    installs = [line for line in dockerfile.splitlines() if "pip install" in line]
    assert installs and all("torch" not in line for line in installs)
    assert any("--no-deps ." in line for line in installs)
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name in ("frontend1", "frontend2"):
        service = compose["services"][name]
        assert service["build"]["dockerfile"] == "deploy/Dockerfile.frontend", name
    manifests = yaml.safe_load_all((DEPLOY / "k8s" / "frontend.yaml").read_text())
    deployment = next(d for d in manifests if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "wsinfer:frontend"


def test_a_frontend_serves_without_torch_or_transformers(redis_url: str) -> None:
    blocked = sorted(ENGINE_ONLY)
    script = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None  # import raises ImportError\n"
        "from wsinfer.cli import main\n"
        f"sys.exit(main(['frontend', '--port', '0', '--redis-url', {redis_url!r}]))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-u", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port = port_from_banner(process.stdout.readline(), "frontend")
        import urllib.error
        import urllib.request

        try:
            status = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").status
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status == 503  # up and answering; no engine, so not healthy
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/").read()
        assert b"wsinfer chat" in page
    finally:
        process.terminate()
        process.wait(30)
