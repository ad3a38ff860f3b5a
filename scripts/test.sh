#!/usr/bin/env bash
# The project's test command: formatting, lints, the real model, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
PROFILE=dev scripts/fetch_smollm2.sh
scripts/fetch_datasets.sh mtbench
# The dump tests read the Arrow shards from Python too (scripts/check_dump.py); the serve test
# drives the server with the official openai client (tests/serve/openai_client.py).
python3 -m pip install --quiet --disable-pip-version-check pyarrow==26.0.1 polars==2.1.0 numpy==2.4.6 openai==3.57.0
# NVRTC alone (no GPU, no driver): the kernels in kernels/ are compiled in CI exactly as the GPU
# paths compile them at start-up (crates/tandem-cuda/tests/nvrtc.rs).
if [[ ! -e .nvrtc/nvidia/cu13/lib/libnvrtc.so.13 ]]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target .nvrtc nvidia-cuda-nvrtc==13.5.37
fi
export LD_LIBRARY_PATH="$PWD/.nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TANDEM_REQUIRE_NVRTC=1
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
