//! [`RetryMiddleware`], a `reqwest-middleware` middleware: each failed
//! attempt becomes evidence, retryd (or the local rule) decides, and a
//! RETRY's backoff is slept holding no connection and never past the
//! caller's deadline.
//!
//! The mapping (the crate README has it as a table): a connect or DNS
//! error, or an HTTP/2 REFUSED_STREAM, proves NOT_SENT, and nothing else
//! does. A timeout, a reset, an
//! incomplete message or any other error once a connection was made is
//! SENT_NO_RESPONSE; a body that breaks after the headers is
//! PARTIAL_RESPONSE. A streaming body (`try_clone` gives `None`) is
//! one-shot and never re-sent.
//!
//! A first attempt that can be copied, declared hedgeable, to an upstream
//! whose hedging retryd serves is hedged (hedge_first.rs, crate docs
//! "Hedging").
//!
//! It describes attempts and asks [`Client`]; it decides nothing.

use std::error::Error as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::Extensions;
use reqwest::{Request, Response, StatusCode};
use reqwest_middleware::{Middleware, Next};
use retryd_engine::Idempotency;
use retryd_proto as pb;
use tokio::time::Instant;

use crate::adapter::{self, AmbiguousError, Call, CallFailed, Decisions, MAX_LOOP, Outcome};
use crate::client::Client;
use crate::decision::Decision;
use crate::fallback;
use crate::hedge;
use crate::lineage;
use crate::request::{MAX_HEADER_BYTES, MAX_NAME_BYTES, pb_idempotency};

mod hedge_first;
use hedge_first::HedgeCall;

/// The statuses decided by retryd by default; any other response is
/// returned as it is.
pub const DEFAULT_RETRY_STATUSES: [u16; 8] = [401, 408, 425, 429, 500, 502, 503, 504];

/// How much of a failed response's body is read before deciding.
pub const DEFAULT_ERROR_BODY_LIMIT: usize = 64 << 10;

/// Sets fresh credentials on the request of the next attempt after retryd
/// answered a 401 with `refresh_credentials`.
pub type RefreshCredentials =
    Arc<dyn Fn(&mut Request) -> Result<(), Box<dyn std::error::Error + Send + Sync>> + Send + Sync>;

/// Retries reqwest requests as retryd decides; see the module docs.
#[derive(Clone)]
pub struct RetryMiddleware {
    client: Client,
    upstream: Option<String>,
    attempt_timeout: Option<Duration>,
    deadline: Option<Duration>,
    retry_statuses: Vec<u16>,
    buffer_responses: Option<usize>,
    error_body_limit: usize,
    reporting: bool,
    refresh_credentials: Option<RefreshCredentials>,
}

impl std::fmt::Debug for RetryMiddleware {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryMiddleware")
            .field("upstream", &self.upstream)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("deadline", &self.deadline)
            .field("retry_statuses", &self.retry_statuses)
            .field("buffer_responses", &self.buffer_responses)
            .finish_non_exhaustive()
    }
}

impl RetryMiddleware {
    /// A middleware deciding through `client`.
    pub fn new(client: Client) -> RetryMiddleware {
        RetryMiddleware {
            client,
            upstream: None,
            attempt_timeout: None,
            deadline: None,
            retry_statuses: DEFAULT_RETRY_STATUSES.to_vec(),
            buffer_responses: None,
            error_body_limit: DEFAULT_ERROR_BODY_LIMIT,
            reporting: true,
            refresh_credentials: None,
        }
    }

    /// The upstream of calls that do not name one (else the URL's host).
    pub fn upstream(mut self, upstream: impl Into<String>) -> Self {
        self.upstream = Some(upstream.into());
        self
    }

    /// Bounds each attempt, up to its response headers (and its body with
    /// [`RetryMiddleware::buffer_responses`]). Running out of it is
    /// SENT_NO_RESPONSE (RESPONSE_HEADER_TIMEOUT): never NOT_SENT.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// The deadline of calls that do not declare one ([`Call::deadline`]),
    /// from when the call starts.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// The statuses decided by retryd (default [`DEFAULT_RETRY_STATUSES`]).
    pub fn retry_statuses(mut self, statuses: impl IntoIterator<Item = u16>) -> Self {
        self.retry_statuses = statuses.into_iter().collect();
        self
    }

    /// Reads a successful response's body (up to `limit` bytes) inside the
    /// attempt, so that a body that breaks off is PARTIAL_RESPONSE and
    /// decided, instead of failing in the caller's read where no retry is
    /// possible. A longer body is handed over after its first `limit` bytes.
    pub fn buffer_responses(mut self, limit: usize) -> Self {
        self.buffer_responses = Some(limit);
        self
    }

    /// Stops counting first attempts on the client's reporter.
    pub fn disable_reporting(mut self) -> Self {
        self.reporting = false;
        self
    }

    /// Called before replaying a request retryd answered with
    /// `refresh_credentials` (after a 401); without it such a 401 is
    /// returned as it is.
    pub fn refresh_credentials(mut self, refresh: RefreshCredentials) -> Self {
        self.refresh_credentials = Some(refresh);
        self
    }
}

/// A failed attempt: what it showed, and the response or error to hand
/// back if no further attempt is made.
struct Failed {
    outcome: Outcome,
    response: Option<Response>,
    error: Option<reqwest_middleware::Error>,
    /// The caller's deadline ended it (no decision is asked).
    deadline: bool,
}

enum Attempted {
    Done(Response),
    Failed(Failed),
}

#[async_trait::async_trait]
impl Middleware for RetryMiddleware {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let started = Instant::now();
        let call = extensions.get::<Call>().cloned().unwrap_or_default();
        let idempotency = call.idempotency.unwrap_or_else(|| {
            if request.headers().contains_key("idempotency-key") {
                Idempotency::IdempotentWithKey
            } else {
                Idempotency::NonIdempotent
            }
        });
        let upstream = call
            .upstream
            .clone()
            .or_else(|| self.upstream.clone())
            .or_else(|| request.url().host_str().map(str::to_owned))
            .unwrap_or_else(|| "unknown".to_owned());
        // Only a failed attempt needs the operation's name: a successful
        // call pays for no formatting.
        let method = request.method().clone();
        let operation = |url: &reqwest::Url| {
            call.operation.clone().unwrap_or_else(|| {
                adapter::truncate(&format!("{method} {}", url.path()), MAX_NAME_BYTES)
            })
        };
        let url = request.url().clone();
        // A streaming body cannot be cloned: it is one-shot.
        let body = match request.body() {
            None => None,
            Some(body) if body.as_bytes().is_some() => Some(pb::Body {
                kind: pb::BodyKind::Bytes as i32,
                ..Default::default()
            }),
            Some(_) => Some(pb::Body {
                kind: pb::BodyKind::InputStream as i32,
                ..Default::default()
            }),
        };
        let deadline = call
            .deadline
            .or(self.deadline.map(|within| started + within));
        if self.reporting {
            self.client.reporter().record(&upstream, 1);
        }

        let mut decisions: Vec<Decision> = Vec::new();
        let mut previous_backoff = Duration::ZERO;
        let mut auth_refreshed = false;
        let mut current = request;
        let mut attempt = 0;
        loop {
            attempt += 1;
            lineage::set_baggage(current.headers_mut(), attempt);
            let replay = current.try_clone();
            // Only a first attempt is hedged, and only one that can be
            // copied (a streaming body is one-shot).
            let plan = match (&replay, attempt) {
                (Some(_), 1) => hedge::plan(&self.client, &upstream, idempotency),
                _ => None,
            };
            let attempted = if let (Some(plan), Some(replay)) = (plan, replay.as_ref()) {
                let call = HedgeCall {
                    upstream: &upstream,
                    operation: operation(&url),
                    idempotency: pb_idempotency(idempotency),
                    body: body.clone(),
                    max_attempts: call.max_attempts,
                };
                let hedged = self
                    .hedged_first(
                        current,
                        replay,
                        extensions,
                        next.clone(),
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
                let attempted = self
                    .attempt(current, extensions, next.clone(), deadline)
                    .await;
                if self.reporting {
                    // A failure is an attempt retryd (or, past the deadline,
                    // the local rule) is asked about; any other ending is a
                    // success. A dropped future never gets here: neither.
                    let success = matches!(attempted, Attempted::Done(_));
                    let reporter = self.client.reporter();
                    reporter.record_outcome(&upstream, success, attempt > 1);
                    // First attempts only, until the response's headers (the
                    // middleware sees no further): hedging's latencies.
                    if attempt == 1 {
                        reporter.record_latency(&upstream, success, sent.elapsed());
                    }
                }
                attempted
            };
            let failed = match attempted {
                Attempted::Done(mut response) => {
                    if !decisions.is_empty() {
                        response.extensions_mut().insert(Decisions(decisions));
                    }
                    return Ok(response);
                }
                Attempted::Failed(failed) => failed,
            };
            let outcome = &failed.outcome;
            let decide_request = pb::DecideRequest {
                upstream: upstream.clone(),
                operation: operation(&url),
                idempotency: pb_idempotency(idempotency) as i32,
                body: body.clone(),
                attempt,
                evidence: outcome.evidence as i32,
                failure: outcome.failure as i32,
                http_status: outcome.http_status,
                retry_after: adapter::truncate(&outcome.retry_after, MAX_HEADER_BYTES),
                retried_below: outcome.retried_below.clone(),
                auth_refresh_attempted: auth_refreshed,
                max_attempts: call.max_attempts,
                ..Default::default()
            };
            if failed.deadline {
                return Err(ended_by_caller(&decide_request, failed, decisions, attempt));
            }
            let (_, decision) =
                match adapter::decide(&self.client, decide_request, deadline, previous_backoff)
                    .await
                {
                    Ok(decided) => decided,
                    Err(error) => return Err(reqwest_middleware::Error::middleware(error)),
                };
            decisions.push(decision.clone());
            if decision.is_outcome_unknown() {
                return Err(ambiguous(decision, decisions, attempt, failed));
            }
            let mut next_request = replay.filter(|_| decision.should_retry() && attempt < MAX_LOOP);
            if decision.refresh_credentials() {
                match (&self.refresh_credentials, next_request.as_mut()) {
                    (Some(refresh), Some(next_request)) => {
                        if let Err(error) = refresh(next_request) {
                            return Err(reqwest_middleware::Error::middleware(CallFailed {
                                decisions,
                                attempts: attempt,
                                cause: format!("refreshing credentials: {error}"),
                                deadline_exceeded: false,
                            }));
                        }
                        auth_refreshed = true;
                    }
                    _ => next_request = None,
                }
            }
            let backoff = decision.backoff();
            let fits = deadline.is_none_or(|deadline| Instant::now() + backoff < deadline);
            let Some(next_request) = next_request.filter(|_| fits) else {
                return finish(failed, decisions, attempt);
            };
            // The failed response (if any) was read and is dropped here:
            // its connection goes back before the wait.
            drop(failed);
            previous_backoff = backoff;
            tokio::time::sleep(backoff).await;
            current = next_request;
        }
    }
}

impl RetryMiddleware {
    async fn attempt(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
        deadline: Option<Instant>,
    ) -> Attempted {
        let started = Instant::now();
        let own_limit = self.attempt_timeout.map(|timeout| started + timeout);
        // Which limit comes first decides what running out of it means: the
        // attempt's own is a failure to decide, the caller's ends the call.
        let (limit, is_deadline) = match (own_limit, deadline) {
            (Some(own), Some(deadline)) if deadline <= own => (Some(deadline), true),
            (Some(own), _) => (Some(own), false),
            (None, Some(deadline)) => (Some(deadline), true),
            (None, None) => (None, false),
        };
        let retry_statuses = &self.retry_statuses;
        let buffer = self.buffer_responses;
        let error_body_limit = self.error_body_limit;
        let exchange = async move {
            let response = match next.run(request, extensions).await {
                Ok(response) => response,
                Err(error) => {
                    return Attempted::Failed(Failed {
                        outcome: classify(&error),
                        response: None,
                        error: Some(error),
                        deadline: false,
                    });
                }
            };
            let status = response.status();
            if retry_statuses.contains(&status.as_u16()) {
                return read_failed(response, error_body_limit).await;
            }
            match buffer {
                Some(limit) => read_successful(response, limit).await,
                None => Attempted::Done(response),
            }
        };
        let Some(limit) = limit else {
            return exchange.await;
        };
        match tokio::time::timeout_at(limit, exchange).await {
            Ok(attempted) => attempted,
            Err(_) => Attempted::Failed(Failed {
                // Whatever stage it was in, running out of time proves
                // nothing about the upstream: never NOT_SENT.
                outcome: Outcome {
                    evidence: pb::Evidence::SentNoResponse,
                    failure: pb::FailureKind::ResponseHeaderTimeout,
                    ..Outcome::default()
                },
                response: None,
                error: None,
                deadline: is_deadline,
            }),
        }
    }
}

/// What a reqwest-middleware error proves about how far the attempt got.
fn classify(error: &reqwest_middleware::Error) -> Outcome {
    let sent = |failure| Outcome {
        evidence: pb::Evidence::SentNoResponse,
        failure,
        ..Outcome::default()
    };
    let reqwest_middleware::Error::Reqwest(error) = error else {
        // An inner middleware's own error: nothing is proven.
        return sent(pb::FailureKind::GenericIo);
    };
    if error.is_connect() {
        // The connector failed: resolving, connecting or the TLS handshake,
        // before any byte of the request. The chain says which.
        let chain = chain_text(error);
        let failure = if chain.contains("certificate") {
            pb::FailureKind::TlsCertificateInvalid
        } else if error.is_dns() || chain.contains("dns error") {
            pb::FailureKind::Dns
        } else {
            pb::FailureKind::Connect
        };
        return Outcome {
            evidence: pb::Evidence::NotSent,
            failure,
            ..Outcome::default()
        };
    }
    if refused_stream(error) {
        // RFC 9113 §8.7: a stream the server reset with REFUSED_STREAM was
        // not processed. (A GOAWAY proves as much only for streams above
        // its last stream id, which the error does not say: not used.)
        return Outcome {
            evidence: pb::Evidence::NotSent,
            failure: pb::FailureKind::Http2RefusedStream,
            ..Outcome::default()
        };
    }
    if error.is_builder() {
        // Refused before it was sent (an invalid URL or header): permanent.
        return Outcome {
            evidence: pb::Evidence::NotSent,
            failure: pb::FailureKind::ProfileRejection,
            ..Outcome::default()
        };
    }
    if error.is_timeout() {
        return sent(pb::FailureKind::ResponseHeaderTimeout);
    }
    if is_reset(error) {
        return sent(pb::FailureKind::ConnectionReset);
    }
    sent(pb::FailureKind::GenericIo)
}

/// Whether the chain holds an HTTP/2 reset with REFUSED_STREAM sent by the
/// server.
fn refused_stream(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(error) = source {
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            if h2.is_reset() && h2.is_remote() && h2.reason() == Some(h2::Reason::REFUSED_STREAM) {
                return true;
            }
        }
        source = error.source();
    }
    false
}

/// Whether the chain shows the connection broke after it was made: hyper's
/// incomplete message (closed before the response) or an I/O reset.
fn is_reset(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(error) = source {
        if let Some(hyper) = error.downcast_ref::<hyper::Error>() {
            if hyper.is_incomplete_message() || hyper.is_closed() {
                return true;
            }
        }
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            ) {
                return true;
            }
        }
        source = error.source();
    }
    false
}

fn chain_text(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(error) = source {
        text.push_str(": ");
        text.push_str(&error.to_string());
        source = error.source();
    }
    text.to_lowercase()
}

/// A body that broke off after the headers: PARTIAL_RESPONSE.
fn partial(status: StatusCode, retry_after: String, error: &reqwest::Error) -> Outcome {
    Outcome {
        evidence: pb::Evidence::PartialResponse,
        failure: if error.is_timeout() {
            pb::FailureKind::InterruptedStream
        } else {
            pb::FailureKind::DecodeReset
        },
        http_status: u32::from(status.as_u16()),
        retry_after,
        ..Outcome::default()
    }
}

/// Reads up to `limit` bytes of the body: `(prefix, complete)`, or the
/// error it broke off with.
async fn read_prefix(
    response: &mut Response,
    limit: usize,
) -> Result<(Bytes, bool), reqwest::Error> {
    let mut prefix = BytesMut::new();
    while prefix.len() <= limit {
        match response.chunk().await? {
            Some(chunk) => prefix.extend_from_slice(&chunk),
            None => return Ok((prefix.freeze(), true)),
        }
    }
    Ok((prefix.freeze(), false))
}

fn retry_after(response: &Response) -> String {
    response
        .headers()
        .get(http::header::RETRY_AFTER)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// A response whose status is decided: its body is read (up to the limit)
/// so that the connection can be reused and the body handed back intact.
async fn read_failed(mut response: Response, limit: usize) -> Attempted {
    let status = response.status();
    let retry_after = retry_after(&response);
    let retried_below = lineage::retried_below(response.headers());
    match read_prefix(&mut response, limit).await {
        Err(error) => Attempted::Failed(Failed {
            outcome: partial(status, retry_after, &error),
            response: None,
            error: Some(reqwest_middleware::Error::Reqwest(error)),
            deadline: false,
        }),
        Ok((prefix, complete)) => Attempted::Failed(Failed {
            outcome: Outcome {
                evidence: pb::Evidence::ResponseReceived,
                http_status: u32::from(status.as_u16()),
                retry_after,
                retried_below,
                ..Outcome::default()
            },
            response: Some(rebuilt(response, prefix, complete)),
            error: None,
            deadline: false,
        }),
    }
}

async fn read_successful(mut response: Response, limit: usize) -> Attempted {
    let status = response.status();
    match read_prefix(&mut response, limit).await {
        Err(error) => Attempted::Failed(Failed {
            outcome: partial(status, retry_after(&response), &error),
            response: None,
            error: Some(reqwest_middleware::Error::Reqwest(error)),
            deadline: false,
        }),
        Ok((prefix, complete)) => Attempted::Done(rebuilt(response, prefix, complete)),
    }
}

/// The response with its body replaced by what was read, followed by the
/// rest when it was not read to its end.
fn rebuilt(response: Response, prefix: Bytes, complete: bool) -> Response {
    use reqwest::ResponseBuilderExt;
    let mut builder = http::Response::builder()
        .status(response.status())
        .version(response.version())
        .url(response.url().clone());
    if let Some(headers) = builder.headers_mut() {
        *headers = response.headers().clone();
    }
    let body = if complete {
        reqwest::Body::from(prefix)
    } else {
        let rest = response.bytes_stream();
        reqwest::Body::wrap_stream(
            futures_util::stream::once(async move { Ok(prefix) }).chain(rest),
        )
    };
    match builder.body(body) {
        Ok(rebuilt) => Response::from(rebuilt),
        // Every part came from a valid response; unreachable in practice,
        // and an empty response of the same status is the honest fallback.
        Err(_) => Response::from(http::Response::new(reqwest::Body::from(Bytes::new()))),
    }
}

fn cause_of(failed: &Failed) -> String {
    match (&failed.error, &failed.response) {
        (Some(error), _) => error.to_string(),
        (None, Some(response)) => format!("HTTP {}", response.status()),
        (None, None) => "no response in time".to_owned(),
    }
}

fn ambiguous(
    decision: Decision,
    decisions: Vec<Decision>,
    attempts: u32,
    failed: Failed,
) -> reqwest_middleware::Error {
    lineage::note_dependency_failed();
    reqwest_middleware::Error::middleware(AmbiguousError {
        decision,
        decisions,
        attempts,
        status: (failed.outcome.http_status != 0).then_some(failed.outcome.http_status),
        cause: Some(cause_of(&failed)),
    })
}

fn ended_by_caller(
    request: &pb::DecideRequest,
    failed: Failed,
    mut decisions: Vec<Decision>,
    attempts: u32,
) -> reqwest_middleware::Error {
    lineage::note_dependency_failed();
    match fallback::ended_by_caller(request, true) {
        Some(decision) => {
            decisions.push(decision.clone());
            ambiguous(decision, decisions, attempts, failed)
        }
        None => reqwest_middleware::Error::middleware(CallFailed {
            cause: cause_of(&failed),
            decisions,
            attempts,
            deadline_exceeded: true,
        }),
    }
}

/// No further attempt: the response as it is, or the error. A call whose
/// outcome an earlier attempt left open stays ambiguous.
fn finish(
    failed: Failed,
    decisions: Vec<Decision>,
    attempts: u32,
) -> reqwest_middleware::Result<Response> {
    // No more attempts after a decision: the server's own failed response
    // says so upward, whatever it makes of this one.
    lineage::note_dependency_failed();
    if let Some(open) = decisions
        .iter()
        .rev()
        .find(|decision| decision.unknown_outcome.is_some())
    {
        let decision = decisions.last().cloned().unwrap_or_else(|| open.clone());
        return Err(ambiguous(decision, decisions, attempts, failed));
    }
    match failed.response {
        Some(mut response) => {
            response.extensions_mut().insert(Decisions(decisions));
            Ok(response)
        }
        None => Err(reqwest_middleware::Error::middleware(CallFailed {
            cause: cause_of(&failed),
            decisions,
            attempts,
            deadline_exceeded: false,
        })),
    }
}
