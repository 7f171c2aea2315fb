#!/usr/bin/env python3
# A/B: server CPU per training step and train_seconds, binaries and ft modes alternated.
import json, os, re, subprocess, sys, time, glob, statistics
bins = sys.argv[1].split(',')
fts = sys.argv[2].split(',')
rounds = int(sys.argv[3])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 400
HZ = os.sysconf('SC_CLK_TCK')
res = {}
def cpu_of(pid):
    try:
        f = open(f'/proc/{pid}/stat').read()
        parts = f[f.rindex(')') + 2:].split()
        return (int(parts[11]) + int(parts[12])) / HZ
    except Exception:
        return None
for r in range(rounds):
    for b in bins:
        for ft in fts:
            rd = f'/tmp/ab-run-{os.getpid()}'
            subprocess.run(['rm', '-rf', rd])
            t0 = time.monotonic()
            p = subprocess.Popen([b, 'cluster', 'run', '--config', '/tmp/prof67-job.toml', '--steps', str(steps),
                                  '--servers', '3', '--workers', '2', '--ft', ft, '--no-eval', '--json', '--run-dir', rd],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            trace = []  # (t, total server cpu)
            last = {}
            while p.poll() is None:
                time.sleep(0.1)
                out = subprocess.run(['pgrep', '-f', f'server --job {rd}/'], capture_output=True, text=True).stdout.split()
                for pid in out:
                    c = cpu_of(pid)
                    if c is not None:
                        last[pid] = c
                trace.append((time.monotonic() - t0, sum(last.values())))
            d = json.loads(p.stdout.read())
            ct = d['cpu_training']
            def at(t):
                best = None
                for (tt, c) in trace:
                    if tt <= t: best = c
                return best or 0.0
            srv = at(ct['to']) - at(ct['from'])
            key = (os.path.basename(b), ft)
            res.setdefault(key, []).append((d['train_seconds'], srv / d['steps'] * 1000, ct['cpu_seconds'] / d['steps'] * 1000))
            print(key, 'train_s %.2f server_cpu_ms/step %.2f all_cpu_ms/step %.1f' % res[key][-1], flush=True)
print('== medians')
for key, v in res.items():
    print(key, 'train_s %.2f server_ms %.2f all_ms %.1f' % tuple(statistics.median(x[i] for x in v) for i in range(3)), [round(x[1], 2) for x in v])
