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
//! Linux only (`received/linux.rs`, the one `unsafe` of transport: libc's
//! `setsockopt` and `recvmsg`). On other systems, and where the socket
//! option is refused, the stamp stays unknown and the deadline counts from
//! when retryd read the call, as it did before stamps.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
pub(super) use linux::TimedTcp;
#[cfg(not(target_os = "linux"))]
pub(super) use untimed::TimedTcp;

/// The receive time of a connection's latest read, shared by the reader
/// and the connection's calls. Nanoseconds since the Unix epoch; 0 while
/// unknown.
#[derive(Clone, Debug, Default)]
pub struct ReceivedAt(Arc<AtomicU64>);

impl ReceivedAt {
    /// When the kernel received the latest bytes this connection read, if
    /// it said.
    pub fn get(&self) -> Option<SystemTime> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            nanos => Some(SystemTime::UNIX_EPOCH + Duration::from_nanos(nanos)),
        }
    }

    #[cfg(target_os = "linux")]
    fn set(&self, nanos: u64) {
        self.0.store(nanos, Ordering::Relaxed);
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
