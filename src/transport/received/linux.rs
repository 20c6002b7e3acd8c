//! Reads with the kernel's receive timestamps, on Linux: `SO_TIMESTAMPNS`
//! asked for on each accepted socket, and every read a `recvmsg` whose
//! `SCM_TIMESTAMPNS` control message gives when the kernel received the
//! latest of the bytes returned. The only `unsafe` of transport, all of it
//! libc calls on the socket tokio owns.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, Interest, ReadBuf};
use tokio::net::TcpStream;

use super::ReceivedAt;

/// A TCP stream whose reads note when the kernel received their bytes.
#[derive(Debug)]
pub(in crate::transport) struct TimedTcp {
    stream: TcpStream,
    received: ReceivedAt,
}

impl TimedTcp {
    /// Asks the kernel to stamp `stream`'s segments. Without the option the
    /// stream still works; its calls' deadlines count from the handler.
    pub(in crate::transport) fn new(stream: TcpStream) -> (TimedTcp, ReceivedAt) {
        let enabled: libc::c_int = 1;
        // SAFETY: a valid socket, and a c_int option of the size passed.
        let refused = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_TIMESTAMPNS,
                (&enabled as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        } != 0;
        if refused {
            tracing::debug!(error = %io::Error::last_os_error(), "no receive timestamps on this connection");
        }
        let received = ReceivedAt::default();
        (
            TimedTcp {
                stream,
                received: received.clone(),
            },
            received,
        )
    }

    /// One `recvmsg` into `unfilled`: the bytes read and the receive time
    /// of the latest of them, if the kernel attached it.
    fn receive(&self, unfilled: &mut [MaybeUninit<u8>]) -> io::Result<(usize, Option<u64>)> {
        // Room for one SCM_TIMESTAMPNS control message (a timespec), aligned
        // as cmsghdr needs.
        #[repr(C, align(8))]
        struct Control([u8; 64]);
        let mut control = Control([0; 64]);
        let mut iov = libc::iovec {
            iov_base: unfilled.as_mut_ptr().cast(),
            iov_len: unfilled.len(),
        };
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
        header.msg_iov = &mut iov;
        header.msg_iovlen = 1;
        header.msg_control = control.0.as_mut_ptr().cast();
        header.msg_controllen = control.0.len() as _;
        // SAFETY: the iovec covers `unfilled`, which the kernel only writes
        // (up to its length), and the control buffer outlives the call.
        let read =
            unsafe { libc::recvmsg(self.stream.as_raw_fd(), &mut header, libc::MSG_DONTWAIT) };
        if read < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut stamp = None;
        // SAFETY: walking the control messages the kernel wrote into
        // `control`, with the libc macros that bound them by the header.
        unsafe {
            let mut message = libc::CMSG_FIRSTHDR(&header);
            while !message.is_null() {
                if (*message).cmsg_level == libc::SOL_SOCKET
                    && (*message).cmsg_type == libc::SCM_TIMESTAMPNS
                {
                    let time: libc::timespec =
                        std::ptr::read_unaligned(libc::CMSG_DATA(message).cast());
                    let nanos = u64::try_from(time.tv_sec)
                        .ok()
                        .and_then(|secs| secs.checked_mul(1_000_000_000))
                        .and_then(|nanos| nanos.checked_add(u64::try_from(time.tv_nsec).ok()?));
                    stamp = nanos.filter(|&nanos| nanos > 0);
                }
                message = libc::CMSG_NXTHDR(&header, message);
            }
        }
        Ok((read as usize, stamp))
    }
}

impl AsyncRead for TimedTcp {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            ready!(this.stream.poll_read_ready(cx))?;
            // SAFETY: `receive` only writes the bytes it reports as read,
            // and only those are marked filled below.
            let unfilled = unsafe { buf.unfilled_mut() };
            match this
                .stream
                .try_io(Interest::READABLE, || this.receive(unfilled))
            {
                Ok((read, stamp)) => {
                    if let Some(nanos) = stamp {
                        this.received.set(nanos);
                    }
                    // SAFETY: the kernel wrote `read` bytes at the start.
                    unsafe { buf.assume_init(read) };
                    buf.advance(read);
                    return Poll::Ready(Ok(()));
                }
                // Not readable after all: `try_io` cleared the readiness.
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => return Poll::Ready(Err(error)),
            }
        }
    }
}

delegate_async_write!(TimedTcp, stream);
