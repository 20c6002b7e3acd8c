//! Anonymous peers holding the connection bound, against the real binary
//! (issue 29, findings 1, 2 and 6): idle HTTP/2 connections, silent TCP
//! connections and half-sent request messages from callers without
//! credentials must not keep a credentialed caller out, nor make the
//! server buffer what they send; metrics connections must not take the
//! gRPC port's file descriptors.
//!
//! Attackers and callers are all on 127.0.0.1, so no per-address limit
//! lets the caller in: eviction of connections that have not
//! authenticated does. Every server runs at the default timeouts.

use retryd_testkit as support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use retryd_proto as pb;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use support::{HANG_GUARD, Server, retryable};
use tokio::net::TcpStream;
use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

const CHECKOUT_KEY: &str = "checkout-key-0123456789";
/// The connection bound of these servers: small, so that a test can hold
/// more than all of it.
const MAX_CONNECTIONS: usize = 32;
/// Attacker connections held at once: the bound and half as many again.
const ATTACKERS: usize = 48;
/// Credentialed callers that must get in, each on a new connection.
const CALLERS: usize = 10;

fn sha(key: &str) -> String {
    retryd::auth::hash_key(key)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Two principals: checkout by API key, ops by client certificate.
fn principals() -> String {
    format!(
        "[[auth.principals]]\nname = \"checkout\"\napi_keys_sha256 = [\"{}\"]\nupstreams = [\"payments\"]\n\n[[auth.principals]]\nname = \"ops\"\nidentities = [\"ops.example\"]\nupstreams = [\"*\"]\n",
        sha(CHECKOUT_KEY)
    )
}

/// A CA, a server certificate for localhost and a client certificate for
/// ops.example, as PEM.
struct Pki {
    ca: String,
    server: (String, String),
    client: (String, String),
}

fn pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    Pki {
        ca,
        server: leaf("localhost"),
        client: leaf("ops.example"),
    }
}

/// How the server is reached and how a credentialed caller proves itself.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// Plain HTTP/2, API keys.
    Plain,
    /// TLS without client certificates, API keys.
    Tls,
    /// mTLS with `client_auth = "optional"`: API keys or certificates.
    MtlsOptional,
    /// mTLS with `client_auth = "required"`: certificates only.
    MtlsRequired,
}

struct Setup {
    server: Server,
    pki: Arc<Pki>,
    mode: Mode,
    _dir: tempfile::TempDir,
}

fn start(mode: Mode) -> Setup {
    let pki = Arc::new(pki());
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let tls = match mode {
        Mode::Plain => String::new(),
        Mode::Tls => format!(
            "[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
            write("server.pem", &pki.server.0),
            write("server.key", &pki.server.1),
        ),
        Mode::MtlsOptional | Mode::MtlsRequired => format!(
            "[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_ca_file = \"{}\"\nclient_auth = \"{}\"\n",
            write("server.pem", &pki.server.0),
            write("server.key", &pki.server.1),
            write("ca.pem", &pki.ca),
            if mode == Mode::MtlsRequired {
                "required"
            } else {
                "optional"
            },
        ),
    };
    let server = Server::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\nmax_connections = {MAX_CONNECTIONS}\n{tls}\n{}",
        principals()
    ));
    Setup {
        server,
        pki,
        mode,
        _dir: dir,
    }
}

impl Setup {
    fn endpoint(&self, identity: bool) -> Endpoint {
        let scheme = if self.mode == Mode::Plain {
            "http"
        } else {
            "https"
        };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{}", self.server.grpc))
            .unwrap()
            .connect_timeout(HANG_GUARD);
        if self.mode == Mode::Plain {
            return endpoint;
        }
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.pki.ca))
            .domain_name("localhost");
        if identity {
            tls = tls.identity(Identity::from_pem(&self.pki.client.0, &self.pki.client.1));
        }
        endpoint.tls_config(tls).unwrap()
    }

    /// A credentialed caller on a new connection: its answer to one Decide.
    async fn caller(&self) -> Result<Channel, tonic::Status> {
        let certificate = matches!(self.mode, Mode::MtlsRequired);
        let channel = self
            .endpoint(certificate)
            .connect()
            .await
            .map_err(|error| tonic::Status::unavailable(format!("connect: {error:?}")))?;
        decide(&channel, !certificate).await?;
        Ok(channel)
    }

    /// An anonymous HTTP/2 connection, past its handshake, that makes no
    /// call; `None` where the handshake needs a certificate it lacks, or
    /// where the server closed it first (to make room for another).
    async fn idle_attacker(&self) -> Option<Channel> {
        if self.mode == Mode::MtlsRequired {
            return None;
        }
        self.endpoint(false).connect().await.ok()
    }
}

impl Setup {
    /// An anonymous connection with `HALF_SENT_PER_ATTACKER` half-sent
    /// Decide messages on it, once the server has answered them (so it
    /// holds a place); `None` where the handshake needs a certificate it
    /// lacks, or where the server closed it first.
    async fn half_sent_attacker(
        &self,
        deadline: tokio::time::Instant,
    ) -> Option<h2::client::SendRequest<Bytes>> {
        let addr = self.server.grpc;
        let tcp = TcpStream::connect(addr).await.ok()?;
        let (answers, client) = match self.mode {
            Mode::MtlsRequired => return None,
            Mode::Plain => half_sent_on(tcp, addr, HALF_SENT_PER_ATTACKER, deadline).await,
            Mode::Tls | Mode::MtlsOptional => {
                use tokio_rustls::rustls;
                let mut roots = rustls::RootCertStore::empty();
                let ca = rustls::pki_types::pem::PemObject::from_pem_slice(self.pki.ca.as_bytes())
                    .unwrap();
                roots.add(ca).unwrap();
                let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
                config.alpn_protocols = vec![b"h2".to_vec()];
                let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
                let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
                    .connect(name, tcp)
                    .await
                    .ok()?;
                half_sent_on(tls, addr, HALF_SENT_PER_ATTACKER, deadline).await
            }
        };
        answers.iter().all(Option::is_some).then_some(client)
    }
}

/// Half-sent streams on each half-sent attacker of the lockout tests.
const HALF_SENT_PER_ATTACKER: usize = 8;

/// One Decide for payments on `channel`, with checkout's key if `key`.
async fn decide(channel: &Channel, key: bool) -> Result<(), tonic::Status> {
    let mut request = tonic::Request::new(retryable("payments"));
    if key {
        request.metadata_mut().insert(
            "authorization",
            MetadataValue::try_from(format!("Bearer {CHECKOUT_KEY}")).unwrap(),
        );
    }
    let answer = RetryDeciderClient::new(channel.clone())
        .decide(request)
        .await?;
    assert_eq!(answer.into_inner().verdict(), pb::Verdict::Retry);
    Ok(())
}

/// TCP connections that send nothing: they hold places in their
/// handshake.
async fn silent(addr: SocketAddr, count: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(count);
    for _ in 0..count {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    held
}

/// Holds more than the bound with anonymous idle, half-sent and silent
/// connections, then checks that every new credentialed caller is
/// answered, and that the callers already in stay in while more attackers
/// arrive.
async fn callers_get_in_past_anonymous_connections(mode: Mode) {
    let setup = start(mode);
    let mut attackers = Vec::new();
    let mut idle = Vec::new();
    let mut half_sent = Vec::new();
    // One bound for all the attackers' answers, which the server gave at
    // once (before, never).
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    for _ in 0..ATTACKERS / 3 {
        if let Some(channel) = setup.idle_attacker().await {
            idle.push(channel);
        }
        if let Some(connection) = setup.half_sent_attacker(deadline).await {
            half_sent.push(connection);
        }
    }
    attackers.extend(silent(setup.server.grpc, ATTACKERS - idle.len() - half_sent.len()).await);

    let mut answered = Vec::new();
    let mut failures = Vec::new();
    for _ in 0..CALLERS {
        match setup.caller().await {
            Ok(channel) => answered.push(channel),
            Err(status) => failures.push(status),
        }
    }
    eprintln!(
        "{mode:?}: {} idle, {} half-sent and {} silent anonymous connections held; {} of {CALLERS} new callers answered",
        idle.len(),
        half_sent.len(),
        attackers.len(),
        answered.len()
    );
    assert!(
        failures.is_empty(),
        "{mode:?}: {} of {CALLERS} callers refused: {failures:?}\n{}",
        failures.len(),
        setup.server.logs()
    );

    // A second wave of attackers takes the places of the first, not those
    // of the callers, who authenticated.
    attackers.extend(silent(setup.server.grpc, ATTACKERS).await);
    for _ in 0..ATTACKERS / 2 {
        if let Some(channel) = setup.idle_attacker().await {
            idle.push(channel);
        }
    }
    for channel in &answered {
        decide(channel, mode != Mode::MtlsRequired)
            .await
            .unwrap_or_else(|status| panic!("{mode:?}: a caller already in: {status:?}"));
    }
}

#[tokio::test]
async fn a_caller_gets_in_past_anonymous_connections_on_plain_http2() {
    callers_get_in_past_anonymous_connections(Mode::Plain).await;
}

#[tokio::test]
async fn a_caller_gets_in_past_anonymous_connections_on_tls() {
    callers_get_in_past_anonymous_connections(Mode::Tls).await;
}

#[tokio::test]
async fn a_caller_gets_in_past_anonymous_connections_with_optional_client_certificates() {
    callers_get_in_past_anonymous_connections(Mode::MtlsOptional).await;
}

#[tokio::test]
async fn a_caller_gets_in_past_silent_connections_with_required_client_certificates() {
    callers_get_in_past_anonymous_connections(Mode::MtlsRequired).await;
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .unwrap()
}

/// Connections of the half-sent attack (the finding's numbers).
const HALF_SENT_CONNECTIONS: usize = 16;
/// Streams per connection: `server.max_concurrent_streams`.
const HALF_SENT_STREAMS: usize = 128;
/// The declared message length, and how much of it is sent.
const DECLARED: u32 = 65_536;
const SENT: usize = 65_531;

/// What one anonymous stream got: its gRPC status, if the server answered.
type Answer = Option<u32>;

/// Opens `HALF_SENT_STREAMS` Decide calls on one new plain connection
/// without credentials, each sending `SENT` of `DECLARED` bytes and then
/// nothing, and waits (up to the hang guard) for the server to answer or
/// reset each. Returns the answers and the connection, kept open.
async fn half_sent(addr: SocketAddr) -> (Vec<Answer>, h2::client::SendRequest<Bytes>) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    half_sent_on(tcp, addr, HALF_SENT_STREAMS, deadline).await
}

/// [`half_sent`] with `streams` streams over `io`, a connection to `addr`
/// (plain or TLS), waiting for answers until `deadline`.
async fn half_sent_on<T>(
    io: T,
    addr: SocketAddr,
    streams: usize,
    deadline: tokio::time::Instant,
) -> (Vec<Answer>, h2::client::SendRequest<Bytes>)
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (client, connection) = h2::client::handshake(io).await.unwrap();
    tokio::spawn(connection);
    let mut message = vec![0u8; SENT];
    message[1..5].copy_from_slice(&DECLARED.to_be_bytes());
    let message = Bytes::from(message);
    let mut calls = Vec::new();
    let mut client = client;
    for _ in 0..streams {
        client = client.ready().await.unwrap();
        let request = http::Request::post(format!("http://{addr}/retryd.v1.RetryDecider/Decide"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let (response, mut body) = client.send_request(request, false).unwrap();
        // The server may have answered (and reset) the stream already.
        let _ = body.send_data(message.clone(), false);
        calls.push((response, body));
    }
    let mut answers = Vec::new();
    for (response, _body) in calls {
        let answer = tokio::time::timeout_at(deadline, response).await;
        answers.push(match answer {
            Ok(Ok(response)) => response
                .headers()
                .get("grpc-status")
                .and_then(|status| status.to_str().ok()?.parse().ok()),
            _ => None,
        });
    }
    (answers, client)
}

/// 16 connections × 128 streams, each 5 bytes short of its declared
/// 65,536: once +164 MiB of RSS held for as long as the peer liked. Now
/// every stream is answered UNAUTHENTICATED on its headers, its body
/// unread, and RSS barely moves; a credentialed caller is answered
/// throughout.
#[tokio::test]
async fn half_sent_anonymous_messages_are_refused_unread() {
    let server = Server::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n{}",
        principals()
    ));
    let caller = server.channel().await;
    decide(&caller, true).await.unwrap();
    let before = rss_kib(server.pid());
    let started = Instant::now();
    let attacks: Vec<_> = (0..HALF_SENT_CONNECTIONS)
        .map(|_| tokio::spawn(half_sent(server.grpc)))
        .collect();
    let mut held = Vec::new();
    let mut unauthenticated = 0;
    for attack in attacks {
        let (answers, connection) = attack.await.unwrap();
        unauthenticated += answers
            .iter()
            .filter(|answer| **answer == Some(Code::Unauthenticated as u32))
            .count();
        held.push(connection);
    }
    let after = rss_kib(server.pid());
    eprintln!(
        "{HALF_SENT_CONNECTIONS} × {HALF_SENT_STREAMS} half-sent anonymous streams: {unauthenticated} answered UNAUTHENTICATED in {:?}; RSS {before} KiB -> {after} KiB",
        started.elapsed()
    );
    assert_eq!(
        unauthenticated,
        HALF_SENT_CONNECTIONS * HALF_SENT_STREAMS,
        "every stream is refused on its headers"
    );
    // 128 MiB were sent; what the server may hold is at most each
    // connection's flow-control window (256 KiB) and its buffers.
    assert!(
        after.saturating_sub(before) < 24 * 1024,
        "RSS grew {} KiB",
        after.saturating_sub(before)
    );
    decide(&caller, true).await.unwrap();
    drop(held);
}

/// Under `nofile = 256`, 300 keep-alive connections to the metrics port,
/// each scraping once a second, took every descriptor and new gRPC
/// callers got 0 of 10. The metrics port now holds at most a few
/// connections, each new one taking the oldest's place, so every gRPC
/// caller and the newest scraper get in.
#[tokio::test]
async fn metrics_connections_leave_the_grpc_port_its_descriptors() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const SCRAPERS: usize = 300;
    let server = Server::start_under(&["prlimit", "--nofile=256:256"], "");
    // Each scraper says once that it has settled: answered, or closed
    // before it was.
    let (settled_tx, mut settled_rx) = tokio::sync::mpsc::channel::<()>(SCRAPERS);
    let mut scrapers = Vec::new();
    for _ in 0..SCRAPERS {
        let mut stream = TcpStream::connect(server.metrics).await.unwrap();
        let settled = settled_tx.clone();
        // Scrapes once a second on its one connection until the server
        // closes it: what keeps a keep-alive connection open.
        scrapers.push(tokio::spawn(async move {
            let mut ticks = tokio::time::interval(std::time::Duration::from_secs(1));
            let mut buffer = vec![0u8; 64 * 1024];
            let mut settled = Some(settled);
            loop {
                ticks.tick().await;
                let scrape = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
                let answered = stream.write_all(scrape).await.is_ok()
                    && matches!(stream.read(&mut buffer).await, Ok(n) if n > 0);
                if let Some(settled) = settled.take() {
                    let _ = settled.try_send(());
                }
                if !answered {
                    return;
                }
            }
        }));
    }
    // Before, the scrapers past the file limit were never accepted.
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    for _ in 0..SCRAPERS {
        tokio::time::timeout_at(deadline, settled_rx.recv())
            .await
            .expect("every scraper is answered or closed: the metrics port holds no more descriptors than its bound");
    }
    let mut answered = 0;
    for _ in 0..10 {
        let connected = Endpoint::from_shared(format!("http://{}", server.grpc))
            .unwrap()
            .connect_timeout(HANG_GUARD)
            .timeout(HANG_GUARD)
            .connect()
            .await;
        if let Ok(channel) = connected {
            if decide(&channel, false).await.is_ok() {
                answered += 1;
            }
        }
    }
    let descriptors = std::fs::read_dir(format!("/proc/{}/fd", server.pid()))
        .unwrap()
        .count();
    eprintln!(
        "{SCRAPERS} keep-alive scrapers: the server holds {descriptors} descriptors of 256; {answered} of 10 gRPC callers answered"
    );
    assert_eq!(answered, 10, "{}", server.logs());
    for scraper in scrapers {
        scraper.abort();
    }
}
