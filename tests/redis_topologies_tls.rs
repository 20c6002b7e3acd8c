//! TLS to a Redis Cluster and to Redis Sentinel, with TLS only: no node
//! or sentinel has a plain port (`--port 0`), the Cluster bus and
//! replication run over TLS too, and certificates come from a CA made here
//! (rcgen). On each topology, two stores (two replicas of retryd) share
//! each budget over `rediss://`, in exact and in leased mode: together
//! they grant exactly its tokens, none from a fallback. A CA that did not
//! sign the servers' certificates is refused at connect, the cause said.
//! Under Sentinel a client certificate reaches a primary that requires
//! one, except with verification off (a redis-rs 1.2.2 limit, pinned
//! here so that README.md's statement of it stays true).

use retryd_testkit::HANG_GUARD;
use retryd_testkit::redis as redis_harness;

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use redis_harness::{RedisCluster, RedisSentinels, SentinelOptions, TlsFiles};
use retryd_budget::redis::{
    Exact, Leased, Mode, RedisAccess, RedisConfig, RedisTls, SentinelConfig,
};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore, StoreError};

const TOKENS: f64 = 20.0;

/// A CA and the certificate it issued to every server, as PEM files.
struct Pki {
    dir: tempfile::TempDir,
    ca_pem: String,
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
        let issuer = Issuer::new(params, key);
        let dir = tempfile::tempdir().unwrap();
        // One certificate for every node and sentinel: `localhost` for the
        // configured URLs, and 127.0.0.1 for the nodes a Cluster's
        // `CLUSTER SLOTS` and the sentinels name by address.
        let server_key = KeyPair::generate().unwrap();
        let mut server = CertificateParams::default();
        server.subject_alt_names = vec![
            SanType::DnsName("localhost".try_into().unwrap()),
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        ];
        let certificate = server.signed_by(&server_key, &issuer).unwrap();
        std::fs::write(dir.path().join("server.pem"), certificate.pem()).unwrap();
        std::fs::write(dir.path().join("server.key"), server_key.serialize_pem()).unwrap();
        std::fs::write(dir.path().join("ca.pem"), &ca_pem).unwrap();
        // A client certificate, for servers that require one.
        let client_key = KeyPair::generate().unwrap();
        let mut client = CertificateParams::default();
        client.subject_alt_names = vec![SanType::DnsName("retryd".try_into().unwrap())];
        let certificate = client.signed_by(&client_key, &issuer).unwrap();
        std::fs::write(dir.path().join("client.pem"), certificate.pem()).unwrap();
        std::fs::write(dir.path().join("client.key"), client_key.serialize_pem()).unwrap();
        Pki { dir, ca_pem }
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// The servers' files: their certificate, and this CA for the peers
    /// they check (each other, over the bus and replication).
    fn files(&self) -> TlsFiles {
        TlsFiles {
            cert: self.path("server.pem"),
            key: self.path("server.key"),
            client_ca: self.path("ca.pem"),
        }
    }

    /// What a store trusts: this CA alone.
    fn trusted(&self) -> RedisTls {
        RedisTls {
            ca_pem: Some(self.ca_pem.clone().into_bytes()),
            ..RedisTls::default()
        }
    }

    /// [`Pki::trusted`] with this CA's client certificate.
    fn trusted_with_client_certificate(&self) -> RedisTls {
        RedisTls {
            client_pem: Some((
                std::fs::read(self.path("client.pem")).unwrap(),
                std::fs::read(self.path("client.key")).unwrap(),
            )),
            ..self.trusted()
        }
    }
}

fn bucket() -> BucketConfig {
    BucketConfig {
        capacity: TOKENS,
        initial: TOKENS,
        ratio: 0.0,
        min_per_second: 0.0,
        on_unavailable: OnUnavailable::Deny,
        configured: false,
    }
}

fn config<M: Mode>(urls: Vec<String>, prefix: &str, tls: RedisTls, sentinel: bool) -> RedisConfig {
    RedisConfig {
        urls: urls.into_iter().map(Into::into).collect(),
        mode: M::MODE,
        timeout: Duration::from_millis(500),
        lease_tokens: 2.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(10),
        key_prefix: prefix.to_owned(),
        access: RedisAccess {
            tls,
            sentinel: sentinel.then(|| SentinelConfig {
                master_name: RedisSentinels::MASTER_NAME.into(),
            }),
            ..RedisAccess::default()
        },
    }
}

/// Two stores on `config` (two replicas) decide alternately on each of
/// `upstreams` until both are refused in the same round: together they
/// must have granted exactly each bucket's tokens, all from Redis (no
/// fallback; with `on_unavailable = deny` a fallback would be an error).
async fn two_stores_share_each_budget<M: Mode>(config: &RedisConfig, upstreams: &[String]) {
    let first: RedisBudgetStore<M> = RedisBudgetStore::connect(config, 100)
        .await
        .expect("connect over TLS");
    let second: RedisBudgetStore<M> = RedisBudgetStore::connect(config, 100)
        .await
        .expect("connect over TLS");
    let bucket = bucket();
    for upstream in upstreams {
        let mut granted = 0;
        for round in 0.. {
            let by_first = first.check(upstream, &bucket, true).await.unwrap().withdrew;
            let by_second = second
                .check(upstream, &bucket, true)
                .await
                .unwrap()
                .withdrew;
            granted += u32::from(by_first) + u32::from(by_second);
            if !by_first && !by_second {
                break;
            }
            assert!(round < 100, "{upstream}: the budget never ran out");
        }
        assert_eq!(
            f64::from(granted),
            TOKENS,
            "{:?}, {upstream}: two stores together granted {granted} of {TOKENS} tokens",
            M::MODE
        );
    }
    for store in [&first, &second] {
        let stats = store.stats();
        assert_eq!(
            (stats.fallbacks, stats.backend_errors),
            (0, 0),
            "{:?}: {stats:?}",
            M::MODE
        );
        assert_eq!(store.availability(), 1.0, "{:?}", M::MODE);
        store.shutdown().await;
    }
}

async fn connect_error<M: Mode>(config: &RedisConfig) -> String {
    match RedisBudgetStore::<M>::connect(config, 100).await {
        Ok(_) => panic!("connected to {:?} trusting another CA", config.urls),
        Err(StoreError::Unavailable(cause)) => cause.to_string(),
        Err(other) => panic!("unexpected error {other:?}"),
    }
}

fn bucket_key(prefix: &str, upstream: &str) -> String {
    format!("{prefix}:{{u:{upstream}}}:bucket")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_only_cluster_shares_exact_and_leased_budgets_and_refuses_a_wrong_ca() {
    let pki = Pki::new("retryd test Redis CA");
    let mut cluster = RedisCluster::start_tls_only(3, &pki.files());
    let urls = cluster.urls();
    assert!(
        urls.iter().all(|url| url.starts_with("rediss://")),
        "{urls:?}"
    );
    let prefix = redis_harness::fresh_prefix("cluster-tls");
    // An upstream on every master, so that every node is reached over TLS
    // (and found through `CLUSTER SLOTS`, which names it by address).
    let mut upstreams: Vec<(usize, String)> = Vec::new();
    for n in 0.. {
        let upstream = format!("tls-up-{n}");
        let master = cluster
            .master_of(&bucket_key(&prefix, &upstream))
            .expect("a master serves every slot");
        if upstreams.iter().all(|(known, _)| *known != master) {
            upstreams.push((master, upstream));
        }
        if upstreams.len() == 3 {
            break;
        }
    }
    let upstreams: Vec<String> = upstreams.into_iter().map(|(_, name)| name).collect();
    two_stores_share_each_budget::<Exact>(
        &config::<Exact>(urls.clone(), &prefix, pki.trusted(), false),
        &upstreams,
    )
    .await;
    let leased_prefix = format!("{prefix}-leased");
    two_stores_share_each_budget::<Leased>(
        &config::<Leased>(urls.clone(), &leased_prefix, pki.trusted(), false),
        &upstreams,
    )
    .await;
    // Every bucket is on the master its slot names, reached over TLS.
    for upstream in &upstreams {
        let master = cluster.master_of(&bucket_key(&prefix, upstream)).unwrap();
        let exists = cluster.nodes[master].cli(&["EXISTS", &bucket_key(&prefix, upstream)]);
        assert_eq!(exists.trim(), "1", "{upstream}: no bucket on its master");
    }

    let stranger = Pki::new("some other CA");
    let cause =
        connect_error::<Exact>(&config::<Exact>(urls, &prefix, stranger.trusted(), false)).await;
    assert!(
        cause.to_lowercase().contains("certificate"),
        "the cause does not say it is the certificate: {cause}"
    );
    println!("a Cluster behind another CA: {cause}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_only_sentinels_share_exact_and_leased_budgets_and_refuse_a_wrong_ca() {
    let pki = Pki::new("retryd test Redis CA");
    let files = pki.files();
    let sentinels = RedisSentinels::start_with(&SentinelOptions {
        tls: Some(&files),
        ..SentinelOptions::default()
    });
    assert!(sentinels.primary.is_tls_only() && sentinels.replica.is_tls_only());
    let urls = sentinels.urls();
    assert!(
        urls.iter().all(|url| url.starts_with("rediss://")),
        "{urls:?}"
    );
    let prefix = redis_harness::fresh_prefix("sentinel-tls");
    let upstreams = ["sentinel-tls-a".to_owned(), "sentinel-tls-b".to_owned()];
    two_stores_share_each_budget::<Exact>(
        &config::<Exact>(urls.clone(), &prefix, pki.trusted(), true),
        &upstreams,
    )
    .await;
    let leased_prefix = format!("{prefix}-leased");
    two_stores_share_each_budget::<Leased>(
        &config::<Leased>(urls.clone(), &leased_prefix, pki.trusted(), true),
        &upstreams,
    )
    .await;
    // The buckets are on the primary the sentinels name, and replicated
    // (over TLS) to the replica.
    let key = bucket_key(&prefix, &upstreams[0]);
    assert_eq!(sentinels.primary.cli(&["EXISTS", &key]).trim(), "1");
    let started = std::time::Instant::now();
    while sentinels.replica.cli(&["EXISTS", &key]).trim() != "1" {
        assert!(
            started.elapsed() < HANG_GUARD,
            "the bucket never reached the replica"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let stranger = Pki::new("some other CA");
    let cause =
        connect_error::<Exact>(&config::<Exact>(urls, &prefix, stranger.trusted(), true)).await;
    assert!(
        cause.to_lowercase().contains("certificate"),
        "the cause does not say it is the certificate: {cause}"
    );
    println!("sentinels behind another CA: {cause}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_sentinel_a_client_certificate_reaches_the_primary_unless_verification_is_off() {
    let pki = Pki::new("retryd test Redis CA");
    let files = pki.files();
    let sentinels = RedisSentinels::start_with(&SentinelOptions {
        tls: Some(&files),
        ..SentinelOptions::default()
    });
    // The primary now requires client certificates (the sentinels and the
    // replica present their own, `tls-cert-file`, so they stay connected).
    let answer = sentinels
        .primary
        .cli(&["CONFIG", "SET", "tls-auth-clients", "yes"]);
    assert!(answer.contains("OK"), "CONFIG SET answered {answer:?}");
    let prefix = redis_harness::fresh_prefix("sentinel-mtls");
    let urls = sentinels.urls();
    // Without a certificate, refused.
    let config_without = config::<Exact>(urls.clone(), &prefix, pki.trusted(), true);
    let cause = connect_error::<Exact>(&config_without).await;
    println!("no client certificate: {cause}");
    assert!(cause.contains("CertificateRequired"), "{cause}");
    // With one, served.
    let with = config::<Exact>(
        urls.clone(),
        &prefix,
        pki.trusted_with_client_certificate(),
        true,
    );
    let store: RedisBudgetStore<Exact> = RedisBudgetStore::connect(&with, 100)
        .await
        .expect("connect with a client certificate");
    assert!(
        store
            .check("mtls-up", &bucket(), true)
            .await
            .unwrap()
            .withdrew
    );
    // With verification off, redis-rs 1.2.2 sends no client certificate to
    // the primary (`SentinelNodeConnectionInfo::create_connection_info`
    // builds `TlsMode::Insecure` addresses with `tls_params: None`), so the
    // primary refuses it: the limit README.md states. If this starts to
    // connect, redis-rs has lifted it; update the README.
    let insecure = RedisTls {
        insecure_skip_verify: true,
        ..pki.trusted_with_client_certificate()
    };
    let cause = connect_error::<Exact>(&config::<Exact>(urls, &prefix, insecure, true)).await;
    println!("insecure_skip_verify with a client certificate: {cause}");
    assert!(cause.contains("CertificateRequired"), "{cause}");
}
