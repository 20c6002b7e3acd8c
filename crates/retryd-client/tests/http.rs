//! The reqwest middleware against real failing servers on loopback and a
//! real retryd: for each failure, the attempts the server saw and the
//! verdict the caller gets.

mod support;

use std::time::{Duration, SystemTime};

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use retryd_client::engine::{DenyReason, Evidence, Idempotency, UnknownOutcome};
use retryd_client::{AmbiguousError, Call, CallFailed, Decisions, RetryMiddleware, Source};
use support::{Answer, Raw};

fn http(middleware: RetryMiddleware) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build()
}

fn ambiguous(error: &reqwest_middleware::Error) -> &AmbiguousError {
    match error {
        reqwest_middleware::Error::Middleware(inner) => inner
            .downcast_ref::<AmbiguousError>()
            .unwrap_or_else(|| panic!("not ambiguous: {inner:?}")),
        other => panic!("not ambiguous: {other:?}"),
    }
}

fn failed(error: &reqwest_middleware::Error) -> &CallFailed {
    match error {
        reqwest_middleware::Error::Middleware(inner) => inner
            .downcast_ref::<CallFailed>()
            .unwrap_or_else(|| panic!("not a plain failure: {inner:?}")),
        other => panic!("not a plain failure: {other:?}"),
    }
}

fn safe() -> Call {
    Call::new(Idempotency::Safe).deadline_in(Duration::from_secs(20))
}

fn charge() -> Call {
    Call::new(Idempotency::NonIdempotent).deadline_in(Duration::from_secs(20))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_not_sent_and_retried_even_for_a_charge() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let addr = support::refused_addr().await;
    let http = http(RetryMiddleware::new(client));
    let error = http
        .post(format!("http://{addr}/v1/charges"))
        .body("amount=1")
        .with_extension(charge())
        .send()
        .await
        .expect_err("nothing listens");
    let failed = failed(&error);
    // Three attempts (retryd's limit), each refused: nothing reached a server.
    assert_eq!(failed.attempts, 3);
    assert_eq!(failed.decisions.len(), 3);
    for decision in &failed.decisions[..2] {
        assert!(decision.should_retry(), "{decision:?}");
        assert_eq!(decision.effective_evidence, Evidence::NotSent);
        assert_eq!(decision.source, Source::Retryd);
    }
    assert_eq!(
        failed.decisions[2].deny_reason(),
        Some(DenyReason::MaxAttempts)
    );
    assert_eq!(failed.decisions[2].unknown_outcome, None);
}

async fn reset(behaviour: Raw, post: bool) -> (u32, reqwest_middleware::Error) {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) = support::raw_server(behaviour).await;
    let http = http(RetryMiddleware::new(client));
    let request = if post {
        http.post(format!("http://{addr}/v1/charges"))
            .body("amount=1")
            .with_extension(charge())
    } else {
        http.get(format!("http://{addr}/items/7"))
            .with_extension(safe())
    };
    let error = request.send().await.expect_err("the server resets");
    (attempts.count(), error)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_before_the_request_is_read_is_retried_for_a_safe_get() {
    let (attempts, error) = reset(Raw::ResetBeforeRead, false).await;
    let failed = failed(&error);
    assert_eq!(attempts, 3, "three requests arrived");
    assert_eq!(failed.attempts, 3);
    // A reset after connecting proves nothing: SENT_NO_RESPONSE, retried
    // only because the GET is declared SAFE.
    assert!(
        failed
            .decisions
            .iter()
            .all(|d| d.effective_evidence == Evidence::SentNoResponse)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_before_the_request_is_read_is_ambiguous_for_a_post() {
    let (attempts, error) = reset(Raw::ResetBeforeRead, true).await;
    let ambiguous = ambiguous(&error);
    assert_eq!(attempts, 1, "never re-sent");
    assert_eq!(ambiguous.attempts, 1);
    assert_eq!(
        ambiguous.decision.effective_evidence,
        Evidence::SentNoResponse
    );
    assert_eq!(
        ambiguous.decision.unknown_outcome,
        Some(UnknownOutcome::Reconcile)
    );
    assert!(!ambiguous.resend_with_same_key());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_on_accept_is_not_sent_only_when_the_connector_saw_it() {
    // The reset races the client: hyper-util's connector may see it (the
    // connection is refused to the caller before any byte is written:
    // NOT_SENT, retried even for a charge) or the request is written first
    // (SENT_NO_RESPONSE: AMBIGUOUS, never re-sent). Either way, no charge
    // that may have been written is sent again.
    let (accepted, error) = reset(Raw::ResetOnAccept, true).await;
    let decisions = match &error {
        reqwest_middleware::Error::Middleware(inner) => {
            if let Some(ambiguous) = inner.downcast_ref::<AmbiguousError>() {
                let (last, before) = ambiguous.decisions.split_last().expect("a decision");
                assert_eq!(last.effective_evidence, Evidence::SentNoResponse);
                assert!(
                    before
                        .iter()
                        .all(|d| d.effective_evidence == Evidence::NotSent)
                );
                ambiguous.decisions.clone()
            } else {
                let failed = failed(&error);
                assert!(
                    failed
                        .decisions
                        .iter()
                        .all(|d| d.effective_evidence == Evidence::NotSent)
                );
                failed.decisions.clone()
            }
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(
        accepted as usize,
        decisions.len(),
        "one connection per attempt"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_after_the_request_is_read_is_retried_for_a_safe_get() {
    let (attempts, error) = reset(Raw::ResetAfterRead, false).await;
    let failed = failed(&error);
    assert_eq!(attempts, 3, "three requests read");
    assert_eq!(
        failed.decisions[2].deny_reason(),
        Some(DenyReason::MaxAttempts)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_after_the_request_is_read_is_ambiguous_for_a_post() {
    let (attempts, error) = reset(Raw::ResetAfterRead, true).await;
    let ambiguous = ambiguous(&error);
    assert_eq!(attempts, 1, "read once, never re-sent");
    assert_eq!(ambiguous.decision.rule, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_post_reset_after_reading_is_ambiguous_with_resend_with_the_same_key() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) = support::raw_server(Raw::ResetAfterRead).await;
    let http = http(RetryMiddleware::new(client));
    // Undeclared, with an Idempotency-Key header: IDEMPOTENT_WITH_KEY.
    let error = http
        .post(format!("http://{addr}/v1/charges"))
        .header("idempotency-key", "charge-7")
        .body("amount=1")
        .send()
        .await
        .expect_err("the server resets");
    let ambiguous = ambiguous(&error);
    // Safely idempotent, so retried to the limit; the outcome stays open.
    assert_eq!(attempts.count(), 3);
    assert!(ambiguous.resend_with_same_key());
    assert_eq!(ambiguous.deny_reason(), Some(DenyReason::MaxAttempts));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_response_past_the_attempt_timeout_is_sent_no_response() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) = support::hyper_server(Answer::Hold).await;
    let http =
        http(RetryMiddleware::new(client.clone()).attempt_timeout(Duration::from_millis(300)));
    let error = http
        .get(format!("http://{addr}/slow"))
        .with_extension(safe())
        .send()
        .await
        .expect_err("never answered");
    let failed = failed(&error);
    support::retryd_testkit_eventually("three requests read", || {
        (attempts.count() == 3).then_some(())
    })
    .await;
    assert_eq!(failed.attempts, 3);
    assert!(
        failed
            .decisions
            .iter()
            .all(|d| d.effective_evidence == Evidence::SentNoResponse)
    );

    // The same timeout on a charge: never re-sent, and not a plain failure.
    let (addr, attempts) = support::hyper_server(Answer::Hold).await;
    let error = http
        .post(format!("http://{addr}/v1/charges"))
        .body("amount=1")
        .with_extension(charge())
        .send()
        .await
        .expect_err("never answered");
    let ambiguous = ambiguous(&error);
    assert_eq!(ambiguous.attempts, 1);
    support::retryd_testkit_eventually("the request read", || {
        (attempts.count() == 1).then_some(())
    })
    .await;
    assert_eq!(attempts.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callers_deadline_ends_a_held_charge_as_ambiguous_without_asking() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) = support::hyper_server(Answer::Hold).await;
    let http = http(RetryMiddleware::new(client));
    let error = http
        .post(format!("http://{addr}/v1/charges"))
        .body("amount=1")
        .with_extension(
            Call::new(Idempotency::NonIdempotent).deadline_in(Duration::from_millis(300)),
        )
        .send()
        .await
        .expect_err("never answered");
    let ambiguous = ambiguous(&error);
    assert_eq!(ambiguous.decision.source, Source::EndedByCaller);
    assert_eq!(ambiguous.deny_reason(), Some(DenyReason::Deadline));
    assert!(ambiguous.decision.decision_id.is_empty());
    assert_eq!(attempts.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_with_retry_after_in_seconds_waits_at_least_that_long() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) =
        support::hyper_server(Answer::Status(503, vec![("retry-after", "1".into())])).await;
    let http = http(RetryMiddleware::new(client));
    let response = http
        .get(format!("http://{addr}/items"))
        .with_extension(safe().max_attempts(2))
        .send()
        .await
        .expect("the last 503 is returned");
    assert_eq!(response.status(), 503);
    assert_eq!(attempts.count(), 2);
    let decisions = response
        .extensions()
        .get::<Decisions>()
        .expect("decisions")
        .0
        .clone();
    assert_eq!(decisions.len(), 2);
    assert!(decisions[0].should_retry());
    assert!(
        decisions[0].backoff() >= Duration::from_secs(1),
        "{:?}",
        decisions[0]
    );
    assert_eq!(decisions[1].deny_reason(), Some(DenyReason::MaxAttempts));
    assert_eq!(
        response.text().await.expect("body"),
        "answer",
        "handed back intact"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_that_does_not_fit_the_deadline_is_denied_at_once() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) =
        support::hyper_server(Answer::Status(503, vec![("retry-after", "5".into())])).await;
    let http = http(RetryMiddleware::new(client));
    let response = http
        .get(format!("http://{addr}/items"))
        .with_extension(Call::new(Idempotency::Safe).deadline_in(Duration::from_secs(2)))
        .send()
        .await
        .expect("the 503 is returned");
    assert_eq!(attempts.count(), 1);
    let decisions = &response
        .extensions()
        .get::<Decisions>()
        .expect("decisions")
        .0;
    assert_eq!(decisions[0].deny_reason(), Some(DenyReason::Deadline));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_with_retry_after_as_an_http_date_is_honoured() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3));
    let (addr, attempts) =
        support::hyper_server(Answer::Status(503, vec![("retry-after", date)])).await;
    let http = http(RetryMiddleware::new(client));
    let response = http
        .get(format!("http://{addr}/items"))
        .with_extension(safe().max_attempts(2))
        .send()
        .await
        .expect("the last 503 is returned");
    assert_eq!(attempts.count(), 2);
    let decisions = &response
        .extensions()
        .get::<Decisions>()
        .expect("decisions")
        .0;
    // The date has whole seconds: between 2 and 3 s from when it was made.
    assert!(
        decisions[0].backoff() >= Duration::from_secs(1),
        "{:?}",
        decisions[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_is_retried_even_for_a_charge() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) = support::hyper_server(Answer::Status(429, vec![])).await;
    let http = http(RetryMiddleware::new(client));
    let response = http
        .post(format!("http://{addr}/v1/charges"))
        .body("amount=1")
        .with_extension(charge())
        .send()
        .await
        .expect("the last 429 is returned");
    assert_eq!(response.status(), 429);
    // A 429 says the request was not processed: the status rule retries it.
    assert_eq!(attempts.count(), 3);
    let decisions = &response
        .extensions()
        .get::<Decisions>()
        .expect("decisions")
        .0;
    assert_eq!(decisions.len(), 3);
    assert_eq!(decisions[2].deny_reason(), Some(DenyReason::MaxAttempts));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_then_a_reset_mid_body_is_a_partial_response() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) = support::raw_server(Raw::ResetMidBody).await;
    let http = http(RetryMiddleware::new(client.clone()).buffer_responses(1 << 20));
    let error = http
        .get(format!("http://{addr}/items"))
        .with_extension(safe())
        .send()
        .await
        .expect_err("the body breaks");
    let failed = failed(&error);
    assert_eq!(attempts.count(), 3);
    assert!(
        failed
            .decisions
            .iter()
            .all(|d| d.effective_evidence == Evidence::PartialResponse)
    );

    // A charge whose 200 broke off: it happened, and its result was lost.
    let (addr, attempts) = support::raw_server(Raw::ResetMidBody).await;
    let error = http
        .post(format!("http://{addr}/v1/charges"))
        .body("amount=1")
        .with_extension(charge())
        .send()
        .await
        .expect_err("the body breaks");
    let ambiguous = ambiguous(&error);
    assert_eq!(attempts.count(), 1);
    assert_eq!(
        ambiguous.decision.effective_evidence,
        Evidence::PartialResponse
    );

    // Unbuffered, the response is handed over and the caller's read fails:
    // delivered, so never retried.
    let (addr, attempts) = support::raw_server(Raw::ResetMidBody).await;
    let plain = self::http(RetryMiddleware::new(client));
    let response = plain
        .get(format!("http://{addr}/items"))
        .with_extension(safe())
        .send()
        .await
        .expect("headers arrived");
    assert!(response.bytes().await.is_err());
    assert_eq!(attempts.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_body_is_one_shot_and_never_re_sent() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) = support::hyper_server(Answer::Status(503, vec![])).await;
    let http = http(RetryMiddleware::new(client));
    let chunks = futures::stream::iter(vec![
        Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"part one,")),
        Ok(bytes::Bytes::from_static(b"part two")),
    ]);
    let response = http
        .put(format!("http://{addr}/upload"))
        .body(reqwest::Body::wrap_stream(chunks))
        .with_extension(Call::new(Idempotency::Idempotent).deadline_in(Duration::from_secs(20)))
        .send()
        .await
        .expect("the 503 is returned");
    assert_eq!(response.status(), 503);
    assert_eq!(attempts.count(), 1);
    let decisions = &response
        .extensions()
        .get::<Decisions>()
        .expect("decisions")
        .0;
    assert_eq!(
        decisions[0].deny_reason(),
        Some(DenyReason::BodyNotReplayable)
    );
    assert_eq!(decisions[0].rule, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_asks_nothing_and_counts_one_first_attempt() {
    let retryd = support::retryd();
    let client = retryd_client::Client::builder(format!("http://{}", retryd.grpc))
        .disable_reporting()
        .connect()
        .await
        .expect("client");
    let (addr, attempts) = support::hyper_server(Answer::Status(200, vec![])).await;
    let http = http(RetryMiddleware::new(client.clone()).upstream("catalog"));
    for _ in 0..3 {
        let response = http
            .get(format!("http://{addr}/items"))
            .with_extension(Call::new(Idempotency::Safe))
            .send()
            .await
            .expect("ok");
        assert_eq!(response.status(), 200);
        assert!(response.extensions().get::<Decisions>().is_none());
    }
    assert_eq!(attempts.count(), 3);
    assert_eq!(client.reporter().pending().await.get("catalog"), Some(&3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_401_is_replayed_once_with_fresh_credentials_for_a_safe_get() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) = support::hyper_server(Answer::UnauthorizedUnless("Bearer fresh")).await;
    let refresh: retryd_client::RefreshCredentials = std::sync::Arc::new(|request| {
        request.headers_mut().insert(
            "authorization",
            reqwest::header::HeaderValue::from_static("Bearer fresh"),
        );
        Ok(())
    });
    let http = http(RetryMiddleware::new(client.clone()).refresh_credentials(refresh));
    let response = http
        .get(format!("http://{addr}/items"))
        .header("authorization", "Bearer stale")
        .with_extension(safe())
        .send()
        .await
        .expect("replayed");
    assert_eq!(response.status(), 200);
    assert_eq!(attempts.count(), 2);
    let decisions = &response
        .extensions()
        .get::<Decisions>()
        .expect("decisions")
        .0;
    assert!(decisions[0].refresh_credentials());

    // A POST gets no refresh-and-replay: its 401 is returned as it is.
    let (addr, attempts) = support::hyper_server(Answer::UnauthorizedUnless("Bearer fresh")).await;
    let response = http
        .post(format!("http://{addr}/v1/charges"))
        .body("amount=1")
        .with_extension(charge())
        .send()
        .await
        .expect("the 401");
    assert_eq!(response.status(), 401);
    assert_eq!(attempts.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_refused_stream_is_not_sent_and_retried_even_for_a_charge() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, refused) = support::h2_refusing_server().await;
    let http = ClientBuilder::new(
        reqwest::Client::builder()
            .http2_prior_knowledge()
            .build()
            .expect("reqwest"),
    )
    .with(RetryMiddleware::new(client))
    .build();
    let error = http
        .post(format!("http://{addr}/v1/charges"))
        .body("amount=1")
        .with_extension(charge())
        .send()
        .await
        .expect_err("every stream is refused");
    let failed = failed(&error);
    assert_eq!(failed.attempts, 3);
    assert!(
        failed
            .decisions
            .iter()
            .all(|d| d.effective_evidence == Evidence::NotSent)
    );
    assert_eq!(
        failed.decisions[2].deny_reason(),
        Some(DenyReason::MaxAttempts)
    );
    // reqwest's own policy re-sends a refused stream by itself too (its
    // protocol NACKs): proven unprocessed, so never an attempt.
    assert!(refused.count() >= 3, "{} streams", refused.count());
}
