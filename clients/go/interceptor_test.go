package retryd

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// upstreamServer is a grpc-go server of the test's own (the standard health
// service) whose Check answers as respond says, given the 1-based call
// number.
type upstreamServer struct {
	healthpb.UnimplementedHealthServer
	calls   atomic.Int64
	respond func(ctx context.Context, n int64) error
}

func (s *upstreamServer) Check(ctx context.Context, _ *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if err := s.respond(ctx, s.calls.Add(1)); err != nil {
		return nil, err
	}
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func startUpstream(t *testing.T, respond func(ctx context.Context, n int64) error) (*upstreamServer, string) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	upstream := &upstreamServer{respond: respond}
	server := grpc.NewServer()
	healthpb.RegisterHealthServer(server, upstream)
	go func() { _ = server.Serve(l) }()
	t.Cleanup(server.Stop)
	return upstream, l.Addr().String()
}

// dialUpstream connects to addr through the interceptor, with grpc-go's own
// retries off, as the README says.
func dialUpstream(t *testing.T, addr string, client *Client, opts InterceptorOptions) healthpb.HealthClient {
	t.Helper()
	if opts.Upstream == "" {
		opts.Upstream = "go-grpc"
	}
	opts.DisableReporting = true
	conn, err := grpc.Dial(addr, grpc.WithInsecure(), grpc.WithDisableRetry(),
		grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(opts)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return healthpb.NewHealthClient(conn)
}

func check(ctx context.Context, c healthpb.HealthClient) error {
	_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

func TestGRPCRefusedPortIsNotSentAndRetried(t *testing.T) {
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	upstream := dialUpstream(t, closedAddr(t), client, InterceptorOptions{})
	// A payment: retried all the same, because it provably never left.
	err := check(context.Background(), upstream)
	var e *Error
	if !errors.As(err, &e) || e.Attempts != 3 || status.Code(err) != codes.Unavailable {
		t.Fatalf("%v", err)
	}
	for _, d := range e.Decisions[:2] {
		if !d.ShouldRetry() || d.EffectiveEvidence != pb.Evidence_EVIDENCE_NOT_SENT || d.EvidenceAdjusted {
			t.Fatalf("decision %+v", d)
		}
	}
}

func TestGRPCNeverAnsweringServer(t *testing.T) {
	// The handler ignores its context (a handler that returned on it would
	// race the client's own deadline with an UNKNOWN status of its own).
	never := make(chan struct{})
	server, addr := startUpstream(t, func(ctx context.Context, n int64) error {
		<-never
		return nil
	})
	t.Cleanup(func() { close(never) }) // runs before the server's Stop
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	upstream := dialUpstream(t, addr, client, InterceptorOptions{AttemptTimeout: 150 * time.Millisecond})

	// Safe: SENT_NO_RESPONSE is retried, up to the attempt limit.
	err := check(safe(context.Background()), upstream)
	var e *Error
	if !errors.As(err, &e) || e.Attempts != 3 || status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("%v", err)
	}
	if d := e.Decisions[0]; d.EffectiveEvidence != pb.Evidence_EVIDENCE_SENT_NO_RESPONSE || !d.ShouldRetry() {
		t.Fatalf("%+v", d)
	}
	// A payment: AMBIGUOUS, sent once.
	before := server.calls.Load()
	err = check(context.Background(), upstream)
	var ambiguous *AmbiguousError
	if !errors.As(err, &ambiguous) || ambiguous.Attempts != 1 || server.calls.Load()-before != 1 {
		t.Fatalf("%v, %d calls", err, server.calls.Load()-before)
	}
	// The caller's own deadline, shorter than the hang: one attempt, at the deadline.
	before = server.calls.Load()
	noAttemptTimeout := dialUpstream(t, addr, client, InterceptorOptions{})
	start := time.Now() // before the deadline is made, so the lower bound holds
	ctx, cancel := context.WithTimeout(safe(context.Background()), 200*time.Millisecond)
	defer cancel()
	err = check(ctx, noAttemptTimeout)
	// The caller's deadline ended it, no sooner than it (no ceiling on wall
	// time: the code says why it returned).
	if status.Code(err) != codes.DeadlineExceeded || server.calls.Load()-before != 1 || time.Since(start) < 200*time.Millisecond {
		t.Fatalf("%v after %v, %d calls", err, time.Since(start), server.calls.Load()-before)
	}
}

func TestGRPCUnavailable(t *testing.T) {
	server, addr := startUpstream(t, func(ctx context.Context, n int64) error {
		if n == 1 || n == 3 {
			return status.Error(codes.Unavailable, "draining")
		}
		return nil
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	upstream := dialUpstream(t, addr, client, InterceptorOptions{})
	if err := check(safe(context.Background()), upstream); err != nil || server.calls.Load() != 2 {
		t.Fatalf("%v after %d calls", err, server.calls.Load())
	}
	// A payment that got UNAVAILABLE after the server read it: AMBIGUOUS, sent once.
	err := check(context.Background(), upstream)
	var ambiguous *AmbiguousError
	if !errors.As(err, &ambiguous) || server.calls.Load() != 3 || status.Code(err) != codes.Unavailable {
		t.Fatalf("%v after %d calls", err, server.calls.Load())
	}
	if ambiguous.Decision.EffectiveEvidence != pb.Evidence_EVIDENCE_RESPONSE_RECEIVED || ambiguous.Decision.Fallback {
		t.Fatalf("%+v", ambiguous.Decision)
	}
}

func TestGRPCPushback(t *testing.T) {
	pushback := "300"
	server, addr := startUpstream(t, func(ctx context.Context, n int64) error {
		if n == 1 {
			_ = grpc.SetTrailer(ctx, metadata.Pairs(PushbackTrailer, pushback))
			return status.Error(codes.ResourceExhausted, "slow down")
		}
		return nil
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	clock := withFakeClock(client)
	// An upstream of its own: the negative pushback below stops the
	// upstream's retries fleet-wide for a while (pushback_stop_window).
	upstream := dialUpstream(t, addr, client, InterceptorOptions{Upstream: "go-grpc-pushback"})
	if err := check(safe(context.Background()), upstream); err != nil || server.calls.Load() != 2 {
		t.Fatalf("%v after %d calls", err, server.calls.Load())
	}
	// The retry waited at least the pushback, on the client's clock.
	if waits := clock.asked(); len(waits) != 1 || waits[0] < 300*time.Millisecond {
		t.Fatalf("waited %v with a 300ms pushback", waits)
	}

	// A negative pushback: the server asks not to retry.
	pushback = "-1"
	server.calls.Store(0)
	err := check(safe(context.Background()), upstream)
	var e *Error
	if !errors.As(err, &e) || server.calls.Load() != 1 || e.Decisions[0].DenyReason != pb.DenyReason_DENY_REASON_SERVER_PUSHBACK {
		t.Fatalf("%v after %d calls", err, server.calls.Load())
	}
}

func TestGRPCUnauthenticatedRefreshesOnce(t *testing.T) {
	server, addr := startUpstream(t, func(ctx context.Context, n int64) error {
		md, _ := metadata.FromIncomingContext(ctx)
		if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer fresh" {
			return status.Error(codes.Unauthenticated, "stale token")
		}
		return nil
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	refreshed := 0
	upstream := dialUpstream(t, addr, client, InterceptorOptions{RefreshCredentials: func(ctx context.Context) (context.Context, error) {
		refreshed++
		md, _ := metadata.FromOutgoingContext(ctx)
		md = md.Copy()
		md.Set("authorization", "Bearer fresh")
		return metadata.NewOutgoingContext(ctx, md), nil
	}})
	ctx := metadata.AppendToOutgoingContext(safe(context.Background()), "authorization", "Bearer stale")
	if err := check(ctx, upstream); err != nil || refreshed != 1 || server.calls.Load() != 2 {
		t.Fatalf("%v: refreshed %d, %d calls", err, refreshed, server.calls.Load())
	}
}

func TestGRPCLocalRuleWhenRetrydIsDown(t *testing.T) {
	server, addr := startUpstream(t, func(ctx context.Context, n int64) error {
		if n == 1 {
			return status.Error(codes.Unavailable, "draining")
		}
		return nil
	})
	client := newClient(t, closedAddr(t), Options{})
	upstream := dialUpstream(t, addr, client, InterceptorOptions{})
	if err := check(safe(context.Background()), upstream); err != nil || server.calls.Load() != 2 {
		t.Fatalf("%v after %d calls", err, server.calls.Load())
	}
}

// A caller's own APIv2 messages through the interceptor, on a connection
// with no codec of its own: grpc-go v1.33's default codec (through
// golang/protobuf v1.3) panics on them, the interceptor's does not. The
// health calls above are the APIv1 side.
func TestGRPCCallersOwnAPIv2MessagesNeedNoCodec(t *testing.T) {
	fake := &fakeDecider{}
	addr := startFake(t, fake)
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	conn, err := grpc.Dial(addr, grpc.WithInsecure(), grpc.WithDisableRetry(),
		grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(InterceptorOptions{Upstream: "go-grpc", DisableReporting: true})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	response, err := pb.NewRetryDeciderClient(conn).Decide(safe(context.Background()), &pb.DecideRequest{Upstream: "mine", Attempt: 7})
	if err != nil || response.GetDecisionId() != "fake" {
		t.Fatalf("%v, %v", response, err)
	}
	if _, req := fake.last(); req.(*pb.DecideRequest).GetAttempt() != 7 {
		t.Fatalf("the server got %v", req)
	}
}
