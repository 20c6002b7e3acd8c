//! How every socket to Redis is set up, whoever opens it (the one-node
//! client in `connection.rs`, a Cluster's nodes in `cluster.rs`, Sentinel's
//! in `sentinel.rs`): the TCP settings and the client's TLS material. The
//! openers import this; it imports none of them.

use ::redis::{ClientTlsConfig, TlsCertificates};

use super::config::RedisTls;

/// TCP_NODELAY on every connection to Redis (redis-rs leaves Nagle on).
/// The connection is multiplexed: with Nagle, a request written while an
/// earlier one is unacknowledged waits for that ACK, which the receiver
/// delays or sends only with its reply, so each request waits for the one
/// before it. Measured through a proxy that delays replies by 400 ms: a
/// second PING 10 ms after the first left only after the first's reply
/// (`tests/redis_outage.rs`).
pub(super) fn tcp_settings() -> ::redis::io::tcp::TcpSettings {
    ::redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

/// The client's certificates from the validated TLS material.
pub(super) fn certificates(tls: &RedisTls) -> TlsCertificates {
    TlsCertificates {
        client_tls: tls
            .client_pem
            .as_ref()
            .map(|(certificate, key)| ClientTlsConfig {
                client_cert: certificate.clone(),
                client_key: key.clone(),
            }),
        root_cert: tls.ca_pem.clone(),
    }
}
