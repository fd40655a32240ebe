"""deploy/ is checked with the tools' own validators: the Kubernetes manifests
against the bundled Kubernetes schemas (strict), compose.yaml against the
Compose spec's schema, the nginx config with ``nginx -t``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.nginx import NginxProxy

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} is not installed (deploy/setup.sh --test installs it)")
    return str(path)


def test_manifests_validate_against_the_kubernetes_schemas() -> None:
    assert len(MANIFESTS) >= 4
    done = subprocess.run(
        [_tool("kubernetes-validate"), "--strict", *map(str, MANIFESTS)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_validator_catches_a_broken_manifest(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    text = (DEPLOY / "k8s" / "frontend.yaml").read_text()
    broken.write_text(text.replace("containerPort: 8000", "containerPort: eight-thousand"))
    done = subprocess.run([_tool("kubernetes-validate"), "--strict", str(broken)])
    assert done.returncode != 0


def test_compose_file_matches_the_compose_spec() -> None:
    done = subprocess.run(
        [
            _tool("check-jsonschema"),
            "--builtin-schema",
            "vendor.compose-spec",
            str(DEPLOY / "compose.yaml"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("nginx") is None, reason="needs nginx (Debian package)")
def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    proxy = NginxProxy(tmp_path, upstreams=[8001, 8002])
    assert proxy.check() == ""
