//! The tower layer over a tonic channel, against a small tonic upstream on
//! loopback and a real retryd: for each failure, the attempts the upstream
//! saw and the status (with the layer's decision in its metadata) the
//! caller gets.

mod support;

use std::time::Duration;

use retryd_client::engine::Idempotency;
use retryd_client::{Call, Client, Decisions, RetrydLayer, outcome_of, pb};
use support::GrpcAnswer;

type Governed = retryd_client::RetrydService<tonic::transport::Channel>;

async fn upstream_client(
    retryd: &Client,
    answer: GrpcAnswer,
    attempt_timeout: Option<Duration>,
) -> (
    pb::retry_decider_client::RetryDeciderClient<Governed>,
    support::Attempts,
) {
    let (addr, attempts) = support::grpc_server(answer).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_lazy();
    let mut layer = RetrydLayer::new(retryd.clone(), "ledger");
    if let Some(timeout) = attempt_timeout {
        layer = layer.attempt_timeout(timeout);
    }
    let service = tower::ServiceBuilder::new().layer(layer).service(channel);
    (
        pb::retry_decider_client::RetryDeciderClient::new(service),
        attempts,
    )
}

fn call(idempotency: Idempotency) -> tonic::Request<pb::DecideRequest> {
    let mut request = tonic::Request::new(pb::DecideRequest::default());
    request
        .extensions_mut()
        .insert(Call::new(idempotency).deadline_in(Duration::from_secs(20)));
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_is_retried_when_safe_and_ambiguous_otherwise() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (mut upstream, attempts) = upstream_client(
        &client,
        GrpcAnswer::Fail(tonic::Code::Unavailable, None),
        None,
    )
    .await;
    let status = upstream
        .decide(call(Idempotency::Safe))
        .await
        .expect_err("always UNAVAILABLE");
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert_eq!(
        status.message(),
        "the upstream says no",
        "the server's own status"
    );
    let outcome = outcome_of(&status).expect("decided");
    assert_eq!(outcome.attempts, 3);
    assert_eq!(outcome.deny_reason.as_deref(), Some("max_attempts"));
    assert_eq!(attempts.count(), 3);

    let (mut upstream, attempts) = upstream_client(
        &client,
        GrpcAnswer::Fail(tonic::Code::Unavailable, None),
        None,
    )
    .await;
    let status = upstream
        .decide(call(Idempotency::NonIdempotent))
        .await
        .expect_err("always UNAVAILABLE");
    let outcome = outcome_of(&status).expect("decided");
    assert!(outcome.is_ambiguous(), "{outcome:?}");
    assert_eq!(outcome.attempts, 1);
    assert_eq!(attempts.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_exhausted_is_retried_only_with_a_pushback_and_no_sooner() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (mut upstream, attempts) = upstream_client(
        &client,
        GrpcAnswer::Fail(tonic::Code::ResourceExhausted, Some("300")),
        None,
    )
    .await;
    let started = tokio::time::Instant::now();
    let status = upstream
        .decide(call(Idempotency::NonIdempotent))
        .await
        .expect_err("always RESOURCE_EXHAUSTED");
    // The server answered, so even a charge is retried after its pushback.
    assert_eq!(attempts.count(), 3);
    assert_eq!(outcome_of(&status).expect("decided").attempts, 3);
    assert!(
        started.elapsed() >= Duration::from_millis(600),
        "two waits of 300 ms"
    );

    let (mut upstream, attempts) = upstream_client(
        &client,
        GrpcAnswer::Fail(tonic::Code::ResourceExhausted, None),
        None,
    )
    .await;
    let status = upstream
        .decide(call(Idempotency::Safe))
        .await
        .expect_err("RESOURCE_EXHAUSTED");
    let outcome = outcome_of(&status).expect("decided");
    assert_eq!(outcome.deny_reason.as_deref(), Some("status_not_retryable"));
    assert_eq!(attempts.count(), 1);

    let (mut upstream, attempts) = upstream_client(
        &client,
        GrpcAnswer::Fail(tonic::Code::ResourceExhausted, Some("-1")),
        None,
    )
    .await;
    let status = upstream
        .decide(call(Idempotency::Safe))
        .await
        .expect_err("RESOURCE_EXHAUSTED");
    let outcome = outcome_of(&status).expect("decided");
    assert_eq!(outcome.deny_reason.as_deref(), Some("server_pushback"));
    assert_eq!(attempts.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_exceeded_attempt_is_sent_no_response() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (mut upstream, attempts) =
        upstream_client(&client, GrpcAnswer::Hold, Some(Duration::from_millis(300))).await;
    let status = upstream
        .decide(call(Idempotency::Idempotent))
        .await
        .expect_err("never answered");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
    assert_eq!(outcome_of(&status).expect("decided").attempts, 3);
    retryd_testkit::eventually("three calls arrived", || {
        (attempts.count() == 3).then_some(())
    })
    .await;

    let (mut upstream, attempts) =
        upstream_client(&client, GrpcAnswer::Hold, Some(Duration::from_millis(300))).await;
    let status = upstream
        .decide(call(Idempotency::NonIdempotent))
        .await
        .expect_err("never answered");
    let outcome = outcome_of(&status).expect("decided");
    assert!(outcome.is_ambiguous(), "{outcome:?}");
    assert_eq!(
        outcome.unknown_outcome,
        Some(retryd_client::engine::UnknownOutcome::Reconcile)
    );
    assert_eq!(outcome.attempts, 1);
    retryd_testkit::eventually("the call arrived", || (attempts.count() == 1).then_some(())).await;
    assert_eq!(attempts.count(), 1);

    // DEADLINE_EXCEEDED sent by the server itself: RESPONSE_RECEIVED, and
    // still of unknown outcome for a charge.
    let (mut upstream, attempts) = upstream_client(
        &client,
        GrpcAnswer::Fail(tonic::Code::DeadlineExceeded, None),
        None,
    )
    .await;
    let status = upstream
        .decide(call(Idempotency::Safe))
        .await
        .expect_err("DEADLINE_EXCEEDED");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
    assert_eq!(attempts.count(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_upstream_is_not_sent_and_retried_even_for_a_charge() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let addr = support::refused_addr().await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_lazy();
    let service = tower::ServiceBuilder::new()
        .layer(RetrydLayer::new(client, "ledger"))
        .service(channel);
    let mut upstream = pb::retry_decider_client::RetryDeciderClient::new(service);
    let status = upstream
        .decide(call(Idempotency::NonIdempotent))
        .await
        .expect_err("nothing listens");
    assert_eq!(status.code(), tonic::Code::Unavailable);
    let outcome = outcome_of(&status).expect("decided");
    assert_eq!(outcome.attempts, 3);
    assert_eq!(outcome.deny_reason.as_deref(), Some("max_attempts"));
    assert!(!outcome.is_ambiguous());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_request_is_one_shot_and_never_re_sent() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (mut upstream, attempts) = upstream_client(
        &client,
        GrpcAnswer::Fail(tonic::Code::Unavailable, None),
        None,
    )
    .await;
    // A stream still being produced when the call starts.
    let (sender, receiver) = tokio::sync::mpsc::channel(4);
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(receiver));
    request
        .extensions_mut()
        .insert(Call::new(Idempotency::Idempotent).deadline_in(Duration::from_secs(20)));
    let feeder = tokio::spawn(async move {
        let _ = sender.send(pb::DecideRequest::default()).await;
        // Held open: the stream has not ended when the call fails.
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
    let status = upstream
        .decide_stream(request)
        .await
        .expect_err("UNAVAILABLE");
    feeder.abort();
    let outcome = outcome_of(&status).expect("decided");
    assert_eq!(outcome.deny_reason.as_deref(), Some("body_not_replayable"));
    assert_eq!(attempts.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_after_a_retry_carries_its_decisions_and_a_first_success_none() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (mut upstream, attempts) = upstream_client(&client, GrpcAnswer::Ok, None).await;
    let response = upstream.decide(call(Idempotency::Safe)).await.expect("ok");
    assert_eq!(response.get_ref().decision_id, "upstream-ok");
    assert!(response.extensions().get::<Decisions>().is_none());
    assert_eq!(attempts.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_is_replayed_once_with_fresh_credentials_for_a_safe_call() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (addr, attempts) =
        support::grpc_server(GrpcAnswer::UnauthenticatedUnless("Bearer fresh")).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_lazy();
    let refresh: retryd_client::RefreshMetadata = std::sync::Arc::new(|headers| {
        headers.insert(
            "authorization",
            http::HeaderValue::from_static("Bearer fresh"),
        );
        Ok(())
    });
    let service = tower::ServiceBuilder::new()
        .layer(RetrydLayer::new(client.clone(), "ledger").refresh_credentials(refresh))
        .service(channel);
    let mut upstream = pb::retry_decider_client::RetryDeciderClient::new(service);
    let response = upstream
        .decide(call(Idempotency::Safe))
        .await
        .expect("replayed");
    assert_eq!(attempts.count(), 2);
    let decisions = &response
        .extensions()
        .get::<Decisions>()
        .expect("decisions")
        .0;
    assert!(decisions[0].refresh_credentials());

    // Without a refresh hook, or for a call that is not SAFE, the status stands.
    let (mut upstream, attempts) = upstream_client(
        &client,
        GrpcAnswer::UnauthenticatedUnless("Bearer fresh"),
        None,
    )
    .await;
    let status = upstream
        .decide(call(Idempotency::Safe))
        .await
        .expect_err("stale");
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    assert_eq!(attempts.count(), 1);
}
