//! Security and robustness against the real binary: authentication and
//! authorization, TLS and mTLS, the refusal to listen publicly without
//! auth, limits, the upstream-name flood, and atomic reloads.

use retryd_testkit as support;

use std::time::Duration;

use retryd_proto as pb;
use retryd_proto::retry_admin_client::RetryAdminClient;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use support::{Server, retryable};
use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

const CHECKOUT_KEY: &str = "checkout-key-0123456789";
const OPS_KEY: &str = "ops-key-0123456789abcdef";

fn sha(key: &str) -> String {
    retryd::auth::hash_key(key)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn auth_config() -> String {
    format!(
        r#"
        [[auth.principals]]
        name = "checkout"
        api_keys_sha256 = ["{}"]
        upstreams = ["payments-*"]

        [[auth.principals]]
        name = "ops"
        api_keys_sha256 = ["{}"]
        identities = ["ops.example"]
        upstreams = ["*"]
        admin = true
        "#,
        sha(CHECKOUT_KEY),
        sha(OPS_KEY)
    )
}

fn with_key<T>(message: T, authorization: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(value) = authorization {
        request
            .metadata_mut()
            .insert("authorization", MetadataValue::try_from(value).unwrap());
    }
    request
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Rpc {
    DecidePayments,
    DecideLedger,
    StreamLedger,
    ReportPayments,
    ReportLedger,
    GetBudget,
    ListBudgets,
    SetRetriesEnabled,
    ReloadConfig,
}

async fn call(channel: &Channel, rpc: Rpc, authorization: Option<&str>) -> Code {
    let mut decider = RetryDeciderClient::new(channel.clone());
    let mut admin = RetryAdminClient::new(channel.clone());
    let report = |upstream: &str| pb::ReportTrafficRequest {
        traffic: vec![pb::UpstreamTraffic {
            upstream: upstream.into(),
            requests: 100,
            ..Default::default()
        }],
        ..Default::default()
    };
    let code =
        |result: Result<(), tonic::Status>| result.err().map_or(Code::Ok, |status| status.code());
    match rpc {
        Rpc::DecidePayments => code(
            decider
                .decide(with_key(retryable("payments-api"), authorization))
                .await
                .map(drop),
        ),
        Rpc::DecideLedger => code(
            decider
                .decide(with_key(retryable("ledger"), authorization))
                .await
                .map(drop),
        ),
        Rpc::StreamLedger => {
            let stream = tokio_stream::iter(vec![retryable("ledger")]);
            match decider.decide_stream(with_key(stream, authorization)).await {
                Err(status) => status.code(),
                // A forbidden upstream inside an authenticated stream is an
                // error item, not the end of the stream.
                Ok(response) => {
                    let item = response.into_inner().message().await.unwrap().unwrap();
                    item.error
                        .map_or(Code::Ok, |error| Code::from_i32(error.code))
                }
            }
        }
        Rpc::ReportPayments => code(
            decider
                .report_traffic(with_key(report("payments-api"), authorization))
                .await
                .map(drop),
        ),
        Rpc::ReportLedger => code(
            decider
                .report_traffic(with_key(report("ledger"), authorization))
                .await
                .map(drop),
        ),
        Rpc::GetBudget => code(
            admin
                .get_budget(with_key(
                    pb::GetBudgetRequest {
                        upstream: "ledger".into(),
                    },
                    authorization,
                ))
                .await
                .map(drop),
        ),
        Rpc::ListBudgets => code(
            admin
                .list_budgets(with_key(pb::ListBudgetsRequest {}, authorization))
                .await
                .map(drop),
        ),
        Rpc::SetRetriesEnabled => code(
            admin
                .set_retries_enabled(with_key(
                    pb::SetRetriesEnabledRequest {
                        upstream: "search".into(),
                        enabled: false,
                        reason: "test".into(),
                    },
                    authorization,
                ))
                .await
                .map(drop),
        ),
        Rpc::ReloadConfig => code(
            admin
                .reload_config(with_key(pb::ReloadConfigRequest {}, authorization))
                .await
                .map(drop),
        ),
    }
}

#[tokio::test]
async fn callers_upstreams_and_rpcs() {
    let server = Server::start(&format!(
        "[defaults]\nbudget = {{ min_per_second = 0.0, ratio = 0.0 }}\n{}",
        auth_config()
    ));
    let channel = server.channel().await;
    let checkout = format!("Bearer {CHECKOUT_KEY}");
    let ops = format!("Bearer {OPS_KEY}");
    let callers: [(&str, Option<&str>); 5] = [
        ("nobody", None),
        ("wrong key", Some("Bearer not-a-key-at-all")),
        ("not bearer", Some("Basic b3BzOm9wcw==")),
        ("checkout", Some(&checkout)),
        ("ops", Some(&ops)),
    ];
    use Code::*;
    use Rpc::*;
    let rpcs = [
        DecidePayments,
        DecideLedger,
        StreamLedger,
        ReportPayments,
        ReportLedger,
        GetBudget,
        ListBudgets,
        SetRetriesEnabled,
        ReloadConfig,
    ];
    // Rows: callers; columns: rpcs.
    let expected: [[Code; 9]; 5] = [
        [Unauthenticated; 9],
        [Unauthenticated; 9],
        [Unauthenticated; 9],
        [
            Ok,
            PermissionDenied,
            PermissionDenied,
            Ok,
            PermissionDenied,
            PermissionDenied,
            PermissionDenied,
            PermissionDenied,
            PermissionDenied,
        ],
        [Ok; 9],
    ];
    for ((caller, authorization), row) in callers.iter().zip(expected) {
        for (rpc, want) in rpcs.iter().zip(row) {
            let got = call(&channel, *rpc, *authorization).await;
            assert_eq!(got, want, "{caller} calling {rpc:?}");
        }
    }

    // The refused calls spent and deposited nothing: ledger saw exactly one
    // RETRY (ops' Decide) and one stream item (ops), and one report (ops).
    let budget = RetryAdminClient::new(channel.clone())
        .get_budget(with_key(
            pb::GetBudgetRequest {
                upstream: "ledger".into(),
            },
            Some(&ops),
        ))
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert_eq!(budget.tokens, 98.0, "{budget:?}");
    let scrape = server.scrape();
    assert!(
        scrape.contains("retryd_reported_requests_total 300"),
        "three permitted reports of 100 (checkout: payments; ops: both):\n{scrape}"
    );
}

#[test]
fn refuses_to_listen_publicly_without_auth() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("public.toml");
    // Refused at validation, before anything is bound.
    std::fs::write(
        &config,
        "[server]\nlisten = \"0.0.0.0:0\"\nmetrics_listen = \"127.0.0.1:0\"\n",
    )
    .unwrap();
    let output = std::process::Command::new(support::binary())
        .args(["serve", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("server.listen") && stderr.contains("[auth]"),
        "{stderr}"
    );
    assert!(output.stdout.is_empty());

    for accepted in [
        "[server]\nlisten = \"0.0.0.0:0\"\nallow_unauthenticated = true\n".to_owned(),
        format!("[server]\nlisten = \"0.0.0.0:0\"\n{}", auth_config()),
    ] {
        std::fs::write(&config, accepted).unwrap();
        let output = std::process::Command::new(support::binary())
            .arg("check-config")
            .arg(&config)
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
    }
}

struct Pki {
    ca_pem: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
    stranger_cert: String,
    stranger_key: String,
}

fn pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "retryd test CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let ca = Issuer::new(ca_params, ca_key);

    let leaf = |names: Vec<String>, issuer: &Issuer<'_, KeyPair>| {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(names).unwrap();
        let cert = params.signed_by(&key, issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".into()], &ca);
    let (client_cert, client_key) = leaf(vec!["ops.example".into()], &ca);

    let rogue_key = KeyPair::generate().unwrap();
    let mut rogue_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    rogue_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let _ = rogue_params.clone().self_signed(&rogue_key).unwrap();
    let rogue = Issuer::new(rogue_params, rogue_key);
    let (stranger_cert, stranger_key) = leaf(vec!["ops.example".into()], &rogue);

    Pki {
        ca_pem: ca_cert.pem(),
        server_cert,
        server_key,
        client_cert,
        client_key,
        stranger_cert,
        stranger_key,
    }
}

async fn tls_channel(
    server: &Server,
    pki: &Pki,
    identity: Option<(&str, &str)>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    Endpoint::from_shared(format!("https://{}", server.grpc))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await
}

#[tokio::test]
async fn tls_and_mtls() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let tls = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_ca_file = \"{}\"\nclient_auth = \"optional\"\n{}",
        write("server.pem", &pki.server_cert),
        write("server.key", &pki.server_key),
        write("ca.pem", &pki.ca_pem),
        auth_config()
    );
    let server = Server::start(&tls);

    // TLS with an API key.
    let channel = tls_channel(&server, &pki, None).await.unwrap();
    let checkout = format!("Bearer {CHECKOUT_KEY}");
    assert_eq!(
        call(&channel, Rpc::DecidePayments, Some(&checkout)).await,
        Code::Ok
    );
    assert_eq!(
        call(&channel, Rpc::DecidePayments, None).await,
        Code::Unauthenticated
    );

    // mTLS: the client certificate's identity is the credential.
    let channel = tls_channel(&server, &pki, Some((&pki.client_cert, &pki.client_key)))
        .await
        .unwrap();
    assert_eq!(
        call(&channel, Rpc::SetRetriesEnabled, None).await,
        Code::Ok,
        "ops.example is an admin"
    );
    assert_eq!(call(&channel, Rpc::DecideLedger, None).await, Code::Ok);

    // A certificate from another CA claiming the same name is refused in
    // the handshake.
    let stranger = tls_channel(&server, &pki, Some((&pki.stranger_cert, &pki.stranger_key))).await;
    match stranger {
        Err(_) => {}
        Ok(channel) => assert_ne!(call(&channel, Rpc::DecideLedger, None).await, Code::Ok),
    }

    // Plaintext gets nowhere.
    let plain = Endpoint::from_shared(format!("http://{}", server.grpc))
        .unwrap()
        .connect()
        .await;
    if let Ok(channel) = plain {
        assert_ne!(
            call(&channel, Rpc::DecidePayments, Some(&checkout)).await,
            Code::Ok
        );
    }
}

#[tokio::test]
async fn limits_refuse_instead_of_queueing_or_crashing() {
    let server = Server::start(
        "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\nmax_message_bytes = 4096\nmax_concurrent_requests = 1\n",
    );
    let channel = server.channel().await;
    let mut client = RetryDeciderClient::new(channel.clone());

    // A message over the limit is refused, not decoded.
    let oversized = pb::ReportTrafficRequest {
        traffic: (0..400)
            .map(|i| pb::UpstreamTraffic {
                upstream: format!("u{i:08}"),
                requests: 1,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let status = client.report_traffic(oversized).await.unwrap_err();
    assert!(
        matches!(status.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{status:?}"
    );

    // One request in progress per connection: a burst of concurrent calls
    // on one connection is partly shed with RESOURCE_EXHAUSTED, at once,
    // instead of queueing without bound.
    let calls = (0..500).map(|i| {
        let mut client = RetryDeciderClient::new(channel.clone());
        async move { client.decide(retryable(&format!("burst-{}", i % 10))).await }
    });
    let results = futures::future::join_all(calls).await;
    let shed = results
        .iter()
        .filter(|result| matches!(result, Err(status) if status.code() == Code::ResourceExhausted))
        .count();
    let answered = results.iter().filter(|result| result.is_ok()).count();
    eprintln!("burst of 500 on one connection: {answered} answered, {shed} shed");
    assert!(shed > 0, "some calls must be shed");
    assert_eq!(shed + answered, 500, "no other outcome");

    // And the server still serves.
    let fresh = server
        .decider()
        .await
        .decide(retryable("after"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fresh.verdict(), pb::Verdict::Retry);
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .unwrap()
}

#[tokio::test]
async fn a_flood_of_upstream_names_is_bounded() {
    let server = Server::start("[limits]\nmax_upstreams = 1000\n");
    let mut client = server.decider().await;
    let pid = server.pid();
    // Warm up allocator and connection before measuring.
    client.decide(retryable("warm")).await.unwrap();
    let before = rss_kib(pid);

    const FLOOD: usize = 50_000;
    let requests = tokio_stream::iter(
        (0..FLOOD).map(|i| retryable(&format!("random-{i}-{}", "x".repeat(200)))),
    );
    let mut responses = client.decide_stream(requests).await.unwrap().into_inner();
    let (mut retries, mut refused) = (0, 0);
    while let Some(response) = responses.message().await.unwrap() {
        match response.error {
            Some(error) => {
                assert_eq!(
                    error.code,
                    Code::ResourceExhausted as i32,
                    "{}",
                    error.message
                );
                refused += 1;
            }
            None => retries += 1,
        }
    }
    let after = rss_kib(pid);
    eprintln!(
        "flood of {FLOOD} names: {retries} tracked, {refused} refused, RSS {before} KiB -> {after} KiB"
    );
    assert_eq!(
        retries, 999,
        "the cap (1000, one taken by the warm-up) is exact"
    );
    assert_eq!(refused, FLOOD - 999);
    // 1,000 buckets of ~300 bytes each plus allocator slack; 50,000 tracked
    // names would be well over 15 MiB.
    assert!(
        after.saturating_sub(before) < 8 * 1024,
        "RSS grew {} KiB",
        after - before
    );
    assert!(server.scrape().contains("retryd_tracked_upstreams 1000"));
}

#[tokio::test]
async fn reloads_are_atomic_validated_and_keep_budgets() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retryd.toml");
    let head = "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n";
    // A: transient 500s retried after exactly 1 s. B: 500 not transient,
    // backoff 2 s. A decision mixing the two would RETRY after 2 s.
    let a = format!(
        "{head}[defaults]\ntransient_500 = true\nbackoff = {{ base = \"1s\", max = \"1s\", jitter = \"decorrelated\" }}\nbudget = {{ capacity = 1000000.0, initial = 1000000.0 }}\n"
    );
    let b = format!(
        "{head}[defaults]\ntransient_500 = false\nbackoff = {{ base = \"2s\", max = \"2s\", jitter = \"decorrelated\" }}\nbudget = {{ capacity = 1000000.0, initial = 1000000.0 }}\n"
    );
    std::fs::write(&path, &a).unwrap();
    let server = Server::start_file(&path);
    let request = pb::DecideRequest {
        failure: 0,
        http_status: 500,
        ..retryable("flaky")
    };

    let deciding = {
        let mut client = server.decider().await;
        let request = request.clone();
        tokio::spawn(async move {
            let (mut old, mut new) = (0, 0);
            let started = std::time::Instant::now();
            while started.elapsed() < Duration::from_secs(60) {
                let response = client.decide(request.clone()).await.unwrap().into_inner();
                match (response.verdict(), response.backoff.map(|b| b.seconds)) {
                    (pb::Verdict::Retry, Some(1)) => old += 1,
                    (pb::Verdict::Deny, _) => new += 1,
                    other => panic!("a torn configuration answered {other:?}"),
                }
                if old + new >= 3000 {
                    break;
                }
            }
            (old, new)
        })
    };
    let mut admin = server.admin().await;
    for i in 0..100 {
        replace(&path, if i % 2 == 0 { &b } else { &a });
        if i % 4 < 2 {
            admin
                .reload_config(pb::ReloadConfigRequest {})
                .await
                .unwrap();
        } else {
            server.signal("HUP");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let (old, new) = deciding.await.unwrap();
    eprintln!("decisions during 100 reloads: {old} under A, {new} under B");
    assert!(old > 0 && new > 0, "both configurations were seen");

    // An invalid file is refused by name and the running policy stays.
    replace(&path, &a);
    admin
        .reload_config(pb::ReloadConfigRequest {})
        .await
        .unwrap();
    let spent_before = server
        .decider()
        .await
        .decide(request.clone())
        .await
        .unwrap()
        .into_inner()
        .tokens_remaining;
    replace(&path, &format!("{head}[defaults]\nmax_attempts = 0\n"));
    let status = admin
        .reload_config(pb::ReloadConfigRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().starts_with("defaults.max_attempts"),
        "{}",
        status.message()
    );
    let after = server
        .decider()
        .await
        .decide(request.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        after.verdict(),
        pb::Verdict::Retry,
        "policy A still in force"
    );
    assert!(
        after.tokens_remaining < spent_before,
        "budgets survive reloads"
    );
    let scrape = server.scrape();
    assert!(
        scrape.contains("retryd_config_reloads_total{outcome=\"refused\"} 1"),
        "{scrape}"
    );
    assert!(server.logs().contains("configuration reload refused"));
}

/// Replaces a file atomically, as configuration tools should, so that a
/// reload never reads a half-written file.
fn replace(path: &std::path::Path, text: &str) {
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, text).unwrap();
    std::fs::rename(&temporary, path).unwrap();
}

/// An admin principal acts only on the upstreams its patterns name: one
/// limited to `payments-*` cannot switch off `ledger`, nor read its budget,
/// and lists only its own; ReloadConfig applies the operator's file and
/// needs only the role.
#[tokio::test]
async fn admin_acts_are_scoped_by_the_principals_upstreams() {
    const PAYMENTS_OPS_KEY: &str = "payments-ops-key-0123456789";
    let server = Server::start(&format!(
        "{}\n[[auth.principals]]\nname = \"payments-ops\"\napi_keys_sha256 = [\"{}\"]\nupstreams = [\"payments-*\"]\nadmin = true\n",
        auth_config(),
        sha(PAYMENTS_OPS_KEY)
    ));
    let channel = server.channel().await;
    let mut admin = RetryAdminClient::new(channel.clone());
    let mut decider = RetryDeciderClient::new(channel);
    let key = format!("Bearer {PAYMENTS_OPS_KEY}");
    let ops = format!("Bearer {OPS_KEY}");
    let switch = |upstream: &str, authorization: &str| {
        with_key(
            pb::SetRetriesEnabledRequest {
                upstream: upstream.into(),
                enabled: false,
                reason: "scope test".into(),
            },
            Some(authorization),
        )
    };
    let status = admin
        .set_retries_enabled(switch("ledger", &key))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().starts_with("upstream:"), "{status:?}");
    admin
        .set_retries_enabled(switch("payments-api", &key))
        .await
        .unwrap();
    // ledger still retries: nothing was switched off for it.
    let answer = decider
        .decide(with_key(retryable("ledger"), Some(&ops)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.verdict(), pb::Verdict::Retry);

    let get = |upstream: &str| {
        with_key(
            pb::GetBudgetRequest {
                upstream: upstream.into(),
            },
            Some(&key),
        )
    };
    assert_eq!(
        admin.get_budget(get("ledger")).await.unwrap_err().code(),
        Code::PermissionDenied
    );
    admin.get_budget(get("payments-api")).await.unwrap();
    let listed: Vec<String> = admin
        .list_budgets(with_key(pb::ListBudgetsRequest {}, Some(&key)))
        .await
        .unwrap()
        .into_inner()
        .budgets
        .into_iter()
        .map(|budget| budget.upstream)
        .collect();
    assert_eq!(listed, ["payments-api"]);
    let everything = admin
        .list_budgets(with_key(pb::ListBudgetsRequest {}, Some(&ops)))
        .await
        .unwrap()
        .into_inner()
        .budgets
        .len();
    assert_eq!(everything, 2, "the global admin sees ledger too");
    admin
        .reload_config(with_key(pb::ReloadConfigRequest {}, Some(&key)))
        .await
        .unwrap();
}
