#!/usr/bin/env bash
# Fuzzes every input decoder ftrec exposes (crates/ftrec-fuzz-targets) with libFuzzer,
# SECONDS each (default 600), growing fuzz/corpus/<target>. Needs the nightly toolchain
# and cargo-fuzz. A crash lands in fuzz/artifacts/<target>/: fix it, then copy the input
# into fuzz/corpus/<target>/ so `cargo test -p ftrec-fuzz-targets` replays it on stable.
#   scripts/fuzz.sh [SECONDS]      TARGETS="chunk push" scripts/fuzz.sh 60
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
targets=${TARGETS:-"chunk dense manifest chunk_list ftrd criteo_line schema push"}
command -v cargo-fuzz >/dev/null || cargo +nightly install cargo-fuzz
failed=""
for t in $targets; do
  echo "== $t: ${seconds}s"
  cargo +nightly fuzz run "$t" -- -max_total_time="$seconds" -rss_limit_mb=4096 -max_len=65536 \
    || failed="$failed $t"
done
# Keep the corpora small: only inputs that add coverage.
for t in $targets; do
  cargo +nightly fuzz cmin "$t" >/dev/null 2>&1 || true
done
if [ -n "$failed" ]; then
  echo "crashes in:$failed (inputs under fuzz/artifacts/)" >&2
  exit 1
fi
