package dev.retryd.client;

/**
 * retryd rejected the request as invalid (INVALID_ARGUMENT), or the local rule
 * did when retryd was unreachable. Never hidden by the fallback: an invalid
 * request is a bug in the caller, not an outage.
 */
public final class InvalidRequestException extends RetrydException {
  private static final long serialVersionUID = 1L;

  /** The message, which starts with the offending field ("upstream: required"). */
  public InvalidRequestException(String message) {
    super(message, null);
  }

  /**
   * The offending field: the message up to its first ':' (for example
   * {@code "body.parts[0].declared"}), or the whole message if it has none.
   */
  public String field() {
    String message = getMessage() == null ? "" : getMessage();
    int colon = message.indexOf(':');
    return colon < 0 ? message : message.substring(0, colon);
  }
}
