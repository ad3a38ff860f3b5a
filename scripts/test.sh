#!/usr/bin/env bash
# The project's test command: formatting, lints, the real model, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
PROFILE=dev scripts/fetch_smollm2.sh
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
