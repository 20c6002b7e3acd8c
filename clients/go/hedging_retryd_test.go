package retryd

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// hedgingConfig is clientTestConfig with hedging policies at their defaults
// (p95, one hedge, 5% extra load, SAFE and IDEMPOTENT, 100 samples over
// 30s). Budgets that neither refill nor take deposits, so that a token
// spent by a hedge shows.
const hedgingConfig = clientTestConfig + `
[upstreams."go-hedge"]
budget = { capacity = 100.0, initial = 50.0, ratio = 0.0, min_per_second = 0.0 }
[upstreams."go-hedge".hedging]
quantile = 0.95

[upstreams."go-hedge-grpc"]
budget = { capacity = 100.0, initial = 50.0, ratio = 0.0, min_per_second = 0.0 }
[upstreams."go-hedge-grpc".hedging]
quantile = 0.95

[upstreams."go-hedge-cap".hedging]
quantile = 0.95
`

// seedLatencies reports n first attempts to upstream, 90% at 1ms and 10% at
// 200ms, so that retryd serves a p95 hedge delay of about 200ms (its p50 is
// far below it: not uniformly slow), long enough that a fast call on a loaded
// machine is not hedged, and returns what the client learned.
func seedLatencies(t *testing.T, client *Client, upstream string, n uint64) Hedging {
	t.Helper()
	fast, slow := n*9/10, n-n*9/10
	counts := map[uint32]uint64{latencyBucketOf(time.Millisecond): fast, latencyBucketOf(200 * time.Millisecond): slow}
	_, err := client.ReportTraffic(context.Background(), &pb.ReportTrafficRequest{Traffic: []*pb.UpstreamTraffic{{
		Upstream: upstream, Requests: n, Successes: n, LatencySuccesses: &pb.LatencyHistogram{Counts: counts},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	h, ok := client.Hedging(upstream)
	if !ok || !h.Enabled || h.Delay < 150*time.Millisecond || h.Delay > 250*time.Millisecond || h.MaxHedges != 1 {
		t.Fatalf("retryd served %+v (%v) after %d latencies", h, ok, n)
	}
	return h
}

func tokens(t *testing.T, client *Client, upstream string) float64 {
	t.Helper()
	budget, err := client.GetBudget(context.Background(), upstream)
	if err != nil {
		t.Fatal(err)
	}
	return budget.GetTokens()
}

func TestRetrydServedHedgeWinsAndTheLoserIsCancelled(t *testing.T) {
	server := startRetryd(t, hedgingConfig, "")
	// The reporter sends only when the test says so: the counts asserted
	// below stay pending.
	client := newClient(t, server.grpc, Options{ReportInterval: time.Hour})
	h := seedLatencies(t, client, "go-hedge", 200)
	upstream := startSlowFirst(t, hangGuard)
	httpClient := &http.Client{Transport: &Transport{Client: client, Upstream: "go-hedge"}}
	ctx, cancel := context.WithTimeout(WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_SAFE), hangGuard)
	defer cancel()

	// A fast call asks nothing: no decision, no token spent, one request.
	resp, body := fetchBody(t, httpClient, ctx, upstream.server.URL+"/warm")
	if body != "fast" || len(Decisions(resp)) != 0 || upstream.other.Load() != 1 || tokens(t, client, "go-hedge") != 50 {
		t.Fatalf("%q %+v %d", body, Decisions(resp), upstream.other.Load())
	}

	start := time.Now()
	resp, body = fetchBody(t, httpClient, ctx, upstream.server.URL+"/slow")
	decisions := Decisions(resp)
	if body != "fast" || len(decisions) != 1 || !decisions[0].ShouldRetry() || decisions[0].Fallback || decisions[0].Backoff != 0 {
		t.Fatalf("%q %+v", body, decisions)
	}
	if gap := upstream.hedgeAfter(start); gap < h.Delay {
		t.Fatalf("the hedge was sent %s after the call began, before the served delay %s", gap, h.Delay)
	}
	select {
	case <-upstream.cancelled:
	case <-time.After(hangGuard):
		t.Fatal("the upstream never saw the first attempt cancelled")
	}
	if n := upstream.slow.Load(); n != 2 {
		t.Fatalf("%d requests to /slow", n)
	}
	// The hedge spent one token of the retry budget, as a retry would.
	if got := tokens(t, client, "go-hedge"); got != 49 {
		t.Fatalf("tokens %v after one hedge", got)
	}
	// The loser is no failure; the first attempt's time is a success; the
	// call is a hedge won (the fast call, never hedged, is not).
	if traffic := client.Reporter().PendingTraffic()["go-hedge"]; traffic != (Traffic{Requests: 2, Successes: 1, RetrySuccesses: 1, HedgesWon: 1}) {
		t.Fatalf("%+v", traffic)
	}
	latency := client.Reporter().PendingLatency()["go-hedge"]
	var successes uint64
	for _, n := range latency.Successes {
		successes += n
	}
	if successes != 2 || len(latency.Failures) != 0 {
		t.Fatalf("%+v", latency)
	}
	// retryd takes the histograms, and counts the hedge won.
	if err := client.Reporter().Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := hedgesWon(t, server, "go-hedge"); got != "1" {
		t.Fatalf("retryd_hedges_won_total %q after one hedge won", got)
	}
}

func TestRetrydServedGRPCHedgeWinsAndTheLoserIsCancelled(t *testing.T) {
	server := startRetryd(t, hedgingConfig, "")
	client := newClient(t, server.grpc, Options{ReportInterval: time.Hour})
	h := seedLatencies(t, client, "go-hedge-grpc", 200)
	cancelled := make(chan struct{}, 1)
	var hedgeArrival atomic.Int64
	upstream, addr := startUpstream(t, func(ctx context.Context, n int64) error {
		switch n {
		case 2: // the slow call's first attempt: held until the hedge wins
			<-ctx.Done()
			cancelled <- struct{}{}
			return ctx.Err()
		case 3:
			hedgeArrival.Store(time.Now().UnixNano())
		}
		return nil
	})
	conn, err := grpc.Dial(addr, grpc.WithInsecure(), grpc.WithDisableRetry(),
		grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(InterceptorOptions{Upstream: "go-hedge-grpc"})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	ctx, cancel := context.WithTimeout(WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_SAFE), hangGuard)
	defer cancel()
	// Call 1 is fast: no Decide, no token.
	if err := check(ctx, health); err != nil || tokens(t, client, "go-hedge-grpc") != 50 {
		t.Fatal(err)
	}
	start := time.Now()
	reply, err := health.Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || reply.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("%v %v", reply, err)
	}
	select {
	case <-cancelled:
	case <-time.After(hangGuard):
		t.Fatal("the upstream never saw the first attempt cancelled")
	}
	if gap := time.Duration(hedgeArrival.Load() - start.UnixNano()); gap < h.Delay {
		t.Fatalf("the hedge was sent %s after the call began, before the served delay %s", gap, h.Delay)
	}
	if n := upstream.calls.Load(); n != 3 || tokens(t, client, "go-hedge-grpc") != 49 {
		t.Fatalf("%d calls", n)
	}
	if traffic := client.Reporter().PendingTraffic()["go-hedge-grpc"]; traffic != (Traffic{Requests: 2, Successes: 1, RetrySuccesses: 1, HedgesWon: 1}) {
		t.Fatalf("%+v", traffic)
	}
	if err := client.Reporter().Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := hedgesWon(t, server, "go-hedge-grpc"); got != "1" {
		t.Fatalf("retryd_hedges_won_total %q after one hedge won", got)
	}
}

func TestRetrydHedgeCapSendsNoCopy(t *testing.T) {
	server := startRetryd(t, hedgingConfig, "")
	client := newClient(t, server.grpc, Options{ReportInterval: time.Hour})
	// 100 first attempts over the window: the default 5% cap allows 5 hedges.
	seedLatencies(t, client, "go-hedge-cap", 100)
	// Each call's first attempt is held until cancelled, or for 1s (past the
	// ~200ms delay) and then answered; its hedge answered at once.
	var arrivals atomic.Int64
	upstream := newHoldFirst(t, time.Second, &arrivals)
	httpClient := &http.Client{Transport: &Transport{Client: client, Upstream: "go-hedge-cap"}}
	ctx := WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_SAFE)
	for i := 1; i <= 5; i++ {
		resp, body := fetchBody(t, httpClient, ctx, upstream.URL)
		if d := Decisions(resp); body != "fast" || len(d) != 1 || !d[0].ShouldRetry() {
			t.Fatalf("call %d: %q %+v", i, body, d)
		}
	}
	before := arrivals.Load()
	resp, body := fetchBody(t, httpClient, ctx, upstream.URL)
	d := Decisions(resp)
	if body != "held" || len(d) != 1 || d[0].DenyReason != pb.DenyReason_DENY_REASON_HEDGE_CAP || d[0].Fallback {
		t.Fatalf("%q %+v", body, d)
	}
	if n := arrivals.Load() - before; n != 1 {
		t.Fatalf("%d requests for a call whose hedge was denied", n)
	}
	// Five calls a hedge answered; the sixth, its hedge denied, answered by
	// its first attempt, is no hedge won.
	if won := client.Reporter().PendingTraffic()["go-hedge-cap"].HedgesWon; won != 5 {
		t.Fatalf("%d hedges won", won)
	}
	if err := client.Reporter().Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := hedgesWon(t, server, "go-hedge-cap"); got != "5" {
		t.Fatalf("retryd_hedges_won_total %q after five hedges won", got)
	}
}

// hedgesWon is the value of retryd_hedges_won_total for upstream on
// server's /metrics ("" when it has no series), as retryd counts the
// reported UpstreamTraffic.hedges_won.
func hedgesWon(t *testing.T, server *retrydServer, upstream string) string {
	t.Helper()
	resp, err := http.Get("http://" + server.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	text, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %d %v", resp.StatusCode, err)
	}
	prefix := `retryd_hedges_won_total{upstream="` + upstream + `"} `
	for _, line := range strings.Split(string(text), "\n") {
		if strings.HasPrefix(line, prefix) {
			return strings.TrimPrefix(line, prefix)
		}
	}
	return ""
}
