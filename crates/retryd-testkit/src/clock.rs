//! tokio's paused clock for tests that talk to real processes.
//!
//! A test on a current-thread runtime calls `tokio::time::pause()`; from
//! then on time moves only when the test says so or, when nothing is ready
//! to run, by jumping to the next timer ("auto-advance"). That makes a
//! timeout fire at exactly its deadline however busy the machine is, which
//! is what a test of "answered within the store timeout" needs.
//!
//! Auto-advance cannot tell "idle" from "waiting for a real Redis to
//! answer", so a paused test talking to a live process would see its
//! timeouts fire before the answer came. [`freeze`] holds the clock still
//! while such I/O is in flight: tokio does not auto-advance while a
//! `spawn_blocking` task runs on a current-thread runtime, so the guard is
//! one blocking task parked until the guard drops. Time then moves only by
//! `tokio::time::advance`, and a loaded machine changes nothing a test
//! measures.

use std::sync::mpsc;

/// While held, a paused clock moves only by `tokio::time::advance`.
#[must_use = "the clock is frozen only while the guard is held"]
pub struct Frozen {
    release: Option<mpsc::Sender<()>>,
}

/// Freezes the paused clock of the current-thread runtime this runs on
/// (on a multi-thread runtime tokio never auto-advances in this way, and
/// `tokio::time::pause` is refused).
pub fn freeze() -> Frozen {
    let (release, wait) = mpsc::channel::<()>();
    // Not awaited: the blocking task ends when the guard drops its sender.
    drop(tokio::task::spawn_blocking(move || {
        let _ = wait.recv();
    }));
    Frozen {
        release: Some(release),
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        self.release.take();
    }
}

/// Lets the runtime run what a timer or a reply woke, without moving the
/// clock: a few yields, since a woken task may wake another.
pub async fn settle() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}
