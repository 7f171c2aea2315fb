//! What the soak learns from the members while they run: the lines their logs gain (the
//! coordinators' timeline events, a coordinator taking the lead, a server taking a slot)
//! and the steps the coordinators count (their metrics). Lines are read as they are
//! written, so each is stamped with the bench's clock at most one poll late.

use std::io::{Read, Seek, SeekFrom};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

use ftrec_proto::timeline::EventKind;

/// A line that matters to the soak.
#[derive(Clone, Debug, PartialEq)]
pub enum Seen {
    /// A timeline event, with the server it is about where the line names one
    /// (`subject=server-N`).
    Event {
        kind: EventKind,
        server: Option<usize>,
    },
    /// This coordinator leads the job now.
    Leads,
    /// This coordinator's metrics endpoint.
    Metrics(String),
    /// This server process serves slot N.
    Serves(usize),
}

/// Reads one log line. The timeline's lines are `... [ 12.34s] kind: detail` with an
/// optional `subject=server-N` field after the message.
pub fn parse_line(line: &str) -> Option<Seen> {
    if line.contains("leads the job (term") {
        return Some(Seen::Leads);
    }
    if let Some(i) = line.find("(metrics http://") {
        let rest = &line[i + "(metrics http://".len()..];
        let end = rest.find('/')?;
        return Some(Seen::Metrics(rest[..end].to_string()));
    }
    if let Some(i) = line.find("] ") {
        let head = &line[..i];
        if head.ends_with('s') && head.contains('[') {
            let rest = &line[i + 2..];
            let name = &rest[..rest.find(':')?];
            let kind = EventKind::ALL.iter().copied().find(|k| k.name() == name)?;
            let server = line
                .rsplit_once("subject=server-")
                .and_then(|(_, id)| id.trim().parse().ok());
            return Some(Seen::Event { kind, server });
        }
    }
    // The server's own line once it holds a slot: `server N at ADDRESS, epoch E`.
    let i = line.find("server ")?;
    let rest = &line[i + "server ".len()..];
    let (id, tail) = rest.split_once(" at ")?;
    if tail.contains(", epoch ") {
        return id.parse().ok().map(Seen::Serves);
    }
    None
}

/// Follows one log file: the complete lines it gained since the last poll.
pub struct Follower {
    path: PathBuf,
    offset: u64,
    partial: String,
}

impl Follower {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            partial: String::new(),
        }
    }

    pub fn poll(&mut self) -> Vec<String> {
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut bytes = Vec::new();
        if file.read_to_end(&mut bytes).is_err() {
            return Vec::new();
        }
        self.offset += bytes.len() as u64;
        self.partial.push_str(&String::from_utf8_lossy(&bytes));
        let mut lines: Vec<String> = self.partial.split('\n').map(str::to_string).collect();
        self.partial = lines.pop().unwrap_or_default();
        lines
    }
}

/// The body of `GET path` from `address` (HTTP/1.0), or `None` when it does not answer
/// within `timeout`.
pub fn http_get(address: &str, path: &str, timeout: Duration) -> Option<String> {
    let socket = address.parse().ok()?;
    let mut stream = TcpStream::connect_timeout(&socket, timeout).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    std::io::Write::write_all(
        &mut stream,
        format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes(),
    )
    .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    Some(text)
}

/// `ftrec_steps_total` from a coordinator's metrics endpoint.
pub fn steps_total(address: &str, timeout: Duration) -> Option<u64> {
    http_get(address, "/metrics", timeout)?
        .lines()
        .find(|l| l.starts_with("ftrec_steps_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_lines_read_with_their_subject() {
        let line = "2026-11-29T04:00:00Z  INFO ftrec_proto::timeline: [  12.34s] \
                    failure-detected: server 3 missed heartbeats; epoch 2 subject=server-3";
        assert_eq!(
            parse_line(line),
            Some(Seen::Event {
                kind: EventKind::FailureDetected,
                server: Some(3)
            })
        );
        let line = "INFO x: [   1.00s] rebuild-end: server 1 rebuilt 2 MB";
        assert_eq!(
            parse_line(line),
            Some(Seen::Event {
                kind: EventKind::RebuildEnd,
                server: None
            })
        );
        assert_eq!(parse_line("INFO x: [   1.00s] not-a-kind: x"), None);
    }

    #[test]
    fn leads_metrics_and_slots_read() {
        assert_eq!(
            parse_line("INFO coordinator c2 leads the job (term 3, lease TTL 3s)"),
            Some(Seen::Leads)
        );
        assert_eq!(
            parse_line("INFO listening on 10.0.0.1:7070 (metrics http://10.0.0.1:9100/metrics)"),
            Some(Seen::Metrics("10.0.0.1:9100".into()))
        );
        assert_eq!(
            parse_line("INFO ftrec_server::start: server 2 at 10.78.0.9:7071, epoch 3"),
            Some(Seen::Serves(2))
        );
        assert_eq!(
            parse_line("spare server at 10.78.0.9:7071 waiting for a slot"),
            None
        );
    }

    #[test]
    fn a_follower_returns_whole_lines_once() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("a.log");
        std::fs::write(&path, "one\ntw").unwrap_or_else(|e| panic!("{e}"));
        let mut f = Follower::new(path.clone());
        assert_eq!(f.poll(), vec!["one".to_string()]);
        std::fs::write(&path, "one\ntwo\nthree\n").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.poll(), vec!["two".to_string(), "three".to_string()]);
        assert!(f.poll().is_empty());
    }
}
