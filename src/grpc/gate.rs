//! The gate every call passes before anything reads its message: a layer
//! of tonic's server, around every service.
//!
//! - RetryDecider and RetryAdmin calls authenticate here, on the request
//!   headers, and a refused call is answered `UNAUTHENTICATED` (logged for
//!   audit, and an admin call recorded as its span) with its body unread. tonic decodes a unary message before
//!   the handler runs, so authenticating only in the handler let anonymous
//!   peers park half-sent messages in the server's memory. The handlers
//!   still authenticate, on the same configuration snapshot as their
//!   authorization, and keep deciding which upstreams a principal may
//!   touch. A call that authenticates marks its connection as such
//!   (`Standing::authenticated`), which keeps it from eviction and from
//!   `server.authenticate_timeout`.
//! - Every call is counted open on its connection until its response body
//!   ends, for `server.idle_timeout`.
//! - A request message must arrive in full within `server.receive_timeout`
//!   (`ReceiveDeadline`), whatever `server.request_timeout` says: a unary
//!   call's whole body from the call's start, a stream's each message from
//!   its first byte (a stream may wait as long as it likes between
//!   messages).
//!
//! Nothing here allocates per call beyond what tonic already does: the
//! wrapped request body takes the place of the one tonic's router boxes,
//! and the wrapped response body sits inside the one tonic's server boxes;
//! the receive timer is made only when a message is still incomplete when
//! the body has nothing more to give.
//!
//! This module must not decide what a principal may do (that is the
//! handlers', through `auth`), nor read a message.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::time::{Instant, Sleep};
use tonic::body::Body;
use tonic::codegen::http;

use super::{Service, trace_context_of_headers};
use crate::budget::BudgetStore;
use crate::telemetry::{
    Attribute, SPAN_GET_BUDGET, SPAN_LIST_BUDGETS, SPAN_RELOAD_CONFIG, SPAN_SET_RETRIES_ENABLED,
    attr,
};
use crate::transport::{OpenCall, Peer};

/// The services whose calls must authenticate: every one of retryd's own.
/// Health and reflection answer anyone, as they always have.
const AUTHENTICATED_PREFIXES: [&str; 2] = ["/retryd.v1.RetryDecider/", "/retryd.v1.RetryAdmin/"];

/// Methods whose request is a stream of messages with waits in between.
const STREAMING_SUFFIXES: [&str; 2] = ["/DecideStream", "/ServerReflectionInfo"];

/// The gate as a layer of tonic's `Server`.
#[derive(Debug)]
pub(super) struct GateLayer<S> {
    service: Service<S>,
    receive_timeout: Duration,
}

impl<S> Clone for GateLayer<S> {
    fn clone(&self) -> Self {
        GateLayer {
            service: self.service.clone(),
            receive_timeout: self.receive_timeout,
        }
    }
}

impl<S> GateLayer<S> {
    pub(super) fn new(service: Service<S>, receive_timeout: Duration) -> Self {
        GateLayer {
            service,
            receive_timeout,
        }
    }
}

impl<S, I> tower_layer::Layer<I> for GateLayer<S> {
    type Service = Gate<S, I>;

    fn layer(&self, inner: I) -> Gate<S, I> {
        Gate {
            service: self.service.clone(),
            receive_timeout: self.receive_timeout,
            inner,
        }
    }
}

/// The gate around `I`, tonic's routes.
#[derive(Debug)]
pub(super) struct Gate<S, I> {
    service: Service<S>,
    receive_timeout: Duration,
    inner: I,
}

impl<S, I: Clone> Clone for Gate<S, I> {
    fn clone(&self) -> Self {
        Gate {
            service: self.service.clone(),
            receive_timeout: self.receive_timeout,
            inner: self.inner.clone(),
        }
    }
}

impl<S, I> tonic::codegen::Service<http::Request<Body>> for Gate<S, I>
where
    S: BudgetStore,
    I: tonic::codegen::Service<http::Request<ReceiveDeadline>, Response = http::Response<Body>>,
{
    type Response = http::Response<Tracked>;
    type Error = I::Error;
    type Future = Gated<I::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        // Taken now, in the connection's task right after the read that held
        // the call's headers: later reads must not make the call look
        // younger (`grpc/deadline.rs`).
        if let Some(arrival) = request
            .extensions()
            .get::<Peer>()
            .map(|peer| peer.received.arrival())
        {
            request.extensions_mut().insert(arrival);
        }
        let path = request.uri().path();
        let peer = request.extensions().get::<Peer>();
        let call = peer.map(|peer| peer.standing().call_opened());
        if AUTHENTICATED_PREFIXES
            .iter()
            .any(|prefix| path.starts_with(prefix))
        {
            let live = self.service.live();
            let authorization = request
                .headers()
                .get("authorization")
                .map(http::HeaderValue::as_bytes);
            match self
                .service
                .authenticate_caller(&live, authorization, peer, path)
            {
                Ok(_) => {
                    if let Some(peer) = peer {
                        peer.standing().authenticated();
                    }
                }
                Err(status) => {
                    self.record_admin_refusal(&request, path, peer, &status);
                    return Gated::Refused {
                        response: Some(status.into_http()),
                        call,
                    };
                }
            }
        }
        let per_message = STREAMING_SUFFIXES
            .iter()
            .any(|suffix| path.ends_with(suffix));
        let timeout = self.receive_timeout;
        let request = request.map(|body| ReceiveDeadline::new(body, timeout, per_message));
        Gated::Called {
            inner: self.inner.call(request),
            call,
        }
    }
}

impl<S, I> Gate<S, I> {
    /// An admin call refused here is recorded as its span, as the admin
    /// handlers record the refusals they make (whatever the sampling).
    fn record_admin_refusal(
        &self,
        request: &http::Request<Body>,
        path: &str,
        peer: Option<&Peer>,
        status: &tonic::Status,
    ) {
        let name = match path {
            "/retryd.v1.RetryAdmin/GetBudget" => SPAN_GET_BUDGET,
            "/retryd.v1.RetryAdmin/ListBudgets" => SPAN_LIST_BUDGETS,
            "/retryd.v1.RetryAdmin/SetRetriesEnabled" => SPAN_SET_RETRIES_ENABLED,
            "/retryd.v1.RetryAdmin/ReloadConfig" => SPAN_RELOAD_CONFIG,
            _ => return,
        };
        let recorder = self.service.recorder();
        let span = recorder
            .tracer()
            .start_always(trace_context_of_headers(request.headers()).as_ref());
        let peer = peer
            .map(|peer| peer.remote_addr.to_string())
            .unwrap_or_default();
        recorder.finish_failed(
            span,
            name,
            status,
            vec![(attr::PEER, Attribute::Text(peer))],
        );
    }
}

pin_project_lite::pin_project! {
    /// A call's response: refused at the gate, or the routes' answer.
    #[project = GatedProjection]
    pub(super) enum Gated<F> {
        Refused { response: Option<http::Response<Body>>, call: Option<OpenCall> },
        Called { #[pin] inner: F, call: Option<OpenCall> },
    }
}

impl<F, E> Future for Gated<F>
where
    F: Future<Output = Result<http::Response<Body>, E>>,
{
    type Output = Result<http::Response<Tracked>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let (response, call) = match self.project() {
            GatedProjection::Refused { response, call } => (
                // Polled again only after it was ready, which a future's
                // caller must not do; answer with an empty body then.
                response.take().unwrap_or_default(),
                call.take(),
            ),
            GatedProjection::Called { inner, call } => match inner.poll(cx) {
                Poll::Ready(Ok(response)) => (response, call.take()),
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            },
        };
        Poll::Ready(Ok(response.map(|body| Tracked { body, _call: call })))
    }
}

/// A response body that keeps its call counted open until it ends.
#[derive(Debug)]
pub(super) struct Tracked {
    body: Body,
    _call: Option<OpenCall>,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body that fails, ending its call, when a message is not
/// received in full within the receive timeout.
#[derive(Debug)]
pub(super) struct ReceiveDeadline {
    body: Body,
    timeout: Duration,
    /// A stream of messages: each must arrive in full from its first byte;
    /// otherwise the whole body must, from the call's start.
    per_message: bool,
    /// The current message's 5-byte prefix as far as it has come.
    prefix: [u8; 5],
    prefix_read: usize,
    /// Bytes of the current message's payload still to come.
    payload_left: u64,
    /// Since when the body owes bytes, if it does.
    waiting_since: Option<Instant>,
    /// Made the first time the body has nothing to give while it owes.
    timer: Option<Pin<Box<Sleep>>>,
}

impl ReceiveDeadline {
    fn new(body: Body, timeout: Duration, per_message: bool) -> Self {
        ReceiveDeadline {
            body,
            timeout,
            per_message,
            prefix: [0; 5],
            prefix_read: 0,
            payload_left: 0,
            waiting_since: (!per_message).then(Instant::now),
            timer: None,
        }
    }

    /// Follows the gRPC message framing (a flag byte, a 4-byte length,
    /// the payload) through `data`.
    fn advance(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.payload_left > 0 {
                let taken = data
                    .len()
                    .min(usize::try_from(self.payload_left).unwrap_or(usize::MAX));
                self.payload_left -= taken as u64;
                data = &data[taken..];
                continue;
            }
            self.prefix[self.prefix_read] = data[0];
            self.prefix_read += 1;
            data = &data[1..];
            if self.prefix_read == self.prefix.len() {
                let [_, length @ ..] = self.prefix;
                self.payload_left = u64::from(u32::from_be_bytes(length));
                self.prefix_read = 0;
            }
        }
        if self.per_message {
            let mid_message = self.prefix_read > 0 || self.payload_left > 0;
            self.waiting_since = match (mid_message, self.waiting_since) {
                (false, _) => None,
                (true, None) => Some(Instant::now()),
                (true, since) => since,
            };
        }
    }
}

impl HttpBody for ReceiveDeadline {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.advance(data);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.waiting_since = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(status))) => Poll::Ready(Some(Err(status))),
            Poll::Pending => {
                let Some(since) = this.waiting_since else {
                    return Poll::Pending;
                };
                let deadline = since + this.timeout;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
                if timer.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.waiting_since = None;
                Poll::Ready(Some(Err(super::status::deadline_exceeded(
                    "the request message did not arrive in full within server.receive_timeout",
                ))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deadline(per_message: bool) -> ReceiveDeadline {
        ReceiveDeadline::new(Body::empty(), Duration::from_secs(10), per_message)
    }

    #[tokio::test]
    async fn follows_message_framing_across_chunks() {
        let mut stream = deadline(true);
        assert!(stream.waiting_since.is_none(), "a stream may wait to begin");
        // A 3-byte message split inside its prefix, then one whole message.
        stream.advance(&[0, 0, 0]);
        assert!(stream.waiting_since.is_some());
        stream.advance(&[0, 3, b'a', b'b']);
        assert_eq!(stream.payload_left, 1);
        stream.advance(&[b'c', 0, 0, 0, 0, 1, b'd']);
        assert!(stream.waiting_since.is_none(), "both messages complete");
        // A unary body owes bytes from the start until its end.
        let mut unary = deadline(false);
        assert!(unary.waiting_since.is_some());
        unary.advance(&[0, 0, 0, 0, 0]);
        assert!(unary.waiting_since.is_some());
    }
}
