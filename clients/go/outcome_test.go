package retryd

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Issue 36: a denied retry never hides that the call may have happened.

// heldServer applies (counts) every request, then holds its response until
// the client gives up on it.
func heldServer(t *testing.T) (url string, applied func() int64) {
	release := make(chan struct{})
	server, n := counted(t, func(_ int64, w http.ResponseWriter, r *http.Request) {
		// Reading the body to its end is what makes net/http watch the
		// connection, so that the client's close ends r.Context().
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	t.Cleanup(func() { close(release) }) // runs before the server's Close
	return server.URL, n.Load
}

func TestDeniedPaymentAfterATimeoutIsAmbiguousWithItsReason(t *testing.T) {
	url, applied := heldServer(t)
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	transport.Upstream = "go-nobudget"
	transport.AttemptTimeout = 150 * time.Millisecond

	resp, err := post(t, context.Background(), transport, url+"/charges", `{"amount": 1}`)
	e := wantAmbiguous(t, resp, err)
	if e.DenyReason() != pb.DenyReason_DENY_REASON_BUDGET_EXHAUSTED || e.Decision.Verdict != pb.Verdict_VERDICT_DENY {
		t.Fatalf("decision %+v", e.Decision)
	}
	if e.Decision.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_RECONCILE || e.ResendWithSameKey() {
		t.Fatalf("mark %s, resend %v", e.Decision.UnknownOutcome, e.ResendWithSameKey())
	}
	if !strings.Contains(e.Error(), "DENY BUDGET_EXHAUSTED") || !strings.Contains(e.Error(), "reconcile") {
		t.Fatalf("message %q", e.Error())
	}
	if e.Attempts != 1 || applied() != 1 {
		t.Fatalf("attempts %d, applied %d", e.Attempts, applied())
	}
}

func TestDeniedKeyedCallAfterATimeoutSaysResendWithTheSameKey(t *testing.T) {
	url, applied := heldServer(t)
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	transport.Upstream = "go-nobudget"
	transport.AttemptTimeout = 150 * time.Millisecond

	req, err := http.NewRequest(http.MethodPost, url+"/charges", strings.NewReader(`{"amount": 1}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", "charge-7")
	resp, err := transport.RoundTrip(req)
	e := wantAmbiguous(t, resp, err)
	if e.DenyReason() != pb.DenyReason_DENY_REASON_BUDGET_EXHAUSTED || !e.ResendWithSameKey() {
		t.Fatalf("decision %+v", e.Decision)
	}
	if !strings.Contains(e.Error(), "same idempotency key") || applied() != 1 {
		t.Fatalf("message %q, applied %d", e.Error(), applied())
	}
}

func TestDeniedSafeCallAfterATimeoutIsAPlainFailure(t *testing.T) {
	url, applied := heldServer(t)
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	transport.Upstream = "go-nobudget"
	transport.AttemptTimeout = 150 * time.Millisecond

	resp, err := get(t, safe(context.Background()), transport, url)
	e := wantError(t, resp, err)
	if last := e.Decisions[len(e.Decisions)-1]; last.DenyReason != pb.DenyReason_DENY_REASON_BUDGET_EXHAUSTED || last.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE {
		t.Fatalf("decision %+v", last)
	}
	if applied() != 1 {
		t.Fatalf("applied %d", applied())
	}
}

func TestGRPCDeniedPaymentAfterATimeoutIsAmbiguous(t *testing.T) {
	never := make(chan struct{})
	server, addr := startUpstream(t, func(ctx context.Context, n int64) error {
		<-never
		return nil
	})
	t.Cleanup(func() { close(never) }) // runs before the server's Stop
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	upstream := dialUpstream(t, addr, client, InterceptorOptions{Upstream: "go-nobudget", AttemptTimeout: 150 * time.Millisecond})

	err := check(context.Background(), upstream)
	var e *AmbiguousError
	if !errors.As(err, &e) {
		t.Fatalf("want *AmbiguousError, got %v", err)
	}
	if e.DenyReason() != pb.DenyReason_DENY_REASON_BUDGET_EXHAUSTED || e.Decision.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_RECONCILE {
		t.Fatalf("decision %+v", e.Decision)
	}
	if status.Code(err) != codes.DeadlineExceeded || e.Attempts != 1 || server.calls.Load() != 1 {
		t.Fatalf("code %s, attempts %d, calls %d", status.Code(err), e.Attempts, server.calls.Load())
	}
}

func TestLocalRuleMarksWhatMayHaveHappened(t *testing.T) {
	base := func(idempotency pb.Idempotency) *pb.DecideRequest {
		return &pb.DecideRequest{Upstream: "x", Idempotency: idempotency, Attempt: 2, Evidence: pb.Evidence_EVIDENCE_SENT_NO_RESPONSE,
			Failure: pb.FailureKind_FAILURE_KIND_RESPONSE_HEADER_TIMEOUT}
	}
	// Attempt 2 is the local limit: DENY MAX_ATTEMPTS, and still marked.
	for idempotency, want := range map[pb.Idempotency]pb.UnknownOutcome{
		pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT:      pb.UnknownOutcome_UNKNOWN_OUTCOME_RECONCILE,
		pb.Idempotency_IDEMPOTENCY_IDEMPOTENT_WITH_KEY: pb.UnknownOutcome_UNKNOWN_OUTCOME_RESEND_WITH_KEY,
		pb.Idempotency_IDEMPOTENCY_SAFE:                pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE,
	} {
		d := LocalDecide(DefaultLocalPolicy, base(idempotency), "test")
		if d.DenyReason != pb.DenyReason_DENY_REASON_MAX_ATTEMPTS || d.UnknownOutcome != want {
			t.Errorf("%s: %+v", idempotency, d)
		}
		if d.OutcomeUnknown() != (want != pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE) {
			t.Errorf("%s: OutcomeUnknown %v", idempotency, d.OutcomeUnknown())
		}
	}
	notSent := base(pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT)
	notSent.Evidence, notSent.Failure = pb.Evidence_EVIDENCE_NOT_SENT, pb.FailureKind_FAILURE_KIND_CONNECT
	if d := LocalDecide(DefaultLocalPolicy, notSent, "test"); d.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE {
		t.Errorf("a proven NOT_SENT is marked: %+v", d)
	}
}

// A keyed call whose first attempt timed out (it may have happened) and
// whose retries never left is still of unknown outcome: the caller must
// re-send with the same key, not treat it as failed and use a new one.
func TestKeyedCallRetriedAfterATimeoutIntoRefusalsIsStillUnknown(t *testing.T) {
	var listener atomic.Pointer[httptest.Server] // set before any request
	release := make(chan struct{})
	server, applied := counted(t, func(_ int64, w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		listener.Load().Listener.Close() // every retry is refused: provably not sent
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	listener.Store(server)
	t.Cleanup(func() { close(release) })
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	transport.AttemptTimeout = 150 * time.Millisecond

	req, err := http.NewRequest(http.MethodPost, server.URL+"/charges", strings.NewReader(`{"amount": 1}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", "charge-9")
	resp, err := transport.RoundTrip(req)
	e := wantAmbiguous(t, resp, err)
	if !e.ResendWithSameKey() || e.DenyReason() != pb.DenyReason_DENY_REASON_MAX_ATTEMPTS || e.Attempts != 3 || applied.Load() != 1 {
		t.Fatalf("resend %v, decision %+v, attempts %d, applied %d", e.ResendWithSameKey(), e.Decision, e.Attempts, applied.Load())
	}
	if first := e.Decisions[0]; !first.ShouldRetry() || first.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_RESEND_WITH_KEY {
		t.Fatalf("first decision %+v", first)
	}
}
