package retryd

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// shadowConfig gives each shadow upstream an enforced twin with the same
// policy, so that the same facts show both sides. transient_500 makes
// retryd retry a 500 on an idempotent call, which the local rule never
// does; an empty budget makes retryd deny what the local rule retries.
const shadowConfig = `
[server]
listen = "%s"
metrics_listen = "127.0.0.1:0"

[defaults]
max_attempts = 3
min_attempt_budget = "20ms"
budget = { capacity = 1000.0, initial = 1000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "1ms", max = "5ms", jitter = "full" }

[upstreams."shadow-500"]
enforce = false
transient_500 = true

[upstreams."live-500"]
transient_500 = true

[upstreams."shadow-empty"]
enforce = false
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }

[upstreams."live-empty"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }

[upstreams."shadow-log"]
enforce = false
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }

[upstreams."shadow-log-other"]
enforce = false
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }
`

var (
	shadowOnce   sync.Once
	shadowServer *retrydServer
)

// shadowRetryd is one retryd with shadowConfig for this file's tests.
func shadowRetryd(t *testing.T) *retrydServer {
	t.Helper()
	retrydBin(t)
	shadowOnce.Do(func() { shadowServer = startRetryd(sharedT, shadowConfig, "") })
	if shadowServer == nil {
		t.Fatal("the shadow retryd did not start")
	}
	return shadowServer
}

func shadowTransport(client *Client, upstream string) *Transport {
	return &Transport{Base: &http.Transport{}, Client: client, Upstream: upstream, DisableReporting: true}
}

// status is a server that answers every request with the statuses in
// order (the last one from then on), counting the requests.
func statuses(t *testing.T, codes ...int) (url string, hits func() int64) {
	server, n := counted(t, func(i int64, w http.ResponseWriter, r *http.Request) {
		code := codes[len(codes)-1]
		if int(i) <= len(codes) {
			code = codes[i-1]
		}
		w.WriteHeader(code)
		fmt.Fprint(w, "body")
	})
	return server.URL, n.Load
}

func getAll(t *testing.T, transport http.RoundTripper, url string) (*http.Response, string) {
	t.Helper()
	resp, err := get(t, safe(context.Background()), transport, url)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(body)
}

func lastDecision(t *testing.T, resp *http.Response) Decision {
	t.Helper()
	decisions := Decisions(resp)
	if len(decisions) == 0 {
		t.Fatal("no decision on the response")
	}
	return decisions[len(decisions)-1]
}

func TestAShadowRetryTheLocalRuleDeniesIsNotRetried(t *testing.T) {
	client := newClient(t, shadowRetryd(t).grpc, Options{Timeout: 5 * time.Second})
	url, hits := statuses(t, 500, 200)
	resp, _ := getAll(t, shadowTransport(client, "shadow-500"), url)
	if resp.StatusCode != 500 || hits() != 1 {
		t.Fatalf("status %d after %d requests: the local rule never retries a 500", resp.StatusCode, hits())
	}
	d := lastDecision(t, resp)
	if !d.Shadow || d.Fallback || d.Verdict != pb.Verdict_VERDICT_DENY || d.DenyReason != pb.DenyReason_DENY_REASON_STATUS_NOT_RETRYABLE {
		t.Fatalf("acted on %+v", d)
	}
	if !strings.Contains(d.Explanation, "shadow") || !math.IsNaN(d.TokensRemaining) {
		t.Fatalf("acted on %+v", d)
	}
	r := d.Retryd
	if r == nil || !r.Shadow || r.Retryd != nil || r.Verdict != pb.Verdict_VERDICT_RETRY || r.Rule != 9 || r.DecisionID == "" || d.DecisionID != r.DecisionID {
		t.Fatalf("retryd's decision %+v", r)
	}
	if got := client.ShadowDivergences(); !reflect.DeepEqual(got, map[string]uint64{"shadow-500": 1}) {
		t.Fatalf("divergences %v", got)
	}
}

func TestAShadowDenialTheLocalRuleRetriesIsRetried(t *testing.T) {
	client := newClient(t, shadowRetryd(t).grpc, Options{Timeout: 5 * time.Second})
	url, hits := statuses(t, 503, 200)
	resp, body := getAll(t, shadowTransport(client, "shadow-empty"), url)
	if resp.StatusCode != 200 || body != "body" || hits() != 2 {
		t.Fatalf("status %d after %d requests", resp.StatusCode, hits())
	}
	d := lastDecision(t, resp)
	if !d.Shadow || !d.ShouldRetry() || d.Retryd == nil || d.Retryd.DenyReason != pb.DenyReason_DENY_REASON_BUDGET_EXHAUSTED {
		t.Fatalf("acted on %+v, retryd %+v", d, d.Retryd)
	}

	// The same direction for a connect failure of a payment, on a stream.
	stream := client.DecideStream(context.Background())
	defer stream.Close()
	d, err := stream.Decide(connectFailure("shadow-empty", pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT))
	if err != nil || !d.Shadow || !d.ShouldRetry() || d.Rule != 9 || d.Retryd == nil ||
		d.Retryd.Verdict != pb.Verdict_VERDICT_DENY || d.Retryd.DenyReason != pb.DenyReason_DENY_REASON_BUDGET_EXHAUSTED {
		t.Fatalf("%+v (retryd %+v), %v", d, d.Retryd, err)
	}
	if got := client.ShadowDivergences()["shadow-empty"]; got != 2 {
		t.Fatalf("divergences %d", got)
	}
}

func TestAnEnforcedUpstreamActsOnRetrydsDecision(t *testing.T) {
	client := newClient(t, shadowRetryd(t).grpc, Options{Timeout: 5 * time.Second})
	url, hits := statuses(t, 500)
	resp, _ := getAll(t, shadowTransport(client, "live-500"), url)
	if resp.StatusCode != 500 || hits() != 3 {
		t.Fatalf("status %d after %d requests: retryd retries a transient 500 up to max_attempts", resp.StatusCode, hits())
	}
	url, hits = statuses(t, 503, 200)
	resp, _ = getAll(t, shadowTransport(client, "live-empty"), url)
	if resp.StatusCode != 503 || hits() != 1 {
		t.Fatalf("status %d after %d requests", resp.StatusCode, hits())
	}
	if d := lastDecision(t, resp); d.Shadow || d.Retryd != nil || d.DenyReason != pb.DenyReason_DENY_REASON_BUDGET_EXHAUSTED {
		t.Fatalf("acted on %+v", d)
	}
	if got := client.ShadowDivergences(); len(got) != 0 {
		t.Fatalf("divergences %v", got)
	}
}

func TestShadowDifferencesAreLoggedOncePerIntervalWithTheCount(t *testing.T) {
	logs := &logBuffer{}
	client := newClient(t, shadowRetryd(t).grpc, Options{Timeout: 5 * time.Second, Logger: logs.logger(), ShadowLogInterval: time.Minute})
	ctx := context.Background()
	differing := func(upstream string) {
		t.Helper()
		// retryd: DENY BUDGET_EXHAUSTED (empty); the local rule: RETRY a 503 GET.
		d, err := client.Decide(ctx, &pb.DecideRequest{Upstream: upstream, Idempotency: pb.Idempotency_IDEMPOTENCY_SAFE, Attempt: 1, HttpStatus: 503})
		if err != nil || !d.ShouldRetry() || d.Retryd == nil || d.Retryd.DenyReason != pb.DenyReason_DENY_REASON_BUDGET_EXHAUSTED {
			t.Fatalf("%+v, %v", d, err)
		}
	}
	lines := func() []string { return logs.matching("shadow decision") }
	for i := 0; i < 4; i++ {
		differing("shadow-log")
	}
	// Both sides agree here (attempt 3: retryd's limit is 3, the local
	// rule's 2): neither counted nor logged.
	agreed, err := client.Decide(ctx, &pb.DecideRequest{Upstream: "shadow-log", Idempotency: pb.Idempotency_IDEMPOTENCY_SAFE, Attempt: 3, HttpStatus: 503})
	if err != nil || !agreed.Shadow || agreed.Retryd == nil || agreed.DenyReason != pb.DenyReason_DENY_REASON_MAX_ATTEMPTS || agreed.Retryd.DenyReason != agreed.DenyReason {
		t.Fatalf("%+v, %v", agreed, err)
	}
	if got := lines(); len(got) != 1 ||
		!strings.Contains(got[0], `"shadow-log"`) ||
		!strings.Contains(got[0], "retryd DENY BUDGET_EXHAUSTED, local rule RETRY (acted on); 0 more") {
		t.Fatalf("log lines %q", got)
	}
	if got := client.ShadowDivergences(); !reflect.DeepEqual(got, map[string]uint64{"shadow-log": 4}) {
		t.Fatalf("divergences %v", got)
	}

	// Another upstream has its own interval.
	differing("shadow-log-other")
	if got := lines(); len(got) != 2 || !strings.Contains(got[1], `"shadow-log-other"`) {
		t.Fatalf("log lines %q", got)
	}

	// Once the interval has passed (the clock moved on, not slept), the
	// next difference is logged with the three that were not.
	client.shadow.mu.Lock()
	client.shadow.now = func() time.Time { return time.Now().Add(time.Hour) }
	client.shadow.mu.Unlock()
	differing("shadow-log")
	if got := lines(); len(got) != 3 || !strings.Contains(got[2], `"shadow-log"`) || !strings.Contains(got[2], "; 3 more difference(s)") {
		t.Fatalf("log lines %q", got)
	}
	if got := client.ShadowDivergences(); !reflect.DeepEqual(got, map[string]uint64{"shadow-log": 5, "shadow-log-other": 1}) {
		t.Fatalf("divergences %v", got)
	}
}

func TestANegativeShadowLogIntervalIsRefused(t *testing.T) {
	if _, err := New("127.0.0.1:1", Options{ShadowLogInterval: -time.Second}); err == nil || !strings.Contains(err.Error(), "ShadowLogInterval") {
		t.Fatalf("got %v", err)
	}
}
