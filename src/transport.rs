//! Transport: the gRPC port below HTTP/2. Accepting connections under
//! their bounds and deadlines (`connections.rs`, each connection's standing
//! in `connections/standing.rs`), the TLS handshake (the server's rustls
//! configuration in `tls.rs`), the HTTP/2 preface (read again by the HTTP/2
//! server through `prefixed.rs`), who a client certificate names
//! ([`Peer`]), and when the kernel received a connection's bytes
//! (`received.rs`, Linux only). It hands tonic connections ready for
//! HTTP/2; what a call means is `grpc`'s.
//!
//! Architecture Invariant: transport knows bytes, sockets, TLS, peers and
//! the deadlines of connections only. It never imports `crate::grpc`,
//! `crate::decide`, the engine or the budget store: the edge depends on
//! transport, never the reverse, and what transport needs from above (such
//! as whether calls must authenticate) is passed in as a plain value or a
//! closure.

/// `AsyncWrite` for a wrapper that changes only how it reads: every write
/// goes to `$field` unchanged. Used by the connection types (`received.rs`,
/// `prefixed.rs`); a generic wrapper names its type parameters first
/// (`impl<T> Wrapper<T>`), each of which must then be `AsyncWrite + Unpin`.
macro_rules! delegate_async_write {
    // `impl` first: a type may start with it too, so the plain arm would
    // take it for one.
    (impl<$($param:ident),+> $wrapper:ty, $field:ident) => {
        delegate_async_write!(@impl [$($param: tokio::io::AsyncWrite + Unpin),+] $wrapper, $field);
    };
    ($wrapper:ty, $field:ident) => {
        delegate_async_write!(@impl [] $wrapper, $field);
    };
    (@impl [$($generics:tt)*] $wrapper:ty, $field:ident) => {
        impl<$($generics)*> tokio::io::AsyncWrite for $wrapper {
            fn poll_write(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                tokio::io::AsyncWrite::poll_write(
                    std::pin::Pin::new(&mut self.get_mut().$field),
                    cx,
                    buf,
                )
            }

            fn poll_write_vectored(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                tokio::io::AsyncWrite::poll_write_vectored(
                    std::pin::Pin::new(&mut self.get_mut().$field),
                    cx,
                    bufs,
                )
            }

            fn is_write_vectored(&self) -> bool {
                tokio::io::AsyncWrite::is_write_vectored(&self.$field)
            }

            fn poll_flush(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                tokio::io::AsyncWrite::poll_flush(
                    std::pin::Pin::new(&mut self.get_mut().$field),
                    cx,
                )
            }

            fn poll_shutdown(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                tokio::io::AsyncWrite::poll_shutdown(
                    std::pin::Pin::new(&mut self.get_mut().$field),
                    cx,
                )
            }
        }
    };
}

mod connections;
mod prefixed;
mod received;
mod tls;

pub use connections::{Acceptor, Connection, OpenCall, Peer, Standing};
pub use received::{Arrival, ReceivedAt};
