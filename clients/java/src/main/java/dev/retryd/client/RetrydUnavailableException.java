package dev.retryd.client;

import io.grpc.Status;

/**
 * retryd could not answer (unreachable, timed out, or failed), and no local
 * fallback was configured, or the call was one (a traffic report, an admin
 * call) that has no fallback.
 */
public final class RetrydUnavailableException extends RetrydException {
  private static final long serialVersionUID = 1L;
  private final transient Status.Code code;

  /** The gRPC code the call to retryd ended with, and the exception it raised. */
  public RetrydUnavailableException(String message, Status.Code code, Throwable cause) {
    super(message, cause);
    this.code = code;
  }

  /** The gRPC code the call to retryd ended with. */
  public Status.Code code() {
    return code;
  }
}
