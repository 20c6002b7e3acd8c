//! Accepting connections: the bounds on how many are open, the deadlines
//! for saying something, authenticating and staying busy, TLS, and who the
//! client certificate names.
//!
//! At most `server.max_connections` are open at once, and
//! `server.max_connections_per_address` from one IP address; at a bound a
//! newcomer takes the place of a connection that has not authenticated, or
//! one that is idle, and is closed at once only when every connection is
//! authenticated and busy (the registry, `standing.rs`). A connection must
//! finish its TLS handshake and send the HTTP/2 preface within
//! `server.handshake_timeout`, then (with `[auth]`) make a call that
//! authenticates within `server.authenticate_timeout`, and it is closed
//! after `server.idle_timeout` with no call open: an HTTP/2 connection
//! with no stream otherwise lives as long as it answers PINGs, so anonymous
//! peers could hold every place. An accept error such as EMFILE repeats at
//! once, so the loop backs off instead of spinning.
//!
//! TLS is done here rather than by tonic so that the client certificate is
//! parsed once per connection, not once per call, and from its leaf alone:
//! the other certificates a client sends are not verified by the handshake,
//! so they vouch for nothing.
//!
//! This module must not decide who may do what: it hands [`Peer`] to the
//! handlers, which ask `auth`, and the request path tells the connection's
//! [`Standing`] that a call authenticated.

mod standing;

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

use super::prefixed::PrefixedIo;
use super::received::{ReceivedAt, TimedTcp};
use super::tls;
use crate::auth::certificate_identities;
use crate::config::{InvalidConfig, ServerLimits, TlsConfig};
use crate::telemetry::Throttle;
use standing::{Deadlines, Full, Registry, Slot};
pub use standing::{OpenCall, Standing};

/// What every HTTP/2 client sends first (RFC 9113, section 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// File descriptors kept for what is not a gRPC connection (the metrics
/// port and its scrapes, Redis, the span exporter, logs).
const RESERVED_FILES: u64 = 64;

/// How long the accept loop waits after an error that repeats at once
/// (out of file descriptors or memory).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Longest the accept loop waits for evicted connections to close before
/// it closes the newcomer instead: they close as soon as their tasks run,
/// so only a stalled process waits this long.
const EVICTION_WAIT: Duration = Duration::from_secs(1);

/// At most one warning per this interval for shed connections and accept
/// errors: a flood must not become a flood of log lines.
const WARN_INTERVAL: Duration = Duration::from_secs(10);

/// Who is at the other end of a connection: a request extension, set once
/// per connection.
#[derive(Clone, Debug)]
pub struct Peer {
    /// The client's address.
    pub remote_addr: SocketAddr,
    /// The identities the client certificate's leaf vouches for (see
    /// [`certificate_identities`]); `None` without TLS or without a client
    /// certificate.
    pub identities: Option<Arc<[String]>>,
    /// When the kernel received the bytes the connection read last.
    pub received: ReceivedAt,
    /// Where the connection stands: whether a call authenticated, how many
    /// are open.
    standing: Arc<Standing>,
}

impl Peer {
    /// Where the connection stands, for the request path to update.
    pub fn standing(&self) -> &Arc<Standing> {
        &self.standing
    }

    /// The identities of the client certificate, empty without one.
    pub fn identities(&self) -> &[String] {
        self.identities.as_deref().unwrap_or_default()
    }
}

/// Accepts connections under the configured bound, deadline and TLS.
#[derive(Clone)]
pub struct Acceptor {
    tls: Option<tokio_rustls::TlsAcceptor>,
    handshake_timeout: Duration,
    max_connections: usize,
    max_connections_per_address: usize,
    authenticate_timeout: Duration,
    idle_timeout: Duration,
}

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acceptor")
            .field("tls", &self.tls.is_some())
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_connections", &self.max_connections)
            .field(
                "max_connections_per_address",
                &self.max_connections_per_address,
            )
            .field("authenticate_timeout", &self.authenticate_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

impl Acceptor {
    /// An acceptor for `limits`, with TLS if `tls` is given. Parses every
    /// certificate and key, so that a bad PEM is refused, naming its key,
    /// before any port is bound.
    pub fn try_new(
        tls: Option<&TlsConfig>,
        limits: &ServerLimits,
    ) -> Result<Acceptor, InvalidConfig> {
        let tls = tls
            .map(|tls| tls::server_config(tls).map(|config| Arc::new(config).into()))
            .transpose()?;
        Ok(Acceptor {
            tls,
            handshake_timeout: limits.handshake_timeout,
            max_connections: within_file_limit(limits.max_connections),
            max_connections_per_address: limits.max_connections_per_address,
            authenticate_timeout: limits.authenticate_timeout,
            idle_timeout: limits.idle_timeout,
        })
    }

    /// The bound on open connections, after fitting it to the file limit.
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// Accepts from `listener` until the returned stream is dropped, handing
    /// over each connection once it has finished its handshake.
    /// `calls_authenticate` says, as each connection is handed over, whether
    /// calls need a credential (`[auth]` names a principal), and so whether
    /// `server.authenticate_timeout` applies to it.
    pub fn incoming(
        self,
        listener: TcpListener,
        calls_authenticate: impl Fn() -> bool + Send + Sync + 'static,
    ) -> ReceiverStream<Result<Connection, Infallible>> {
        // A short queue: connections wait in it only while tonic is busy
        // taking the previous one.
        let (sender, receiver) = mpsc::channel(64);
        tokio::spawn(accept_loop(
            listener,
            self,
            Arc::new(calls_authenticate),
            sender,
        ));
        ReceiverStream::new(receiver)
    }

    /// The TLS handshake (if any) and the HTTP/2 preface, which the caller
    /// bounds in time. The IO returned serves the preface again first, for
    /// the HTTP/2 server.
    async fn handshake(
        &self,
        stream: TcpStream,
        remote_addr: SocketAddr,
        standing: Arc<Standing>,
    ) -> io::Result<(PrefixedIo<Io>, Peer)> {
        // Without it, Nagle's algorithm held a response's last small segment
        // until the caller's delayed ACK: a 40 ms tail on a share of calls.
        stream.set_nodelay(true)?;
        let (stream, received) = TimedTcp::new(stream);
        let (mut io, identities) = match &self.tls {
            None => (Io::Plain(stream), None),
            Some(tls) => {
                let stream = tls.accept(stream).await?;
                // The leaf is the only certificate the handshake verified.
                let identities = stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|chain| chain.first())
                    .map(|leaf| Arc::from(certificate_identities(leaf.as_ref())));
                (Io::Tls(Box::new(stream)), identities)
            }
        };
        let mut preface = [0; PREFACE.len()];
        io.read_exact(&mut preface).await?;
        if &preface != PREFACE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not an HTTP/2 connection preface",
            ));
        }
        Ok((
            PrefixedIo::new(&PREFACE[..], io),
            Peer {
                remote_addr,
                identities,
                received,
                standing,
            },
        ))
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: Acceptor,
    calls_authenticate: Arc<dyn Fn() -> bool + Send + Sync>,
    sender: mpsc::Sender<Result<Connection, Infallible>>,
) {
    let registry = Arc::new(Registry::new(
        acceptor.max_connections,
        acceptor.max_connections_per_address,
    ));
    let acceptor = Arc::new(acceptor);
    let shed = Throttle::new(WARN_INTERVAL, 1);
    let evicting = Throttle::new(WARN_INTERVAL, 1);
    let failed = Throttle::new(WARN_INTERVAL, 1);
    loop {
        let accepted = tokio::select! {
            // The server stopped taking connections: stop accepting, which
            // closes the port.
            () = sender.closed() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, remote_addr) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                failed.log(|suppressed| {
                    tracing::warn!(%error, suppressed, "cannot accept a connection");
                });
                if is_exhaustion(&error) {
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
                continue;
            }
        };
        let slot = match admit(&registry, remote_addr.ip()).await {
            Ok(slot) => {
                if let Some(full) = slot.made_room() {
                    evicting.log(|suppressed| {
                        tracing::warn!(
                            max_connections = acceptor.max_connections,
                            max_connections_per_address = acceptor.max_connections_per_address,
                            bound = ?full,
                            suppressed,
                            "connection bound reached (server.max_connections or server.max_connections_per_address): closing unauthenticated or idle connections to make room"
                        );
                    });
                }
                slot
            }
            Err(full) => {
                drop(stream);
                shed.log(|suppressed| match full {
                    Full::Connections => tracing::warn!(
                        max_connections = acceptor.max_connections,
                        %remote_addr,
                        suppressed,
                        "too many open connections (server.max_connections), all authenticated and busy: closing new ones"
                    ),
                    Full::Evicting => tracing::warn!(
                        %remote_addr,
                        suppressed,
                        "connections evicted to make room are slow to close: closing new ones"
                    ),
                    Full::Address => tracing::warn!(
                        max_connections_per_address = acceptor.max_connections_per_address,
                        %remote_addr,
                        suppressed,
                        "too many open connections from one address (server.max_connections_per_address), all authenticated and busy: closing new ones"
                    ),
                });
                continue;
            }
        };
        let acceptor = Arc::clone(&acceptor);
        let calls_authenticate = Arc::clone(&calls_authenticate);
        let sender = sender.clone();
        tokio::spawn(async move {
            let deadline = acceptor.handshake_timeout;
            let standing = Arc::clone(slot.standing());
            let handshake = tokio::time::timeout(deadline, async {
                // A caller speaks at once (a TLS ClientHello, the HTTP/2
                // preface); a connection that does not goes first when
                // room must be made.
                stream.readable().await?;
                slot.spoke();
                acceptor
                    .handshake(stream, remote_addr, Arc::clone(&standing))
                    .await
            });
            // Evicted to make room while still handshaking: dropping the
            // handshake closes the socket.
            let evicted = std::future::poll_fn(|cx| standing.poll_closing(cx));
            let handshaken = tokio::select! {
                handshaken = handshake => handshaken,
                () = evicted => {
                    tracing::debug!(%remote_addr, "connection evicted during its handshake");
                    return;
                }
            };
            match handshaken {
                Ok(Ok((io, peer))) => {
                    standing.handshake_done();
                    let deadlines = Deadlines {
                        authenticate: calls_authenticate().then_some(acceptor.authenticate_timeout),
                        idle: acceptor.idle_timeout,
                    };
                    let ready = Instant::now();
                    let connection = Connection {
                        io,
                        peer,
                        ready,
                        deadlines,
                        // The first check: at the authentication deadline
                        // or after an idle period, whichever comes first.
                        watch: Box::pin(tokio::time::sleep_until(ready)),
                        _slot: slot,
                    };
                    // Fails only when the server has stopped.
                    let _ = sender.send(Ok(connection)).await;
                }
                Ok(Err(error)) => {
                    tracing::debug!(%error, %remote_addr, "connection closed during its handshake");
                }
                Err(_) => {
                    tracing::debug!(%remote_addr, ?deadline, "connection closed: no handshake in time (server.handshake_timeout)");
                }
            }
        });
    }
}

/// Admits a connection from `remote_ip`: while the connections evicted to
/// make room have yet to close, waits for them (new connections wait in
/// the kernel's queue meanwhile), up to [`EVICTION_WAIT`].
async fn admit(registry: &Arc<Registry>, remote_ip: std::net::IpAddr) -> Result<Slot, Full> {
    let deadline = Instant::now() + EVICTION_WAIT;
    loop {
        match registry.admit(remote_ip) {
            Err(Full::Evicting) => {
                if tokio::time::timeout_at(deadline, registry.evicted())
                    .await
                    .is_err()
                {
                    return Err(Full::Evicting);
                }
            }
            admitted => return admitted,
        }
    }
}

/// Errors that `accept` returns again at once until something is closed:
/// out of descriptors (the process's or the system's), of socket buffers,
/// or of memory. The numbers are libc's, which differ between systems
/// (ENOBUFS is 105 on Linux, 55 on the BSDs and macOS); std names ENOMEM
/// alone among them, as `OutOfMemory`.
fn is_exhaustion(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS)
    ) || error.kind() == io::ErrorKind::OutOfMemory
}

/// `wanted`, lowered so that the open connections and what else the
/// process needs fit under its file limit: past it, `accept` fails for
/// everyone, legitimate callers included.
fn within_file_limit(wanted: usize) -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let Some(files) = limit.current else {
        return wanted;
    };
    let fitting =
        usize::try_from(files.saturating_sub(RESERVED_FILES).max(1)).unwrap_or(usize::MAX);
    if fitting < wanted {
        tracing::warn!(
            max_connections = wanted,
            file_limit = files,
            lowered_to = fitting,
            "server.max_connections does not fit the file limit (ulimit -n): lowered"
        );
        fitting
    } else {
        wanted
    }
}

/// An accepted connection, past its handshake, holding its place until it
/// closes. The preface it already sent is read again first, by the HTTP/2
/// server ([`PrefixedIo`]).
///
/// It closes itself: a read returns end of file, and a write an error,
/// once it is evicted or past a deadline, and the HTTP/2 server, which
/// always has a read or a flush pending, then drops it. The deadlines are
/// one timer per connection, polled by that read, so they cost nothing per
/// call.
pub struct Connection {
    io: PrefixedIo<Io>,
    peer: Peer,
    /// When its handshake finished.
    ready: Instant,
    deadlines: Deadlines,
    /// Fires when a deadline may have passed.
    watch: Pin<Box<Sleep>>,
    _slot: Slot,
}

impl Connection {
    /// Whether the connection is to close now; else arranges for the
    /// reading task to be woken when that may change.
    fn is_closing(&mut self, cx: &mut Context<'_>) -> bool {
        let standing = &self.peer.standing;
        if standing.poll_closing(cx).is_ready() {
            return true;
        }
        while self.watch.as_mut().poll(cx).is_ready() {
            match standing.next_check(Instant::now(), self.ready, self.deadlines) {
                Some(next) => self.watch.as_mut().reset(next),
                None => return true,
            }
        }
        false
    }
}

impl tonic::transport::server::Connected for Connection {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.peer.clone()
    }
}

enum Io {
    Plain(TimedTcp),
    Tls(Box<TlsStream<TimedTcp>>),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Io::Tls(stream) => Pin::new(stream).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Io::Tls(stream) => Pin::new(stream).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Io::Tls(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(stream) => stream.is_write_vectored(),
            Io::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Io::Tls(stream) => Pin::new(stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Io::Tls(stream) => Pin::new(stream).poll_shutdown(cx),
        }
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.is_closing(cx) {
            // End of file: HTTP/2 ends the connection as if the peer had.
            return Poll::Ready(Ok(()));
        }
        // Counted here, above TLS, where HTTP/2 reads: its asking again and
        // finding nothing means it processed every frame read before.
        let filled = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        match &read {
            Poll::Ready(Ok(())) if buf.filled().len() > filled => this.peer.received.read(),
            Poll::Pending => this.peer.received.drained(),
            _ => {}
        }
        read
    }
}

/// The error a write gets once the connection is to close: a peer that
/// reads nothing can leave the HTTP/2 server waiting to flush, and then it
/// never reads the end of file that `poll_read` gives, so writes end the
/// connection too.
fn closed_for_writing() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "connection closed by the server (evicted, or past a deadline)",
    )
}

impl AsyncWrite for Connection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.is_closing(cx) {
            return Poll::Ready(Err(closed_for_writing()));
        }
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.is_closing(cx) {
            return Poll::Ready(Err(closed_for_writing()));
        }
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.is_closing(cx) {
            return Poll::Ready(Err(closed_for_writing()));
        }
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhaustion_is_told_by_this_systems_numbers() {
        for exhausted in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert!(
                is_exhaustion(&io::Error::from_raw_os_error(exhausted)),
                "{exhausted}"
            );
        }
        assert!(is_exhaustion(&io::ErrorKind::OutOfMemory.into()));
        // A peer that gave up before its connection was accepted: the next
        // accept succeeds, so no backoff.
        for passing in [libc::ECONNABORTED, libc::ECONNRESET, libc::EINTR] {
            assert!(
                !is_exhaustion(&io::Error::from_raw_os_error(passing)),
                "{passing}"
            );
        }
    }
}
