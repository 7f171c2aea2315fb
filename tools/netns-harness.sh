#!/usr/bin/env bash
# A multi-host harness over Linux network namespaces (issue 21, section 4). One bridge, one
# namespace per member (the coordinator, servers 0-2, one spare, one worker), each process
# started by hand with `ftrec coordinator|server|worker` on its own address; one
# deterministic erasure-coded (or checkpointed, or partial) job with freeze-loopback.sh's
# small model; a fault injected into server J a chosen number of seconds after training
# starts; the final state digest compared with `ftrec train`'s. Needs root.
#
#   tools/netns-harness.sh run --fault F --ft MODE [--at S | --at A-B --seed N] [--server J]
#        [--direction both|to-server|to-worker] [--cont S] [--loss P] [--rate RATE]
#        [--steps N] [--time-limit S] [--set KEY=VALUE ...] [--keep-net]
#   tools/netns-harness.sh sweep --json OUT.json [--rounds N] [--seed N] [--at A-B] [--steps N]
#        [--faults link-down,partition,loss,freeze,zombie] [--fts ec,checkpoint,partial]
#        [--loss-steps N] [--loss-at A-B]
#   tools/netns-harness.sh ci          # one trial per fault under --ft ec, asserting issue 21's goals
#   tools/netns-harness.sh coordinator [--at S] [--cont S] [--steps N]
#        # the coordinator in etcd (issue 22): the leader's host taken off the network
#        # (tools/netns-coordinator.sh)
#
# Faults (J = --server, default 1; the namespaces are P-c, P-s0..P-s2, P-sp, P-w0):
#   none       the baseline
#   link-down  `ip link set P-s<J>h down`: the bridge end of server J's veth (a host lost
#              from the network; its process lives on, cut off)
#   partition  DROP between the worker and server J only, in both namespaces, both chains
#              (the coordinator still reaches both): --direction to-server drops worker ->
#              server J (`iptables -I OUTPUT -d S_J -j DROP` in the worker's namespace,
#              `iptables -I INPUT -s W -j DROP` in server J's), to-worker the reverse, both
#              (default) all four rules. Silent drops, never a refusal (no blackhole route).
#   loss       `iptables -I INPUT -m statistic --mode random --probability 0.05 -j DROP`
#              in server J's namespace (--loss P), and the same for packets from server J
#              (`-s S_J`) in every other member's: each packet is lost where it arrives, as
#              on a lossy wire, never refused to its sender. With --rate RATE a
#              `tc qdisc add dev eth0 root tbf rate RATE burst 64kb latency 50ms` on both ends
#              of its veth. The goal: no recovery.
#   freeze     `kill -STOP` server J's process; --cont S sends SIGCONT S seconds later.
#   zombie     `freeze --cont 8` (unless --cont says otherwise).
# The moment is --at seconds after the coordinator logs training-start. With --ft ec and an
# ftrec that has `cluster verify-parity`, a live scrub runs once the fault's rebuild ended
# (the standalone coordinator reports no parity check of its own). --keep-net leaves the
# namespaces and processes up for inspection (`ip netns`; delete them by hand).
#
# ci asserts: the baseline exact; link down exact and at most 6 s slower than the baseline;
# the partition finishes exact and is found within 3 s; a 20 Mbit/s link starts no recovery; SIGSTOP for good and SIGSTOP 8 s + SIGCONT exact with 0
# mismatches; 5% loss exact with no recovery. It prints `SKIPPED: ...` and passes where
# namespaces need root. CI_STEPS (3000), CI_LOSS_STEPS (400), CI_TIME_LIMIT (90 s per run).
#
# Each run prints one JSON line (fault, ft, seconds, detect/resume seconds, exact, mismatches,
# recoveries, exit, ...) and tears everything down on exit (processes, namespaces, bridge;
# the iptables rules and qdiscs live in the namespaces). A run that does not finish within
# --time-limit is killed and reported `"result": "timed out after S s"`, exit 124.
# Environment: BIN (default target/release/ftrec), WORK (dataset and reference digests,
# default ${TMPDIR:-/tmp}/ftrec-netns-harness), STEPS (default 1500), TIME_LIMIT (300).
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN=${BIN:-target/release/ftrec}
case $BIN in /*) ;; *) BIN=$ROOT/$BIN ;; esac
WORK=${WORK:-${TMPDIR:-/tmp}/ftrec-netns-harness}
STEPS=${STEPS:-1500}
TIME_LIMIT=${TIME_LIMIT:-300}
unset FTREC_JOB_SECRET
# freeze-loopback.sh's model and data.
DATA_ROWS=20000
DATA_SEED=2
SUBNET=10.77.0
COORD_IP=$SUBNET.1
WORKER_IP=$SUBNET.30
SPARE_IP=$SUBNET.20
PORT=7070
server_ip() { echo "$SUBNET.$((10 + $1))"; }

say() { echo "netns-harness: $*" >&2; }
die() { say "$*"; exit 2; }
now_ms() { date +%s%3N; }
ci_done() { # RC STARTED_MS: says how long a ci took, keeps its logs if it failed
    if [ "$1" = 0 ]; then
        rm -rf "$WORK"
        say "ci took $(( ($(now_ms) - $2) / 1000 )) s"
    else
        say "ci took $(( ($(now_ms) - $2) / 1000 )) s; logs kept under $WORK"
    fi
    return "$1"
}

usage() {
    sed -n '2,/^set -euo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

# ---------------------------------------------------------------------------------------
# Preconditions.

# Prints why network namespaces cannot be used here, or nothing.
netns_unusable() {
    [ "$(id -u)" = 0 ] || { echo "not root (uid $(id -u))"; return; }
    command -v ip > /dev/null || { echo "no ip command (iproute2)"; return; }
    local probe="fhprobe$$" err
    if ! err=$(ip netns add "$probe" 2>&1); then
        echo "ip netns add failed: $err"
        return
    fi
    ip netns del "$probe" 2> /dev/null || true
}

ensure_iptables() {
    command -v iptables > /dev/null && return 0
    say "iptables is missing: installing Debian's iptables"
    if command -v apt-get > /dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q iptables > /dev/null 2>&1 ||
            { apt-get update -q > /dev/null 2>&1 &&
                DEBIAN_FRONTEND=noninteractive apt-get install -y -q iptables > /dev/null 2>&1; } ||
            true
    fi
    command -v iptables > /dev/null
}

# ---------------------------------------------------------------------------------------
# The job: one dictionary (model, data, cluster, --set overrides) written as job.toml for
# the cluster and as ref.toml (without the cluster's sections) for `ftrec train`.

write_configs() { # RUN_DIR FT CKPT_DIR SETS...
    local run_dir=$1 ft=$2 ckpt=$3
    shift 3
    python3 - "$run_dir" "$ft" "$ckpt" "$STEPS" "$WORK/data" "$@" << 'PY'
import json, sys, tomllib
run_dir, ft, ckpt, steps, data, *sets = sys.argv[1:]
job = {
    "seed": 4, "threads": 1,
    "model": {"num_dense": 13, "num_tables": 26, "rows_per_table": 2000, "dim": 16,
              "bottom": [32, 16], "top": [32, 1]},
    "optimizer": {"sparse": {"kind": "sgd", "lr": 0.01}, "dense": {"kind": "sgd", "lr": 0.01}},
    "train": {"batch_size": 128, "steps": int(steps), "epochs": 1, "eval_samples": 0},
    "data": {"dir": data},
    "cluster": {"servers": 3, "workers": 1, "ft": ft, "deterministic": True},
    "security": {"secret_file": "job.secret"},
}
if ft in ("checkpoint", "ec+checkpoint", "partial"):
    # What `cluster run` sets for these modes: a directory every server can reach (one
    # file system here), and a cut every 10 steps.
    job["checkpoint"] = {"dir": ckpt, "every_steps": 10}
for s in sets:
    key, _, value = s.partition("=")
    node = job
    *path, last = key.strip().split(".")
    for p in path:
        node = node.setdefault(p, {})
    node[last] = tomllib.loads("v = " + value)["v"]

def value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(value(x) for x in v) + "]"
    raise SystemExit(f"cannot write {v!r} as TOML")

def dump(d, prefix=""):
    lines = [f"{k} = {value(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for k, v in d.items():
        if isinstance(v, dict):
            name = f"{prefix}.{k}" if prefix else k
            body = dump(v, name)
            lines.append(f"\n[{name}]\n{body}" if any(not isinstance(x, dict) for x in v.values()) else body)
    return "\n".join(lines)

open(f"{run_dir}/job.toml", "w").write(dump(job) + "\n")
ref = {k: v for k, v in job.items() if k not in ("cluster", "ec", "checkpoint", "security", "cpr")}
open(f"{run_dir}/ref.toml", "w").write(dump(ref) + "\n")
PY
}

ensure_data() {
    mkdir -p "$WORK"
    [ -f "$WORK/data/meta.json" ] && return 0
    say "generating the dataset ($DATA_ROWS rows) in $WORK/data"
    "$BIN" data gen --rows "$DATA_ROWS" --seed "$DATA_SEED" --out "$WORK/data" --json > /dev/null
}

# `ftrec train`'s digest for ref.toml, cached by the file and the binary.
reference_digest() { # REF_TOML
    local key cache
    key=$( { cat "$1"; stat -c '%s %Y' "$BIN"; } | sha256sum | cut -c1-16)
    cache=$WORK/reference-$key.txt
    if [ ! -s "$cache" ]; then
        "$BIN" train --config "$1" --json |
            python3 -c 'import json,sys; print(json.load(sys.stdin)["state_digest"])' > "$cache.tmp"
        mv "$cache.tmp" "$cache"
    fi
    cat "$cache"
}

# ---------------------------------------------------------------------------------------
# The network: bridge P-br, and per member a namespace P-<m> whose eth0 is one end of a
# veth pair, the other end (P-<m>h) on the bridge.

P=fh$(( $$ % 100000 ))
MEMBERS=(c s0 s1 s2 sp w0)
NET_UP=0
PIDS=()

member_ip() {
    case $1 in
        c) echo "$COORD_IP" ;;
        s[0-9]) server_ip "${1#s}" ;;
        sp) echo "$SPARE_IP" ;;
        w0) echo "$WORKER_IP" ;;
    esac
}

net_up() {
    NET_UP=1
    # Bridged frames skip the host's own iptables (a host FORWARD policy of DROP would
    # otherwise cut every member off).
    ip link add "$P-br" type bridge nf_call_iptables 0 2> /dev/null ||
        ip link add "$P-br" type bridge
    ip link set "$P-br" up
    local m ns
    for m in "${MEMBERS[@]}"; do
        ns=$P-$m
        ip netns add "$ns"
        ip link add "$P-${m}h" type veth peer name "$P-${m}n"
        ip link set "$P-${m}h" master "$P-br" up
        ip link set "$P-${m}n" netns "$ns"
        ip -n "$ns" link set "$P-${m}n" name eth0
        ip -n "$ns" addr add "$(member_ip "$m")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done
}

teardown() {
    local rc=$? pid m
    trap - EXIT INT TERM
    # bash reports each killed job ("Killed ...") on stderr: not news here.
    exec 2> /dev/null
    # Our children still running (an exited one's pid may belong to someone else by now).
    local live
    live=" $(jobs -p | tr '\n' ' ') "
    for pid in "${PIDS[@]}"; do
        [[ $live == *" $pid "* ]] || continue
        kill -CONT "$pid" 2> /dev/null || true
        kill -KILL "$pid" 2> /dev/null || true
    done
    if [ "$NET_UP" = 1 ]; then
        for m in "${MEMBERS[@]}"; do
            # Whatever else runs in our namespaces was started by this run.
            for pid in $(ip netns pids "$P-$m" 2> /dev/null); do
                kill -KILL "$pid" 2> /dev/null || true
            done
        done
        for pid in "${PIDS[@]}"; do wait "$pid" 2> /dev/null || true; done
        for m in "${MEMBERS[@]}"; do
            ip netns del "$P-$m" 2> /dev/null || true   # its veth pair, rules and qdiscs with it
            ip link del "$P-${m}h" 2> /dev/null || true
        done
        ip link del "$P-br" 2> /dev/null || true
    fi
    exit "$rc"
}

# Starts `ftrec ARGS...` in member M's namespace, logging to RUN/logs/NAME.log; sets LAST_PID.
start_in() { # M NAME ARGS...
    local m=$1 name=$2
    shift 2
    ip netns exec "$P-$m" env FTREC_LOG="${FTREC_LOG:-info}" NO_COLOR=1 "$BIN" "$@" \
        > "$RUN/logs/$name.out" 2> "$RUN/logs/$name.log" &
    LAST_PID=$!
    PIDS+=("$LAST_PID")
}

# Steps the coordinator has counted finished (its metrics), or nothing.
coord_steps() {
    [ -n "${METRICS_URL:-}" ] || return 0
    ip netns exec "$P-c" python3 -c 'import re, sys, urllib.request
try:
    text = urllib.request.urlopen(sys.argv[1], timeout=2).read().decode()
    m = re.search(r"^ftrec_steps_total\S* (\d+)", text, re.M)
    print(m[1] if m else "")
except Exception:
    pass' "$METRICS_URL" 2> /dev/null || true
}

count_in_log() { # PATTERN LOG
    local n
    n=$(grep -c -- "$1" "$2" 2> /dev/null) || true
    echo "${n:-0}"
}

# ---------------------------------------------------------------------------------------
# Faults.

inject() {
    local j=$SERVER sip wip
    sip=$(server_ip "$j")
    wip=$WORKER_IP
    case $FAULT in
        link-down)
            ip link set "$P-s${j}h" down
            ;;
        partition)
            case $DIRECTION in
                to-server | both)
                    ip netns exec "$P-w0" iptables -I OUTPUT -d "$sip" -j DROP
                    ip netns exec "$P-s$j" iptables -I INPUT -s "$wip" -j DROP
                    ;;&
                to-worker | both)
                    ip netns exec "$P-s$j" iptables -I OUTPUT -d "$wip" -j DROP
                    ip netns exec "$P-w0" iptables -I INPUT -s "$sip" -j DROP
                    ;;
            esac
            ;;
        loss)
            # Dropped where they arrive, as a lossy wire drops them: a DROP in the
            # sender's own OUTPUT chain fails the send locally, and Linux then waits at
            # least 200 ms (its probe timer, TCP_RTO_MIN, which no socket option lowers)
            # before it tries again, a delay no real link's loss causes.
            ip netns exec "$P-s$j" iptables -I INPUT -m statistic --mode random \
                --probability "$LOSS" -j DROP
            local m
            for m in "${MEMBERS[@]}"; do
                [ "$m" = "s$j" ] && continue
                ip netns exec "$P-$m" iptables -I INPUT -s "$sip" -m statistic \
                    --mode random --probability "$LOSS" -j DROP
            done
            if [ -n "$RATE" ]; then
                ip netns exec "$P-s$j" tc qdisc add dev eth0 root tbf rate "$RATE" \
                    burst 64kb latency 50ms
                tc qdisc add dev "$P-s${j}h" root tbf rate "$RATE" burst 64kb latency 50ms
            fi
            ;;
        freeze)
            kill -STOP "$SERVER_PID"
            ;;
        none) ;;
    esac
}

# ---------------------------------------------------------------------------------------
# One trial.

# Whether the live parity scrub should start now (cmd_run's loop variables): once the
# fault's rebuild ended (and a frozen server was resumed a second ago, when it is), or
# two seconds into a fault that triggers no recovery (loss), or at --at in a baseline.
scrub_due() {
    [ -n "$t_train" ] || return 1
    if [ "$FAULT" = none ]; then
        [ "$now" -ge $(( t_train + at_ms )) ]
        return
    fi
    [ "$injected" = 1 ] || return 1
    if [ -n "$cont_ms" ]; then
        [ "$conted" = 1 ] && [ "$now" -ge $(( t_cont + 1000 )) ] || return 1
    fi
    [ "$(count_in_log rebuild-end "$clog")" -gt 0 ] ||
        { [ "$FAULT" = loss ] && [ "$now" -ge $(( t_fault + 2000 )) ]; }
}

cmd_run() {
    FAULT=none FT=ec AT=2 SEED=1 SERVER=1 DIRECTION=both CONT="" LOSS=0.05 RATE=""
    local sets=() keep_net=0
    while [ $# -gt 0 ]; do
        case $1 in
            --fault) FAULT=$2; shift ;;
            --ft) FT=$2; shift ;;
            --at) AT=$2; shift ;;
            --seed) SEED=$2; shift ;;
            --server) SERVER=$2; shift ;;
            --direction) DIRECTION=$2; shift ;;
            --cont) CONT=$2; shift ;;
            --loss) LOSS=$2; shift ;;
            --rate) RATE=$2; shift ;;
            --steps) STEPS=$2; shift ;;
            --time-limit) TIME_LIMIT=$2; shift ;;
            --set) sets+=("$2"); shift ;;
            --keep-net) keep_net=1 ;;
            -h | --help) usage ;;
            *) die "run: unknown argument $1 (see --help)" ;;
        esac
        shift
    done
    if [ "$FAULT" = zombie ]; then # frozen, then resumed
        FAULT=freeze
        CONT=${CONT:-8}
    fi
    case $FAULT in none | link-down | partition | loss | freeze) ;;
        *) die "unknown fault $FAULT: none, link-down, partition, loss, freeze or zombie" ;; esac
    case $FT in none | checkpoint | ec | ec+checkpoint | partial) ;;
        *) die "unknown --ft $FT: none, checkpoint, ec, ec+checkpoint or partial" ;; esac
    case $DIRECTION in both | to-server | to-worker) ;;
        *) die "unknown direction $DIRECTION: both, to-server or to-worker" ;; esac
    [[ $SERVER =~ ^[0-2]$ ]] || die "--server must be 0, 1 or 2"
    AT=$(draw "$AT" "$SEED") # --at A-B: a random moment in [A, B], drawn from --seed
    local why
    why=$(netns_unusable)
    [ -z "$why" ] || die "needs root for network namespaces ($why)"
    [ -x "$BIN" ] || die "no binary at $BIN (cargo build --release -p ftrec, or set BIN)"
    if [ "$FAULT" = partition ] || [ "$FAULT" = loss ]; then
        ensure_iptables || die "iptables is missing and could not be installed"
    fi
    ensure_data
    RUN=$(mktemp -d "$WORK/run-$(date +%H%M%S)-$FAULT-$FT-XXXX")
    mkdir -p "$RUN/logs" "$RUN/out"
    write_configs "$RUN" "$FT" "$RUN/checkpoints" ${sets[@]+"${sets[@]}"}
    (umask 077; od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$RUN/job.secret")
    local reference
    reference=$(reference_digest "$RUN/ref.toml")

    [ "$keep_net" = 1 ] || trap teardown EXIT
    trap 'exit 130' INT TERM
    net_up
    local job=$RUN/job.toml coord=$COORD_IP:$PORT
    local t_start t_train="" t_fault="" t_cont="" t_end deadline timeline_t0=""
    local injected=0 conted=0 timed_out=0 rc=0 coord_pid steps_at_fault="" steps_done=""
    # A live parity scrub (`ftrec cluster verify-parity`, where this ftrec has it) once the
    # fault's recovery is over: the standalone coordinator does not check parity itself.
    local scrub=0 scrub_pid=""
    case $FT in ec | ec+checkpoint)
        "$BIN" cluster verify-parity --help > /dev/null 2>&1 && scrub=1 ;;
    esac
    t_start=$(now_ms)
    deadline=$(( t_start + ${TIME_LIMIT%.*} * 1000 ))
    start_in c coordinator coordinator --job "$job" --host "$COORD_IP" --port "$PORT" \
        --out "$RUN/out" --json
    coord_pid=$LAST_PID
    local clog=$RUN/logs/coordinator.log
    until grep -q "coordinator listening" "$clog" 2> /dev/null; do
        kill -0 "$coord_pid" 2> /dev/null || break
        [ "$(now_ms)" -lt "$deadline" ] || break
        sleep 0.05
    done
    METRICS_URL=$(grep -o 'metrics http://[0-9.:]*/metrics' "$clog" | head -1 | cut -d' ' -f2)
    local j
    for j in 0 1 2; do
        start_in "s$j" "server-$j" server --job "$job" --coordinator "$coord" --id "$j" \
            --host "$(server_ip "$j")"
        [ "$j" != "$SERVER" ] || SERVER_PID=$LAST_PID
    done
    start_in sp spare server --job "$job" --coordinator "$coord" --spare --host "$SPARE_IP"
    # The worker last: training starts once it joins, with the spare already standing by.
    while [ "$(count_in_log server-joined "$clog")" -lt 3 ] ||
        [ "$(count_in_log spare-joined "$clog")" -lt 1 ]; do
        kill -0 "$coord_pid" 2> /dev/null || break
        [ "$(now_ms)" -lt "$deadline" ] || break
        sleep 0.05
    done
    start_in w0 worker-0 worker --job "$job" --coordinator "$coord" --id 0

    local at_ms cont_ms now line
    at_ms=$(python3 -c "print(int(float('$AT') * 1000))")
    cont_ms=$([ -n "$CONT" ] && python3 -c "print(int(float('$CONT') * 1000))" || echo "")
    while kill -0 "$coord_pid" 2> /dev/null; do
        now=$(now_ms)
        if [ -z "$t_train" ] && line=$(grep -m1 "training-start" "$clog" 2> /dev/null); then
            t_train=$now
            timeline_t0=$(sed -n 's/.*\[ *\([0-9.]*\)s\] training-start.*/\1/p' <<< "$line")
        fi
        if [ -n "$t_train" ] && [ "$injected" = 0 ] && [ "$FAULT" != none ] &&
            [ "$now" -ge $(( t_train + at_ms )) ]; then
            inject
            injected=1
            t_fault=$(now_ms)
            steps_at_fault=$(coord_steps)
        fi
        if [ "$injected" = 1 ] && [ -n "$cont_ms" ] && [ "$conted" = 0 ] &&
            [ "$now" -ge $(( t_fault + cont_ms )) ]; then
            kill -CONT "$SERVER_PID" 2> /dev/null || true
            conted=1
            t_cont=$(now_ms)
        fi
        if [ "$scrub" = 1 ] && [ -z "$scrub_pid" ] && scrub_due; then
            start_in c scrub cluster verify-parity --coordinator "$coord" --job "$job" --json
            scrub_pid=$LAST_PID
        fi
        if [ "$now" -ge "$deadline" ]; then
            timed_out=1
            steps_done=$(coord_steps)
            break
        fi
        sleep 0.05
    done
    t_end=$(now_ms)
    if [ -n "$scrub_pid" ]; then # it ends with the cluster, if not before
        local until_ms=$(( $(now_ms) + 5000 ))
        while kill -0 "$scrub_pid" 2> /dev/null && [ "$(now_ms)" -lt "$until_ms" ]; do
            sleep 0.1
        done
        if kill -0 "$scrub_pid" 2> /dev/null; then kill -KILL "$scrub_pid" 2> /dev/null || true; fi
    fi
    if [ "$timed_out" = 1 ]; then
        kill -KILL "$coord_pid" 2> /dev/null || true
        wait "$coord_pid" 2> /dev/null || true
        rc=124
    else
        wait "$coord_pid" || rc=$?
    fi
    python3 - "$RUN" "$reference" << PY
import json, os, re, sys
run, reference = sys.argv[1:]
def ms(v):
    return int(v) if v else None
t_start, t_train, t_fault, t_cont, t_end = (ms(x) for x in
    ("$t_start", "$t_train", "$t_fault", "$t_cont", "$t_end"))
timeline_t0 = float("$timeline_t0") if "$timeline_t0" else None
rc, timed_out = $rc, bool($timed_out)
steps, steps_at_fault, steps_done = $STEPS, ms("$steps_at_fault"), ms("$steps_done")
text = open(f"{run}/logs/coordinator.out").read().strip()
try:
    o = json.loads(text) if text else {}
except ValueError:
    o = {}
# The fault's moment on the coordinator's timeline (seconds since it started): the
# training-start event's timeline time plus the wall time from reading it to the fault.
fault_t = None
if t_fault is not None and timeline_t0 is not None:
    fault_t = timeline_t0 + (t_fault - t_train) / 1000
events = []
try:
    events = json.load(open(f"{run}/out/timeline.json"))["events"]
except (OSError, ValueError, KeyError):
    # No timeline (a run killed at its time limit): the events the log printed.
    pat = re.compile(r"\[\s*([0-9.]+)s\] ([a-z-]+): (.*)")
    for line in open(f"{run}/logs/coordinator.log", errors="replace"):
        m = pat.search(line)
        if m:
            events.append({"t": float(m[1]), "kind": m[2], "detail": m[3]})
def first(kinds):
    for e in events:
        if e["kind"] in kinds and (fault_t is None or e["t"] >= fault_t - 0.2):
            return e
rel = lambda t: round(t - fault_t, 2) if (t is not None and fault_t is not None) else None
detected = first({"failure-detected", "suspicion-confirmed"})
resumed = first({"recovery-end"})
recoveries = o.get("recoveries", [])
detect = rel(recoveries[0]["detected_at"]) if recoveries else rel(detected and detected["t"])
resume = rel(recoveries[0]["resumed_at"]) if recoveries else rel(resumed and resumed["t"])
digest = o.get("state_digest")
# Parity: the coordinator's own check where it reports one, else the live scrub's.
scrub = None
parity, replicas, checked_by, scrub_note = (o.get("parity_mismatches"),
    o.get("replica_mismatches"), "coordinator" if "parity_mismatches" in o else None, None)
if checked_by is None and os.path.exists(f"{run}/logs/scrub.out"):
    try:
        sc = json.loads(open(f"{run}/logs/scrub.out").read())
        parity, replicas = sc.get("parity_mismatches"), sc.get("replica_mismatches")
        checked_by = "verify-parity"
        scrub = {"stripes": sc.get("stripes"), "at_steps": [sc.get("first_applied"), sc.get("last_applied")]}
        if sc.get("unsettled"):
            scrub_note = f"{sc['unsettled']} ranges unsettled"
    except (OSError, ValueError):
        lines = open(f"{run}/logs/scrub.log", errors="replace").read().strip().splitlines()
        scrub_note = "verify-parity failed: " + (lines[-1][:300] if lines else "no output")
end = first({"training-end"})
# Training speed while the fault held: the steps from the fault to the end of training.
window_rate = None
if steps_at_fault is not None and end and fault_t is not None and end["t"] > fault_t:
    window_rate = round((steps - steps_at_fault) / (end["t"] - fault_t), 1)
# Why a run failed, in the processes' own words: their last warnings and errors.
notes = []
for name in sorted(os.listdir(f"{run}/logs")):
    if not name.endswith(".log"):
        continue
    lines = [l.rstrip() for l in open(f"{run}/logs/{name}", errors="replace")
             if re.search(r"\b(WARN|ERROR)\b|^Error|error:", l)]
    notes += [name[:-4] + ": " + re.sub(r"^\S+\s+", "", l)[:400] for l in lines[-2:]]
if timed_out:
    result = f"timed out after {round((t_end - t_start) / 1000)} s"
elif rc != 0:
    result = f"failed: coordinator exit {rc}"
else:
    result = "ok"
recovery_events = [e["kind"] for e in events
                   if e["kind"] in ("failure-detected", "suspicion-confirmed", "recovery-end",
                                    "rebuild-end", "superseded-killed", "fatal")]
print(json.dumps({
    "fault": "zombie" if "$CONT" else "$FAULT",
    "ft": "$FT",
    "server": $SERVER,
    "at": float("$AT") if "$FAULT" != "none" else None,
    "cont": float("$CONT") if "$CONT" else None,
    "direction": "$DIRECTION" if "$FAULT" == "partition" else None,
    "loss": float("$LOSS") if "$FAULT" == "loss" else None,
    "rate": ("$RATE" or None) if "$FAULT" == "loss" else None,
    "fault_injected": t_fault is not None,
    "cont_sent": (t_cont is not None) if "$CONT" else None,
    "steps": $STEPS,
    "result": result,
    "exit": rc,
    "timed_out": timed_out,
    "seconds": round((t_end - t_start) / 1000, 2),
    "train_seconds": o.get("train_seconds"),
    "fault_t": round(fault_t, 2) if fault_t is not None else None,
    "detect_seconds": detect,
    "resume_seconds": resume,
    "exact": (digest == reference) if digest else None,
    "state_digest": digest,
    "reference_digest": reference,
    "parity_mismatches": parity,
    "replica_mismatches": replicas,
    "mismatches_checked_by": checked_by,
    "scrub": scrub,
    "scrub_note": scrub_note,
    "steps_per_sec": round(steps / o["train_seconds"], 1) if o.get("train_seconds") else None,
    "steps_at_fault": steps_at_fault,
    "fault_window_steps_per_sec": window_rate,
    "steps_done_at_timeout": steps_done,
    "recoveries": len(recoveries) if o else None,
    "recovery_modes": [r.get("mode") for r in recoveries],
    "zombies_refused": o.get("zombies_refused"),
    "lost_samples": o.get("lost_samples"),
    "steps_rolled_back": o.get("steps_rolled_back"),
    "events": recovery_events[:12],
    "notes": notes[-6:] if result != "ok" or recovery_events else [],
    "logs": run,
}))
PY
    return "$rc"
}

# ---------------------------------------------------------------------------------------
# Many trials: each faulted run paired with a baseline run right before it.

trial() { # prints the run's JSON line (or a line saying the harness itself failed)
    local line
    line=$("$SELF" run "$@" 2> "$WORK/trial.err" | tail -1) || true
    if [ -z "$line" ] || ! python3 -c 'import json,sys; json.loads(sys.argv[1])' "$line" 2> /dev/null; then
        line=$(python3 -c 'import json,sys; print(json.dumps({"args": sys.argv[2:],
            "result": "harness failed: " + sys.argv[1][-400:]}))' "$(cat "$WORK/trial.err")" "$@")
    fi
    echo "$line"
}

draw() { # RANGE SEED -> a moment in [A, B] (or the number itself)
    python3 -c 'import random, sys
r, seed = sys.argv[1], int(sys.argv[2])
if "-" in r[1:]:
    a, b = map(float, r.split("-", 1)); random.seed(seed); print(round(random.uniform(a, b), 2))
else:
    print(float(r))' "$1" "$2"
}

brief() { # a run's JSON line -> a short line for the sweep's progress
    python3 -c 'import json, sys
r = json.loads(sys.argv[1])
print("netns-harness:   " + " ".join(f"{k}={r.get(k)}" for k in ("fault", "ft", "steps", "result",
      "seconds", "exact", "detect_seconds", "resume_seconds", "recoveries")))' "$1" >&2
}

# Steps for a zombie trial: enough that training still runs a few seconds after the SIGCONT
# (AT + 8 s), at the speed BASELINE (a run's JSON line) trained.
zombie_steps() { # BASELINE AT STEPS
    python3 -c 'import json, math, sys
b, at, steps = json.loads(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
rate = b.get("steps_per_sec") or 0
print(max(steps, math.ceil(rate * (at + 8 + 4))))' "$1" "$2" "$3"
}

cmd_sweep() {
    local out="" rounds=1 seed=1 range=1-4 faults=link-down,partition,loss,freeze,zombie
    local fts=ec,checkpoint,partial steps="" loss_steps=400 loss_range=0.5-1.5 extra=()
    while [ $# -gt 0 ]; do
        case $1 in
            --json) out=$2; shift ;;
            --rounds) rounds=$2; shift ;;
            --seed) seed=$2; shift ;;
            --at) range=$2; shift ;;
            --faults) faults=$2; shift ;;
            --fts) fts=$2; shift ;;
            --steps) steps=$2; shift ;;
            --loss-steps) loss_steps=$2; shift ;;
            --loss-at) loss_range=$2; shift ;;
            --time-limit | --server | --set | --rate | --loss | --direction)
                extra+=("$1" "$2"); shift ;;
            -h | --help) usage ;;
            *) die "sweep: unknown argument $1 (see --help)" ;;
        esac
        shift
    done
    [ -n "$out" ] || die "sweep: --json OUT.json is required"
    local why
    why=$(netns_unusable)
    [ -z "$why" ] || die "needs root for network namespaces ($why)"
    ensure_iptables || say "iptables is missing: partition and loss trials will fail"
    mkdir -p "$WORK"
    local lines=$out.lines r ft fault s=$seed n at base faulted args
    : > "$lines"
    for r in $(seq 1 "$rounds"); do
        for ft in ${fts//,/ }; do
            for fault in ${faults//,/ }; do
                s=$((s + 1))
                # ec trains ~4x faster than the modes that cut every 10 steps: 3000 steps
                # there, 1500 here, so a fault 1-4 s in lands mid-run; 5% loss slows
                # training many times over, so its trials are short and faulted early.
                if [ "$fault" = loss ]; then
                    n=$loss_steps
                    at=$(draw "$loss_range" "$s")
                else
                    n=${steps:-$([ "$ft" = ec ] && echo 3000 || echo 1500)}
                    at=$(draw "$range" "$s")
                fi
                say "round $r: $fault at $at s under --ft $ft, $n steps (baseline first)"
                base=$(trial --fault none --ft "$ft" --steps "$n" ${extra[@]+"${extra[@]}"})
                if [ "$fault" = zombie ]; then
                    local need
                    need=$(zombie_steps "$base" "$at" "$n")
                    if [ "$need" -gt "$n" ]; then
                        say "training ends before the SIGCONT: $need steps instead of $n"
                        n=$need
                        base=$(trial --fault none --ft "$ft" --steps "$n" ${extra[@]+"${extra[@]}"})
                    fi
                fi
                brief "$base"
                args=(--fault "$fault")
                faulted=$(trial "${args[@]}" --ft "$ft" --at "$at" --steps "$n" \
                    ${extra[@]+"${extra[@]}"})
                brief "$faulted"
                printf '{"round": %s, "baseline": %s, "faulted": %s}\n' "$r" "$base" "$faulted" >> "$lines"
            done
        done
    done
    python3 - "$lines" "$out" << 'PY'
import json, sys
pairs = [json.loads(l) for l in open(sys.argv[1])]
for p in pairs:
    b, f = p["baseline"].get("seconds"), p["faulted"].get("seconds")
    p["slowdown_seconds"] = round(f - b, 2) if b is not None and f is not None else None
json.dump({"trials": pairs}, open(sys.argv[2], "w"), indent=1)
print(f"{len(pairs)} pairs written to {sys.argv[2]}")
PY
    rm -f "$lines"
}

# ---------------------------------------------------------------------------------------
# CI: one trial per fault under --ft ec and one baseline; issue 21's goals asserted.

cmd_ci() {
    local why
    why=$(netns_unusable)
    if [ -n "$why" ]; then
        echo "SKIPPED: needs root for network namespaces ($why)"
        exit 0
    fi
    ensure_iptables || say "iptables is missing and could not be installed: partition and loss fail"
    [ -x "$BIN" ] || die "no binary at $BIN (set BIN)"
    local started
    started=$(now_ms)
    # A small model, 3000 steps (about 12 s here: long enough for a fault at 1.5 s, its
    # recovery, and a SIGCONT 8 s later while training still runs); the loss trial and its
    # baseline 400 steps, as 5% loss slows training many times over. Every run is bounded,
    # so a livelock fails, never hangs.
    local steps=${CI_STEPS:-3000} loss_steps=${CI_LOSS_STEPS:-400} limit=${CI_TIME_LIMIT:-90}
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/ftrec-netns-ci.XXXX")
    export WORK
    local base link part frozen zombie base_small loss slow
    base=$(trial --steps "$steps" --fault none --ft ec --time-limit "$limit")
    echo "$base"
    link=$(trial --steps "$steps" --fault link-down --ft ec --at 1.5 --time-limit "$limit")
    echo "$link"
    part=$(trial --steps "$steps" --fault partition --ft ec --at 1.5 --time-limit "$limit")
    echo "$part"
    frozen=$(trial --steps "$steps" --fault freeze --ft ec --at 1.5 --time-limit "$limit")
    echo "$frozen"
    # The zombie needs training to outlast the SIGCONT: as many steps as that takes here.
    zombie=$(trial --steps "$(zombie_steps "$base" 1.5 "$steps")" --fault zombie --ft ec --at 1.5 \
        --time-limit "$limit")
    echo "$zombie"
    base_small=$(trial --steps "$loss_steps" --fault none --ft ec --time-limit "$limit")
    echo "$base_small"
    loss=$(trial --steps "$loss_steps" --fault loss --ft ec --at 1 --time-limit "$limit")
    echo "$loss"
    # A slow link that loses nothing (a 20 Mbit/s token bucket: several times slower here):
    # its calls are suspected and probed, and the probes get through, so no recovery.
    slow=$(trial --steps "$loss_steps" --fault loss --loss 0 --rate 20mbit --ft ec --at 1 \
        --time-limit "$limit")
    echo "$slow"
    local rc=0
    python3 - "$base" "$link" "$part" "$frozen" "$zombie" "$base_small" "$loss" "$slow" \
        << 'PY' || rc=$?
import json, sys
base, link, part, frozen, zombie, base_small, loss, slow = (json.loads(a) for a in sys.argv[1:])
failed = 0
def goal(name, run, checks):
    global failed
    bad = [why for ok, why in checks if not ok]
    if run.get("result") != "ok":
        bad.insert(0, run.get("result", "no result"))
    print(f"{'PASS' if not bad else 'FAIL'}: {name}" + (f": {'; '.join(bad)}" if bad else ""))
    failed += bool(bad)
def exact(r):
    return (r.get("exact") is True, f"digest {r.get('state_digest')} is not ftrec train's")
def no_mismatch(r):
    if r.get("mismatches_checked_by") is None:
        print(f"note: {r.get('fault')}: parity not checked "
              f"({r.get('scrub_note') or 'no scrub ran: the run ended first, or this ftrec has no cluster verify-parity'})")
        return (True, "")
    n = (r.get("parity_mismatches") or 0) + (r.get("replica_mismatches") or 0)
    return (n == 0, f"{n} parity/replica mismatches")
def slower(r, b):
    if r.get("seconds") is None or b.get("seconds") is None:
        return None
    return round(r["seconds"] - b["seconds"], 2)
goal("baseline (no fault) exact", base, [exact(base)])
d = slower(link, base)
goal(f"link down, one spare, --ft ec: exact, at most 6 s slower (slower by {d} s)", link,
     [exact(link), (d is not None and d <= 6, f"{d} s slower than the baseline")])
# Issue 44's goal is the failure timeout (1 s) + 1 s; 3 s leaves room for a loaded host and
# still fails a return to two step deadlines (11 s).
detect = part.get("detect_seconds")
goal(f"worker <-> server partitioned, coordinator sees both: finishes exact, found within 3 s "
     f"(slower by {slower(part, base)} s, detected after {detect} s)", part,
     [exact(part), (detect is not None and detect <= 3, f"detected after {detect} s")])
goal(f"SIGSTOP for good: exact, 0 mismatches (slower by {slower(frozen, base)} s)", frozen,
     [exact(frozen), no_mismatch(frozen)])
goal(f"SIGSTOP 8 s then SIGCONT: exact, 0 mismatches ({zombie.get('steps')} steps in "
     f"{zombie.get('seconds')} s, {zombie.get('zombies_refused')} zombies refused)", zombie,
     [exact(zombie), no_mismatch(zombie),
      (zombie.get("cont_sent") is True, "training ended before the SIGCONT")])
goal("5% loss on one server, both directions: exact, no recovery "
     f"({loss.get('fault_window_steps_per_sec')} steps/s under loss against "
     f"{base_small.get('steps_per_sec')} without; slower by {slower(loss, base_small)} s)", loss,
     [exact(base_small), exact(loss),
      (loss.get("recoveries") == 0, f"{loss.get('recoveries')} recoveries")])
goal("a slow link (20 Mbit/s, no loss) on one server: exact, no recovery "
     f"({slow.get('fault_window_steps_per_sec')} steps/s against "
     f"{base_small.get('steps_per_sec')} without)", slow,
     [exact(slow), (slow.get("recoveries") == 0, f"{slow.get('recoveries')} recoveries")])
sys.exit(1 if failed else 0)
PY
    ci_done "$rc" "$started"
}

# tools/netns-coordinator.sh reuses the functions above.
[ "${NETNS_HARNESS_LIB:-0}" = 1 ] && return 0

case ${1:-} in
    coordinator) shift; exec "$ROOT/tools/netns-coordinator.sh" "$@" ;;
    run) shift; cmd_run "$@" ;;
    sweep) shift; cmd_sweep "$@" ;;
    ci) shift; cmd_ci "$@" ;;
    -h | --help | help) usage ;;
    *) usage 2 ;;
esac
