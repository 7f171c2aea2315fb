#!/usr/bin/env bash
# A server that goes silent, on loopback: SIGSTOP server 1 of a deterministic
# erasure-coded `cluster run` (3 servers, 1 worker) a few seconds in, and report
# the run's time, whether it ended with `ftrec train`'s model, and its parity.
#   BIN=target/release/ftrec STEPS=1500 AFTER=3 [CONT=8] [NOSTOP=1] tools/freeze-loopback.sh
# CONT=S resumes the frozen process S seconds later (a zombie); NOSTOP=1 runs the
# same job without the fault, for the baseline.
set -euo pipefail
BIN=${BIN:-target/release/ftrec}
STEPS=${STEPS:-1500}
AFTER=${AFTER:-3}
FT=${FT:-ec}
WORK=${WORK:-$(mktemp -d)}
DATA=$WORK/data
MODEL=(--seed 4 --set model.rows_per_table=2000 --set model.dim=16
       --set 'model.bottom=[32,16]' --set 'model.top=[32,1]' --set train.batch_size=128)
[ -d "$DATA" ] || "$BIN" data gen --rows 20000 --seed 2 --out "$DATA" --json > /dev/null
reference=$("$BIN" train --data "$DATA" --steps "$STEPS" "${MODEL[@]}" --json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["state_digest"])')
rm -rf "$WORK/run"
start=$(date +%s.%N)
"$BIN" cluster run --data "$DATA" --steps "$STEPS" --servers 3 --workers 1 --deterministic \
    --ft "$FT" --no-eval --run-dir "$WORK/run" --time-limit 300 --json "${MODEL[@]}" \
    > "$WORK/out.json" 2> "$WORK/err.txt" &
launcher=$!
sleep "$AFTER"
# Only the launcher's own child: another job's `server --id 1` on this host is not ours.
frozen=$(pgrep -P "$launcher" -f " server .*--id 1( |$)" | head -1)
[ -n "$frozen" ] || { echo "freeze-loopback: server 1 of launcher $launcher not found" >&2; exit 2; }
if [ -z "${NOSTOP:-}" ]; then
    kill -STOP "$frozen"
    [ -n "${CONT:-}" ] && { sleep "$CONT"; kill -CONT "$frozen" 2>/dev/null || true; } &
fi
rc=0
wait "$launcher" || rc=$?
end=$(date +%s.%N)
kill -KILL "$frozen" 2>/dev/null || true
python3 - "$WORK/out.json" "$reference" "$rc" "$start" "$end" <<'PY'
import json, sys
path, reference, rc, start, end = sys.argv[1:]
text = open(path).read().strip()
o = json.loads(text) if text else {}
print(json.dumps({
    "exit": int(rc),
    "wall_seconds": round(float(end) - float(start), 2),
    "train_seconds": o.get("train_seconds"),
    "exact": o.get("state_digest") == reference,
    "parity_mismatches": o.get("parity_mismatches"),
    "replica_mismatches": o.get("replica_mismatches"),
    "recoveries": len(o.get("recoveries", [])),
    "zombies_refused": o.get("zombies_refused"),
}))
PY
