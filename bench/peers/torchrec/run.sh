#!/usr/bin/env bash
# ftrec against TorchRec on the same DLRM step, in one session, with the same threads.
#
#   bench/peers/torchrec/run.sh [--threads N] [--warmup W] [--steps S] [--rounds R]
#
# Builds ftrec (release) unless FTREC_BIN names a binary, runs `ftrec bench train --json`
# and dlrm.py alternately R times (so a noisy neighbour hits both alike), writes every JSON
# line to ${OUT:-bench-peers-torchrec}/, and prints each side's median samples/s and the
# ratio ftrec / TorchRec. With FTREC_BASE naming another ftrec binary (a baseline build),
# each round runs it too, and the summary adds its median and ratio: before and after a
# change, against the same TorchRec runs. FTREC_SET (and FTREC_BASE_SET for the baseline)
# hold space-separated `key=value` settings passed as `--set`, e.g.
# FTREC_SET="train.huge_pages=true"; the summary records them. Needs the venv from setup.sh.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
venv="${FTREC_PEER_VENV:-${HOME}/.cache/ftrec-peers/torchrec}"
threads="$(nproc)"
warmup=5
steps=60
rounds=3
while [ $# -gt 0 ]; do
    case "$1" in
        --threads) threads="$2"; shift 2 ;;
        --warmup) warmup="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ ! -x "$venv/bin/python" ]; then
    echo "run.sh: no venv at $venv: run $here/setup.sh first" >&2
    exit 1
fi
if [ -z "${FTREC_BIN:-}" ]; then
    (cd "$repo" && cargo build --release -p ftrec)
    FTREC_BIN="${CARGO_TARGET_DIR:-$repo/target}/release/ftrec"
fi
out="${OUT:-bench-peers-torchrec}"
mkdir -p "$out"
: > "$out/ftrec.jsonl"
: > "$out/torchrec.jsonl"
: > "$out/base.jsonl"

set_args=()
for kv in ${FTREC_SET:-}; do set_args+=(--set "$kv"); done
base_set_args=()
for kv in ${FTREC_BASE_SET:-}; do base_set_args+=(--set "$kv"); done

for r in $(seq 1 "$rounds"); do
    if [ -n "${FTREC_BASE:-}" ]; then
        echo "round $r/$rounds: baseline ftrec bench train ($FTREC_BASE)" >&2
        "$FTREC_BASE" bench train --preset tiny --threads "$threads" --warmup "$warmup" \
            --steps "$steps" --json "${base_set_args[@]}" >> "$out/base.jsonl"
    fi
    echo "round $r/$rounds: ftrec bench train" >&2
    "$FTREC_BIN" bench train --preset tiny --threads "$threads" --warmup "$warmup" \
        --steps "$steps" --json "${set_args[@]}" >> "$out/ftrec.jsonl"
    echo "round $r/$rounds: TorchRec dlrm.py" >&2
    "$venv/bin/python" "$here/dlrm.py" --threads "$threads" --warmup "$warmup" \
        --steps "$steps" >> "$out/torchrec.jsonl"
done

"$venv/bin/python" - "$out" "$threads" <<'PY'
import json, os, statistics, sys
out, threads = sys.argv[1], int(sys.argv[2])
def runs(name):
    with open(f"{out}/{name}.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]
f, t = runs("ftrec"), runs("torchrec")
fs = statistics.median(r["samples_per_sec"] for r in f)
ts = statistics.median(r["samples_per_sec"] for r in t)
summary = {
    "threads": threads,
    "batch_size": f[0]["batch_size"],
    "rounds": len(f),
    "ftrec_samples_per_sec": fs,
    "ftrec_runs": [round(r["samples_per_sec"]) for r in f],
    "ftrec_step_ms_median": statistics.median(r["step_ms_median"] for r in f),
    "torchrec_samples_per_sec": ts,
    "torchrec_runs": [round(r["samples_per_sec"]) for r in t],
    "torchrec_step_ms_median": statistics.median(r["step_ms_median"] for r in t),
    "torchrec_versions": t[0]["versions"],
    "ratio": fs / ts,
    "ftrec_set": os.environ.get("FTREC_SET", ""),
}
b = runs("base")
if b:
    bs = statistics.median(r["samples_per_sec"] for r in b)
    summary["base_samples_per_sec"] = bs
    summary["base_runs"] = [round(r["samples_per_sec"]) for r in b]
    summary["base_ratio"] = bs / ts
    summary["base_set"] = os.environ.get("FTREC_BASE_SET", "")
with open(f"{out}/summary.json", "w") as fh:
    json.dump(summary, fh, indent=2)
print(json.dumps(summary))
print(f"ftrec {fs:,.0f} samples/s, TorchRec {ts:,.0f} samples/s on {threads} threads: "
      f"ratio {fs / ts:.2f}x", file=sys.stderr)
PY
