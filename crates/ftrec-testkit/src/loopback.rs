//! A server process on a free loopback port, killed when dropped: what the moto (S3) and
//! Azurite (Azure) test servers share.

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::deps;

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
/// port accepts connections. `what` names the server in failures; the caller has checked
/// that it is installed (see [`deps`]).
/// The port is found by binding and releasing it, so another process may take it first:
/// then the server exits, and it is started again on another port (3 tries).
#[track_caller]
pub fn start(program: &Path, args: impl Fn(&str) -> Vec<String>, what: &str) -> LoopbackServer {
    for _ in 0..3 {
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
            .unwrap_or_else(|e| deps::missing(what, format_args!("{}: {e}", program.display())));
        let mut server = LoopbackServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut up = false;
        while Instant::now() < deadline {
            if server.child.try_wait().ok().flatten().is_some() {
                break; // exited: most likely the port was taken
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                up = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Answering on the port is not enough: it must be our process that does.
        std::thread::sleep(Duration::from_millis(200));
        if up && server.child.try_wait().ok().flatten().is_none() {
            return server;
        }
    }
    panic!(
        "{what} did not start on a loopback port in 3 tries (`{}` reinstalls it)",
        deps::INSTALL
    )
}
