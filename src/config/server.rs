//! `[server]` validated: the gRPC port's TLS files read (a PEM that is
//! not even PEM refused) and its transport limits, and the refusal to
//! listen beyond loopback without authentication.
//!
//! It reads files but binds nothing: the acceptor in `transport` builds TLS
//! from the [`TlsConfig`] this returns.

use std::net::SocketAddr;
use std::time::Duration;

use crate::auth::Auth;

use super::{ClientAuth, InvalidConfig, ServerSettings, TlsSettings, invalid, parse_duration};

/// The validated `[server.tls]`, files read. Its `Debug` leaves the private
/// key out, so that no log line or panic message can carry it.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM certificate chain.
    pub cert_pem: Vec<u8>,
    /// PEM private key.
    pub key_pem: Vec<u8>,
    /// PEM client CA bundle, for mTLS.
    pub client_ca_pem: Option<Vec<u8>>,
    /// Whether a client certificate may be absent (mTLS optional).
    pub client_auth_optional: bool,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("cert_pem", &format_args!("{} bytes", self.cert_pem.len()))
            .field("key_pem", &format_args!("<redacted>"))
            .field(
                "client_ca_pem",
                &self.client_ca_pem.as_ref().map(|pem| pem.len()),
            )
            .field("client_auth_optional", &self.client_auth_optional)
            .finish()
    }
}

/// Transport limits of the gRPC server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// Largest request message, bytes.
    pub max_message_bytes: usize,
    /// HTTP/2 streams per connection.
    pub max_concurrent_streams: u32,
    /// Requests in progress per connection, if limited.
    pub max_concurrent_requests: Option<usize>,
    /// Per-call time limit, if any.
    pub request_timeout: Option<Duration>,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Time a connection has for its TLS handshake and HTTP/2 preface.
    pub handshake_timeout: Duration,
    /// Time a connection has, after its handshake, to make a call that
    /// authenticates (with `[auth]`).
    pub authenticate_timeout: Duration,
    /// Time a connection may stay open with no call in progress.
    pub idle_timeout: Duration,
    /// Most connections open at once from one IP address.
    pub max_connections_per_address: usize,
    /// Time a request message has to arrive in full (a unary call's body
    /// from the call's start, a stream's each message from its first byte).
    pub receive_timeout: Duration,
}

/// Without authentication, anyone who can reach the port can drain budgets
/// and switch retries off: only loopback, unless insisted.
pub(super) fn refuse_public_unauthenticated(
    listen: SocketAddr,
    auth: &Auth,
    server: &ServerSettings,
) -> Result<(), InvalidConfig> {
    if !listen.ip().is_loopback() && !auth.is_enabled() && !server.allow_unauthenticated {
        return Err(invalid(
            "server.listen",
            format!(
                "{listen} is not a loopback address and [auth] names no principal; configure [auth] or set server.allow_unauthenticated = true"
            ),
        ));
    }
    Ok(())
}

pub(super) fn tls_config(tls: &TlsSettings) -> Result<TlsConfig, InvalidConfig> {
    let read = |key: &str, path: &str| {
        std::fs::read(path).map_err(|err| invalid(key, format!("cannot read {path:?}: {err}")))
    };
    let cert_pem = read("server.tls.cert_file", &tls.cert_file)?;
    let key_pem = read("server.tls.key_file", &tls.key_file)?;
    let client_ca_pem = tls
        .client_ca_file
        .as_deref()
        .map(|path| read("server.tls.client_ca_file", path))
        .transpose()?;
    for (key, pem) in [
        ("server.tls.cert_file", Some(&cert_pem)),
        ("server.tls.key_file", Some(&key_pem)),
        ("server.tls.client_ca_file", client_ca_pem.as_ref()),
    ] {
        if pem.is_some_and(|pem| !pem.windows(11).any(|w| w == b"-----BEGIN ")) {
            return Err(invalid(key, "is not a PEM file"));
        }
    }
    // Unset is "required" with a client CA and means nothing without one;
    // only a written "required" without a CA is refused: it would
    // silently require nothing, since no client certificate is even asked
    // for.
    if tls.client_auth == Some(ClientAuth::Required) && client_ca_pem.is_none() {
        return Err(invalid(
            "server.tls.client_ca_file",
            "required when server.tls.client_auth = \"required\": without a client CA no client certificate is asked for, so nothing would be required",
        ));
    }
    let client_auth_optional = tls.client_auth == Some(ClientAuth::Optional);
    Ok(TlsConfig {
        cert_pem,
        key_pem,
        client_ca_pem,
        client_auth_optional,
    })
}

pub(super) fn server_limits(server: &ServerSettings) -> Result<ServerLimits, InvalidConfig> {
    if !(1024..=16 * 1024 * 1024).contains(&server.max_message_bytes) {
        return Err(invalid(
            "server.max_message_bytes",
            "must be between 1024 and 16777216",
        ));
    }
    if server.max_concurrent_streams == 0 {
        return Err(invalid(
            "server.max_concurrent_streams",
            "must be at least 1",
        ));
    }
    let request_timeout = parse_duration("server.request_timeout", &server.request_timeout)?;
    if server.max_connections == 0 {
        return Err(invalid("server.max_connections", "must be at least 1"));
    }
    let handshake_timeout = parse_duration("server.handshake_timeout", &server.handshake_timeout)?;
    if handshake_timeout.is_zero() {
        return Err(invalid(
            "server.handshake_timeout",
            "must be more than 0s: a connection that never speaks would be kept forever",
        ));
    }
    let authenticate_timeout = positive_duration(
        "server.authenticate_timeout",
        &server.authenticate_timeout,
        "an anonymous connection would hold its place forever",
    )?;
    let idle_timeout = positive_duration(
        "server.idle_timeout",
        &server.idle_timeout,
        "a connection with no call would be kept forever",
    )?;
    let receive_timeout = positive_duration(
        "server.receive_timeout",
        &server.receive_timeout,
        "a half-sent message would be buffered forever",
    )?;
    if server.max_connections_per_address == 0 {
        return Err(invalid(
            "server.max_connections_per_address",
            "must be at least 1",
        ));
    }
    Ok(ServerLimits {
        max_message_bytes: server.max_message_bytes,
        max_concurrent_streams: server.max_concurrent_streams,
        max_concurrent_requests: (server.max_concurrent_requests > 0)
            .then_some(server.max_concurrent_requests),
        request_timeout: (!request_timeout.is_zero()).then_some(request_timeout),
        max_connections: server.max_connections,
        handshake_timeout,
        authenticate_timeout,
        idle_timeout,
        max_connections_per_address: server.max_connections_per_address,
        receive_timeout,
    })
}

/// `raw` as a duration that must not be zero, else refused naming `key`
/// and saying `why` zero would be unsafe.
fn positive_duration(key: &str, raw: &str, why: &str) -> Result<Duration, InvalidConfig> {
    let duration = parse_duration(key, raw)?;
    if duration.is_zero() {
        return Err(invalid(key, format!("must be more than 0s: {why}")));
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::super::{Config, Settings};
    use std::time::Duration;

    #[test]
    fn connection_deadlines_default_to_what_an_operator_wants_and_refuse_zero() {
        let limits = Config::try_from(Settings::from_toml("").unwrap())
            .unwrap()
            .server_limits;
        assert_eq!(limits.authenticate_timeout, Duration::from_secs(5));
        assert_eq!(limits.idle_timeout, Duration::from_secs(300));
        assert_eq!(limits.receive_timeout, Duration::from_secs(10));
        assert_eq!(limits.max_connections_per_address, 1000);
        for (key, value) in [
            ("authenticate_timeout", "\"0s\""),
            ("idle_timeout", "\"0s\""),
            ("receive_timeout", "\"0s\""),
            ("max_connections_per_address", "0"),
        ] {
            let toml = format!("[server]\n{key} = {value}\n");
            let error = Config::try_from(Settings::from_toml(&toml).unwrap())
                .expect_err("zero is refused")
                .to_string();
            assert!(error.contains(&format!("server.{key}")), "{error}");
        }
    }
}
