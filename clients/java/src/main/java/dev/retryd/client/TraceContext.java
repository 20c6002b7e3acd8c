package dev.retryd.client;

import java.util.Objects;
import java.util.Optional;
import java.util.regex.Pattern;

/**
 * A W3C trace context to send with a call to retryd, so that retryd's
 * {@code retry.decide} span joins the caller's trace.
 *
 * <p>OpenTelemetry's Java API is not a dependency of this client (it is not
 * packaged where this client is built): give the client a supplier that reads
 * the current span from whatever tracing library you use, for example with
 * OpenTelemetry:
 *
 * <pre>{@code
 * RetrydClient.builder(target).traceContext(() -> {
 *   SpanContext span = Span.current().getSpanContext();
 *   return span.isValid()
 *       ? TraceContext.of(span.getTraceId(), span.getSpanId(), span.isSampled())
 *       : null;
 * })
 * }</pre>
 */
public final class TraceContext {
  private static final Pattern TRACEPARENT = Pattern.compile("00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}");
  private static final Pattern ZEROS = Pattern.compile("0+");

  private final String traceparent;
  private final String tracestate;

  private TraceContext(String traceparent, String tracestate) {
    this.traceparent = traceparent;
    this.tracestate = tracestate;
  }

  /**
   * A context from its ids. Only the sampled flag is sent: some version-00
   * parsers reject the Level 2 "random" flag, which would cut retryd's span out
   * of the trace.
   *
   * @param traceId 32 lowercase hex digits, not all zero
   * @param spanId 16 lowercase hex digits, not all zero
   * @throws IllegalArgumentException if an id is malformed
   */
  public static TraceContext of(String traceId, String spanId, boolean sampled) {
    return parse("00-" + traceId + "-" + spanId + (sampled ? "-01" : "-00"), null)
        .orElseThrow(() -> new IllegalArgumentException("traceparent: invalid trace or span id"));
  }

  /**
   * A context from raw {@code traceparent} and optional {@code tracestate}
   * headers, as a propagator would carry them; empty if the traceparent is not a
   * valid version-00 value (which is then not sent at all).
   */
  public static Optional<TraceContext> parse(String traceparent, String tracestate) {
    if (traceparent == null || !TRACEPARENT.matcher(traceparent).matches()) {
      return Optional.empty();
    }
    if (ZEROS.matcher(traceparent.substring(3, 35)).matches() || ZEROS.matcher(traceparent.substring(36, 52)).matches()) {
      return Optional.empty();
    }
    int flags = Integer.parseInt(traceparent.substring(53), 16) & 0x01;
    String sent = traceparent.substring(0, 53) + (flags == 1 ? "01" : "00");
    String state = tracestate == null || tracestate.isBlank() ? null : tracestate;
    return Optional.of(new TraceContext(sent, state));
  }

  /** The {@code traceparent} value sent. */
  public String traceparent() {
    return traceparent;
  }

  /** The {@code tracestate} value sent, if any. */
  public Optional<String> tracestate() {
    return Optional.ofNullable(tracestate);
  }

  @Override
  public boolean equals(Object other) {
    return other instanceof TraceContext
        && traceparent.equals(((TraceContext) other).traceparent)
        && Objects.equals(tracestate, ((TraceContext) other).tracestate);
  }

  @Override
  public int hashCode() {
    return Objects.hash(traceparent, tracestate);
  }

  @Override
  public String toString() {
    return traceparent;
  }
}
