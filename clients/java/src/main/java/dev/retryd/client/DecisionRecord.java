package dev.retryd.client;

import java.util.HashSet;
import java.util.Optional;
import java.util.Set;

/**
 * Carries retryd's decision on a failure the adapters pass back to the caller
 * unchanged: as a suppressed exception of an {@code IOException} rethrown by
 * {@link RetryingHttpClient}, or as the cause of the {@code Status} a
 * {@link RetrydClientInterceptor} call closes with. Find it with {@link #find}.
 */
final class DecisionRecord extends RuntimeException {
  private static final long serialVersionUID = 1L;
  final transient Decision decision;

  DecisionRecord(Decision decision, Throwable cause) {
    super("retryd: " + decision, cause, false, false);
    this.decision = decision;
  }

  static Optional<Decision> find(Throwable error) {
    Set<Throwable> seen = new HashSet<>();
    for (Throwable cause = error; cause != null && seen.add(cause); cause = cause.getCause()) {
      if (cause instanceof DecisionRecord) {
        return Optional.of(((DecisionRecord) cause).decision);
      }
      if (cause instanceof AmbiguousExecutionException) {
        return Optional.of(((AmbiguousExecutionException) cause).decision());
      }
      for (Throwable suppressed : cause.getSuppressed()) {
        if (suppressed instanceof DecisionRecord) {
          return Optional.of(((DecisionRecord) suppressed).decision);
        }
      }
    }
    return Optional.empty();
  }
}
