//! CPU time of the job's processes (servers, workers, the launcher), read from `/proc` as
//! the run goes: what a rebuild really costs the cluster (`bench ec`'s
//! `rebuild_core_seconds_per_gb`), in the time every process spent on the CPU rather than
//! in what the rebuild's own clock says.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

/// The job processes' summed CPU seconds since the run began, sampled over time. A process that
/// exits between samples loses its last few milliseconds; a process counts from the first
/// sample that sees it in a slot.
#[derive(Debug, Default)]
pub(super) struct CpuSeries {
    per_pid: HashMap<u32, f64>,
    total: f64,
    /// (timeline seconds, cumulative CPU seconds), in time order.
    points: Vec<(f64, f64)>,
}

/// The job's CPU over a window of the timeline.
#[derive(Clone, Copy, Debug, Serialize, serde::Deserialize)]
pub struct CpuWindow {
    pub from: f64,
    pub to: f64,
    /// CPU seconds the job's processes used in the window, summed.
    pub cpu_seconds: f64,
}

impl CpuSeries {
    /// Reads every process in `pids` at timeline time `now`; one that has exited is
    /// skipped.
    pub(super) fn sample(&mut self, now: f64, pids: impl IntoIterator<Item = u32>) {
        for pid in pids {
            let Some(seconds) = read_cpu_seconds(pid) else {
                continue;
            };
            // A process first seen now (a spare just promoted to a slot) counts from now:
            // what it used before (starting, waiting as a spare) is not the slot's work.
            let last = self.per_pid.entry(pid).or_insert(seconds);
            self.total += (seconds - *last).max(0.0);
            *last = seconds;
        }
        self.points.push((now, self.total));
    }

    /// The cumulative CPU at `t`, interpolated between the samples around it (`None`
    /// outside the samples).
    fn at(&self, t: f64) -> Option<f64> {
        let after = self.points.partition_point(|&(pt, _)| pt < t);
        let &(t1, c1) = self.points.get(after)?;
        if t1 == t || after == 0 {
            return (t1 == t).then_some(c1);
        }
        let (t0, c0) = self.points[after - 1];
        Some(c0 + (c1 - c0) * (t - t0) / (t1 - t0))
    }

    /// The processes' CPU seconds in `[from, to]`, or `None` if no sample covers it.
    pub(super) fn window(&self, from: f64, to: f64) -> Option<CpuWindow> {
        let first = self.points.first()?.0;
        let last = self.points.last()?.0;
        if from < first || to > last || to < from {
            return None;
        }
        Some(CpuWindow {
            from,
            to,
            cpu_seconds: self.at(to)? - self.at(from)?,
        })
    }
}

/// A process's user plus system CPU time (`/proc/PID/stat` fields 14 and 15), in seconds.
fn read_cpu_seconds(pid: u32) -> Option<f64> {
    let stat =
        std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat")).ok()?;
    parse_cpu_ticks(&stat)
        .map(|ticks| ticks as f64 / rustix::param::clock_ticks_per_second() as f64)
}

/// utime + stime in clock ticks. The command name (field 2) may hold spaces and
/// parentheses, so the fields are counted after its last `)`.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_user_and_system_ticks_after_an_odd_name() {
        let stat = "42 (ftrec (x) y) S 1 42 42 0 -1 4194560 100 0 0 0 250 37 0 0 20 0 5 0 1 2 3";
        assert_eq!(parse_cpu_ticks(stat), Some(287));
        assert_eq!(parse_cpu_ticks("42 (short) S 1"), None);
    }

    #[test]
    fn a_window_is_the_growth_between_its_ends_interpolated() {
        let series = CpuSeries {
            points: vec![(0.0, 0.0), (1.0, 2.0), (2.0, 2.0), (3.0, 5.0)],
            ..Default::default()
        };
        let w = series.window(0.5, 2.5).unwrap();
        assert!((w.cpu_seconds - (3.5 - 1.0)).abs() < 1e-12, "{w:?}");
        assert!(series.window(-1.0, 1.0).is_none());
        assert!(series.window(1.0, 4.0).is_none());
    }

    #[test]
    fn this_process_uses_cpu_as_it_spins() {
        let me = std::process::id();
        let mut series = CpuSeries::default();
        series.sample(0.0, [me]);
        let spin = std::time::Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < std::time::Duration::from_millis(150) {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        std::hint::black_box(x);
        series.sample(1.0, [me]);
        let used = series.window(0.0, 1.0).unwrap().cpu_seconds;
        // The first sample is the baseline: the window holds the spin, not the test
        // binary's CPU before it.
        assert!((0.05..1.0).contains(&used), "{used}");
    }
}
