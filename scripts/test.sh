#!/usr/bin/env bash
# The project's test command: formatting, lints, the real model, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
PROFILE=dev scripts/fetch_smollm2.sh
scripts/fetch_datasets.sh mtbench
# The dump tests read the Arrow shards from Python too (scripts/check_dump.py).
python3 -m pip install --quiet --disable-pip-version-check pyarrow==26.0.1 polars==2.1.0 numpy==2.4.6
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
