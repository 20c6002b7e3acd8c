package dev.retryd.client;

import io.grpc.ClientStreamTracer;
import io.grpc.Metadata;
import java.util.ArrayList;
import java.util.List;

/**
 * What grpc-java did with one attempt's stream(s), as its stream tracer saw it
 * (the evidence a failed attempt's {@link GrpcOutcome} is built from), and the
 * attempt's {@code retryd.lineage} baggage member, put on the headers the
 * transport sends.
 */
final class AttemptTrace extends ClientStreamTracer.Factory {
  private final String lineage;
  volatile boolean streamCreated;
  volatile boolean trailersReceived;

  AttemptTrace(String lineage) {
    this.lineage = lineage;
  }

  @Override
  public ClientStreamTracer newClientStreamTracer(ClientStreamTracer.StreamInfo info, Metadata headers) {
    // The attempt's retryd.lineage member goes in here, on the headers the
    // transport sends (grpc-java lets a tracer change them): the interceptors
    // listed before this one run per attempt after it, and one of them may
    // add baggage of its own (OpenTelemetry's re-sends the inbound member).
    // The other members pass through untouched.
    Iterable<String> baggage = headers.removeAll(RetrydClientInterceptor.BAGGAGE);
    List<String> members = new ArrayList<>();
    if (baggage != null) {
      baggage.forEach(members::add);
    }
    headers.put(RetrydClientInterceptor.BAGGAGE, Lineage.withMember(members, lineage));
    return new ClientStreamTracer() {
      @Override
      public void streamCreated(io.grpc.Attributes transportAttrs, Metadata headers) {
        streamCreated = true;
      }

      @Override
      public void inboundTrailers(Metadata trailers) {
        trailersReceived = true;
      }
    };
  }
}
