package dev.retryd.client;

import io.grpc.Context;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.Objects;
import java.util.Optional;

/**
 * Where a call sits in a call chain (docs/lineage.md): the {@code retryd.lineage}
 * member of the W3C {@code baggage} header, and what the inbound middleware
 * ({@link LineageFilter}, {@link LineageServletFilter}, {@link
 * LineageServerInterceptor}) and the outbound adapters ({@link
 * RetryingHttpClient}, {@link RetrydClientInterceptor}) share about the
 * request being served.
 *
 * <p>The request being served is held in a grpc-java {@link Context} under one
 * key, for both HTTP and gRPC servers: grpc-java attaches the server call's
 * context on every callback of a handler, and {@link LineageFilter} (and
 * {@link LineageServletFilter}) runs the exchange's handler (the servlet) inside one. A {@code Context} is a thread-local scope, so
 * work handed to another thread carries it only if you say so: {@code
 * Context.current().wrap(task)}, or {@code Context.currentContextExecutor(executor)}
 * for an executor (a {@code CompletableFuture.supplyAsync(task, that executor)}
 * included). {@link #current()} is what the adapters read.
 *
 * <p>Values are validated strictly and shortened as the contract says; an
 * inbound value that is not valid is ignored (it came from a caller we do not
 * control), so that a bad header can never make the Decide request invalid.
 */
public final class Lineage {
  private Lineage() {}

  /** The baggage member's key. */
  public static final String BAGGAGE_MEMBER = "retryd.lineage";
  /** The HTTP response header and gRPC trailer naming the layer that already retried a failure. */
  public static final String RETRIED_HEADER = "retryd-retried";
  /** The most entries a lineage holds. */
  public static final int MAX_ENTRIES = 32;
  /** The most bytes a lineage holds. */
  public static final int MAX_BYTES = 1024;
  /** The highest attempt number of an entry. */
  public static final int MAX_ATTEMPT = 1000;
  /** The layer name standing for the dropped outermost entries of a shortened lineage. */
  public static final String DROPPED = "...";

  private static final int MAX_LAYER_BYTES = 64;

  static final Context.Key<Inbound> KEY = Context.key("retryd-lineage");

  /**
   * The request being served, as the inbound middleware saw it: its lineage
   * (shortened, possibly empty) and whether one of its outbound calls ended in
   * failure after retryd's decision. Thread-safe.
   */
  public static final class Inbound {
    private final String lineage;
    private volatile boolean failedAfterDecision;

    Inbound(String lineage) {
      this.lineage = lineage;
    }

    /** The inbound lineage, outermost first, without this layer's entry; empty if the request carried none. */
    public String lineage() {
      return lineage;
    }

    /**
     * Whether an outbound call made while serving this request ended in failure
     * after retryd's decision (a DENY, an AMBIGUOUS, or the failed last attempt of
     * a RETRY): the middleware then marks a failed response with {@code retryd-retried}.
     */
    public boolean failedAfterDecision() {
      return failedAfterDecision;
    }

    /** Records that an outbound call ended in failure after retryd's decision (the adapters call it). */
    public void markFailedAfterDecision() {
      failedAfterDecision = true;
    }
  }

  /** The request being served on this thread (its grpc {@link Context}), if an inbound middleware put one there. */
  public static Optional<Inbound> current() {
    return Optional.ofNullable(KEY.get());
  }

  /** A context holding {@code inbound}, for code that serves requests without the middleware. */
  public static Context withInbound(Context context, Inbound inbound) {
    return context.withValue(KEY, Objects.requireNonNull(inbound, "inbound"));
  }

  /** A request being served with this (raw, inbound) lineage value: invalid is ignored, long is shortened. */
  public static Inbound inbound(String rawLineage) {
    return new Inbound(rawLineage == null ? "" : shorten(rawLineage).orElse(""));
  }

  /** Whether {@code name} is a valid layer name: 1 to 64 bytes of {@code [A-Za-z0-9._-]}. */
  public static boolean isValidLayer(String name) {
    if (name == null || name.isEmpty() || name.length() > MAX_LAYER_BYTES) {
      return false;
    }
    for (int i = 0; i < name.length(); i++) {
      if (!isLayerChar(name.charAt(i))) {
        return false;
      }
    }
    return true;
  }

  private static boolean isLayerChar(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
  }

  /** One {@code layer:attempt} entry. */
  private static final class Entry {
    final String layer;
    final int attempt;

    Entry(String layer, int attempt) {
      this.layer = layer;
      this.attempt = attempt;
    }

    @Override
    public String toString() {
      return layer + ":" + attempt;
    }
  }

  /** The entries of a value, or empty if any entry is not valid (any count, any length). */
  private static Optional<List<Entry>> entries(String value) {
    List<Entry> entries = new ArrayList<>();
    if (value.isEmpty()) {
      return Optional.of(entries);
    }
    for (String part : value.split("/", -1)) {
      int colon = part.lastIndexOf(':');
      if (colon < 0) {
        return Optional.empty();
      }
      String layer = part.substring(0, colon);
      String digits = part.substring(colon + 1);
      if (!isValidLayer(layer) || digits.isEmpty() || digits.length() > 4 || !digits.chars().allMatch(c -> c >= '0' && c <= '9')) {
        return Optional.empty();
      }
      int attempt = Integer.parseInt(digits);
      if (attempt < 1 || attempt > MAX_ATTEMPT) {
        return Optional.empty();
      }
      entries.add(new Entry(layer, attempt));
    }
    return Optional.of(entries);
  }

  /** Whether {@code value} is a valid lineage as retryd accepts it (at most 32 entries and 1024 bytes; empty is valid). */
  public static boolean isValid(String value) {
    return value != null
        && value.getBytes(StandardCharsets.UTF_8).length <= MAX_BYTES
        && entries(value).map(list -> list.size() <= MAX_ENTRIES).orElse(false);
  }

  /**
   * A valid inbound value, shortened to at most 32 entries and 1024 bytes by
   * dropping the outermost entries; if any dropped entry had an attempt above 1,
   * {@code ...:<the highest>} comes first, so that an enclosing retry is still
   * seen. Empty if any entry is not valid.
   */
  public static Optional<String> shorten(String value) {
    return entries(value.trim()).map(Lineage::fit);
  }

  /**
   * The value an outbound attempt sends: the inbound lineage plus this layer's
   * {@code layer:attempt}, shortened the same way (this layer's entry is never dropped).
   */
  public static String outbound(String inboundLineage, String layer, int attempt) {
    if (!isValidLayer(layer)) {
      throw new IllegalArgumentException("layer: 1 to 64 bytes of [A-Za-z0-9._-], got " + layer);
    }
    String own = layer + ":" + Math.max(1, Math.min(MAX_ATTEMPT, attempt));
    // On every attempt of every call: the common cases without parsing (an
    // Inbound's lineage is valid and shortened already).
    if (inboundLineage.isEmpty()) {
      return own;
    }
    if (inboundLineage.length() + 1 + own.length() <= MAX_BYTES && isValid(inboundLineage) && count(inboundLineage, '/') < MAX_ENTRIES - 1) {
      return inboundLineage + "/" + own;
    }
    List<Entry> entries = entries(inboundLineage).orElseGet(ArrayList::new);
    entries.add(new Entry(layer, Math.max(1, Math.min(MAX_ATTEMPT, attempt))));
    return fit(entries);
  }

  private static int count(String value, char c) {
    int n = 0;
    for (int i = 0; i < value.length(); i++) {
      if (value.charAt(i) == c) {
        n++;
      }
    }
    return n;
  }

  private static String fit(List<Entry> entries) {
    int dropped = 0;
    int highestDropped = 0;
    while (true) {
      List<Entry> kept = new ArrayList<>();
      if (highestDropped > 1) {
        kept.add(new Entry(DROPPED, highestDropped));
      }
      kept.addAll(entries.subList(dropped, entries.size()));
      String joined = join(kept);
      if (kept.size() <= MAX_ENTRIES && joined.length() <= MAX_BYTES) {
        return joined;
      }
      highestDropped = Math.max(highestDropped, entries.get(dropped).attempt);
      dropped++;
    }
  }

  private static String join(List<Entry> entries) {
    StringBuilder joined = new StringBuilder();
    for (Entry entry : entries) {
      if (joined.length() > 0) {
        joined.append('/');
      }
      joined.append(entry);
    }
    return joined.toString();
  }

  /** Whether a lineage holds an attempt above 1: the call is made inside a retry of an enclosing call. */
  public static boolean isInsideEnclosingRetry(String lineage) {
    return entries(lineage).map(list -> list.stream().anyMatch(entry -> entry.attempt > 1)).orElse(false);
  }

  /**
   * The raw {@code retryd.lineage} member of baggage header values (a header may
   * repeat; members are comma-separated, properties after {@code ;}), or empty.
   */
  public static Optional<String> fromBaggage(List<String> baggageValues) {
    if (baggageValues == null) {
      return Optional.empty();
    }
    for (String header : baggageValues) {
      for (String member : header.split(",")) {
        int equals = member.indexOf('=');
        if (equals > 0 && member.substring(0, equals).trim().equals(BAGGAGE_MEMBER)) {
          String value = member.substring(equals + 1);
          int properties = value.indexOf(';');
          return Optional.of((properties < 0 ? value : value.substring(0, properties)).trim());
        }
      }
    }
    return Optional.empty();
  }

  /**
   * One baggage header value: the members of {@code baggageValues} but {@code
   * retryd.lineage}, untouched and in order, then {@code retryd.lineage=<lineage>}.
   */
  public static String withMember(List<String> baggageValues, String lineage) {
    if (baggageValues == null || baggageValues.isEmpty()) {
      return BAGGAGE_MEMBER + "=" + lineage;
    }
    StringBuilder baggage = new StringBuilder();
    if (baggageValues != null) {
      for (String header : baggageValues) {
        for (String member : header.split(",")) {
          int equals = member.indexOf('=');
          String key = equals < 0 ? member.trim() : member.substring(0, equals).trim();
          if (member.trim().isEmpty() || key.equals(BAGGAGE_MEMBER)) {
            continue;
          }
          baggage.append(member.trim()).append(',');
        }
      }
    }
    return baggage.append(BAGGAGE_MEMBER).append('=').append(lineage).toString();
  }

  /** A {@code retryd-retried} value if it names a valid layer (ignored otherwise: it came from an upstream). */
  static Optional<String> retriedBelow(String headerValue) {
    if (headerValue == null) {
      return Optional.empty();
    }
    String value = headerValue.trim();
    return isValidLayer(value) ? Optional.of(value) : Optional.empty();
  }

  /**
   * The default layer name: {@code OTEL_SERVICE_NAME} if set and valid, else the
   * program's name (the main class's simple name or the jar's, from {@code
   * sun.java.command}) sanitised to the charset, else {@code service}.
   */
  public static String defaultLayer() {
    return defaultLayer(System.getenv("OTEL_SERVICE_NAME"), System.getProperty("sun.java.command"));
  }

  static String defaultLayer(String otelServiceName, String javaCommand) {
    if (isValidLayer(otelServiceName)) {
      return otelServiceName;
    }
    if (javaCommand != null && !javaCommand.trim().isEmpty()) {
      String program = javaCommand.trim().split("\\s+")[0];
      program = program.substring(program.lastIndexOf('/') + 1);
      if (program.toLowerCase(Locale.ROOT).endsWith(".jar")) {
        program = program.substring(0, program.length() - 4);
      } else {
        program = program.substring(program.lastIndexOf('.') + 1); // a main class: its simple name
      }
      String sanitised = sanitise(program);
      if (isValidLayer(sanitised)) {
        return sanitised;
      }
    }
    return "service";
  }

  private static String sanitise(String name) {
    StringBuilder clean = new StringBuilder();
    for (int i = 0; i < name.length() && clean.length() < MAX_LAYER_BYTES; i++) {
      char c = name.charAt(i);
      clean.append(isLayerChar(c) ? c : '_');
    }
    return clean.toString();
  }
}
