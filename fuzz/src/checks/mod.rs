//! The invariants of everything retryd parses from untrusted input, each a
//! plain function of a byte string: a fuzz target in `fuzz/fuzz_targets/`
//! is one call, and `tests/fuzz_smoke.rs` calls the same functions on
//! seeded pseudo-random inputs and on the committed seeds, so that stable
//! `cargo test` checks what the fuzzers check.
//!
//! A function returns when the input is uninteresting (a protobuf that
//! does not decode) or every invariant holds, and panics, which libFuzzer
//! reports as a crash, when one does not. The test includes this file by
//! path, so it may use only what both crates have: retryd, prost,
//! prost-types and httpdate. It must not depend on retryd's private code
//! either: the invariants are restated here, independently of the engine.
//!
//! Long (about 1,300 lines) because it is that independent restatement, one
//! oracle per fuzz target, shared by two crates that can include only one
//! file; it is test code, not shipped.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prost::Message;
use retryd::config::{Config, InvalidConfig, Settings, StoreConfig};
use retryd::grpc::validate::{self, InvalidRequest, ValidDecideRequest};
use retryd::telemetry::TraceContext;
use retryd_engine::{
    self as engine, BudgetView, Decision, DenyReason, Evidence, Facts, FailureKind, Idempotency,
    Jitter, Policy, Replayability, Verdict,
};
use retryd_proto as pb;

/// The fuzz targets, one per parser of untrusted input.
pub const TARGETS: [&str; 5] = [
    "decide",
    "traffic_report",
    "retry_after",
    "config",
    "trace_context",
];

/// Runs target `target`'s checks on one input.
pub fn run(target: &str, data: &[u8]) {
    match target {
        "decide" => {
            decide(data);
        }
        "traffic_report" => traffic_report(data),
        "retry_after" => retry_after(data),
        "config" => config(data),
        "trace_context" => trace_context(data),
        other => panic!("no fuzz target is called {other:?}"),
    }
}

/// Wall-clock time as the engine sees it in every check: a fixed instant, so
/// that a crash reproduces whenever it is replayed.
pub fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}

/// Seconds since the epoch of the first instant httpdate cannot format
/// (year 10000).
pub const HTTP_DATE_END: u64 = 253_402_300_800;

// ---------------------------------------------------------------------------
// Reading structure off raw bytes

/// Reads choices off the front of a fuzz input. Past its end every read is
/// zero, so any byte string maps to some value and the fuzzer's mutations
/// map to nearby values.
struct Input<'a> {
    bytes: &'a [u8],
}

impl<'a> Input<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Input { bytes }
    }

    fn byte(&mut self) -> u8 {
        match self.bytes.split_first() {
            Some((&first, rest)) => {
                self.bytes = rest;
                first
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    fn below(&mut self, n: usize) -> usize {
        usize::from(self.byte()) % n
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }

    /// Up to `max_len` bytes of the input as text, invalid UTF-8 replaced.
    fn text(&mut self, max_len: usize) -> String {
        let len = (usize::from(self.u16()) % (max_len + 1)).min(self.bytes.len());
        let (head, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        String::from_utf8_lossy(head).into_owned()
    }

    fn rest(self) -> &'a [u8] {
        self.bytes
    }
}

/// What a decision depends on besides the request: the budget as the store
/// reports it, the random draw, and the upstream's policy. None of it comes
/// from callers in production, but varying it reaches every rule.
#[derive(Clone, Debug)]
pub struct Environment {
    /// The budget looked at.
    pub budget: BudgetView,
    /// The jitter draw, in `[0, 1)`.
    pub jitter: f64,
    /// The upstream's policy.
    pub policy: Policy,
}

impl Environment {
    fn read(input: &mut Input<'_>) -> Environment {
        let flags = input.byte();
        let tokens = f64::from(input.byte()) / 32.0;
        let jitter = f64::from(input.u32()) / (f64::from(u32::MAX) + 1.0);
        Environment {
            budget: BudgetView {
                tokens,
                retries_enabled: flags & 0b11 != 0,
                unavailable: flags & 0b1100 == 0b1100,
            },
            jitter,
            policy: policies()[usize::from(flags >> 4) % 4].clone(),
        }
    }
}

/// The default policy first, then three that stress other branches:
/// decorrelated jitter, extra permanent failures with a short Retry-After
/// limit and no attempt budget, and the longest durations configuration
/// allows.
fn policies() -> [Policy; 4] {
    let default = Policy::default();
    let mut decorrelated = default.clone();
    decorrelated.backoff.jitter = Jitter::Decorrelated;
    let strict = Policy {
        transient_500: true,
        permanent_failures: vec![FailureKind::Dns, FailureKind::ConnectionReset],
        max_retry_after: Duration::from_secs(1),
        min_attempt_budget: Duration::ZERO,
        ..default.clone()
    };
    let mut long = default;
    long.max_attempts = 100;
    long.min_attempt_budget = Duration::from_secs(86_400);
    long.max_retry_after = Duration::from_secs(86_400);
    long.backoff.base = Duration::from_secs(86_400);
    long.backoff.max = Duration::from_secs(86_400);
    [Policy::default(), decorrelated, strict, long]
}

/// A name as a caller might send it: valid, at or past the length limit,
/// with a control character, or raw bytes from the input.
fn name(input: &mut Input<'_>) -> String {
    match input.byte() % 16 {
        0 => String::new(),
        1 => "a".repeat(validate::MAX_NAME_BYTES),
        2 => "a".repeat(validate::MAX_NAME_BYTES + 1),
        3 => "bad\nname".into(),
        4 => "é".repeat(validate::MAX_NAME_BYTES / 2),
        5..=7 => input.text(300),
        _ => "payments-api".into(),
    }
}

/// A protobuf enum value: mostly one the contract defines (`0..n_values`),
/// sometimes the next one, sometimes an extreme.
fn enum_value(input: &mut Input<'_>, n_values: i32) -> i32 {
    match input.byte() {
        252 => -1,
        253 => i32::MIN,
        254 => i32::MAX,
        255 => input.u32() as i32,
        byte => i32::from(byte) % (n_values + 1),
    }
}

fn flag(input: &mut Input<'_>) -> bool {
    input.byte() % 8 == 0
}

fn http_status(input: &mut Input<'_>) -> u32 {
    const STATUSES: [u32; 20] = [
        0, 99, 100, 200, 204, 302, 400, 401, 404, 408, 409, 425, 429, 500, 501, 502, 503, 504, 599,
        600,
    ];
    match input.byte() % 8 {
        0 => input.u32(),
        1 => u32::from(input.u16()) % 700,
        _ => input.pick(&STATUSES),
    }
}

/// A Retry-After value: each form the specification allows, each kind of
/// garbage the tests know, or raw input.
fn retry_after_text(input: &mut Input<'_>) -> String {
    match input.byte() % 16 {
        0..=3 => String::new(),
        4 => "0".into(),
        5 => "1".into(),
        6 => " 120 ".into(),
        7 => "99999999999999999999999".into(),
        8 => input
            .pick(&["-5", "1.5", "soon", "12s", "+3", "0x10"])
            .into(),
        9 => {
            // Within a year of now, either side.
            let year = Duration::from_secs(31_536_000);
            let offset = Duration::from_secs(u64::from(input.u32()) % (2 * year.as_secs()));
            httpdate::fmt_http_date(now() - year + offset)
        }
        10 => "Sun, 06 Nov 1994 08:49:37 GMT".into(),
        11 => "Sunday, 06-Nov-94 08:49:37 GMT".into(),
        12 => "Sun Nov  6 08:49:37 1994".into(),
        13 => "Fri, 31 Dec 9999 23:59:59 GMT".into(),
        14 => "9".repeat(validate::MAX_RETRY_AFTER_BYTES + 1),
        _ => input.text(300),
    }
}

fn duration(input: &mut Input<'_>) -> Option<prost_types::Duration> {
    match input.byte() % 16 {
        0..=5 => None,
        6..=13 => {
            let millis = i64::from(input.u16());
            Some(prost_types::Duration {
                seconds: millis / 1000,
                nanos: (millis % 1000) as i32 * 1_000_000,
            })
        }
        14 => Some(prost_types::Duration {
            seconds: 86_400,
            nanos: i32::from(input.byte() % 2),
        }),
        _ => Some(prost_types::Duration {
            seconds: input.u64() as i64,
            nanos: input.u32() as i32,
        }),
    }
}

/// A body tree of at most `*n_nodes` nodes, reaching past each limit of
/// validation (depth, parts, nodes) now and then.
fn body(input: &mut Input<'_>, depth: usize, n_nodes: &mut usize) -> pb::Body {
    *n_nodes = n_nodes.saturating_sub(1);
    let kind = enum_value(input, 8);
    // Only a publisher factory declares; now and then another kind does too.
    let declared = if kind == pb::BodyKind::PublisherFactory as i32 || flag(input) {
        enum_value(input, 4)
    } else {
        0
    };
    let n_parts = if kind == pb::BodyKind::Multipart as i32 {
        input.pick(&[
            0,
            1,
            2,
            3,
            4,
            1,
            validate::MAX_PARTS,
            validate::MAX_PARTS + 1,
        ])
    } else if flag(input) {
        1
    } else {
        0
    };
    let mut parts = Vec::new();
    while parts.len() < n_parts && *n_nodes > 0 && depth <= validate::MAX_BODY_DEPTH + 1 {
        parts.push(body(input, depth + 1, n_nodes));
    }
    pb::Body {
        kind,
        declared,
        parts,
    }
}

/// A decide request built from the input so that most fields are close to
/// valid and validation passes often enough to reach the engine.
fn decide_request(input: &mut Input<'_>) -> pb::DecideRequest {
    let mut request = pb::DecideRequest {
        upstream: name(input),
        operation: name(input),
        idempotency: enum_value(input, 5),
        body: match input.byte() % 4 {
            0 => None,
            _ => Some(body(input, 1, &mut (validate::MAX_BODY_NODES + 16))),
        },
        attempt: match input.byte() {
            255 => input.u32(),
            byte => [0, 1, 1, 1, 2, 2, 3, 99][usize::from(byte % 8)],
        },
        evidence: enum_value(input, 5),
        failure: enum_value(input, 16),
        http_status: http_status(input),
        retry_after: retry_after_text(input),
        deadline_remaining: duration(input),
        first_byte_delivered: flag(input),
        runtime_draining: flag(input),
        auth_refresh_attempted: flag(input),
        previous_backoff: duration(input),
        max_attempts: match input.byte() {
            255 => input.u32(),
            byte => u32::from(byte % 8),
        },
        grpc_status_code: 0,
        grpc_retry_pushback_ms: None,
    };
    // Drawn last, so the HTTP fields read the same bytes as before. Mostly
    // a gRPC code only for a call without an HTTP status (then without a
    // Retry-After, as a gRPC call has none), so the HTTP paths keep their
    // share; now and then both, which is invalid. Codes above 16 are out of
    // range on purpose. An exhausted input reads zeros: they mean "unset".
    match input.byte() % 16 {
        1..=3 if request.http_status == 0 => {
            request.grpc_status_code = u32::from(input.byte() % 20);
            request.retry_after.clear();
        }
        4 => request.grpc_status_code = u32::from(input.byte() % 20),
        _ => {}
    }
    // A pushback mostly with a code; rarely without, which is invalid.
    let pushback = match input.byte() % 16 {
        1..=6 => request.grpc_status_code != 0,
        7 => true,
        _ => false,
    };
    if pushback {
        request.grpc_retry_pushback_ms = Some(retry_after_text(input));
    }
    request
}

// ---------------------------------------------------------------------------
// Decide: validation, then the engine

/// Fuzz target `decide`. The input is an [`Environment`] (6 bytes), a mode
/// byte, then either a protobuf `DecideRequest` (even mode) or bytes that
/// [`decide_request`] maps to one (odd mode). Returns the decision, if the
/// request was valid, so that tests can see which rules the inputs reach.
pub fn decide(data: &[u8]) -> Option<Decision> {
    let mut input = Input::new(data);
    let environment = Environment::read(&mut input);
    let request = if input.byte() % 2 == 0 {
        pb::DecideRequest::decode(input.rest()).ok()?
    } else {
        decide_request(&mut input)
    };
    check_decide(&request, &environment)
}

/// Validates `request` and, if it passes, decides it under `environment`,
/// checking validation's promises and the engine's invariants.
pub fn check_decide(request: &pb::DecideRequest, environment: &Environment) -> Option<Decision> {
    let valid = match validate::decide_request(request) {
        Ok(valid) => valid,
        Err(invalid) => {
            check_invalid_request(&invalid, DECIDE_FIELDS);
            return None;
        }
    };
    check_valid_decide_request(request, &valid);
    let facts = valid.facts(environment.budget, now(), environment.jitter);
    let decision = engine::decide(&facts, &environment.policy);
    check_decision(&facts, &environment.policy, &decision);
    Some(decision)
}

const DECIDE_FIELDS: &[&str] = &[
    "upstream",
    "operation",
    "idempotency",
    "body",
    "attempt",
    "evidence",
    "failure",
    "http_status",
    "retry_after",
    "deadline_remaining",
    "previous_backoff",
    "max_attempts",
    "grpc_status_code",
    "grpc_retry_pushback_ms",
];

/// An error names a field of the request (its path starts with one of
/// `fields`) and says what is wrong with it.
fn check_invalid_request(invalid: &InvalidRequest, fields: &[&str]) {
    let top = invalid.field.split(['.', '[']).next().unwrap_or_default();
    assert!(
        fields.contains(&top),
        "the error names no field of the request: {invalid:?}"
    );
    assert!(!invalid.reason.is_empty(), "{invalid:?}");
    assert!(
        invalid.to_string().starts_with(&invalid.field),
        "the message does not start with the field: {invalid}"
    );
}

fn check_name(what: &str, name: &str) {
    assert!(
        name.len() <= validate::MAX_NAME_BYTES,
        "{what} of {} bytes passed",
        name.len()
    );
    assert!(
        !name.chars().any(char::is_control),
        "{what} {name:?} with a control character passed"
    );
}

fn check_duration(what: &str, raw: Option<&prost_types::Duration>, valid: Option<Duration>) {
    match (raw, valid) {
        (None, None) => {}
        (Some(raw), Some(valid)) => {
            assert!(valid <= validate::MAX_DURATION, "{what} {valid:?} passed");
            assert_eq!(valid.as_secs() as i64, raw.seconds, "{what}");
            assert_eq!(valid.subsec_nanos() as i32, raw.nanos, "{what}");
        }
        other => panic!("{what} changed presence in validation: {other:?}"),
    }
}

/// What a validated request promises: every limit the contract states, and
/// the caller's values carried over unchanged.
fn check_valid_decide_request(request: &pb::DecideRequest, valid: &ValidDecideRequest<'_>) {
    assert!(!valid.upstream.is_empty(), "an empty upstream passed");
    check_name("upstream", valid.upstream);
    check_name("operation", valid.operation);
    assert_eq!(valid.upstream, request.upstream);
    assert_eq!(valid.operation, request.operation);
    assert!(valid.reported.attempt >= 1, "attempt 0 passed");
    assert_eq!(valid.reported.attempt, request.attempt);
    match valid.reported.http_status {
        Some(status) => {
            assert!((100..=599).contains(&status), "status {status} passed");
            assert_eq!(u32::from(status), request.http_status);
        }
        None => assert_eq!(request.http_status, 0),
    }
    match valid.reported.grpc_status {
        Some(code) => {
            assert_eq!(code.number(), request.grpc_status_code);
            assert!(valid.reported.http_status.is_none(), "HTTP and gRPC passed");
            assert!(valid.reported.retry_after.is_none(), "Retry-After on gRPC");
        }
        None => assert_eq!(request.grpc_status_code, 0),
    }
    match valid.reported.grpc_pushback {
        Some(raw) => {
            assert!(
                valid.reported.grpc_status.is_some(),
                "pushback without code"
            );
            assert!(raw.len() <= validate::MAX_PUSHBACK_BYTES);
            assert_eq!(Some(raw), request.grpc_retry_pushback_ms.as_deref());
        }
        None => assert!(request.grpc_retry_pushback_ms.is_none()),
    }
    let status_known = valid.reported.http_status.is_some() || valid.reported.grpc_status.is_some();
    if valid.reported.claimed_evidence.is_none() {
        assert!(
            valid.reported.failure.is_some() || status_known,
            "nothing says what happened, yet validation passed"
        );
    }
    if valid.reported.claimed_evidence == Some(Evidence::ResponseReceived) {
        assert!(status_known, "RESPONSE_RECEIVED without status");
    }
    match valid.reported.retry_after {
        Some(raw) => {
            assert!(!raw.is_empty());
            assert!(raw.len() <= validate::MAX_RETRY_AFTER_BYTES);
            assert_eq!(raw, request.retry_after);
        }
        None => assert!(request.retry_after.is_empty()),
    }
    check_duration(
        "deadline_remaining",
        request.deadline_remaining.as_ref(),
        valid.reported.deadline_remaining,
    );
    check_duration(
        "previous_backoff",
        request.previous_backoff.as_ref(),
        valid.reported.previous_backoff,
    );
    assert_eq!(
        valid.reported.max_attempts.unwrap_or(0),
        request.max_attempts
    );
    assert_eq!(
        valid.reported.first_byte_delivered,
        request.first_byte_delivered
    );
    assert_eq!(valid.reported.runtime_draining, request.runtime_draining);
    assert_eq!(
        valid.reported.auth_refresh_attempted,
        request.auth_refresh_attempted
    );
    let mut n_nodes = 0;
    check_valid_body(&valid.body, 1, &mut n_nodes);
    assert!(n_nodes <= validate::MAX_BODY_NODES, "{n_nodes} body nodes");
}

fn check_valid_body(body: &engine::Body, depth: usize, n_nodes: &mut usize) {
    *n_nodes += 1;
    assert!(
        depth <= validate::MAX_BODY_DEPTH,
        "a body {depth} deep passed"
    );
    if let engine::Body::Multipart(parts) = body {
        assert!(
            (1..=validate::MAX_PARTS).contains(&parts.len()),
            "a multipart body of {} parts passed",
            parts.len()
        );
        for part in parts {
            check_valid_body(part, depth + 1, n_nodes);
        }
    }
}

/// The first of rules 1 to 7 whose condition holds, restated from the
/// specification rather than taken from the engine: the rule order is the
/// contract, so whenever one of them applies nothing later may overrule it.
fn first_forbidding_rule(facts: &Facts<'_>, policy: &Policy) -> Option<(DenyReason, u8)> {
    let limit = facts
        .max_attempts
        .map_or(policy.max_attempts, |own| own.min(policy.max_attempts));
    let checks = [
        (facts.attempt >= limit, DenyReason::MaxAttempts, 1),
        (facts.budget.unavailable, DenyReason::BudgetUnavailable, 2),
        (facts.budget.tokens < 1.0, DenyReason::BudgetExhausted, 2),
        (
            facts.body.replayability() == Replayability::OneShot,
            DenyReason::BodyNotReplayable,
            3,
        ),
        (
            facts.first_byte_delivered,
            DenyReason::ResponseAlreadyDelivered,
            4,
        ),
        (facts.runtime_draining, DenyReason::RuntimeDraining, 5),
        (
            !facts.budget.retries_enabled,
            DenyReason::RetriesDisabled,
            5,
        ),
        (
            facts
                .deadline_remaining
                .is_some_and(|remaining| remaining < policy.min_attempt_budget),
            DenyReason::Deadline,
            6,
        ),
        (
            facts.failure.is_some_and(|failure| {
                failure.is_permanent() || policy.permanent_failures.contains(&failure)
            }),
            DenyReason::PermanentFailure,
            7,
        ),
    ];
    checks
        .into_iter()
        .find(|(applies, _, _)| *applies)
        .map(|(_, reason, rule)| (reason, rule))
}

/// The engine's invariants for one decision.
pub fn check_decision(facts: &Facts<'_>, policy: &Policy, decision: &Decision) {
    let effective = decision.effective_evidence;
    let rule = decision.rule.number();

    // Evidence is never stronger than the claim, nor than what the failure
    // and the status prove.
    match facts.claimed_evidence {
        Some(claim) => {
            assert!(
                effective >= claim,
                "claim {claim:?} upgraded to {effective:?}"
            );
            assert_eq!(decision.evidence_adjusted, effective != claim);
        }
        None => assert!(
            !decision.evidence_adjusted,
            "a derived evidence was adjusted"
        ),
    }
    if effective == Evidence::NotSent {
        assert!(
            facts
                .failure
                .is_some_and(|failure| failure.evidence_floor() == Evidence::NotSent),
            "NOT_SENT without a failure that proves it"
        );
    }
    if let Some(failure) = facts.failure {
        assert!(
            effective >= failure.evidence_floor(),
            "{failure:?} -> {effective:?}"
        );
    } else {
        assert!(
            effective >= Evidence::SentNoResponse,
            "no failure, yet NOT_SENT"
        );
    }
    if facts.http_status.is_some() || facts.grpc_pushback.is_some() {
        assert!(
            effective >= Evidence::ResponseReceived,
            "a status or a pushback, yet {effective:?}"
        );
    }
    assert!(
        facts.http_status.is_none() || facts.grpc_status.is_none(),
        "validation let both an HTTP status and a gRPC code through"
    );

    // Rules 1 to 7 deny whenever their condition holds.
    match first_forbidding_rule(facts, policy) {
        Some((reason, number)) => {
            assert_eq!(decision.verdict, Verdict::Deny(reason), "{decision}");
            assert_eq!(rule, number, "{decision}");
        }
        None => assert!(
            rule >= 6,
            "rule {rule} applied where it does not hold: {decision}"
        ),
    }

    // Not safely idempotent and possibly executed: never a retry.
    if facts.idempotency == Idempotency::NonIdempotent && effective == Evidence::SentNoResponse {
        assert!(
            !matches!(decision.verdict, Verdict::Retry { .. }),
            "a NON_IDEMPOTENT SENT_NO_RESPONSE retried: {decision}"
        );
    }

    match decision.verdict {
        Verdict::Retry {
            backoff,
            refresh_credentials,
        } => {
            assert_eq!(rule, 9, "a retry from rule {rule}");
            // The server's floor: a valid pushback (gRPC) or Retry-After.
            let floor = match facts.grpc_pushback.map(engine::parse_pushback) {
                Some(engine::Pushback::Wait(wait)) => Some(wait),
                Some(engine::Pushback::DoNotRetry) => {
                    panic!("a retry despite a do-not-retry pushback: {decision}")
                }
                None => facts
                    .retry_after
                    .and_then(|raw| engine::parse_retry_after(raw, facts.now)),
            };
            let ceiling = policy.backoff.max.max(floor.unwrap_or_default());
            assert!(backoff <= ceiling, "backoff {backoff:?} above {ceiling:?}");
            if let Some(floor) = floor {
                assert!(
                    backoff >= floor,
                    "backoff {backoff:?} below Retry-After {floor:?}"
                );
                assert!(
                    floor <= policy.max_retry_after,
                    "Retry-After {floor:?} honoured"
                );
            }
            if let Some(deadline) = facts.deadline_remaining {
                let needed = backoff.saturating_add(policy.min_attempt_budget);
                assert!(
                    needed <= deadline,
                    "backoff {backoff:?} + {:?} past the deadline {deadline:?}",
                    policy.min_attempt_budget
                );
            }
            if refresh_credentials {
                assert!(
                    facts.http_status == Some(401)
                        || facts.grpc_status == Some(engine::GrpcCode::Unauthenticated),
                    "a refresh for {decision}"
                );
                assert_eq!(facts.idempotency, Idempotency::Safe);
                assert!(!facts.auth_refresh_attempted, "a second refresh");
            }
        }
        Verdict::Ambiguous => {
            assert!(
                !facts.idempotency.is_safely_idempotent(),
                "AMBIGUOUS for a {:?} operation",
                facts.idempotency
            );
            assert!(rule == 8 || rule == 9, "{decision}");
        }
        Verdict::Deny(DenyReason::StatusNotRetryable | DenyReason::ServerPushback) => {
            assert_eq!(rule, 9)
        }
        Verdict::Deny(DenyReason::Deadline) => assert_eq!(rule, 6),
        Verdict::Deny(_) => assert!(rule <= 7, "{decision}"),
    }

    let explanation = decision.to_string();
    assert!(!explanation.is_empty());
}

// ---------------------------------------------------------------------------
// ReportTraffic

/// Fuzz target `traffic_report`: a mode byte, then a protobuf
/// `ReportTrafficRequest` (even mode) or bytes mapped to one (odd mode).
pub fn traffic_report(data: &[u8]) {
    let mut input = Input::new(data);
    let request = if input.byte() % 2 == 0 {
        match pb::ReportTrafficRequest::decode(input.rest()) {
            Ok(request) => request,
            Err(_) => return,
        }
    } else {
        let n_entries = input.pick(&[
            0,
            1,
            2,
            3,
            4,
            validate::MAX_TRAFFIC_ENTRIES,
            validate::MAX_TRAFFIC_ENTRIES + 1,
            1,
        ]);
        let traffic = (0..n_entries)
            .map(|_| pb::UpstreamTraffic {
                upstream: name(&mut input),
                requests: match input.byte() % 6 {
                    0 => 0,
                    1 => 1_000_000_000,
                    2 => 1_000_000_001,
                    3 => input.u64(),
                    _ => u64::from(input.u16()),
                },
            })
            .collect();
        pb::ReportTrafficRequest {
            traffic,
            ..Default::default()
        }
    };
    check_traffic_report(&request);
}

/// Validation of a traffic report keeps every entry, in order, within the
/// limits, or names the entry at fault.
pub fn check_traffic_report(request: &pb::ReportTrafficRequest) {
    match validate::traffic_report(request) {
        Ok(entries) => {
            assert!(entries.len() <= validate::MAX_TRAFFIC_ENTRIES);
            assert_eq!(entries.len(), request.traffic.len());
            for ((upstream, requests), entry) in entries.iter().zip(&request.traffic) {
                assert!(!upstream.is_empty(), "an empty upstream passed");
                check_name("upstream", upstream);
                assert_eq!(*upstream, entry.upstream);
                assert_eq!(*requests, entry.requests);
                assert!(*requests <= 1_000_000_000, "{requests} requests passed");
            }
        }
        Err(invalid) => {
            check_invalid_request(&invalid, &["traffic"]);
            if let Some(index) = invalid
                .field
                .strip_prefix("traffic[")
                .and_then(|rest| rest.split(']').next())
            {
                let index: usize = index.parse().expect("an entry's index");
                assert!(index < request.traffic.len(), "{invalid}");
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Retry-After

/// Fuzz target `retry_after`: the whole input as a header value, and its
/// first 8 bytes as an instant to format as an HTTP-date and read back.
pub fn retry_after(data: &[u8]) {
    check_retry_after(&String::from_utf8_lossy(data));
    if let Some(head) = data.first_chunk::<8>() {
        check_http_date_round_trip(u64::from_le_bytes(*head) % HTTP_DATE_END);
    }
}

/// Parsing a Retry-After value never panics; delay-seconds always parse
/// (saturating); surrounding whitespace changes nothing.
pub fn check_retry_after(raw: &str) {
    let parsed = engine::parse_retry_after(raw, now());
    let value = raw.trim();
    if value.is_empty() {
        assert_eq!(parsed, None, "{raw:?}");
    } else if value.bytes().all(|byte| byte.is_ascii_digit()) {
        let seconds = value.parse::<u64>().unwrap_or(u64::MAX);
        assert_eq!(parsed, Some(Duration::from_secs(seconds)), "{raw:?}");
    }
    let padded = format!(" \t{raw}\t ");
    assert_eq!(engine::parse_retry_after(&padded, now()), parsed, "{raw:?}");
}

/// An instant `seconds` after the epoch, formatted as an IMF-fixdate, reads
/// back as the delay from now to it (zero once it is past).
pub fn check_http_date_round_trip(seconds: u64) {
    let at = UNIX_EPOCH + Duration::from_secs(seconds);
    let text = httpdate::fmt_http_date(at);
    let expected = at.duration_since(now()).unwrap_or(Duration::ZERO);
    assert_eq!(
        engine::parse_retry_after(&text, now()),
        Some(expected),
        "{text:?}"
    );
}

// ---------------------------------------------------------------------------
// Configuration

/// The top-level sections of the configuration file.
const SECTIONS: [&str; 6] = [
    "server",
    "store",
    "telemetry",
    "limits",
    "defaults",
    "upstreams",
];

/// Fuzz target `config`: the input as a TOML file.
pub fn config(data: &[u8]) {
    check_config(&String::from_utf8_lossy(data));
}

/// Loading any text never panics; a refusal names the key at fault; what
/// is accepted keeps every documented bound, and its policies decide
/// without breaking the engine's invariants.
pub fn check_config(toml: &str) {
    let settings = match Settings::from_toml(toml) {
        Ok(settings) => settings,
        Err(error) => return check_config_error(&error),
    };
    match Config::try_from(settings) {
        Ok(config) => check_valid_config(&config),
        Err(error) => check_config_error(&error),
    }
}

fn check_config_error(error: &InvalidConfig) {
    let message = error.to_string();
    assert!(!message.is_empty());
    if let InvalidConfig::Value { key, reason } = error {
        assert!(!reason.is_empty(), "{message}");
        assert!(message.starts_with(key.as_str()), "{message}");
        // Keys with brackets are refused wherever they stand, by their own
        // name (the config crate would expand them as array indices).
        if key.contains(['[', ']']) {
            return;
        }
        let section = key.split('.').next().unwrap_or_default();
        assert!(
            SECTIONS.contains(&section),
            "key {key:?} is not in a section"
        );
        assert!(
            key == "upstreams" || key.len() > section.len() + 1,
            "key {key:?} is not a dotted path"
        );
    }
}

fn check_valid_config(config: &Config) {
    let telemetry = &config.telemetry;
    assert!((0.0..=1.0).contains(&telemetry.sampling.ratio));
    if let Some(export) = &telemetry.otlp {
        assert!(export.endpoint.starts_with("http://") || export.endpoint.starts_with("https://"));
    }
    assert!(config.max_upstreams >= 1);
    assert!(config.shutdown_grace <= Duration::from_secs(86_400));
    if let StoreConfig::Redis(redis) = &config.store {
        assert!(!redis.urls.is_empty());
        for url in &redis.urls {
            let url = url.expose_credentials();
            assert!(url.starts_with("redis://") || url.starts_with("rediss://"));
        }
        assert!(!redis.timeout.is_zero());
        assert!(redis.lease_tokens.is_finite() && redis.lease_tokens >= 1.0);
        assert!(redis.lease_ttl >= Duration::from_millis(10));
        assert!(!redis.key_prefix.is_empty() && !redis.key_prefix.contains(['{', '}']));
    }
    let named: Vec<_> = config.policies.named().collect();
    assert!(named.len() <= config.max_upstreams);
    let defaults = config.policies.defaults();
    for (name, policy) in std::iter::once(("", defaults)).chain(named) {
        assert!(name.len() <= validate::MAX_NAME_BYTES, "{name:?}");
        let engine = &policy.engine;
        let day = Duration::from_secs(86_400);
        assert!((1..=100).contains(&engine.max_attempts), "{name:?}");
        assert!(engine.min_attempt_budget <= day, "{name:?}");
        assert!(engine.max_retry_after <= day, "{name:?}");
        assert!(engine.backoff.base <= engine.backoff.max, "{name:?}");
        assert!(engine.backoff.max <= day, "{name:?}");
        let bucket = &policy.bucket;
        assert!((1.0..=1e9).contains(&bucket.capacity), "{name:?}");
        assert!(
            (0.0..=bucket.capacity).contains(&bucket.initial),
            "{name:?}"
        );
        assert!(bucket.ratio.is_finite() && bucket.ratio >= 0.0, "{name:?}");
        assert!(
            bucket.min_per_second.is_finite() && bucket.min_per_second >= 0.0,
            "{name:?}"
        );
        decide_under(engine);
    }
}

/// A handful of retryable attempts under a policy that configuration
/// accepted: the engine's invariants hold for every policy it can be given.
fn decide_under(policy: &Policy) {
    let body = engine::Body::Bytes;
    for (attempt, status, retry_after, deadline, previous) in [
        (1, Some(503), None, None, None),
        (
            1,
            Some(429),
            Some("120"),
            Some(Duration::from_secs(30)),
            None,
        ),
        (2, None, Some("1"), None, Some(Duration::from_secs(86_400))),
        (99, Some(401), None, Some(Duration::from_secs(86_400)), None),
    ] {
        let facts = Facts {
            idempotency: Idempotency::Safe,
            body: &body,
            attempt,
            claimed_evidence: None,
            failure: None,
            http_status: status,
            retry_after,
            grpc_status: None,
            grpc_pushback: None,
            deadline_remaining: deadline,
            first_byte_delivered: false,
            runtime_draining: false,
            auth_refresh_attempted: false,
            previous_backoff: previous,
            max_attempts: None,
            budget: BudgetView {
                tokens: 10.0,
                retries_enabled: true,
                unavailable: false,
            },
            now: now(),
            jitter: 0.999_999,
        };
        check_decision(&facts, policy, &engine::decide(&facts, policy));
    }
}

// ---------------------------------------------------------------------------
// W3C trace context

/// Fuzz target `trace_context`: the input's first line as `traceparent`,
/// the rest, if there is a line break, as `tracestate`.
pub fn trace_context(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match text.split_once('\n') {
        Some((traceparent, tracestate)) => check_trace_context(traceparent, Some(tracestate)),
        None => check_trace_context(&text, None),
    }
}

/// Lower-case hex, as W3C trace context spells ids.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Parsing never panics; what parses has non-zero ids, a bounded
/// `tracestate`, a version the specification allows, and re-encodes to a
/// `traceparent` that parses back to the same context.
pub fn check_trace_context(traceparent: &str, tracestate: Option<&str>) {
    let Some(context) = TraceContext::parse(traceparent, tracestate) else {
        return;
    };
    assert_ne!(context.trace_id, [0; 16]);
    assert_ne!(context.span_id, [0; 8]);
    let expected_state = tracestate.filter(|state| state.len() <= 512).unwrap_or("");
    assert_eq!(context.trace_state, expected_state);
    // W3C Trace Context §3.2.2.1: `version = 2HEXDIGLC`, and ff is invalid.
    let version = traceparent.trim().split('-').next().unwrap_or_default();
    assert!(
        version.len() == 2
            && version
                .bytes()
                .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte))
            && version != "ff",
        "traceparent version {version:?} accepted: {traceparent:?}"
    );
    let encoded = format!(
        "00-{}-{}-{:02x}",
        hex(&context.trace_id),
        hex(&context.span_id),
        u8::from(context.sampled)
    );
    let again = TraceContext::parse(&encoded, Some(&context.trace_state));
    assert_eq!(again.as_ref(), Some(&context), "{encoded:?}");
}

// ---------------------------------------------------------------------------
// Seeds

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
                ..retry
            },
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
