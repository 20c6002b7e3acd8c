package dev.retryd.client;

import io.grpc.Metadata;
import io.grpc.Status;
import java.util.Objects;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.FailureKind;

/**
 * What one failed grpc-java call attempt proves, in retryd's terms, from what
 * the attempt's {@link io.grpc.ClientStreamTracer} saw:
 *
 * <table>
 *   <caption>grpc-java outcome, and what it proves</caption>
 *   <tr><th>what the tracer saw</th><th>evidence</th><th>failure</th></tr>
 *   <tr><td>no stream was ever created on a transport (no connection, the channel
 *       failing fast, a deadline spent connecting)</td><td>NOT_SENT</td><td>CONNECT</td></tr>
 *   <tr><td>trailers arrived: the server sent the status (its
 *       {@code grpc-retry-pushback-ms} is passed raw)</td><td>RESPONSE_RECEIVED</td><td>-</td></tr>
 *   <tr><td>a response message arrived, then no trailers</td><td>PARTIAL_RESPONSE</td><td>INTERRUPTED_STREAM</td></tr>
 *   <tr><td>DEADLINE_EXCEEDED after a stream was created</td><td>SENT_NO_RESPONSE</td><td>RESPONSE_HEADER_TIMEOUT</td></tr>
 *   <tr><td>any other code after a stream was created (a reset, a GOAWAY, a
 *       local UNAVAILABLE)</td><td>SENT_NO_RESPONSE</td><td>CONNECTION_RESET</td></tr>
 * </table>
 *
 * <p>The status code always goes in {@code grpc_status_code}: a code alone proves
 * nothing (grpc-java makes up DEADLINE_EXCEEDED, CANCELLED and UNAVAILABLE by
 * itself), which is why the evidence comes from the tracer and not from the code.
 * A stream created but whose headers were not written is still SENT_NO_RESPONSE:
 * nothing grpc-java exposes proves that no byte of it left.
 */
public final class GrpcOutcome {
  /** The trailer of gRFC A6. */
  public static final Metadata.Key<String> PUSHBACK = Metadata.Key.of("grpc-retry-pushback-ms", Metadata.ASCII_STRING_MARSHALLER);

  private final Evidence evidence;
  private final FailureKind failure;
  private final int grpcStatusCode;
  private final String pushback;

  /** An outcome; {@code pushback} is the raw trailer value, or null when the server sent none. */
  public GrpcOutcome(Evidence evidence, FailureKind failure, int grpcStatusCode, String pushback) {
    this.evidence = Objects.requireNonNull(evidence);
    this.failure = Objects.requireNonNull(failure);
    this.grpcStatusCode = grpcStatusCode;
    this.pushback = pushback;
  }

  /** The evidence claimed. */
  public Evidence evidence() {
    return evidence;
  }

  /** The stage failure. */
  public FailureKind failure() {
    return failure;
  }

  /** The status code, as the {@code google.rpc.Code} number. */
  public int grpcStatusCode() {
    return grpcStatusCode;
  }

  /** The raw {@code grpc-retry-pushback-ms} trailer, or null. */
  public String pushback() {
    return pushback;
  }

  /**
   * Classifies a failed attempt.
   *
   * @param streamCreated whether grpc-java created a stream for it on a transport
   * @param trailersReceived whether the server's trailers (its status) arrived
   * @param messageReceived whether a response message arrived
   */
  public static GrpcOutcome of(Status status, Metadata trailers, boolean streamCreated, boolean trailersReceived, boolean messageReceived) {
    int code = status.getCode().value();
    if (!streamCreated) {
      return new GrpcOutcome(Evidence.EVIDENCE_NOT_SENT, FailureKind.FAILURE_KIND_CONNECT, code, null);
    }
    if (trailersReceived) {
      String pushback = trailers == null ? null : trailers.get(PUSHBACK);
      return new GrpcOutcome(Evidence.EVIDENCE_RESPONSE_RECEIVED, FailureKind.FAILURE_KIND_UNSPECIFIED, code, pushback);
    }
    if (messageReceived) {
      return new GrpcOutcome(Evidence.EVIDENCE_PARTIAL_RESPONSE, FailureKind.FAILURE_KIND_INTERRUPTED_STREAM, code, null);
    }
    FailureKind failure =
        status.getCode() == Status.Code.DEADLINE_EXCEEDED
            ? FailureKind.FAILURE_KIND_RESPONSE_HEADER_TIMEOUT
            : FailureKind.FAILURE_KIND_CONNECTION_RESET;
    return new GrpcOutcome(Evidence.EVIDENCE_SENT_NO_RESPONSE, failure, code, null);
  }

  @Override
  public String toString() {
    return evidence.name() + "/" + failure.name() + "/grpc " + grpcStatusCode + (pushback == null ? "" : "/pushback " + pushback);
  }
}
