//! The checkpoint engine against a real S3-compatible server (moto's, from PyPI) that the
//! test starts on loopback. No mock: requests go over HTTP to the server.

use ftrec_ckpt::ObjectStoreBackend;
use ftrec_testkit::moto;

use crate::object_suite;

#[test]
fn store_contract_and_every_strategy_restores_exactly_over_s3() {
    let server = moto::start_server();
    moto::create_bucket(server.port, "ckpt");
    let endpoint = format!("http://127.0.0.1:{}", server.port);
    let options = [
        ("aws_endpoint", endpoint.as_str()),
        ("allow_http", "true"),
        ("aws_access_key_id", "test"),
        ("aws_secret_access_key", "test"),
        ("aws_region", "us-east-1"),
    ];
    object_suite::run("s3://ckpt", |url| {
        ObjectStoreBackend::open_with_options(url, &options).unwrap()
    });
}
