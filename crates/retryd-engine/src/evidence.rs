//! Execution evidence and the stage failures that support it (step 0).
//!
//! The one promise here: evidence is never upgraded. NOT_SENT stands only
//! when a stage failure proves it, because a timeout mistaken for "never
//! sent" is exactly how a payment gets made twice.

use strum::VariantArray;

/// How far the failed attempt got, from "proven never received" to "part
/// of the response arrived". Ordered: a later variant admits more of the
/// request's effect, so weakening a claim means moving it later.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Evidence {
    /// Proven that the server never received the request.
    NotSent,
    /// Some or all of the request was written, no final header arrived.
    SentNoResponse,
    /// Final headers arrived, whatever the status.
    ResponseReceived,
    /// Headers and part of the body arrived, then the exchange broke.
    PartialResponse,
}

impl Evidence {
    /// A stable name for logs and spans.
    pub fn as_str(self) -> &'static str {
        match self {
            Evidence::NotSent => "not_sent",
            Evidence::SentNoResponse => "sent_no_response",
            Evidence::ResponseReceived => "response_received",
            Evidence::PartialResponse => "partial_response",
        }
    }
}

/// The stage failure behind a failed attempt. `FailureKind::VARIANTS`
/// lists every kind, derived, so that no hand-kept list can miss one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::VariantArray)]
pub enum FailureKind {
    /// Name resolution failed.
    Dns,
    /// The connection could not be established.
    Connect,
    /// No pooled connection became free in time.
    PoolTimeout,
    /// The TLS handshake failed before the request.
    PreRequestTls,
    /// The client's own profile refused the request.
    ProfileRejection,
    /// HTTP/2 REFUSED_STREAM.
    Http2RefusedStream,
    /// The stream was above a GOAWAY's last-stream-id.
    GoawayUnprocessed,
    /// Part of the request was written.
    PartialWrite,
    /// No final header arrived in time.
    ResponseHeaderTimeout,
    /// The connection was reset after sending.
    ConnectionReset,
    /// The connection broke while decoding the body.
    DecodeReset,
    /// The response stream was interrupted.
    InterruptedStream,
    /// An I/O error of unknown stage.
    GenericIo,
    /// The server's certificate is invalid.
    TlsCertificateInvalid,
    /// The request could not be encoded.
    RequestEncoding,
}

impl FailureKind {
    /// The snake_case name used in configuration and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Dns => "dns",
            FailureKind::Connect => "connect",
            FailureKind::PoolTimeout => "pool_timeout",
            FailureKind::PreRequestTls => "pre_request_tls",
            FailureKind::ProfileRejection => "profile_rejection",
            FailureKind::Http2RefusedStream => "http2_refused_stream",
            FailureKind::GoawayUnprocessed => "goaway_unprocessed",
            FailureKind::PartialWrite => "partial_write",
            FailureKind::ResponseHeaderTimeout => "response_header_timeout",
            FailureKind::ConnectionReset => "connection_reset",
            FailureKind::DecodeReset => "decode_reset",
            FailureKind::InterruptedStream => "interrupted_stream",
            FailureKind::GenericIo => "generic_io",
            FailureKind::TlsCertificateInvalid => "tls_certificate_invalid",
            FailureKind::RequestEncoding => "request_encoding",
        }
    }

    /// The kind named `name` (as [`FailureKind::as_str`] spells it).
    pub fn from_name(name: &str) -> Option<FailureKind> {
        FailureKind::VARIANTS
            .iter()
            .copied()
            .find(|kind| kind.as_str() == name)
    }

    /// The strongest evidence this failure can support: the earliest stage
    /// it proves the attempt stopped at.
    pub fn evidence_floor(self) -> Evidence {
        match self {
            FailureKind::Dns
            | FailureKind::Connect
            | FailureKind::PoolTimeout
            | FailureKind::PreRequestTls
            | FailureKind::ProfileRejection
            | FailureKind::Http2RefusedStream
            | FailureKind::GoawayUnprocessed
            | FailureKind::TlsCertificateInvalid => Evidence::NotSent,
            // Encoding can fail halfway through a streamed body, after the
            // headers left, so it proves nothing about the upstream.
            FailureKind::PartialWrite
            | FailureKind::ResponseHeaderTimeout
            | FailureKind::ConnectionReset
            | FailureKind::GenericIo
            | FailureKind::RequestEncoding => Evidence::SentNoResponse,
            FailureKind::DecodeReset | FailureKind::InterruptedStream => Evidence::PartialResponse,
        }
    }

    /// Failures that no retry can fix, whatever the upstream's policy.
    pub fn is_permanent(self) -> bool {
        matches!(
            self,
            FailureKind::ProfileRejection
                | FailureKind::TlsCertificateInvalid
                | FailureKind::RequestEncoding
        )
    }
}

/// Step 0: the evidence the decision may use, and whether the caller's
/// claim had to be weakened to get it.
///
/// The result is the latest (weakest) of the claim, what the failure
/// supports (no failure supports no more than SENT_NO_RESPONSE), and what
/// `answered` implies: something only the server can have sent (an HTTP
/// status, a gRPC pushback trailer) means at least RESPONSE_RECEIVED. An
/// absent claim is not "weakened": it is derived.
pub fn effective_evidence(
    claimed: Option<Evidence>,
    failure: Option<FailureKind>,
    answered: bool,
) -> (Evidence, bool) {
    let failure_floor = failure.map_or(Evidence::SentNoResponse, FailureKind::evidence_floor);
    let status_floor = if answered {
        Evidence::ResponseReceived
    } else {
        Evidence::NotSent
    };
    let derived = failure_floor.max(status_floor);
    match claimed {
        Some(claim) => {
            let effective = claim.max(derived);
            (effective, effective != claim)
        }
        None => (derived, false),
    }
}
