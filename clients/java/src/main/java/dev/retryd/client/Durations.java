package dev.retryd.client;

import java.time.Duration;

/** Conversions between java.time and google.protobuf.Duration. */
final class Durations {
  private Durations() {}

  static Duration fromProto(com.google.protobuf.Duration value) {
    return Duration.ofSeconds(value.getSeconds(), value.getNanos());
  }

  /** Negative values are sent as they are (retryd rejects them, naming the field). */
  static com.google.protobuf.Duration toProto(Duration value) {
    long seconds = value.getSeconds();
    int nanos = value.getNano();
    // java.time keeps nanos non-negative; protobuf wants them to share the sign of seconds.
    if (seconds < 0 && nanos > 0) {
      seconds += 1;
      nanos -= 1_000_000_000;
    }
    return com.google.protobuf.Duration.newBuilder().setSeconds(seconds).setNanos(nanos).build();
  }
}
