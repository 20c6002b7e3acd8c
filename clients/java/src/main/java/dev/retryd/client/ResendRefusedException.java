package dev.retryd.client;

import java.io.IOException;
import java.util.HashSet;
import java.util.Optional;
import java.util.Set;

/**
 * An attempt whose request was sent and got no response byte back (the
 * connection was closed or reset), after which the JDK's {@code HttpClient}
 * tried to re-send it by itself and {@link RetryingHttpClient} refused: the
 * re-send was never written, and retryd decides whether there is another
 * attempt. Evidence SENT_NO_RESPONSE, failure CONNECTION_RESET.
 */
public final class ResendRefusedException extends IOException {
  private static final long serialVersionUID = 1L;

  ResendRefusedException() {
    super("no response byte came back (connection closed or reset after the request was sent);"
        + " the JDK's own re-send was refused, so that retryd decides the next attempt");
  }

  static Optional<ResendRefusedException> in(Throwable error) {
    Set<Throwable> seen = new HashSet<>();
    for (Throwable cause = error; cause != null && seen.add(cause); cause = cause.getCause()) {
      if (cause instanceof ResendRefusedException) {
        return Optional.of((ResendRefusedException) cause);
      }
    }
    return Optional.empty();
  }
}
