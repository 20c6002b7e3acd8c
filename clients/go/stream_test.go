package retryd

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// watchServer is a grpc-go health server whose Watch (server-streaming)
// answers as respond says, given the 1-based call number: an error before
// any message, or (sendFirst) one message and then the error, or nil for a
// message and the end. It records each call's baggage.
type watchServer struct {
	healthpb.UnimplementedHealthServer
	calls     atomic.Int64
	sendFirst bool
	respond   func(stream healthpb.Health_WatchServer, n int64) error
	mu        sync.Mutex
	baggage   []string
}

func (s *watchServer) Watch(_ *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	md, _ := metadata.FromIncomingContext(stream.Context())
	s.mu.Lock()
	s.baggage = append(s.baggage, strings.Join(md.Get("baggage"), ","))
	s.mu.Unlock()
	err := s.respond(stream, s.calls.Add(1))
	if err == nil || s.sendFirst {
		if sendErr := stream.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}); sendErr != nil {
			return sendErr
		}
	}
	return err
}

func (s *watchServer) seen() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.baggage...)
}

func serveHealth(t *testing.T, server *grpc.Server, impl healthpb.HealthServer) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	healthpb.RegisterHealthServer(server, impl)
	go func() { _ = server.Serve(l) }()
	t.Cleanup(server.Stop)
	return l.Addr().String()
}

func startWatch(t *testing.T, w *watchServer) string {
	return serveHealth(t, grpc.NewServer(), w)
}

// dialStreaming connects to addr through both client interceptors.
func dialStreaming(t *testing.T, addr string, client *Client, upstream string) *grpc.ClientConn {
	t.Helper()
	opts := InterceptorOptions{Upstream: upstream, DisableReporting: true}
	conn, err := grpc.Dial(addr, grpc.WithInsecure(), grpc.WithDisableRetry(),
		grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(opts)),
		grpc.WithStreamInterceptor(client.StreamClientInterceptor(opts)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// watchOnce opens a Watch and receives its first message.
func watchOnce(ctx context.Context, conn *grpc.ClientConn) error {
	stream, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return err
	}
	if _, err := stream.Recv(); err != nil {
		return err
	}
	_, err = stream.Recv() // the server's end of the stream
	return err
}

func unavailable(_ healthpb.Health_WatchServer, _ int64) error {
	return status.Error(codes.Unavailable, "back end down")
}

func TestStreamRetriesBeforeTheFirstMessageWithTheLineageOfEachAttempt(t *testing.T) {
	w := &watchServer{respond: func(_ healthpb.Health_WatchServer, n int64) error {
		if n <= 2 {
			return status.Error(codes.Unavailable, "warming up")
		}
		return nil
	}}
	client := newClient(t, shared(t).grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(client)
	conn := dialStreaming(t, startWatch(t, w), client, "go-stream")
	ctx := metadata.AppendToOutgoingContext(WithInboundLineage(safe(context.Background()), "edge:1"), "baggage", "tenant=a")
	stream, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	reply, err := stream.Recv()
	if err != nil || reply.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("%v %v", reply, err)
	}
	if _, err := stream.Recv(); err == nil || err.Error() != "EOF" {
		t.Fatalf("want the end of the stream, got %v", err)
	}
	wantGRPCBaggage(t, w.seen(), "edge:1/middle:1", "edge:1/middle:2", "edge:1/middle:3")
	if RetriedInside(ctx) {
		t.Fatal("a stream that succeeded on a retry marked the request as failed after a decision")
	}
}

func TestStreamOpenFailureIsNotSentAndRetried(t *testing.T) {
	client := newClient(t, shared(t).grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(client)
	conn := dialStreaming(t, closedAddr(t), client, "go-stream")
	// A non-idempotent call: retried all the same, since nothing left.
	err := watchOnce(context.Background(), conn)
	var e *Error
	if !errors.As(err, &e) || e.Attempts != 3 || status.Code(err) != codes.Unavailable {
		t.Fatalf("%v", err)
	}
	for _, d := range e.Decisions[:2] {
		if !d.ShouldRetry() || d.EffectiveEvidence != pb.Evidence_EVIDENCE_NOT_SENT {
			t.Fatalf("%+v", d)
		}
	}
	if d := e.Decisions[2]; d.DenyReason != pb.DenyReason_DENY_REASON_MAX_ATTEMPTS {
		t.Fatalf("%+v", d)
	}
}

func TestStreamInsideAnEnclosingRetryIsNotRetriedAndTheDecideSaysWhy(t *testing.T) {
	retryd := chainRetryd(t)
	w := &watchServer{respond: unavailable}
	client := newClient(t, retryd.grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(client)
	conn := dialStreaming(t, startWatch(t, w), client, "go-stream")
	ctx := metadata.AppendToOutgoingContext(WithInboundLineage(safe(context.Background()), "edge:2"), "baggage", "tenant=a")
	err := watchOnce(ctx, conn)
	var e *Error
	if !errors.As(err, &e) || e.Attempts != 1 || status.Code(err) != codes.Unavailable {
		t.Fatalf("%v", err)
	}
	d := e.Decisions[0]
	if d.DenyReason != pb.DenyReason_DENY_REASON_INSIDE_ENCLOSING_RETRY || d.Fallback || !strings.Contains(d.Explanation, "inside attempt 2 of layer edge") {
		t.Fatalf("%+v", d)
	}
	wantGRPCBaggage(t, w.seen(), "edge:2/middle:1")
	if !RetriedInside(ctx) {
		t.Fatal("a denied stream did not mark the request being served")
	}
}

func TestStreamReportsRetriedBelowFromItsTrailer(t *testing.T) {
	retryd := chainRetryd(t)
	w := &watchServer{respond: func(stream healthpb.Health_WatchServer, _ int64) error {
		stream.SetTrailer(metadata.Pairs(RetriedHeader, "back"))
		return status.Error(codes.Unavailable, "retried below")
	}}
	client := newClient(t, retryd.grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(client)
	conn := dialStreaming(t, startWatch(t, w), client, "go-stream")
	err := watchOnce(safe(context.Background()), conn)
	var e *Error
	if !errors.As(err, &e) || e.Attempts != 1 {
		t.Fatalf("%v", err)
	}
	if d := e.Decisions[0]; d.DenyReason != pb.DenyReason_DENY_REASON_RETRIED_BELOW || !strings.Contains(d.Explanation, "retried by layer back") {
		t.Fatalf("%+v", d)
	}
	if got := w.seen(); len(got) != 1 || got[0] != "retryd.lineage=middle:1" {
		t.Fatalf("%q", got)
	}
}

func TestStreamIsNotRetriedAfterAMessageNorWhenTheApplicationStreams(t *testing.T) {
	client := newClient(t, shared(t).grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(client)

	// One message delivered, then UNAVAILABLE: rule 4.
	after := &watchServer{respond: unavailable, sendFirst: true}
	conn := dialStreaming(t, startWatch(t, after), client, "go-stream")
	err := watchOnce(safe(context.Background()), conn)
	var e *Error
	if !errors.As(err, &e) || e.Attempts != 1 || e.Decisions[0].DenyReason != pb.DenyReason_DENY_REASON_RESPONSE_ALREADY_DELIVERED {
		t.Fatalf("%v", err)
	}

	// The same method opened as a bidi stream: the messages were the
	// application's to send, so one-shot (rule 3).
	w := &watchServer{respond: unavailable}
	conn = dialStreaming(t, startWatch(t, w), client, "go-stream")
	stream, err := conn.NewStream(safe(context.Background()), &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, "/grpc.health.v1.Health/Watch")
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.SendMsg(&healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	err = stream.RecvMsg(new(healthpb.HealthCheckResponse))
	if !errors.As(err, &e) || e.Attempts != 1 || e.Decisions[0].DenyReason != pb.DenyReason_DENY_REASON_BODY_NOT_REPLAYABLE || status.Code(err) != codes.Unavailable {
		t.Fatalf("%v", err)
	}
	// A later RecvMsg says the same.
	if again := stream.RecvMsg(new(healthpb.HealthCheckResponse)); again != err {
		t.Fatalf("%v", again)
	}
	if len(w.seen()) != 1 {
		t.Fatalf("%q", w.seen())
	}
}

// streamMiddle is the middle of a streaming chain: behind the lineage
// server interceptors, its Watch opens a Watch on the back end through the
// stream client interceptor, and fails with UNAVAILABLE when that fails.
type streamMiddle struct {
	healthpb.UnimplementedHealthServer
	backend healthpb.HealthClient
	served  atomic.Int64
}

func (m *streamMiddle) Watch(_ *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	m.served.Add(1)
	below, err := m.backend.Watch(safe(stream.Context()), &healthpb.HealthCheckRequest{})
	if err == nil {
		var reply *healthpb.HealthCheckResponse
		if reply, err = below.Recv(); err == nil {
			return stream.Send(reply)
		}
	}
	return status.Error(codes.Unavailable, "back end failed")
}

func TestStreamingChainOneLayerRetries(t *testing.T) {
	retryd := chainRetryd(t)
	back := &watchServer{respond: unavailable}
	backAddr := startWatch(t, back)
	middleClient := newClient(t, retryd.grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(middleClient)
	middle := &streamMiddle{backend: healthpb.NewHealthClient(dialStreaming(t, backAddr, middleClient, "go-stream-back"))}
	middleAddr := serveHealth(t, grpc.NewServer(grpc.UnaryInterceptor(middleClient.LineageUnaryServerInterceptor()),
		grpc.StreamInterceptor(middleClient.LineageStreamServerInterceptor())), middle)

	// A plain client as the edge's first attempt: the middle retries, each
	// attempt below carries the inbound lineage, and the failure is marked.
	plain := plainHealth(t, middleAddr)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "baggage", "retryd.lineage=edge:1")
	stream, err := plain.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("%v", err)
	}
	wantRetriedTrailer(t, stream.Trailer())
	if got := back.seen(); len(got) != 3 || got[0] != "retryd.lineage=edge:1/middle:1" || got[2] != "retryd.lineage=edge:1/middle:3" {
		t.Fatalf("%q", got)
	}

	// The edge through the stream interceptor: RETRIED_BELOW, one attempt.
	edge := newClient(t, retryd.grpc, Options{Layer: "edge", NoFallback: true})
	withFakeClock(edge)
	err = watchOnce(safe(context.Background()), dialStreaming(t, middleAddr, edge, "go-stream-middle"))
	var e *Error
	if !errors.As(err, &e) || e.Attempts != 1 || middle.served.Load() != 2 {
		t.Fatalf("%v, the middle served %d", err, middle.served.Load())
	}
	if d := e.Decisions[0]; d.DenyReason != pb.DenyReason_DENY_REASON_RETRIED_BELOW || d.Fallback || !strings.Contains(d.Explanation, "retried by layer middle") {
		t.Fatalf("%+v", d)
	}
	if got := back.seen()[3:]; len(got) != 3 || got[0] != "retryd.lineage=edge:1/middle:1" {
		t.Fatalf("%q", got)
	}
}
