#!/usr/bin/env python3
"""Own saves without a drain, side by side (issue 24): the failure-free demo job under
`--ft none`, `--ft partial` with cuts every 40 steps, and `cpr.uncoordinated` with a binary
that drains the step pipeline before each own save (OLD, a build of 2836ab0) and with this
tree's (NEW), rounds interleaved. Prints each run and the medians; writes results.json.

    python3 bench/own-saves/run.py NEW_FTREC OLD_FTREC DATA_DIR OUT_DIR [ROUNDS]
"""
import json, statistics, subprocess, sys

new, old, data, out = sys.argv[1:5]
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
base = ['cluster', 'run', '--data', data, '--preset', 'demo', '--steps', '300', '--servers', '3',
        '--workers', '2', '--deterministic', '--no-eval', '--json', '--time-limit', '600']
own = ['--ft', 'partial', '--set', 'checkpoint.every_steps=40', '--set', 'cpr.uncoordinated=true']
configs = {
    'none': (new, ['--ft', 'none']),
    'partial-cuts': (new, ['--ft', 'partial', '--set', 'checkpoint.every_steps=40']),
    'uncoord-drain(old)': (old, own),
    'uncoord-nodrain(new)': (new, own),
}
res = {k: [] for k in configs}
for r in range(rounds):
    for name, (binary, extra) in configs.items():
        run_dir = f"{out}/run-{name}-{r}".replace('(', '').replace(')', '')
        subprocess.run(['rm', '-rf', run_dir])
        p = subprocess.run([binary] + base + extra + ['--run-dir', run_dir], capture_output=True, text=True)
        if p.returncode != 0:
            print(name, 'FAILED', p.returncode, p.stderr[-3000:], flush=True)
            continue
        j = json.loads(p.stdout)
        pauses = [c['pause_seconds'] for c in j.get('checkpoints', [])]
        row = dict(train=j['train_seconds'], n=len(pauses), pause_sum=sum(pauses),
                   pause_med=statistics.median(pauses) if pauses else 0,
                   rss=max(j.get('server_peak_rss_bytes') or [0]),
                   stalls=[round(x, 3) for x in pauses])
        res[name].append(row)
        print(r, name, json.dumps(row), flush=True)
json.dump(res, open(f"{out}/results.json", 'w'), indent=1)
for name, rows in res.items():
    if rows:
        train = [x['train'] for x in rows]
        print(f"{name:24s} train median {statistics.median(train):.2f}s "
              f"(spread {min(train):.2f}-{max(train):.2f}); saves {rows[0]['n']}; pause sum median "
              f"{statistics.median([x['pause_sum'] for x in rows]):.3f}s; per save median "
              f"{statistics.median([x['pause_med'] for x in rows]):.3f}s; peak RSS per server "
              f"{statistics.median([x['rss'] for x in rows]) / 1e6:.0f} MB")
