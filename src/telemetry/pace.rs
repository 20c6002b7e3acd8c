//! Back-pressure from the span exporter and the decision log's writer to a
//! DecideStream: before its next item, a stream whose span or log line
//! would find that queue over half full waits until its consumer has made
//! progress, rather than have them dropped a moment later. Whenever the
//! stream has no item ready (it waits, or its caller has sent nothing
//! more), its span batch (`otlp::SpanBatch`) goes to the export queue.
//!
//! Why a stream and not a unary call: one DecideStream decides hundreds of
//! thousands of items a second in one task, so on a busy machine it can
//! outrun the export task or the writer thread (which share the cores with
//! it) and fill their queues; a unary call costs its caller a round trip
//! per decision and has not filled them at any rate measured
//! (BENCHMARKS.md, issue 34). Waiting between items holds no budget and no
//! decision half made: the next item simply stays in the stream's
//! flow-control window a moment longer.
//!
//! The wait is bounded: if the consumer makes no progress within
//! [`STALL`], it cannot keep up (a stalled collector, a hung disk, not a
//! moment's contention), so streams stop waiting for it, and its queue
//! fills and drops, counted and warned as before, until it makes progress
//! again with under half its queue waiting. Every wait is counted
//! (`retryd_span_export_waits_total`, `retryd_decision_log_waits_total`),
//! and a stall warned.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::sync::Notify;

use super::Throttle;

/// How long a stream waits for a consumer's progress at most before the
/// consumer is taken to be stalled.
pub(crate) const STALL: Duration = Duration::from_millis(500);

/// How often at most a stall is warned about.
const STALL_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// A bounded queue whose producer may wait for its consumer.
pub trait Backlog: Send + Sync + std::fmt::Debug + 'static {
    /// At least half the queue is waiting.
    fn over_half(&self) -> bool;
    /// Its consumer's progress, and whether it is taken to be stalled.
    fn room(&self) -> &Room;
    /// Counts a wait in its metric.
    fn count_wait(&self);
}

/// The consumer's side: woken waiters, the stall flag.
#[derive(Debug)]
pub struct Room {
    progress: Notify,
    stalled: AtomicBool,
    stalls: Throttle,
    /// The warning when a wait for it times out.
    warning: &'static str,
}

impl Room {
    /// A room whose stall is warned with `warning`.
    pub fn new(warning: &'static str) -> Room {
        Room {
            progress: Notify::new(),
            stalled: AtomicBool::new(false),
            stalls: Throttle::new(STALL_WARNING_INTERVAL, 1),
            warning,
        }
    }

    /// The consumer made progress, with `over_half` of its queue waiting
    /// or not: waiters look again, and once under half it is keeping up
    /// again (no longer stalled).
    pub fn progressed(&self, over_half: bool) {
        if !over_half {
            self.stalled.store(false, Ordering::Relaxed);
        }
        self.progress.notify_waiters();
    }

    fn stalled(&self) -> bool {
        self.stalled.load(Ordering::Relaxed)
    }
}

/// Whether a producer should wait for `backlog` now.
#[inline]
fn should_wait(backlog: &dyn Backlog) -> bool {
    backlog.over_half() && !backlog.room().stalled()
}

/// A stream of items, each polled only once the queues it feeds have room.
pub struct Paced<S> {
    inner: S,
    /// Empty when neither tracing nor the decision log is on: then a
    /// pass-through.
    backlogs: Vec<Arc<dyn Backlog>>,
    wait: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The stream's span batch, queued whenever the stream has no item
    /// ready: its spans do not wait for the next item.
    spans: Option<Arc<super::SpanBatch>>,
}

impl<S> Paced<S> {
    /// `inner`, paced by `backlogs`, flushing `spans` when it has no item
    /// ready.
    pub(crate) fn new(
        inner: S,
        backlogs: Vec<Arc<dyn Backlog>>,
        spans: Option<Arc<super::SpanBatch>>,
    ) -> Paced<S> {
        Paced {
            inner,
            backlogs,
            wait: None,
            spans,
        }
    }
}

impl<S: Stream + Unpin> Stream for Paced<S> {
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let this = self.get_mut();
        if this.wait.is_none() {
            if let Some(backlog) = this.backlogs.iter().find(|b| should_wait(b.as_ref())) {
                this.wait = Some(Box::pin(room(Arc::clone(backlog))));
            }
        }
        let polled = match &mut this.wait {
            Some(wait) => match wait.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.wait = None;
                    Pin::new(&mut this.inner).poll_next(cx)
                }
                Poll::Pending => Poll::Pending,
            },
            None => Pin::new(&mut this.inner).poll_next(cx),
        };
        if !matches!(polled, Poll::Ready(Some(_))) {
            if let Some(spans) = &this.spans {
                spans.flush();
            }
        }
        polled
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

/// Waits until `backlog`'s consumer makes progress, or [`STALL`] passed
/// with none (then marks it stalled, and warns). The stream looks at the
/// queues again after: it may wait again.
async fn room(backlog: Arc<dyn Backlog>) {
    backlog.count_wait();
    let room = backlog.room();
    let notified = room.progress.notified();
    tokio::pin!(notified);
    // Registered before the queue is looked at again, so that progress
    // made in between is not missed.
    notified.as_mut().enable();
    if !should_wait(backlog.as_ref()) {
        return;
    }
    if tokio::time::timeout(STALL, notified).await.is_err() {
        room.stalled.store(true, Ordering::Relaxed);
        room.stalls.log(|suppressed| {
            tracing::warn!(suppressed, "{}", room.warning);
        });
    }
}
