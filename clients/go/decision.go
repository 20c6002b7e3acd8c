package retryd

import (
	"context"
	"errors"
	"math"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// Decision is the decision for one failed attempt: what the client acts
// on. It is retryd's answer, or the local rule's when Fallback is true
// (retryd could not answer) or Shadow is true (retryd answered for an
// upstream in shadow mode).
type Decision struct {
	// Verdict is RETRY, DENY or AMBIGUOUS.
	Verdict pb.Verdict
	// Backoff is how long to wait before the next attempt (RETRY only).
	Backoff time.Duration
	// DenyReason says why (DENY only).
	DenyReason pb.DenyReason
	// RefreshCredentials asks for fresh credentials before the replay (a
	// RETRY after a 401 or UNAUTHENTICATED).
	RefreshCredentials bool
	// Rule is the step of the decision order that decided, 1 to 9.
	Rule uint32
	// EffectiveEvidence is the evidence retryd used, after weakening the
	// claim to what the failure proves.
	EffectiveEvidence pb.Evidence
	// EvidenceAdjusted says whether EffectiveEvidence is weaker than the claim.
	EvidenceAdjusted bool
	// DecisionID identifies the decision on retryd's audit span ("" for a
	// fallback decision).
	DecisionID string
	// TokensRemaining is the upstream's budget after the decision (NaN for a
	// fallback decision).
	TokensRemaining float64
	// Explanation is one line for humans.
	Explanation string
	// Fallback is true when retryd could not answer and the local rule
	// decided.
	Fallback bool
	// UnknownOutcome says whether the attempt may have taken effect
	// upstream, whatever the verdict (retryd computes it whichever rule
	// decided; the local rule computes it the same way). RECONCILE (a
	// NON_IDEMPOTENT call) or RESEND_WITH_KEY (IDEMPOTENT_WITH_KEY) on a
	// DENY means the denial is not a plain failure: the Transport and the
	// interceptor then return an *AmbiguousError carrying DenyReason.
	UnknownOutcome pb.UnknownOutcome
	// Shadow is true when retryd answered for an upstream in shadow mode
	// (enforce = false in its policy): retryd's decision is not enforced,
	// so this decision is the client's own local rule (the one it falls
	// back to, with Options.LocalPolicy), and the Transport and the
	// interceptor act on it. Then Retryd is retryd's shadow decision,
	// DecisionID is retryd's (its audit span), TokensRemaining is NaN and
	// Fallback is false.
	Shadow bool
	// Retryd is, for a shadow answer, retryd's own decision as it answered
	// (its Shadow true, its TokensRemaining the shadow budget's): what
	// retryd would have enforced. Nil otherwise.
	Retryd *Decision
}

// ShouldRetry reports whether the verdict is RETRY.
func (d Decision) ShouldRetry() bool { return d.Verdict == pb.Verdict_VERDICT_RETRY }

// IsAmbiguous reports whether the verdict is AMBIGUOUS.
func (d Decision) IsAmbiguous() bool { return d.Verdict == pb.Verdict_VERDICT_AMBIGUOUS }

// OutcomeUnknown reports whether the attempt may have taken effect upstream
// and no further attempt is allowed: an AMBIGUOUS verdict, or a DENY
// carrying an unknown-outcome mark. Such a call is never a plain failure.
func (d Decision) OutcomeUnknown() bool {
	return d.IsAmbiguous() || (!d.ShouldRetry() && d.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE)
}

func decisionOf(response *pb.DecideResponse) Decision {
	return Decision{
		Verdict:            response.GetVerdict(),
		Backoff:            response.GetBackoff().AsDuration(),
		DenyReason:         response.GetDenyReason(),
		RefreshCredentials: response.GetRefreshCredentials(),
		Rule:               response.GetRule(),
		EffectiveEvidence:  response.GetEffectiveEvidence(),
		EvidenceAdjusted:   response.GetEvidenceAdjusted(),
		DecisionID:         response.GetDecisionId(),
		TokensRemaining:    response.GetTokensRemaining(),
		Explanation:        response.GetExplanation(),
		UnknownOutcome:     response.GetUnknownOutcome(),
		Shadow:             response.GetShadow(),
	}
}

func verdictName(d Decision) string {
	return strings.TrimPrefix(d.Verdict.String(), "VERDICT_")
}

var nan = math.NaN()

// setTiming fills in what retryd needs to know of time: the deadline left
// on ctx (none if it has none; zero once it has passed) and the backoff
// waited before this attempt, if any. The Transport and the interceptor
// report both alike.
func setTiming(ctx context.Context, req *pb.DecideRequest, previousBackoff time.Duration) {
	if deadline, ok := ctx.Deadline(); ok {
		req.DeadlineRemaining = remainingUntil(deadline)
	}
	if previousBackoff > 0 {
		req.PreviousBackoff = durationpb.New(previousBackoff)
	}
}

// remainingUntil is the time left before deadline, as deadline_remaining
// (zero once it has passed).
func remainingUntil(deadline time.Time) *durationpb.Duration {
	remaining := time.Until(deadline)
	if remaining < 0 {
		remaining = 0
	}
	return durationpb.New(remaining)
}

// endedByCaller is the decision for a failed attempt when the caller's own
// context ended it (its deadline, or a cancellation) after the request may
// have been sent: made here, without retryd, since there is no time left to
// ask and nothing left to retry. A call of unknown outcome (req's mark, as
// the local rule computes it) gets a DENY carrying that mark, which the
// adapters surface as *AmbiguousError; ok is false for any other call,
// which is a plain failure.
func endedByCaller(ctx context.Context, req *pb.DecideRequest) (d Decision, ok bool) {
	effective := EffectiveEvidence(req)
	mark := unknownOutcome(req, effective)
	if mark == pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE {
		return Decision{}, false
	}
	reason, why := pb.DenyReason_DENY_REASON_UNSPECIFIED, "was cancelled"
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		reason, why = pb.DenyReason_DENY_REASON_DEADLINE, "deadline expired"
	}
	return Decision{
		Verdict:           pb.Verdict_VERDICT_DENY,
		DenyReason:        reason,
		Rule:              6,
		EffectiveEvidence: effective,
		EvidenceAdjusted:  req.GetEvidence() != pb.Evidence_EVIDENCE_UNSPECIFIED && effective != req.GetEvidence(),
		TokensRemaining:   nan,
		UnknownOutcome:    mark,
		Explanation:       "the caller's context " + why + " after the request may have been sent (decided locally, retryd not asked)",
	}, true
}

// earlierUnknown reports whether an attempt of the call may have taken
// effect (a decision carried a mark) and nothing since proved otherwise: a
// keyed call retried after a timeout whose retries then never left. Only a
// success proves it, so once open it stays open.
func earlierUnknown(decisions []Decision) bool {
	for _, d := range decisions {
		if d.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE {
			return true
		}
	}
	return false
}

// callFailed is the error of a call that ends with no response to return:
// *AmbiguousError if an attempt of it may have taken effect (earlierUnknown),
// ending with the last decision; the plain *Error otherwise.
func callFailed(err error, attempts int, decisions []Decision, statusCode int, body []byte) error {
	if n := len(decisions); n > 0 && earlierUnknown(decisions) {
		return &AmbiguousError{Decision: decisions[n-1], Decisions: decisions, Attempts: attempts, StatusCode: statusCode, Body: body, Err: err}
	}
	return &Error{Err: err, Attempts: attempts, Decisions: decisions}
}

// clock is the time source of the waits the adapters make between
// attempts. The Client holds one (the real one); the tests put in one that
// records the waits asked for and returns at once, so that what a backoff
// is can be asserted exactly, without sleeping or timing the wall clock.
type clock interface {
	// wait waits for d, or returns ctx's error as soon as ctx is done.
	wait(ctx context.Context, d time.Duration) error
}

type realClock struct{}

func (realClock) wait(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// waitBackoff waits out a backoff on c's clock, or returns ctx's error as
// soon as ctx is done: a caller's deadline bounds the wait as well as the
// attempts.
func (c *Client) waitBackoff(ctx context.Context, backoff time.Duration) error {
	if backoff <= 0 {
		return nil
	}
	return c.clock.wait(ctx, backoff)
}
