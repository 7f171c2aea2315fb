#!/usr/bin/env bash
# The coordinator in etcd across hosts (issue 22), over the namespace harness's bridge: etcd
# in its own namespace, a leader and a standby coordinator each in theirs, 3 servers and a
# worker, every process started by hand with the per-role commands of README's
# "Coordinators in etcd" (`--etcd`, no `--coordinator`). --at seconds after training
# starts, the leader's host goes off the network (its veth down: it can reach neither etcd
# nor the members); --cont seconds later it comes back. The goals: the standby takes over
# and the run ends at `ftrec train`'s digest; the old leader, back on the network, learns it
# was deposed and exits saying so, having changed nothing. Prints one JSON line. Needs root.
#
#   tools/netns-coordinator.sh [--at S] [--cont S] [--steps N] [--time-limit S] [--ci]
#   (or tools/netns-harness.sh coordinator ...)
# --ci asserts the goals (exit 1 with FAIL lines otherwise) and prints SKIPPED without root.
set -euo pipefail
NETNS_HARNESS_LIB=1
# shellcheck source=netns-harness.sh
source "$(dirname "$0")/netns-harness.sh"

# shellcheck source=netns-etcd.sh
source "$ROOT/tools/netns-etcd.sh"
MEMBERS=(e c c2 s0 s1 s2 w0)

AT=2 CONT=6 CI=0
while [ $# -gt 0 ]; do
    case $1 in
        --ci) CI=1 ;;
        --at) AT=$2; shift ;;
        --cont) CONT=$2; shift ;;
        --steps) STEPS=$2; shift ;;
        --time-limit) TIME_LIMIT=$2; shift ;;
        -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
        *) die "coordinator: unknown argument $1" ;;
    esac
    shift
done
etcd_preconditions
etcd_job coordinator ec /ftrec/netns
reference=$REFERENCE
trap teardown EXIT
trap 'exit 130' INT TERM
net_up
t_start=$(now_ms)
DEADLINE=$(( t_start + ${TIME_LIMIT%.*} * 1000 ))
start_etcd
# One command per role, as README gives them.
start_coordinators
leader_pid=$LEADER_PID standby_pid=$STANDBY_PID
start_members 3 0 1

result=ok t_train="" t_cut="" t_back=""
while :; do
    now=$(now_ms)
    if [ -z "$t_train" ] && grep -q "training-start" "$RUN/logs/leader.log"; then
        t_train=$now
    fi
    if [ -n "$t_train" ] && [ -z "$t_cut" ] &&
        [ "$now" -ge $(( t_train + $(python3 -c "print(int(float('$AT') * 1000))") )) ]; then
        ip link set "$P-ch" down
        t_cut=$now
        say "the leader's host is off the network"
    fi
    if [ -n "$t_cut" ] && [ -z "$t_back" ] &&
        [ "$now" -ge $(( t_cut + $(python3 -c "print(int(float('$CONT') * 1000))") )) ]; then
        ip link set "$P-ch" up
        t_back=$now
        say "the old leader's host is back"
    fi
    if ! kill -0 "$standby_pid" 2> /dev/null && [ -n "$t_back" ]; then
        break
    fi
    if ! kill -0 "$standby_pid" 2> /dev/null && [ -z "$t_cut" ]; then
        result="the standby exited before the fault"
        break
    fi
    if past; then
        result="timed out after $TIME_LIMIT s"
        break
    fi
    sleep 0.05
done
# The old leader learns it was deposed once it hears from etcd or a server again.
old_exit=""
for _ in $(seq 1 200); do
    kill -0 "$leader_pid" 2> /dev/null || break
    sleep 0.05
done
if ! kill -0 "$leader_pid" 2> /dev/null; then
    wait "$leader_pid" 2> /dev/null && old_exit=0 || old_exit=$?
fi
standby_rc=0
wait "$standby_pid" 2> /dev/null || standby_rc=$?
t_end=$(now_ms)
line=$(python3 - "$result" "$reference" "$RUN/logs/standby.out" "$RUN/logs/leader.log" \
    "$standby_rc" "${old_exit:-}" "$t_start" "$t_end" "$AT" "$CONT" "$RUN" << 'PY'
import json, sys
result, reference, report_path, old_log, standby_rc, old_exit, t0, t1, at, cont, run = sys.argv[1:]
try:
    report = json.load(open(report_path))
except Exception:
    report = {}
failovers = report.get("coordinator_failovers") or []
text = open(old_log, errors="replace").read()
print(json.dumps({
    "fault": "coordinator-link-down",
    "result": result if standby_rc == "0" or result != "ok" else f"standby exited {standby_rc}",
    "at": float(at), "cont": float(cont),
    "seconds": round((int(t1) - int(t0)) / 1000, 2),
    "exact": report.get("state_digest") == reference,
    "state_digest": report.get("state_digest"),
    "lost_samples": report.get("lost_samples"),
    "parity_mismatches": report.get("parity_mismatches"),
    "failovers": len(failovers),
    "failover_seconds": failovers[0].get("failover_seconds") if failovers else None,
    "old_leader_exit": int(old_exit) if old_exit else None,
    "old_leader_deposed": "no longer leads the job" in text,
    "run_dir": run,
}))
PY
)
echo "$line"
[ "$CI" = 1 ] || exit 0
python3 - "$line" << 'PY'
import json, sys
r = json.loads(sys.argv[1])
checks = [
    (r["result"] == "ok", r["result"]),
    (r["exact"], f"digest {r['state_digest']} is not ftrec train's"),
    (r["lost_samples"] == 0, f"lost_samples {r['lost_samples']}"),
    (r["parity_mismatches"] == 0, f"parity_mismatches {r['parity_mismatches']}"),
    (r["failovers"] == 1, f"{r['failovers']} failovers"),
    (r["old_leader_deposed"], "the old leader did not say it was deposed"),
    (r["old_leader_exit"] not in (None, 0), f"the old leader's exit: {r['old_leader_exit']}"),
]
bad = [why for ok, why in checks if not ok]
print(("PASS" if not bad else "FAIL") + ": the leader's host off the network for "
      f"{r['cont']} s: the standby took over ({r['failover_seconds']} s), the run exact, the old "
      "leader deposed" + (": " + "; ".join(bad) if bad else ""))
sys.exit(1 if bad else 0)
PY
