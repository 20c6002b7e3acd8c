//! The committed seed corpus, one to a dozen small inputs per target.

use prost::Message;
use retryd_proto as pb;

/// One committed seed input.
#[derive(Clone, Debug)]
pub struct Seed {
    /// Its target.
    pub target: &'static str,
    /// Its file name under `fuzz/seeds/<target>/`.
    pub name: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

/// The environment prefix of a decide seed: full budget, retries on, the
/// default policy, a mid-range jitter draw.
const ENVIRONMENT: [u8; 6] = [0b01, 255, 0, 0, 0, 128];

fn decide_seed(name: &str, request: pb::DecideRequest) -> Seed {
    let mut bytes = ENVIRONMENT.to_vec();
    bytes.push(0);
    bytes.extend(request.encode_to_vec());
    Seed {
        target: "decide",
        name: name.into(),
        bytes,
    }
}

fn text_seed(target: &'static str, name: &str, text: &str) -> Seed {
    Seed {
        target,
        name: name.into(),
        bytes: text.as_bytes().to_vec(),
    }
}

/// The seed corpus, one to a dozen small inputs per target that reach
/// different branches. `tests/fuzz_smoke.rs` checks that the files under
/// `fuzz/seeds/` are exactly these and rewrites them when asked to.
pub fn seeds() -> Vec<Seed> {
    let retry = pb::DecideRequest {
        upstream: "payments-api".into(),
        operation: "GET /v1/charges".into(),
        idempotency: pb::Idempotency::Idempotent as i32,
        body: Some(pb::Body {
            kind: pb::BodyKind::Bytes as i32,
            ..Default::default()
        }),
        attempt: 1,
        failure: pb::FailureKind::Connect as i32,
        ..Default::default()
    };
    let mut seeds = vec![
        decide_seed("connect_retry", retry.clone()),
        decide_seed(
            "status_503_retry_after_date",
            pb::DecideRequest {
                failure: 0,
                evidence: pb::Evidence::ResponseReceived as i32,
                http_status: 503,
                retry_after: "Thu, 15 Jan 2027 08:00:30 GMT".into(),
                deadline_remaining: Some(prost_types::Duration {
                    seconds: 2,
                    nanos: 500_000_000,
                }),
                ..retry.clone()
            },
        ),
        decide_seed(
            "non_idempotent_timeout",
            pb::DecideRequest {
                idempotency: pb::Idempotency::NonIdempotent as i32,
                evidence: pb::Evidence::NotSent as i32,
                failure: pb::FailureKind::ResponseHeaderTimeout as i32,
                ..retry.clone()
            },
        ),
        decide_seed(
            "safe_401_refresh",
            pb::DecideRequest {
                idempotency: pb::Idempotency::Safe as i32,
                failure: 0,
                http_status: 401,
                previous_backoff: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 200_000_000,
                }),
                ..retry.clone()
            },
        ),
        decide_seed(
            "multipart_one_shot",
            pb::DecideRequest {
                body: Some(pb::Body {
                    kind: pb::BodyKind::Multipart as i32,
                    parts: vec![
                        pb::Body {
                            kind: pb::BodyKind::Bytes as i32,
                            ..Default::default()
                        },
                        pb::Body {
                            kind: pb::BodyKind::PublisherFactory as i32,
                            declared: pb::Replayability::OneShot as i32,
                            parts: Vec::new(),
                        },
                    ],
                    declared: 0,
                }),
                ..retry.clone()
            },
        ),
        decide_seed(
            "partial_response_429",
            pb::DecideRequest {
                evidence: pb::Evidence::PartialResponse as i32,
                failure: pb::FailureKind::DecodeReset as i32,
                http_status: 429,
                retry_after: "120".into(),
                max_attempts: 2,
                ..retry.clone()
            },
        ),
        decide_seed(
            "invalid_attempt_zero",
            pb::DecideRequest {
                attempt: 0,
                ..retry.clone()
            },
        ),
        // The first hedge of a call still in flight (granted under the
        // environment's default hedging), and one that also reports a
        // failure, which validation refuses by name.
        decide_seed(
            "hedge_first",
            pb::DecideRequest {
                failure: 0,
                hedge: 1,
                ..retry.clone()
            },
        ),
        decide_seed(
            "invalid_hedge_with_failure",
            pb::DecideRequest { hedge: 1, ..retry },
        ),
    ];
    // The same kinds of request through the structured mode: an odd mode
    // byte, then choices (see `decide_request`).
    let mut structured = ENVIRONMENT.to_vec();
    structured.extend([
        1, // mode: structured
        8, 8, // upstream and operation "payments-api"
        2, // IDEMPOTENT
        1, 1, 1, 1, // a BYTES body, nothing declared, no parts
        1, // attempt 1
        3, // RESPONSE_RECEIVED
        0, // no failure
        2, 16, // status 503
        10, // Retry-After "Sun, 06 Nov 1994 08:49:37 GMT" (long past)
        6, 0xd0, 0x07, // deadline 2 s
        1, 1, 1, // nothing delivered, not draining, no refresh yet
    ]);
    seeds.push(Seed {
        target: "decide",
        name: "structured_retry_after_date".into(),
        bytes: structured,
    });

    let entry = |upstream: &str, requests| pb::UpstreamTraffic {
        upstream: upstream.into(),
        requests,
        ..Default::default()
    };
    for (name, traffic) in [
        (
            "two_entries",
            vec![entry("payments-api", 100), entry("search", 0)],
        ),
        (
            "too_many_requests",
            vec![entry("payments-api", 1_000_000_001)],
        ),
        ("empty_upstream", vec![entry("search", 5), entry("", 1)]),
        (
            "hedges_won",
            vec![pb::UpstreamTraffic {
                hedges_won: 3,
                ..entry("payments-api", 100)
            }],
        ),
        (
            "too_many_hedges_won",
            vec![pb::UpstreamTraffic {
                hedges_won: 1_000_000_001,
                ..entry("payments-api", 100)
            }],
        ),
    ] {
        let mut bytes = vec![0];
        bytes.extend(
            pb::ReportTrafficRequest {
                traffic,
                ..Default::default()
            }
            .encode_to_vec(),
        );
        seeds.push(Seed {
            target: "traffic_report",
            name: name.into(),
            bytes,
        });
    }

    for (name, text) in [
        ("delay_seconds", "120"),
        ("delay_padded", " 0 "),
        ("delay_overflow", "99999999999999999999999"),
        ("imf_fixdate", "Sun, 06 Nov 1994 08:49:37 GMT"),
        ("rfc850", "Sunday, 06-Nov-94 08:49:37 GMT"),
        ("asctime", "Sun Nov  6 08:49:37 1994"),
        ("future_date", "Fri, 15 Jan 2027 08:00:30 GMT"),
        ("garbage", "soon"),
    ] {
        seeds.push(text_seed("retry_after", name, text));
    }

    for (name, text) in [
        ("empty", ""),
        (
            "design_example",
            concat!(
                "[server]\nlisten = \"127.0.0.1:50051\"\nmetrics_listen = \"127.0.0.1:9464\"\n",
                "shutdown_grace = \"10s\"\n",
                "[store]\nkind = \"memory\"\n",
                "[telemetry]\nsampling_ratio = 0.5\nlog_format = \"json\"\n",
                "otlp_endpoint = \"http://127.0.0.1:4317\"\n",
                "[limits]\nmax_upstreams = 100\n",
                "[defaults]\nmax_attempts = 3\nmin_attempt_budget = \"50ms\"\n",
                "max_retry_after = \"60s\"\ntransient_500 = false\n",
                "budget = { capacity = 100.0, initial = 100.0, ratio = 0.1, min_per_second = 1.0 }\n",
                "backoff = { base = \"50ms\", max = \"5s\", jitter = \"full\" }\n",
                "[upstreams.\"payments-api\"]\nmax_attempts = 2\nbudget = { capacity = 20.0 }\n",
                "permanent_failures = [\"connect\", \"dns\"]\non_unavailable = \"deny\"\n",
            ),
        ),
        (
            "redis_cluster",
            concat!(
                "[store]\nkind = \"redis\"\n",
                "url = [\"redis://127.0.0.1:7000\", \"rediss://127.0.0.1:7001\"]\n",
                "mode = \"leased\"\ntimeout = \"20ms\"\nlease_tokens = 5.0\nlease_ttl = \"2s\"\n",
                "key_prefix = \"retryd\"\non_unavailable = \"local\"\n",
            ),
        ),
        (
            "bad_backoff",
            "[upstreams.search]\nbackoff = { base = \"10s\", max = \"1s\", jitter = \"decorrelated\" }\n",
        ),
        ("unknown_key", "[defaults]\nmax_atempts = 3\n"),
    ] {
        seeds.push(text_seed("config", name, text));
    }

    for (name, text) in [
        (
            "sampled",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\nvendor=value",
        ),
        (
            "not_sampled",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        ),
        (
            "future_version",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-extra",
        ),
        (
            "zero_trace",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        ),
    ] {
        seeds.push(text_seed("trace_context", name, text));
    }
    seeds
}
