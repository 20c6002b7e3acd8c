package retryd

import (
	"context"
	"encoding/json"
	"os"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// hedgingVectorsPath is the hedge decisions' conformance file (issue 33).
const hedgingVectorsPath = "../../conformance/hedging.json"

type hedgingVectorFile struct {
	Config           string            `json:"config"`
	DisableUpstreams []string          `json:"disable_upstreams"`
	Reports          []json.RawMessage `json:"reports"`
	Cases            []vector          `json:"cases"`
}

// hedgeFailureFields are the request fields a HedgeRequest cannot carry: a
// hedge is asked while nothing has failed. The cases that set one are
// retryd's own validation, run by the server's suite.
var hedgeFailureFields = []string{"evidence", "failure", "httpStatus", "retryAfter"}

// hedgeCases splits the file's cases into those DecideHedge can ask and the
// names of those it cannot.
func hedgeCases(t *testing.T, cases []vector) (asked []vector, leftOut []string) {
	t.Helper()
	for _, c := range cases {
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(c.Request, &fields); err != nil {
			t.Fatalf("%s: request is not an object: %v", c.Name, err)
		}
		failing := false
		for _, name := range hedgeFailureFields {
			if _, ok := fields[name]; ok {
				failing = true
			}
		}
		if failing {
			leftOut = append(leftOut, c.Name)
		} else {
			asked = append(asked, c)
		}
	}
	return asked, leftOut
}

// hedgeRequestOf is the case's request as a HedgeRequest, and fails the test
// if any field of the case would not reach retryd through it.
func hedgeRequestOf(t *testing.T, c vector) HedgeRequest {
	t.Helper()
	req := vectorRequest(t, c)
	h := HedgeRequest{
		Upstream: req.GetUpstream(), Operation: req.GetOperation(), Idempotency: req.GetIdempotency(),
		Body: req.GetBody(), Hedge: req.GetHedge(), Attempt: req.GetAttempt(),
		MaxAttempts: req.GetMaxAttempts(), Lineage: req.GetLineage(),
	}
	if req.DeadlineRemaining != nil {
		h.Deadline = time.Now().Add(req.DeadlineRemaining.AsDuration())
	}
	// Every field but the deadline (sent as what remains of it) must pass
	// through as written.
	sent := h.decideRequest()
	if (sent.DeadlineRemaining != nil) != (req.DeadlineRemaining != nil) {
		t.Fatalf("%s: deadline_remaining sent %v, case %v", c.Name, sent.DeadlineRemaining, req.DeadlineRemaining)
	}
	sent.DeadlineRemaining, req.DeadlineRemaining = nil, nil
	if !proto.Equal(sent, req) {
		t.Fatalf("%s: DecideHedge would send %v, the case is %v", c.Name, sent, req)
	}
	return h
}

// TestHedgingConformance runs conformance/hedging.json through
// Client.DecideHedge against a real retryd: the vectors' reports go through
// Client.ReportTraffic (whose answers fill the client's hedging table), then
// every case without failure fields is asked as the adapters ask a hedge.
func TestHedgingConformance(t *testing.T) {
	data, err := os.ReadFile(hedgingVectorsPath)
	if err != nil {
		t.Fatalf("reading the hedging vectors: %v", err)
	}
	var file hedgingVectorFile
	if err := json.Unmarshal(data, &file); err != nil {
		t.Fatalf("parsing %s: %v", hedgingVectorsPath, err)
	}
	cases, leftOut := hedgeCases(t, file.Cases)
	wantLeftOut := []string{"hedge-with-evidence", "hedge-with-status", "hedge-with-failure", "hedge-with-retry-after"}
	if len(leftOut) != len(wantLeftOut) {
		t.Fatalf("left out %v, want exactly %v", leftOut, wantLeftOut)
	}
	for i := range leftOut {
		if leftOut[i] != wantLeftOut[i] {
			t.Fatalf("left out %v, want exactly %v", leftOut, wantLeftOut)
		}
	}
	if len(cases) < 15 || len(file.Reports) == 0 {
		t.Fatalf("only %d hedge cases and %d reports", len(cases), len(file.Reports))
	}

	server := startRetryd(t, file.Config, "")
	// No fallback: a broken or missing server must fail these tests.
	client := newClient(t, server.grpc, Options{Timeout: 5 * time.Second, NoFallback: true})
	ctx := context.Background()
	for _, upstream := range file.DisableUpstreams {
		if _, err := client.SetRetriesEnabled(ctx, upstream, false, "hedging conformance vectors"); err != nil {
			t.Fatalf("disabling %s: %v", upstream, err)
		}
	}
	for i, raw := range file.Reports {
		report := &pb.ReportTrafficRequest{}
		if err := protojson.Unmarshal(raw, report); err != nil {
			t.Fatalf("report %d is not a ReportTrafficRequest in proto3 JSON: %v", i, err)
		}
		response, err := client.ReportTraffic(ctx, report)
		if err != nil {
			t.Fatalf("report %d: %v", i, err)
		}
		if response.GetAccepted() != uint32(len(report.GetTraffic())) {
			t.Fatalf("report %d: %d of %d entries accepted", i, response.GetAccepted(), len(report.GetTraffic()))
		}
	}
	// The reports' answers filled the client's hedging table.
	if h, ok := client.Hedging("hedge-tail"); !ok || !h.allows(pb.Idempotency_IDEMPOTENCY_IDEMPOTENT) {
		t.Fatalf("hedge-tail: hedging %+v (known %v), want it served and allowing IDEMPOTENT", h, ok)
	}
	if h, ok := client.Hedging("hedge-slow"); !ok || h.allows(pb.Idempotency_IDEMPOTENCY_SAFE) {
		t.Fatalf("hedge-slow: hedging %+v (known %v), want it served and off (uniformly slow)", h, ok)
	}

	for _, c := range cases {
		c := c
		t.Run(c.Name, func(t *testing.T) {
			d, err := client.DecideHedge(ctx, hedgeRequestOf(t, c))
			checkVector(t, c, d, err)
		})
	}
}

// TestDecideHedgeRefusesHedgeZero: a failed attempt is not a hedge; the call
// is refused before retryd is asked (the client points at a closed port).
func TestDecideHedgeRefusesHedgeZero(t *testing.T) {
	client := newClient(t, closedAddr(t), Options{NoFallback: true, ConnectTimeout: -1})
	_, err := client.DecideHedge(context.Background(), HedgeRequest{
		Upstream: "hedge-tail", Idempotency: pb.Idempotency_IDEMPOTENCY_SAFE, Attempt: 1,
	})
	invalid, ok := err.(*InvalidRequestError)
	if !ok || invalid.Field != "hedge" {
		t.Fatalf("want an InvalidRequestError naming hedge, got %v", err)
	}
}

// TestDecideHedgeWithRetrydDown: with retryd unreachable the local hedge rule
// answers DecideHedge (DENY HEDGING_OFF without LocalPolicy.HedgeDelay; a
// RETRY with one, once first attempts have earned a token), and with
// NoFallback it is an *UnavailableError.
func TestDecideHedgeWithRetrydDown(t *testing.T) {
	addr := closedAddr(t)
	ctx := context.Background()
	hedge := HedgeRequest{Upstream: "hedge-down", Idempotency: pb.Idempotency_IDEMPOTENCY_IDEMPOTENT, Hedge: 1}

	strict := newClient(t, addr, Options{NoFallback: true})
	if _, err := strict.DecideHedge(ctx, hedge); err == nil {
		t.Fatal("want an *UnavailableError, got a decision")
	} else if _, ok := err.(*UnavailableError); !ok {
		t.Fatalf("want an *UnavailableError, got %T %v", err, err)
	}

	byDefault := newClient(t, addr, Options{})
	d, err := byDefault.DecideHedge(ctx, hedge)
	if err != nil || !d.Fallback || d.Verdict != pb.Verdict_VERDICT_DENY || d.DenyReason != pb.DenyReason_DENY_REASON_HEDGING_OFF {
		t.Fatalf("want a fallback DENY HEDGING_OFF, got %+v, %v", d, err)
	}

	policy := DefaultLocalPolicy
	policy.HedgeDelay = 50 * time.Millisecond
	local := newClient(t, addr, Options{LocalPolicy: &policy})
	if d, err := local.DecideHedge(ctx, hedge); err != nil || !d.Fallback || d.DenyReason != pb.DenyReason_DENY_REASON_HEDGE_CAP {
		t.Fatalf("with no token earned: want a fallback DENY HEDGE_CAP, got %+v, %v", d, err)
	}
	for i := 0; i < 25; i++ { // 25 first attempts at 0.05 each: a token (and some)
		local.firstAttemptSent(hedge.Upstream)
	}
	if d, err := local.DecideHedge(ctx, hedge); err != nil || !d.Fallback || !d.ShouldRetry() || d.Backoff != 0 {
		t.Fatalf("with a token: want a fallback RETRY now, got %+v, %v", d, err)
	}
	hedge.Deadline = time.Now().Add(10 * time.Millisecond)
	for i := 0; i < 25; i++ {
		local.firstAttemptSent(hedge.Upstream)
	}
	if d, err := local.DecideHedge(ctx, hedge); err != nil || d.DenyReason != pb.DenyReason_DENY_REASON_DEADLINE {
		t.Fatalf("10ms left: want a fallback DENY DEADLINE, got %+v, %v", d, err)
	}
}
