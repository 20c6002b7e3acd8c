package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.EOFException;
import java.io.IOException;
import java.net.ConnectException;
import java.net.URI;
import java.net.UnknownHostException;
import java.net.http.HttpClient;
import java.net.http.HttpConnectTimeoutException;
import java.net.http.HttpHeaders;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.net.http.HttpTimeoutException;
import java.nio.channels.UnresolvedAddressException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.cert.CertificateException;
import java.time.Duration;
import java.time.Instant;
import java.util.List;
import java.util.Map;
import java.util.concurrent.SubmissionPublisher;
import javax.net.ssl.SSLException;
import javax.net.ssl.SSLHandshakeException;
import org.junit.jupiter.api.Test;
import retryd.v1.Retryd.Body;
import retryd.v1.Retryd.BodyKind;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.FailureKind;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.Replayability;
import retryd.v1.Retryd.Verdict;

/**
 * The mappings that need no server: JDK exceptions that cannot be provoked on
 * loopback (DNS, a bad certificate chain), body publishers, and the local rule.
 */
class ClassificationTest {
  private static void assertOutcome(Evidence evidence, FailureKind failure, HttpOutcome outcome) {
    assertEquals(evidence, outcome.evidence(), outcome.toString());
    assertEquals(failure, outcome.failure(), outcome.toString());
  }

  private static HttpResponse.ResponseInfo headers(int status) {
    return new HttpResponse.ResponseInfo() {
      @Override
      public int statusCode() {
        return status;
      }

      @Override
      public HttpHeaders headers() {
        return HttpHeaders.of(Map.of("Retry-After", List.of("2")), (a, b) -> true);
      }

      @Override
      public HttpClient.Version version() {
        return HttpClient.Version.HTTP_1_1;
      }
    };
  }

  @Test
  void jdkExceptionsMapToEvidence() {
    ConnectException unresolved = new ConnectException();
    unresolved.initCause(new UnresolvedAddressException());
    assertOutcome(Evidence.EVIDENCE_NOT_SENT, FailureKind.FAILURE_KIND_DNS, HttpOutcome.ofException(unresolved, null));
    assertOutcome(Evidence.EVIDENCE_NOT_SENT, FailureKind.FAILURE_KIND_DNS, HttpOutcome.ofException(new IOException(new UnknownHostException("x.internal")), null));
    assertOutcome(Evidence.EVIDENCE_NOT_SENT, FailureKind.FAILURE_KIND_CONNECT, HttpOutcome.ofException(new HttpConnectTimeoutException("HTTP connect timed out"), null));
    assertOutcome(Evidence.EVIDENCE_NOT_SENT, FailureKind.FAILURE_KIND_CONNECT, HttpOutcome.ofException(new ConnectException("Connection refused"), null));

    SSLHandshakeException badChain = new SSLHandshakeException("PKIX path building failed");
    badChain.initCause(new CertificateException("unable to find valid certification path"));
    assertOutcome(Evidence.EVIDENCE_NOT_SENT, FailureKind.FAILURE_KIND_TLS_CERTIFICATE_INVALID, HttpOutcome.ofException(badChain, null));
    assertOutcome(Evidence.EVIDENCE_NOT_SENT, FailureKind.FAILURE_KIND_PRE_REQUEST_TLS, HttpOutcome.ofException(new SSLHandshakeException("Received fatal alert: handshake_failure"), null));
    assertOutcome(Evidence.EVIDENCE_SENT_NO_RESPONSE, FailureKind.FAILURE_KIND_GENERIC_IO, HttpOutcome.ofException(new SSLException("Tag mismatch"), null));

    // A timeout or an unknown error is never NOT_SENT.
    assertOutcome(Evidence.EVIDENCE_SENT_NO_RESPONSE, FailureKind.FAILURE_KIND_RESPONSE_HEADER_TIMEOUT, HttpOutcome.ofException(new HttpTimeoutException("request timed out"), null));
    assertOutcome(Evidence.EVIDENCE_SENT_NO_RESPONSE, FailureKind.FAILURE_KIND_CONNECTION_RESET, HttpOutcome.ofException(new IOException("HTTP/1.1 header parser received no bytes"), null));
    assertOutcome(Evidence.EVIDENCE_SENT_NO_RESPONSE, FailureKind.FAILURE_KIND_CONNECTION_RESET, HttpOutcome.ofException(new IOException("Connection reset"), null));
    assertOutcome(Evidence.EVIDENCE_SENT_NO_RESPONSE, FailureKind.FAILURE_KIND_CONNECTION_RESET, HttpOutcome.ofException(new EOFException(), null));
    assertOutcome(Evidence.EVIDENCE_SENT_NO_RESPONSE, FailureKind.FAILURE_KIND_GENERIC_IO, HttpOutcome.ofException(new IOException("something new"), null));

    // After the headers: a broken body.
    HttpOutcome partial = HttpOutcome.ofException(new IOException("fixed content-length: 100, bytes received: 13"), headers(200));
    assertOutcome(Evidence.EVIDENCE_PARTIAL_RESPONSE, FailureKind.FAILURE_KIND_DECODE_RESET, partial);
    assertEquals(200, partial.httpStatus());
    assertEquals("2", partial.retryAfter());
    assertOutcome(Evidence.EVIDENCE_PARTIAL_RESPONSE, FailureKind.FAILURE_KIND_INTERRUPTED_STREAM, HttpOutcome.ofException(new HttpTimeoutException("body"), headers(200)));
  }

  @Test
  void bodyPublishersMapToReplayability() throws Exception {
    URI uri = URI.create("http://127.0.0.1:1/");
    Path file = Files.createTempFile("retryd-body", ".bin");
    assertNull(RetryingHttpClient.bodyOf(HttpRequest.newBuilder(uri).GET().build(), false));
    assertNull(RetryingHttpClient.bodyOf(HttpRequest.newBuilder(uri).POST(HttpRequest.BodyPublishers.noBody()).build(), false));
    assertEquals(BodyKind.BODY_KIND_BYTES, RetryingHttpClient.bodyOf(HttpRequest.newBuilder(uri).POST(HttpRequest.BodyPublishers.ofString("x")).build(), false).getKind());
    assertEquals(BodyKind.BODY_KIND_BYTES, RetryingHttpClient.bodyOf(HttpRequest.newBuilder(uri).POST(HttpRequest.BodyPublishers.ofByteArray(new byte[3])).build(), false).getKind());
    assertEquals(BodyKind.BODY_KIND_REOPENABLE_SUPPLIER, RetryingHttpClient.bodyOf(HttpRequest.newBuilder(uri).POST(HttpRequest.BodyPublishers.ofFile(file)).build(), false).getKind());
    HttpRequest stream = HttpRequest.newBuilder(uri).POST(HttpRequest.BodyPublishers.ofInputStream(() -> null)).build();
    assertEquals(BodyKind.BODY_KIND_INPUT_STREAM, RetryingHttpClient.bodyOf(stream, false).getKind());
    assertEquals(BodyKind.BODY_KIND_REOPENABLE_SUPPLIER, RetryingHttpClient.bodyOf(stream, true).getKind());
    HttpRequest publisher = HttpRequest.newBuilder(uri).POST(HttpRequest.BodyPublishers.fromPublisher(new SubmissionPublisher<>())).build();
    assertEquals(BodyKind.BODY_KIND_PUBLISHER, RetryingHttpClient.bodyOf(publisher, false).getKind());
    HttpRequest iterable = HttpRequest.newBuilder(uri).POST(HttpRequest.BodyPublishers.ofByteArrays(List.of(new byte[1]))).build();
    assertEquals(BodyKind.BODY_KIND_PUBLISHER, RetryingHttpClient.bodyOf(iterable, false).getKind());
    Files.delete(file);
  }

  private static DecideRequest.Builder request() {
    return DecideRequest.newBuilder().setUpstream("u").setIdempotency(Idempotency.IDEMPOTENCY_SAFE).setAttempt(1);
  }

  private static Decision local(DecideRequest.Builder request) {
    return LocalRule.decide(LocalPolicy.DEFAULT, request.build(), "test");
  }

  @Test
  void theLocalRuleIsConservative() {
    assertEquals(Verdict.VERDICT_RETRY, local(request().setFailure(FailureKind.FAILURE_KIND_CONNECT)).verdict());
    assertEquals(Verdict.VERDICT_AMBIGUOUS, local(request().setIdempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).setFailure(FailureKind.FAILURE_KIND_CONNECTION_RESET)).verdict());
    assertEquals(Verdict.VERDICT_RETRY, local(request().setIdempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).setFailure(FailureKind.FAILURE_KIND_DNS)).verdict());
    assertEquals(DenyReason.DENY_REASON_PERMANENT_FAILURE, local(request().setFailure(FailureKind.FAILURE_KIND_TLS_CERTIFICATE_INVALID)).denyReason());
    assertEquals(DenyReason.DENY_REASON_BODY_NOT_REPLAYABLE,
        local(request().setHttpStatus(503).setBody(Body.newBuilder().setKind(BodyKind.BODY_KIND_INPUT_STREAM))).denyReason());
    assertEquals(DenyReason.DENY_REASON_BODY_NOT_REPLAYABLE,
        local(request().setHttpStatus(503).setBody(Body.newBuilder().setKind(BodyKind.BODY_KIND_MULTIPART)
            .addParts(Body.newBuilder().setKind(BodyKind.BODY_KIND_BYTES)).addParts(Body.newBuilder().setKind(BodyKind.BODY_KIND_PUBLISHER)))).denyReason());
    assertEquals(DenyReason.DENY_REASON_STATUS_NOT_RETRYABLE, local(request().setHttpStatus(500)).denyReason());
    assertEquals(Verdict.VERDICT_AMBIGUOUS, local(request().setIdempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).setHttpStatus(503)).verdict());
    Decision refresh = local(request().setHttpStatus(401));
    assertTrue(refresh.refreshCredentials() && refresh.shouldRetry());
    assertEquals(DenyReason.DENY_REASON_STATUS_NOT_RETRYABLE, local(request().setHttpStatus(401).setAuthRefreshAttempted(true)).denyReason());
    Decision retryAfter = local(request().setHttpStatus(429).setRetryAfter("3"));
    assertEquals(Duration.ofSeconds(3), retryAfter.backoff());
    assertEquals(DenyReason.DENY_REASON_DEADLINE, local(request().setHttpStatus(429).setRetryAfter("3")
        .setDeadlineRemaining(com.google.protobuf.Duration.newBuilder().setSeconds(1))).denyReason());
    assertEquals(DenyReason.DENY_REASON_DEADLINE, local(request().setFailure(FailureKind.FAILURE_KIND_CONNECT)
        .setDeadlineRemaining(com.google.protobuf.Duration.newBuilder().setNanos(10_000_000))).denyReason());
    Decision jitter = local(request().setFailure(FailureKind.FAILURE_KIND_CONNECT));
    assertTrue(jitter.backoff().compareTo(Duration.ofMillis(100)) <= 0, jitter.toString());

    // gRPC outcomes.
    assertEquals(Verdict.VERDICT_RETRY, local(request().setGrpcStatusCode(14).setEvidence(Evidence.EVIDENCE_RESPONSE_RECEIVED)).verdict());
    assertEquals(Verdict.VERDICT_AMBIGUOUS, local(request().setIdempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).setGrpcStatusCode(14).setEvidence(Evidence.EVIDENCE_RESPONSE_RECEIVED)).verdict());
    assertEquals(DenyReason.DENY_REASON_STATUS_NOT_RETRYABLE, local(request().setGrpcStatusCode(8).setEvidence(Evidence.EVIDENCE_RESPONSE_RECEIVED)).denyReason(), "RESOURCE_EXHAUSTED without pushback");
    Decision pushback = local(request().setGrpcStatusCode(8).setGrpcRetryPushbackMs("300"));
    assertEquals(Evidence.EVIDENCE_RESPONSE_RECEIVED, pushback.effectiveEvidence(), "a pushback means the server answered");
    assertTrue(pushback.backoff().compareTo(Duration.ofMillis(300)) >= 0, pushback.toString());
    assertEquals(DenyReason.DENY_REASON_SERVER_PUSHBACK, local(request().setGrpcStatusCode(8).setGrpcRetryPushbackMs("-1")).denyReason());
    assertEquals(DenyReason.DENY_REASON_SERVER_PUSHBACK, local(request().setGrpcStatusCode(14).setGrpcRetryPushbackMs("soon")).denyReason());
    assertEquals(Evidence.EVIDENCE_SENT_NO_RESPONSE, local(request().setGrpcStatusCode(4)).effectiveEvidence(), "a code alone proves nothing");
    assertTrue(local(request().setGrpcStatusCode(16).setEvidence(Evidence.EVIDENCE_RESPONSE_RECEIVED)).refreshCredentials());
  }

  @Test
  void retryAfterAndPushbackParse() {
    Instant now = Instant.parse("2026-01-01T00:00:00Z");
    assertEquals(Duration.ofSeconds(120), LocalRule.parseRetryAfter("120", now).orElseThrow());
    assertEquals(Duration.ofSeconds(30), LocalRule.parseRetryAfter("Thu, 01 Jan 2026 00:00:30 GMT", now).orElseThrow());
    assertEquals(Duration.ofSeconds(30), LocalRule.parseRetryAfter("Thursday, 01-Jan-26 00:00:30 GMT", now).orElseThrow());
    assertEquals(Duration.ofSeconds(30), LocalRule.parseRetryAfter("Thu Jan  1 00:00:30 2026", now).orElseThrow());
    assertEquals(Duration.ZERO, LocalRule.parseRetryAfter("Sun, 06 Nov 1994 08:49:37 GMT", now).orElseThrow());
    assertEquals(Duration.ZERO, LocalRule.parseRetryAfter("Sunday, 06-Nov-94 08:49:37 GMT", now).orElseThrow(), "94 is 1994");
    assertTrue(LocalRule.parseRetryAfter("soon", now).isEmpty());
    assertTrue(LocalRule.parseRetryAfter("-5", now).isEmpty());
    assertEquals(Duration.ofMillis(300), LocalRule.parsePushback(" 300\t").orElseThrow());
    assertTrue(LocalRule.parsePushback("-1").isEmpty());
    assertTrue(LocalRule.parsePushback("").isEmpty());
    assertTrue(LocalRule.parsePushback("1.5").isEmpty());
    assertEquals(Replayability.REPLAYABILITY_ONE_SHOT, LocalRule.replayability(Body.newBuilder().setKind(BodyKind.BODY_KIND_PUBLISHER_FACTORY).build()));
  }
}
