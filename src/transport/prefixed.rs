//! Bytes already read from a connection, served again before the rest.
//!
//! The acceptor reads the HTTP/2 preface itself, so that a peer that is
//! not speaking HTTP/2 is closed within the handshake deadline; the HTTP/2
//! server must then still read that preface. [`PrefixedIo`] serves those
//! bytes first and then reads the inner IO; writes go to the inner IO
//! unchanged. It knows nothing of HTTP/2: any prefix, any IO.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::{AsyncRead, ReadBuf};

/// An IO whose reads return `prefix` before anything of the inner IO.
#[derive(Debug)]
pub(crate) struct PrefixedIo<T> {
    /// What is still to be served; empty once it all has been.
    prefix: Bytes,
    io: T,
}

impl<T> PrefixedIo<T> {
    /// `io`, whose first reads return `prefix`. A read returns bytes of
    /// the prefix or of `io`, never both, so no read waits on `io` while
    /// prefix bytes are left.
    pub(crate) fn new(prefix: impl Into<Bytes>, io: T) -> PrefixedIo<T> {
        PrefixedIo {
            prefix: prefix.into(),
            io,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for PrefixedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.prefix.is_empty() {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        let served = this.prefix.len().min(buf.remaining());
        buf.put_slice(&this.prefix.split_to(served));
        Poll::Ready(Ok(()))
    }
}

delegate_async_write!(impl<T> PrefixedIo<T>, io);

#[cfg(test)]
mod tests {
    use std::io::IoSlice;

    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    use super::*;

    #[tokio::test]
    async fn the_prefix_is_read_first_then_the_inner_io() {
        let mut io = PrefixedIo::new(&b"PRI * "[..], &b"HTTP/2.0"[..]);
        let mut read = Vec::new();
        io.read_to_end(&mut read).await.unwrap();
        assert_eq!(read, b"PRI * HTTP/2.0");
    }

    #[tokio::test]
    async fn a_small_buffer_takes_the_prefix_in_pieces_and_never_mixes_it_with_the_inner_io() {
        let mut io = PrefixedIo::new(&b"abc"[..], &b"def"[..]);
        let mut reads = Vec::new();
        loop {
            let mut buf = [0; 2];
            let n = io.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            reads.push(buf[..n].to_vec());
        }
        assert_eq!(reads, [&b"ab"[..], b"c", b"de", b"f"]);
    }

    #[tokio::test]
    async fn a_full_buffer_loses_no_prefix_byte() {
        let mut io = PrefixedIo::new(&b"abc"[..], &b""[..]);
        let mut full = [0; 0];
        assert_eq!(io.read(&mut full).await.unwrap(), 0);
        let mut read = Vec::new();
        io.read_to_end(&mut read).await.unwrap();
        assert_eq!(read, b"abc");
    }

    #[tokio::test]
    async fn an_empty_prefix_reads_the_inner_io_alone() {
        let mut io = PrefixedIo::new(Bytes::new(), &b"def"[..]);
        let mut read = Vec::new();
        io.read_to_end(&mut read).await.unwrap();
        assert_eq!(read, b"def");
    }

    #[tokio::test]
    async fn writes_go_to_the_inner_io_while_the_prefix_is_unread() {
        let (mut peer, inner) = duplex(64);
        let mut io = PrefixedIo::new(&b"hello "[..], inner);
        io.write_all(b"first").await.unwrap();
        let written = io
            .write_vectored(&[IoSlice::new(b", then"), IoSlice::new(b" more")])
            .await
            .unwrap();
        assert!(written > 0);
        io.flush().await.unwrap();
        let mut received = vec![0; 5 + written];
        peer.read_exact(&mut received).await.unwrap();
        assert_eq!(received, &b"first, then more"[..received.len()]);

        peer.write_all(b"world").await.unwrap();
        drop(peer);
        let mut read = Vec::new();
        io.read_to_end(&mut read).await.unwrap();
        assert_eq!(read, b"hello world");
    }
}
