package retryd

import (
	"context"
	"errors"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Issue 38: a non-idempotent call that the caller's own deadline ends after
// it was sent is of unknown outcome, decided locally. The clients here point
// at a port nothing listens on, with NoFallback: had they asked retryd, the
// call would fail with an UnavailableError instead.

func TestHungPaymentIntoTheCallersDeadlineIsAmbiguous(t *testing.T) {
	url, applied := heldServer(t)
	client := newClient(t, closedAddr(t), Options{NoFallback: true})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	resp, err := post(t, ctx, testTransport(t, client), url+"/charges", `{"amount": 1}`)
	e := wantAmbiguous(t, resp, err)
	if !errors.Is(err, context.DeadlineExceeded) || e.DenyReason() != pb.DenyReason_DENY_REASON_DEADLINE {
		t.Fatalf("err %v, decision %+v", err, e.Decision)
	}
	if e.Decision.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_RECONCILE || e.Decision.DecisionID != "" || e.Attempts != 1 || applied() != 1 {
		t.Fatalf("decision %+v, attempts %d, applied %d", e.Decision, e.Attempts, applied())
	}
}

func TestHungSafeCallIntoTheCallersDeadlineIsAPlainFailure(t *testing.T) {
	url, _ := heldServer(t)
	client := newClient(t, closedAddr(t), Options{NoFallback: true})
	ctx, cancel := context.WithTimeout(safe(context.Background()), 300*time.Millisecond)
	defer cancel()
	resp, err := get(t, ctx, testTransport(t, client), url)
	if e := wantError(t, resp, err); !errors.Is(err, context.DeadlineExceeded) || len(e.Decisions) != 0 {
		t.Fatalf("err %v, decisions %+v", err, e.Decisions)
	}
}

func TestGRPCHungPaymentIntoTheCallersDeadlineIsAmbiguous(t *testing.T) {
	never := make(chan struct{})
	server, addr := startUpstream(t, func(ctx context.Context, n int64) error {
		<-never
		return nil
	})
	t.Cleanup(func() { close(never) }) // runs before the server's Stop
	client := newClient(t, closedAddr(t), Options{NoFallback: true})
	upstream := dialUpstream(t, addr, client, InterceptorOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err := check(ctx, upstream)
	var e *AmbiguousError
	if !errors.As(err, &e) || status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("want *AmbiguousError with DEADLINE_EXCEEDED, got %v", err)
	}
	if e.DenyReason() != pb.DenyReason_DENY_REASON_DEADLINE || e.Decision.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_RECONCILE || server.calls.Load() != 1 {
		t.Fatalf("decision %+v, calls %d", e.Decision, server.calls.Load())
	}
}
