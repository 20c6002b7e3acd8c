package dev.retryd.client;

import java.io.IOException;
import java.net.http.HttpResponse;
import java.util.Optional;

/**
 * retryd answered AMBIGUOUS: the request may have taken effect upstream, so it
 * was not retried, and reporting a plain failure would claim it did not happen.
 * Reconcile: query the upstream, or replay with an idempotency key.
 *
 * <p>An {@link IOException}, so that {@link RetryingHttpClient#send} keeps the
 * checked exceptions of {@link java.net.http.HttpClient#send}. The cause is the
 * failure of the last attempt, if it was an exception.
 */
public final class AmbiguousExecutionException extends IOException {
  private static final long serialVersionUID = 1L;
  private final transient Decision decision;
  private final transient HttpResponse<?> response;

  /** An AMBIGUOUS decision, the response of the last attempt (or null) and its failure (or null). */
  public AmbiguousExecutionException(Decision decision, HttpResponse<?> response, Throwable cause) {
    super("retryd: AMBIGUOUS (rule " + decision.rule() + "): " + decision.explanation(), cause);
    this.decision = decision;
    this.response = response;
  }

  /** The AMBIGUOUS decision. */
  public Decision decision() {
    return decision;
  }

  /** The response of the last attempt, if one arrived (a 503, say). */
  public Optional<HttpResponse<?>> response() {
    return Optional.ofNullable(response);
  }
}
