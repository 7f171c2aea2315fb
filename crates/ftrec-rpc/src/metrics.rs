//! Prometheus text-format metrics, served by every process on its own port.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Named counters and gauges (gauges hold f64 bits). Registered up front, updated lock-free.
#[derive(Default)]
pub struct Metrics {
    counters: BTreeMap<&'static str, (&'static str, AtomicU64)>,
    gauges: BTreeMap<&'static str, (&'static str, AtomicU64)>,
    labels: String,
}

impl Metrics {
    /// `labels` are attached to every sample, e.g. `role="server",id="1"`.
    pub fn new(labels: String) -> Self {
        Self {
            labels,
            ..Default::default()
        }
    }

    pub fn counter(mut self, name: &'static str, help: &'static str) -> Self {
        self.counters.insert(name, (help, AtomicU64::new(0)));
        self
    }

    pub fn gauge(mut self, name: &'static str, help: &'static str) -> Self {
        self.gauges.insert(name, (help, AtomicU64::new(0)));
        self
    }

    pub fn add(&self, name: &str, v: u64) {
        if let Some((_, c)) = self.counters.get(name) {
            c.fetch_add(v, Ordering::Relaxed);
        }
    }

    pub fn set(&self, name: &str, v: f64) {
        if let Some((_, g)) = self.gauges.get(name) {
            g.store(v.to_bits(), Ordering::Relaxed);
        }
    }

    pub fn get(&self, name: &str) -> u64 {
        self.counters
            .get(name)
            .map_or(0, |(_, c)| c.load(Ordering::Relaxed))
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        for (name, (help, c)) in &self.counters {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{}}} {}\n",
                self.labels,
                c.load(Ordering::Relaxed)
            ));
        }
        for (name, (help, g)) in &self.gauges {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{}}} {}\n",
                self.labels,
                f64::from_bits(g.load(Ordering::Relaxed))
            ));
        }
        out
    }
}

/// Serves `GET /metrics` on `listener` until the runtime ends.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>) {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let m = metrics.clone();
            async move { m.render() }
        }),
    );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!("metrics endpoint stopped: {e}");
    }
}

/// Binds the metrics endpoint on `host:0` and starts serving it; returns its address.
pub async fn start(
    network: &crate::network::Network,
    host: &str,
    metrics: Arc<Metrics>,
) -> Option<String> {
    // A simulated member has no real port to offer, and a real one would escape the
    // simulation.
    if network.is_simulated() {
        return None;
    }
    match crate::client::bind(host, 0).await {
        Ok((listener, address)) => {
            tokio::spawn(serve(listener, metrics));
            Some(address)
        }
        Err(e) => {
            tracing::warn!("no metrics endpoint: {e}");
            None
        }
    }
}

/// A process's peak resident set (`VmHWM` in `/proc/PID/status`; `pid` "self" for this
/// one), in bytes; None where it cannot be read (exited, or a host without `/proc`).
pub fn peak_rss_bytes(pid: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_hwm(&status)
}

fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let mut fields = line["VmHWM:".len()..].split_whitespace();
    let value: u64 = fields.next()?.parse().ok()?;
    match fields.next() {
        Some("kB") => Some(value * 1024),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_the_peak_in_bytes() {
        use super::parse_vm_hwm;
        let status = "Name:\tftrec\nVmPeak:\t  900 kB\nVmHWM:\t   12345 kB\nVmRSS:\t 100 kB\n";
        assert_eq!(parse_vm_hwm(status), Some(12345 * 1024));
        assert_eq!(parse_vm_hwm("VmHWM:\t12 MB\n"), None);
        assert_eq!(parse_vm_hwm("VmRSS:\t12 kB\n"), None);
    }

    use super::*;

    #[test]
    fn renders_prometheus_text_with_labels() {
        let m = Metrics::new("role=\"server\",id=\"1\"".into())
            .counter("ftrec_pushes_total", "Pushes applied")
            .gauge("ftrec_epoch", "Cluster epoch");
        m.add("ftrec_pushes_total", 3);
        m.set("ftrec_epoch", 2.0);
        let text = m.render();
        assert!(text.contains(
            "# TYPE ftrec_pushes_total counter\nftrec_pushes_total{role=\"server\",id=\"1\"} 3\n"
        ));
        assert!(text.contains("ftrec_epoch{role=\"server\",id=\"1\"} 2\n"));
    }
}
