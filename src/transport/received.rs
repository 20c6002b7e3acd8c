//! When the kernel received a connection's bytes.
//!
//! A caller's `grpc-timeout` counts from when it sent the call, but retryd
//! only sees the call when it reads it, which can be much later: while the
//! process was stopped, starved of CPU or paused with its VM, the call sat
//! in the socket. Measured from the read, such a call looks fresh, is
//! decided and spends a token, although its caller gave up long ago. The
//! kernel stamps every segment it receives (`SO_TIMESTAMPNS`, which Linux
//! reports for TCP too), so each read here notes the receive time of the
//! latest segment it returned: a lower bound of how old anything in that
//! read is, never an overestimate. `grpc/deadline.rs` counts the deadline
//! from it.
//!
//! A stamp is the latest read's, so a call takes its own when it is
//! dispatched ([`ReceivedAt::arrival`], in the connection's task right
//! after the read that held its headers): a later read must not make it
//! look younger. The connection's reads are counted too, and each time the
//! reader finds nothing more to read: by then HTTP/2 has processed every
//! frame read so far (it asks for bytes only when its buffer holds no whole
//! frame), resets included. [`ReceivedAt::drained_past`] waits for that.
//!
//! Linux only (`received/linux.rs`, the one `unsafe` of transport: libc's
//! `setsockopt` and `recvmsg`). On other systems, and where the socket
//! option is refused, the stamp stays unknown and the deadline counts from
//! when retryd read the call, as it did before stamps.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use tokio::sync::Notify;

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
pub(super) use linux::TimedTcp;
#[cfg(not(target_os = "linux"))]
pub(super) use untimed::TimedTcp;

/// The receive time of a connection's latest read, and how far its reader
/// has got; shared by the reader and the connection's calls.
#[derive(Clone, Debug, Default)]
pub struct ReceivedAt(Arc<Progress>);

#[derive(Debug, Default)]
struct Progress {
    /// Nanoseconds since the Unix epoch; 0 while unknown.
    stamp: AtomicU64,
    /// Reads that returned bytes.
    reads: AtomicU64,
    /// `reads` when the reader last found nothing more to read.
    drained: AtomicU64,
    /// Calls waiting in [`ReceivedAt::drained_past`]: the reader wakes
    /// them only when there are some, so that a connection nobody waits on
    /// pays one atomic load per empty read.
    waiting: AtomicUsize,
    woken: Notify,
}

/// When a call arrived, as its connection knew at its dispatch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Arrival {
    /// When the kernel received the read that held the call's headers (or a
    /// read before its dispatch), if it said.
    pub received: Option<SystemTime>,
    /// The connection's reads up to the call's dispatch.
    pub reads: u64,
}

impl ReceivedAt {
    /// When the kernel received the latest bytes this connection read, if
    /// it said.
    pub fn get(&self) -> Option<SystemTime> {
        match self.0.stamp.load(Ordering::Relaxed) {
            0 => None,
            nanos => Some(SystemTime::UNIX_EPOCH + Duration::from_nanos(nanos)),
        }
    }

    /// A call's arrival, taken when it is dispatched.
    pub fn arrival(&self) -> Arrival {
        Arrival {
            received: self.get(),
            reads: self.0.reads.load(Ordering::Acquire),
        }
    }

    /// Returns once the connection's reader found nothing more to read
    /// after its first `reads` reads, so that every frame they held, a reset
    /// of the call included, has been processed. A connection that closes
    /// meanwhile leaves the caller waiting: bound the wait (by the call's
    /// deadline).
    pub async fn drained_past(&self, reads: u64) {
        let progress = &self.0;
        if progress.drained.load(Ordering::Acquire) >= reads {
            return;
        }
        // SeqCst here and in `drained`: each side writes one value and then
        // reads the other's, which only a total order makes safe (either
        // the reader sees a waiter, or the waiter sees the drain).
        progress.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&progress.waiting);
        loop {
            let woken = progress.woken.notified();
            tokio::pin!(woken);
            // Registered before the check, so a drain between the check and
            // the wait still wakes it.
            woken.as_mut().enable();
            if progress.drained.load(Ordering::SeqCst) >= reads {
                return;
            }
            woken.await;
        }
    }

    /// The reader read bytes.
    pub(super) fn read(&self) {
        self.0.reads.fetch_add(1, Ordering::AcqRel);
    }

    /// The reader found nothing more to read.
    pub(super) fn drained(&self) {
        let progress = &self.0;
        let reads = progress.reads.load(Ordering::Acquire);
        if progress.drained.swap(reads, Ordering::SeqCst) != reads
            && progress.waiting.load(Ordering::SeqCst) > 0
        {
            progress.woken.notify_waiters();
        }
    }

    #[cfg(target_os = "linux")]
    fn set(&self, nanos: u64) {
        self.0.stamp.store(nanos, Ordering::Relaxed);
    }
}

/// One call waiting for a drain, counted while it waits.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Without kernel receive timestamps: the stream as it is, its stamp
/// always unknown.
#[cfg(not(target_os = "linux"))]
mod untimed {
    use std::io;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::{AsyncRead, ReadBuf};
    use tokio::net::TcpStream;

    use super::ReceivedAt;

    /// A TCP stream whose reads note nothing: this system gives retryd no
    /// receive timestamps.
    #[derive(Debug)]
    pub(in crate::transport) struct TimedTcp {
        stream: TcpStream,
    }

    impl TimedTcp {
        /// `stream`, with a stamp that stays unknown.
        pub(in crate::transport) fn new(stream: TcpStream) -> (TimedTcp, ReceivedAt) {
            (TimedTcp { stream }, ReceivedAt::default())
        }
    }

    impl AsyncRead for TimedTcp {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
        }
    }

    delegate_async_write!(TimedTcp, stream);
}
