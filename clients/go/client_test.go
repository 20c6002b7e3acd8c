package retryd

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

func connectFailure(upstream string, idempotency pb.Idempotency) *pb.DecideRequest {
	return &pb.DecideRequest{
		Upstream: upstream, Operation: "GET /x", Idempotency: idempotency, Attempt: 1,
		Failure: pb.FailureKind_FAILURE_KIND_CONNECT,
	}
}

func TestDecideReturnsRetrydsDecision(t *testing.T) {
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	d, err := client.Decide(context.Background(), connectFailure("go-decide", pb.Idempotency_IDEMPOTENCY_SAFE))
	if err != nil {
		t.Fatal(err)
	}
	if !d.ShouldRetry() || d.Fallback || d.DecisionID == "" || d.Backoff > 50*time.Millisecond || d.EffectiveEvidence != pb.Evidence_EVIDENCE_NOT_SENT {
		t.Fatalf("%+v", d)
	}
}

func TestInvalidRequestNamesTheField(t *testing.T) {
	client := newClient(t, shared(t).grpc, Options{})
	_, err := client.Decide(context.Background(), connectFailure("", pb.Idempotency_IDEMPOTENCY_SAFE))
	var invalid *InvalidRequestError
	if !errors.As(err, &invalid) || invalid.Field != "upstream" || status.Code(err) != codes.InvalidArgument {
		t.Fatalf("%v", err)
	}
}

func TestInvalidRequestIsNotHiddenByTheFallback(t *testing.T) {
	client := newClient(t, closedAddr(t), Options{})
	_, err := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_UNSPECIFIED))
	var invalid *InvalidRequestError
	if !errors.As(err, &invalid) || invalid.Field != "idempotency" {
		t.Fatalf("%v", err)
	}
}

func TestFallbackWhenRetrydIsUnreachable(t *testing.T) {
	var logs logBuffer
	client := newClient(t, closedAddr(t), Options{Logger: logs.logger()})
	d, err := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT))
	if err != nil || !d.Fallback || !d.ShouldRetry() || d.Rule != 9 {
		t.Fatalf("%+v, %v", d, err)
	}
	if len(logs.matching("local rule")) != 1 {
		t.Fatalf("logs %q", logs.all())
	}
	req := connectFailure("x", pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT)
	req.Failure = pb.FailureKind_FAILURE_KIND_RESPONSE_HEADER_TIMEOUT
	if d, _ := client.Decide(context.Background(), req); !d.IsAmbiguous() || !d.Fallback {
		t.Fatalf("a payment without a response: %+v", d)
	}
}

func TestFallbackCanBeSwitchedOff(t *testing.T) {
	client := newClient(t, closedAddr(t), Options{NoFallback: true})
	_, err := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE))
	var unavailable *UnavailableError
	if !errors.As(err, &unavailable) || unavailable.Code != codes.Unavailable {
		t.Fatalf("%v", err)
	}
}

func TestFrozenRetrydFallsBackWithinTheTimeout(t *testing.T) {
	server := startRetryd(t, clientTestConfig, "")
	client := newClient(t, server.grpc, Options{Timeout: 300 * time.Millisecond})
	if _, err := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); err != nil {
		t.Fatal(err)
	}
	server.freeze()
	defer server.thaw()
	for _, name := range []string{"timeout", "caller deadline", "request deadline"} {
		// Timed from before the deadline is set: the answer may come no
		// sooner than the deadline, counted from when it was made (a loaded
		// machine can put milliseconds between making it and the call).
		start := time.Now()
		ctx, cancel := context.Background(), context.CancelFunc(func() {})
		req := connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)
		want := 300 * time.Millisecond
		switch name {
		case "caller deadline":
			ctx, cancel = context.WithTimeout(ctx, 100*time.Millisecond)
			want = 100 * time.Millisecond
		case "request deadline":
			req.DeadlineRemaining = durationpb.New(120 * time.Millisecond)
			want = 120 * time.Millisecond
		}
		d, err := client.Decide(ctx, req)
		elapsed := time.Since(start)
		cancel()
		if err != nil || !d.Fallback {
			t.Fatalf("%s: %+v, %v", name, d, err)
		}
		if elapsed < want || elapsed > want+2*time.Second {
			t.Fatalf("%s: answered after %v, want about %v", name, elapsed, want)
		}
	}
}

func TestReconnectsWithinTwoSecondsOfRetrydsReturn(t *testing.T) {
	addr := closedAddr(t)
	server := startRetryd(t, clientTestConfig, addr)
	client := newClient(t, server.grpc, Options{Timeout: time.Second})
	if d, err := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); err != nil || d.Fallback {
		t.Fatalf("%+v, %v", d, err)
	}
	server.stop()
	// Let grpc-go's reconnect backoff grow while retryd is away.
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if d, _ := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); !d.Fallback {
			t.Fatal("a decision from a stopped retryd")
		}
	}
	server.start(addr)
	back := time.Now()
	for {
		d, err := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE))
		if err == nil && !d.Fallback {
			break
		}
		// The client's promise, not a wait bound: grpc-go asks again at most
		// ReconnectBackoff.MaxDelay (2 s) after a failed connect, and the
		// connection itself gets a second on a loaded machine.
		if limit := ReconnectBackoff.MaxDelay + time.Second; time.Since(back) > limit {
			t.Fatalf("still falling back %v after retryd returned (the promise: %v)", time.Since(back), limit)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("reconnected %v after retryd returned", time.Since(back))
}

func TestDecideStreamFallsBackAndReopens(t *testing.T) {
	addr := closedAddr(t)
	server := startRetryd(t, clientTestConfig, addr)
	client := newClient(t, server.grpc, Options{Timeout: time.Second})
	stream := client.DecideStream(context.Background())
	defer stream.Close()
	if d, err := stream.Decide(connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); err != nil || d.Fallback {
		t.Fatalf("%+v, %v", d, err)
	}
	server.crash()
	if d, err := stream.Decide(connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); err != nil || !d.Fallback {
		t.Fatalf("%+v, %v", d, err)
	}
	server.start(addr)
	for start := time.Now(); ; time.Sleep(50 * time.Millisecond) {
		if d, err := stream.Decide(connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); err == nil && !d.Fallback {
			break
		}
		if time.Since(start) > hangGuard {
			t.Fatal("the stream was not reopened")
		}
	}
	if stream.opened < 2 {
		t.Fatalf("%d streams opened", stream.opened)
	}
}

// fakeDecider is a gRPC server of the test's own that records what a client
// sends: what a real retryd cannot show.
type fakeDecider struct {
	pb.UnimplementedRetryDeciderServer
	mu       sync.Mutex
	metadata []metadata.MD
	requests []proto.Message
	delay    time.Duration
	report   func(n int, req *pb.ReportTrafficRequest) (*pb.ReportTrafficResponse, error)
}

func (f *fakeDecider) record(ctx context.Context, req proto.Message) int {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.metadata = append(f.metadata, md)
	f.requests = append(f.requests, proto.Clone(req))
	return len(f.requests)
}

func (f *fakeDecider) Decide(ctx context.Context, req *pb.DecideRequest) (*pb.DecideResponse, error) {
	f.record(ctx, req)
	if f.delay > 0 {
		select {
		case <-time.After(f.delay):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return &pb.DecideResponse{Verdict: pb.Verdict_VERDICT_DENY, DenyReason: pb.DenyReason_DENY_REASON_MAX_ATTEMPTS, Rule: 1, DecisionId: "fake"}, nil
}

func (f *fakeDecider) ReportTraffic(ctx context.Context, req *pb.ReportTrafficRequest) (*pb.ReportTrafficResponse, error) {
	n := f.record(ctx, req)
	if f.report != nil {
		return f.report(n, req)
	}
	return &pb.ReportTrafficResponse{Accepted: uint32(len(req.GetTraffic()))}, nil
}

func (f *fakeDecider) last() (metadata.MD, proto.Message) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.requests) == 0 {
		return nil, nil
	}
	return f.metadata[len(f.metadata)-1], f.requests[len(f.requests)-1]
}

func (f *fakeDecider) reports() []*pb.ReportTrafficRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*pb.ReportTrafficRequest
	for _, r := range f.requests {
		if report, ok := r.(*pb.ReportTrafficRequest); ok {
			out = append(out, report)
		}
	}
	return out
}

func startFake(t *testing.T, fake *fakeDecider) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// The server decodes with the same codec as the client (Debian's
	// golang/protobuf 1.3 cannot decode these messages).
	server := grpc.NewServer(grpc.CustomCodec(serverCodec{}))
	pb.RegisterRetryDeciderServer(server, fake)
	go func() { _ = server.Serve(l) }()
	t.Cleanup(server.Stop)
	return l.Addr().String()
}

func TestMetadataAndTraceContextAreSentButNotTheCallersOwn(t *testing.T) {
	fake := &fakeDecider{}
	client := newClient(t, startFake(t, fake), Options{Metadata: metadata.Pairs("authorization", "Bearer retryd-token")})
	const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer upstream-token")
	ctx = WithTraceContext(ctx, traceparent, "vendor=1")
	if _, err := client.Decide(ctx, connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); err != nil {
		t.Fatal(err)
	}
	md, _ := fake.last()
	if got := md.Get("traceparent"); len(got) != 1 || got[0] != traceparent {
		t.Fatalf("traceparent %q", got)
	}
	if got := md.Get("tracestate"); len(got) != 1 || got[0] != "vendor=1" {
		t.Fatalf("tracestate %q", got)
	}
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer retryd-token" {
		t.Fatalf("authorization %q: the caller's upstream credentials leaked to retryd", got)
	}
}

func TestTransportPassesTheRequestsTraceparent(t *testing.T) {
	fake := &fakeDecider{}
	client := newClient(t, startFake(t, fake), Options{})
	server, _ := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) { w.WriteHeader(503) })
	const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	req, _ := http.NewRequestWithContext(safe(context.Background()), http.MethodGet, server.URL, nil)
	req.Header.Set("traceparent", traceparent)
	resp, err := testTransport(t, client).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	md, sent := fake.last()
	if got := md.Get("traceparent"); len(got) != 1 || got[0] != traceparent {
		t.Fatalf("traceparent %q", got)
	}
	decide := sent.(*pb.DecideRequest)
	if decide.GetHttpStatus() != 503 || decide.GetEvidence() != pb.Evidence_EVIDENCE_RESPONSE_RECEIVED || decide.GetOperation() != "GET /" {
		t.Fatalf("sent %v", decide)
	}
}

func TestRequestFieldsPassThroughUnchanged(t *testing.T) {
	fake := &fakeDecider{}
	client := newClient(t, startFake(t, fake), Options{})
	pushback := ""
	req := &pb.DecideRequest{
		Upstream: "x", Operation: "/pkg.Svc/M", Idempotency: pb.Idempotency_IDEMPOTENCY_SAFE, Attempt: 2,
		Evidence: pb.Evidence_EVIDENCE_RESPONSE_RECEIVED, GrpcStatusCode: 8, GrpcRetryPushbackMs: &pushback,
		DeadlineRemaining: durationpb.New(time.Second), PreviousBackoff: durationpb.New(time.Millisecond),
		Body: &pb.Body{Kind: pb.BodyKind_BODY_KIND_MULTIPART, Parts: []*pb.Body{{Kind: pb.BodyKind_BODY_KIND_BYTES}}},
	}
	if _, err := client.Decide(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	_, got := fake.last()
	if !proto.Equal(got, req) || got.(*pb.DecideRequest).GrpcRetryPushbackMs == nil {
		t.Fatalf("sent %v, received %v", req, got)
	}
}

func TestLocalRule(t *testing.T) {
	pushback := func(s string) *string { return &s }
	cases := []struct {
		name    string
		req     *pb.DecideRequest
		verdict pb.Verdict
		rule    uint32
		deny    pb.DenyReason
	}{
		{"connect, payment", connectFailure("x", pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT), pb.Verdict_VERDICT_RETRY, 9, 0},
		{"limit", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 2, Failure: pb.FailureKind_FAILURE_KIND_CONNECT}, pb.Verdict_VERDICT_DENY, 1, pb.DenyReason_DENY_REASON_MAX_ATTEMPTS},
		{"one-shot", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, Failure: 2, Body: &pb.Body{Kind: pb.BodyKind_BODY_KIND_INPUT_STREAM}}, pb.Verdict_VERDICT_DENY, 3, pb.DenyReason_DENY_REASON_BODY_NOT_REPLAYABLE},
		{"deadline", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, Failure: 2, DeadlineRemaining: durationpb.New(10 * time.Millisecond)}, pb.Verdict_VERDICT_DENY, 6, pb.DenyReason_DENY_REASON_DEADLINE},
		{"certificate", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, Failure: pb.FailureKind_FAILURE_KIND_TLS_CERTIFICATE_INVALID}, pb.Verdict_VERDICT_DENY, 7, pb.DenyReason_DENY_REASON_PERMANENT_FAILURE},
		{"generic io never NOT_SENT", &pb.DecideRequest{Upstream: "x", Idempotency: 4, Attempt: 1, Evidence: 1, Failure: pb.FailureKind_FAILURE_KIND_GENERIC_IO}, pb.Verdict_VERDICT_AMBIGUOUS, 8, 0},
		{"payment 503", &pb.DecideRequest{Upstream: "x", Idempotency: 4, Attempt: 1, HttpStatus: 503}, pb.Verdict_VERDICT_AMBIGUOUS, 9, 0},
		{"safe 500", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, HttpStatus: 500}, pb.Verdict_VERDICT_DENY, 9, pb.DenyReason_DENY_REASON_STATUS_NOT_RETRYABLE},
		{"safe 429", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, HttpStatus: 429}, pb.Verdict_VERDICT_RETRY, 9, 0},
		{"gRPC UNAVAILABLE payment", &pb.DecideRequest{Upstream: "x", Idempotency: 4, Attempt: 1, Evidence: 3, GrpcStatusCode: 14}, pb.Verdict_VERDICT_AMBIGUOUS, 9, 0},
		{"gRPC UNAVAILABLE safe", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, Evidence: 3, GrpcStatusCode: 14}, pb.Verdict_VERDICT_RETRY, 9, 0},
		{"gRPC RESOURCE_EXHAUSTED no pushback", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, Evidence: 3, GrpcStatusCode: 8}, pb.Verdict_VERDICT_DENY, 9, pb.DenyReason_DENY_REASON_STATUS_NOT_RETRYABLE},
		{"gRPC pushback -1", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, GrpcStatusCode: 8, GrpcRetryPushbackMs: pushback("-1")}, pb.Verdict_VERDICT_DENY, 9, pb.DenyReason_DENY_REASON_SERVER_PUSHBACK},
		{"gRPC pushback 300", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, GrpcStatusCode: 8, GrpcRetryPushbackMs: pushback("300")}, pb.Verdict_VERDICT_RETRY, 9, 0},
		{"gRPC UNAUTHENTICATED", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, Evidence: 3, GrpcStatusCode: 16}, pb.Verdict_VERDICT_RETRY, 9, 0},
		{"gRPC INTERNAL", &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, Evidence: 3, GrpcStatusCode: 13}, pb.Verdict_VERDICT_DENY, 9, pb.DenyReason_DENY_REASON_STATUS_NOT_RETRYABLE},
	}
	for _, c := range cases {
		d := LocalDecide(DefaultLocalPolicy, c.req, "test")
		if d.Verdict != c.verdict || d.Rule != c.rule || d.DenyReason != c.deny || !d.Fallback {
			t.Errorf("%s: %+v", c.name, d)
		}
	}
	d := LocalDecide(DefaultLocalPolicy, cases[len(cases)-3].req, "test")
	if d.Backoff < 300*time.Millisecond {
		t.Errorf("a backoff of %v below the 300ms pushback", d.Backoff)
	}
}

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	cases := map[string]time.Duration{
		"120":                             2 * time.Minute,
		"Tue, 01 Jan 2030 00:00:05 GMT":   5 * time.Second,
		"Tuesday, 01-Jan-30 00:00:05 GMT": 5 * time.Second,
		"Tue Jan  1 00:00:05 2030":        5 * time.Second,
		"Mon, 01 Jan 2029 00:00:00 GMT":   0,
	}
	for value, want := range cases {
		if got, ok := ParseRetryAfter(value, now); !ok || got != want {
			t.Errorf("%q: %v %v, want %v", value, got, ok, want)
		}
	}
	for _, value := range []string{"", "soon", "-1", "1.5"} {
		if _, ok := ParseRetryAfter(value, now); ok {
			t.Errorf("%q parsed", value)
		}
	}
	if !strings.Contains(LocalDecide(DefaultLocalPolicy, &pb.DecideRequest{Upstream: "x", Idempotency: 1, Attempt: 1, HttpStatus: 429, RetryAfter: "3600"}, "r").Explanation, "local maximum") {
		t.Error("a Retry-After above the local maximum was not denied")
	}
}

// serverCodec is protoCodec in the older interface grpc.CustomCodec takes.
type serverCodec struct{ protoCodec }

func (serverCodec) String() string { return "proto" }
