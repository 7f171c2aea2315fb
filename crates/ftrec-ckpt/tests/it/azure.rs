//! The checkpoint engine against Azurite, Microsoft's Azure Storage emulator (from npm),
//! started by the test on loopback. No mock: requests go over HTTP to the server.

use ftrec_ckpt::ObjectStoreBackend;
use ftrec_testkit::azurite;

use crate::object_suite;

#[test]
fn store_contract_and_every_strategy_restores_exactly_over_azure() {
    let server = azurite::start_server();
    azurite::create_container(server.port, "ckpt");
    let options = azurite::options(&server);
    let options: Vec<(&str, &str)> = options.iter().map(|(k, v)| (*k, v.as_str())).collect();
    object_suite::run("az://ckpt", |url| {
        ObjectStoreBackend::open_with_options(url, &options).unwrap()
    });
}

#[test]
fn an_unknown_store_option_is_an_error_naming_it() {
    let e = ObjectStoreBackend::open_with_options("az://ckpt/x", &[("azure_no_such_key", "1")])
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("azure_no_such_key") && e.contains("az://ckpt/x"),
        "{e}"
    );
}
