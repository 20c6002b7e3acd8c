//! Back-pressure from the span exporter to a DecideStream: before its next
//! item, a stream whose spans would find the export queue over half full
//! waits until the export task has drained it below half, rather than
//! have its spans dropped a moment later.
//!
//! Why a stream and not a unary call: one DecideStream decides hundreds of
//! thousands of items a second in one task, so on a busy machine it can
//! outrun the export task (which shares the cores with it) and fill the
//! queue; a unary call costs its caller a round trip per decision and has
//! not filled it at any rate measured (BENCHMARKS.md, issue 34). Waiting
//! between items holds no budget and no decision half made: the next item
//! simply stays in the stream's flow-control window a moment longer.
//!
//! The wait is bounded: if the export task makes no progress (no batch on
//! its way) within [`STALL`], the exporter cannot keep up (a stalled
//! collector, not a moment's contention), so streams stop waiting, and the
//! queue fills and drops, counted and warned as before, until the task
//! makes progress again with under half the queue waiting. Every wait
//! is counted (`retryd_span_export_waits_total`), and a stall warned.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures::Stream;

use super::otlp::Pipeline;

/// How long a stream waits for room at most before the exporter is taken
/// to be stalled.
pub(crate) const STALL: Duration = Duration::from_millis(500);

/// A stream of items, each polled only once the span export queue has room.
pub struct Paced<S> {
    inner: S,
    /// `None` when tracing is off: then a pass-through.
    pipeline: Option<Arc<Pipeline>>,
    wait: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl<S> Paced<S> {
    pub(super) fn new(inner: S, pipeline: Option<Arc<Pipeline>>) -> Paced<S> {
        Paced {
            inner,
            pipeline,
            wait: None,
        }
    }
}

impl<S: Stream + Unpin> Stream for Paced<S> {
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let this = self.get_mut();
        if let Some(pipeline) = &this.pipeline {
            if this.wait.is_none() && pipeline.backlogged() {
                this.wait = Some(Box::pin(room(Arc::clone(pipeline))));
            }
            if let Some(wait) = &mut this.wait {
                ready!(wait.as_mut().poll(cx));
                this.wait = None;
            }
        }
        Pin::new(&mut this.inner).poll_next(cx)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

/// Waits until the export task makes progress, or [`STALL`] passed with
/// none (then marks the exporter stalled, and warns). The stream looks at
/// the queue again after: it may wait again.
async fn room(pipeline: Arc<Pipeline>) {
    pipeline
        .metrics
        .span_export_waits
        .fetch_add(1, Ordering::Relaxed);
    let room = Arc::clone(&pipeline.room);
    let notified = room.notified();
    tokio::pin!(notified);
    // Registered before the queue is looked at again, so that progress
    // made in between is not missed.
    notified.as_mut().enable();
    if !pipeline.backlogged() {
        return;
    }
    if tokio::time::timeout(STALL, notified).await.is_err() {
        pipeline.stalled.store(true, Ordering::Relaxed);
        pipeline.stalls.log(|suppressed| {
            tracing::warn!(
                suppressed,
                "the span exporter is not keeping up: DecideStreams no longer wait for it, and spans are dropped when its queue is full (retryd_spans_dropped_total)"
            );
        });
    }
}
