//! The Rust client of [retryd](https://github.com/retryd/retryd): ask
//! whether a failed outbound call may be retried, and let reqwest and
//! tonic callers turn "how far did this attempt get" into honest evidence.
//!
//! - [`Client`]: `Decide`, `DecideStream` and `ReportTraffic`, with an API
//!   key, TLS or mTLS, and a per-call timeout bounded by the caller's
//!   deadline. When retryd does not answer, the local [`Fallback`] decides
//!   with `retryd_engine::decide` itself (no copy of the rules), with one
//!   warning per outage.
//! - [`RetryMiddleware`] (feature `reqwest`): a `reqwest-middleware`
//!   middleware. NOT_SENT only from proof: a connect or DNS error; a
//!   timeout or a broken body after sending never is.
//! - [`RetrydLayer`] (feature `tower`): a tower layer for tonic clients,
//!   passing gRPC codes and `grpc-retry-pushback-ms` as the server sent them.
//! - [`TrafficReporter`]: on by default, batching first attempts with a
//!   `report_id` per batch that a re-send keeps.
//! - Shadow answers (an upstream with `enforce = false`) are followed by the
//!   local rule, with retryd's answer beside it ([`Decision::retryd`]).
//! - Hedging: both adapters hedge slow idempotent calls at the delay retryd
//!   serves (see [Hedging](#hedging)).
//!
//! # Deciding locally
//!
//! The fallback is the engine on a local policy: it runs anywhere, without
//! retryd, and gives the answer the engine gives.
//!
//! ```
//! use retryd_client::{Fallback, Source, pb};
//! use retryd_client::engine::{DenyReason, Verdict};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let fallback = Fallback::default();
//! // A payment whose response never came: it may have happened.
//! let charge = pb::DecideRequest {
//!     upstream: "payments-api".into(),
//!     operation: "POST /v1/charges".into(),
//!     idempotency: pb::Idempotency::NonIdempotent as i32,
//!     attempt: 1,
//!     failure: pb::FailureKind::ResponseHeaderTimeout as i32,
//!     ..Default::default()
//! };
//! let decision = fallback.decide(&charge, "example", Source::Fallback).unwrap();
//! assert_eq!(decision.verdict, Verdict::Ambiguous);
//! assert!(decision.is_outcome_unknown());
//!
//! // A connection that was refused proves the request never left.
//! let refused = pb::DecideRequest {
//!     failure: pb::FailureKind::Connect as i32,
//!     ..charge.clone()
//! };
//! assert!(fallback.decide(&refused, "example", Source::Fallback).unwrap().should_retry());
//!
//! // The local policy allows two attempts in all.
//! let second = pb::DecideRequest { attempt: 2, ..refused };
//! let decision = fallback.decide(&second, "example", Source::Fallback).unwrap();
//! assert_eq!(decision.deny_reason(), Some(DenyReason::MaxAttempts));
//! # }
//! ```
//!
//! # Asking retryd
//!
//! ```no_run
//! use retryd_client::{Client, pb};
//!
//! # #[tokio::main] async fn main() -> Result<(), retryd_client::Error> {
//! let client = Client::builder("http://127.0.0.1:50051")
//!     .api_key("my-service-key-0123456789")
//!     .connect()
//!     .await?;
//! let decision = client
//!     .decide(&pb::DecideRequest {
//!         upstream: "payments-api".into(),
//!         idempotency: pb::Idempotency::Safe as i32,
//!         attempt: 1,
//!         http_status: 503,
//!         ..Default::default()
//!     })
//!     .await?;
//! if decision.should_retry() {
//!     tokio::time::sleep(decision.backoff()).await;
//! }
//! client.close(std::time::Duration::from_secs(2)).await?;
//! # Ok(()) }
//! ```
//!
//! # reqwest
//!
//! ```no_run
//! use retryd_client::{Call, Client, RetryMiddleware};
//! use retryd_client::engine::Idempotency;
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let retryd = Client::builder("http://127.0.0.1:50051").connect().await?;
//! let http = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(RetryMiddleware::new(retryd).upstream("catalog"))
//!     .build();
//! let response = http
//!     .get("http://catalog.internal/items/7")
//!     // Declared, never guessed from the method.
//!     .with_extension(Call::new(Idempotency::Safe).deadline_in(std::time::Duration::from_secs(2)))
//!     .send()
//!     .await?;
//! # drop(response); Ok(()) }
//! ```
//!
//! # tonic
//!
//! ```no_run
//! use retryd_client::{Client, RetrydLayer};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let retryd = Client::builder("http://127.0.0.1:50051").connect().await?;
//! let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:7000").connect_lazy();
//! let governed = tower::ServiceBuilder::new()
//!     .layer(RetrydLayer::new(retryd, "ledger").attempt_timeout(std::time::Duration::from_millis(500)))
//!     .service(channel);
//! // Any generated client: here retryd's own contract stands in for yours.
//! let mut ledger = retryd_client::pb::retry_decider_client::RetryDeciderClient::new(governed);
//! # let _ = &mut ledger; Ok(()) }
//! ```
//!
//! # Call chains: one layer retries
//!
//! A service that both serves requests and makes outbound calls puts
//! [`LineageLayer`] on its server (tower: axum, hyper, tonic). The adapters
//! then send the `retryd.lineage` baggage member on each attempt and the
//! inbound lineage with each Decide, read the `retryd-retried` mark of a
//! failed response, and a failed response of the server says
//! `retryd-retried` when its handler's outbound call was retried to the end
//! or denied: only the layer nearest a failure retries it (docs/lineage.md
//! in the repository). A task the handler spawns carries the request with
//! [`Inbound::scope`].
//!
//! # Hedging
//!
//! Both adapters hedge a call's first attempt when retryd serves a hedge
//! delay for its upstream (learned from the traffic reports' answers,
//! [`TrafficReporter::hedging`]): a SAFE or IDEMPOTENT call (as the policy
//! lists them; never NON_IDEMPOTENT, never a streaming body) starts a timer
//! of that delay when it is sent, and only if the timer fires with the
//! call still running is retryd asked (`Decide` with `hedge = k`). On
//! RETRY a copy is sent; the first answer wins and the other copies are
//! dropped (cancelled). A denied hedge sends nothing. With retryd
//! unreachable, the local rule hedges at a fixed delay if one is set
//! ([`FallbackPolicy::local_hedge_delay`], [`LocalHedging`]), else not at
//! all:
//!
//! ```
//! use std::time::Duration;
//! use retryd_client::{Fallback, FallbackPolicy, Source, pb};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let fallback = Fallback::new(FallbackPolicy::default().local_hedge_delay(Duration::from_millis(50)));
//! // Each first attempt earns 5% of a hedge: 20 of them, one hedge.
//! fallback.record_traffic("catalog", 21);
//! let hedge = pb::DecideRequest {
//!     upstream: "catalog".into(),
//!     idempotency: pb::Idempotency::Safe as i32,
//!     attempt: 1,
//!     hedge: 1,
//!     ..Default::default()
//! };
//! assert!(fallback.decide(&hedge, "retryd unreachable", Source::Fallback).unwrap().should_retry());
//! # }
//! ```
//!
//! # Architecture
//!
//! Invariant: this crate never imports the server (`retryd`); it depends on
//! the wire contract (`retryd-proto`) and the pure rules (`retryd-engine`).
#![forbid(unsafe_code)]

mod adapter;
mod client;
mod decision;
mod fallback;
mod hedge;
mod lineage;
mod outage;
mod reporter;
mod request;
#[cfg(feature = "reqwest")]
mod reqwest;
mod shadow;
#[cfg(feature = "tower")]
mod tower;

/// The pure rules the fallback decides with.
pub use retryd_engine as engine;
/// The wire contract (`retryd.v1`), generated.
pub use retryd_proto as pb;

pub use adapter::{AmbiguousError, Call, CallFailed, Decisions};
pub use client::{
    Builder, Client, DEFAULT_CONNECT_TIMEOUT, DEFAULT_TIMEOUT, DecideStream, Error,
    MIN_CALL_TIMEOUT,
};
pub use decision::{Decision, Source, deny_reason_name};
pub use fallback::{Fallback, FallbackPolicy, LocalBudget, MAX_LOCAL_UPSTREAMS, UpstreamFallback};
pub use hedge::{LOCAL_HEDGE_BURST, LocalHedging};
pub use lineage::{BAGGAGE_KEY, Inbound, RETRIED_HEADER, default_layer, lineage_of_baggage};
#[cfg(feature = "tower")]
pub use lineage::{LineageBody, LineageLayer, LineageService};
pub use outage::OutageCounts;
pub use reporter::{
    FAILURE_CODES, HEDGING_STALE_AFTER, ReporterOptions, Traffic, TrafficReporter,
    attempt_succeeded, new_report_id,
};
pub use request::{InvalidRequest, pb_duration};
#[cfg(feature = "reqwest")]
pub use reqwest::{
    DEFAULT_ERROR_BODY_LIMIT, DEFAULT_RETRY_STATUSES, RefreshCredentials, RetryMiddleware,
};
pub use shadow::DEFAULT_SHADOW_LOG_INTERVAL;
#[cfg(feature = "tower")]
pub use tower::{
    ATTEMPTS_KEY, DEFAULT_MAX_REPLAY_BYTES, DENY_REASON_KEY, GrpcOutcome, RefreshMetadata,
    RetrydLayer, RetrydService, UNKNOWN_OUTCOME_KEY, VERDICT_KEY, outcome_of,
};
