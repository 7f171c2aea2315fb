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

ETCD_IP=$SUBNET.2
STANDBY_IP=$SUBNET.3
MEMBERS=(e c c2 s0 s1 s2 w0)
member_ip() {
    case $1 in
        e) echo "$ETCD_IP" ;;
        c) echo "$COORD_IP" ;;
        c2) echo "$STANDBY_IP" ;;
        s[0-9]) server_ip "${1#s}" ;;
        w0) echo "$WORKER_IP" ;;
    esac
}

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
why=$(netns_unusable)
if [ -n "$why" ] && [ "$CI" = 1 ]; then
    echo "SKIPPED: needs root for network namespaces ($why)"
    exit 0
fi
[ -z "$why" ] || die "needs root for network namespaces ($why)"
[ -x "$BIN" ] || die "no binary at $BIN (set BIN)"
command -v etcd > /dev/null || die "no etcd (Debian's etcd-server; scripts/test-deps)"
ensure_data
RUN=$(mktemp -d "$WORK/run-$(date +%H%M%S)-coordinator-XXXX")
mkdir -p "$RUN/logs"
E=$ETCD_IP:2379
write_configs "$RUN" ec "$RUN/checkpoints" 'cluster.membership="etcd"' \
    "cluster.etcd_endpoints=[\"$E\"]" 'cluster.etcd_prefix="/ftrec/netns"'
(umask 077; od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$RUN/job.secret")
reference=$(reference_digest "$RUN/ref.toml")
trap teardown EXIT
trap 'exit 130' INT TERM
net_up
job=$RUN/job.toml
t_start=$(now_ms)
deadline=$(( t_start + ${TIME_LIMIT%.*} * 1000 ))
past() { [ "$(now_ms)" -ge "$deadline" ]; }

ip netns exec "$P-e" etcd --name e --data-dir "$RUN/etcd" \
    --listen-client-urls "http://$E" --advertise-client-urls "http://$E" \
    --listen-peer-urls "http://$ETCD_IP:2380" --initial-advertise-peer-urls "http://$ETCD_IP:2380" \
    --initial-cluster "e=http://$ETCD_IP:2380" > "$RUN/logs/etcd.log" 2>&1 &
PIDS+=("$!")
until ip netns exec "$P-e" python3 -c 'import sys, urllib.request
sys.exit(0 if b"true" in urllib.request.urlopen(sys.argv[1], timeout=1).read() else 1)' \
    "http://$E/health" 2> /dev/null; do
    past && die "etcd did not serve"
    sleep 0.1
done

# One command per role, as README gives them.
start_in c leader coordinator --job "$job" --etcd "$E" --id c1 --host "$COORD_IP" --port "$PORT" \
    --out "$RUN/c1" --json
leader_pid=$LAST_PID
until grep -q "coordinator c1 leads the job" "$RUN/logs/leader.log" 2> /dev/null; do
    past && die "c1 never led; see $RUN/logs"
    sleep 0.05
done
start_in c2 standby coordinator --job "$job" --etcd "$E" --id c2 --host "$STANDBY_IP" \
    --port "$PORT" --out "$RUN/c2" --json --standby
standby_pid=$LAST_PID
for j in 0 1 2; do
    start_in "s$j" "server-$j" server --job "$job" --etcd "$E" --id "$j" --host "$(server_ip "$j")"
done
start_in w0 worker-0 worker --job "$job" --etcd "$E" --id 0

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
