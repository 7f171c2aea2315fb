//! A real S3-compatible server (moto's, from PyPI) on loopback for tests.

use std::io::{Read, Write};
use std::net::TcpStream;

use crate::{deps, loopback};

pub type S3Server = loopback::LoopbackServer;

const WHAT: &str = "moto's S3 server (the Python package moto[server])";

/// Starts moto's server; fails the test naming moto and `./scripts/test-deps` where
/// Python cannot import it.
#[track_caller]
pub fn start_server() -> S3Server {
    deps::python_module("moto.server", WHAT);
    loopback::start(
        &deps::program("python3", "python3"),
        |port| {
            ["-m", "moto.server", "-H", "127.0.0.1", "-p", port]
                .map(String::from)
                .to_vec()
        },
        WHAT,
    )
}

/// Creates a bucket with a plain HTTP PUT (object_store does not manage buckets), asking
/// again for a few seconds while the server is still coming up.
pub fn create_bucket(port: u16, bucket: &str) {
    let attempt = || -> std::io::Result<String> {
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
        write!(
            s,
            "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )?;
        let mut reply = String::new();
        s.read_to_string(&mut reply)?;
        Ok(reply)
    };
    let mut last = None;
    for _ in 0..50 {
        match attempt() {
            Ok(reply) if reply.starts_with("HTTP/1.1 200") => return,
            other => last = Some(other),
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("create bucket {bucket}: {last:?}");
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
