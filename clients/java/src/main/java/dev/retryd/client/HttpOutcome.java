package dev.retryd.client;

import java.io.EOFException;
import java.io.IOException;
import java.net.ConnectException;
import java.net.UnknownHostException;
import java.net.http.HttpConnectTimeoutException;
import java.net.http.HttpResponse;
import java.net.http.HttpTimeoutException;
import java.nio.channels.ClosedChannelException;
import java.nio.channels.UnresolvedAddressException;
import java.security.cert.CertPathValidatorException;
import java.security.cert.CertificateException;
import java.util.HashSet;
import java.util.Locale;
import java.util.Objects;
import java.util.Set;
import javax.net.ssl.SSLException;
import javax.net.ssl.SSLHandshakeException;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.FailureKind;

/**
 * What one attempt over {@link java.net.http.HttpClient} proves, in retryd's
 * terms: the evidence, the stage failure, the status and Retry-After.
 *
 * <table>
 *   <caption>What the JDK raises, and what it proves</caption>
 *   <tr><th>JDK outcome</th><th>evidence</th><th>failure</th></tr>
 *   <tr><td>{@code HttpConnectTimeoutException}, {@code ConnectException}</td><td>NOT_SENT</td><td>CONNECT</td></tr>
 *   <tr><td>{@code UnresolvedAddressException}, {@code UnknownHostException} (in the chain)</td><td>NOT_SENT</td><td>DNS</td></tr>
 *   <tr><td>a certificate that does not validate (a {@code CertificateException} or
 *       {@code CertPathValidatorException} in a handshake failure)</td><td>NOT_SENT</td><td>TLS_CERTIFICATE_INVALID (permanent)</td></tr>
 *   <tr><td>another {@code SSLHandshakeException}, or "Unsupported or unrecognized SSL
 *       message" (the peer's first bytes were not TLS)</td><td>NOT_SENT</td><td>PRE_REQUEST_TLS</td></tr>
 *   <tr><td>{@code HttpTimeoutException} before the headers</td><td>SENT_NO_RESPONSE</td><td>RESPONSE_HEADER_TIMEOUT</td></tr>
 *   <tr><td>{@link ResendRefusedException}, a reset, "header parser received no bytes", EOF, a closed channel, before the headers</td><td>SENT_NO_RESPONSE</td><td>CONNECTION_RESET</td></tr>
 *   <tr><td>any other {@code IOException} before the headers (another {@code SSLException} included)</td><td>SENT_NO_RESPONSE</td><td>GENERIC_IO</td></tr>
 *   <tr><td>a body read that fails after the headers</td><td>PARTIAL_RESPONSE</td><td>DECODE_RESET (INTERRUPTED_STREAM for a timeout)</td></tr>
 *   <tr><td>a response</td><td>RESPONSE_RECEIVED</td><td>(status, Retry-After)</td></tr>
 * </table>
 *
 * <p>The JDK makes the TLS handshake before it writes any request byte, so a
 * handshake failure proves NOT_SENT. The JDK raises a peer that does not speak
 * TLS as a plain {@code SSLException} ("Unrecognized SSL message"), not as a
 * handshake failure; it is taken as one, since a server that completed a TLS
 * handshake and then sent non-TLS records is not one that exists in practice. A timeout never does: the request was
 * written, and the upstream may be executing it. An unknown {@code IOException}
 * is never NOT_SENT.
 */
public final class HttpOutcome {
  private final Evidence evidence;
  private final FailureKind failure;
  private final int httpStatus;
  private final String retryAfter;

  /** An outcome; {@code retryAfter} may be null. */
  public HttpOutcome(Evidence evidence, FailureKind failure, int httpStatus, String retryAfter) {
    this.evidence = Objects.requireNonNull(evidence);
    this.failure = Objects.requireNonNull(failure);
    this.httpStatus = httpStatus;
    this.retryAfter = retryAfter;
  }

  /** The evidence claimed. */
  public Evidence evidence() {
    return evidence;
  }

  /** The stage failure, FAILURE_KIND_UNSPECIFIED for a plain status. */
  public FailureKind failure() {
    return failure;
  }

  /** The HTTP status, 0 if no headers arrived. */
  public int httpStatus() {
    return httpStatus;
  }

  /** The raw Retry-After header, or null. */
  public String retryAfter() {
    return retryAfter;
  }

  /** A response whose headers arrived: its status and Retry-After. */
  public static HttpOutcome ofResponse(HttpResponse.ResponseInfo response) {
    return new HttpOutcome(
        Evidence.EVIDENCE_RESPONSE_RECEIVED,
        FailureKind.FAILURE_KIND_UNSPECIFIED,
        response.statusCode(),
        response.headers().firstValue("retry-after").orElse(null));
  }

  /**
   * What an exception of {@link java.net.http.HttpClient} proves (see the table).
   *
   * @param headers the response headers if they had arrived before the failure
   *     (a body read that failed), else null
   */
  public static HttpOutcome ofException(Throwable error, HttpResponse.ResponseInfo headers) {
    if (headers != null) {
      FailureKind failure =
          has(error, HttpTimeoutException.class) ? FailureKind.FAILURE_KIND_INTERRUPTED_STREAM : FailureKind.FAILURE_KIND_DECODE_RESET;
      return new HttpOutcome(
          Evidence.EVIDENCE_PARTIAL_RESPONSE, failure, headers.statusCode(), headers.headers().firstValue("retry-after").orElse(null));
    }
    if (has(error, ResendRefusedException.class)) {
      return sentNoResponse(FailureKind.FAILURE_KIND_CONNECTION_RESET);
    }
    if (has(error, HttpConnectTimeoutException.class)) {
      return notSent(FailureKind.FAILURE_KIND_CONNECT);
    }
    if (has(error, UnresolvedAddressException.class) || has(error, UnknownHostException.class)) {
      return notSent(FailureKind.FAILURE_KIND_DNS);
    }
    if (has(error, ConnectException.class)) {
      return notSent(FailureKind.FAILURE_KIND_CONNECT);
    }
    if (has(error, SSLException.class)) {
      if (has(error, CertificateException.class) || has(error, CertPathValidatorException.class)) {
        return notSent(FailureKind.FAILURE_KIND_TLS_CERTIFICATE_INVALID);
      }
      if (has(error, SSLHandshakeException.class) || messages(error).contains("unrecognized ssl message")) {
        return notSent(FailureKind.FAILURE_KIND_PRE_REQUEST_TLS);
      }
      // An SSLException after the handshake says nothing about the request.
      return sentNoResponse(FailureKind.FAILURE_KIND_GENERIC_IO);
    }
    if (has(error, HttpTimeoutException.class)) {
      return sentNoResponse(FailureKind.FAILURE_KIND_RESPONSE_HEADER_TIMEOUT);
    }
    String text = messages(error);
    if (has(error, EOFException.class)
        || has(error, ClosedChannelException.class)
        || text.contains("connection reset")
        || text.contains("header parser received no bytes")
        || text.contains("connection closed")
        || text.contains("broken pipe")) {
      return sentNoResponse(FailureKind.FAILURE_KIND_CONNECTION_RESET);
    }
    return sentNoResponse(FailureKind.FAILURE_KIND_GENERIC_IO);
  }

  private static HttpOutcome notSent(FailureKind failure) {
    return new HttpOutcome(Evidence.EVIDENCE_NOT_SENT, failure, 0, null);
  }

  private static HttpOutcome sentNoResponse(FailureKind failure) {
    return new HttpOutcome(Evidence.EVIDENCE_SENT_NO_RESPONSE, failure, 0, null);
  }

  private static boolean has(Throwable error, Class<?> type) {
    Set<Throwable> seen = new HashSet<>();
    for (Throwable cause = error; cause != null && seen.add(cause); cause = cause.getCause()) {
      if (type.isInstance(cause)) {
        return true;
      }
    }
    return false;
  }

  private static String messages(Throwable error) {
    StringBuilder text = new StringBuilder();
    Set<Throwable> seen = new HashSet<>();
    for (Throwable cause = error; cause != null && seen.add(cause); cause = cause.getCause()) {
      text.append(cause.getMessage()).append('\n');
    }
    return text.toString().toLowerCase(Locale.ROOT);
  }

  @Override
  public String toString() {
    return evidence.name() + "/" + failure.name() + (httpStatus == 0 ? "" : "/" + httpStatus);
  }

}
