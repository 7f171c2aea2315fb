# The namespace harness under etcd: the pieces tools/netns-coordinator.sh and
# tools/netns-control.sh share. Sourced after tools/netns-harness.sh (NETNS_HARNESS_LIB=1),
# never run. One namespace per host: etcd (e), the leader (c) and a standby (c2)
# coordinator, servers s0.., spares sp and sp2, workers w0 and w1; every process started by
# hand with the per-role commands of README's "Coordinators in etcd" (`--etcd`, no
# `--coordinator`).
# shellcheck shell=bash
# The globals set here (REFERENCE, the pids, the exit codes) are read by the scripts that
# source this file.
# shellcheck disable=SC2034

ETCD_IP=$SUBNET.2
STANDBY_IP=$SUBNET.3
E=$ETCD_IP:2379
ETCD_PID="" LEADER_PID="" STANDBY_PID=""
SERVER_PIDS=() SPARE_PIDS=() WORKER_PIDS=()

# Replaces the harness's: the etcd hosts' addresses.
member_ip() {
    case $1 in
        e) echo "$ETCD_IP" ;;
        c) echo "$COORD_IP" ;;
        c2) echo "$STANDBY_IP" ;;
        s[0-9]) server_ip "${1#s}" ;;
        sp) echo "$SPARE_IP" ;;
        sp2) echo "$SUBNET.21" ;;
        w[0-9]) echo "$SUBNET.$((30 + ${1#w}))" ;;
    esac
}

# The hosts of a job with N servers, S spares and W workers (sets MEMBERS for net_up).
etcd_members() { # SERVERS SPARES WORKERS
    local j
    MEMBERS=(e c c2)
    for j in $(seq 0 $(($1 - 1))); do MEMBERS+=("s$j"); done
    [ "$2" -lt 1 ] || MEMBERS+=(sp)
    [ "$2" -lt 2 ] || MEMBERS+=(sp2)
    for j in $(seq 0 $(($3 - 1))); do MEMBERS+=("w$j"); done
}

# Preconditions, in the order and words every schedule uses. CI=1: SKIPPED without root.
etcd_preconditions() {
    local why
    why=$(netns_unusable)
    if [ -n "$why" ] && [ "${CI:-0}" = 1 ]; then
        echo "SKIPPED: needs root for network namespaces ($why)"
        exit 0
    fi
    [ -z "$why" ] || die "needs root for network namespaces ($why)"
    [ -x "$BIN" ] || die "no binary at $BIN (set BIN)"
    command -v etcd > /dev/null || die "no etcd (Debian's etcd-server; scripts/test-deps)"
}

# A run directory with job.toml (membership in etcd under PREFIX, then SETS), ref.toml
# and the job secret; REFERENCE is `ftrec train`'s digest for it.
etcd_job() { # NAME FT PREFIX SETS...
    local name=$1 ft=$2 prefix=$3
    shift 3
    ensure_data
    RUN=$(mktemp -d "$WORK/run-$(date +%H%M%S)-$name-XXXX")
    mkdir -p "$RUN/logs"
    write_configs "$RUN" "$ft" "$RUN/checkpoints" 'cluster.membership="etcd"' \
        "cluster.etcd_endpoints=[\"$E\"]" "cluster.etcd_prefix=\"$prefix\"" "$@"
    (umask 077; od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$RUN/job.secret")
    REFERENCE=$(reference_digest "$RUN/ref.toml")
}

past() { [ "$(now_ms)" -ge "$DEADLINE" ]; }

# Seconds (a decimal) to milliseconds.
ms_of() { python3 -c "print(int(float('$1') * 1000))"; }

# etcd in its own namespace; returns once it serves.
start_etcd() {
    ip netns exec "$P-e" etcd --name e --data-dir "$RUN/etcd" \
        --listen-client-urls "http://$E" --advertise-client-urls "http://$E" \
        --listen-peer-urls "http://$ETCD_IP:2380" --initial-advertise-peer-urls "http://$ETCD_IP:2380" \
        --initial-cluster "e=http://$ETCD_IP:2380" > "$RUN/logs/etcd.log" 2>&1 &
    ETCD_PID=$!
    PIDS+=("$ETCD_PID")
    until ip netns exec "$P-e" python3 -c 'import sys, urllib.request
sys.exit(0 if b"true" in urllib.request.urlopen(sys.argv[1], timeout=1).read() else 1)' \
        "http://$E/health" 2> /dev/null; do
        past && die "etcd did not serve"
        sleep 0.1
    done
}

# Waits until LOG has PATTERN (at least N times); dies naming WHAT at the deadline.
wait_log() { # PATTERN LOG WHAT [N]
    while [ "$(count_in_log "$1" "$2")" -lt "${4:-1}" ]; do
        past && die "$3; see $RUN/logs"
        sleep 0.05
    done
}

# The leader c1 (logs leader.*, timeline in RUN/c1) and the standby c2 (standby.*, RUN/c2).
start_coordinators() {
    start_in c leader coordinator --job "$RUN/job.toml" --etcd "$E" --id c1 --host "$COORD_IP" \
        --port "$PORT" --out "$RUN/c1" --json
    LEADER_PID=$LAST_PID
    wait_log "coordinator c1 leads the job" "$RUN/logs/leader.log" "c1 never led"
    start_in c2 standby coordinator --job "$RUN/job.toml" --etcd "$E" --id c2 \
        --host "$STANDBY_IP" --port "$PORT" --out "$RUN/c2" --json --standby
    STANDBY_PID=$LAST_PID
}

# N servers and S spares, then (once the leader counts them all, so the spares stand by
# before training starts) W workers.
start_members() { # SERVERS SPARES WORKERS
    local j spare_hosts=(sp sp2)
    for j in $(seq 0 $(($1 - 1))); do
        start_in "s$j" "server-$j" server --job "$RUN/job.toml" --etcd "$E" --id "$j" \
            --host "$(server_ip "$j")"
        SERVER_PIDS[j]=$LAST_PID
    done
    for j in $(seq 0 $(($2 - 1))); do
        start_in "${spare_hosts[j]}" "spare-$j" server --job "$RUN/job.toml" --etcd "$E" \
            --spare --host "$(member_ip "${spare_hosts[j]}")"
        SPARE_PIDS[j]=$LAST_PID
    done
    wait_log server-joined "$RUN/logs/leader.log" "the servers never joined" "$1"
    wait_log spare-joined "$RUN/logs/leader.log" "the spares never joined" "$2"
    for j in $(seq 0 $(($3 - 1))); do
        start_in "w$j" "worker-$j" worker --job "$RUN/job.toml" --etcd "$E" --id "$j"
        WORKER_PIDS[j]=$LAST_PID
    done
}

alive() { kill -0 "$1" 2> /dev/null; }

# Waits for both coordinators to exit (the job ended: one reports, the other says it was
# deposed or that the job had finished), or the deadline; sets TIMED_OUT (0 or 1) and the
# exit codes LEADER_RC and STANDBY_RC (empty: still running at the deadline, then killed).
wait_coordinators() {
    TIMED_OUT=0 LEADER_RC="" STANDBY_RC=""
    while alive "$LEADER_PID" || alive "$STANDBY_PID"; do
        if past; then
            TIMED_OUT=1
            break
        fi
        sleep 0.1
    done
    if ! alive "$LEADER_PID"; then
        LEADER_RC=0
        wait "$LEADER_PID" 2> /dev/null || LEADER_RC=$?
    fi
    if ! alive "$STANDBY_PID"; then
        STANDBY_RC=0
        wait "$STANDBY_PID" 2> /dev/null || STANDBY_RC=$?
    fi
}

# The wall time (ms) a coordinator's timeline started at: the moment the harness saw
# training-start in LOG, less the event's timeline time. Empty if it never logged one.
timeline_origin() { # LOG WALL_MS_SEEN
    local line t
    line=$(grep -m1 "training-start" "$1" 2> /dev/null) || return 0
    t=$(sed -n 's/.*\[ *\([0-9.]*\)s\] training-start.*/\1/p' <<< "$line")
    [ -n "$t" ] && python3 -c "print(int($2 - float('$t') * 1000))"
}
