#!/usr/bin/env python3
"""The reports and goals of tools/netns-control.sh's schedules (issue 42, section 3).

    netns_control.py report KEY=VALUE...   one JSON line from a finished run's directory
    netns_control.py check SCHEDULE LINE    PASS/FAIL lines for the schedule's goals; exit 1 on FAIL

`report` takes run=DIR, schedule=NAME, reference=DIGEST, the wall times the script saw
(t_start, t_train, t_end and the schedule's fault moments, milliseconds) and the
coordinators' exit codes; a VALUE is read as JSON where it parses, else as a string.
The run directory holds logs/{leader,standby}.{out,log} and each coordinator's timeline
under c1/ and c2/.
"""

import json
import os
import re
import sys

# Timeline events that are a coordinator's decisions. One whose lease is in doubt may
# train on (`cluster.train_through_etcd_outage`, the default), but declares a server dead
# only on hard evidence: its port refused a connection.
DECISIONS = {
    "failure-detected", "suspicion-confirmed", "worker-failure-detected", "recovery-start",
    "replacement", "rebuild-start", "checkpoint-start", "server-joined", "spare-joined",
    "worker-joined", "step-regranted",
}
COORDINATORS = (("leader", "c1"), ("standby", "c2"))
EVENT = re.compile(r"\[\s*([0-9.]+)s\] ([a-z-]+): (.*)")


def parse_args(args):
    facts = {}
    for a in args:
        key, _, value = a.partition("=")
        try:
            facts[key] = json.loads(value)
        except ValueError:
            facts[key] = value if value != "" else None
    return facts


def load_json(path):
    try:
        text = open(path).read().strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


def timeline(run, name, out):
    """A coordinator's timeline: its timeline.json, else the events its log printed."""
    t = load_json(f"{run}/{out}/timeline.json")
    if t.get("events") is not None:
        return t
    events = []
    try:
        for line in open(f"{run}/logs/{name}.log", errors="replace"):
            m = EVENT.search(line)
            if m:
                events.append({"t": float(m[1]), "kind": m[2], "detail": m[3]})
    except OSError:
        pass
    return {"events": events, "samples_per_second": None}


def origin(tl, t_train):
    """The wall time (ms) of a coordinator's timeline zero, from the moment the script saw
    its training-start: right for the first leader only (a standby's timeline starts at its
    takeover, and its training-start with it)."""
    if t_train is None:
        return None
    for e in tl["events"]:
        if e["kind"] == "training-start":
            return t_train - e["t"] * 1000
    return None


def in_doubt(tl, t_train, window):
    """What a coordinator did inside WINDOW (wall ms, from, to): the samples of the steps it
    counted finished in the whole seconds of its timeline within the window, and its
    decisions. None where its timeline cannot be placed on the wall clock."""
    zero = origin(tl, t_train)
    if zero is None or window is None or window[0] is None or window[1] is None:
        return None
    lo, hi = (window[0] - zero) / 1000, (window[1] - zero) / 1000
    if hi <= lo:
        return {"seconds": 0, "samples": 0, "decisions": [], "declared": []}
    per_second = tl.get("samples_per_second")
    samples = None
    if per_second is not None:
        samples = sum(n for i, n in enumerate(per_second) if i >= lo and i + 1 <= hi)
    inside = [e for e in tl["events"] if lo <= e["t"] <= hi]
    decisions = [f"{e['kind']}@{e['t']:.1f}" for e in inside if e["kind"] in DECISIONS]
    declared = [e["detail"] for e in inside if e["kind"] == "failure-detected"]
    return {"seconds": round(hi - lo, 1), "samples": samples, "decisions": decisions,
            "declared": declared}


def notes(run):
    """Why a run failed, in the processes' own words: their last warnings and errors."""
    out = []
    for name in sorted(os.listdir(f"{run}/logs")):
        if not name.endswith(".log"):
            continue
        lines = [l.rstrip() for l in open(f"{run}/logs/{name}", errors="replace")
                 if re.search(r"\b(WARN|ERROR)\b|^Error|error:", l)]
        out += [name[:-4] + ": " + re.sub(r"^\S+\s+", "", l)[:300] for l in lines[-2:]]
    return out[-8:]


def rel(facts, key):
    t, t0 = facts.get(key), facts.get("t_train")
    return round((t - t0) / 1000, 2) if t is not None and t0 is not None else None


def report(facts):
    run = facts["run"]
    reports = {name: load_json(f"{run}/logs/{name}.out") for name, _ in COORDINATORS}
    # The coordinator that ended the job reports the state; the other says it was deposed,
    # or that the job had finished under another.
    by = next((n for n, r in reports.items() if r.get("state_digest")), None)
    r = reports.get(by, {})
    logs = {n: open(f"{run}/logs/{n}.log", errors="replace").read()
            if os.path.exists(f"{run}/logs/{n}.log") else "" for n, _ in COORDINATORS}
    tls = {n: timeline(run, n, out) for n, out in COORDINATORS}
    t_train = facts.get("t_train")
    doubt = {n: in_doubt(tls[n], t_train, facts.get(f"doubt_{n}")) for n, _ in COORDINATORS}
    failovers = r.get("coordinator_failovers") or []
    recoveries = r.get("recoveries") or []
    exits = {n: facts.get(f"{n}_exit") for n, _ in COORDINATORS}
    if facts.get("timed_out"):
        result = f"timed out after {round((facts['t_end'] - facts['t_start']) / 1000)} s"
    elif by is None:
        result = "no coordinator reported the job's state"
    elif exits[by] != 0:
        result = f"the reporting coordinator ({by}) exited {exits[by]}"
    else:
        result = "ok"
    line = {
        "schedule": facts["schedule"],
        "result": result,
        "seconds": round((facts["t_end"] - facts["t_start"]) / 1000, 2),
        "train_seconds": r.get("train_seconds"),
        "steps": facts.get("steps"),
        "exact": r.get("state_digest") == facts.get("reference") if by else None,
        "state_digest": r.get("state_digest"),
        "reference_digest": facts.get("reference"),
        "lost_samples": r.get("lost_samples"),
        "parity_mismatches": r.get("parity_mismatches"),
        "replica_mismatches": r.get("replica_mismatches"),
        "recoveries": len(recoveries) if by else None,
        "recovered_servers": [x.get("server") for x in recoveries],
        # Recovered by a leader in doubt without a record, and kept by its successor.
        "unrecorded_recoveries": r.get("unrecorded_recoveries", []),
        "failovers": len(failovers) if by else None,
        "failover_seconds": [f.get("failover_seconds") for f in failovers],
        "reported_by": by,
        "leader_exit": exits["leader"],
        "standby_exit": exits["standby"],
        "leader_deposed": "no longer leads the job" in logs["leader"],
        "standby_deposed": "no longer leads the job" in logs["standby"],
        "in_doubt": {n: d for n, d in doubt.items() if d is not None} or None,
        # Training went on under the standby (its first second also counts the steps it
        # settled when it took over): the fault landed while training ran.
        "standby_samples_after_takeover": sum((tls["standby"].get("samples_per_second") or [0])[1:]),
    }
    for key in sorted(facts):
        if key.startswith("t_") and key not in ("t_start", "t_end", "t_train"):
            line["at_" + key[2:]] = rel(facts, key)
    for key in sorted(facts):
        if key.startswith("x_"):
            line[key[2:]] = facts[key]
    # Slots a standing-by spare took ("replacement: spare T at A takes server N").
    line["spares_took"] = sorted({int(m) for text in logs.values()
                                  for m in re.findall(r"replacement: spare \S+ at \S+ takes server (\d+)", text)})
    line["notes"] = notes(run) if result != "ok" else []
    line["run_dir"] = run
    return line


def goals(r):
    """(what the schedule asserts, [(ok, why not)]) for the schedule of line R."""
    s = r["schedule"]
    common = [
        (r["result"] == "ok", r["result"]),
        (r["lost_samples"] == 0, f"lost_samples {r['lost_samples']}"),
        (r["parity_mismatches"] == 0 and r["replica_mismatches"] == 0,
         f"parity/replica mismatches {r['parity_mismatches']}/{r['replica_mismatches']}"),
    ]
    exact = (r["exact"] is True, f"digest {r['state_digest']} is not ftrec train's")
    doubt = r.get("in_doubt") or {}

    def undecided(name):
        # In doubt, a leader trains on while every server is well; with nobody dead it
        # has nothing to decide.
        d = doubt.get(name)
        if d is None:
            return (False, f"{name}: its timeline could not be placed (no training-start?)")
        return (not d["decisions"],
                f"{name} decided while its lease was in doubt ({d['seconds']} s): "
                f"decisions {d['decisions']}")

    def on_hard_evidence(name):
        # Every failure it declared in doubt was a port that refused a connection.
        d = doubt.get(name)
        if d is None:
            return (False, f"{name}: its timeline could not be placed (no training-start?)")
        soft = [e for e in d["declared"] if "refused" not in e]
        return (not soft, f"{name} declared a failure in doubt on silence alone: {soft}")

    def old_leader_deposed():
        return [(r["leader_deposed"], "the old leader did not say it was deposed"),
                (r["leader_exit"] not in (None, 0), f"the old leader's exit: {r['leader_exit']}")]

    if s == "leader-etcd-cut":
        return (f"the leader cut off from etcd only ({r.get('cut_seconds')} s): it decided "
                f"nothing in doubt, the standby took over ({r['failover_seconds']} s), the run exact, "
                "the old leader deposed",
                common + [exact, undecided("leader"),
                          (r["failovers"] == 1, f"{r['failovers']} failovers"),
                          (r["reported_by"] == "standby", f"reported by {r['reported_by']}"),
                          (r["standby_samples_after_takeover"] > 0,
                           "training had ended before the standby took over (more --steps)"),
                          (r.get("standby_exit") == 0, f"the standby's exit: {r.get('standby_exit')}")]
                + old_leader_deposed())
    if s == "etcd-freeze-server-kill":
        # Which coordinator leads when etcd wakes is etcd's to say (the leader's lease
        # expired while frozen): one failover and the old leader deposed, or none.
        one_leader = (r["failovers"] == 0 and r["reported_by"] == "leader") or (
            r["failovers"] == 1 and r["reported_by"] == "standby" and r["leader_deposed"]
            and r["leader_exit"] not in (None, 0))
        return (f"etcd frozen {r.get('freeze_seconds')} s, server {r.get('killed_server')} "
                f"SIGKILLed {r.get('kill_after_freeze')} s in, asynchronous workers: finished, "
                f"nothing lost, parity verifies, {r['recoveries']} recoveries "
                f"(and {len(r['unrecorded_recoveries'])} kept unrecorded), "
                f"{r['failovers']} failovers",
                common + [on_hard_evidence("leader"),
                          ((r["recoveries"] or 0) + len(r["unrecorded_recoveries"]) >= 1,
                           f"{r['recoveries']} recoveries, "
                           f"{len(r['unrecorded_recoveries'])} kept unrecorded"),
                          (one_leader, f"{r['failovers']} failovers, reported by "
                           f"{r['reported_by']}, old leader deposed {r['leader_deposed']} "
                           f"exit {r['leader_exit']}")])
    if s == "survivor-link-down-rebuild":
        return (f"server {r.get('killed_server')} SIGKILLed, survivor {r.get('survivor')}'s link "
                f"down {r.get('down_seconds')} s during the rebuild: exact, nothing lost, "
                f"parity verifies ({r['recoveries']} recoveries, servers {r['recovered_servers']})",
                common + [exact,
                          (r.get("rebuilding_at_link_down") is True,
                           "the rebuild was not in flight when the link went down"),
                          ((r["recoveries"] or 0) >= 1, f"{r['recoveries']} recoveries"),
                          (r["failovers"] == 0, f"{r['failovers']} failovers"),
                          (r["reported_by"] == "leader", f"reported by {r['reported_by']}")])
    if s == "leader-then-server-kill":
        base = r.get("baseline") or {}
        slower = (round(r["seconds"] - base["seconds"], 2)
                  if base.get("seconds") is not None else None)
        return (f"the leader SIGKILLed, server {r.get('killed_server')} {r.get('gap_seconds')} s "
                f"later: a spare took the slot, exact, {slower} s slower than without faults "
                f"({base.get('seconds')} s against {r['seconds']} s)",
                common + [exact, (base.get("result") == "ok", f"baseline: {base.get('result')}"),
                          (base.get("exact") is True, "the baseline is not exact"),
                          (slower is not None and slower <= 30, f"{slower} s slower"),
                          (r["failovers"] == 1, f"{r['failovers']} failovers"),
                          (r.get("killed_server") in (r.get("spares_took") or []),
                           f"no spare took server {r.get('killed_server')}'s slot"),
                          (r["reported_by"] == "standby", f"reported by {r['reported_by']}")])
    raise SystemExit(f"unknown schedule {s}")


def check(line):
    r = json.loads(line)
    if r.get("expected_to_fail"):
        print(f"XFAIL: {r['schedule']}: {r['expected_to_fail']}")
    what, checks = goals(r)
    bad = [why for ok, why in checks if not ok]
    print(("PASS" if not bad else "FAIL") + f": {r['schedule']}: {what}"
          + (": " + "; ".join(bad) if bad else ""))
    return 1 if bad else 0


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "report":
        print(json.dumps(report(parse_args(sys.argv[2:]))))
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "check":
        return check(sys.argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
