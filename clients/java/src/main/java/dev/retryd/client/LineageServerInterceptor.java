package dev.retryd.client;

import io.grpc.Context;
import io.grpc.Contexts;
import io.grpc.ForwardingServerCall;
import io.grpc.Metadata;
import io.grpc.ServerCall;
import io.grpc.ServerCallHandler;
import io.grpc.ServerInterceptor;
import io.grpc.Status;
import java.util.ArrayList;
import java.util.List;
import java.util.Objects;

/**
 * The inbound side of a call chain (docs/lineage.md) for grpc-java servers:
 * reads the call's {@code retryd.lineage} baggage member into the call's
 * {@link Context} (see {@link Lineage}), and on a non-OK status, when one of
 * the handler's outbound calls ended in failure after retryd's decision, adds
 * the trailers {@code retryd-retried: <layer>} and {@code grpc-retry-pushback-ms: -1}
 * (so that a plain gRPC client, gRFC A6, does not retry either).
 *
 * <pre>{@code
 * Server server = NettyServerBuilder.forPort(8080)
 *     .addService(ServerInterceptors.intercept(service, LineageServerInterceptor.of(retryd)))
 *     .build();
 * }</pre>
 *
 * <p>grpc-java attaches the call's context on every callback of the handler,
 * so a blocking or async stub called from the handler finds it; work handed to
 * another thread carries it with {@code Context.current().wrap(task)}.
 */
public final class LineageServerInterceptor implements ServerInterceptor {
  static final Metadata.Key<String> PUSHBACK = Metadata.Key.of("grpc-retry-pushback-ms", Metadata.ASCII_STRING_MARSHALLER);

  private final String layer;

  private LineageServerInterceptor(String layer) {
    if (!Lineage.isValidLayer(layer)) {
      throw new IllegalArgumentException("layer: 1 to 64 bytes of [A-Za-z0-9._-], got " + layer);
    }
    this.layer = layer;
  }

  /** An interceptor naming this layer as {@code retryd}'s {@link RetrydClient#layer()}. */
  public static LineageServerInterceptor of(RetrydClient retryd) {
    return new LineageServerInterceptor(Objects.requireNonNull(retryd, "retryd").layer());
  }

  /** An interceptor naming this layer {@code layer} (the same name as the outbound adapters' client). */
  public static LineageServerInterceptor of(String layer) {
    return new LineageServerInterceptor(layer);
  }

  @Override
  public <Q, R> ServerCall.Listener<Q> interceptCall(ServerCall<Q, R> call, Metadata headers, ServerCallHandler<Q, R> next) {
    Iterable<String> baggage = headers.getAll(RetrydClientInterceptor.BAGGAGE);
    List<String> values = new ArrayList<>();
    if (baggage != null) {
      baggage.forEach(values::add);
    }
    Lineage.Inbound inbound = Lineage.inbound(Lineage.fromBaggage(values).orElse(""));
    ServerCall<Q, R> marking =
        new ForwardingServerCall.SimpleForwardingServerCall<Q, R>(call) {
          @Override
          public void close(Status status, Metadata trailers) {
            if (!status.isOk() && inbound.failedAfterDecision()) {
              trailers.discardAll(RetrydClientInterceptor.RETRIED);
              trailers.put(RetrydClientInterceptor.RETRIED, layer);
              trailers.discardAll(PUSHBACK);
              trailers.put(PUSHBACK, "-1");
            }
            super.close(status, trailers);
          }
        };
    return Contexts.interceptCall(Lineage.withInbound(Context.current(), inbound), marking, headers, next);
  }
}
