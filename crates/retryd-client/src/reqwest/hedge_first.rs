//! The middleware's hedged first attempt: the request and its hedges run
//! through [`crate::hedge::run`], each copy a clone of the request (a
//! streaming body is never hedged) with its own extensions and its own
//! attempt timeout. A loser's future is dropped: reqwest closes its
//! connection (HTTP/1.1) or resets its stream (HTTP/2).
//!
//! Reporting stays honest: the first attempt's outcome and latency as an
//! unhedged call's (or, cancelled because a hedge won, its latency so far
//! as a success); a hedge that ends on its own counts as an attempt after
//! the first, never as a first attempt; a cancelled one counts nowhere; a
//! hedge that wins counts in `hedges_won`.

use std::time::Duration;

use http::Extensions;
use reqwest::Request;
use reqwest_middleware::Next;
use retryd_proto as pb;
use tokio::time::Instant;

use super::{Attempted, RetryMiddleware};
use crate::adapter;
use crate::client::Error;
use crate::decision::Decision;
use crate::hedge::{self, Copies, Hedged, Plan, Task};
use crate::lineage;

/// What the Decide of a hedge says about the call.
pub(super) struct HedgeCall<'c> {
    pub(super) upstream: &'c str,
    pub(super) operation: String,
    pub(super) idempotency: pb::Idempotency,
    pub(super) body: Option<pb::Body>,
    pub(super) max_attempts: u32,
}

impl RetryMiddleware {
    /// Sends `request` and hedges it as `plan` says; `replay` is the clone
    /// each hedge is copied from.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn hedged_first(
        &self,
        request: Request,
        replay: &Request,
        extensions: &mut Extensions,
        next: Next<'_>,
        deadline: Option<Instant>,
        plan: Plan,
        call: HedgeCall<'_>,
    ) -> Hedged<Attempted> {
        let upstream = call.upstream;
        // Each hedge gets its own copy of what the caller put in them.
        let base = extensions.clone();
        let first: Task<'_, Attempted> =
            Box::pin(self.attempt(request, extensions, next.clone(), deadline));
        let send = |k: u32| -> Option<Task<'_, Attempted>> {
            let mut copy = replay.try_clone()?;
            lineage::set_baggage(copy.headers_mut(), k + 1);
            let mut extensions = base.clone();
            let next = next.clone();
            Some(Box::pin(async move {
                self.attempt(copy, &mut extensions, next, deadline).await
            }))
        };
        let call = &call;
        let decide = |k: u32, sent: u32| -> Task<'_, Result<Decision, Error>> {
            let request = pb::DecideRequest {
                upstream: upstream.to_owned(),
                operation: call.operation.clone(),
                idempotency: call.idempotency as i32,
                body: call.body.clone(),
                attempt: sent,
                hedge: k,
                max_attempts: call.max_attempts,
                ..Default::default()
            };
            Box::pin(async move {
                adapter::decide(&self.client, request, deadline, Duration::ZERO)
                    .await
                    .map(|(_, decision)| decision)
            })
        };
        let ended = |copy: u32, result: &Attempted, elapsed: Duration| {
            if !self.reporting {
                return;
            }
            let success = matches!(result, Attempted::Done(_));
            let reporter = self.client.reporter();
            reporter.record_outcome(upstream, success, copy > 0);
            if copy == 0 {
                reporter.record_latency(upstream, success, elapsed);
            }
        };
        let cancelled_first = |elapsed: Duration| {
            if self.reporting {
                self.client
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
        if self.reporting && hedged.copy > 0 && matches!(hedged.result, Attempted::Done(_)) {
            self.client.reporter().record_hedge_won(upstream);
        }
        hedged
    }
}
