//! The cluster is closed: calls without the job's secret are refused, epochs only move
//! forward, a server pushed into a foreign epoch ends the run with that cause, and a TLS
//! cluster trains on loopback bit-exactly.

use ftrec_testkit::ClusterRun;
use ftrec_testkit::cluster::announced;

use crate::FTREC;

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use ftrec_proto::proto::coordinator_client::CoordinatorClient;
use ftrec_proto::proto::parameter_server_client::ParameterServerClient;
use ftrec_proto::proto::{PlacementRequest, SetEpochRequest};
use tonic::Code;

const SECRET_KEY: &str = "x-ftrec-job-secret";

fn with_secret<T>(message: T, secret: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert(SECRET_KEY, secret.parse().unwrap());
    request
}

fn set_epoch(epoch: u64) -> SetEpochRequest {
    SetEpochRequest {
        finish: Vec::new(),
        epoch,
        applied: 0,
        unsettled: Vec::new(),
    }
}

#[test]
fn strangers_are_refused_and_a_server_forced_into_a_later_epoch_ends_the_run_with_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let run = dir.path().join("run");
    let args = ClusterRun::new(&data)
        .run_dir(&run)
        .steps(100000)
        .servers(1)
        .workers(1)
        .no_eval()
        .args();
    let mut child = FTREC
        .command()
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (address, _, mut stderr) = announced(&mut child);
    let secret = std::fs::read_to_string(run.join("job.secret")).unwrap();
    let secret = secret.trim();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut coordinator = CoordinatorClient::connect(format!("http://{address}"))
            .await
            .unwrap();
        let none = coordinator
            .placement(PlacementRequest {})
            .await
            .unwrap_err();
        assert_eq!(none.code(), Code::Unauthenticated, "{none:?}");
        assert!(none.message().contains("no job secret"), "{none:?}");
        let wrong = "0".repeat(secret.len());
        let wrong = coordinator
            .placement(with_secret(PlacementRequest {}, &wrong))
            .await
            .unwrap_err();
        assert_eq!(wrong.code(), Code::Unauthenticated);
        assert!(wrong.message().contains("wrong job secret"), "{wrong:?}");

        // The member's own secret is admitted: find server 0 once it has joined.
        let started = Instant::now();
        let server = loop {
            let placement = coordinator
                .placement(with_secret(PlacementRequest {}, secret))
                .await
                .unwrap()
                .into_inner();
            if let Some(a) = placement.servers.first().filter(|a| !a.is_empty()) {
                break a.clone();
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "no server joined"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let mut server = ParameterServerClient::connect(format!("http://{server}"))
            .await
            .unwrap();
        // The attack the issue measured: an unauthenticated SetEpoch(0).
        let e = server.set_epoch(set_epoch(0)).await.unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        // A member gone wrong (it holds the secret) moves the server to a foreign epoch;
        // after that, an older epoch is refused: epochs only move forward.
        server
            .set_epoch(with_secret(set_epoch(1000), secret))
            .await
            .unwrap();
        let back = server
            .set_epoch(with_secret(set_epoch(999), secret))
            .await
            .unwrap_err();
        assert!(back.message().contains("stale epoch 999"), "{back:?}");
    });
    // The coordinator notices that its server refuses every step, and says why, instead of
    // burning the schedule until the time limit.
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the run went on after its server left the cluster's epoch");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    assert!(!status.success());
    assert!(
        rest.contains("epoch 1000") && rest.contains("outside this job"),
        "{rest}"
    );
}

/// A CA and a certificate for `localhost` signed by it, as PEM files in `dir`.
fn test_certificates(dir: &std::path::Path) -> [std::path::PathBuf; 3] {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().unwrap())
        .unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let paths = ["ca.pem", "cert.pem", "key.pem"].map(|n| dir.join(n));
    std::fs::write(&paths[0], ca.pem()).unwrap();
    std::fs::write(&paths[1], cert.pem()).unwrap();
    std::fs::write(&paths[2], key.serialize_pem()).unwrap();
    paths
}

#[test]
fn a_tls_cluster_trains_bit_exactly_and_refuses_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let [ca, cert, key] = test_certificates(dir.path());
    let run = dir.path().join("run");
    let sets = [
        format!("security.tls_ca={:?}", ca.to_str().unwrap()),
        format!("security.tls_cert={:?}", cert.to_str().unwrap()),
        format!("security.tls_key={:?}", key.to_str().unwrap()),
    ];
    let args = sets
        .iter()
        .fold(
            ClusterRun::new(&data)
                .run_dir(&run)
                .steps(40)
                .servers(2)
                .workers(1)
                .deterministic()
                .no_eval(),
            |run, s| run.set(s),
        )
        .args();
    let mut child = FTREC
        .command()
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (address, _, mut stderr) = announced(&mut child);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // Plaintext HTTP/2 to a TLS listener never becomes a call.
        match CoordinatorClient::connect(format!("http://{address}")).await {
            Err(_) => {}
            Ok(mut c) => {
                let e = c.placement(PlacementRequest {}).await.unwrap_err();
                assert_ne!(e.code(), Code::Ok);
            }
        }
    });
    let out = child.wait_with_output().unwrap();
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    assert!(out.status.success(), "{rest}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["steps"], 40);
    assert_eq!(
        report["state_digest"],
        FTREC.single_process_digest(&data, "40")
    );
}
