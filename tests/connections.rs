//! Connections that never speak, against the real binary: they are closed
//! after `server.handshake_timeout` (TLS handshake and HTTP/2 preface), at
//! most `server.max_connections` are open at once (fitted under the file
//! limit), the accept loop does not spin, and a legitimate caller is still
//! answered throughout.

use retryd_testkit as support;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use retryd_proto::retry_decider_client::RetryDeciderClient;
use support::{HANG_GUARD, Server, retryable};
use tonic::transport::{Channel, Endpoint};

/// Opens `count` TCP connections that send nothing.
fn silent(addr: SocketAddr, count: usize) -> Vec<TcpStream> {
    (0..count)
        .map(|_| TcpStream::connect(addr).expect("the kernel accepts the TCP connection"))
        .collect()
}

/// How many of `connections` the server has closed, waiting up to `limit`
/// for each (a read returns end of file or a reset once it has).
fn closed_within(connections: &mut [TcpStream], limit: Duration) -> usize {
    let deadline = Instant::now() + limit;
    let mut closed = 0;
    for connection in connections {
        let left = deadline.saturating_duration_since(Instant::now());
        connection
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        let mut byte = [0u8; 1];
        match connection.read(&mut byte) {
            Ok(0) => closed += 1,
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => closed += 1,
            _ => {}
        }
    }
    closed
}

async fn decide_ok(channel: &Channel) -> bool {
    RetryDeciderClient::new(channel.clone())
        .decide(retryable("payments"))
        .await
        .is_ok()
}

/// A new caller connecting and deciding, trying again until `limit`: it
/// may be shed while the silent connections hold every permit.
async fn new_caller_answered(addr: SocketAddr, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let connected = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(2))
            .connect()
            .await;
        if let Ok(channel) = connected {
            if decide_ok(&channel).await {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Holds silent connections past the bound and checks what the issue
/// promised, on a server started with `extra` (run by `wrapper`).
async fn hold_silent_connections(wrapper: &[&str], extra: &str, silent_count: usize) {
    let server = Server::start_under(
        wrapper,
        &format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\nhandshake_timeout = \"1s\"\n{extra}"
        ),
    );
    let established = server.channel().await;
    assert!(decide_ok(&established).await);

    let cpu_before = server.cpu_seconds();
    let started = Instant::now();
    let mut held = silent(server.grpc, silent_count);

    // An established caller is answered while the flood is held.
    for _ in 0..20 {
        assert!(decide_ok(&established).await, "{}", server.logs());
    }
    // Every silent connection is closed: past the bound at once, the rest
    // at the handshake timeout (1 s; the hang guard allows for a busy
    // machine: how soon is tests/connection_deadlines.rs's to show).
    let closed = closed_within(&mut held, HANG_GUARD);
    assert_eq!(closed, silent_count, "silent connections still open");
    // The accept loop did not spin while the connections were held: a
    // spinning loop takes a whole core for as long as the flood lasts.
    let cpu = server.cpu_seconds() - cpu_before;
    let wall = started.elapsed().as_secs_f64();
    assert!(
        cpu < 0.5 * wall + 0.5,
        "retryd used {cpu:.2} s of CPU in {wall:.2} s"
    );
    // A new caller gets in once the silent ones are gone, and the
    // established one is still answered.
    assert!(new_caller_answered(server.grpc, HANG_GUARD).await);
    assert!(decide_ok(&established).await);
    let logs = server.logs();
    assert!(
        logs.contains("server.max_connections"),
        "reaching the bound is logged: {logs}"
    );
}

#[tokio::test]
async fn silent_connections_are_bounded_and_closed() {
    hold_silent_connections(&[], "max_connections = 32\n", 200).await;
}

/// With a file limit of 256, silent connections made a legitimate Decide
/// fail and the accept loop spin at a full core: the bound is now lowered
/// to fit under the limit, so `accept` never runs out of descriptors.
#[tokio::test]
async fn silent_connections_under_a_low_file_limit() {
    hold_silent_connections(&["prlimit", "--nofile=256:256"], "", 400).await;
}

/// The TLS port: a connection that opens TCP and never says hello is
/// closed at the handshake timeout too.
#[tokio::test]
async fn a_silent_tls_connection_is_closed() {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cert_path = dir.path().join("server.pem");
    let key_path = dir.path().join("server.key");
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    let server = Server::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\nhandshake_timeout = \"1s\"\n[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        cert_path.display(),
        key_path.display()
    ));
    let mut held = silent(server.grpc, 20);
    assert_eq!(closed_within(&mut held, HANG_GUARD), 20);
}

/// One HTTP/2 frame: length, type, flags, stream, payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let length = payload.len() as u32;
    let mut bytes = length.to_be_bytes()[1..].to_vec();
    bytes.extend([kind, flags]);
    bytes.extend(stream.to_be_bytes());
    bytes.extend(payload);
    bytes
}

/// The error codes of the GOAWAY frames read from `stream` until it
/// closes or `limit` passes.
fn goaways(mut stream: TcpStream, limit: Duration) -> Vec<u32> {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut codes = Vec::new();
    let mut header = [0u8; 9];
    while stream.read_exact(&mut header).is_ok() {
        let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        let mut payload = vec![0; length];
        if stream.read_exact(&mut payload).is_err() {
            break;
        }
        if header[3] == 0x7 && payload.len() >= 8 {
            codes.push(u32::from_be_bytes(payload[4..8].try_into().unwrap()));
        }
    }
    codes
}

/// A client that makes the server reset stream after stream (each opened
/// with HEADERS carrying two different content-lengths, a stream error) is
/// cut off with GOAWAY ENHANCE_YOUR_CALM once it passes the bound; tonic's
/// default set no bound.
#[test]
fn a_client_making_the_server_reset_streams_is_cut_off() {
    use std::io::Write;
    const ENHANCE_YOUR_CALM: u32 = 0xb;
    let server = Server::start("");
    let mut stream = TcpStream::connect(server.grpc).unwrap();
    let reader = stream.try_clone().unwrap();
    let goaways = std::thread::spawn(move || goaways(reader, HANG_GUARD));
    let mut opening = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    opening.extend(frame(0x4, 0, 0, &[]));
    opening.extend(frame(0x4, 0x1, 0, &[]));
    stream.write_all(&opening).unwrap();
    // HPACK: :method POST, :scheme http (static table), then :path and
    // the rest as literals without indexing.
    let mut headers = vec![0x83, 0x86];
    for (name, value) in [
        (&b""[..], &b"/retryd.v1.RetryDecider/Decide"[..]),
        (b"content-type", b"application/grpc"),
        (b"content-length", b"1"),
        (b"content-length", b"2"),
    ] {
        if name.is_empty() {
            headers.push(0x04);
        } else {
            headers.push(0x00);
            headers.push(name.len() as u8);
            headers.extend(name);
        }
        headers.push(value.len() as u8);
        headers.extend(value);
    }
    for i in 0..2000u32 {
        let id = 1 + 2 * i;
        if stream.write_all(&frame(0x1, 0x4, id, &headers)).is_err() {
            break;
        }
    }
    let codes = goaways.join().unwrap();
    assert!(
        codes.contains(&ENHANCE_YOUR_CALM),
        "GOAWAY codes: {codes:?}"
    );
}
