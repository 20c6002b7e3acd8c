package retryd

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/protobuf/encoding/protojson"
)

// vectorsPath is the language-neutral conformance file, read from the
// repository at test time.
const vectorsPath = "../../conformance/decisions.json"

type vectorFile struct {
	Config           string   `json:"config"`
	DisableUpstreams []string `json:"disable_upstreams"`
	Cases            []vector `json:"cases"`
}

type vector struct {
	Name    string          `json:"name"`
	Request json.RawMessage `json:"request"`
	Expect  *struct {
		Verdict            string   `json:"verdict"`
		DenyReason         string   `json:"deny_reason"`
		Rule               uint32   `json:"rule"`
		EffectiveEvidence  string   `json:"effective_evidence"`
		EvidenceAdjusted   *bool    `json:"evidence_adjusted"`
		RefreshCredentials *bool    `json:"refresh_credentials"`
		BackoffMinMs       *float64 `json:"backoff_min_ms"`
		BackoffMaxMs       *float64 `json:"backoff_max_ms"`
		UnknownOutcome     string   `json:"unknown_outcome"`
	} `json:"expect"`
	ExpectError *struct {
		Code  string `json:"code"`
		Field string `json:"field"`
	} `json:"expect_error"`
}

func loadVectors(t *testing.T) vectorFile {
	t.Helper()
	data, err := os.ReadFile(vectorsPath)
	if err != nil {
		t.Fatalf("reading the conformance vectors: %v", err)
	}
	var file vectorFile
	if err := json.Unmarshal(data, &file); err != nil {
		t.Fatalf("parsing %s: %v", vectorsPath, err)
	}
	if len(file.Cases) < 60 {
		t.Fatalf("only %d conformance cases", len(file.Cases))
	}
	return file
}

// vectorRequest is the case's DecideRequest, read with the proto3 JSON
// mapping: every field passes through as written, including ones this test
// never names (grpcStatusCode, grpcRetryPushbackMs, whose presence matters,
// and whatever the contract adds next).
func vectorRequest(t *testing.T, c vector) *pb.DecideRequest {
	t.Helper()
	req := &pb.DecideRequest{}
	if err := protojson.Unmarshal(c.Request, req); err != nil {
		t.Fatalf("%s: the request is not a DecideRequest in proto3 JSON: %v", c.Name, err)
	}
	return req
}

func checkVector(t *testing.T, c vector, d Decision, err error) {
	t.Helper()
	if c.ExpectError != nil {
		if c.ExpectError.Code != "INVALID_ARGUMENT" {
			t.Fatalf("unexpected expect_error code %s", c.ExpectError.Code)
		}
		invalid, ok := err.(*InvalidRequestError)
		if !ok {
			t.Fatalf("want INVALID_ARGUMENT naming %s, got %+v, %v", c.ExpectError.Field, d, err)
		}
		if !strings.HasPrefix(invalid.Message, c.ExpectError.Field) {
			t.Fatalf("message %q does not start with %q", invalid.Message, c.ExpectError.Field)
		}
		return
	}
	if err != nil {
		t.Fatalf("unexpected error: %v", err)
	}
	want := c.Expect
	if got := d.Verdict.String(); got != want.Verdict {
		t.Errorf("verdict %s, want %s (%s)", got, want.Verdict, d.Explanation)
	}
	wantDeny := want.DenyReason
	if wantDeny == "" {
		wantDeny = pb.DenyReason_DENY_REASON_UNSPECIFIED.String()
	}
	if got := d.DenyReason.String(); got != wantDeny {
		t.Errorf("deny_reason %s, want %s (%s)", got, wantDeny, d.Explanation)
	}
	if d.Rule != want.Rule {
		t.Errorf("rule %d, want %d (%s)", d.Rule, want.Rule, d.Explanation)
	}
	if got := d.EffectiveEvidence.String(); got != want.EffectiveEvidence {
		t.Errorf("effective_evidence %s, want %s", got, want.EffectiveEvidence)
	}
	if want.EvidenceAdjusted != nil && d.EvidenceAdjusted != *want.EvidenceAdjusted {
		t.Errorf("evidence_adjusted %v, want %v", d.EvidenceAdjusted, *want.EvidenceAdjusted)
	}
	if want.RefreshCredentials != nil && d.RefreshCredentials != *want.RefreshCredentials {
		t.Errorf("refresh_credentials %v, want %v", d.RefreshCredentials, *want.RefreshCredentials)
	}
	if got := d.UnknownOutcome.String(); got != want.UnknownOutcome {
		t.Errorf("unknown_outcome %s, want %s (%s)", got, want.UnknownOutcome, d.Explanation)
	}
	// The adapters surface a decision through OutcomeUnknown: a DENY with
	// a mark must be the ambiguous-execution error, never a plain failure.
	marked := want.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE.String()
	if wantAmbiguous := want.Verdict == "VERDICT_AMBIGUOUS" || (want.Verdict == "VERDICT_DENY" && marked); d.OutcomeUnknown() != wantAmbiguous {
		t.Errorf("OutcomeUnknown %v, want %v", d.OutcomeUnknown(), wantAmbiguous)
	}
	if d.Fallback {
		t.Errorf("a fallback decision: %s", d.Explanation)
	}
	if d.DecisionID == "" {
		t.Errorf("no decision_id")
	}
	backoffMs := float64(d.Backoff) / float64(time.Millisecond)
	if d.ShouldRetry() {
		if want.BackoffMinMs != nil && backoffMs < *want.BackoffMinMs-1e-6 {
			t.Errorf("backoff %.3fms below %.3fms", backoffMs, *want.BackoffMinMs)
		}
		if want.BackoffMaxMs != nil && backoffMs > *want.BackoffMaxMs+1e-6 {
			t.Errorf("backoff %.3fms above %.3fms", backoffMs, *want.BackoffMaxMs)
		}
	} else if backoffMs != 0 || math.IsNaN(backoffMs) {
		t.Errorf("backoff %v on a %s", d.Backoff, d.Verdict)
	}
}

// TestConformance runs every vector through Client.Decide and through one
// DecideStream against a real retryd started with the vectors' config.
func TestConformance(t *testing.T) {
	file := loadVectors(t)
	server := startRetryd(t, file.Config, "")
	// No fallback: a broken or missing server must fail these tests.
	client := newClient(t, server.grpc, Options{Timeout: 5 * time.Second, NoFallback: true})
	ctx := context.Background()
	for _, upstream := range file.DisableUpstreams {
		if _, err := client.SetRetriesEnabled(ctx, upstream, false, "conformance vectors"); err != nil {
			t.Fatalf("disabling %s: %v", upstream, err)
		}
	}
	names := map[string]bool{}
	for _, c := range file.Cases {
		if names[c.Name] {
			t.Fatalf("duplicate case name %s", c.Name)
		}
		names[c.Name] = true
	}

	t.Run("unary", func(t *testing.T) {
		for _, c := range file.Cases {
			c := c
			t.Run(c.Name, func(t *testing.T) {
				d, err := client.Decide(ctx, vectorRequest(t, c))
				checkVector(t, c, d, err)
			})
		}
	})
	t.Run("stream", func(t *testing.T) {
		stream := client.DecideStream(ctx)
		defer stream.Close()
		for _, c := range file.Cases {
			c := c
			t.Run(c.Name, func(t *testing.T) {
				d, err := stream.Decide(vectorRequest(t, c))
				checkVector(t, c, d, err)
			})
		}
		if stream.opened != 1 || stream.stream == nil {
			t.Fatalf("%d streams opened: every case must go over one DecideStream", stream.opened)
		}
	})
}

// TestEffectiveEvidenceAgreesWithEveryVector checks the local rule's
// evidence weakening and unknown-outcome mark against retryd's, case by case.
func TestEffectiveEvidenceAgreesWithEveryVector(t *testing.T) {
	for _, c := range loadVectors(t).Cases {
		if c.Expect == nil {
			continue
		}
		req := vectorRequest(t, c)
		effective := EffectiveEvidence(req)
		if effective.String() != c.Expect.EffectiveEvidence {
			t.Errorf("%s: local %s, retryd %s", c.Name, effective, c.Expect.EffectiveEvidence)
		}
		// The local rule's mark has the engine's definition: it must agree
		// on every case, whichever rule decides.
		if got := unknownOutcome(req, effective); got.String() != c.Expect.UnknownOutcome {
			t.Errorf("%s: local unknown_outcome %s, retryd %s", c.Name, got, c.Expect.UnknownOutcome)
		}
	}
}
