//! `RetryDecider`: Decide and DecideStream (ReportTraffic's edge is
//! `report.rs`). Translation only: a request becomes an [`Attempt`], the
//! pipeline (`crate::decide`) decides, the recorder records, and the
//! [`Decided`] becomes a `DecideResponse`. A store that answers at once is
//! decided without an executor (`decide::at_once`), on the same path.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::answer::response;
use super::deadline;
use super::{Live, Service, peer, peer_addr, trace_context, validate};
use crate::auth::Principal;
use crate::budget::BudgetStore;
use crate::decide::Draw;
use crate::pb;
use crate::telemetry::{SpanBatch, TraceContext};
use crate::transport::{Arrival, ReceivedAt};

/// How many stream items may be in flight at once. Responses still leave
/// in request order; the window only lets store round trips overlap.
const STREAM_WINDOW: usize = 32;

/// The methods, as refusals name them in the audit log.
const RPC_DECIDE: &str = "/retryd.v1.RetryDecider/Decide";
const RPC_DECIDE_STREAM: &str = "/retryd.v1.RetryDecider/DecideStream";

impl<S: BudgetStore> Service<S> {
    /// One decision on the configuration `live` the caller loaded (so that
    /// a reload never splits a decision), under the caller's trace context,
    /// recorded either way. `method` is the span's `rpc.method`.
    async fn decide_one(
        &self,
        live: &Live,
        principal: &Principal,
        request: &pb::DecideRequest,
        parent: Option<&TraceContext>,
        method: &'static str,
        batch: Option<&Arc<SpanBatch>>,
    ) -> Result<pb::DecideResponse, Status> {
        let recorder = self.recorder();
        let recording = recorder.start(parent, method);
        let decided = match validate::decide_request(request) {
            Err(invalid) => Err(Status::from(invalid)),
            Ok(attempt) => {
                let draw = Draw::fresh(&attempt);
                let decider = self.decider();
                match decider.begin(live, principal, attempt, draw) {
                    Ok(begun) => decider.decide(begun, recorder).await,
                    Err(refused) => Err(refused),
                }
                .map_err(|refused| self.refusal(refused))
            }
        };
        match decided {
            Ok(decided) => {
                let answer = response(&decided);
                recorder.record(recording, parent, &decided, batch.map(Arc::as_ref));
                Ok(answer)
            }
            Err(status) => {
                recorder.refused_decision(recording, &principal.name, &status);
                Err(status)
            }
        }
    }

    /// [`Service::decide_one`] for a store that answers at once, polled
    /// once without an executor.
    fn decide_one_now(
        &self,
        live: &Live,
        principal: &Principal,
        request: &pb::DecideRequest,
        parent: Option<&TraceContext>,
        method: &'static str,
        batch: Option<&Arc<SpanBatch>>,
    ) -> Result<pb::DecideResponse, Status> {
        crate::decide::at_once(
            self.decide_one(live, principal, request, parent, method, batch),
            || Err(super::status::not_answered_at_once()),
        )
    }

    /// `Err(DEADLINE_EXCEEDED)` once a stream's deadline has passed.
    fn within(&self, deadline: Option<std::time::Instant>) -> Result<(), Status> {
        match deadline {
            Some(deadline) => deadline::expired(deadline, self.recorder().metrics()),
            None => Ok(()),
        }
    }
}

/// The connection a request came on and when the request arrived on it,
/// as the gate noted at its dispatch (from the connection now, for a
/// request that did not pass the gate).
fn arrival<T>(request: &Request<T>) -> Option<(&ReceivedAt, Arrival)> {
    let peer = peer(request)?;
    let arrival = request
        .extensions()
        .get::<Arrival>()
        .copied()
        .unwrap_or_else(|| peer.received.arrival());
    Some((&peer.received, arrival))
}

type DecideResponseStream = Pin<Box<dyn Stream<Item = Result<pb::DecideResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<S: BudgetStore> pb::retry_decider_server::RetryDecider for Service<S> {
    async fn decide(
        &self,
        request: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        // One load of the configuration serves authentication and decision.
        let live = self.live();
        let principal = self.authenticate(&live, &request, RPC_DECIDE)?;
        let arrived = arrival(&request);
        let received = arrived.and_then(|(_, arrival)| arrival.received);
        if let Some(deadline) = deadline::caller_deadline(request.metadata(), received) {
            deadline::still_wanted(deadline, arrived, self.recorder().metrics()).await?;
        }
        let parent = trace_context(request.metadata());
        let (message, parent) = (request.get_ref(), parent.as_ref());
        let answer = if S::ANSWERS_AT_ONCE {
            self.decide_one_now(&live, principal, message, parent, "Decide", None)
        } else {
            self.decide_one(&live, principal, message, parent, "Decide", None)
                .await
        };
        if let Err(status) = &answer {
            let peer = peer_addr(&request);
            self.recorder()
                .audit_refusal(RPC_DECIDE, peer, Some(&principal.name), status);
        }
        answer.map(Response::new)
    }

    type DecideStreamStream = DecideResponseStream;

    async fn decide_stream(
        &self,
        request: Request<Streaming<pb::DecideRequest>>,
    ) -> Result<Response<Self::DecideStreamStream>, Status> {
        // The caller authenticates once for the stream; each item is still
        // checked against the upstreams it may use.
        let principal = Arc::clone(self.authenticate(&self.live(), &request, RPC_DECIDE_STREAM)?);
        // The stream's deadline covers every item: one arriving after it is
        // answered DEADLINE_EXCEEDED in place, and spends nothing.
        let received = arrival(&request).and_then(|(_, arrival)| arrival.received);
        let deadline = deadline::caller_deadline(request.metadata(), received);
        // Every item's span is a child of the stream's trace context.
        let parent = trace_context(request.metadata()).map(Arc::new);
        let peer = peer_addr(&request);
        // Back-pressure from the span exporter and the decision log
        // (telemetry/pace.rs): the next item waits while either queue is
        // over half full.
        // Its items' spans go to the export queue a batch at a time.
        let batch = self.recorder().stream_batch();
        let items = self.recorder().paced(request.into_inner(), batch.clone());
        // A bad item is answered in place, so one caller's mistake does not
        // tear down a shared sidecar stream; a transport error ends it.
        let answered = move |service: &Service<S>,
                             principal: &Principal,
                             answer: Result<pb::DecideResponse, Status>| {
            answer.unwrap_or_else(|status| {
                service.recorder().audit_refusal(
                    RPC_DECIDE_STREAM,
                    peer,
                    Some(&principal.name),
                    &status,
                );
                pb::DecideResponse {
                    error: Some(pb::StreamError {
                        code: status.code() as i32,
                        message: status.message().to_owned(),
                    }),
                    ..pb::DecideResponse::default()
                }
            })
        };
        let service = self.clone();
        let responses: DecideResponseStream = if S::ANSWERS_AT_ONCE {
            // Decided in the stream's own poll, one item after the other:
            // no future per item to box, queue and reorder.
            Box::pin(items.map(move |item| {
                item.map(|request| {
                    let live = service.live();
                    let answer = service.within(deadline).and_then(|()| {
                        service.decide_one_now(
                            &live,
                            &principal,
                            &request,
                            parent.as_deref(),
                            "DecideStream",
                            batch.as_ref(),
                        )
                    });
                    answered(&service, &principal, answer)
                })
            }))
        } else {
            Box::pin(
                items
                    .map(move |item| {
                        let service = service.clone();
                        let parent = parent.clone();
                        let batch = batch.clone();
                        let principal = Arc::clone(&principal);
                        async move {
                            let request = item?;
                            let live = service.live();
                            let answer = match service.within(deadline) {
                                Ok(()) => {
                                    service
                                        .decide_one(
                                            &live,
                                            &principal,
                                            &request,
                                            parent.as_deref(),
                                            "DecideStream",
                                            batch.as_ref(),
                                        )
                                        .await
                                }
                                Err(status) => Err(status),
                            };
                            Ok(answered(&service, &principal, answer))
                        }
                    })
                    .buffered(STREAM_WINDOW),
            )
        };
        Ok(Response::new(responses))
    }

    async fn report_traffic(
        &self,
        request: Request<pb::ReportTrafficRequest>,
    ) -> Result<Response<pb::ReportTrafficResponse>, Status> {
        let traffic = request.get_ref().traffic.clone();
        let answer = self.report_traffic_call(request).await;
        // Per upstream, what this call applied: every entry after those an
        // earlier call with the same report id applied. (A report the store
        // failed midway is counted in the total only: which of its entries
        // landed is in its status message, not in a value.)
        if let Ok(response) = &answer {
            let applied = response.get_ref().already_applied as usize;
            for entry in traffic.iter().skip(applied) {
                self.recorder().reported(&entry.upstream, entry.requests);
            }
        }
        answer
    }
}
