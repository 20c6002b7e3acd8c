package retryd

import (
	"context"
	"errors"
	"io"
	"sync"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// StreamClientInterceptor returns a grpc-go interceptor for the streaming
// calls of a connection (grpc.WithStreamInterceptor), the companion of
// [Client.UnaryClientInterceptor]. Every attempt of a stream carries the
// lineage of the request being served (docs/lineage.md) in its baggage,
// `retryd.lineage=<inbound>/<layer>:<attempt>`, the other members kept.
//
// When a stream ends in failure (it could not be opened, or RecvMsg
// returned an error other than io.EOF) the interceptor asks retryd, with
// the call's `lineage` and, from a failed status's trailers, `retried_below`
// (retryd-retried) and the pushback, as the unary interceptor does. Then:
//
//   - a stream that could not be opened is opened again as retryd decides
//     (nothing of the application's was sent on it yet);
//   - a server-streaming call (one request message, which the interceptor
//     keeps, then CloseSend) that fails before its first response message is
//     opened again and its request sent again, as retryd decides, on the
//     ClientStream the caller already holds;
//   - a client- or bidi-streaming call that fails once open is not retried:
//     its messages were the application's to send, and are gone
//     (BODY_KIND_PUBLISHER: DENY BODY_NOT_REPLAYABLE); nor a stream that
//     already delivered a response message (first_byte_delivered).
//
// The failure then comes out of RecvMsg (or of the open) as an *Error or
// *AmbiguousError with the decisions, status.Code working on it, and the
// request being served is marked as retried below (see [RetriedInside]).
// Idempotency is declared as for unary calls (WithCall, WithIdempotency).
// InterceptorOptions.AttemptTimeout does not apply to streams: a stream
// lives as long as its context.
func (c *Client) StreamClientInterceptor(opts InterceptorOptions) grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, callOpts ...grpc.CallOption) (grpc.ClientStream, error) {
		call := callOf(ctx)
		s := &retryingStream{
			c: c, opts: opts, ctx: ctx, desc: desc, cc: cc, method: method, streamer: streamer, callOpts: callOpts,
			call: call, idempotency: call.Idempotency, upstream: call.Upstream, operation: call.Operation,
			lineage: InboundLineage(ctx), attemptCtx: ctx,
			// One request message, kept: a server-streaming call can be sent again.
			replayable: desc.ServerStreams && !desc.ClientStreams,
		}
		if s.idempotency == pb.Idempotency_IDEMPOTENCY_UNSPECIFIED {
			s.idempotency = pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT
		}
		if s.upstream == "" {
			s.upstream = opts.Upstream
		}
		if s.upstream == "" {
			s.upstream = cc.Target()
		}
		if s.operation == "" {
			s.operation = truncate(method, 256)
		}
		if !opts.DisableReporting {
			c.Reporter().Record(s.upstream, 1)
		}
		// Opening fails only before anything of the application's was sent:
		// opened again as retryd decides.
		for {
			p := new(peer.Peer)
			cs, err := s.open(p)
			if err == nil {
				s.cur = cs
				return s, nil
			}
			// grpc-go ran the call options' after() before returning: p is set.
			evidence, failure := pb.Evidence_EVIDENCE_NOT_SENT, pb.FailureKind_FAILURE_KIND_CONNECT
			if p.Addr != nil {
				evidence, failure = pb.Evidence_EVIDENCE_SENT_NO_RESPONSE, pb.FailureKind_FAILURE_KIND_CONNECTION_RESET
			}
			req := s.decideRequest(err, &pb.Body{Kind: pb.BodyKind_BODY_KIND_NONE})
			req.Evidence, req.Failure = evidence, failure
			if final := s.decide(err, req); final != nil {
				return nil, final
			}
		}
	}
}

// retryingStream is the ClientStream the caller holds; cur is the current
// attempt's. grpc-go lets one goroutine send while another receives: cur
// changes only inside RecvMsg, and only for a server-streaming call, whose
// sending (one message, CloseSend) is over by then.
type retryingStream struct {
	c           *Client
	opts        InterceptorOptions
	ctx         context.Context // the caller's
	attemptCtx  context.Context // the caller's, or what RefreshCredentials made of it
	desc        *grpc.StreamDesc
	cc          *grpc.ClientConn
	method      string
	streamer    grpc.Streamer
	callOpts    []grpc.CallOption
	call        Call
	idempotency pb.Idempotency
	upstream    string
	operation   string
	lineage     string
	replayable  bool

	mu              sync.Mutex
	cur             grpc.ClientStream
	attempt         int
	sent            []interface{}
	closedSend      bool
	received        bool
	decided         bool
	decisions       []Decision
	previousBackoff time.Duration
	authRefreshed   bool
	failed          error
}

// open starts attempt s.attempt+1 with its own lineage entry.
func (s *retryingStream) open(p *peer.Peer) (grpc.ClientStream, error) {
	s.attempt++
	sendCtx := withOutgoingLineage(s.attemptCtx, outboundLineage(s.lineage, s.c.Layer(), s.attempt))
	options := append(append([]grpc.CallOption(nil), s.callOpts...), grpc.Peer(p))
	return s.streamer(sendCtx, s.desc, s.cc, s.method, options...)
}

func (s *retryingStream) decideRequest(err error, body *pb.Body) *pb.DecideRequest {
	st := status.Convert(err)
	req := &pb.DecideRequest{
		Upstream:             s.upstream,
		Operation:            s.operation,
		Idempotency:          s.idempotency,
		Body:                 body,
		Attempt:              uint32(s.attempt),
		GrpcStatusCode:       uint32(st.Code()),
		AuthRefreshAttempted: s.authRefreshed,
		MaxAttempts:          s.call.MaxAttempts,
		Lineage:              s.lineage,
	}
	if st.Code() > 16 {
		req.GrpcStatusCode = uint32(codes.Unknown)
	}
	return req
}

// decide asks about a failed attempt and waits its backoff; nil means
// "make the next attempt", anything else is the call's final error (and
// the request being served is then marked, if a decision was made).
func (s *retryingStream) decide(err error, req *pb.DecideRequest) (final error) {
	defer func() {
		if final != nil && s.decided {
			markRetried(s.ctx)
		}
	}()
	if s.ctx.Err() != nil {
		if decision, ok := endedByCaller(s.ctx, req); ok {
			s.decisions = append(s.decisions, decision)
			return &AmbiguousError{Decision: decision, Decisions: s.decisions, Attempts: s.attempt, Err: err}
		}
		return callFailed(err, s.attempt, s.decisions, 0, nil)
	}
	setTiming(s.ctx, req, s.previousBackoff)
	decision, decideErr := s.c.Decide(s.ctx, req)
	if decideErr != nil {
		return callFailed(decideErr, s.attempt, s.decisions, 0, nil)
	}
	s.decided = true
	s.decisions = append(s.decisions, decision)
	if decision.OutcomeUnknown() || (decision.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE && s.attempt >= maxLoop) {
		return &AmbiguousError{Decision: decision, Decisions: s.decisions, Attempts: s.attempt, Err: err}
	}
	if !decision.ShouldRetry() || s.attempt >= maxLoop {
		return callFailed(err, s.attempt, s.decisions, 0, nil)
	}
	if decision.RefreshCredentials {
		if s.opts.RefreshCredentials == nil {
			return callFailed(err, s.attempt, s.decisions, 0, nil)
		}
		refreshed, refreshErr := s.opts.RefreshCredentials(s.attemptCtx)
		if refreshErr != nil {
			return callFailed(refreshErr, s.attempt, s.decisions, 0, nil)
		}
		s.attemptCtx = refreshed
		s.authRefreshed = true
	}
	s.previousBackoff = decision.Backoff
	if err := s.c.waitBackoff(s.ctx, decision.Backoff); err != nil {
		return callFailed(status.FromContextError(err).Err(), s.attempt, s.decisions, 0, nil)
	}
	return nil
}

func (s *retryingStream) current() grpc.ClientStream {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

func (s *retryingStream) Header() (metadata.MD, error) { return s.current().Header() }
func (s *retryingStream) Trailer() metadata.MD         { return s.current().Trailer() }
func (s *retryingStream) Context() context.Context     { return s.current().Context() }

func (s *retryingStream) SendMsg(m interface{}) error {
	cs := s.current()
	if s.replayable {
		s.mu.Lock()
		s.sent = append(s.sent, m)
		s.mu.Unlock()
	}
	return cs.SendMsg(m)
}

func (s *retryingStream) CloseSend() error {
	cs := s.current()
	s.mu.Lock()
	s.closedSend = true
	s.mu.Unlock()
	return cs.CloseSend()
}

func (s *retryingStream) RecvMsg(m interface{}) error {
	for {
		cs := s.current()
		if s.failed != nil {
			return s.failed
		}
		err := cs.RecvMsg(m)
		if err == nil {
			s.received = true
			return nil
		}
		if errors.Is(err, io.EOF) {
			return err
		}
		if final := s.failedAttempt(cs, err); final != nil {
			s.failed = final
			return final
		}
	}
}

// failedAttempt decides about the current attempt's failure; nil means a
// new attempt is open and its request sent.
func (s *retryingStream) failedAttempt(cs grpc.ClientStream, err error) error {
	s.mu.Lock()
	// The request can be sent again: one message, the sending closed.
	resendable := s.replayable && s.closedSend && len(s.sent) == 1
	sent := append([]interface{}(nil), s.sent...)
	s.mu.Unlock()
	body := &pb.Body{Kind: pb.BodyKind_BODY_KIND_ENCODED_VALUE}
	if !resendable {
		body = &pb.Body{Kind: pb.BodyKind_BODY_KIND_PUBLISHER}
	}
	// A response message already delivered: first_byte_delivered (rule 4).
	replay := resendable && !s.received
	req := s.decideRequest(err, body)
	req.FirstByteDelivered = s.received
	// The stream's RecvMsg failed: the stream is over, so Header no longer
	// waits. Without an error, the server's HEADERS arrived: its status.
	if _, headerErr := cs.Header(); headerErr == nil {
		req.Evidence = pb.Evidence_EVIDENCE_RESPONSE_RECEIVED
		trailer := cs.Trailer()
		if values := trailer.Get(PushbackTrailer); len(values) > 0 {
			raw := truncate(values[0], 256)
			req.GrpcRetryPushbackMs = &raw
		}
		if values := trailer.Get(RetriedHeader); len(values) > 0 {
			req.RetriedBelow = retriedBelow(values[0])
		}
	} else {
		req.Evidence = pb.Evidence_EVIDENCE_SENT_NO_RESPONSE
		if status.Code(err) == codes.DeadlineExceeded {
			req.Failure = pb.FailureKind_FAILURE_KIND_RESPONSE_HEADER_TIMEOUT
		} else {
			req.Failure = pb.FailureKind_FAILURE_KIND_CONNECTION_RESET
		}
	}
	for {
		if final := s.decide(err, req); final != nil {
			return final
		}
		if !replay {
			// Not for retryd to allow (rules 3 and 4 deny it), but never
			// send what the application did not give again.
			markRetried(s.ctx)
			return callFailed(err, s.attempt, s.decisions, 0, nil)
		}
		p := new(peer.Peer)
		next, openErr := s.open(p)
		if openErr == nil {
			s.mu.Lock()
			s.cur = next
			s.mu.Unlock()
			if sendErr := next.SendMsg(sent[0]); sendErr != nil && !errors.Is(sendErr, io.EOF) {
				return sendErr
			}
			// io.EOF from SendMsg: the stream broke; RecvMsg says how.
			if closeErr := next.CloseSend(); closeErr != nil {
				return closeErr
			}
			return nil
		}
		err = openErr
		req = s.decideRequest(openErr, body)
		req.Evidence, req.Failure = pb.Evidence_EVIDENCE_NOT_SENT, pb.FailureKind_FAILURE_KIND_CONNECT
		if p.Addr != nil {
			req.Evidence, req.Failure = pb.Evidence_EVIDENCE_SENT_NO_RESPONSE, pb.FailureKind_FAILURE_KIND_CONNECTION_RESET
		}
	}
}
