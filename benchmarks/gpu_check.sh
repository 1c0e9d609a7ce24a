#!/usr/bin/env bash
# Every check that needs a GPU, in one run under 8 minutes, ending in one table
# (see benchmarks/gpu_check.py for what it runs). Exit status: 0 all passed, 1 a check failed,
# 2 no CUDA device (nothing was run), 124 over time.
#   bash benchmarks/gpu_check.sh [--out DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Builds go to a fresh cache unless one is given, so the build time reported is a real build.
export LIGHTNING_ZERO_BUILD_DIR="${LIGHTNING_ZERO_BUILD_DIR:-${TMPDIR:-/tmp}/lightning_zero_gpu_check_build}"
timeout 470 python benchmarks/gpu_check.py "$@"
