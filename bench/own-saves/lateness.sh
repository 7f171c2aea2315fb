#!/usr/bin/env bash
# How late own saves are (`cpr.uncoordinated`): a failure-free run of the cluster tests'
# small model (steps of a few ms, saves every 20 steps staggered over 3 servers), and for
# each save the steps between its server's turn and the step it saved.
#
#   bench/own-saves/lateness.sh FTREC_BIN OUT_DIR [STEPS]
#
# Prints one JSON line: the saves taken, the turns there were, the median and largest
# lateness in steps, every lateness, and samples/s. A save is labelled with the step its
# shard had applied, so a lateness of -1 to -3 is a save asked at its turn while granted
# steps were still in flight.
set -euo pipefail
bin="$1"
out="$2"
steps="${3:-300}"
mkdir -p "$out"
data="$out/data"
[ -d "$data" ] || "$bin" data gen --rows 8000 --seed 2 --out "$data" --json > /dev/null
rm -rf "$out/run"
"$bin" cluster run --data "$data" --steps "$steps" --run-dir "$out/run" --time-limit 240 --json \
    --seed 4 --set model.rows_per_table=2000 --set model.dim=16 --set 'model.bottom=[32, 16]' \
    --set 'model.top=[32, 1]' --set train.batch_size=128 --set 'optimizer.sparse.kind="adam"' \
    --servers 3 --workers 1 --deterministic --no-eval --ft partial \
    --set checkpoint.every_steps=20 --set cpr.uncoordinated=true > "$out/report.json"
python3 - "$out" "$steps" <<'PY'
import json, re, statistics, sys
out, steps = sys.argv[1], int(sys.argv[2])
every, servers = 20, 3
timeline = json.load(open(f"{out}/run/timeline.json"))
late = []
for e in timeline["events"]:
    d = e.get("detail", "")
    if e.get("kind") == "checkpoint-end" and "own save" in d:
        step = int(re.search(r"step (\d+)", d).group(1))
        j = int(re.search(r"server (\d+)", d).group(1))
        offset = j * every // servers
        # The turn it answers: the last one at or before the step saved (3 steps of slack
        # for steps granted but not yet applied).
        turn = max(t for t in range(1, steps + 1) if t % every == offset and t <= step + 3)
        late.append(step - turn)
turns = sum(1 for j in range(servers) for t in range(1, steps) if t % every == j * every // servers)
report = json.load(open(f"{out}/report.json"))
print(json.dumps({
    "saves": len(late), "turns": turns,
    "lateness_steps_median": statistics.median(late), "lateness_steps_max": max(late),
    "lateness_steps": late, "samples_per_sec": round(report["samples_per_sec"]),
}))
PY
