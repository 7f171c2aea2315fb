//! A server process on a free loopback port, killed when dropped: what the moto (S3) and
//! Azurite (Azure) test servers share.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct LoopbackServer {
    child: Child,
    pub port: u16,
}

impl Drop for LoopbackServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `program` with `args(port)` on a free port and waits (30 s at most) until the
/// port accepts connections. `install` says how to get the program when it is missing.
pub fn start(
    program: &str,
    args: impl FnOnce(&str) -> Vec<String>,
    install: &str,
) -> LoopbackServer {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(program)
        .args(args(&port.to_string()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{program}: {e} ({install})"));
    let server = LoopbackServer { child, port };
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{program} did not start on port {port}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}
