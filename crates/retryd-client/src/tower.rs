//! [`RetrydLayer`], a tower layer for tonic clients: each failed gRPC
//! attempt becomes evidence (its status code and `grpc-retry-pushback-ms`
//! passed raw, as the server sent them), retryd (or the local rule)
//! decides, and a RETRY's backoff is slept inside the caller's deadline.
//!
//! Layer it over a `tonic::transport::Channel` (`ServiceBuilder::new()
//! .layer(layer).service(channel)`) and build the generated client on the
//! result. The evidence:
//!
//! - an error before the request was handed over (`poll_ready`), or tonic's
//!   `ConnectError` (its connector failed): NOT_SENT, CONNECT;
//! - a status the server sent (in the headers of a trailers-only response,
//!   or in the trailers): RESPONSE_RECEIVED with its code and pushback;
//! - a deadline that ran out, a reset, any other transport error:
//!   SENT_NO_RESPONSE (DEADLINE_EXCEEDED, or UNAVAILABLE with
//!   CONNECTION_RESET), never NOT_SENT.
//!
//! The request body is read before the first attempt as far as it is
//! ready: a unary (or an already complete) request is kept and replayed; a
//! stream still being produced is one-shot, sent as it comes, and never
//! re-sent (DENY BODY_NOT_REPLAYABLE). The response is handed over as soon
//! as its first message arrives (a streamed response stays streamed); only
//! a response that ends without a message is decided.
//!
//! A call that is not attempted again fails with the last attempt's
//! status, carrying the decision in its metadata ([`outcome_of`]).
//!
//! A call kept whole for replays, declared hedgeable, to an upstream whose
//! hedging retryd serves is hedged (hedge_first.rs, crate docs "Hedging"):
//! the first copy whose response is not a failure wins.
//!
//! It describes attempts and asks [`Client`]; it decides nothing.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http_body::{Body as _, Frame};
use http_body_util::BodyExt;
use retryd_engine::{Idempotency, UnknownOutcome};
use retryd_proto as pb;
use tokio::time::Instant;
use tonic::body::Body;
use tower::ServiceExt;

use crate::adapter::{self, Call, Decisions, MAX_LOOP, Outcome};
use crate::client::Client;
use crate::decision::Decision;
use crate::fallback;
use crate::hedge;
use crate::lineage;
use crate::reporter;
use crate::request::{MAX_HEADER_BYTES, MAX_NAME_BYTES, pb_idempotency};

mod hedge_first;
use hedge_first::{HedgeCall, hedged_first};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The most request bytes kept for a replay; a longer request is one-shot.
pub const DEFAULT_MAX_REPLAY_BYTES: usize = 4 << 20;

/// The metadata key of the verdict on a failed call's status.
pub const VERDICT_KEY: &str = "retryd-verdict";
/// The metadata key of the deny reason on a failed call's status.
pub const DENY_REASON_KEY: &str = "retryd-deny-reason";
/// The metadata key of the unknown-outcome mark on a failed call's status.
pub const UNKNOWN_OUTCOME_KEY: &str = "retryd-unknown-outcome";
/// The metadata key of the number of attempts made.
pub const ATTEMPTS_KEY: &str = "retryd-attempts";

/// The layer; see the module docs.
#[derive(Clone, Debug)]
pub struct RetrydLayer {
    config: Arc<Config>,
}

/// Sets fresh credentials on the next attempt's headers after retryd
/// answered UNAUTHENTICATED with `refresh_credentials`.
pub type RefreshMetadata = Arc<dyn Fn(&mut http::HeaderMap) -> Result<(), BoxError> + Send + Sync>;

#[derive(Clone)]
struct Config {
    client: Client,
    upstream: Option<String>,
    attempt_timeout: Option<Duration>,
    max_replay_bytes: usize,
    reporting: bool,
    refresh_credentials: Option<RefreshMetadata>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("upstream", &self.upstream)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("max_replay_bytes", &self.max_replay_bytes)
            .field("reporting", &self.reporting)
            .finish_non_exhaustive()
    }
}

impl RetrydLayer {
    /// A layer deciding through `client`, for calls to `upstream` (unless a
    /// call's [`Call`] extension names another).
    pub fn new(client: Client, upstream: impl Into<String>) -> RetrydLayer {
        RetrydLayer {
            config: Arc::new(Config {
                client,
                upstream: Some(upstream.into()),
                attempt_timeout: None,
                max_replay_bytes: DEFAULT_MAX_REPLAY_BYTES,
                reporting: true,
                refresh_credentials: None,
            }),
        }
    }

    fn config_mut(&mut self) -> &mut Config {
        // Copy-on-write: configuring a layer never changes one cloned from it.
        Arc::make_mut(&mut self.config)
    }

    /// Bounds each attempt (and sets its `grpc-timeout`); running out of it
    /// is SENT_NO_RESPONSE with DEADLINE_EXCEEDED.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.config_mut().attempt_timeout = Some(timeout);
        self
    }

    /// The most request bytes kept for a replay (default 4 MiB).
    pub fn max_replay_bytes(mut self, limit: usize) -> Self {
        self.config_mut().max_replay_bytes = limit;
        self
    }

    /// Stops counting first attempts on the client's reporter.
    pub fn disable_reporting(mut self) -> Self {
        self.config_mut().reporting = false;
        self
    }

    /// Called before replaying a call retryd answered with
    /// `refresh_credentials` (after UNAUTHENTICATED, SAFE calls only), to
    /// set fresh credentials on its headers; without it such a call fails
    /// with its status.
    pub fn refresh_credentials(mut self, refresh: RefreshMetadata) -> Self {
        self.config_mut().refresh_credentials = Some(refresh);
        self
    }
}

impl<S> tower_layer::Layer<S> for RetrydLayer {
    type Service = RetrydService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RetrydService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service [`RetrydLayer`] makes.
#[derive(Clone, Debug)]
pub struct RetrydService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S, ResBody> tower_service::Service<http::Request<Body>> for RetrydService<S>
where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        // The ready clone is the one called first; later attempts wait for
        // readiness themselves.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(run(inner, self.config.clone(), request))
    }
}

/// What a request body became: kept whole for replays, or one-shot.
enum Replay {
    Kept(Bytes),
    OneShot(Option<Body>),
}

/// Reads the frames of `body` that are ready now, up to `limit` bytes.
async fn read_ready(mut body: Body, limit: usize) -> Replay {
    let mut kept = BytesMut::new();
    loop {
        if body.is_end_stream() {
            return Replay::Kept(kept.freeze());
        }
        // Only what is ready: a stream still being produced is one-shot,
        // and waiting for its end could wait forever.
        match body.frame().now_or_never() {
            Some(None) => return Replay::Kept(kept.freeze()),
            Some(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => {
                    kept.extend_from_slice(&data);
                    if kept.len() > limit {
                        return Replay::OneShot(Some(prefixed(kept.freeze(), body)));
                    }
                }
                // A request carries no trailers in gRPC; one that does is
                // passed on as it came.
                Err(frame) => {
                    let trailers = frame.into_trailers().ok();
                    return Replay::OneShot(Some(Body::new(Frames::new(kept.freeze(), trailers))));
                }
            },
            Some(Some(Err(_))) | None => {
                return Replay::OneShot(Some(prefixed(kept.freeze(), body)));
            }
        }
    }
}

fn prefixed(prefix: Bytes, rest: Body) -> Body {
    let first =
        futures_util::stream::once(async move { Ok::<_, tonic::Status>(Frame::data(prefix)) });
    let rest = http_body_util::BodyStream::new(rest);
    Body::new(http_body_util::StreamBody::new(
        futures_util::StreamExt::chain(first, rest),
    ))
}

/// A body of one data frame and optional trailers.
struct Frames {
    data: Option<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl Frames {
    fn new(data: Bytes, trailers: Option<http::HeaderMap>) -> Frames {
        Frames {
            data: Some(data).filter(|data| !data.is_empty()),
            trailers,
        }
    }
}

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(
            self.trailers
                .take()
                .map(|trailers| Ok(Frame::trailers(trailers))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }
}

/// The caller's deadline from `grpc-timeout` (`100m`, `2S`, ...).
fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    let raw = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = raw.split_at(raw.len().checked_sub(1)?);
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(value.saturating_mul(3600)),
        "M" => Duration::from_secs(value.saturating_mul(60)),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

fn grpc_timeout_value(timeout: Duration) -> http::HeaderValue {
    // Milliseconds, rounded up so a short deadline is not made zero; at
    // most 8 digits, as the gRPC spec allows.
    let millis = timeout.as_nanos().div_ceil(1_000_000).clamp(1, 99_999_999);
    http::HeaderValue::from_str(&format!("{millis}m"))
        .unwrap_or(http::HeaderValue::from_static("1m"))
}

/// How one attempt ended.
enum Attempted {
    Done(http::Response<Body>),
    Failed {
        outcome: Outcome,
        /// The status to fail the call with if it is not attempted again.
        status: tonic::Status,
        /// The caller's deadline ended it.
        deadline: bool,
    },
}

async fn run<S, ResBody>(
    mut inner: S,
    config: Arc<Config>,
    request: http::Request<Body>,
) -> Result<http::Response<Body>, BoxError>
where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let started = Instant::now();
    let (mut parts, body) = request.into_parts();
    let call = parts.extensions.get::<Call>().cloned().unwrap_or_default();
    let idempotency = call.idempotency.unwrap_or(Idempotency::NonIdempotent);
    let upstream = call
        .upstream
        .clone()
        .or_else(|| config.upstream.clone())
        .or_else(|| parts.uri.authority().map(|authority| authority.to_string()))
        .unwrap_or_else(|| "unknown".to_owned());
    let operation = call
        .operation
        .clone()
        .unwrap_or_else(|| adapter::truncate(parts.uri.path(), MAX_NAME_BYTES));
    let deadline = call
        .deadline
        .or_else(|| grpc_timeout(&parts.headers).map(|timeout| started + timeout));
    let mut replay = read_ready(body, config.max_replay_bytes).await;
    let body_kind = match replay {
        Replay::Kept(_) => pb::BodyKind::EncodedValue,
        Replay::OneShot(_) => pb::BodyKind::InputStream,
    };
    if config.reporting {
        config.client.reporter().record(&upstream, 1);
    }

    let mut decisions: Vec<Decision> = Vec::new();
    let mut previous_backoff = Duration::ZERO;
    let mut auth_refreshed = false;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let body = match &mut replay {
            Replay::Kept(bytes) => Body::new(Frames::new(bytes.clone(), None)),
            Replay::OneShot(body) => body.take().unwrap_or_default(),
        };
        let mut attempt_request = http::Request::from_parts(parts.clone(), body);
        lineage::set_baggage(attempt_request.headers_mut(), attempt);
        // Only a first attempt is hedged, and only a call kept whole for
        // replays (a one-shot stream cannot be copied).
        let plan = match (&replay, attempt) {
            (Replay::Kept(_), 1) => hedge::plan(&config.client, &upstream, idempotency),
            _ => None,
        };
        let attempted = if let (Some(plan), Replay::Kept(bytes)) = (plan, &replay) {
            let call = HedgeCall {
                upstream: &upstream,
                operation: &operation,
                idempotency: pb_idempotency(idempotency),
                max_attempts: call.max_attempts,
            };
            let hedged = hedged_first(
                &mut inner,
                &config,
                attempt_request,
                &parts,
                bytes,
                deadline,
                plan,
                call,
            )
            .await;
            decisions.extend(hedged.decisions);
            // The next retry, if any, counts every copy sent.
            attempt = hedged.sent;
            hedged.result
        } else {
            let sent = Instant::now();
            let attempted = one_attempt(&mut inner, &config, &mut attempt_request, deadline).await;
            if config.reporting {
                // FAILURE_CODES fail, any other ending succeeds, CANCELLED
                // (and a dropped future, which never gets here) is neither.
                let success = match &attempted {
                    Attempted::Done(_) => Some(true),
                    Attempted::Failed { status, .. } => reporter::attempt_succeeded(status.code()),
                };
                if let Some(success) = success {
                    let reporter = config.client.reporter();
                    reporter.record_outcome(&upstream, success, attempt > 1);
                    // First attempts only: hedging's latencies.
                    if attempt == 1 {
                        reporter.record_latency(&upstream, success, sent.elapsed());
                    }
                }
            }
            attempted
        };
        let (outcome, status, ended) = match attempted {
            Attempted::Done(mut response) => {
                if !decisions.is_empty() {
                    response.extensions_mut().insert(Decisions(decisions));
                }
                return Ok(response);
            }
            Attempted::Failed {
                outcome,
                status,
                deadline,
            } => (outcome, status, deadline),
        };
        let decide_request = pb::DecideRequest {
            upstream: upstream.clone(),
            operation: operation.clone(),
            idempotency: pb_idempotency(idempotency) as i32,
            body: Some(pb::Body {
                kind: body_kind as i32,
                ..Default::default()
            }),
            attempt,
            evidence: outcome.evidence as i32,
            failure: outcome.failure as i32,
            grpc_status_code: outcome.grpc_status,
            grpc_retry_pushback_ms: outcome
                .grpc_pushback
                .as_deref()
                .map(|raw| adapter::truncate(raw, MAX_HEADER_BYTES)),
            max_attempts: call.max_attempts,
            auth_refresh_attempted: auth_refreshed,
            retried_below: outcome.retried_below.clone(),
            ..Default::default()
        };
        if ended {
            lineage::note_dependency_failed();
            return Err(match fallback::ended_by_caller(&decide_request, true) {
                Some(decision) => {
                    decisions.push(decision.clone());
                    marked(status, &decision, &decisions, attempt)
                }
                None => marked_plain(status, attempt),
            });
        }
        let (_, decision) =
            adapter::decide(&config.client, decide_request, deadline, previous_backoff)
                .await
                .map_err(|error| Box::new(error) as BoxError)?;
        decisions.push(decision.clone());
        let backoff = decision.backoff();
        let fits = deadline.is_none_or(|deadline| Instant::now() + backoff < deadline);
        let replayable = matches!(replay, Replay::Kept(_));
        let refreshable = !decision.refresh_credentials() || config.refresh_credentials.is_some();
        if decision.is_outcome_unknown()
            || !decision.should_retry()
            || !refreshable
            || !replayable
            || !fits
            || attempt >= MAX_LOOP
        {
            lineage::note_dependency_failed();
            return Err(marked(status, &decision, &decisions, attempt));
        }
        if decision.refresh_credentials() {
            if let Some(refresh) = &config.refresh_credentials {
                refresh(&mut parts.headers)?;
                auth_refreshed = true;
            }
        }
        previous_backoff = backoff;
        tokio::time::sleep(backoff).await;
    }
}

async fn one_attempt<S, ResBody>(
    inner: &mut S,
    config: &Config,
    request: &mut http::Request<Body>,
    deadline: Option<Instant>,
) -> Attempted
where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let now = Instant::now();
    let own = config.attempt_timeout.map(|timeout| now + timeout);
    let (limit, is_deadline) = match (own, deadline) {
        (Some(own), Some(deadline)) if deadline <= own => (Some(deadline), true),
        (Some(own), _) => (Some(own), false),
        (None, Some(deadline)) => (Some(deadline), true),
        (None, None) => (None, false),
    };
    if let Some(limit) = limit {
        // A little later than the layer's own limit: a tonic server answers
        // its expired deadline CANCELLED, which must not win the race with
        // the timeout the layer decides on.
        let margin = Duration::from_millis(50);
        request.headers_mut().insert(
            "grpc-timeout",
            grpc_timeout_value(limit.saturating_duration_since(now) + margin),
        );
    }
    let request = std::mem::replace(request, http::Request::new(Body::empty()));
    let exchange = async move {
        // An error before the request was handed over proves it never left.
        let service = match inner.ready().await {
            Ok(service) => service,
            Err(error) => return transport_failure(error.into(), true),
        };
        let response = match service.call(request).await {
            Ok(response) => response,
            Err(error) => return transport_failure(error.into(), false),
        };
        inspect(response).await
    };
    let Some(limit) = limit else {
        return exchange.await;
    };
    match tokio::time::timeout_at(limit, exchange).await {
        Ok(attempted) => attempted,
        Err(_) => Attempted::Failed {
            outcome: Outcome {
                evidence: pb::Evidence::SentNoResponse,
                failure: pb::FailureKind::ResponseHeaderTimeout,
                grpc_status: tonic::Code::DeadlineExceeded as u32,
                ..Outcome::default()
            },
            status: tonic::Status::deadline_exceeded("the attempt ran out of time"),
            deadline: is_deadline,
        },
    }
}

fn transport_failure(error: BoxError, before_call: bool) -> Attempted {
    let mut connect = before_call;
    let mut timeout = false;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&*error);
    while let Some(error) = source {
        connect |= error.downcast_ref::<tonic::ConnectError>().is_some();
        timeout |= error.downcast_ref::<tonic::TimeoutExpired>().is_some();
        source = error.source();
    }
    // The channel enforces the `grpc-timeout` the layer set and calls its
    // expiry CANCELLED; to the caller it is the attempt's deadline.
    let status = if timeout && !connect {
        tonic::Status::deadline_exceeded("the attempt ran out of time")
    } else {
        tonic::Status::from_error(error)
    };
    let outcome = if connect {
        Outcome {
            evidence: pb::Evidence::NotSent,
            failure: pb::FailureKind::Connect,
            grpc_status: tonic::Code::Unavailable as u32,
            ..Outcome::default()
        }
    } else if timeout {
        Outcome {
            evidence: pb::Evidence::SentNoResponse,
            failure: pb::FailureKind::ResponseHeaderTimeout,
            grpc_status: tonic::Code::DeadlineExceeded as u32,
            ..Outcome::default()
        }
    } else {
        Outcome {
            evidence: pb::Evidence::SentNoResponse,
            failure: pb::FailureKind::ConnectionReset,
            grpc_status: match status.code() {
                tonic::Code::Ok => tonic::Code::Unknown as u32,
                code => code as u32,
            },
            ..Outcome::default()
        }
    };
    Attempted::Failed {
        outcome,
        status,
        deadline: false,
    }
}

/// The status the server sent in `headers` (or trailers), as a failure.
fn status_failure(headers: &http::HeaderMap) -> Option<Attempted> {
    let status = tonic::Status::from_header_map(headers)?;
    if status.code() == tonic::Code::Ok {
        return None;
    }
    let pushback = headers
        .get("grpc-retry-pushback-ms")
        .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned());
    Some(Attempted::Failed {
        outcome: Outcome {
            evidence: pb::Evidence::ResponseReceived,
            grpc_status: status.code() as u32,
            grpc_pushback: pushback,
            retried_below: lineage::retried_below(headers),
            ..Outcome::default()
        },
        status,
        deadline: false,
    })
}

async fn inspect<ResBody>(response: http::Response<ResBody>) -> Attempted
where
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // A trailers-only response: the status is in the headers.
    if response.headers().contains_key("grpc-status") {
        if let Some(failed) = status_failure(response.headers()) {
            return failed;
        }
    }
    let (parts, body) = response.into_parts();
    // Boxed so that any body can be polled (`frame` needs `Unpin`).
    let mut body = Box::pin(body);
    let first = body.frame().await;
    let rebuilt = move |first: Frame<Bytes>, body: Pin<Box<ResBody>>| {
        let first = futures_util::stream::once(async move { Ok::<_, BoxError>(first) });
        let rest = futures_util::StreamExt::map(http_body_util::BodyStream::new(body), |frame| {
            frame.map_err(Into::into)
        });
        http::Response::from_parts(
            parts,
            Body::new(http_body_util::StreamBody::new(
                futures_util::StreamExt::chain(first, rest),
            )),
        )
    };
    match first {
        // Ended with no frame at all: handed over as it came (tonic reports
        // the missing status itself).
        None => Attempted::Done(rebuilt(Frame::data(Bytes::new()), body)),
        Some(Ok(frame)) if frame.is_trailers() => {
            if let Some(failed) = frame.trailers_ref().and_then(status_failure) {
                return failed;
            }
            Attempted::Done(rebuilt(frame, body))
        }
        // A message arrived: the call is answered; hand it over streaming.
        Some(Ok(frame)) => Attempted::Done(rebuilt(frame, body)),
        Some(Err(error)) => Attempted::Failed {
            outcome: Outcome {
                evidence: pb::Evidence::SentNoResponse,
                failure: pb::FailureKind::ConnectionReset,
                grpc_status: tonic::Code::Unavailable as u32,
                ..Outcome::default()
            },
            status: tonic::Status::from_error(error.into()),
            deadline: false,
        },
    }
}

fn insert(status: &mut tonic::Status, key: &'static str, value: &str) {
    if let Ok(value) = value.parse() {
        status.metadata_mut().insert(key, value);
    }
}

/// The last attempt's status with the decision in its metadata.
fn marked(
    mut status: tonic::Status,
    decision: &Decision,
    decisions: &[Decision],
    attempts: u32,
) -> BoxError {
    // An attempt that may have taken effect keeps the call's outcome open.
    let open = decisions
        .iter()
        .rev()
        .find_map(|decision| decision.unknown_outcome);
    let verdict = if decision.is_outcome_unknown() || open.is_some() {
        "ambiguous"
    } else {
        decision.verdict.as_str()
    };
    insert(&mut status, VERDICT_KEY, verdict);
    if let Some(reason) = decision.deny_reason() {
        insert(&mut status, DENY_REASON_KEY, reason.as_str());
    }
    if let Some(mark) = open {
        insert(&mut status, UNKNOWN_OUTCOME_KEY, mark.as_str());
    }
    insert(&mut status, ATTEMPTS_KEY, &attempts.to_string());
    Box::new(status)
}

fn marked_plain(mut status: tonic::Status, attempts: u32) -> BoxError {
    insert(&mut status, VERDICT_KEY, "deny");
    insert(&mut status, DENY_REASON_KEY, "deadline");
    insert(&mut status, ATTEMPTS_KEY, &attempts.to_string());
    Box::new(status)
}

/// What the layer decided for a call that failed, read from its status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrpcOutcome {
    /// `retry` (a RETRY that could not be followed), `deny` or `ambiguous`
    /// (the call may have taken effect: reconcile, never a plain failure).
    pub verdict: String,
    /// The deny reason's name, for a DENY.
    pub deny_reason: Option<String>,
    /// The unknown-outcome mark, if any attempt may have taken effect.
    pub unknown_outcome: Option<UnknownOutcome>,
    /// Attempts made.
    pub attempts: u32,
}

impl GrpcOutcome {
    /// Whether the call may have taken effect upstream.
    pub fn is_ambiguous(&self) -> bool {
        self.verdict == "ambiguous"
    }
}

/// The layer's decision on a failed call's `status`; `None` for a status
/// the layer did not decide (an error of a layer above it, say).
pub fn outcome_of(status: &tonic::Status) -> Option<GrpcOutcome> {
    let metadata = status.metadata();
    let text = |key: &str| {
        metadata
            .get(key)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    Some(GrpcOutcome {
        verdict: text(VERDICT_KEY)?,
        deny_reason: text(DENY_REASON_KEY),
        unknown_outcome: match text(UNKNOWN_OUTCOME_KEY).as_deref() {
            Some("reconcile") => Some(UnknownOutcome::Reconcile),
            Some("resend_with_key") => Some(UnknownOutcome::ResendWithKey),
            _ => None,
        },
        attempts: text(ATTEMPTS_KEY)?.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_reads_every_unit_and_refuses_garbage() {
        let read = |raw: &'static str| {
            let mut headers = http::HeaderMap::new();
            headers.insert("grpc-timeout", http::HeaderValue::from_static(raw));
            grpc_timeout(&headers)
        };
        assert_eq!(read("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(read("3M"), Some(Duration::from_secs(180)));
        assert_eq!(read("4S"), Some(Duration::from_secs(4)));
        assert_eq!(read("250m"), Some(Duration::from_millis(250)));
        assert_eq!(read("7u"), Some(Duration::from_micros(7)));
        assert_eq!(read("9n"), Some(Duration::from_nanos(9)));
        for garbage in ["", "m", "10", "10x", "-5m"] {
            assert_eq!(read(garbage), None, "{garbage:?}");
        }
        assert_eq!(grpc_timeout_value(Duration::from_micros(1)), "1m");
        assert_eq!(grpc_timeout_value(Duration::from_millis(1500)), "1500m");
    }
}
