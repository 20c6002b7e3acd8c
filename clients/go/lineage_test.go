package retryd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
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

func TestNormalizeLineage(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"", ""},
		{"edge:2/middle:1", "edge:2/middle:1"},
		{"...:3/a.b_c-D9:1000", "...:3/a.b_c-D9:1000"},
		// Entries that are not layer:attempt are dropped, the rest kept.
		{"no-attempt/edge:0/x:1001/a b:1/:1/y:-1/z:01x/ok:3", "ok:3"},
		{strings.Repeat("l", 65) + ":2/ok:1", "ok:1"},
	} {
		if got := NormalizeLineage(c.in); got != c.want {
			t.Errorf("NormalizeLineage(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestShortenLineageKeepsTheInnermostAndAnEnclosingRetry(t *testing.T) {
	entries := func(n, firstAttempt int, layer func(i int) string) string {
		parts := make([]string, n)
		for i := range parts {
			attempt := 1
			if i == 0 {
				attempt = firstAttempt
			}
			parts[i] = fmt.Sprintf("%s:%d", layer(i), attempt)
		}
		return strings.Join(parts, "/")
	}
	short := func(i int) string { return fmt.Sprintf("l%d", i) }
	// Too many entries, all first attempts: the outermost are dropped.
	got := NormalizeLineage(entries(40, 1, short))
	if want := entries(40, 1, short)[len("l0:1/l1:1/l2:1/l3:1/l4:1/l5:1/l6:1/l7:1/"):]; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
	// A dropped retry stays visible as a first entry ...:<max>.
	got = NormalizeLineage(entries(40, 7, short))
	parts := strings.Split(got, "/")
	if len(parts) != MaxLineageEntries || parts[0] != "...:7" || parts[1] != "l9:1" || parts[31] != "l39:1" {
		t.Fatalf("got %q", got)
	}
	// Too many bytes: 64-byte layer names, 66 bytes an entry.
	long := func(i int) string { return fmt.Sprintf("%02d", i) + strings.Repeat("x", 62) }
	got = NormalizeLineage(entries(20, 1, long))
	parts = strings.Split(got, "/")
	if len(got) > MaxLineageBytes || len(parts) != 15 || !strings.HasPrefix(parts[0], "05") || !strings.HasPrefix(parts[14], "19") {
		t.Fatalf("%d bytes, %d entries: %q", len(got), len(parts), got)
	}
	got = NormalizeLineage(entries(20, 2, long))
	parts = strings.Split(got, "/")
	if len(got) > MaxLineageBytes || parts[0] != "...:2" || len(parts) != 16 || !strings.HasPrefix(parts[1], "05") {
		t.Fatalf("%d bytes, %d entries: %q", len(got), len(parts), got)
	}
	// Our own entry is always kept.
	if got := outboundLineage(entries(40, 3, short), "me", 2); !strings.HasSuffix(got, "/l39:1/me:2") || !strings.HasPrefix(got, "...:3/") ||
		len(strings.Split(got, "/")) != MaxLineageEntries {
		t.Fatalf("outbound %q", got)
	}
	if got := outboundLineage("", "edge", 1); got != "edge:1" {
		t.Fatalf("edge %q", got)
	}
	if got := outboundLineage("edge:2", "middle", 3); got != "edge:2/middle:3" {
		t.Fatalf("middle %q", got)
	}
}

func TestBaggageMember(t *testing.T) {
	if got := baggageLineage([]string{"a=1, retryd.lineage = edge:2/middle:1;prop=x", "b=2"}); got != "edge:2/middle:1" {
		t.Fatalf("read %q", got)
	}
	if got := baggageLineage([]string{"retryd.lineage=edge%3A2%2Fmiddle%3A1"}); got != "edge:2/middle:1" {
		t.Fatalf("percent-encoded %q", got)
	}
	if got := baggageLineage([]string{"a=1", "retryd.lineagex=edge:2"}); got != "" {
		t.Fatalf("none %q", got)
	}
	if got := withLineageMember([]string{"a=1, retryd.lineage=old:1;p", "b=2;q=3"}, "edge:1/x:2"); got != "a=1,b=2;q=3,retryd.lineage=edge:1/x:2" {
		t.Fatalf("written %q", got)
	}
	if got := withLineageMember(nil, "edge:1"); got != "retryd.lineage=edge:1" {
		t.Fatalf("alone %q", got)
	}
}

func TestLayerNames(t *testing.T) {
	for name, want := range map[string]bool{"edge": true, "a.b_c-9": true, "": false, "a b": false, "a/b": false, "a:b": false, strings.Repeat("x", 64): true, strings.Repeat("x", 65): false} {
		if ValidLayer(name) != want {
			t.Errorf("ValidLayer(%q) != %v", name, want)
		}
	}
	if got := sanitizeLayer("my prog:v2"); got != "my_prog_v2" {
		t.Fatalf("sanitized %q", got)
	}
	if got := sanitizeLayer("  "); got != "" {
		t.Fatalf("nothing left %q", got)
	}
	t.Setenv("OTEL_SERVICE_NAME", "checkout")
	if got := DefaultLayer(); got != "checkout" {
		t.Fatalf("from OTEL_SERVICE_NAME: %q", got)
	}
	t.Setenv("OTEL_SERVICE_NAME", "check out")
	if got, want := DefaultLayer(), sanitizeLayer(filepath.Base(os.Args[0])); got != want || !ValidLayer(got) {
		t.Fatalf("from the program name: %q, want %q", got, want)
	}
	client := newClient(t, closedAddr(t), Options{Layer: "middle", ConnectTimeout: -1})
	if client.Layer() != "middle" {
		t.Fatal(client.Layer())
	}
	if _, err := New(closedAddr(t), Options{Layer: "mid dle", ConnectTimeout: -1}); err == nil || !strings.Contains(err.Error(), "Options.Layer") {
		t.Fatalf("%v", err)
	}
}

func TestLocalRuleInACallChain(t *testing.T) {
	base := func(idempotency pb.Idempotency) *pb.DecideRequest {
		return &pb.DecideRequest{Upstream: "u", Idempotency: idempotency, Attempt: 1, HttpStatus: 503, Evidence: pb.Evidence_EVIDENCE_RESPONSE_RECEIVED}
	}
	req := base(pb.Idempotency_IDEMPOTENCY_SAFE)
	if d := LocalDecide(DefaultLocalPolicy, req, "test"); !d.ShouldRetry() {
		t.Fatalf("without a chain: %+v", d)
	}
	req.Lineage = "edge:1/middle:1"
	if d := LocalDecide(DefaultLocalPolicy, req, "test"); !d.ShouldRetry() {
		t.Fatalf("first attempts above: %+v", d)
	}
	req.Lineage = "edge:2/middle:1"
	d := LocalDecide(DefaultLocalPolicy, req, "test")
	if d.Verdict != pb.Verdict_VERDICT_DENY || d.DenyReason != pb.DenyReason_DENY_REASON_INSIDE_ENCLOSING_RETRY || d.Rule != 5 || !strings.Contains(d.Explanation, "edge") {
		t.Fatalf("inside a retry: %+v", d)
	}
	req.RetriedBelow = "backend"
	d = LocalDecide(DefaultLocalPolicy, req, "test")
	if d.DenyReason != pb.DenyReason_DENY_REASON_RETRIED_BELOW || d.Rule != 5 || !strings.Contains(d.Explanation, "backend") {
		t.Fatalf("retried below: %+v", d)
	}
	// The mark of an open outcome is kept by both denials.
	payment := base(pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT)
	payment.RetriedBelow = "backend"
	if d := LocalDecide(DefaultLocalPolicy, payment, "test"); d.DenyReason != pb.DenyReason_DENY_REASON_RETRIED_BELOW ||
		d.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_RECONCILE || !d.OutcomeUnknown() {
		t.Fatalf("payment: %+v", d)
	}
	// Rules 1, 3 and 4 come first, as at retryd.
	req.Attempt = 2
	if d := LocalDecide(DefaultLocalPolicy, req, "test"); d.DenyReason != pb.DenyReason_DENY_REASON_MAX_ATTEMPTS {
		t.Fatalf("attempt limit first: %+v", d)
	}
}

// chainRetryd is a retryd that applies the chain rule (docs/lineage.md):
// $RETRYD_BIN. A server that does not (it answers a
// retried_below with anything but DENY RETRIED_BELOW) fails the test: every
// retryd built from this repository applies it, so a skip would only hide
// a stale binary.
func chainRetryd(t *testing.T) *retrydServer {
	t.Helper()
	s := &retrydServer{t: t, config: clientTestConfig, dir: t.TempDir(), bin: retrydBin(t)}
	s.start("127.0.0.1:0")
	t.Cleanup(s.stop)
	probe := newClient(t, s.grpc, Options{NoFallback: true})
	d, err := probe.Decide(context.Background(), &pb.DecideRequest{Upstream: "go-chain-probe", Idempotency: pb.Idempotency_IDEMPOTENCY_SAFE,
		Attempt: 1, HttpStatus: 503, RetriedBelow: "probe"})
	if err != nil {
		t.Fatal(err)
	}
	if d.DenyReason != pb.DenyReason_DENY_REASON_RETRIED_BELOW {
		t.Fatalf("the retryd at %s does not apply the chain rule (answered %s %s): a stale binary?", s.bin, d.Verdict, d.DenyReason)
	}
	return s
}

// backend is a failing back end: every request gets a 503, and its baggage
// header is recorded.
type backend struct {
	mu      sync.Mutex
	baggage []string
	server  *httptest.Server
}

func startBackend(t *testing.T) *backend {
	b := &backend{}
	b.server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.mu.Lock()
		b.baggage = append(b.baggage, strings.Join(r.Header.Values("Baggage"), ","))
		b.mu.Unlock()
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(b.server.Close)
	return b
}

func (b *backend) seen() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.baggage...)
}

// startMiddle is a service in the middle of a chain: behind the lineage
// middleware, its handler calls the back end through the Transport and
// answers 503 when that fails (path /own: 503 without calling anything).
func startMiddle(t *testing.T, client *Client, backendURL string) (*httptest.Server, *atomic.Int64) {
	var served atomic.Int64
	httpClient := &http.Client{Transport: &Transport{Base: &http.Transport{}, Client: client, Upstream: "go-chain-backend", DisableReporting: true}}
	handler := func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		if _, ok := w.(http.Flusher); !ok {
			t.Errorf("the middleware's ResponseWriter is not an http.Flusher")
		}
		if r.URL.Path == "/own" {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		req, err := http.NewRequestWithContext(safe(r.Context()), http.MethodGet, backendURL, nil)
		if err != nil {
			t.Error(err)
			return
		}
		req.Header.Set("Baggage", "tenant=a")
		resp, err := httpClient.Do(req)
		if err != nil {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode >= 500 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok"))
	}
	server := httptest.NewServer(client.LineageHandler(http.HandlerFunc(handler)))
	t.Cleanup(server.Close)
	return server, &served
}

func wantBaggage(t *testing.T, got []string, lineage ...string) {
	t.Helper()
	if len(got) != len(lineage) {
		t.Fatalf("the back end got %d requests, want %d: %q", len(got), len(lineage), got)
	}
	for i, l := range lineage {
		if want := "tenant=a,retryd.lineage=" + l; got[i] != want {
			t.Fatalf("attempt %d baggage %q, want %q", i+1, got[i], want)
		}
	}
}

func TestMiddleRetriesAndMarksItsFailure(t *testing.T) {
	back := startBackend(t)
	middleClient := newClient(t, shared(t).grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(middleClient)
	middle, _ := startMiddle(t, middleClient, back.server.URL)

	// Called by an edge's first attempt (a plain client, so that its
	// baggage is exactly what we say).
	req, _ := http.NewRequest(http.MethodGet, middle.URL, nil)
	req.Header.Set("Baggage", "userid=7, retryd.lineage=edge:1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	// retryd's max_attempts is 3: the middle is the layer that retries.
	wantBaggage(t, back.seen(), "edge:1/middle:1", "edge:1/middle:2", "edge:1/middle:3")
	if resp.StatusCode != 503 || resp.Header.Get(RetriedHeader) != "middle" {
		t.Fatalf("%d, retryd-retried %q", resp.StatusCode, resp.Header.Get(RetriedHeader))
	}

	// The same failure from the edge itself, with no inbound lineage: the
	// first entry is the middle's own.
	resp, err = http.Get(middle.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	wantBaggage(t, back.seen()[3:], "middle:1", "middle:2", "middle:3")
	if resp.Header.Get(RetriedHeader) != "middle" {
		t.Fatal("no mark without an inbound lineage")
	}

	// A failure of the middle's own, with no outbound call: no mark.
	resp, err = http.Get(middle.URL + "/own")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Values(RetriedHeader) != nil {
		t.Fatalf("%d, retryd-retried %q", resp.StatusCode, resp.Header.Values(RetriedHeader))
	}
}

func TestMiddleMarksASuccessfulRetryNot(t *testing.T) {
	var n atomic.Int64
	flaky := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			w.WriteHeader(503)
		}
	}))
	t.Cleanup(flaky.Close)
	middleClient := newClient(t, shared(t).grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(middleClient)
	middle, _ := startMiddle(t, middleClient, flaky.URL)
	resp, err := http.Get(middle.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || n.Load() != 2 || resp.Header.Values(RetriedHeader) != nil {
		t.Fatalf("%d after %d back-end requests, retryd-retried %q", resp.StatusCode, n.Load(), resp.Header.Values(RetriedHeader))
	}
}

// edgeGet calls the middle through the edge's Transport.
func edgeGet(t *testing.T, edge *Client, url string) *http.Response {
	t.Helper()
	transport := &Transport{Base: &http.Transport{}, Client: edge, Upstream: "go-chain-middle", DisableReporting: true}
	req, _ := http.NewRequestWithContext(safe(context.Background()), http.MethodGet, url, nil)
	req.Header.Set("Baggage", "userid=7")
	resp, err := transport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	// A RoundTripper must not change the caller's request.
	if got := req.Header.Values("Baggage"); len(got) != 1 || got[0] != "userid=7" {
		t.Fatalf("the caller's baggage became %q", got)
	}
	return resp
}

func TestEdgeDoesNotRetryWhatTheMiddleRetried(t *testing.T) {
	retryd := chainRetryd(t)
	back := startBackend(t)
	middleClient := newClient(t, retryd.grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(middleClient)
	middle, served := startMiddle(t, middleClient, back.server.URL)
	edge := newClient(t, retryd.grpc, Options{Layer: "edge", NoFallback: true})
	edgeClock := withFakeClock(edge)

	resp := edgeGet(t, edge, middle.URL)
	decisions := Decisions(resp)
	if resp.StatusCode != 503 || len(decisions) != 1 || served.Load() != 1 {
		t.Fatalf("%d, %d decisions, the middle served %d", resp.StatusCode, len(decisions), served.Load())
	}
	if d := decisions[0]; d.Verdict != pb.Verdict_VERDICT_DENY || d.DenyReason != pb.DenyReason_DENY_REASON_RETRIED_BELOW || d.Fallback {
		t.Fatalf("%+v", d)
	}
	if len(edgeClock.asked()) != 0 {
		t.Fatalf("the edge waited %v", edgeClock.asked())
	}
	// 3 requests reach the back end for the one at the edge, not 9.
	wantBaggage(t, back.seen(), "edge:1/middle:1", "edge:1/middle:2", "edge:1/middle:3")
}

func TestMiddleInsideAnEnclosingRetryDoesNotRetry(t *testing.T) {
	retryd := chainRetryd(t)
	back := startBackend(t)
	middleClient := newClient(t, retryd.grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(middleClient)
	middle, _ := startMiddle(t, middleClient, back.server.URL)
	req, _ := http.NewRequest(http.MethodGet, middle.URL, nil)
	req.Header.Set("Baggage", "retryd.lineage=edge:2")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	wantBaggage(t, back.seen(), "edge:2/middle:1")
	// Denied a retry is retried below too, for the layer above.
	if resp.StatusCode != 503 || resp.Header.Get(RetriedHeader) != "middle" {
		t.Fatalf("%d, retryd-retried %q", resp.StatusCode, resp.Header.Get(RetriedHeader))
	}
}

func TestEdgeLocalRuleHonoursRetriedBelow(t *testing.T) {
	back := startBackend(t)
	middleClient := newClient(t, shared(t).grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(middleClient)
	middle, served := startMiddle(t, middleClient, back.server.URL)
	// retryd unreachable for the edge: its local rule decides.
	edge := newClient(t, closedAddr(t), Options{Layer: "edge", ConnectTimeout: -1})
	withFakeClock(edge)
	resp := edgeGet(t, edge, middle.URL)
	decisions := Decisions(resp)
	if resp.StatusCode != 503 || len(decisions) != 1 || served.Load() != 1 || len(back.seen()) != 3 {
		t.Fatalf("%d, %d decisions, the middle served %d", resp.StatusCode, len(decisions), served.Load())
	}
	if d := decisions[0]; !d.Fallback || d.DenyReason != pb.DenyReason_DENY_REASON_RETRIED_BELOW {
		t.Fatalf("%+v", d)
	}
	// An invalid mark is ignored (it came from a server we do not control).
	bogus := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(RetriedHeader, "not a layer")
		w.WriteHeader(503)
	}))
	t.Cleanup(bogus.Close)
	if d := Decisions(edgeGet(t, edge, bogus.URL)); len(d) != 2 || !d[0].ShouldRetry() || d[1].DenyReason != pb.DenyReason_DENY_REASON_MAX_ATTEMPTS {
		t.Fatalf("%+v", d)
	}
}

// grpcBackend is a failing gRPC back end (UNAVAILABLE) that records the
// baggage of each call.
func grpcBackend(t *testing.T) (addr string, seen func() []string) {
	var mu sync.Mutex
	var baggage []string
	_, addr = startUpstream(t, func(ctx context.Context, n int64) error {
		md, _ := metadata.FromIncomingContext(ctx)
		mu.Lock()
		baggage = append(baggage, strings.Join(md.Get("baggage"), ","))
		mu.Unlock()
		return status.Error(codes.Unavailable, "back end down")
	})
	return addr, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), baggage...)
	}
}

// grpcMiddle serves the health service behind the lineage interceptors;
// Check and Watch both call the back end's Check through the client
// interceptor and fail with UNAVAILABLE when it fails.
type grpcMiddle struct {
	healthpb.UnimplementedHealthServer
	backend healthpb.HealthClient
	served  atomic.Int64
}

func (m *grpcMiddle) call(ctx context.Context) error {
	m.served.Add(1)
	ctx = metadata.AppendToOutgoingContext(safe(ctx), "baggage", "tenant=a")
	if err := check(ctx, m.backend); err != nil {
		return status.Error(codes.Unavailable, "back end failed")
	}
	return nil
}

func (m *grpcMiddle) Check(ctx context.Context, _ *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if err := m.call(ctx); err != nil {
		return nil, err
	}
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func (m *grpcMiddle) Watch(_ *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	if err := m.call(stream.Context()); err != nil {
		return err
	}
	return stream.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING})
}

func startGRPCMiddle(t *testing.T, client *Client, backendAddr string) (*grpcMiddle, string) {
	m := &grpcMiddle{backend: dialUpstream(t, backendAddr, client, InterceptorOptions{Upstream: "go-chain-backend"})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := grpc.NewServer(grpc.UnaryInterceptor(client.LineageUnaryServerInterceptor()),
		grpc.StreamInterceptor(client.LineageStreamServerInterceptor()))
	healthpb.RegisterHealthServer(server, m)
	go func() { _ = server.Serve(l) }()
	t.Cleanup(server.Stop)
	return m, l.Addr().String()
}

func plainHealth(t *testing.T, addr string) healthpb.HealthClient {
	conn, err := grpc.Dial(addr, grpc.WithInsecure(), grpc.WithDisableRetry())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return healthpb.NewHealthClient(conn)
}

func wantGRPCBaggage(t *testing.T, got []string, lineage ...string) {
	t.Helper()
	if len(got) != len(lineage) {
		t.Fatalf("the back end got %d calls, want %d: %q", len(got), len(lineage), got)
	}
	for i, l := range lineage {
		if want := "tenant=a,retryd.lineage=" + l; got[i] != want {
			t.Fatalf("attempt %d baggage %q, want %q", i+1, got[i], want)
		}
	}
}

func wantRetriedTrailer(t *testing.T, trailer metadata.MD) {
	t.Helper()
	if got, pushback := trailer.Get(RetriedHeader), trailer.Get(PushbackTrailer); len(got) != 1 || got[0] != "middle" || len(pushback) != 1 || pushback[0] != "-1" {
		t.Fatalf("trailer %v", trailer)
	}
}

func TestGRPCMiddleRetriesAndMarksItsFailure(t *testing.T) {
	backendAddr, seen := grpcBackend(t)
	middleClient := newClient(t, shared(t).grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(middleClient)
	_, middleAddr := startGRPCMiddle(t, middleClient, backendAddr)
	plain := plainHealth(t, middleAddr)

	// Unary.
	ctx := metadata.AppendToOutgoingContext(context.Background(), "baggage", "userid=7,retryd.lineage=edge:1")
	var trailer metadata.MD
	_, err := plain.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Trailer(&trailer))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("%v", err)
	}
	wantRetriedTrailer(t, trailer)
	wantGRPCBaggage(t, seen(), "edge:1/middle:1", "edge:1/middle:2", "edge:1/middle:3")

	// Streaming.
	stream, err := plain.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("%v", err)
	}
	wantRetriedTrailer(t, stream.Trailer())
	wantGRPCBaggage(t, seen()[3:], "edge:1/middle:1", "edge:1/middle:2", "edge:1/middle:3")
}

func TestGRPCEdgeDoesNotRetryWhatTheMiddleRetried(t *testing.T) {
	retryd := chainRetryd(t)
	backendAddr, seen := grpcBackend(t)
	middleClient := newClient(t, retryd.grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(middleClient)
	middle, middleAddr := startGRPCMiddle(t, middleClient, backendAddr)
	edge := newClient(t, retryd.grpc, Options{Layer: "edge", NoFallback: true})
	withFakeClock(edge)
	upstream := dialUpstream(t, middleAddr, edge, InterceptorOptions{Upstream: "go-chain-middle"})
	err := check(safe(context.Background()), upstream)
	var e *Error
	if !errors.As(err, &e) || e.Attempts != 1 || status.Code(err) != codes.Unavailable || middle.served.Load() != 1 {
		t.Fatalf("%v, the middle served %d", err, middle.served.Load())
	}
	if d := e.Decisions[0]; d.DenyReason != pb.DenyReason_DENY_REASON_RETRIED_BELOW || d.Fallback {
		t.Fatalf("%+v", d)
	}
	wantGRPCBaggage(t, seen(), "edge:1/middle:1", "edge:1/middle:2", "edge:1/middle:3")
}

func TestGRPCEdgeLocalRuleHonoursRetriedBelow(t *testing.T) {
	backendAddr, seen := grpcBackend(t)
	middleClient := newClient(t, shared(t).grpc, Options{Layer: "middle", NoFallback: true})
	withFakeClock(middleClient)
	middle, middleAddr := startGRPCMiddle(t, middleClient, backendAddr)
	edge := newClient(t, closedAddr(t), Options{Layer: "edge", ConnectTimeout: -1})
	upstream := dialUpstream(t, middleAddr, edge, InterceptorOptions{Upstream: "go-chain-middle"})
	err := check(safe(context.Background()), upstream)
	var e *Error
	if !errors.As(err, &e) || e.Attempts != 1 || middle.served.Load() != 1 || len(seen()) != 3 {
		t.Fatalf("%v, the middle served %d, the back end %d", err, middle.served.Load(), len(seen()))
	}
	if d := e.Decisions[0]; !d.Fallback || d.DenyReason != pb.DenyReason_DENY_REASON_RETRIED_BELOW {
		t.Fatalf("%+v", d)
	}
}
