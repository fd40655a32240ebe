"""The release workflow (.github/workflows/release.yml): valid for GitHub, run on a
version tag, builds and publishes both packages, and refuses a tag that is not the
version both packages carry. The README names no unpublished package as if it were."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from wsinfer import __version__

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"


def workflow() -> dict[Any, Any]:
    return dict(yaml.safe_load(WORKFLOW.read_text()))


def steps(job: str) -> list[dict[str, Any]]:
    return list(workflow()["jobs"][job]["steps"])


def test_the_workflow_matches_githubs_schema() -> None:
    tool = Path(sys.executable).parent / "check-jsonschema"
    if not tool.exists():
        pytest.skip("check-jsonschema is not installed (deploy/setup.sh --test installs it)")
    done = subprocess.run(
        [str(tool), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_version_tag_builds_and_publishes_both_packages() -> None:
    flow = workflow()
    assert flow[True]["push"]["tags"] == ["v*"]  # YAML reads the key `on` as True
    build = " ".join(s.get("run", "") for s in steps("build"))
    assert "python -m build" in build and "npm pack" in build
    assert any(s.get("uses", "").startswith("pypa/gh-action-pypi-publish") for s in steps("pypi"))
    assert workflow()["jobs"]["pypi"]["permissions"]["id-token"] == "write"
    assert any("npm publish" in s.get("run", "") for s in steps("npm"))


@pytest.mark.parametrize(("tag", "ok"), [(f"v{__version__}", True), ("v9.9.9", False)])
def test_the_tag_must_be_the_version_of_both_packages(tag: str, ok: bool) -> None:
    [check] = [s for s in steps("build") if s.get("name", "").startswith("The tag names")]
    npm_version = json.loads((ROOT / "clients" / "browser" / "package.json").read_text())
    assert npm_version["version"] == __version__
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", check["run"]],
        cwd=ROOT,
        env={"GITHUB_REF_NAME": tag, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert (done.returncode == 0) is ok, done.stdout + done.stderr


@pytest.mark.parametrize("readme", ["README.md", "clients/browser/README.md"])
def test_the_readmes_install_only_what_exists(readme: str) -> None:
    """Until they are published, `pip install wsinfer-stream` and `npm install
    wsinfer-client` fail for everyone: no README shows them as the way to install."""
    for line in (ROOT / readme).read_text().splitlines():
        command = line.split("#")[0].strip()
        assert command not in ("pip install wsinfer-stream", "npm install wsinfer-client"), line
