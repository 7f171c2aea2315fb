//! Azurite, Microsoft's Azure Storage emulator (`npm install -g azurite`), on loopback for
//! tests; shared by the ftrec-ckpt and ftrec test suites through `#[path]`.
#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Azurite's well-known development account and key (public, documented by Microsoft).
pub const ACCOUNT: &str = "devstoreaccount1";
pub const KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

pub struct AzureServer {
    child: Child,
    pub port: u16,
}

impl Drop for AzureServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start_server() -> AzureServer {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("azurite-blob")
        .args([
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            &port.to_string(),
            "--inMemoryPersistence",
            "--skipApiVersionCheck",
            "--disableTelemetry",
            "--silent",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("azurite-blob (npm install -g azurite)");
    let server = AzureServer { child, port };
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "azurite did not start on port {port}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

/// Creates a container with a Shared Key signed REST call (object_store does not manage
/// containers), signed by Python's standard library.
pub fn create_container(port: u16, container: &str) {
    const SCRIPT: &str = r#"
import base64, email.utils, hashlib, hmac, sys, urllib.request
port, container, account, key = sys.argv[1:5]
date = email.utils.formatdate(usegmt=True)
version = "2021-08-06"
to_sign = "\n".join(["PUT"] + [""] * 11 + [
    f"x-ms-date:{date}\nx-ms-version:{version}",
    f"/{account}/{account}/{container}\nrestype:container"])
sig = base64.b64encode(hmac.new(base64.b64decode(key), to_sign.encode(), hashlib.sha256).digest())
req = urllib.request.Request(
    f"http://127.0.0.1:{port}/{account}/{container}?restype=container", method="PUT",
    headers={"x-ms-date": date, "x-ms-version": version, "Content-Length": "0",
             "Authorization": f"SharedKey {account}:{sig.decode()}"})
print(urllib.request.urlopen(req).status)
"#;
    let out = Command::new("python3")
        .args(["-c", SCRIPT, &port.to_string(), container, ACCOUNT, KEY])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).trim() == "201",
        "create container: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ObjectStoreBackend::open_with_options` settings that reach `server`.
pub fn options(server: &AzureServer) -> Vec<(&'static str, String)> {
    vec![
        ("azure_storage_account_name", ACCOUNT.into()),
        ("azure_storage_account_key", KEY.into()),
        (
            "azure_storage_endpoint",
            format!("http://127.0.0.1:{}/{ACCOUNT}", server.port),
        ),
        ("allow_http", "true".into()),
    ]
}

/// Environment for a child process that talks to `server`, as a user would set it.
pub fn env(server: &AzureServer) -> Vec<(&'static str, String)> {
    vec![
        ("AZURE_STORAGE_USE_EMULATOR", "true".into()),
        (
            "AZURITE_BLOB_STORAGE_URL",
            format!("http://127.0.0.1:{}", server.port),
        ),
    ]
}
