package retryd

// Issue 32: reports carry outcomes. The adapters, against a real retryd and
// real downstream servers, count how every attempt ended; the counts that
// reach the wire are captured by an in-process gRPC server that forwards
// decisions to the real retryd and records every ReportTraffic.
//
// The rule: an attempt is a failure when the adapter asked (or would ask)
// retryd whether to retry it; every other ending is a success (a 404
// included); an attempt whose context the caller cancelled is neither.

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// reportCapture forwards Decide to a real retryd and records every
// ReportTraffic as sent, failing the first `failures` of them (UNAVAILABLE).
type reportCapture struct {
	pb.UnimplementedRetryDeciderServer
	real     *Client
	mu       sync.Mutex
	reports  []*pb.ReportTrafficRequest
	failures int
}

func (c *reportCapture) Decide(ctx context.Context, req *pb.DecideRequest) (*pb.DecideResponse, error) {
	return c.real.decider.Decide(ctx, req)
}

func (c *reportCapture) ReportTraffic(_ context.Context, req *pb.ReportTrafficRequest) (*pb.ReportTrafficResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reports = append(c.reports, proto.Clone(req).(*pb.ReportTrafficRequest))
	if len(c.reports) <= c.failures {
		return nil, status.Error(codes.Unavailable, "injected")
	}
	return &pb.ReportTrafficResponse{Accepted: uint32(len(req.GetTraffic()))}, nil
}

func (c *reportCapture) all() []*pb.ReportTrafficRequest {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*pb.ReportTrafficRequest(nil), c.reports...)
}

// sent sums the entries of the reports delivered per upstream (a re-sent
// report counted once).
func (c *reportCapture) sent() map[string]Traffic {
	seen := map[string]bool{}
	total := map[string]Traffic{}
	for _, report := range c.all() {
		if seen[report.GetReportId()] {
			continue
		}
		seen[report.GetReportId()] = true
		for _, entry := range report.GetTraffic() {
			t := total[entry.GetUpstream()]
			t.add(trafficOf(entry))
			total[entry.GetUpstream()] = t
		}
	}
	return total
}

// capturedClient is a client whose decisions are the shared retryd's and
// whose reports land in the capture.
func capturedClient(t *testing.T) (*Client, *reportCapture) {
	t.Helper()
	capture := &reportCapture{real: newClient(t, shared(t).grpc, Options{NoFallback: true})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := grpc.NewServer(grpc.CustomCodec(serverCodec{}))
	pb.RegisterRetryDeciderServer(server, capture)
	go func() { _ = server.Serve(l) }()
	t.Cleanup(server.Stop)
	return newClient(t, l.Addr().String(), Options{NoFallback: true, ReportInterval: time.Hour}), capture
}

// scripted answers the n-th request (1-based) with statuses[n-1], the last repeating.
func scripted(t *testing.T, statuses ...int) *httptest.Server {
	var n atomic.Int64
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := int(n.Add(1)) - 1
		if i >= len(statuses) {
			i = len(statuses) - 1
		}
		w.WriteHeader(statuses[i])
	}))
	t.Cleanup(server.Close)
	return server
}

func TestHTTPOutcomesReachTheReport(t *testing.T) {
	client, capture := capturedClient(t)
	get := func(ctx context.Context, url, upstream string) (*http.Response, error) {
		transport := &Transport{Base: &http.Transport{}, Client: client, Upstream: upstream}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := transport.RoundTrip(req)
		if resp != nil {
			resp.Body.Close()
		}
		return resp, err
	}
	for _, c := range []struct {
		upstream string
		statuses []int
		want     int
	}{
		{"go-out-ok", []int{200}, 200},
		{"go-out-retried", []int{503, 200}, 200},
		{"go-out-404", []int{404}, 404},
		{"go-out-500", []int{500}, 500}, // asked about, denied (transient_500 = false)
	} {
		resp, err := get(safe(context.Background()), scripted(t, c.statuses...).URL, c.upstream)
		if err != nil || resp.StatusCode != c.want {
			t.Fatalf("%s: %v %v", c.upstream, resp, err)
		}
	}
	// Not sent: retried up to max_attempts = 3, even for a payment.
	if _, err := get(context.Background(), "http://"+closedAddr(t)+"/", "go-out-refused"); err == nil {
		t.Fatal("a refused connection succeeded")
	}
	// A payment answered 503: AMBIGUOUS, not retried.
	if _, err := get(context.Background(), scripted(t, 503).URL, "go-out-charge"); err == nil {
		t.Fatal("an ambiguous payment succeeded")
	}
	// Cancelled by the caller while the upstream holds the request: neither.
	held := make(chan struct{})
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(held)
		<-r.Context().Done()
	}))
	t.Cleanup(hang.Close)
	ctx, cancel := context.WithCancel(safe(context.Background()))
	go func() { <-held; cancel() }()
	if _, err := get(ctx, hang.URL, "go-out-cancel"); err == nil {
		t.Fatal("a cancelled call succeeded")
	}
	if err := client.Reporter().Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	want := map[string]Traffic{
		"go-out-ok":      {Requests: 1, Successes: 1},
		"go-out-retried": {Requests: 1, Failures: 1, RetrySuccesses: 1},
		"go-out-404":     {Requests: 1, Successes: 1},
		"go-out-500":     {Requests: 1, Failures: 1},
		"go-out-refused": {Requests: 1, Failures: 1, RetryFailures: 2},
		"go-out-charge":  {Requests: 1, Failures: 1},
		"go-out-cancel":  {Requests: 1},
	}
	if got := capture.sent(); !equalTraffic(got, want) {
		t.Fatalf("sent %+v\nwant %+v", got, want)
	}
}

func TestGRPCOutcomesReachTheReport(t *testing.T) {
	client, capture := capturedClient(t)
	call := func(ctx context.Context, addr, upstream string) error {
		conn, err := grpc.Dial(addr, grpc.WithInsecure(), grpc.WithDisableRetry(),
			grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(InterceptorOptions{Upstream: upstream})))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		return check(ctx, healthpb.NewHealthClient(conn))
	}
	for _, c := range []struct {
		upstream string
		codes    []codes.Code
		want     codes.Code
	}{
		{"go-out-grpc-ok", []codes.Code{codes.OK}, codes.OK},
		{"go-out-grpc-retried", []codes.Code{codes.Unavailable, codes.OK}, codes.OK},
		{"go-out-grpc-404", []codes.Code{codes.NotFound}, codes.NotFound},
		{"go-out-grpc-internal", []codes.Code{codes.Internal}, codes.Internal}, // asked about, denied
	} {
		script := c.codes
		_, addr := startUpstream(t, func(ctx context.Context, n int64) error {
			i := int(n) - 1
			if i >= len(script) {
				i = len(script) - 1
			}
			if script[i] == codes.OK {
				return nil
			}
			return status.Error(script[i], "scripted")
		})
		if err := call(safe(context.Background()), addr, c.upstream); status.Code(err) != c.want {
			t.Fatalf("%s: %v", c.upstream, err)
		}
	}
	if err := call(context.Background(), closedAddr(t), "go-out-grpc-refused"); status.Code(err) != codes.Unavailable {
		t.Fatalf("refused: %v", err)
	}
	held := make(chan struct{})
	var once sync.Once
	_, addr := startUpstream(t, func(ctx context.Context, n int64) error {
		once.Do(func() { close(held) })
		<-ctx.Done()
		return ctx.Err()
	})
	ctx, cancel := context.WithCancel(safe(context.Background()))
	go func() { <-held; cancel() }()
	if err := call(ctx, addr, "go-out-grpc-cancel"); status.Code(err) != codes.Canceled {
		t.Fatalf("cancelled: %v", err)
	}
	if err := client.Reporter().Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	want := map[string]Traffic{
		"go-out-grpc-ok":       {Requests: 1, Successes: 1},
		"go-out-grpc-retried":  {Requests: 1, Failures: 1, RetrySuccesses: 1},
		"go-out-grpc-404":      {Requests: 1, Successes: 1},
		"go-out-grpc-internal": {Requests: 1, Failures: 1},
		"go-out-grpc-refused":  {Requests: 1, Failures: 1, RetryFailures: 2},
		"go-out-grpc-cancel":   {Requests: 1},
	}
	if got := capture.sent(); !equalTraffic(got, want) {
		t.Fatalf("sent %+v\nwant %+v", got, want)
	}
}

func TestAResentReportCarriesTheSameOutcomes(t *testing.T) {
	client, capture := capturedClient(t)
	capture.failures = 1
	transport := &Transport{Base: &http.Transport{}, Client: client, Upstream: "go-out-resend"}
	get := func(url string) {
		req, _ := http.NewRequestWithContext(safe(context.Background()), http.MethodGet, url, nil)
		resp, err := transport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	get(scripted(t, 503, 200).URL)
	if err := client.Reporter().Flush(context.Background()); status.Code(err) != codes.Unavailable {
		t.Fatalf("first flush: %v", err)
	}
	get(scripted(t, 200).URL)
	if got := client.Reporter().PendingTraffic()["go-out-resend"]; got != (Traffic{Requests: 2, Successes: 1, Failures: 1, RetrySuccesses: 1}) {
		t.Fatalf("pending %+v", got)
	}
	if err := client.Reporter().Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	reports := capture.all()
	if len(reports) != 3 || !proto.Equal(reports[0], reports[1]) {
		t.Fatalf("reports %v", reports)
	}
	if got := trafficOf(reports[0].GetTraffic()[0]); got != (Traffic{Requests: 1, Failures: 1, RetrySuccesses: 1}) {
		t.Fatalf("first %+v", got)
	}
	if got := trafficOf(reports[2].GetTraffic()[0]); reports[2].GetReportId() == reports[0].GetReportId() || got != (Traffic{Requests: 1, Successes: 1}) {
		t.Fatalf("third %v", reports[2])
	}
	// The first attempt's latency goes with its outcome (a failure: the 503),
	// the retry's nowhere; the re-sent batch (proto.Equal above) carries the
	// same histograms.
	first, third := latencyOf(reports[0].GetTraffic()[0]), latencyOf(reports[2].GetTraffic()[0])
	if len(first.Successes) != 0 || len(first.Failures) != 1 || len(third.Successes) != 1 || len(third.Failures) != 0 {
		t.Fatalf("latencies %+v %+v", first, third)
	}
	for _, l := range []Latency{first, third} {
		for _, m := range []map[uint32]uint64{l.Successes, l.Failures} {
			for b, n := range m {
				if n != 1 || b > MaxLatencyBucket {
					t.Fatalf("latencies %+v", l)
				}
			}
		}
	}
}

func TestRecordOutcomeWithoutTheAdapters(t *testing.T) {
	client, capture := capturedClient(t)
	reporter := NewTrafficReporter(client, ReporterOptions{})
	reporter.Record("a", 3)
	reporter.RecordOutcome("a", true, false, 1)
	reporter.RecordOutcome("a", false, false, 2)
	reporter.RecordOutcome("a", true, true, 1)
	reporter.RecordOutcome("a", false, true, 4)
	reporter.RecordOutcome("b", true, true, 1) // a retry whose first attempt was reported earlier
	reporter.RecordHedgeWon("a", 2)
	if got := reporter.Pending(); len(got) != 1 || got["a"] != 3 {
		t.Fatalf("pending %v", got)
	}
	if err := reporter.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	want := map[string]Traffic{"a": {Requests: 3, Successes: 1, Failures: 2, RetrySuccesses: 1, RetryFailures: 4, HedgesWon: 2}, "b": {RetrySuccesses: 1}}
	if got := capture.sent(); !equalTraffic(got, want) {
		t.Fatalf("sent %+v", got)
	}
	// Bounded like requests: beyond MaxUpstreams the outcomes go with the requests.
	bounded := NewTrafficReporter(client, ReporterOptions{MaxUpstreams: 1})
	bounded.RecordOutcome("a", true, false, 1)
	bounded.Record("b", 2)
	bounded.RecordOutcome("b", false, false, 1)
	if got := bounded.PendingTraffic(); len(got) != 1 || got["a"] != (Traffic{Successes: 1}) || bounded.Dropped() != 2 {
		t.Fatalf("pending %+v, dropped %d", got, bounded.Dropped())
	}
}

func TestRetrydAcceptsReportsWithOutcomes(t *testing.T) {
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	reporter := NewTrafficReporter(client, ReporterOptions{})
	reporter.Record("go-out-real", 2)
	reporter.RecordOutcome("go-out-real", true, false, 1)
	reporter.RecordOutcome("go-out-real", false, true, 1)
	if err := reporter.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func equalTraffic(a, b map[string]Traffic) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}
