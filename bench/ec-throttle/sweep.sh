#!/bin/bash
# The throttled rebuild's rate against the training it keeps (issue 23): one `--ft ec` run
# without a failure, then one SIGKILL run per cap, on `bench ec`'s job (tiny preset, Adagrad
# rows, Adam dense, 3 servers, 2 workers, a spare, 300 steps). Prints, per cap, the steps
# committed per second from the resume to full redundancy (or to the last step, if the
# rebuild outlasted the steps) over the failure-free run's.
#
# usage: bench/ec-throttle/sweep.sh FTREC DATA OUT [CAP ...]   (caps in bytes/s; 0 = none)
set -euo pipefail
BIN=$1; DATA=$2; OUT=$3; shift 3
CAPS=("$@"); [ ${#CAPS[@]} -eq 0 ] && CAPS=(40000000 100000000 150000000 200000000 300000000 0)
mkdir -p "$OUT"
run() { # name, extra args...
  local name=$1; shift
  rm -rf "$OUT/$name"
  "$BIN" cluster run --data "$DATA" --preset tiny --steps 300 --servers 3 --workers 2 --spares 1 \
    --ft ec --set 'optimizer.sparse.kind="adagrad"' --set 'optimizer.dense.kind="adam"' \
    --no-eval --run-dir "$OUT/$name" --json "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
}
run none
for cap in "${CAPS[@]}"; do
  run "cap-$cap" --set "ec.rebuild_bytes_per_sec=$cap" --kill server:1@4s
done
python3 - "$OUT" "${CAPS[@]}" <<'PY'
import json, sys
out, caps = sys.argv[1], sys.argv[2:]
none = json.load(open(f"{out}/none.json"))
normal = none["steps"] / none["train_seconds"]  # no rebuild to wait for
print(f"failure-free: {normal:.2f} steps/s")
for cap in caps:
    r = json.load(open(f"{out}/cap-{cap}.json"))
    x = r["recoveries"][0]
    # To full redundancy, or to the last step if the rebuild outlasted the steps.
    end = min(x["detected_at"] + x["degraded_seconds"], r.get("last_step_at") or 1e18)
    window = end - x["resumed_at"]
    degraded = x["steps_committed_while_degraded"] / window
    rate = x["rebuild_bytes"] / x["rebuild_seconds"] / 1e6
    print(f"cap {int(cap) / 1e6:6.0f} MB/s: rebuild {rate:5.0f} MB/s over {window:5.2f} s, "
          f"{degraded:.2f} steps/s, ratio {degraded / normal:.3f}")
PY
