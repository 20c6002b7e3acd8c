package retryd

import (
	"context"
	"net/http"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// hedgeCall is what the Transport's hedges of one call share.
type hedgeCall struct {
	upstream       string
	operation      string
	idempotency    pb.Idempotency
	body           *pb.Body
	maxAttempts    uint32
	lineage        string
	baggage        []string
	errorBodyLimit int64
}

// hedgeRequest is the DecideHedge of hedge k with sent copies sent, the
// call's deadline being ctx's.
func (call hedgeCall) hedgeRequest(ctx context.Context, k, sent int) HedgeRequest {
	deadline, _ := ctx.Deadline()
	return HedgeRequest{
		Upstream: call.upstream, Operation: call.operation, Idempotency: call.idempotency,
		Body: call.body, Hedge: uint32(k), Attempt: uint32(sent),
		MaxAttempts: call.maxAttempts, Lineage: call.lineage, Deadline: deadline,
	}
}

// httpCopy is how one copy of a request ended (see Transport.attempt).
type httpCopy struct {
	resp   *http.Response
	failed *failure
	err    error
}

// hedgedHTTP is the first attempt of a hedged call as the retry loop sees
// it: the winning copy (or the last failure), the copies sent and the hedge
// decisions made.
type hedgedHTTP struct {
	httpCopy
	sent      int
	decisions []Decision
}

// hedgeFirst sends req's first attempt and, while it is slower than the
// plan's delay, hedges as retryd (or the local rule) allows (see
// runHedged). A loser is cancelled, which aborts its request (net/http
// closes the stream or the connection): the upstream sees it go. The
// winner's body, when closed, releases its context.
func (t *Transport) hedgeFirst(ctx, decideCtx context.Context, req *http.Request, plan hedgePlan, call hedgeCall) hedgedHTTP {
	send := func(copyCtx context.Context, copy int) (httpCopy, bool) {
		sent := req
		if copy > 0 {
			replay, err := nextRequest(req, copyCtx)
			if err != nil {
				// GetBody failed: nothing was sent.
				return httpCopy{failed: &failure{outcome: outcome{evidence: pb.Evidence_EVIDENCE_NOT_SENT, failure: pb.FailureKind_FAILURE_KIND_REQUEST_ENCODING}}, err: err}, false
			}
			sent = replay
		}
		member := withLineageMember(call.baggage, outboundLineage(call.lineage, t.Client.Layer(), copy+1))
		resp, failed, err := t.attempt(copyCtx, sent, member, call.errorBodyLimit)
		return httpCopy{resp: resp, failed: failed, err: err}, err == nil && failed == nil
	}
	decide := func(k, sent int) (Decision, error) {
		return t.Client.DecideHedge(decideCtx, call.hedgeRequest(ctx, k, sent))
	}
	record := func(r copyResult[httpCopy]) {
		if !t.DisableReporting {
			t.Client.recordAttempt(ctx, call.upstream, r.copy+1, r.done, r.elapsed)
		}
	}
	cancelledFirst := func(elapsed time.Duration) {
		if !t.DisableReporting && ctx.Err() == nil {
			t.Client.Reporter().RecordLatency(call.upstream, true, elapsed)
		}
	}
	discard := func(c httpCopy) { closeResponse(c.resp) }
	out := runHedged(ctx, plan, send, decide, record, cancelledFirst, discard)
	if !t.DisableReporting {
		t.Client.recordHedgeWon(ctx, call.upstream, out.won())
	}
	result := out.result
	if result.resp != nil {
		result.resp.Body = cancelOnClose{ReadCloser: result.resp.Body, cancel: out.cancel}
	} else {
		out.cancel()
	}
	return hedgedHTTP{httpCopy: result, sent: out.sent, decisions: out.decisions}
}
