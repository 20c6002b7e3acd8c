package retryd

import (
	"context"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// InterceptorOptions configures [Client.UnaryClientInterceptor]. The zero
// value is usable.
type InterceptorOptions struct {
	// Upstream names the budget and policy, unless the call declares its
	// own with WithCall; "" means the ClientConn's target.
	Upstream string
	// AttemptTimeout bounds each attempt (0: only the context does). An
	// attempt that runs out of it is SENT_NO_RESPONSE (DEADLINE_EXCEEDED),
	// retried if the call is safely idempotent, AMBIGUOUS otherwise.
	AttemptTimeout time.Duration
	// RefreshCredentials is called before replaying a call that retryd
	// answered with refresh_credentials (after UNAUTHENTICATED); it returns
	// the context for the replay (with fresh per-RPC metadata, say). Without
	// it such a call fails with its UNAUTHENTICATED status.
	RefreshCredentials func(ctx context.Context) (context.Context, error)
	// DisableReporting stops counting first attempts and outcomes on the
	// client's TrafficReporter.
	DisableReporting bool
}

// PushbackTrailer is the trailer of gRFC A6 through which a server asks a
// client to wait (or not to retry); it is passed to retryd raw.
const PushbackTrailer = "grpc-retry-pushback-ms"

// UnaryClientInterceptor returns a grpc-go interceptor that retries unary
// calls under retryd's decisions, like [Transport] does for HTTP:
//
//   - a call whose attempt never got a transport stream (a connection that
//     could not be established, with WaitForReady false) provably never left:
//     NOT_SENT, CONNECT;
//   - a status the server sent (its HEADERS arrived) is RESPONSE_RECEIVED,
//     with its code, and its grpc-retry-pushback-ms trailer passed raw;
//   - a status grpc-go made up after the request may have been written (a
//     deadline, a reset) is SENT_NO_RESPONSE with its code.
//
// Idempotency is declared with WithCall or WithIdempotency; undeclared, a
// call is NON_IDEMPOTENT. The request message is replayable (a value plus a
// deterministic codec). An AMBIGUOUS answer fails the call with an
// *AmbiguousError, a denial with an *Error wrapping the call's status;
// status.Code works on both. Backoffs are slept inside the context's
// deadline, which is passed to retryd with each decision. First attempts
// are counted on the client's TrafficReporter, and every attempt's outcome
// ([FailureCodes] fail, any other ending succeeds, CANCELLED or a cancelled
// context is neither).
//
// A unary call with a protobuf reply to an upstream whose hedging retryd
// serves is hedged as the [Transport] hedges (see interceptor_hedge.go): a
// copy after the served delay if retryd allows it, the first ending whose
// code is not in [FailureCodes] winning, the others cancelled.
//
// Switch off grpc-go's own retries on the connection (grpc.WithDisableRetry,
// and no retryPolicy in the service config): the interceptor would see only
// their last attempt, and retries would be made that retryd never allowed.
func (c *Client) UnaryClientInterceptor(opts InterceptorOptions) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply interface{}, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) (err error) {
		call := callOf(ctx)
		idempotency := call.Idempotency
		if idempotency == pb.Idempotency_IDEMPOTENCY_UNSPECIFIED {
			idempotency = pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT
		}
		upstream := call.Upstream
		if upstream == "" {
			upstream = opts.Upstream
		}
		if upstream == "" {
			upstream = cc.Target()
		}
		operation := call.Operation
		if operation == "" {
			operation = truncate(method, 256)
		}
		if !opts.DisableReporting {
			c.Reporter().Record(upstream, 1)
		}
		c.firstAttemptSent(upstream)
		lineage := InboundLineage(ctx)
		var decisions []Decision
		decided := false
		defer func() {
			// Failed after a decision: the layer above must not retry it
			// again (docs/lineage.md); the server interceptor says so.
			if err != nil && decided {
				markRetried(ctx)
			}
		}()
		var previousBackoff time.Duration
		authRefreshed := false
		attemptCtx := ctx
		send := func(sendCtx context.Context, attempt int, reply interface{}) grpcCopy {
			var out grpcCopy
			// The codec first, so that one the caller set (on the call or the
			// connection) wins; see protoCodec.
			options := append([]grpc.CallOption{grpc.ForceCodec(protoCodec{})}, callOpts...)
			options = append(options, grpc.Header(&out.header), grpc.Trailer(&out.trailer), grpc.Peer(&out.peer))
			sendCtx = withOutgoingLineage(sendCtx, outboundLineage(lineage, c.Layer(), attempt))
			out.err = invokeAttempt(sendCtx, opts.AttemptTimeout, method, req, reply, cc, invoker, options)
			return out
		}
		for attempt := 1; ; attempt++ {
			var sent grpcCopy
			if plan, ok := c.grpcHedgePlan(attempt, upstream, idempotency, reply); ok {
				first := c.hedgeFirstCall(ctx, plan, send, reply, hedgeCallOf(upstream, operation, idempotency, call.MaxAttempts, lineage), opts.DisableReporting)
				sent = first.grpcCopy
				decisions = append(decisions, first.decisions...)
				if first.sent > 1 {
					decided = true
				}
				attempt = first.sent
			} else {
				start := time.Now()
				sent = send(attemptCtx, attempt, reply)
				if code := status.Code(sent.err); !opts.DisableReporting && code != codes.Canceled {
					c.recordAttempt(ctx, upstream, attempt, !FailureCodes[code], time.Since(start))
				}
			}
			err, header, trailer, p := sent.err, sent.header, sent.trailer, sent.peer
			st := status.Convert(err)
			if err == nil {
				return nil
			}
			decideReq := &pb.DecideRequest{
				Upstream:             upstream,
				Operation:            operation,
				Idempotency:          idempotency,
				Body:                 &pb.Body{Kind: pb.BodyKind_BODY_KIND_ENCODED_VALUE},
				Attempt:              uint32(attempt),
				GrpcStatusCode:       uint32(st.Code()),
				AuthRefreshAttempted: authRefreshed,
				MaxAttempts:          call.MaxAttempts,
				Lineage:              lineage,
			}
			if st.Code() > 16 {
				decideReq.GrpcStatusCode = uint32(codes.Unknown)
			}
			switch {
			case p.Addr == nil:
				// No transport stream was ever created for the attempt: the
				// request never left this process.
				decideReq.Evidence = pb.Evidence_EVIDENCE_NOT_SENT
				decideReq.Failure = pb.FailureKind_FAILURE_KIND_CONNECT
			case header != nil:
				// The server's HEADERS arrived: the status is the server's.
				decideReq.Evidence = pb.Evidence_EVIDENCE_RESPONSE_RECEIVED
				if values := trailer.Get(PushbackTrailer); len(values) > 0 {
					raw := truncate(values[0], 256)
					decideReq.GrpcRetryPushbackMs = &raw
				}
				if values := trailer.Get(RetriedHeader); len(values) > 0 {
					decideReq.RetriedBelow = retriedBelow(values[0])
				}
			default:
				decideReq.Evidence = pb.Evidence_EVIDENCE_SENT_NO_RESPONSE
				if st.Code() == codes.DeadlineExceeded {
					decideReq.Failure = pb.FailureKind_FAILURE_KIND_RESPONSE_HEADER_TIMEOUT
				} else {
					decideReq.Failure = pb.FailureKind_FAILURE_KIND_CONNECTION_RESET
				}
			}
			if ctx.Err() != nil {
				// The caller's deadline or cancellation ended the call; one
				// that may have been sent and is not idempotent is of
				// unknown outcome.
				if decision, ok := endedByCaller(ctx, decideReq); ok {
					decisions = append(decisions, decision)
					return &AmbiguousError{Decision: decision, Decisions: decisions, Attempts: attempt, Err: err}
				}
				return callFailed(err, attempt, decisions, 0, nil)
			}
			setTiming(ctx, decideReq, previousBackoff)
			decision, decideErr := c.Decide(ctx, decideReq)
			if decideErr != nil {
				return callFailed(decideErr, attempt, decisions, 0, nil)
			}
			decided = true
			decisions = append(decisions, decision)
			if decision.OutcomeUnknown() || (decision.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE && attempt >= maxLoop) {
				return &AmbiguousError{Decision: decision, Decisions: decisions, Attempts: attempt, Err: err}
			}
			if !decision.ShouldRetry() || attempt >= maxLoop {
				return callFailed(err, attempt, decisions, 0, nil)
			}
			if decision.RefreshCredentials {
				if opts.RefreshCredentials == nil {
					return callFailed(err, attempt, decisions, 0, nil)
				}
				refreshed, refreshErr := opts.RefreshCredentials(attemptCtx)
				if refreshErr != nil {
					return callFailed(refreshErr, attempt, decisions, 0, nil)
				}
				attemptCtx = refreshed
				authRefreshed = true
			}
			previousBackoff = decision.Backoff
			if err := c.waitBackoff(ctx, decision.Backoff); err != nil {
				return callFailed(status.FromContextError(err).Err(), attempt, decisions, 0, nil)
			}
		}
	}
}

func invokeAttempt(ctx context.Context, timeout time.Duration, method string, req, reply interface{}, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, options []grpc.CallOption) error {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	return invoker(ctx, method, req, reply, cc, options...)
}

// withOutgoingLineage is ctx with the outgoing baggage's retryd.lineage
// member set to lineage, the other members and metadata kept.
func withOutgoingLineage(ctx context.Context, lineage string) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	md = md.Copy()
	md.Set("baggage", withLineageMember(md.Get("baggage"), lineage))
	return metadata.NewOutgoingContext(ctx, md)
}
