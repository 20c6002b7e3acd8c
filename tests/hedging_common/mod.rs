//! The harness the hedging suites share: retryd in this process on a
//! given store, and the requests they send.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use retryd::config::Config;
use retryd::grpc::{self, Reload, Service};
use retryd::telemetry::{Metrics, Tracer};
use retryd::transport::Acceptor;
use retryd_budget::BudgetStore;
use retryd_engine::latency;
use retryd_proto as pb;
use retryd_proto::retry_admin_client::RetryAdminClient;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use tonic::transport::Channel;

/// retryd serving `store` with the configuration `toml`, in this process.
pub(crate) struct InProcess {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
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
        let service = Service::new(
            store,
            "hedging",
            Reload {
                path: Some(path),
                startup: config,
            },
            metrics,
            Tracer::disabled(),
        );
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
            _dir: dir,
        }
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

/// A histogram of `count` latencies of `millis` each, per pair.
pub(crate) fn histogram(latencies: &[(u64, u64)]) -> pb::LatencyHistogram {
    let mut counts = std::collections::HashMap::new();
    for &(millis, count) in latencies {
        *counts.entry(latency::bucket(millis * 1000)).or_insert(0u64) += count;
    }
    pb::LatencyHistogram { counts }
}

pub(crate) fn entry(
    upstream: &str,
    requests: u64,
    latencies: &[(u64, u64)],
) -> pb::UpstreamTraffic {
    pb::UpstreamTraffic {
        upstream: upstream.into(),
        requests,
        latency_successes: Some(histogram(latencies)),
        ..Default::default()
    }
}

pub(crate) async fn report(
    client: &mut RetryDeciderClient<Channel>,
    traffic: Vec<pb::UpstreamTraffic>,
) -> Result<pb::ReportTrafficResponse, tonic::Status> {
    client
        .report_traffic(pb::ReportTrafficRequest {
            traffic,
            ..Default::default()
        })
        .await
        .map(tonic::Response::into_inner)
}

pub(crate) fn hedge(upstream: &str, k: u32) -> pb::DecideRequest {
    pb::DecideRequest {
        upstream: upstream.into(),
        idempotency: pb::Idempotency::Idempotent as i32,
        attempt: k,
        hedge: k,
        ..Default::default()
    }
}

pub(crate) async fn budget(server: &InProcess, upstream: &str) -> pb::Budget {
    server
        .admin()
        .await
        .get_budget(pb::GetBudgetRequest {
            upstream: upstream.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap()
}

pub(crate) fn millis(duration: &Option<prost_types::Duration>) -> f64 {
    let duration = duration.as_ref().expect("a delay");
    duration.seconds as f64 * 1e3 + f64::from(duration.nanos) / 1e6
}
