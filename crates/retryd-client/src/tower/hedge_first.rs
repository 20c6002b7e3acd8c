//! The layer's hedged first attempt: a unary call (its request kept whole
//! for replays) and its hedges run through [`crate::hedge::run`], each copy
//! on its own clone of the inner service with its own attempt timeout. A
//! loser's future is dropped: the channel resets its HTTP/2 stream
//! (RST_STREAM CANCEL), which the upstream's server sees as a cancelled call.
//!
//! Reporting as the middleware's (reqwest/hedge_first.rs): hedges count as
//! attempts after the first, a cancelled copy nowhere, a first attempt
//! cancelled because a hedge won as a success with the time it had run, a
//! hedge that won in `hedges_won`.

use std::time::Duration;

use bytes::Bytes;
use retryd_proto as pb;
use tokio::time::Instant;
use tonic::body::Body;

use super::{Attempted, BoxError, Config, Frames, one_attempt};
use crate::adapter;
use crate::client::Error;
use crate::decision::Decision;
use crate::hedge::{self, Copies, Hedged, Plan, Task};
use crate::{lineage, reporter};

/// What the Decide of a hedge says about the call.
pub(super) struct HedgeCall<'c> {
    pub(super) upstream: &'c str,
    pub(super) operation: &'c str,
    pub(super) idempotency: pb::Idempotency,
    pub(super) max_attempts: u32,
}

fn success(result: &Attempted) -> Option<bool> {
    match result {
        Attempted::Done(_) => Some(true),
        Attempted::Failed { status, .. } => reporter::attempt_succeeded(status.code()),
    }
}

/// Sends `request` on `inner` and hedges it as `plan` says, each hedge a
/// copy of `parts` with the kept `bytes`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn hedged_first<S, ResBody>(
    inner: &mut S,
    config: &Config,
    mut request: http::Request<Body>,
    parts: &http::request::Parts,
    bytes: &Bytes,
    deadline: Option<Instant>,
    plan: Plan,
    call: HedgeCall<'_>,
) -> Hedged<Attempted>
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
    let upstream = call.upstream;
    let template = inner.clone();
    let first: Task<'_, Attempted> =
        Box::pin(async move { one_attempt(inner, config, &mut request, deadline).await });
    // Owned by the closure: a service need not be Sync.
    let send = move |k: u32| -> Option<Task<'_, Attempted>> {
        let mut service = template.clone();
        let mut copy =
            http::Request::from_parts(parts.clone(), Body::new(Frames::new(bytes.clone(), None)));
        lineage::set_baggage(copy.headers_mut(), k + 1);
        Some(Box::pin(async move {
            one_attempt(&mut service, config, &mut copy, deadline).await
        }))
    };
    let call = &call;
    let decide = |k: u32, sent: u32| -> Task<'_, Result<Decision, Error>> {
        let request = pb::DecideRequest {
            upstream: upstream.to_owned(),
            operation: call.operation.to_owned(),
            idempotency: call.idempotency as i32,
            body: Some(pb::Body {
                kind: pb::BodyKind::EncodedValue as i32,
                ..Default::default()
            }),
            attempt: sent,
            hedge: k,
            max_attempts: call.max_attempts,
            ..Default::default()
        };
        Box::pin(async move {
            adapter::decide(&config.client, request, deadline, Duration::ZERO)
                .await
                .map(|(_, decision)| decision)
        })
    };
    let ended = |copy: u32, result: &Attempted, elapsed: Duration| {
        if !config.reporting {
            return;
        }
        // CANCELLED (the caller's own) counts as neither.
        let Some(success) = success(result) else {
            return;
        };
        let reporter = config.client.reporter();
        reporter.record_outcome(upstream, success, copy > 0);
        if copy == 0 {
            reporter.record_latency(upstream, success, elapsed);
        }
    };
    let cancelled_first = |elapsed: Duration| {
        if config.reporting {
            config
                .client
                .reporter()
                .record_latency(upstream, true, elapsed);
        }
    };
    let hedged = hedge::run(
        plan,
        deadline,
        first,
        Copies {
            send,
            decide,
            done: |result: &Attempted| matches!(result, Attempted::Done(_)),
            ended,
            cancelled_first,
            marker: std::marker::PhantomData,
        },
    )
    .await;
    if config.reporting && hedged.copy > 0 && matches!(hedged.result, Attempted::Done(_)) {
        config.client.reporter().record_hedge_won(upstream);
    }
    hedged
}
