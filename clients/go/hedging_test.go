package retryd

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/durationpb"
)

// The contract's vectors (retryd.proto, LatencyHistogram). 1000 us is in
// bucket 63: bucket 63 starts at (8+7)<<6 = 960 us and bucket 64 at 1024.
func TestLatencyBucketVectors(t *testing.T) {
	vectors := []struct {
		micros uint64
		bucket uint32
	}{
		{0, 0}, {15, 15}, {16, 16}, {17, 16}, {18, 17}, {31, 23}, {32, 24},
		{1000, 63}, {1023, 63}, {1024, 64}, {3600000000, 237}, {7200000000, 237}, {1<<64 - 1, 237},
	}
	for _, v := range vectors {
		if got := LatencyBucket(v.micros); got != v.bucket {
			t.Errorf("LatencyBucket(%d) = %d, want %d", v.micros, got, v.bucket)
		}
	}
	// Every bucket from 16 starts where the contract says, and the value
	// before its start is in the bucket before.
	for b := uint32(16); b <= MaxLatencyBucket; b++ {
		start := uint64(8+b%8) << (b/8 - 1)
		if LatencyBucket(start) != b || LatencyBucket(start-1) != b-1 {
			t.Fatalf("bucket %d: starts at %d, LatencyBucket(start) = %d, LatencyBucket(start-1) = %d", b, start, LatencyBucket(start), LatencyBucket(start-1))
		}
	}
}

func TestHedgingTableKeepsAnAbsentUpstreamForThreeIntervals(t *testing.T) {
	table := newHedgingTable(2)
	now := time.Unix(1000, 0)
	stale := 3 * time.Second
	served := []*pb.Hedging{{
		Upstream: "a", Enabled: true, Delay: durationpb.New(20 * time.Millisecond), MaxHedges: 1,
		Idempotency: []pb.Idempotency{pb.Idempotency_IDEMPOTENCY_SAFE, pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT},
	}}
	table.update(served, now, stale)
	h, ok := table.lookup("a", now.Add(stale), stale)
	if !ok || h.Delay != 20*time.Millisecond || !h.allows(pb.Idempotency_IDEMPOTENCY_SAFE) {
		t.Fatalf("%+v %v", h, ok)
	}
	// Never NON_IDEMPOTENT, even if a (buggy) retryd listed it.
	if h.allows(pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT) || h.allows(pb.Idempotency_IDEMPOTENCY_IDEMPOTENT_WITH_KEY) {
		t.Fatalf("%+v", h)
	}
	if _, ok := table.lookup("a", now.Add(stale+time.Millisecond), stale); ok {
		t.Fatal("an entry outlived three intervals")
	}
	// A response without "a" drops it once stale; the table is bounded.
	table.update([]*pb.Hedging{{Upstream: "b"}, {Upstream: "c"}, {Upstream: "d"}}, now.Add(stale+time.Second), stale)
	if len(table.entries) != 2 {
		t.Fatalf("%v", table.entries)
	}
	if _, ok := table.entries["a"]; ok {
		t.Fatal("a stale entry was kept")
	}
}

// slowFirst is an HTTP upstream whose first request to /slow is held until
// the client cancels it (or for hold, then answered), and whose every other
// request is answered at once.
type slowFirst struct {
	server    *httptest.Server
	hold      time.Duration
	slow      atomic.Int64
	other     atomic.Int64
	cancelled chan struct{}
	mu        sync.Mutex
	arrivals  []time.Time
}

func startSlowFirst(t *testing.T, hold time.Duration) *slowFirst {
	s := &slowFirst{hold: hold, cancelled: make(chan struct{}, 1)}
	s.server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/slow" {
			s.other.Add(1)
			io.WriteString(w, "fast")
			return
		}
		s.mu.Lock()
		s.arrivals = append(s.arrivals, time.Now())
		s.mu.Unlock()
		if s.slow.Add(1) == 1 {
			select {
			case <-r.Context().Done():
				s.cancelled <- struct{}{}
				return
			case <-time.After(s.hold):
			}
			io.WriteString(w, "held")
			return
		}
		io.WriteString(w, "fast")
	}))
	t.Cleanup(s.server.Close)
	return s
}

// hedgeAfter is how long after start the second request to /slow arrived.
func (s *slowFirst) hedgeAfter(start time.Time) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.arrivals) < 2 {
		return 0
	}
	return s.arrivals[1].Sub(start)
}

// unreachableClient is a client whose retryd is down, known to be down (a
// traffic report failed), with policy as its local rule.
func unreachableClient(t *testing.T, policy LocalPolicy) *Client {
	client := newClient(t, closedAddr(t), Options{LocalPolicy: &policy, ReportInterval: time.Hour})
	client.Reporter().Record("warm-up", 1)
	if err := client.Reporter().Flush(context.Background()); err == nil {
		t.Fatal("a report to a closed port was taken")
	}
	return client
}

func fetchBody(t *testing.T, client *http.Client, ctx context.Context, url string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(body)
}

func TestLocalHedgeWinsAndCancelsTheSlowFirstAttempt(t *testing.T) {
	upstream := startSlowFirst(t, hangGuard)
	policy := DefaultLocalPolicy
	policy.HedgeDelay = 50 * time.Millisecond
	client := unreachableClient(t, policy)
	httpClient := &http.Client{Transport: &Transport{Client: client, Upstream: "go-hedge-local"}}
	// 25 first attempts earn one token at the default HedgeLoad (0.05);
	// NON_IDEMPOTENT, so none is hedged, however slow the machine.
	for i := 0; i < 25; i++ {
		resp, body := fetchBody(t, httpClient, context.Background(), upstream.server.URL+"/warm")
		if body != "fast" || len(Decisions(resp)) != 0 {
			t.Fatalf("%q %v", body, Decisions(resp))
		}
	}
	ctx, cancel := context.WithTimeout(WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_SAFE), hangGuard)
	defer cancel()
	start := time.Now()
	resp, body := fetchBody(t, httpClient, ctx, upstream.server.URL+"/slow")
	decisions := Decisions(resp)
	if body != "fast" || len(decisions) != 1 || !decisions[0].ShouldRetry() || !decisions[0].Fallback {
		t.Fatalf("%q %+v", body, decisions)
	}
	// The timer starts when the first attempt is sent, after start.
	if gap := upstream.hedgeAfter(start); gap < policy.HedgeDelay {
		t.Fatalf("the hedge was sent %s after the first attempt, before the delay", gap)
	}
	select {
	case <-upstream.cancelled:
	case <-time.After(hangGuard):
		t.Fatal("the upstream never saw the first attempt cancelled")
	}
	if n := upstream.slow.Load(); n != 2 {
		t.Fatalf("%d requests to /slow", n)
	}
	// The loser is no failure and no outcome at all; the hedge that won is
	// an attempt after the first, and the call a hedge won; the first
	// attempt's latency is the time it ran, as a success.
	traffic := client.Reporter().PendingTraffic()["go-hedge-local"]
	if traffic != (Traffic{Requests: 26, Successes: 25, RetrySuccesses: 1, HedgesWon: 1}) {
		t.Fatalf("%+v", traffic)
	}
	latency := client.Reporter().PendingLatency()["go-hedge-local"]
	var successes, slow uint64
	for b, n := range latency.Successes {
		successes += n
		if b >= latencyBucketOf(policy.HedgeDelay) {
			slow += n
		}
	}
	if successes != 26 || slow < 1 || len(latency.Failures) != 0 {
		t.Fatalf("%+v", latency)
	}
}

func TestLocalHedgeDeniedSendsNoCopy(t *testing.T) {
	upstream := startSlowFirst(t, 300*time.Millisecond)
	policy := DefaultLocalPolicy
	policy.HedgeDelay = 20 * time.Millisecond
	client := unreachableClient(t, policy) // no first attempt yet: no token
	httpClient := &http.Client{Transport: &Transport{Client: client, Upstream: "go-hedge-denied"}}
	ctx := WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_SAFE)
	resp, body := fetchBody(t, httpClient, ctx, upstream.server.URL+"/slow")
	decisions := Decisions(resp)
	if body != "held" || len(decisions) != 1 || decisions[0].DenyReason != pb.DenyReason_DENY_REASON_HEDGE_CAP {
		t.Fatalf("%q %+v", body, decisions)
	}
	if n := upstream.slow.Load(); n != 1 {
		t.Fatalf("%d requests to /slow: a denied hedge was sent", n)
	}
	if traffic := client.Reporter().PendingTraffic()["go-hedge-denied"]; traffic != (Traffic{Requests: 1, Successes: 1}) {
		t.Fatalf("%+v", traffic)
	}
}

func TestNoLocalHedgingByDefault(t *testing.T) {
	upstream := startSlowFirst(t, 100*time.Millisecond)
	client := unreachableClient(t, DefaultLocalPolicy)
	httpClient := &http.Client{Transport: &Transport{Client: client, Upstream: "go-hedge-off"}}
	for i := 0; i < 25; i++ {
		fetchBody(t, httpClient, context.Background(), upstream.server.URL+"/warm")
	}
	resp, body := fetchBody(t, httpClient, WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_SAFE), upstream.server.URL+"/slow")
	if body != "held" || len(Decisions(resp)) != 0 || upstream.slow.Load() != 1 {
		t.Fatalf("%q %+v %d", body, Decisions(resp), upstream.slow.Load())
	}
}

func TestGRPCLocalHedgeWinsAndCancelsTheSlowFirstAttempt(t *testing.T) {
	cancelled := make(chan struct{}, 1)
	var hedgeArrival atomic.Int64
	upstream, addr := startUpstream(t, func(ctx context.Context, n int64) error {
		if n == 2 {
			hedgeArrival.Store(time.Now().UnixNano())
		}
		if n == 1 {
			<-ctx.Done() // held until the hedge wins
			cancelled <- struct{}{}
			return ctx.Err()
		}
		return nil
	})
	policy := DefaultLocalPolicy
	policy.HedgeDelay = 50 * time.Millisecond
	client := unreachableClient(t, policy)
	for i := 0; i < 25; i++ {
		client.firstAttemptSent("go-grpc-hedge") // as 25 calls would
	}
	conn, err := grpc.Dial(addr, grpc.WithInsecure(), grpc.WithDisableRetry(),
		grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(InterceptorOptions{Upstream: "go-grpc-hedge"})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_SAFE), hangGuard)
	defer cancel()
	start := time.Now()
	reply, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || reply.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("%v %v", reply, err)
	}
	select {
	case <-cancelled:
	case <-time.After(hangGuard):
		t.Fatal("the upstream never saw the first attempt cancelled")
	}
	if gap := time.Duration(hedgeArrival.Load() - start.UnixNano()); gap < policy.HedgeDelay {
		t.Fatalf("the hedge was sent %s after the first attempt", gap)
	}
	if n := upstream.calls.Load(); n != 2 {
		t.Fatalf("%d calls", n)
	}
	if traffic := client.Reporter().PendingTraffic()["go-grpc-hedge"]; traffic != (Traffic{Requests: 1, RetrySuccesses: 1, HedgesWon: 1}) {
		t.Fatalf("%+v", traffic)
	}
	if latency := client.Reporter().PendingLatency()["go-grpc-hedge"]; len(latency.Successes) != 1 || len(latency.Failures) != 0 {
		t.Fatalf("%+v", latency)
	}
}

// newHoldFirst is an HTTP upstream whose first attempts (their
// retryd.lineage entry's attempt 1) are held until cancelled (or for hold,
// then answered "held") and whose hedges (attempt 2) are answered "fast" at
// once, counting every request in arrivals. Told apart by the lineage, not by
// arrival order: on a loaded machine a call's first attempt, paying for a new
// connection, can arrive after its hedge.
func newHoldFirst(t *testing.T, hold time.Duration, arrivals *atomic.Int64) *httptest.Server {
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrivals.Add(1)
		lineage := baggageLineage(r.Header.Values("Baggage"))
		if entries := parseLineage(lineage); len(entries) > 0 && entries[len(entries)-1].attempt == 1 {
			select {
			case <-r.Context().Done():
				return
			case <-time.After(hold):
			}
			io.WriteString(w, "held")
			return
		}
		io.WriteString(w, "fast")
	}))
	t.Cleanup(server.Close)
	return server
}
