//! A real S3-compatible server (moto's, from PyPI) on loopback for tests; shared by the
//! ftrec-ckpt and ftrec test suites through `#[path]`.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct S3Server {
    child: Child,
    pub port: u16,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start_server() -> S3Server {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("python3")
        .args([
            "-m",
            "moto.server",
            "-H",
            "127.0.0.1",
            "-p",
            &port.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3 -m moto.server (pip install 'moto[server]')");
    let server = S3Server { child, port };
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "moto server did not start on port {port}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

/// Creates a bucket with a plain HTTP PUT (object_store does not manage buckets).
pub fn create_bucket(port: u16, bucket: &str) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "create bucket: {reply}");
}

/// Environment for a child process that talks to `server`.
pub fn env(server: &S3Server) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT", format!("http://127.0.0.1:{}", server.port)),
        ("AWS_ALLOW_HTTP", "true".into()),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("AWS_REGION", "us-east-1".into()),
    ]
}
