//! Sizes checked against the host's memory before anything is allocated: a model that
//! cannot fit would otherwise abort the process ("memory allocation of N bytes failed")
//! instead of telling the user which key to change.

use ftrec_model::{MemoryEstimate, human_bytes};

use crate::{ConfigError, JobConfig};

impl JobConfig {
    /// What a single-process trainer of this configuration needs (the whole model plus
    /// the buffers of one step at `train.batch_size`).
    pub fn memory_estimate(&self) -> Result<MemoryEstimate, ConfigError> {
        Ok(self.model_config()?.memory_estimate(self.train.batch_size))
    }

    /// Refuses a configuration whose estimate exceeds `available` bytes, naming the
    /// estimate, its largest part and the key(s) that size it. `held` bytes of the model
    /// are already in memory (a loaded snapshot) and so are not needed again.
    pub fn check_memory(&self, available: u64, held: u64) -> Result<(), ConfigError> {
        let e = self.memory_estimate()?;
        let parts = [
            MemoryPart::new(e.tables, "embedding tables", self.table_keys()),
            MemoryPart::new(e.bottom, "bottom MLP", self.bottom_keys()),
            MemoryPart::new(e.top, "top MLP", self.top_keys()),
            MemoryPart::new(e.batch, "per-batch buffers", self.batch_keys()),
        ];
        check_parts("this model", &parts, held as u128, available)
    }

    /// The keys that size the embedding tables, with their values.
    pub fn table_keys(&self) -> String {
        let m = &self.model;
        if m.table_rows.is_empty() {
            format!(
                "model.num_tables = {} x model.rows_per_table = {} x model.dim = {}",
                m.num_tables, m.rows_per_table, m.dim
            )
        } else {
            format!(
                "model.table_rows ({} tables, {} rows in all) x model.dim = {}",
                m.table_rows.len(),
                m.table_rows.iter().map(|&r| r as u128).sum::<u128>(),
                m.dim
            )
        }
    }

    /// The keys that size the bottom MLP.
    pub fn bottom_keys(&self) -> String {
        format!(
            "model.bottom = {:?} (its activations grow with train.batch_size = {})",
            self.model.bottom, self.train.batch_size
        )
    }

    /// The keys that size the top MLP.
    pub fn top_keys(&self) -> String {
        format!(
            "model.top = {:?} (its input grows with model.dim and the table count, its \
             activations with train.batch_size = {})",
            self.model.top, self.train.batch_size
        )
    }

    /// The keys that size the buffers of one step.
    pub fn batch_keys(&self) -> String {
        format!(
            "train.batch_size = {} (and model.dim = {})",
            self.train.batch_size, self.model.dim
        )
    }

    /// [`Self::check_memory`] against this host's available memory; skipped where the
    /// host does not say (no `/proc/meminfo`).
    pub fn fits_in_memory(&self, held: u64) -> Result<(), ConfigError> {
        match available_memory() {
            Some(available) => self.check_memory(available, held),
            None => Ok(()),
        }
    }
}

/// One part of a memory estimate: its size, what it is, and the key(s) that set it.
#[derive(Clone, Debug)]
pub struct MemoryPart {
    pub bytes: u128,
    pub what: String,
    pub keys: String,
}

impl MemoryPart {
    pub fn new(bytes: u128, what: impl Into<String>, keys: impl Into<String>) -> Self {
        Self {
            bytes,
            what: what.into(),
            keys: keys.into(),
        }
    }
}

/// Refuses an estimate (the sum of `parts`, less `held` bytes already in memory) larger
/// than `available`: "`subject` needs about N of memory (each part) but M is available;
/// the largest part is the P: lower KEYS". One wording for every process that checks.
pub fn check_parts(
    subject: &str,
    parts: &[MemoryPart],
    held: u128,
    available: u64,
) -> Result<(), ConfigError> {
    let total: u128 = parts.iter().map(|p| p.bytes).sum();
    let need = total.saturating_sub(held);
    if need <= available as u128 {
        return Ok(());
    }
    // The first of equals, so the wording does not depend on the order of ties' ends.
    let Some(largest) = parts
        .iter()
        .reduce(|a, b| if b.bytes > a.bytes { b } else { a })
    else {
        // No parts need nothing, and nothing always fits.
        return Ok(());
    };
    let breakdown = parts
        .iter()
        .map(|p| format!("{} {}", p.what, human_bytes(p.bytes)))
        .collect::<Vec<_>>()
        .join(", ");
    Err(ConfigError::Invalid(format!(
        "{subject} needs about {} of memory ({breakdown}) but {} is available; the largest \
         part is the {}: lower {}",
        human_bytes(need),
        human_bytes(available as u128),
        largest.what,
        largest.keys
    )))
}

/// [`check_parts`] against this host's available memory; skipped where the host does not
/// say (no `/proc/meminfo`).
pub fn parts_fit_in_memory(subject: &str, parts: &[MemoryPart]) -> Result<(), ConfigError> {
    match available_memory() {
        Some(available) => check_parts(subject, parts, 0, available),
        None => Ok(()),
    }
}

/// Bytes this process can still allocate: the kernel's `MemAvailable`, lowered by a
/// cgroup v2 memory limit when one is set (a container sees the host's meminfo).
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let host = parse_meminfo(&meminfo)?;
    let read = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok();
    let cgroup = match (read("memory.max"), read("memory.current")) {
        (Some(max), Some(current)) => cgroup_headroom(&max, &current),
        _ => None,
    };
    Some(cgroup.map_or(host, |c| c.min(host)))
}

/// `MemAvailable` from `/proc/meminfo` text, in bytes.
fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// What a cgroup v2 limit leaves; `None` when unlimited ("max").
fn cgroup_headroom(max: &str, current: &str) -> Option<u64> {
    let max: u64 = max.trim().parse().ok()?;
    let current: u64 = current.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn tiny(overrides: &[&str]) -> JobConfig {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        JobConfig::load(Some("tiny"), None, &o).unwrap()
    }

    #[test]
    fn the_tiny_preset_fits_in_a_few_gib() {
        let c = tiny(&[]);
        let e = c.memory_estimate().unwrap();
        // 26 x 100k x 64 f32 = 666 MB of tables.
        assert_eq!(e.tables, 26 * 100_000 * 64 * 4);
        c.check_memory(2 * GIB, 0).unwrap();
        assert!(c.check_memory(GIB / 4, 0).is_err());
        // What a loaded snapshot already holds is not counted twice.
        c.check_memory(GIB / 4, e.tables as u64).unwrap();
    }

    #[test]
    fn each_oversize_names_its_key_and_the_estimate() {
        for (set, key) in [
            (
                "train.batch_size=1000000000",
                "train.batch_size = 1000000000",
            ),
            (
                "model.rows_per_table=4294967295",
                "model.rows_per_table = 4294967295",
            ),
            (
                "model.bottom=[100000000,64]",
                "model.bottom = [100000000, 64]",
            ),
        ] {
            let c = tiny(&[set]);
            let e = c.check_memory(64 * GIB, 0).unwrap_err().to_string();
            assert!(
                e.contains(key) && e.contains("needs about") && e.contains("64.0 GiB"),
                "{set}: {e}"
            );
        }
        let c = tiny(&["model.dim=100000", "model.bottom=[512,100000]"]);
        let e = c.check_memory(64 * GIB, 0).unwrap_err().to_string();
        assert!(e.contains("model.dim = 100000"), "{e}");
    }

    #[test]
    fn meminfo_and_cgroup_are_parsed() {
        let text = "MemTotal:       16 kB\nMemFree:   1 kB\nMemAvailable:    2048 kB\n";
        assert_eq!(parse_meminfo(text), Some(2 << 20));
        assert_eq!(parse_meminfo("MemTotal: 5 kB\n"), None);
        assert_eq!(cgroup_headroom("max\n", "100\n"), None);
        assert_eq!(cgroup_headroom("1000\n", "100\n"), Some(900));
        assert!(available_memory().is_some_and(|b| b > 0));
    }
}
