//! Table-driven tests of the decision order, one case per rule and per
//! status row, and property tests of the ordering invariant and the backoff
//! bounds.

use super::*;
use crate::explanation::push_decimal;
use proptest::prelude::*;

const NOW_SECS: u64 = 1_800_000_000;

fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(NOW_SECS)
}

/// One case: a description of the attempt, built on top of a baseline that
/// would be a RETRY (idempotent, first attempt, connect failure, full
/// budget).
#[derive(Clone, Debug)]
struct Case {
    idempotency: Idempotency,
    body: Body,
    attempt: u32,
    claimed: Option<Evidence>,
    failure: Option<FailureKind>,
    status: Option<u16>,
    retry_after: Option<&'static str>,
    grpc: Option<GrpcCode>,
    pushback: Option<&'static str>,
    deadline: Option<Duration>,
    first_byte_delivered: bool,
    draining: bool,
    auth_refreshed: bool,
    previous_backoff: Option<Duration>,
    max_attempts: Option<u32>,
    tokens: f64,
    enabled: bool,
    unavailable: bool,
    jitter: f64,
    lineage: &'static str,
    retried_below: Option<&'static str>,
}

fn case() -> Case {
    Case {
        idempotency: Idempotency::Idempotent,
        body: Body::Bytes,
        attempt: 1,
        claimed: None,
        failure: Some(FailureKind::Connect),
        status: None,
        retry_after: None,
        grpc: None,
        pushback: None,
        deadline: None,
        first_byte_delivered: false,
        draining: false,
        auth_refreshed: false,
        previous_backoff: None,
        max_attempts: None,
        tokens: 10.0,
        enabled: true,
        unavailable: false,
        jitter: 0.5,
        lineage: "",
        retried_below: None,
    }
}

impl Case {
    fn status(mut self, status: u16) -> Self {
        self.failure = None;
        self.status = Some(status);
        self
    }
    /// A gRPC call that ended with `code`, its status sent by the server.
    fn grpc(mut self, code: GrpcCode) -> Self {
        self.failure = None;
        self.claimed = Some(Evidence::ResponseReceived);
        self.grpc = Some(code);
        self
    }
    fn pushback(mut self, raw: &'static str) -> Self {
        self.pushback = Some(raw);
        self
    }
    /// Made while serving a request whose lineage is `lineage`.
    fn lineage(mut self, lineage: &'static str) -> Self {
        self.lineage = lineage;
        self
    }
    /// Its response said `layer` had already retried it.
    fn retried_below(mut self, layer: &'static str) -> Self {
        self.retried_below = Some(layer);
        self
    }
    fn idempotency(mut self, idempotency: Idempotency) -> Self {
        self.idempotency = idempotency;
        self
    }
    /// The facts this case decides on.
    fn facts(&self) -> Facts<'_> {
        Facts {
            idempotency: self.idempotency,
            body: &self.body,
            attempt: self.attempt,
            claimed_evidence: self.claimed,
            failure: self.failure,
            http_status: self.status,
            retry_after: self.retry_after,
            grpc_status: self.grpc,
            grpc_pushback: self.pushback,
            deadline_remaining: self.deadline,
            first_byte_delivered: self.first_byte_delivered,
            runtime_draining: self.draining,
            auth_refresh_attempted: self.auth_refreshed,
            previous_backoff: self.previous_backoff,
            max_attempts: self.max_attempts,
            lineage: Lineage::parse(self.lineage).expect("a valid lineage"),
            retried_below: self.retried_below,
            budget: BudgetView {
                tokens: self.tokens,
                retries_enabled: self.enabled,
                unavailable: self.unavailable,
            },
            now: now(),
            jitter: self.jitter,
        }
    }

    fn run(&self, policy: &Policy) -> Decision {
        decide(&self.facts(), policy)
    }
}

/// What a case must produce. A RETRY's backoff is checked separately.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    Retry,
    RetryRefresh,
    Deny(DenyReason),
    Ambiguous,
}

fn check(name: &str, case: Case, expect: Expect, rule: u8) {
    check_with(name, &Policy::default(), case, expect, rule)
}

fn check_with(name: &str, policy: &Policy, case: Case, expect: Expect, rule: u8) {
    let decision = case.run(policy);
    let got = match decision.verdict {
        Verdict::Retry {
            refresh_credentials: true,
            ..
        } => Expect::RetryRefresh,
        Verdict::Retry { .. } => Expect::Retry,
        Verdict::Deny(reason) => Expect::Deny(reason),
        Verdict::Ambiguous => Expect::Ambiguous,
    };
    assert_eq!(got, expect, "{name}: {decision}");
    assert_eq!(decision.rule.number(), rule, "{name}: {decision}");
}

use DenyReason::*;
use Idempotency::*;

#[test]
fn each_rule_in_order() {
    let mut c = case();
    c.attempt = 3;
    check(
        "1: attempts exhausted by policy",
        c,
        Expect::Deny(MaxAttempts),
        1,
    );
    let mut c = case();
    c.max_attempts = Some(1);
    check(
        "1: the caller's own lower limit",
        c,
        Expect::Deny(MaxAttempts),
        1,
    );
    let mut c = case();
    c.attempt = 2;
    c.max_attempts = Some(10);
    check(
        "1: the caller cannot raise the limit",
        c.clone(),
        Expect::Retry,
        9,
    );
    c.attempt = 3;
    check(
        "1: the caller cannot raise the limit",
        c,
        Expect::Deny(MaxAttempts),
        1,
    );

    let mut c = case();
    c.tokens = 0.999;
    check(
        "2: less than one token",
        c,
        Expect::Deny(BudgetExhausted),
        2,
    );
    let mut c = case();
    c.unavailable = true;
    check(
        "2: store unreachable, policy deny",
        c.clone(),
        Expect::Deny(BudgetUnavailable),
        2,
    );
    c.attempt = 3;
    check(
        "1 before 2 even when blind",
        c,
        Expect::Deny(MaxAttempts),
        1,
    );

    for body in [
        Body::InputStream,
        Body::Publisher,
        Body::PublisherFactory(Replayability::OneShot),
    ] {
        let mut c = case();
        c.body = body.clone();
        check(
            &format!("3: {body:?}"),
            c,
            Expect::Deny(BodyNotReplayable),
            3,
        );
    }

    let mut c = case();
    c.first_byte_delivered = true;
    check(
        "4: first byte delivered",
        c,
        Expect::Deny(ResponseAlreadyDelivered),
        4,
    );

    let mut c = case();
    c.draining = true;
    check("5: draining", c, Expect::Deny(RuntimeDraining), 5);
    let mut c = case();
    c.enabled = false;
    check("5: kill switch", c, Expect::Deny(RetriesDisabled), 5);

    let mut c = case();
    c.deadline = Some(Duration::from_millis(49));
    check(
        "6: below min attempt budget",
        c.clone(),
        Expect::Deny(Deadline),
        6,
    );
    c.deadline = Some(Duration::from_millis(50));
    check("6: exactly the min attempt budget", c, Expect::Retry, 9);

    for failure in [
        FailureKind::ProfileRejection,
        FailureKind::TlsCertificateInvalid,
        FailureKind::RequestEncoding,
    ] {
        let mut c = case();
        c.failure = Some(failure);
        check(
            &format!("7: {failure:?}"),
            c,
            Expect::Deny(PermanentFailure),
            7,
        );
    }
    let policy = Policy {
        permanent_failures: vec![FailureKind::Dns],
        ..Policy::default()
    };
    let mut c = case();
    c.failure = Some(FailureKind::Dns);
    check_with(
        "7: added by policy",
        &policy,
        c,
        Expect::Deny(PermanentFailure),
        7,
    );

    let mut c = case().idempotency(NonIdempotent);
    c.failure = Some(FailureKind::ResponseHeaderTimeout);
    check(
        "8: sent, no response, not idempotent",
        c,
        Expect::Ambiguous,
        8,
    );
}

#[test]
fn evidence_rows() {
    for &failure in FailureKind::VARIANTS {
        if failure.is_permanent() {
            continue;
        }
        for idempotency in [Safe, Idempotent, IdempotentWithKey, NonIdempotent] {
            let mut c = case().idempotency(idempotency);
            c.failure = Some(failure);
            let (expect, rule) = match failure.evidence_floor() {
                Evidence::NotSent => (Expect::Retry, 9),
                Evidence::SentNoResponse if idempotency == NonIdempotent => (Expect::Ambiguous, 8),
                Evidence::SentNoResponse => (Expect::Retry, 9),
                Evidence::PartialResponse if idempotency == NonIdempotent => (Expect::Ambiguous, 9),
                Evidence::PartialResponse => (Expect::Retry, 9),
                Evidence::ResponseReceived => unreachable!("no failure implies a response"),
            };
            check(&format!("9: {failure:?} {idempotency:?}"), c, expect, rule);
        }
    }
    // A partial response with an error status follows the status rules.
    let mut c = case().idempotency(NonIdempotent).status(503);
    c.failure = Some(FailureKind::DecodeReset);
    check(
        "9: partial 503 not idempotent",
        c.clone(),
        Expect::Ambiguous,
        9,
    );
    c.status = Some(404);
    check(
        "9: partial 404",
        c.clone(),
        Expect::Deny(StatusNotRetryable),
        9,
    );
    c.status = Some(200);
    check(
        "9: partial 200 not idempotent",
        c.clone(),
        Expect::Ambiguous,
        9,
    );
    c.idempotency = Safe;
    check("9: partial 200 safe", c, Expect::Retry, 9);
}

#[test]
fn status_rows() {
    let rows: &[(u16, Idempotency, u32, Expect)] = &[
        (408, NonIdempotent, 1, Expect::Retry),
        (425, NonIdempotent, 1, Expect::Retry),
        (425, Safe, 2, Expect::Deny(StatusNotRetryable)),
        (429, NonIdempotent, 1, Expect::Retry),
        (401, Safe, 1, Expect::RetryRefresh),
        (401, Idempotent, 1, Expect::Deny(StatusNotRetryable)),
        (500, Safe, 1, Expect::Deny(StatusNotRetryable)),
        (502, Idempotent, 1, Expect::Retry),
        (503, IdempotentWithKey, 1, Expect::Retry),
        (504, Safe, 1, Expect::Retry),
        (502, NonIdempotent, 1, Expect::Ambiguous),
        (503, NonIdempotent, 1, Expect::Ambiguous),
        (504, NonIdempotent, 1, Expect::Ambiguous),
        (200, Safe, 1, Expect::Deny(StatusNotRetryable)),
        (301, Safe, 1, Expect::Deny(StatusNotRetryable)),
        (400, Safe, 1, Expect::Deny(StatusNotRetryable)),
        (403, Safe, 1, Expect::Deny(StatusNotRetryable)),
        (404, Safe, 1, Expect::Deny(StatusNotRetryable)),
        (409, Safe, 1, Expect::Deny(StatusNotRetryable)),
        (501, Safe, 1, Expect::Deny(StatusNotRetryable)),
        (505, Safe, 1, Expect::Deny(StatusNotRetryable)),
    ];
    for &(status, idempotency, attempt, expect) in rows {
        let mut c = case().idempotency(idempotency).status(status);
        c.attempt = attempt;
        check(
            &format!("{status} {idempotency:?} attempt {attempt}"),
            c,
            expect,
            9,
        );
    }

    let mut c = case().idempotency(Safe).status(401);
    c.auth_refreshed = true;
    check(
        "401 already refreshed",
        c,
        Expect::Deny(StatusNotRetryable),
        9,
    );

    let transient = Policy {
        transient_500: true,
        ..Policy::default()
    };
    let c = case().idempotency(Idempotent).status(500);
    check_with("500 transient idempotent", &transient, c, Expect::Retry, 9);
    let c = case().idempotency(NonIdempotent).status(500);
    check_with(
        "500 transient not idempotent",
        &transient,
        c,
        Expect::Deny(StatusNotRetryable),
        9,
    );
}

#[test]
fn evidence_is_never_upgraded() {
    use Evidence::*;
    // (claim, failure, status) -> (effective, adjusted)
    type Row = (
        Option<Evidence>,
        Option<FailureKind>,
        Option<u16>,
        Evidence,
        bool,
    );
    let rows: &[Row] = &[
        (
            Some(NotSent),
            Some(FailureKind::GenericIo),
            None,
            SentNoResponse,
            true,
        ),
        (Some(NotSent), None, None, SentNoResponse, true),
        (
            Some(NotSent),
            Some(FailureKind::Connect),
            None,
            NotSent,
            false,
        ),
        (
            Some(NotSent),
            Some(FailureKind::PartialWrite),
            None,
            SentNoResponse,
            true,
        ),
        (
            Some(NotSent),
            Some(FailureKind::RequestEncoding),
            None,
            SentNoResponse,
            true,
        ),
        (Some(NotSent), None, Some(503), ResponseReceived, true),
        (
            Some(SentNoResponse),
            Some(FailureKind::Dns),
            None,
            SentNoResponse,
            false,
        ),
        (
            Some(ResponseReceived),
            Some(FailureKind::DecodeReset),
            Some(200),
            PartialResponse,
            true,
        ),
        (
            Some(PartialResponse),
            None,
            Some(200),
            PartialResponse,
            false,
        ),
        (
            None,
            Some(FailureKind::Http2RefusedStream),
            None,
            NotSent,
            false,
        ),
        (
            None,
            Some(FailureKind::GenericIo),
            None,
            SentNoResponse,
            false,
        ),
        (None, None, Some(429), ResponseReceived, false),
        // Something only a server sends (a pushback trailer) weakens a
        // NOT_SENT claim even with a failure that would prove it.
        (
            Some(NotSent),
            Some(FailureKind::Connect),
            Some(14),
            ResponseReceived,
            true,
        ),
        (
            None,
            Some(FailureKind::InterruptedStream),
            None,
            PartialResponse,
            false,
        ),
    ];
    for &(claim, failure, status, effective, adjusted) in rows {
        assert_eq!(
            effective_evidence(claim, failure, status.is_some()),
            (effective, adjusted),
            "{claim:?} {failure:?} {status:?}"
        );
    }
    // The payment case: a timeout claimed as NOT_SENT is ambiguous, and the
    // explanation says the claim was weakened.
    let mut c = case().idempotency(NonIdempotent);
    c.claimed = Some(NotSent);
    c.failure = Some(FailureKind::GenericIo);
    let decision = c.run(&Policy::default());
    assert_eq!(decision.verdict, Verdict::Ambiguous);
    assert_eq!(decision.effective_evidence, SentNoResponse);
    assert!(decision.to_string().contains("weakened"), "{decision}");
}

#[test]
fn multipart_takes_the_weakest_part() {
    use Replayability::*;
    let body = |parts| Body::Multipart(parts);
    assert_eq!(
        body(vec![Body::Bytes, Body::ReopenableSupplier]).replayability(),
        Reopenable
    );
    assert_eq!(
        body(vec![Body::Bytes, Body::InputStream]).replayability(),
        OneShot
    );
    assert_eq!(
        body(vec![
            Body::EncodedValue,
            body(vec![Body::PublisherFactory(OneShot)])
        ])
        .replayability(),
        OneShot
    );
    assert_eq!(
        body(vec![Body::None, Body::PublisherFactory(Replayable)]).replayability(),
        Replayable
    );
    let mut c = case();
    c.body = body(vec![Body::Bytes, Body::Publisher]);
    check(
        "3: multipart with a publisher",
        c,
        Expect::Deny(BodyNotReplayable),
        3,
    );
    let mut c = case();
    c.body = Body::ReopenableSupplier;
    check("3: reopenable may retry", c, Expect::Retry, 9);
}

fn backoff_of(case: &Case, policy: &Policy) -> Duration {
    match case.run(policy).verdict {
        Verdict::Retry { backoff, .. } => backoff,
        other => panic!("expected a retry, got {other:?}"),
    }
}

#[test]
fn backoff_full_jitter_doubles_up_to_max() {
    let policy = Policy {
        max_attempts: 20,
        ..Policy::default()
    };
    let mut c = case();
    c.jitter = 0.999_999;
    for (attempt, ceiling_ms) in [
        (1, 50),
        (2, 100),
        (3, 200),
        (7, 3200),
        (8, 5000),
        (19, 5000),
    ] {
        c.attempt = attempt;
        let backoff = backoff_of(&c, &policy);
        assert!(
            backoff <= Duration::from_millis(ceiling_ms),
            "attempt {attempt}: {backoff:?}"
        );
        assert!(
            backoff >= Duration::from_millis(ceiling_ms) * 99 / 100,
            "attempt {attempt}: {backoff:?}"
        );
    }
    c.jitter = 0.0;
    assert_eq!(backoff_of(&c, &policy), Duration::ZERO);
}

#[test]
fn backoff_decorrelated() {
    let policy = Policy {
        backoff: Backoff {
            jitter: Jitter::Decorrelated,
            ..Backoff::default()
        },
        ..Policy::default()
    };
    let mut c = case();
    c.jitter = 0.0;
    assert_eq!(
        backoff_of(&c, &policy),
        Duration::from_millis(50),
        "no previous: base"
    );
    c.previous_backoff = Some(Duration::from_millis(400));
    c.jitter = 0.5;
    // Uniform in 50..1200 at the midpoint.
    assert_eq!(backoff_of(&c, &policy), Duration::from_millis(625));
    c.previous_backoff = Some(Duration::from_secs(10));
    c.jitter = 0.999_999;
    let backoff = backoff_of(&c, &policy);
    assert!(
        backoff <= Duration::from_secs(5),
        "capped at max: {backoff:?}"
    );
    assert!(backoff >= Duration::from_millis(4990), "{backoff:?}");
}

#[test]
fn retry_after_is_a_floor_within_the_deadline() {
    let mut c = case().idempotency(NonIdempotent).status(429);
    c.retry_after = Some("2");
    assert_eq!(backoff_of(&c, &Policy::default()), Duration::from_secs(2));
    // The HTTP-date form, 3 s ahead of now.
    let body = Body::None;
    let facts = Facts {
        idempotency: NonIdempotent,
        body: &body,
        attempt: 1,
        claimed_evidence: None,
        failure: None,
        http_status: Some(429),
        retry_after: Some("Fri, 15 Jan 2027 08:00:03 GMT"),
        grpc_status: None,
        grpc_pushback: None,
        deadline_remaining: None,
        first_byte_delivered: false,
        runtime_draining: false,
        auth_refresh_attempted: false,
        previous_backoff: None,
        max_attempts: None,
        lineage: Lineage::EDGE,
        retried_below: None,
        budget: BudgetView {
            tokens: 1.0,
            retries_enabled: true,
            unavailable: false,
        },
        now: httpdate::parse_http_date("Fri, 15 Jan 2027 08:00:00 GMT").expect("valid date"),
        jitter: 0.0,
    };
    match decide(&facts, &Policy::default()).verdict {
        Verdict::Retry { backoff, .. } => assert_eq!(backoff, Duration::from_secs(3)),
        other => panic!("{other:?}"),
    }
    // Unparseable: ignored.
    c.retry_after = Some("later, please");
    c.jitter = 0.0;
    assert_eq!(backoff_of(&c, &Policy::default()), Duration::ZERO);
    // Longer than max_retry_after: deny.
    c.retry_after = Some("61");
    check(
        "retry-after above max",
        c.clone(),
        Expect::Deny(Deadline),
        6,
    );
    // Does not fit the deadline: deny.
    c.retry_after = Some("2");
    c.deadline = Some(Duration::from_millis(2049));
    check(
        "retry-after beyond deadline",
        c.clone(),
        Expect::Deny(Deadline),
        6,
    );
    c.deadline = Some(Duration::from_millis(2050));
    assert_eq!(backoff_of(&c, &Policy::default()), Duration::from_secs(2));
    // A computed backoff is shortened to fit instead.
    let mut c = case();
    c.attempt = 2;
    c.jitter = 0.999;
    c.deadline = Some(Duration::from_millis(80));
    assert_eq!(
        backoff_of(&c, &Policy::default()),
        Duration::from_millis(30)
    );
}

#[test]
fn explanations_name_the_rule() {
    let mut c = case();
    c.tokens = 0.0;
    let text = c.run(&Policy::default()).to_string();
    assert_eq!(text, "deny: the upstream's retry budget is empty (rule 2)");
    let text = case().status(404).run(&Policy::default()).to_string();
    assert_eq!(
        text,
        "deny: the status is not retryable for this operation (rule 9, status 404)"
    );
}

/// Rule 5 in a call chain (docs/lineage.md): the layer nearest the failure
/// retries it, and no other.
#[test]
fn only_one_layer_retries_a_failure() {
    let policy = Policy::default();
    let allow = Policy {
        inside_enclosing_retry: EnclosingRetry::Allow,
        ..Policy::default()
    };
    let failing = || case().status(503);
    // The nearest layer, every enclosing call on its first attempt: retried.
    check(
        "5: first attempts",
        failing().lineage("edge:1/middle:1"),
        Expect::Retry,
        9,
    );
    // A failure already retried below is denied, whatever the policy.
    for policy in [&policy, &allow] {
        check_with(
            "5: retried below",
            policy,
            failing().retried_below("middle"),
            Expect::Deny(RetriedBelow),
            5,
        );
    }
    // Inside an enclosing retry: denied by default, retried when allowed.
    for lineage in ["edge:2", "edge:2/middle:1", "edge:1/middle:3", "...:4/x:1"] {
        let inside = failing().lineage(lineage);
        check(
            "5: inside a retry",
            inside,
            Expect::Deny(InsideEnclosingRetry),
            5,
        );
        check_with(
            "5: allowed",
            &allow,
            failing().lineage(lineage),
            Expect::Retry,
            9,
        );
    }
    // Earlier rules decide first; rule 5's own order is draining, the
    // operator's switch, then the chain.
    let mut exhausted = failing().retried_below("middle").lineage("edge:2");
    exhausted.attempt = 3;
    check("1 before 5", exhausted, Expect::Deny(MaxAttempts), 1);
    let mut draining = failing().retried_below("middle");
    draining.draining = true;
    check("draining first", draining, Expect::Deny(RuntimeDraining), 5);
    let mut disabled = failing().lineage("edge:2");
    disabled.enabled = false;
    check("switch first", disabled, Expect::Deny(RetriesDisabled), 5);
    // The chain's denial keeps the mark: a timed-out POST is still unknown.
    let mut post = case().idempotency(NonIdempotent).lineage("edge:2");
    post.failure = Some(FailureKind::ResponseHeaderTimeout);
    let decision = post.run(&policy);
    assert_eq!(decision.verdict, Verdict::Deny(InsideEnclosingRetry));
    assert_eq!(decision.unknown_outcome, Some(UnknownOutcome::Reconcile));
}

#[test]
fn a_chain_denial_names_its_layers() {
    let below = case().status(503).retried_below("middle");
    assert_eq!(
        below.run(&Policy::default()).explanation_in(&below.facts()),
        "deny: a layer below already retried this failure, and only the layer nearest a \
         failure retries it (rule 5, retried by layer middle)"
    );
    let inside = case().status(503).lineage("edge:3/middle:1");
    assert_eq!(
        inside
            .run(&Policy::default())
            .explanation_in(&inside.facts()),
        "deny: a layer above is already retrying the request this call serves (rule 5, \
         inside attempt 3 of layer edge)"
    );
    // Without the facts, the same sentence without names.
    assert_eq!(
        inside.run(&Policy::default()).explanation(),
        "deny: a layer above is already retrying the request this call serves (rule 5)"
    );
}

/// Every branch of the explanation text, exactly: callers log it and
/// people read it, so a rewrite for speed must not change a byte.
#[test]
fn every_explanation_word_for_word() {
    let decision = |verdict, rule, status, adjusted| Decision {
        verdict,
        rule,
        effective_evidence: Evidence::SentNoResponse,
        evidence_adjusted: adjusted,
        unknown_outcome: None,
        http_status: status,
        grpc_status: None,
        hedge: None,
    };
    let retry = |refresh_credentials| Verdict::Retry {
        backoff: Duration::from_micros(1_234_567),
        refresh_credentials,
    };
    let cases = [
        (
            decision(retry(true), Rule::STATUS, Some(401), false),
            "retry after 1234ms: refresh credentials and replay once (rule 9, 401)",
        ),
        (
            decision(retry(false), Rule::STATUS, Some(503), false),
            "retry after 1234ms: status 503 is retryable (rule 9)",
        ),
        (
            decision(retry(false), Rule::STATUS, None, true),
            "retry after 1234ms: evidence sent_no_response allows another attempt (rule 9); \
             the claimed evidence was weakened to sent_no_response",
        ),
        (
            decision(Verdict::Ambiguous, Rule::AMBIGUOUS_SEND, None, false),
            "ambiguous: the request was sent and may have taken effect; the operation is not \
             idempotent, so reconcile (rule 8)",
        ),
        (
            decision(Verdict::Ambiguous, Rule::STATUS, Some(500), false),
            "ambiguous: evidence sent_no_response means the request may have taken effect; \
             the operation is not idempotent, so reconcile (rule 9)",
        ),
        (
            decision(Verdict::Deny(MaxAttempts), Rule::MAX_ATTEMPTS, None, false),
            "deny: no attempts left (rule 1)",
        ),
        (
            decision(Verdict::Deny(BudgetExhausted), Rule::BUDGET, None, false),
            "deny: the upstream's retry budget is empty (rule 2)",
        ),
        (
            decision(Verdict::Deny(BudgetUnavailable), Rule::BUDGET, None, false),
            "deny: the shared retry budget is unreachable and the policy is to deny (rule 2)",
        ),
        (
            decision(Verdict::Deny(BodyNotReplayable), Rule::BODY, None, false),
            "deny: the body cannot be sent again (rule 3)",
        ),
        (
            decision(
                Verdict::Deny(ResponseAlreadyDelivered),
                Rule::FIRST_BYTE,
                None,
                false,
            ),
            "deny: part of the response already reached the application (rule 4)",
        ),
        (
            decision(Verdict::Deny(RuntimeDraining), Rule::DRAINING, None, false),
            "deny: the caller's runtime is draining (rule 5)",
        ),
        (
            decision(Verdict::Deny(RetriesDisabled), Rule::BUDGET, None, false),
            "deny: an operator switched retries off for this upstream (rule 2)",
        ),
        (
            decision(Verdict::Deny(RetriedBelow), Rule::DRAINING, None, false),
            "deny: a layer below already retried this failure, and only the layer nearest a \
             failure retries it (rule 5)",
        ),
        (
            decision(
                Verdict::Deny(InsideEnclosingRetry),
                Rule::DRAINING,
                None,
                false,
            ),
            "deny: a layer above is already retrying the request this call serves (rule 5)",
        ),
        (
            decision(Verdict::Deny(Deadline), Rule::DEADLINE, None, false),
            "deny: the remaining deadline leaves no room for another attempt (rule 6)",
        ),
        (
            decision(Verdict::Deny(PermanentFailure), Rule::PERMANENT, None, true),
            "deny: the failure is permanent (rule 7); the claimed evidence was weakened to \
             sent_no_response",
        ),
        (
            decision(
                Verdict::Deny(StatusNotRetryable),
                Rule::STATUS,
                Some(404),
                false,
            ),
            "deny: the status is not retryable for this operation (rule 9, status 404)",
        ),
        (
            decision(Verdict::Deny(StatusNotRetryable), Rule::STATUS, None, false),
            "deny: the outcome is not retryable for this operation (rule 9)",
        ),
    ];
    for (decision, text) in cases {
        assert_eq!(decision.to_string(), text, "{decision:?}");
    }
}

#[test]
fn decimals_as_format_writes_them() {
    for n in [0, 7, 10, 99, 1_234, 1_000_000, u64::MAX] {
        let mut text = String::from("x");
        push_decimal(&mut text, n);
        assert_eq!(text, format!("x{n}"));
    }
}

#[test]
fn losing_the_token_race_is_a_budget_denial() {
    let decision = case()
        .run(&Policy::default())
        .into_budget_denial(BudgetExhausted);
    assert_eq!(decision.verdict, Verdict::Deny(BudgetExhausted));
    assert_eq!(decision.rule, Rule::BUDGET);
}

// ---- properties -----------------------------------------------------------

fn any_idempotency() -> impl Strategy<Value = Idempotency> {
    prop_oneof![
        Just(Safe),
        Just(Idempotent),
        Just(IdempotentWithKey),
        Just(NonIdempotent)
    ]
}

fn any_body() -> impl Strategy<Value = Body> {
    let leaf = prop_oneof![
        Just(Body::None),
        Just(Body::Bytes),
        Just(Body::EncodedValue),
        Just(Body::ReopenableSupplier),
        Just(Body::InputStream),
        Just(Body::Publisher),
        prop_oneof![
            Just(Replayability::OneShot),
            Just(Replayability::Reopenable),
            Just(Replayability::Replayable)
        ]
        .prop_map(Body::PublisherFactory),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop::collection::vec(inner, 1..4).prop_map(Body::Multipart)
    })
}

fn any_case() -> impl Strategy<Value = Case> {
    (
        (
            any_idempotency(),
            any_body(),
            1u32..6,
            prop::option::of(prop_oneof![
                Just(Evidence::NotSent),
                Just(Evidence::SentNoResponse),
                Just(Evidence::ResponseReceived),
                Just(Evidence::PartialResponse)
            ]),
            prop::option::of(prop::sample::select(FailureKind::VARIANTS.to_vec())),
            prop::option::of(prop_oneof![100u16..600, Just(401), Just(429), Just(503)]),
            prop::option::of(prop_oneof![Just("1"), Just("100"), Just("junk")]),
            prop::option::of(prop::sample::select(GrpcCode::VARIANTS.to_vec())),
            prop::option::of(prop_oneof![
                Just("0"),
                Just("300"),
                Just("-1"),
                Just("junk"),
                Just("99999999")
            ]),
            any::<bool>(),
        ),
        (
            prop::option::of((0u64..3000).prop_map(Duration::from_millis)),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            prop::option::of((0u64..10_000).prop_map(Duration::from_millis)),
            prop::option::of(1u32..5),
            0.0f64..3.0,
            any::<bool>(),
            0.0f64..1.0,
            prop::bool::weighted(0.05),
        ),
        (
            prop::sample::select(vec![
                "",
                "",
                "",
                "edge:1",
                "edge:2",
                "edge:1/middle:1",
                "edge:3/middle:1",
                "...:4/middle:1",
            ]),
            // Mostly none: the mark decides whenever it is set.
            prop::option::weighted(0.15, Just("middle")),
        ),
    )
        .prop_map(|(a, b, c)| {
            // An HTTP call or a gRPC call, as validation allows: never both.
            let grpc_call = a.9;
            Case {
                idempotency: a.0,
                body: a.1,
                attempt: a.2,
                claimed: a.3,
                failure: a.4,
                status: if grpc_call { None } else { a.5 },
                retry_after: if grpc_call { None } else { a.6 },
                grpc: if grpc_call { a.7 } else { None },
                pushback: if grpc_call { a.8 } else { None },
                deadline: b.0,
                first_byte_delivered: b.1,
                draining: b.2,
                auth_refreshed: b.3,
                previous_backoff: b.4,
                max_attempts: b.5,
                tokens: b.6,
                enabled: b.7,
                unavailable: b.9,
                jitter: b.8,
                lineage: c.0,
                retried_below: c.1,
            }
        })
}

/// The first of rules 1 to 7 that applies to `case`, independently of the
/// engine's own code.
fn first_forbidding_rule(case: &Case, policy: &Policy) -> Option<(DenyReason, u8)> {
    let limit = case
        .max_attempts
        .map_or(policy.max_attempts, |m| m.min(policy.max_attempts));
    let checks = [
        (case.attempt >= limit, MaxAttempts, 1),
        (case.unavailable, BudgetUnavailable, 2),
        (case.tokens < 1.0, BudgetExhausted, 2),
        (
            case.body.replayability() == Replayability::OneShot,
            BodyNotReplayable,
            3,
        ),
        (case.first_byte_delivered, ResponseAlreadyDelivered, 4),
        (case.draining, RuntimeDraining, 5),
        (!case.enabled, RetriesDisabled, 5),
        (case.retried_below.is_some(), RetriedBelow, 5),
        (
            // Restated: some entry's attempt is not 1.
            case.lineage
                .split('/')
                .any(|entry| !entry.is_empty() && !entry.ends_with(":1"))
                && policy.inside_enclosing_retry == EnclosingRetry::Deny,
            InsideEnclosingRetry,
            5,
        ),
        (
            case.deadline.is_some_and(|d| d < policy.min_attempt_budget),
            Deadline,
            6,
        ),
        (
            case.failure
                .is_some_and(|f| f.is_permanent() || policy.permanent_failures.contains(&f)),
            PermanentFailure,
            7,
        ),
    ];
    checks
        .into_iter()
        .find(|(applies, _, _)| *applies)
        .map(|(_, reason, rule)| (reason, rule))
}

proptest! {
    /// Whenever one of rules 1 to 7 applies, the verdict is that rule's
    /// DENY, whatever the other inputs: no later rule re-enables a retry.
    #[test]
    fn earlier_rules_always_win(case in any_case()) {
        let policy = Policy::default();
        let decision = case.run(&policy);
        if let Some((reason, rule)) = first_forbidding_rule(&case, &policy) {
            prop_assert_eq!(decision.verdict, Verdict::Deny(reason));
            prop_assert_eq!(decision.rule.number(), rule);
        } else {
            prop_assert!(decision.rule.number() >= 6, "{}", decision);
        }
    }

    /// What the service's one-store-call decision rests on: a budget that
    /// allows gives exactly the decision of an open budget, and one that
    /// does not changes it, if at all, only into a DENY of rule 2 or 5.
    #[test]
    fn the_budget_can_only_deny(case in any_case()) {
        let policy = Policy::default();
        let decision = case.run(&policy);
        let open = Case {
            tokens: BudgetView::OPEN.tokens,
            enabled: BudgetView::OPEN.retries_enabled,
            unavailable: BudgetView::OPEN.unavailable,
            ..case.clone()
        }
        .run(&policy);
        let view = BudgetView {
            tokens: case.tokens,
            retries_enabled: case.enabled,
            unavailable: case.unavailable,
        };
        if view.allows() {
            prop_assert_eq!(decision, open);
        } else if decision != open {
            prop_assert!(matches!(decision.verdict, Verdict::Deny(_)), "{}", decision);
            prop_assert!(matches!(decision.rule.number(), 2 | 5), "{}", decision);
        }
    }

    /// A claim is never made stronger; evidence NOT_SENT needs a proving
    /// failure.
    #[test]
    fn evidence_never_upgraded(case in any_case()) {
        let decision = case.run(&Policy::default());
        if let Some(claim) = case.claimed {
            prop_assert!(decision.effective_evidence >= claim);
        }
        if decision.effective_evidence == Evidence::NotSent {
            prop_assert!(case.failure.is_some_and(|f| f.evidence_floor() == Evidence::NotSent));
            prop_assert!(case.status.is_none());
            prop_assert!(case.pushback.is_none());
        }
        // Not idempotent and possibly executed: never a retry.
        if case.idempotency == NonIdempotent
            && matches!(decision.effective_evidence, Evidence::SentNoResponse)
        {
            let retried = matches!(decision.verdict, Verdict::Retry { .. });
            prop_assert!(!retried);
        }
    }

    /// A backoff never exceeds max backoff (unless a Retry-After floor asks
    /// for more), never undercuts a Retry-After, and always leaves the
    /// minimum attempt budget inside the deadline.
    #[test]
    fn backoff_bounds(case in any_case(), decorrelated in any::<bool>()) {
        let mut policy = Policy::default();
        if decorrelated {
            policy.backoff.jitter = Jitter::Decorrelated;
        }
        if let Verdict::Retry { backoff, .. } = case.run(&policy).verdict {
            let floor = match case.pushback.map(parse_pushback) {
                Some(Pushback::Wait(wait)) => Some(wait),
                Some(Pushback::DoNotRetry) => {
                    prop_assert!(false, "a retry despite a do-not-retry pushback");
                    None
                }
                None => case.retry_after.and_then(|raw| parse_retry_after(raw, now())),
            };
            prop_assert!(backoff <= policy.backoff.max.max(floor.unwrap_or_default()));
            if let Some(floor) = floor {
                prop_assert!(backoff >= floor);
                prop_assert!(floor <= policy.max_retry_after);
            }
            if let Some(deadline) = case.deadline {
                prop_assert!(backoff + policy.min_attempt_budget <= deadline);
            }
        }
    }
}

proptest! {
    /// Rule 8 wins over every gRPC code: a non-idempotent call that may
    /// have run is AMBIGUOUS whatever code its library reported, unless an
    /// earlier rule denied it.
    #[test]
    fn rule_8_wins_over_every_grpc_code(
        case in any_case(),
        code in prop::sample::select(GrpcCode::VARIANTS.to_vec()),
    ) {
        let policy = Policy::default();
        let case = Case {
            idempotency: NonIdempotent,
            claimed: Some(Evidence::SentNoResponse),
            status: None,
            retry_after: None,
            pushback: None,
            grpc: Some(code),
            ..case
        };
        let decision = case.run(&policy);
        // (A failure like a decode reset weakens the claim past it.)
        if first_forbidding_rule(&case, &policy).is_none()
            && decision.effective_evidence == Evidence::SentNoResponse
        {
            prop_assert_eq!(decision.verdict, Verdict::Ambiguous, "{}", decision);
            prop_assert_eq!(decision.rule, Rule::AMBIGUOUS_SEND);
        }
    }

    /// Proven never sent is a RETRY whatever the code (rule 0 evidence
    /// decides first), once rules 1 to 7 let it through.
    #[test]
    fn not_sent_retries_whatever_the_code(
        code in prop::sample::select(GrpcCode::VARIANTS.to_vec()),
        idempotency in any_idempotency(),
    ) {
        let c = Case { grpc: Some(code), idempotency, ..case() };
        let decision = c.run(&Policy::default());
        prop_assert!(matches!(decision.verdict, Verdict::Retry { .. }), "{}", decision);
        prop_assert_eq!(decision.effective_evidence, Evidence::NotSent);
    }
}

/// Every row of the gRPC table (README "gRPC outcomes"), with the HTTP row
/// it mirrors, for a server-sent status (RESPONSE_RECEIVED).
#[test]
fn grpc_rows() {
    use GrpcCode::*;
    let rows: &[(&str, Case, Expect)] = &[
        (
            "unavailable, safe",
            case().grpc(Unavailable).idempotency(Safe),
            Expect::Retry,
        ),
        (
            "unavailable, keyed",
            case().grpc(Unavailable).idempotency(IdempotentWithKey),
            Expect::Retry,
        ),
        (
            "unavailable, not idempotent",
            case().grpc(Unavailable).idempotency(NonIdempotent),
            Expect::Ambiguous,
        ),
        (
            "exhausted with pushback",
            case().grpc(ResourceExhausted).pushback("300"),
            Expect::Retry,
        ),
        (
            "exhausted with pushback, not idempotent (as 429)",
            case()
                .grpc(ResourceExhausted)
                .pushback("300")
                .idempotency(NonIdempotent),
            Expect::Retry,
        ),
        (
            "exhausted without pushback",
            case().grpc(ResourceExhausted),
            Expect::Deny(StatusNotRetryable),
        ),
        (
            "exhausted, pushback 0",
            case().grpc(ResourceExhausted).pushback("0"),
            Expect::Retry,
        ),
        (
            "negative pushback",
            case().grpc(ResourceExhausted).pushback("-1"),
            Expect::Deny(ServerPushback),
        ),
        (
            "garbage pushback",
            case().grpc(Unavailable).pushback("soon"),
            Expect::Deny(ServerPushback),
        ),
        (
            "empty pushback",
            case().grpc(Unavailable).pushback(""),
            Expect::Deny(ServerPushback),
        ),
        (
            "fractional pushback",
            case().grpc(Unavailable).pushback("1.5"),
            Expect::Deny(ServerPushback),
        ),
        (
            "negative pushback on a denied code",
            case().grpc(Aborted).pushback("-1"),
            Expect::Deny(ServerPushback),
        ),
        (
            "valid pushback on a denied code",
            case().grpc(Aborted).pushback("10"),
            Expect::Deny(StatusNotRetryable),
        ),
        (
            "deadline, idempotent",
            case().grpc(DeadlineExceeded),
            Expect::Retry,
        ),
        (
            "deadline, not idempotent",
            case().grpc(DeadlineExceeded).idempotency(NonIdempotent),
            Expect::Ambiguous,
        ),
        (
            "unauthenticated, safe",
            case().grpc(Unauthenticated).idempotency(Safe),
            Expect::RetryRefresh,
        ),
        (
            "unauthenticated, idempotent",
            case().grpc(Unauthenticated),
            Expect::Deny(StatusNotRetryable),
        ),
        (
            "internal",
            case().grpc(Internal),
            Expect::Deny(StatusNotRetryable),
        ),
        (
            "unknown",
            case().grpc(Unknown),
            Expect::Deny(StatusNotRetryable),
        ),
        (
            "aborted",
            case().grpc(Aborted),
            Expect::Deny(StatusNotRetryable),
        ),
        (
            "cancelled",
            case().grpc(Cancelled),
            Expect::Deny(StatusNotRetryable),
        ),
        (
            "invalid argument",
            case().grpc(InvalidArgument),
            Expect::Deny(StatusNotRetryable),
        ),
        (
            "unimplemented",
            case().grpc(Unimplemented),
            Expect::Deny(StatusNotRetryable),
        ),
    ];
    for (name, c, expect) in rows {
        check(name, c.clone(), *expect, 9);
    }
    let mut c = case().grpc(Unauthenticated).idempotency(Safe);
    c.auth_refreshed = true;
    check(
        "unauthenticated after a refresh",
        c,
        Expect::Deny(StatusNotRetryable),
        9,
    );

    // INTERNAL and UNKNOWN registered by the upstream: as a transient 500.
    let registered = Policy {
        grpc_retryable: GrpcCodes::DEFAULT.with(Internal).with(Unknown),
        ..Policy::default()
    };
    check_with(
        "internal registered",
        &registered,
        case().grpc(Internal),
        Expect::Retry,
        9,
    );
    check_with(
        "unknown registered",
        &registered,
        case().grpc(Unknown),
        Expect::Retry,
        9,
    );
    check_with(
        "internal registered, not idempotent",
        &registered,
        case().grpc(Internal).idempotency(NonIdempotent),
        Expect::Deny(StatusNotRetryable),
        9,
    );
    // An upstream that lists only UNAVAILABLE retries nothing else.
    let only_unavailable = Policy {
        grpc_retryable: [Unavailable].into_iter().collect(),
        ..Policy::default()
    };
    check_with(
        "deadline unlisted",
        &only_unavailable,
        case().grpc(DeadlineExceeded),
        Expect::Deny(StatusNotRetryable),
        9,
    );
    check_with(
        "unavailable listed",
        &only_unavailable,
        case().grpc(Unavailable),
        Expect::Retry,
        9,
    );
}

/// The evidence rows of a gRPC call: a code alone proves no response.
#[test]
fn grpc_evidence() {
    use Evidence::*;
    use GrpcCode::*;
    // Unclaimed, no failure: SENT_NO_RESPONSE, so rule 8 answers for a
    // call that is not idempotent.
    let mut c = case().grpc(Unavailable).idempotency(NonIdempotent);
    c.claimed = None;
    let decision = c.run(&Policy::default());
    assert_eq!(decision.effective_evidence, SentNoResponse);
    assert_eq!(
        (decision.verdict, decision.rule),
        (Verdict::Ambiguous, Rule::AMBIGUOUS_SEND)
    );
    // A reset after the request was written, on an idempotent call: the code
    // still speaks (CANCELLED is the caller's own doing).
    let mut c = case().grpc(Cancelled);
    c.claimed = Some(SentNoResponse);
    check(
        "cancelled after sending",
        c,
        Expect::Deny(StatusNotRetryable),
        9,
    );
    let mut c = case().grpc(Unavailable);
    c.claimed = Some(SentNoResponse);
    c.failure = Some(FailureKind::ConnectionReset);
    check("reset after sending", c, Expect::Retry, 9);
    // A library-made UNAVAILABLE with a proving failure: NOT_SENT, retried
    // even when not idempotent.
    let mut c = case().grpc(Unavailable).idempotency(NonIdempotent);
    c.claimed = Some(NotSent);
    c.failure = Some(FailureKind::Connect);
    let decision = c.run(&Policy::default());
    assert_eq!(decision.effective_evidence, NotSent);
    assert!(
        matches!(decision.verdict, Verdict::Retry { .. }),
        "{decision}"
    );
    // A pushback is the server's: a NOT_SENT claim is weakened.
    let mut c = case().grpc(ResourceExhausted).pushback("100");
    c.claimed = Some(NotSent);
    c.failure = Some(FailureKind::Connect);
    let decision = c.run(&Policy::default());
    assert_eq!(decision.effective_evidence, ResponseReceived);
    assert!(decision.evidence_adjusted);
    // A partial response with a code (a stream that broke): the code decides.
    let mut c = case().grpc(Internal);
    c.claimed = Some(PartialResponse);
    check("partial, internal", c, Expect::Deny(StatusNotRetryable), 9);
}

/// A valid pushback is a floor on the backoff, inside `max_retry_after`
/// and the deadline, exactly as Retry-After is.
#[test]
fn pushback_is_a_floor_within_the_deadline() {
    let mut c = case().grpc(GrpcCode::ResourceExhausted).pushback("300");
    c.jitter = 0.0;
    assert_eq!(
        backoff_of(&c, &Policy::default()),
        Duration::from_millis(300)
    );
    c.pushback = Some(" 2000 ");
    assert_eq!(backoff_of(&c, &Policy::default()), Duration::from_secs(2));
    c.pushback = Some("61000");
    check(
        "pushback above max_retry_after",
        c.clone(),
        Expect::Deny(Deadline),
        6,
    );
    c.pushback = Some("99999999999999999999999");
    check("pushback beyond u64", c.clone(), Expect::Deny(Deadline), 6);
    c.pushback = Some("300");
    c.deadline = Some(Duration::from_millis(349));
    check(
        "pushback beyond the deadline",
        c.clone(),
        Expect::Deny(Deadline),
        6,
    );
    c.deadline = Some(Duration::from_millis(350));
    assert_eq!(
        backoff_of(&c, &Policy::default()),
        Duration::from_millis(300)
    );
    // The computed backoff wins when it is longer.
    let mut c = case().grpc(GrpcCode::Unavailable).pushback("1");
    c.attempt = 2;
    c.jitter = 0.999;
    let computed = Policy::default().backoff.compute(2, None, 0.999);
    assert!(computed > Duration::from_millis(1));
    assert_eq!(backoff_of(&c, &Policy::default()), computed);
}

#[test]
fn grpc_codes_and_names() {
    for (index, code) in GrpcCode::VARIANTS.iter().enumerate() {
        assert_eq!(code.number() as usize, index + 1);
        assert_eq!(GrpcCode::from_number(code.number()), Some(*code));
        assert_eq!(GrpcCode::from_name(code.as_str()), Some(*code));
    }
    assert_eq!(GrpcCode::from_number(0), None);
    assert_eq!(GrpcCode::from_number(17), None);
    assert_eq!(GrpcCode::from_number(u32::MAX), None);
    assert_eq!(GrpcCode::Unavailable.number(), 14);
    assert_eq!(GrpcCode::from_name("UNAVAILABLE"), None);
    let set: GrpcCodes = [GrpcCode::Unauthenticated, GrpcCode::Cancelled]
        .into_iter()
        .collect();
    assert_eq!(
        set.iter().collect::<Vec<_>>(),
        [GrpcCode::Cancelled, GrpcCode::Unauthenticated]
    );
    assert!(!set.contains(GrpcCode::Unavailable));
    assert_eq!(parse_pushback("+3"), Pushback::DoNotRetry);
    assert_eq!(parse_pushback("0x10"), Pushback::DoNotRetry);
    assert_eq!(
        parse_pushback("12"),
        Pushback::Wait(Duration::from_millis(12))
    );
}

#[test]
fn grpc_explanations_word_for_word() {
    let explain = |c: Case| c.run(&Policy::default()).to_string();
    let mut c = case().grpc(GrpcCode::Unavailable);
    c.jitter = 0.0;
    assert_eq!(
        explain(c),
        "retry after 0ms: gRPC status unavailable is retryable (rule 9)"
    );
    assert_eq!(
        explain(case().grpc(GrpcCode::Aborted)),
        "deny: the status is not retryable for this operation (rule 9, gRPC status aborted)"
    );
    assert_eq!(
        explain(case().grpc(GrpcCode::Unavailable).pushback("-1")),
        "deny: the server asked not to retry (grpc-retry-pushback-ms) (rule 9)"
    );
    assert_eq!(
        explain(case().grpc(GrpcCode::Unauthenticated).idempotency(Safe)),
        "retry after 0ms: refresh credentials and replay once (rule 9, unauthenticated)"
    );
}

/// Issue 36: whichever rule decides, a call that may have taken effect says
/// so. Each case of the table, on a POST (NON_IDEMPOTENT) whose
/// response timed out unless the case says otherwise, and the controls.
#[test]
fn the_unknown_outcome_survives_every_rule() {
    let timed_out = || Case {
        idempotency: NonIdempotent,
        failure: Some(FailureKind::ResponseHeaderTimeout),
        ..case()
    };
    let mark = |c: Case| c.run(&Policy::default()).unknown_outcome;
    let reconcile = Some(UnknownOutcome::Reconcile);
    let cases: Vec<(&str, Case, Expect, Option<UnknownOutcome>)> = vec![
        (
            "budget empty",
            Case {
                tokens: 0.0,
                ..timed_out()
            },
            Expect::Deny(BudgetExhausted),
            reconcile,
        ),
        (
            "budget unreachable",
            Case {
                unavailable: true,
                ..timed_out()
            },
            Expect::Deny(BudgetUnavailable),
            reconcile,
        ),
        (
            "attempts used up",
            Case {
                attempt: 3,
                ..timed_out()
            },
            Expect::Deny(MaxAttempts),
            reconcile,
        ),
        (
            "deadline spent",
            Case {
                deadline: Some(Duration::from_millis(10)),
                ..timed_out()
            },
            Expect::Deny(Deadline),
            reconcile,
        ),
        (
            "one-shot body",
            Case {
                body: Body::InputStream,
                ..timed_out()
            },
            Expect::Deny(BodyNotReplayable),
            reconcile,
        ),
        (
            "draining",
            Case {
                draining: true,
                ..timed_out()
            },
            Expect::Deny(RuntimeDraining),
            reconcile,
        ),
        (
            "kill switch",
            Case {
                enabled: false,
                ..timed_out()
            },
            Expect::Deny(RetriesDisabled),
            reconcile,
        ),
        (
            "first byte delivered",
            Case {
                first_byte_delivered: true,
                failure: Some(FailureKind::DecodeReset),
                ..timed_out()
            },
            Expect::Deny(ResponseAlreadyDelivered),
            reconcile,
        ),
        (
            "encoding failed after the headers left",
            Case {
                failure: Some(FailureKind::RequestEncoding),
                ..timed_out()
            },
            Expect::Deny(PermanentFailure),
            reconcile,
        ),
        (
            "502 on a POST, last attempt",
            Case {
                attempt: 3,
                ..timed_out().status(502)
            },
            Expect::Deny(MaxAttempts),
            reconcile,
        ),
        (
            "504 on a POST, budget empty",
            Case {
                tokens: 0.0,
                ..timed_out().status(504)
            },
            Expect::Deny(BudgetExhausted),
            reconcile,
        ),
        (
            "503 on a POST",
            timed_out().status(503),
            Expect::Ambiguous,
            reconcile,
        ),
        (
            "a timeout with budget left",
            timed_out(),
            Expect::Ambiguous,
            reconcile,
        ),
        (
            "gRPC UNAVAILABLE, budget empty",
            Case {
                tokens: 0.0,
                ..timed_out().grpc(GrpcCode::Unavailable)
            },
            Expect::Deny(BudgetExhausted),
            reconcile,
        ),
        (
            "gRPC DEADLINE_EXCEEDED",
            timed_out().grpc(GrpcCode::DeadlineExceeded),
            Expect::Ambiguous,
            reconcile,
        ),
        (
            "gRPC UNAVAILABLE with a do-not-retry pushback",
            timed_out().grpc(GrpcCode::Unavailable).pushback("-1"),
            Expect::Deny(ServerPushback),
            reconcile,
        ),
        // A keyed call may have happened too, but re-sending with its key is safe.
        (
            "keyed, budget empty",
            Case {
                tokens: 0.0,
                idempotency: IdempotentWithKey,
                ..timed_out()
            },
            Expect::Deny(BudgetExhausted),
            Some(UnknownOutcome::ResendWithKey),
        ),
        (
            "keyed, retried",
            Case {
                idempotency: IdempotentWithKey,
                ..timed_out()
            },
            Expect::Retry,
            Some(UnknownOutcome::ResendWithKey),
        ),
        // The controls: proven not sent, a final response, a call without side effects.
        (
            "proven NOT_SENT, budget empty",
            Case {
                failure: Some(FailureKind::Connect),
                tokens: 0.0,
                ..timed_out()
            },
            Expect::Deny(BudgetExhausted),
            None,
        ),
        (
            "a 4xx settles it",
            timed_out().status(409),
            Expect::Deny(StatusNotRetryable),
            None,
        ),
        (
            "a 500 settles it",
            timed_out().status(500),
            Expect::Deny(StatusNotRetryable),
            None,
        ),
        (
            "gRPC INVALID_ARGUMENT settles it",
            timed_out().grpc(GrpcCode::InvalidArgument),
            Expect::Deny(StatusNotRetryable),
            None,
        ),
        (
            "SAFE, budget empty",
            Case {
                tokens: 0.0,
                idempotency: Safe,
                ..timed_out()
            },
            Expect::Deny(BudgetExhausted),
            None,
        ),
        (
            "IDEMPOTENT, 503",
            Case {
                idempotency: Idempotent,
                ..timed_out().status(503)
            },
            Expect::Retry,
            None,
        ),
    ];
    for (name, c, expect, expected_mark) in cases {
        let decision = c.run(&Policy::default());
        let got = match decision.verdict {
            Verdict::Retry { .. } => Expect::Retry,
            Verdict::Deny(reason) => Expect::Deny(reason),
            Verdict::Ambiguous => Expect::Ambiguous,
        };
        assert_eq!(got, expect, "{name}: {decision}");
        assert_eq!(mark(c), expected_mark, "{name}: {decision}");
    }
}

/// The same facts with rules 1 to 7 unable to apply and every gRPC code
/// retryable: what rule 8 or the status rules answer on their own.
fn with_early_rules_neutralised(case: &Case) -> (Case, Policy) {
    let neutral = Case {
        attempt: 1,
        max_attempts: None,
        tokens: 10.0,
        enabled: true,
        unavailable: false,
        body: Body::Bytes,
        first_byte_delivered: false,
        draining: false,
        deadline: None,
        // The chain's rule denies like draining; it never changes the mark.
        lineage: "",
        retried_below: None,
        // The built-in permanent failures, each replaced by one with the
        // same evidence that is not permanent.
        failure: match case.failure {
            Some(FailureKind::RequestEncoding) => Some(FailureKind::GenericIo),
            Some(FailureKind::ProfileRejection | FailureKind::TlsCertificateInvalid) => {
                Some(FailureKind::Connect)
            }
            other => other,
        },
        // A do-not-retry pushback is still an answer from the server (it
        // keeps RESPONSE_RECEIVED); a valid one does the same and lets the
        // code speak.
        pushback: case.pushback.map(|raw| match parse_pushback(raw) {
            Pushback::DoNotRetry => "0",
            Pushback::Wait(_) => raw,
        }),
        ..case.clone()
    };
    let policy = Policy {
        grpc_retryable: GrpcCode::VARIANTS.iter().copied().collect(),
        ..Policy::default()
    };
    (neutral, policy)
}

proptest! {
    /// Issue 36's definition, checked against the engine's own rules: the
    /// mark is set if and only if, with no earlier rule able to deny, rule
    /// 8 or the status rules would answer AMBIGUOUS for the call made
    /// NON_IDEMPOTENT; RECONCILE for a NON_IDEMPOTENT call, RESEND_WITH_KEY
    /// for a keyed one, never for SAFE or IDEMPOTENT. And it never depends
    /// on the verdict: the budget, the attempt, the deadline change nothing.
    #[test]
    fn the_mark_is_the_ambiguity_no_rule_can_hide(case in any_case()) {
        let decision = case.run(&Policy::default());
        let (neutral, permissive) = with_early_rules_neutralised(&case);
        let would_be_ambiguous = Case { idempotency: NonIdempotent, ..neutral }
            .run(&permissive)
            .verdict
            == Verdict::Ambiguous;
        let expected = match case.idempotency {
            NonIdempotent if would_be_ambiguous => Some(UnknownOutcome::Reconcile),
            IdempotentWithKey if would_be_ambiguous => Some(UnknownOutcome::ResendWithKey),
            _ => None,
        };
        prop_assert_eq!(decision.unknown_outcome, expected, "{}", decision);
        if decision.effective_evidence == Evidence::NotSent {
            prop_assert_eq!(decision.unknown_outcome, None);
        }
        // A non-idempotent call of unknown outcome is never retried.
        if decision.unknown_outcome == Some(UnknownOutcome::Reconcile) {
            prop_assert!(!matches!(decision.verdict, Verdict::Retry { .. }), "{}", decision);
        }
    }
}

#[test]
fn explanations_say_the_outcome_is_unknown() {
    let decision = |verdict, unknown_outcome| Decision {
        verdict,
        rule: Rule::BUDGET,
        effective_evidence: Evidence::SentNoResponse,
        evidence_adjusted: false,
        unknown_outcome,
        http_status: None,
        grpc_status: None,
        hedge: None,
    };
    let cases = [
        (
            decision(
                Verdict::Deny(BudgetExhausted),
                Some(UnknownOutcome::Reconcile),
            ),
            "deny: the upstream's retry budget is empty (rule 2); the outcome upstream is \
             unknown: reconcile before reporting a failure",
        ),
        (
            decision(
                Verdict::Deny(BudgetExhausted),
                Some(UnknownOutcome::ResendWithKey),
            ),
            "deny: the upstream's retry budget is empty (rule 2); the outcome upstream is \
             unknown: re-send only with the same idempotency key",
        ),
        (
            Decision {
                rule: Rule::AMBIGUOUS_SEND,
                ..decision(Verdict::Ambiguous, Some(UnknownOutcome::Reconcile))
            },
            "ambiguous: the request was sent and may have taken effect; the operation is not \
             idempotent, so reconcile (rule 8)",
        ),
    ];
    for (decision, text) in cases {
        assert_eq!(decision.to_string(), text, "{decision:?}");
    }
}
