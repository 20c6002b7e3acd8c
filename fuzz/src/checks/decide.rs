//! Fuzz target `decide`: validation of a `DecideRequest`, then the engine.
//! The input's format ([`Environment`], a mode byte, then a protobuf or
//! bytes mapped to a near-valid request) and the engine's invariants,
//! restated from the specification rather than taken from the engine.

use std::time::Duration;

use prost::Message;
use retryd::decide::{Attempt, Draw};
use retryd::grpc::validate;
use retryd_engine::{
    self as engine, BudgetView, Decision, DenyReason, EnclosingRetry, Evidence, Facts, FailureKind,
    HedgeFacts, HedgePolicy, HedgeState, Idempotencies, Idempotency, Jitter, Policy, RecentLatency,
    Replayability, Verdict,
};
use retryd_proto as pb;

use super::common::{Input, check_invalid_request, check_name, name};
use super::now;

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
    /// The upstream's hedging policy, if it has one.
    pub hedging: Option<HedgePolicy>,
    /// What the fleet reported about the upstream over the hedging window.
    pub hedge_state: HedgeState,
}

impl Environment {
    fn read(input: &mut Input<'_>) -> Environment {
        let flags = input.byte();
        let tokens = f64::from(input.byte()) / 32.0;
        let jitter = f64::from(input.u32()) / (f64::from(u32::MAX) + 1.0);
        // The two high bits, which the policy's choice leaves unread, so
        // that an older input keeps its meaning (and hedging setup 0).
        let (hedging, hedge_state) = hedgings()[usize::from(flags >> 6)];
        Environment {
            budget: BudgetView {
                tokens,
                retries_enabled: flags & 0b11 != 0,
                unavailable: flags & 0b1100 == 0b1100,
            },
            jitter,
            policy: policies()[usize::from(flags >> 4) % 4].clone(),
            hedging,
            hedge_state,
        }
    }
}

/// Hedging as the fleet may have it: a default policy whose upstream can be
/// hedged (the budget decides; its recent latencies have a tail), no policy
/// (with recent latencies uniformly slow, which must not matter), a policy
/// whose cap is reached with just enough samples for the delay, and an
/// upstream whose window is not uniformly slow but whose recent part is,
/// under a policy of four hedges that allows keyed idempotency too. (Too
/// few samples, and a whole window uniformly slow, are the engine's table
/// tests' cases: here they would hide the rest.)
fn hedgings() -> [(Option<HedgePolicy>, HedgeState); 4] {
    let served = HedgeState {
        samples: 1_000,
        p50: Duration::from_millis(10),
        delay: Duration::from_millis(50),
        tail: Duration::from_millis(100),
        first_attempts: 1_000,
        hedges: 0,
        recent: RecentLatency {
            samples: 200,
            p50: Duration::from_millis(10),
            tail: Duration::from_millis(100),
        },
    };
    let default = HedgePolicy::default();
    let capped = HedgeState {
        samples: default.min_samples,
        hedges: (default.max_extra_load * served.first_attempts as f64) as u64,
        ..served
    };
    let recently_slow = HedgeState {
        recent: RecentLatency {
            samples: 200,
            p50: Duration::from_millis(95),
            tail: Duration::from_millis(100),
        },
        ..served
    };
    let wide = HedgePolicy {
        max_hedges: 4,
        idempotency: Idempotencies::SAFE_AND_IDEMPOTENT.with(Idempotency::IdempotentWithKey),
        ..default
    };
    [
        (Some(default), served),
        (None, recently_slow),
        (Some(default), capped),
        (Some(wide), recently_slow),
    ]
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
        lineage: String::new(),
        retried_below: String::new(),
        hedge: 0,
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
    // The call chain, drawn after everything else: mostly none (the chain's
    // denial would hide the rules after 5), else a lineage near the limits
    // (docs/lineage.md) or a mark from below.
    if input.byte() % 16 == 1 {
        let entries = input.pick(&[1, 2, 3, 31, 32, 33]);
        let lineage: Vec<String> = (0..entries)
            .map(|_| {
                let layer = input.pick(&["edge", "middle", "...", "", "mid dle", "a"]);
                let attempt = input.pick(&["1", "2", "1000", "1001", "0", "01"]);
                format!("{layer}:{attempt}")
            })
            .collect();
        request.lineage = lineage.join("/");
    }
    if input.byte() % 16 == 1 {
        request.retried_below = input.pick(&["middle", "", "mid/dle", "x"]).to_owned();
    }
    // A hedge, drawn last so that older inputs read the same bytes (and an
    // exhausted input none). Mostly with the failure fields cleared, as a
    // hedge reports no failure; now and then with them, which is invalid.
    if input.byte() % 4 == 1 {
        request.hedge = match input.byte() % 8 {
            0 => input.u32(),
            1 => validate::MAX_HEDGE,
            2 => validate::MAX_HEDGE + 1,
            3 => 5,
            4 => 2,
            5 => 4,
            _ => 1, // the default policy's one hedge
        };
        if input.byte() % 8 != 0 {
            request.evidence = 0;
            request.failure = 0;
            request.http_status = 0;
            request.grpc_status_code = 0;
            request.grpc_retry_pushback_ms = None;
            request.retry_after.clear();
            request.retried_below.clear();
        }
    }
    request
}

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
    if valid.hedge > 0 {
        return Some(check_hedge(&valid, environment));
    }
    let draw = Draw {
        now: now(),
        jitter: environment.jitter,
    };
    let facts = valid.facts(environment.budget, draw);
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
    "lineage",
    "retried_below",
    "hedge",
];

/// Decides a valid hedge request under `environment` and checks it against
/// the hedge rule's order, restated from the contract (`DecideRequest.hedge`
/// and the deny reasons): the kill switch, the policy (none, the
/// idempotency, the number of hedges), the deadline, the fleet's latency
/// (too few samples, uniformly slow), the cap on extra load, the budget.
fn check_hedge(valid: &Attempt<'_>, environment: &Environment) -> Decision {
    let facts = HedgeFacts {
        hedge: valid.hedge,
        idempotency: valid.reported.idempotency,
        deadline_remaining: valid.reported.deadline_remaining,
        min_attempt_budget: environment.policy.min_attempt_budget,
        budget: environment.budget,
    };
    let state = &environment.hedge_state;
    let decision = engine::decide_hedge(&facts, environment.hedging.as_ref(), state);
    let budget = &environment.budget;
    let expected = if !budget.retries_enabled {
        Some(DenyReason::RetriesDisabled)
    } else if let Some(policy) = &environment.hedging {
        let too_few = state.samples < policy.min_samples.max(1);
        let near = |p50: Duration, tail: Duration| {
            p50.as_secs_f64() >= policy.uniform_ratio * tail.as_secs_f64()
        };
        let uniform = near(state.p50, state.tail)
            || (state.recent.samples >= policy.min_samples.max(1)
                && near(state.recent.p50, state.recent.tail));
        let cap = (policy.max_extra_load * state.first_attempts as f64).floor() as u64;
        if facts.idempotency == Idempotency::NonIdempotent
            || !policy.idempotency.contains(facts.idempotency)
            || facts.hedge > policy.max_hedges
        {
            Some(DenyReason::HedgingOff)
        } else if facts
            .deadline_remaining
            .is_some_and(|remaining| remaining < facts.min_attempt_budget)
        {
            Some(DenyReason::Deadline)
        } else if too_few {
            // Not learned yet: hedging is not on, which says nothing of
            // the upstream.
            Some(DenyReason::HedgingOff)
        } else if uniform {
            Some(DenyReason::UniformlySlow)
        } else if state.hedges >= cap {
            Some(DenyReason::HedgeCap)
        } else if budget.unavailable {
            Some(DenyReason::BudgetUnavailable)
        } else if budget.tokens < 1.0 {
            Some(DenyReason::BudgetExhausted)
        } else {
            None
        }
    } else {
        Some(DenyReason::HedgingOff)
    };
    match (expected, decision.verdict) {
        (Some(reason), Verdict::Deny(got)) => {
            assert_eq!(got, reason, "{facts:?} {state:?} {decision:?}");
        }
        (None, Verdict::Retry { backoff, .. }) => {
            // A hedge is sent now: its timer already ran.
            assert_eq!(backoff, Duration::ZERO, "{decision:?}");
        }
        (expected, _) => panic!("hedge expected {expected:?}, got {decision:?} for {facts:?}"),
    }
    assert_eq!(decision.rule, engine::Rule::HEDGE, "{decision:?}");
    assert!(decision.unknown_outcome.is_none(), "a hedge in doubt");
    decision
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
fn check_valid_decide_request(request: &pb::DecideRequest, valid: &Attempt<'_>) {
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
    // The chain: carried over unchanged, within its limits, and a mark from
    // below only with a response that carried it.
    let lineage = valid.reported.lineage;
    assert_eq!(lineage.as_str(), request.lineage);
    assert!(lineage.as_str().len() <= engine::MAX_LINEAGE_BYTES);
    assert!(lineage.depth() as usize <= engine::MAX_LINEAGE_ENTRIES + 1);
    match valid.reported.retried_below {
        Some(layer) => {
            assert_eq!(layer, request.retried_below);
            assert!(engine::layer_name(layer).is_ok());
            assert!(
                !matches!(
                    valid.reported.claimed_evidence,
                    Some(Evidence::NotSent | Evidence::SentNoResponse)
                ) && (status_known || valid.reported.claimed_evidence.is_some()),
                "a mark from below without a response"
            );
        }
        None => assert!(request.retried_below.is_empty()),
    }
    if valid.reported.claimed_evidence.is_none() && valid.hedge == 0 {
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
    // A hedge is carried over within its bound, and reports no failure.
    assert_eq!(valid.hedge, request.hedge);
    assert!(
        valid.hedge <= validate::MAX_HEDGE,
        "hedge {} passed",
        valid.hedge
    );
    if valid.hedge > 0 {
        assert!(
            valid.reported.failure.is_none()
                && valid.reported.claimed_evidence.is_none()
                && !status_known
                && valid.reported.retry_after.is_none()
                && valid.reported.grpc_pushback.is_none()
                && valid.reported.retried_below.is_none(),
            "a hedge with a failure passed: {request:?}"
        );
    }
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
        (facts.retried_below.is_some(), DenyReason::RetriedBelow, 5),
        (
            facts.lineage.enclosing_retry().is_some()
                && policy.inside_enclosing_retry == EnclosingRetry::Deny,
            DenyReason::InsideEnclosingRetry,
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
