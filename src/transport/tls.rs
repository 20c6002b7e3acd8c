//! The rustls configuration of the gRPC port, from `[server.tls]`: the
//! server's chain and key, and with a client CA the verifier of client
//! certificates (required, or optional when API keys are the
//! alternative). Only HTTP/2 is offered (ALPN `h2`).
//!
//! Every PEM is parsed here, and each certificate as X.509, so that
//! `Acceptor::try_new` (which `check-config` runs too) refuses a bad file,
//! naming its key, before any port is bound. It reads no file: `config`
//! did, into [`TlsConfig`].

use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::{InvalidConfig, TlsConfig};

/// The rustls configuration of `[server.tls]`, every PEM parsed.
pub(super) fn server_config(tls: &TlsConfig) -> Result<rustls::ServerConfig, InvalidConfig> {
    let invalid = |key: &str, reason: String| InvalidConfig::Value {
        key: key.to_owned(),
        reason,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certificates("server.tls.cert_file", &tls.cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(&tls.key_pem).map_err(|error| {
        invalid(
            "server.tls.key_file",
            format!("no usable PEM private key: {error}"),
        )
    })?;
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|error| invalid("server.tls", error.to_string()))?;
    let builder = match &tls.client_ca_pem {
        None => builder.with_no_client_auth(),
        Some(ca_pem) => {
            let mut roots = rustls::RootCertStore::empty();
            for ca in certificates("server.tls.client_ca_file", ca_pem)? {
                roots.add(ca).map_err(|error| {
                    invalid(
                        "server.tls.client_ca_file",
                        format!("not a usable CA certificate: {error}"),
                    )
                })?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            );
            let verifier = if tls.client_auth_optional {
                verifier.allow_unauthenticated()
            } else {
                verifier
            };
            builder.with_client_cert_verifier(
                verifier
                    .build()
                    .map_err(|error| invalid("server.tls.client_ca_file", error.to_string()))?,
            )
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|error| {
        invalid(
            "server.tls.key_file",
            format!("cannot be used with server.tls.cert_file: {error}"),
        )
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Every certificate of a PEM file, which must hold at least one.
fn certificates(key: &str, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, InvalidConfig> {
    let invalid = |reason: String| InvalidConfig::Value {
        key: key.to_owned(),
        reason,
    };
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| invalid(format!("not a PEM certificate file: {error}")))?;
    for certificate in &certificates {
        use x509_parser::prelude::{FromDer, X509Certificate};
        X509Certificate::from_der(certificate.as_ref())
            .map_err(|error| invalid(format!("a certificate does not parse: {error}")))?;
    }
    if certificates.is_empty() {
        return Err(invalid("holds no PEM certificate".into()));
    }
    Ok(certificates)
}
