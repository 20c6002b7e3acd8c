//! Reloads that must not weaken the running configuration (issue 29,
//! findings 3 and 12): an empty or truncated file, or one without `[auth]`,
//! never switches authentication off; a change of principals is audited;
//! `ReloadConfig` is single-flight and paced, and reads the file off the
//! runtime's workers.
//!
//! Against the real binary, except the bound-address rule, which needs a
//! non-loopback address: the service is built in this process on such an
//! address without binding it.

use retryd_testkit as support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use retryd::config::{Config, Settings};
use retryd::grpc::{Reload, Service};
use retryd::telemetry::{Metrics, Tracer};
use retryd_budget::MemoryBudgetStore;
use retryd_proto as pb;
use support::{HANG_GUARD, Server, retryable};
use tonic::Code;
use tonic::metadata::MetadataValue;

const OPS_KEY: &str = "ops-key-0123456789abcdef";
const PAYMENTS_OPS_KEY: &str = "payments-ops-key-0123456789";

fn sha(key: &str) -> String {
    hex::encode(retryd::auth::hash_key(key))
}

const HEAD: &str = "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n";

fn principals() -> String {
    format!(
        "[[auth.principals]]\nname = \"ops\"\napi_keys_sha256 = [\"{}\"]\nupstreams = [\"*\"]\nadmin = true\n\n[[auth.principals]]\nname = \"payments-ops\"\napi_keys_sha256 = [\"{}\"]\nupstreams = [\"payments-*\"]\nadmin = true\n",
        sha(OPS_KEY),
        sha(PAYMENTS_OPS_KEY)
    )
}

fn with_key<T>(message: T, key: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        request.metadata_mut().insert(
            "authorization",
            MetadataValue::try_from(format!("Bearer {key}")).unwrap(),
        );
    }
    request
}

/// Polls the server's log until `wanted` appears `times` times.
async fn logged(server: &Server, wanted: &str, times: usize) {
    let started = Instant::now();
    while server.logs().matches(wanted).count() < times {
        assert!(
            started.elapsed() < HANG_GUARD,
            "{wanted:?} not logged {times} times:\n{}",
            server.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Finding 3: an editor's truncate-then-write caught by SIGHUP, the same
/// file by a scoped admin's `ReloadConfig`, a file cut before its `[auth]`:
/// all refused, and the port still authenticates every caller. A real
/// change of principals is applied and audited by name.
#[tokio::test]
async fn a_reload_never_switches_authentication_off() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retryd.toml");
    std::fs::write(&path, format!("{HEAD}{}", principals())).unwrap();
    let server = Server::start_file(&path);
    let channel = server.channel().await;
    let mut decider = pb::retry_decider_client::RetryDeciderClient::new(channel.clone());
    let mut admin = pb::retry_admin_client::RetryAdminClient::new(channel);
    let anonymous_is_refused = |code: Code| assert_eq!(code, Code::Unauthenticated);

    // Truncated, then a SIGHUP before the write.
    std::fs::write(&path, "").unwrap();
    server.signal("HUP");
    logged(&server, "configuration reload refused", 1).await;
    assert!(server.logs().contains("sets nothing"), "{}", server.logs());
    let status = decider
        .decide(with_key(retryable("ledger"), None))
        .await
        .unwrap_err();
    anonymous_is_refused(status.code());

    // The same empty file, reloaded by an admin scoped to one team.
    let status = admin
        .reload_config(with_key(pb::ReloadConfigRequest {}, Some(PAYMENTS_OPS_KEY)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("sets nothing"), "{status:?}");

    // Cut before `[auth]`: a valid file naming no principal.
    std::fs::write(&path, format!("{HEAD}[defaults]\nmax_attempts = 3\n")).unwrap();
    let status = admin
        .reload_config(with_key(pb::ReloadConfigRequest {}, Some(PAYMENTS_OPS_KEY)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(
        status.message().starts_with("auth.principals:"),
        "{status:?}"
    );
    let status = decider
        .decide(with_key(retryable("ledger"), None))
        .await
        .unwrap_err();
    anonymous_is_refused(status.code());
    decider
        .decide(with_key(retryable("ledger"), Some(OPS_KEY)))
        .await
        .expect("the running principals still authenticate");

    // A real change: payments-ops loses the admin role, a principal joins.
    let changed = principals().replace(
        "upstreams = [\"payments-*\"]\nadmin = true",
        "upstreams = [\"payments-*\"]",
    );
    std::fs::write(
        &path,
        format!(
            "{HEAD}{changed}\n[[auth.principals]]\nname = \"ledger\"\napi_keys_sha256 = [\"{}\"]\nupstreams = [\"ledger\"]\n",
            sha("ledger-key-0123456789abcdef")
        ),
    )
    .unwrap();
    admin
        .reload_config(with_key(pb::ReloadConfigRequest {}, Some(OPS_KEY)))
        .await
        .unwrap();
    logged(&server, "principals changed by a configuration reload", 1).await;
    let line = server
        .logs()
        .lines()
        .find(|line| line.contains("principals changed"))
        .unwrap()
        .to_owned();
    assert!(
        line.contains("retryd::audit")
            && line.contains("added=[\"ledger\"]")
            && line.contains("changed=[\"payments-ops\"]"),
        "{line}"
    );
    let status = admin
        .reload_config(with_key(pb::ReloadConfigRequest {}, Some(PAYMENTS_OPS_KEY)))
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::PermissionDenied,
        "the new file is in force"
    );
}

/// Finding 3: the non-loopback rule is checked against the address the
/// server is bound to, not the reloaded file's `server.listen`. A server
/// started on 0.0.0.0 with `allow_unauthenticated` cannot have that
/// insistence taken back by a file that merely claims loopback: the port
/// stays public, so the file is refused.
#[tokio::test]
async fn the_public_address_rule_reads_the_bound_address() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retryd.toml");
    let public = "[server]\nlisten = \"0.0.0.0:50051\"\nallow_unauthenticated = true\n";
    std::fs::write(&path, public).unwrap();
    let startup = Config::try_from(Settings::from_toml(public).unwrap()).unwrap();
    let service = Service::new(
        MemoryBudgetStore::new(100),
        "memory",
        Reload {
            path: Some(path.clone()),
            startup,
        },
        Arc::new(Metrics::new(std::iter::empty::<&str>())),
        Tracer::disabled(),
    );
    std::fs::write(&path, "[server]\nlisten = \"127.0.0.1:50051\"\n").unwrap();
    let refused = service.reload().await.unwrap_err().to_string();
    assert!(
        refused.starts_with("server.listen: the server is bound to 0.0.0.0:50051"),
        "{refused}"
    );
    // Still insisting, the file is applied.
    std::fs::write(&path, public).unwrap();
    service.reload().await.unwrap();
}

/// Finding 12: 200 concurrent `ReloadConfig` calls from a scoped admin
/// cost one reload at a time, at most one per `RELOAD_INTERVAL`; the
/// others are refused `RESOURCE_EXHAUSTED` at once.
#[tokio::test]
async fn a_flood_of_reload_calls_reloads_at_a_bounded_rate() {
    let server = Server::start(&principals());
    let channel = server.channel().await;
    let started = Instant::now();
    let calls: Vec<_> = (0..200)
        .map(|_| {
            let mut admin = pb::retry_admin_client::RetryAdminClient::new(channel.clone());
            tokio::spawn(async move {
                admin
                    .reload_config(with_key(pb::ReloadConfigRequest {}, Some(PAYMENTS_OPS_KEY)))
                    .await
                    .map(drop)
                    .map_err(|status| status.code())
            })
        })
        .collect();
    let (mut applied, mut busy) = (0, 0);
    for call in calls {
        match call.await.unwrap() {
            Ok(()) => applied += 1,
            Err(Code::ResourceExhausted) => busy += 1,
            Err(other) => panic!("a reload answered {other:?}"),
        }
    }
    let elapsed = started.elapsed();
    let allowed = 2 + (elapsed.as_millis() / retryd::grpc::RELOAD_INTERVAL.as_millis()) as usize;
    eprintln!("{applied} reloads applied and {busy} refused in {elapsed:?}");
    assert!(
        applied <= allowed,
        "{applied} reloads in {elapsed:?}: more than {allowed}"
    );
    assert_eq!(applied + busy, 200);
    let scrape = server.scrape();
    assert!(
        scrape.contains(&format!(
            "retryd_config_reloads_total{{outcome=\"applied\"}} {applied}"
        )),
        "{scrape}"
    );
}

/// Finding 12: the file is read off the runtime's workers. A
/// configuration path that blocks its reader (a FIFO nobody writes)
/// holds one reload, not the server: with more concurrent reloads than
/// the runtime has workers, a decision is still answered.
#[tokio::test]
async fn a_reload_stuck_reading_its_file_blocks_no_decision() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retryd.toml");
    let text = format!("{HEAD}{}", principals());
    std::fs::write(&path, &text).unwrap();
    let server = Server::start_file(&path);
    std::fs::remove_file(&path).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&path)
        .status()
        .unwrap();
    assert!(made.success(), "mkfifo");

    let channel = server.channel().await;
    let workers = std::thread::available_parallelism().map_or(2, usize::from);
    let reloads: Vec<_> = (0..workers + 2)
        .map(|_| {
            let mut admin = pb::retry_admin_client::RetryAdminClient::new(channel.clone());
            tokio::spawn(async move {
                admin
                    .reload_config(with_key(pb::ReloadConfigRequest {}, Some(OPS_KEY)))
                    .await
                    .map(drop)
                    .map_err(|status| status.code())
            })
        })
        .collect();
    let mut decider = pb::retry_decider_client::RetryDeciderClient::new(channel);
    let answered = tokio::time::timeout(
        HANG_GUARD,
        decider.decide(with_key(retryable("ledger"), Some(OPS_KEY))),
    )
    .await;
    assert!(
        matches!(answered, Ok(Ok(_))),
        "a decision waited behind reloads reading a FIFO: {answered:?}"
    );

    // Unblock the reader, leaving a plain file for the reload that waits.
    let fifo = path.clone();
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        writer.write_all(text.as_bytes()).unwrap();
        let plain = fifo.with_extension("tmp");
        std::fs::write(&plain, &text).unwrap();
        std::fs::rename(&plain, &fifo).unwrap();
    })
    .await
    .unwrap();
    for reload in reloads {
        let answer = tokio::time::timeout(HANG_GUARD, reload)
            .await
            .expect("every reload ends once the file can be read")
            .unwrap();
        assert!(
            matches!(answer, Ok(()) | Err(Code::ResourceExhausted)),
            "{answer:?}"
        );
    }
}
