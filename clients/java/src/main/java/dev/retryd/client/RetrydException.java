package dev.retryd.client;

/** The base of every unchecked exception this client throws. */
public class RetrydException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  /** An exception with a message and an optional cause. */
  public RetrydException(String message, Throwable cause) {
    super(message, cause);
  }
}
