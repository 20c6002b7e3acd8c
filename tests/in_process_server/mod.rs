//! retryd in this process on a store the suite builds (a memory store on a
//! manual clock, or Redis exact or leased on a redis-server the suite
//! starts), serving a configuration file: what the adaptive, pushback,
//! ramp and hedging suites share. A suite declares `mod in_process_server;`.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use retryd::config::Config;
use retryd::grpc::{self, Reload, Service};
use retryd::telemetry::{Metrics, Tracer};
use retryd::transport::Acceptor;
use retryd_budget::redis::{Mode, RedisAccess, RedisConfig};
use retryd_budget::{BudgetStore, RedisBudgetStore};
use retryd_proto::retry_admin_client::RetryAdminClient;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use tonic::transport::Channel;

/// retryd serving `store` with the configuration `toml`, in this process.
pub(crate) struct InProcess {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    flush: Box<dyn Fn() + Send + Sync>,
    metrics: Arc<Metrics>,
    _dir: tempfile::TempDir,
}

impl InProcess {
    pub(crate) async fn start<S: BudgetStore>(toml: &str, store: S) -> InProcess {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("retryd.toml");
        std::fs::write(&path, toml).unwrap();
        let config = Config::load(Some(&path)).unwrap();
        let acceptor = Acceptor::try_new(config.tls.as_ref(), &config.server_limits).unwrap();
        let metrics = Arc::new(Metrics::new(config.policies.named().map(|(name, _)| name)));
        let log = config.decision_log.as_ref().map(|log| {
            retryd::decision_log::DecisionLog::open(&log.path, log.queue, log.max_bytes).unwrap()
        });
        let service = Service::new(
            store,
            "in-process",
            Reload {
                path: Some(path),
                startup: config,
            },
            metrics.clone(),
            Tracer::disabled(),
        );
        let service = match log {
            Some(log) => service.with_decision_log(log),
            None => service,
        };
        let flusher = service.clone();
        let flush: Box<dyn Fn() + Send + Sync> = Box::new(move || {
            assert!(flusher.flush_decision_log(Duration::from_secs(10)));
        });
        let listener = grpc::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(grpc::serve(
            listener,
            acceptor,
            service,
            async {
                let _ = stopped.await;
            },
            Duration::from_secs(1),
        ));
        InProcess {
            addr,
            stop: Some(stop),
            flush,
            metrics,
            _dir: dir,
        }
    }

    /// The metrics page, without the store's budgets (what the counters
    /// and gauges of decisions and reports say).
    pub(crate) fn metrics_page(&self) -> String {
        self.metrics
            .render(&[], 1.0, &retryd_budget::StoreStats::default())
    }

    /// Waits until every decision-log line so far is in the file.
    pub(crate) fn flush_log(&self) {
        (self.flush)();
    }

    pub(crate) async fn decider(&self) -> RetryDeciderClient<Channel> {
        RetryDeciderClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
    }

    pub(crate) async fn admin(&self) -> RetryAdminClient<Channel> {
        RetryAdminClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A Redis store on `urls` (one node, or a Cluster's seeds) under `prefix`,
/// with `timeout` as its `store.timeout`.
pub(crate) async fn redis_store<M: Mode>(
    urls: &[String],
    prefix: &str,
    timeout: Duration,
) -> RedisBudgetStore<M> {
    let config = RedisConfig {
        urls: urls.iter().map(|url| url.as_str().into()).collect(),
        mode: M::MODE,
        timeout,
        lease_tokens: 5.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: prefix.to_owned(),
        access: RedisAccess::default(),
    };
    RedisBudgetStore::connect(&config, 100)
        .await
        .expect("connect to the test Redis")
}
