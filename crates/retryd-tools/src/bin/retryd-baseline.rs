//! `retryd-baseline`: gRPC itself on this machine, for comparison.
//!
//! It serves the same `retryd.v1.RetryDecider` service as retryd, on the
//! same tonic server with default settings, but answers every call with a
//! canned response and no logic: no validation, no budget, no engine, no
//! metrics. `retryd-load` therefore drives both identically, and every
//! retryd figure can be read as a ratio to "a tonic server that does
//! nothing" with the same messages on the wire.
//!
//! The canned response is picked by the request's declared idempotency (one
//! array index), so each of `retryd-load`'s request kinds gets a response of
//! the size retryd would send for it: same verdict, a 32-character decision
//! id and the same explanation text.
//!
//! With `--redis URL` every `Decide` also runs, before answering, the one
//! script retryd's exact Redis store runs per decision (the `bucket.lua`
//! prelude plus `check.lua`, same keys and arguments, withdrawing for the
//! RETRY kind), through the same client (redis-rs, one multiplexed
//! `ConnectionManager`), and ignores its answer: "gRPC plus the raw script",
//! the reference for retryd on the exact Redis store.
//!
//! Like `retryd serve`, it prints `{"grpc":"HOST:PORT"}` on stdout once
//! listening, and stops on SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use futures::{Stream, StreamExt};
use retryd_proto as pb;
use retryd_proto::retry_decider_server::{RetryDecider, RetryDeciderServer};
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

#[derive(Parser, Debug)]
#[command(about = "A RetryDecider that answers canned responses, as a baseline for retryd-load.")]
struct Args {
    /// Where to listen (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Serve as `retryd serve` does by default, apart from the decision:
    /// its `[server]` defaults (128 streams per connection, keepalive) and
    /// its routes (health, reflection v1 and v1alpha beside the decider),
    /// to tell the cost of that setup from the decision's.
    #[arg(long)]
    server_limits: bool,
    /// Also run the exact store's decision script on this Redis per Decide.
    #[arg(long, value_name = "URL")]
    redis: Option<String>,
}

/// The script the exact Redis store runs once per decision.
const CHECK_SCRIPT: &str = retryd_budget::redis::CHECK_SOURCE;

/// One upstream's keys as the store lays them out (prefix `retryd`), for
/// `retryd-load`'s single upstream.
const KEYS: [&str; 3] = [
    "retryd:{u:upstream-000000}:bucket",
    "retryd:{u:upstream-000000}:off",
    "retryd:{u:upstream-000000}:leases",
];

/// The decision script and what `scripts/bench` configures retryd with: a
/// bucket that never runs dry.
#[derive(Clone)]
struct RawScript {
    connection: redis::aio::ConnectionManager,
    script: redis::Script,
    capacity_units: u64,
    initial_units: u64,
    floor: String,
}

impl RawScript {
    async fn connect(url: &str) -> anyhow::Result<RawScript> {
        let client = redis::Client::open(url).with_context(|| format!("bad Redis URL {url}"))?;
        let connection = redis::aio::ConnectionManager::new(client)
            .await
            .with_context(|| format!("cannot connect to {url}"))?;
        let config = retryd_budget::BucketConfig {
            capacity: 1e9,
            initial: 1e9,
            ratio: 0.1,
            min_per_second: 1000.0,
            ..retryd_budget::BucketConfig::default()
        };
        Ok(RawScript {
            connection,
            script: redis::Script::new(CHECK_SCRIPT),
            capacity_units: config.capacity_units(),
            initial_units: config.initial_units(),
            floor: format!("{:?}", config.floor_units_per_nano()),
        })
    }

    async fn run(&self, withdraw: bool) -> Result<(), Status> {
        let mut invocation = self.script.prepare_invoke();
        for key in KEYS {
            invocation.key(key);
        }
        invocation
            .arg(self.capacity_units)
            .arg(self.initial_units)
            .arg(&self.floor)
            // The store's IDLE_TTL_MS.
            .arg(60_000)
            .arg(if withdraw { "1" } else { "0" });
        invocation
            .invoke_async::<Vec<i64>>(&mut self.connection.clone())
            .await
            .map(drop)
            .map_err(|error| Status::unavailable(error.to_string()))
    }
}

/// Canned responses by `DecideRequest.idempotency` (0 to 4).
#[derive(Clone)]
struct Baseline {
    canned: Arc<[pb::DecideResponse; 5]>,
    redis: Option<RawScript>,
}

fn canned(
    verdict: pb::Verdict,
    deny_reason: pb::DenyReason,
    rule: u32,
    evidence: pb::Evidence,
    explanation: &str,
) -> pb::DecideResponse {
    pb::DecideResponse {
        verdict: verdict as i32,
        // A typical full-jitter backoff: a few tens of milliseconds.
        backoff: Some(prost_types::Duration {
            seconds: 0,
            nanos: if verdict == pb::Verdict::Retry {
                23_456_789
            } else {
                0
            },
        }),
        deny_reason: deny_reason as i32,
        refresh_credentials: false,
        rule,
        effective_evidence: evidence as i32,
        evidence_adjusted: false,
        decision_id: "5f0c1d3e9a7b44c2b1e0f6a8d2c4e913".into(),
        tokens_remaining: 99_999_999.0,
        explanation: explanation.into(),
        error: None,
        shadow: false,
        unknown_outcome: pb::UnknownOutcome::None as i32,
    }
}

impl Baseline {
    fn new(redis: Option<RawScript>) -> Self {
        let retry = canned(
            pb::Verdict::Retry,
            pb::DenyReason::Unspecified,
            9,
            pb::Evidence::NotSent,
            "retry after 23.456789ms: evidence not_sent allows another attempt (rule 9)",
        );
        let deny = canned(
            pb::Verdict::Deny,
            pb::DenyReason::StatusNotRetryable,
            9,
            pb::Evidence::ResponseReceived,
            "deny: the status is not retryable for this operation (rule 9, status 404)",
        );
        let mut ambiguous = canned(
            pb::Verdict::Ambiguous,
            pb::DenyReason::Unspecified,
            8,
            pb::Evidence::SentNoResponse,
            "ambiguous: the request was sent and may have taken effect; the operation is not idempotent, so reconcile (rule 8); the claimed evidence was weakened to sent_no_response",
        );
        ambiguous.evidence_adjusted = true;
        // retryd-load sends SAFE for its DENY kind, IDEMPOTENT for RETRY and
        // NON_IDEMPOTENT for AMBIGUOUS.
        Baseline {
            canned: Arc::new([retry.clone(), deny, retry.clone(), retry, ambiguous]),
            redis,
        }
    }

    fn answer(&self, request: &pb::DecideRequest) -> pb::DecideResponse {
        let index = usize::try_from(request.idempotency).unwrap_or(0) % self.canned.len();
        self.canned[index].clone()
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<pb::DecideResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RetryDecider for Baseline {
    async fn decide(
        &self,
        request: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        let answer = self.answer(request.get_ref());
        if let Some(redis) = &self.redis {
            redis
                .run(answer.verdict == pb::Verdict::Retry as i32)
                .await?;
        }
        Ok(Response::new(answer))
    }

    type DecideStreamStream = Answers;

    async fn decide_stream(
        &self,
        request: Request<Streaming<pb::DecideRequest>>,
    ) -> Result<Response<Self::DecideStreamStream>, Status> {
        let baseline = self.clone();
        let answers = request
            .into_inner()
            .map(move |item| item.map(|request| baseline.answer(&request)));
        Ok(Response::new(Box::pin(answers)))
    }

    async fn report_traffic(
        &self,
        request: Request<pb::ReportTrafficRequest>,
    ) -> Result<Response<pb::ReportTrafficResponse>, Status> {
        Ok(Response::new(pb::ReportTrafficResponse {
            accepted: request.get_ref().traffic.len() as u32,
            already_applied: 0,
            ..Default::default()
        }))
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot bind {}", args.listen))?;
        let redis = match &args.redis {
            Some(url) => Some(RawScript::connect(url).await?),
            None => None,
        };
        let address = listener.local_addr()?;
        println!("{{\"grpc\":\"{address}\"}}");
        let mut server = tonic::transport::Server::builder();
        let decider = RetryDeciderServer::new(Baseline::new(redis));
        let router = if args.server_limits {
            // What `retryd serve` sets up by default around the decider:
            // the `[server]` defaults, and the same routes.
            let (_, health) = tonic_health::server::health_reporter();
            let reflection = || {
                tonic_reflection::server::Builder::configure()
                    .register_encoded_file_descriptor_set(retryd_proto::FILE_DESCRIPTOR_SET)
                    .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            };
            server
                .max_concurrent_streams(128)
                .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
                .add_service(health)
                .add_service(reflection().build_v1()?)
                .add_service(reflection().build_v1alpha()?)
                .add_service(decider)
        } else {
            server.add_service(decider)
        };
        router
            .serve_with_incoming_shutdown(
                // tonic's default (TCP_NODELAY), which it applies only to
                // listeners it binds itself.
                TcpIncoming::from(listener).with_nodelay(Some(true)),
                shutdown_signal(),
            )
            .await
            .context("the gRPC server failed")
    })
}

/// SIGTERM (what background shells and scripts send) or SIGINT.
async fn shutdown_signal() {
    let mut terminate =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
}
