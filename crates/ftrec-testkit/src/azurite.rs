//! Azurite, Microsoft's Azure Storage emulator (`npm install -g azurite`), on loopback for
//! tests.

use std::process::Command;

use crate::{deps, loopback};

/// Azurite's well-known development account and key (public, documented by Microsoft).
pub const ACCOUNT: &str = "devstoreaccount1";
pub const KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

pub type AzureServer = loopback::LoopbackServer;

const WHAT: &str = "Azurite, the Azure Storage emulator (the npm package azurite)";

/// Starts Azurite's blob service; fails the test naming Azurite and `./scripts/test-deps`
/// where `azurite-blob` is not installed.
#[track_caller]
pub fn start_server() -> AzureServer {
    loopback::start(
        &deps::program("azurite-blob", WHAT),
        |port| {
            [
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                port,
                "--inMemoryPersistence",
                "--skipApiVersionCheck",
                "--disableTelemetry",
                "--silent",
            ]
            .map(String::from)
            .to_vec()
        },
        WHAT,
    )
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
    let out = Command::new(deps::program("python3", "python3"))
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
