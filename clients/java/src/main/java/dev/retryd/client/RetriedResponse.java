package dev.retryd.client;

import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpHeaders;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.util.Optional;
import javax.net.ssl.SSLSession;

/**
 * The final response of {@link RetryingHttpClient#send}: the JDK's response of
 * the last attempt, plus how many attempts it took and retryd's last decision.
 *
 * @param <T> the body type of the {@code BodyHandler}
 */
public final class RetriedResponse<T> implements HttpResponse<T> {
  private final HttpResponse<T> response;
  private final int attempts;
  private final Decision decision;

  RetriedResponse(HttpResponse<T> response, int attempts, Decision decision) {
    this.response = response;
    this.attempts = attempts;
    this.decision = decision;
  }

  /** Attempts made, this one included (1: it succeeded, or was returned, without a retry). */
  public int attempts() {
    return attempts;
  }

  /**
   * The last decision retryd (or the local rule) made for this call: the RETRY
   * before this successful attempt, or the DENY that returned this error
   * response. Empty when the first attempt's response needed no decision.
   */
  public Optional<Decision> decision() {
    return Optional.ofNullable(decision);
  }

  /** The JDK's response of the last attempt. */
  public HttpResponse<T> unwrap() {
    return response;
  }

  @Override
  public int statusCode() {
    return response.statusCode();
  }

  @Override
  public HttpRequest request() {
    return response.request();
  }

  @Override
  public Optional<HttpResponse<T>> previousResponse() {
    return response.previousResponse();
  }

  @Override
  public HttpHeaders headers() {
    return response.headers();
  }

  @Override
  public T body() {
    return response.body();
  }

  @Override
  public Optional<SSLSession> sslSession() {
    return response.sslSession();
  }

  @Override
  public URI uri() {
    return response.uri();
  }

  @Override
  public HttpClient.Version version() {
    return response.version();
  }

  @Override
  public String toString() {
    return response + " after " + attempts + " attempt(s)" + (decision == null ? "" : ", " + decision);
  }
}
