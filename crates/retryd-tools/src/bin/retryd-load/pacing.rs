//! When `retryd-load` sends: flat out, or tickets released at a fixed rate
//! by a pacer thread on the OS timer (see the binary's module doc).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Mutex, mpsc};

/// When each request may start. Flat out: as soon as a sender is free. At
/// a rate: when the pacer releases a ticket, which is also where its
/// latency is measured from.
#[derive(Clone)]
pub(crate) enum Tickets {
    FlatOut {
        end: Instant,
    },
    Paced {
        queue: Arc<Mutex<mpsc::UnboundedReceiver<Instant>>>,
        /// Tickets the pacer has released so far: the offered load, which
        /// a slow server cannot change.
        released: Arc<AtomicU64>,
    },
    /// Flat out, until this many tickets, shared by every sender, are gone.
    Counted(Arc<AtomicU64>),
}

impl Tickets {
    /// The next ticket's release time, or `None` once the run is over.
    pub(crate) async fn next(&self) -> Option<Instant> {
        match self {
            Tickets::FlatOut { end } => {
                let now = Instant::now();
                (now < *end).then_some(now)
            }
            Tickets::Paced { queue, .. } => queue.lock().await.recv().await,
            Tickets::Counted(left) => left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
                .then(Instant::now),
        }
    }

    pub(crate) fn is_paced(&self) -> bool {
        matches!(self, Tickets::Paced { .. })
    }

    /// How many tickets a paced run has released (`None` when not paced).
    pub(crate) fn released(&self) -> Option<Arc<AtomicU64>> {
        match self {
            Tickets::Paced { released, .. } => Some(Arc::clone(released)),
            _ => None,
        }
    }
}

/// Releases `rate` tickets per second, evenly spaced, from `start` until
/// `end`, on an OS thread.
pub(crate) fn start_pacer(rate: f64, start: Instant, end: Instant) -> Tickets {
    let (tx, rx) = mpsc::unbounded_channel();
    let released = Arc::new(AtomicU64::new(0));
    let count = Arc::clone(&released);
    std::thread::spawn(move || {
        let interval = Duration::from_secs_f64(1.0 / rate);
        let mut due = start;
        while due < end {
            let now = Instant::now();
            // Everything due is released at once, each with its release
            // time: a late wake-up delays arrivals, it is not latency.
            while due <= now && due < end {
                if tx.send(now).is_err() {
                    return;
                }
                count.fetch_add(1, Ordering::Relaxed);
                due += interval;
            }
            if due > now {
                std::thread::sleep(due - now);
            }
        }
    });
    Tickets::Paced {
        queue: Arc::new(Mutex::new(rx)),
        released,
    }
}
