//! Client-certificate identities against the real binary: only the leaf
//! the handshake verified names the caller, read as RFC 6125 says (SANs;
//! the CN only without any SAN), and read once per connection.
//!
//! The attacks come from a security review: a leaf for a name nobody was
//! given, followed in the chain by a self-signed certificate naming an
//! admin; an intermediate CA named like an admin; a CN naming an admin on
//! a certificate whose SAN names someone else.

use retryd_testkit as support;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
use retryd_proto as pb;
use retryd_proto::retry_admin_client::RetryAdminClient;
use support::Server;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

const ADMIN: &str = "sre.ops.example.com";
const NOBODY: &str = "nobody.example.com";

/// A certificate's PEM and its key's PEM.
struct Issued {
    pem: String,
    key: String,
}

/// Certificate parameters with exactly these DNS SANs and this CN (rcgen
/// would otherwise add a CN of its own).
fn params(sans: &[&str], common_name: Option<&str>) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.subject_alt_names = sans
        .iter()
        .map(|name| SanType::DnsName((*name).try_into().unwrap()))
        .collect();
    params.distinguished_name = rcgen::DistinguishedName::new();
    if let Some(common_name) = common_name {
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
    }
    params
}

fn ca_params(common_name: &str, sans: &[&str]) -> CertificateParams {
    let mut params = params(sans, Some(common_name));
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
}

fn issue(params: CertificateParams, issuer: &Issuer<'_, KeyPair>) -> Issued {
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    Issued {
        pem: cert.pem(),
        key: key.serialize_pem(),
    }
}

struct Pki {
    ca_pem: String,
    ca: Issuer<'static, KeyPair>,
    server: Issued,
}

fn pki() -> Pki {
    let key = KeyPair::generate().unwrap();
    let params = ca_params("retryd test client CA", &[]);
    let ca_pem = params.self_signed(&key).unwrap().pem();
    let ca = Issuer::new(params, key);
    let server = issue(params_for_server(), &ca);
    Pki { ca_pem, ca, server }
}

fn params_for_server() -> CertificateParams {
    params(&["localhost"], None)
}

/// A server with mTLS (`client_auth` required or optional) and one admin
/// principal known only by its certificate identity.
fn server(pki: &Pki, client_auth: &str) -> (Server, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let config = format!(
        r#"[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"
[server.tls]
cert_file = "{}"
key_file = "{}"
client_ca_file = "{}"
client_auth = "{client_auth}"

[[auth.principals]]
name = "sre"
identities = ["{ADMIN}"]
upstreams = ["*"]
admin = true
"#,
        write("server.pem", &pki.server.pem),
        write("server.key", &pki.server.key),
        write("ca.pem", &pki.ca_pem),
    );
    (Server::start(&config), dir)
}

/// A channel presenting `chain` (PEM certificates, leaf first) and the
/// leaf's key.
async fn connect(server: &Server, pki: &Pki, chain: &str, key: &str) -> Channel {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost")
        .identity(Identity::from_pem(chain, key));
    Endpoint::from_shared(format!("https://{}", server.grpc))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("the handshake accepts a leaf that chains to the client CA")
}

/// What switching retries off (an admin act) answers on `channel`.
async fn kill_switch(channel: &Channel) -> Code {
    let mut admin = RetryAdminClient::new(channel.clone());
    let request = pb::SetRetriesEnabledRequest {
        upstream: "ledger".into(),
        enabled: false,
        reason: "mtls test".into(),
    };
    match admin.set_retries_enabled(request).await {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    }
}

#[tokio::test]
async fn only_the_verified_leaf_names_the_caller() {
    let pki = pki();
    for client_auth in ["required", "optional"] {
        let (server, _dir) = server(&pki, client_auth);

        // Controls: the admin's own certificate, by SAN and (without any
        // SAN) by CN, is the admin.
        let by_san = issue(params(&[ADMIN], None), &pki.ca);
        let channel = connect(&server, &pki, &by_san.pem, &by_san.key).await;
        assert_eq!(kill_switch(&channel).await, Code::Ok, "{client_auth}: SAN");
        // A DNS name compares in any case (RFC 6125).
        let shouting = issue(params(&[&ADMIN.to_ascii_uppercase()], None), &pki.ca);
        let channel = connect(&server, &pki, &shouting.pem, &shouting.key).await;
        assert_eq!(
            kill_switch(&channel).await,
            Code::Ok,
            "{client_auth}: SAN in upper case"
        );
        let by_cn = issue(params(&[], Some(ADMIN)), &pki.ca);
        let channel = connect(&server, &pki, &by_cn.pem, &by_cn.key).await;
        assert_eq!(kill_switch(&channel).await, Code::Ok, "{client_auth}: CN");

        // A leaf for nobody, followed by a self-signed certificate naming
        // the admin: the extra certificate was never verified.
        let nobody = issue(params(&[NOBODY], None), &pki.ca);
        let forged_key = KeyPair::generate().unwrap();
        let forged = params(&[ADMIN], Some(ADMIN))
            .self_signed(&forged_key)
            .unwrap()
            .pem();
        let chain = format!("{}{forged}", nobody.pem);
        let channel = connect(&server, &pki, &chain, &nobody.key).await;
        assert_eq!(
            kill_switch(&channel).await,
            Code::Unauthenticated,
            "{client_auth}: a forged certificate after the leaf"
        );

        // An intermediate CA named like the admin promotes nothing it
        // issues.
        let intermediate_key = KeyPair::generate().unwrap();
        let intermediate_params = ca_params(ADMIN, &[ADMIN]);
        let intermediate_pem = intermediate_params
            .signed_by(&intermediate_key, &pki.ca)
            .unwrap()
            .pem();
        let intermediate = Issuer::new(intermediate_params, intermediate_key);
        let issued = issue(params(&[NOBODY], None), &intermediate);
        let chain = format!("{}{intermediate_pem}", issued.pem);
        let channel = connect(&server, &pki, &chain, &issued.key).await;
        assert_eq!(
            kill_switch(&channel).await,
            Code::Unauthenticated,
            "{client_auth}: an intermediate named like the admin"
        );

        // A CN naming the admin on a certificate whose SAN names someone
        // else: the SAN is what the certificate vouches for.
        let mixed = issue(params(&[NOBODY], Some(ADMIN)), &pki.ca);
        let channel = connect(&server, &pki, &mixed.pem, &mixed.key).await;
        assert_eq!(
            kill_switch(&channel).await,
            Code::Unauthenticated,
            "{client_auth}: CN of the admin, SAN of another"
        );

        // Nothing of the refused attempts switched retries off: only the
        // two controls did, as the admin.
        let logs = server.logs();
        assert!(!logs.contains("principal=\"nobody"), "{logs}");
    }
}

/// The server's CPU per call for `calls` kill-switch calls on `channel`.
async fn cpu_per_call(server: &Server, channel: &Channel, calls: u32) -> f64 {
    let before = server.cpu_seconds();
    for _ in 0..calls {
        assert_eq!(kill_switch(channel).await, Code::Ok);
    }
    (server.cpu_seconds() - before) / f64::from(calls)
}

#[tokio::test]
async fn a_long_chain_costs_once_per_connection_not_per_call() {
    let pki = pki();
    let (server, _dir) = server(&pki, "required");
    let admin = issue(params(&[ADMIN], None), &pki.ca);
    // A client may send any certificates after its leaf; they were parsed
    // on every call, before the API key was even looked at.
    let padding_key = KeyPair::generate().unwrap();
    let padding: String = (0..100)
        .map(|i| {
            params(&[&format!("pad{i}.example.com")], None)
                .self_signed(&padding_key)
                .unwrap()
                .pem()
        })
        .collect();
    let short = connect(&server, &pki, &admin.pem, &admin.key).await;
    let long = connect(
        &server,
        &pki,
        &format!("{}{padding}", admin.pem),
        &admin.key,
    )
    .await;
    // Warm up both, then measure them alternately, so that a change in the
    // machine's load falls on both.
    cpu_per_call(&server, &short, 50).await;
    cpu_per_call(&server, &long, 50).await;
    let (mut short_cpu, mut long_cpu) = (0.0, 0.0);
    for _ in 0..4 {
        short_cpu += cpu_per_call(&server, &short, 500).await;
        long_cpu += cpu_per_call(&server, &long, 500).await;
    }
    // Parsed per call, the long chain cost about ten times the short one
    // (540 against 55 µs in the review; 1,700 against 600 in a debug build).
    assert!(
        long_cpu < 1.8 * short_cpu.max(1e-6),
        "CPU per call: {:.0} µs with 100 extra certificates, {:.0} µs without",
        long_cpu / 4.0 * 1e6,
        short_cpu / 4.0 * 1e6
    );
}
