//! TLS to Redis: a real `redis-server --tls-port`, with certificates made
//! here (rcgen). Exact and leased decisions over TLS; a CA that did not
//! sign the server's certificate is refused at connect, with the cause
//! said; a server requiring client certificates is refused without one and
//! served with one; and a server name that the certificate does not carry
//! is refused (the name is checked).

use retryd_testkit::redis as redis_harness;

use std::path::PathBuf;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use redis_harness::{RedisServer, TlsFiles};
use retryd_budget::redis::{Exact, Leased, Mode, RedisAccess, RedisConfig, RedisTls};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore, StoreError};

/// A CA and what it issued, as PEM files in one directory.
struct Pki {
    dir: tempfile::TempDir,
    ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_pem = params.self_signed(&key).unwrap().pem();
        Pki {
            dir: tempfile::tempdir().unwrap(),
            ca_pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf for `names`, written as `<file>.pem` and `<file>.key`.
    fn issue(&self, file: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.subject_alt_names = names
            .iter()
            .map(|name| SanType::DnsName((*name).try_into().unwrap()))
            .collect();
        let certificate = params.signed_by(&key, &self.issuer).unwrap();
        let cert_path = self.dir.path().join(format!("{file}.pem"));
        let key_path = self.dir.path().join(format!("{file}.key"));
        std::fs::write(&cert_path, certificate.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (cert_path, key_path)
    }

    fn ca_file(&self) -> PathBuf {
        let path = self.dir.path().join("ca.pem");
        std::fs::write(&path, &self.ca_pem).unwrap();
        path
    }

    /// A TLS server whose certificate this CA signed for `localhost`, and
    /// which trusts this CA's client certificates.
    fn server(&self, require_client_certificates: bool) -> RedisServer {
        let (cert, key) = self.issue("server", &["localhost"]);
        let files = TlsFiles {
            cert,
            key,
            client_ca: self.ca_file(),
        };
        RedisServer::start_tls(&files, require_client_certificates)
    }
}

fn bucket() -> BucketConfig {
    BucketConfig {
        capacity: 20.0,
        initial: 20.0,
        ratio: 0.5,
        min_per_second: 0.0,
        on_unavailable: OnUnavailable::Deny,
        configured: false,
    }
}

fn config<M: Mode>(url: String, tls: RedisTls) -> RedisConfig {
    RedisConfig {
        urls: vec![url.into()],
        mode: M::MODE,
        timeout: Duration::from_millis(20), // the server's default
        lease_tokens: 2.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: redis_harness::fresh_prefix("tls"),
        access: RedisAccess {
            tls,
            ..RedisAccess::default()
        },
    }
}

fn trusting(pki: &Pki) -> RedisTls {
    RedisTls {
        ca_pem: Some(pki.ca_pem.clone().into_bytes()),
        ..RedisTls::default()
    }
}

/// Every one of the bucket's tokens granted once, then a denial: the
/// decisions ran in Redis, over TLS.
async fn spends_the_shared_budget<M: Mode>(store: &RedisBudgetStore<M>) {
    let config = bucket();
    for n in 0..20 {
        let check = store.check("tls-up", &config, true).await.unwrap();
        assert!(check.withdrew, "decision {n} over TLS was denied");
    }
    let check = store.check("tls-up", &config, true).await.unwrap();
    assert!(!check.withdrew, "the 21st decision found a token");
    assert_eq!(store.stats().fallbacks, 0, "no decision fell back");
}

async fn connect_error<M: Mode>(config: &RedisConfig) -> String {
    match RedisBudgetStore::<M>::connect(config, 100).await {
        Ok(_) => panic!("connected to {:?}", config.urls),
        Err(StoreError::Unavailable(cause)) => cause.to_string(),
        Err(other) => panic!("unexpected error {other:?}"),
    }
}

#[tokio::test]
async fn exact_and_leased_decisions_run_over_tls() {
    let pki = Pki::new("retryd test Redis CA");
    let server = pki.server(false);
    let exact: RedisBudgetStore<Exact> =
        RedisBudgetStore::connect(&config::<Exact>(server.tls_url(), trusting(&pki)), 100)
            .await
            .expect("connect over TLS");
    spends_the_shared_budget(&exact).await;
    let leased: RedisBudgetStore<Leased> =
        RedisBudgetStore::connect(&config::<Leased>(server.tls_url(), trusting(&pki)), 100)
            .await
            .expect("connect over TLS");
    spends_the_shared_budget(&leased).await;
    leased.shutdown().await;
    // Redis saw TLS clients, not only the harness's plain ones.
    let clients = server.cli(&["INFO", "stats"]);
    assert!(clients.contains("total_connections_received"), "{clients}");
}

#[tokio::test]
async fn a_wrong_ca_or_a_wrong_name_is_refused_at_connect_with_its_cause() {
    let pki = Pki::new("retryd test Redis CA");
    let server = pki.server(false);
    let stranger = Pki::new("some other CA");
    let cause =
        connect_error::<Exact>(&config::<Exact>(server.tls_url(), trusting(&stranger))).await;
    assert!(
        cause.to_lowercase().contains("certificate"),
        "the cause does not say it is the certificate: {cause}"
    );
    // The certificate names localhost; 127.0.0.1 is not in it.
    let by_address = server.tls_url().replace("localhost", "127.0.0.1");
    let cause = connect_error::<Exact>(&config::<Exact>(by_address, trusting(&pki))).await;
    assert!(
        cause.to_lowercase().contains("certificate"),
        "a name the certificate does not carry was accepted or misreported: {cause}"
    );
    // Only under its insecure name does the wrong CA pass.
    let insecure = RedisTls {
        insecure_skip_verify: true,
        ..trusting(&stranger)
    };
    let store: RedisBudgetStore<Exact> =
        RedisBudgetStore::connect(&config::<Exact>(server.tls_url(), insecure), 100)
            .await
            .expect("insecure_skip_verify connects to any certificate");
    spends_the_shared_budget(&store).await;
}

#[tokio::test]
async fn mutual_tls_required_by_redis_is_provided_by_retryd() {
    let pki = Pki::new("retryd test Redis CA");
    let server = pki.server(true);
    // Without a client certificate the server refuses the handshake.
    let cause = connect_error::<Exact>(&config::<Exact>(server.tls_url(), trusting(&pki))).await;
    assert!(!cause.is_empty());
    let (cert, key) = pki.issue("client", &["retryd"]);
    let with_client = RedisTls {
        client_pem: Some((std::fs::read(cert).unwrap(), std::fs::read(key).unwrap())),
        ..trusting(&pki)
    };
    let store: RedisBudgetStore<Exact> =
        RedisBudgetStore::connect(&config::<Exact>(server.tls_url(), with_client), 100)
            .await
            .expect("connect with a client certificate");
    spends_the_shared_budget(&store).await;
}
