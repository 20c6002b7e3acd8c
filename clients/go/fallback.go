package retryd

import (
	"fmt"
	"math/rand"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc/codes"
)

// LocalPolicy holds the limits of the conservative local rule that decides
// when retryd cannot answer. Without retryd there is no fleet-wide budget
// and no per-upstream policy, so the local rule only ever allows less than
// retryd would (the same rule as the Python and TypeScript clients):
//
//   - at most MaxAttempts attempts (2 by default: one retry per call), or
//     the request's own lower max_attempts;
//   - never a one-shot body, a response already delivered, a draining
//     runtime, a deadline below MinAttemptBudget, or a permanent failure
//     (profile rejection, invalid certificate, request encoding);
//   - never a failure a layer below already retried (retried_below set:
//     DENY RETRIED_BELOW), nor a call made inside a retry of an enclosing
//     call (a lineage entry with an attempt above 1: DENY
//     INSIDE_ENCLOSING_RETRY), as retryd's default policy
//     (docs/lineage.md);
//   - never what may have been sent unless the operation is safely
//     idempotent: a NON_IDEMPOTENT call is retried only on proven NOT_SENT,
//     and is AMBIGUOUS when no response (or only part of one), a
//     502/503/504, or a gRPC UNAVAILABLE or DEADLINE_EXCEEDED came back;
//   - a safely idempotent call is retried on SENT_NO_RESPONSE, a partial
//     2xx/3xx response, and 408, 425 (first attempt), 429, 502, 503, 504; a
//     401 once with RefreshCredentials for SAFE calls; 500 never. For gRPC:
//     UNAVAILABLE and DEADLINE_EXCEEDED; RESOURCE_EXHAUSTED only with a valid
//     pushback; UNAUTHENTICATED once with RefreshCredentials for SAFE calls;
//     a negative or unparseable pushback is DENY SERVER_PUSHBACK;
//   - the backoff is full jitter from Base capped at MaxBackoff, floored by
//     Retry-After or the gRPC pushback (one above MaxRetryAfter, or that
//     does not fit the deadline, is DENY DEADLINE), shortened to fit the
//     deadline.
type LocalPolicy struct {
	// MaxAttempts is the local attempt limit (attempts, not retries).
	MaxAttempts uint32
	// Base is the backoff of the first retry, before jitter.
	Base time.Duration
	// MaxBackoff caps the jittered backoff.
	MaxBackoff time.Duration
	// MinAttemptBudget is the least deadline left that is worth an attempt.
	MinAttemptBudget time.Duration
	// MaxRetryAfter is the longest Retry-After or pushback honoured.
	MaxRetryAfter time.Duration
	// HedgeDelay is the fixed hedge delay while retryd is unreachable (and
	// has served no hedging for the upstream in the last three report
	// intervals): a safely idempotent call still running after it is
	// hedged if the local allowance has a token. 0, the default: no
	// hedging without retryd.
	HedgeDelay time.Duration
	// MaxHedges is the most hedges of one call by the local rule (1 when 0).
	MaxHedges uint32
	// HedgeLoad is the share of first attempts the local rule may add as
	// hedges, per upstream (each first attempt earns that much of a token,
	// up to 10 saved); 0 means 0.05, retryd's default cap of extra load.
	HedgeLoad float64
}

// DefaultLocalPolicy is the local rule's default limits.
var DefaultLocalPolicy = LocalPolicy{
	MaxAttempts:      2,
	Base:             100 * time.Millisecond,
	MaxBackoff:       2 * time.Second,
	MinAttemptBudget: 50 * time.Millisecond,
	MaxRetryAfter:    30 * time.Second,
}

var notSentProof = map[pb.FailureKind]bool{
	pb.FailureKind_FAILURE_KIND_DNS:                     true,
	pb.FailureKind_FAILURE_KIND_CONNECT:                 true,
	pb.FailureKind_FAILURE_KIND_POOL_TIMEOUT:            true,
	pb.FailureKind_FAILURE_KIND_PRE_REQUEST_TLS:         true,
	pb.FailureKind_FAILURE_KIND_PROFILE_REJECTION:       true,
	pb.FailureKind_FAILURE_KIND_HTTP2_REFUSED_STREAM:    true,
	pb.FailureKind_FAILURE_KIND_GOAWAY_UNPROCESSED:      true,
	pb.FailureKind_FAILURE_KIND_TLS_CERTIFICATE_INVALID: true,
}

var permanentFailures = map[pb.FailureKind]bool{
	pb.FailureKind_FAILURE_KIND_PROFILE_REJECTION:       true,
	pb.FailureKind_FAILURE_KIND_TLS_CERTIFICATE_INVALID: true,
	pb.FailureKind_FAILURE_KIND_REQUEST_ENCODING:        true,
}

// evidenceRank orders evidence from weakest to strongest claim about how
// far the attempt got, as retryd does.
func evidenceRank(e pb.Evidence) int {
	switch e {
	case pb.Evidence_EVIDENCE_NOT_SENT, pb.Evidence_EVIDENCE_UNSPECIFIED:
		return 0
	case pb.Evidence_EVIDENCE_SENT_NO_RESPONSE:
		return 1
	case pb.Evidence_EVIDENCE_RESPONSE_RECEIVED:
		return 2
	case pb.Evidence_EVIDENCE_PARTIAL_RESPONSE:
		return 3
	}
	return 1 // a value newer than this client: never treated as NOT_SENT
}

var evidenceByRank = []pb.Evidence{
	pb.Evidence_EVIDENCE_NOT_SENT,
	pb.Evidence_EVIDENCE_SENT_NO_RESPONSE,
	pb.Evidence_EVIDENCE_RESPONSE_RECEIVED,
	pb.Evidence_EVIDENCE_PARTIAL_RESPONSE,
}

// EffectiveEvidence is the evidence retryd would use for req: the strongest
// of the claim (none counts as NOT_SENT), the failure's floor (NOT_SENT only
// for a failure that proves it) and the response's floor (a status or a
// pushback means RESPONSE_RECEIVED).
func EffectiveEvidence(req *pb.DecideRequest) pb.Evidence {
	rank := evidenceRank(req.GetEvidence())
	floor := 1
	switch failure := req.GetFailure(); {
	case notSentProof[failure]:
		floor = 0
	case failure == pb.FailureKind_FAILURE_KIND_DECODE_RESET || failure == pb.FailureKind_FAILURE_KIND_INTERRUPTED_STREAM:
		floor = 3
	}
	if floor > rank {
		rank = floor
	}
	if (req.GetHttpStatus() != 0 || req.GrpcRetryPushbackMs != nil) && rank < 2 {
		rank = 2
	}
	return evidenceByRank[rank]
}

// ParseRetryAfter reads a Retry-After value: delay-seconds or an HTTP-date
// (all three forms), relative to now. ok is false when it is unparseable.
func ParseRetryAfter(value string, now time.Time) (wait time.Duration, ok bool) {
	text := strings.TrimSpace(value)
	if text == "" {
		return 0, false
	}
	if strings.Trim(text, "0123456789") == "" {
		seconds, err := strconv.ParseInt(text, 10, 64)
		if err != nil || seconds > int64(24*time.Hour/time.Second)*365 {
			return 365 * 24 * time.Hour, true // absurdly long: denied as too long
		}
		return time.Duration(seconds) * time.Second, true
	}
	at, err := http.ParseTime(text)
	if err != nil {
		return 0, false
	}
	if wait = at.Sub(now); wait < 0 {
		wait = 0
	}
	return wait, true
}

// parsePushback reads a raw grpc-retry-pushback-ms value as gRFC A6 defines
// it; ok is false for a negative or unparseable value (do not retry).
func parsePushback(raw string) (wait time.Duration, ok bool) {
	digits := strings.Trim(raw, " \t")
	if digits == "" || strings.Trim(digits, "0123456789") != "" {
		return 0, false
	}
	millis, err := strconv.ParseUint(digits, 10, 63)
	if err != nil || millis > uint64(365*24*time.Hour/time.Millisecond) {
		return 365 * 24 * time.Hour, true
	}
	return time.Duration(millis) * time.Millisecond, true
}

func isSafelyIdempotent(i pb.Idempotency) bool {
	switch i {
	case pb.Idempotency_IDEMPOTENCY_SAFE, pb.Idempotency_IDEMPOTENCY_IDEMPOTENT, pb.Idempotency_IDEMPOTENCY_IDEMPOTENT_WITH_KEY:
		return true
	}
	return false
}

// replayability of a body as the contract's table defines it (the weakest
// part of a multipart).
func replayability(body *pb.Body) pb.Replayability {
	if body == nil {
		return pb.Replayability_REPLAYABILITY_REPLAYABLE
	}
	switch body.GetKind() {
	case pb.BodyKind_BODY_KIND_NONE, pb.BodyKind_BODY_KIND_BYTES, pb.BodyKind_BODY_KIND_ENCODED_VALUE:
		return pb.Replayability_REPLAYABILITY_REPLAYABLE
	case pb.BodyKind_BODY_KIND_REOPENABLE_SUPPLIER:
		return pb.Replayability_REPLAYABILITY_REOPENABLE
	case pb.BodyKind_BODY_KIND_PUBLISHER_FACTORY:
		if d := body.GetDeclared(); d != pb.Replayability_REPLAYABILITY_UNSPECIFIED {
			return d
		}
		return pb.Replayability_REPLAYABILITY_ONE_SHOT
	case pb.BodyKind_BODY_KIND_MULTIPART:
		weakest := pb.Replayability_REPLAYABILITY_REPLAYABLE
		for _, part := range body.GetParts() {
			if r := replayability(part); r > weakest {
				weakest = r
			}
		}
		return weakest
	}
	return pb.Replayability_REPLAYABILITY_ONE_SHOT
}

// validateLocally rejects, without retryd, what retryd would certainly
// reject, so that the fallback never hides a caller's bug.
func validateLocally(req *pb.DecideRequest) error {
	switch {
	case req.GetUpstream() == "":
		return newInvalidRequest("upstream: required")
	case req.GetIdempotency() == pb.Idempotency_IDEMPOTENCY_UNSPECIFIED:
		return newInvalidRequest("idempotency: required")
	case req.GetAttempt() < 1:
		return newInvalidRequest("attempt: must be at least 1")
	case req.GetHttpStatus() != 0 && req.GetGrpcStatusCode() != 0:
		return newInvalidRequest("grpc_status_code: not together with http_status")
	case req.GetGrpcStatusCode() > 16:
		return newInvalidRequest("grpc_status_code: above 16")
	}
	return nil
}

var (
	jitterMu sync.Mutex
	jitter   = rand.New(rand.NewSource(time.Now().UnixNano()))
)

func jittered(limit time.Duration) time.Duration {
	if limit <= 0 {
		return 0
	}
	jitterMu.Lock()
	defer jitterMu.Unlock()
	return time.Duration(jitter.Int63n(int64(limit) + 1))
}

// LocalDecide decides one failed attempt without retryd, by the rule
// [LocalPolicy] describes. reason starts the explanation ("retryd
// unreachable (UNAVAILABLE)").
func LocalDecide(policy LocalPolicy, req *pb.DecideRequest, reason string) Decision {
	effective := EffectiveEvidence(req)
	claimed := req.GetEvidence() != pb.Evidence_EVIDENCE_UNSPECIFIED
	idempotency := req.GetIdempotency()
	safe := isSafelyIdempotent(idempotency)
	attempt := req.GetAttempt()
	httpStatus := req.GetHttpStatus()
	grpcCode := codes.Code(req.GetGrpcStatusCode())
	answer := func(verdict pb.Verdict, deny pb.DenyReason, rule uint32, why string, backoff time.Duration, refresh bool) Decision {
		return Decision{
			Verdict:            verdict,
			Backoff:            backoff,
			DenyReason:         deny,
			RefreshCredentials: refresh,
			Rule:               rule,
			EffectiveEvidence:  effective,
			EvidenceAdjusted:   claimed && effective != req.GetEvidence(),
			TokensRemaining:    nan,
			Explanation:        reason + "; local rule: " + why,
			UnknownOutcome:     unknownOutcome(req, effective),
			Fallback:           true,
		}
	}
	deny := func(reason pb.DenyReason, rule uint32, why string) Decision {
		return answer(pb.Verdict_VERDICT_DENY, reason, rule, why, 0, false)
	}
	var deadline *time.Duration
	if req.DeadlineRemaining != nil {
		remaining := req.DeadlineRemaining.AsDuration()
		deadline = &remaining
	}

	limit := policy.MaxAttempts
	if m := req.GetMaxAttempts(); m > 0 && m < limit {
		limit = m
	}
	if attempt >= limit {
		return deny(pb.DenyReason_DENY_REASON_MAX_ATTEMPTS, 1, fmt.Sprintf("attempt %d reached the local limit %d", attempt, limit))
	}
	if replayability(req.GetBody()) == pb.Replayability_REPLAYABILITY_ONE_SHOT {
		return deny(pb.DenyReason_DENY_REASON_BODY_NOT_REPLAYABLE, 3, "the body is one-shot")
	}
	if req.GetFirstByteDelivered() {
		return deny(pb.DenyReason_DENY_REASON_RESPONSE_ALREADY_DELIVERED, 4, "the response was already delivered")
	}
	if req.GetRuntimeDraining() {
		return deny(pb.DenyReason_DENY_REASON_RUNTIME_DRAINING, 5, "the runtime is draining")
	}
	// Rule 5 in a call chain (docs/lineage.md), as retryd with its default
	// policy: the layer nearest a failure retries it, and no layer retries
	// inside a retry of a layer above.
	if below := req.GetRetriedBelow(); below != "" {
		return deny(pb.DenyReason_DENY_REASON_RETRIED_BELOW, 5, "the layer below ("+below+") already retried this failure")
	}
	if e, ok := enclosingRetry(req.GetLineage()); ok {
		return deny(pb.DenyReason_DENY_REASON_INSIDE_ENCLOSING_RETRY, 5, fmt.Sprintf("inside attempt %d of layer %s, which is already retrying", e.attempt, e.layer))
	}
	if deadline != nil && *deadline < policy.MinAttemptBudget {
		return deny(pb.DenyReason_DENY_REASON_DEADLINE, 6, "the deadline leaves no room for another attempt")
	}
	if permanentFailures[req.GetFailure()] {
		return deny(pb.DenyReason_DENY_REASON_PERMANENT_FAILURE, 7, "the failure is permanent")
	}
	if effective == pb.Evidence_EVIDENCE_SENT_NO_RESPONSE && !safe {
		return answer(pb.Verdict_VERDICT_AMBIGUOUS, 0, 8, "the request may have been sent and is not idempotent", 0, false)
	}

	// Rule 9: what the failure or the response says.
	var floor *time.Duration // Retry-After or pushback: the least backoff
	if req.GrpcRetryPushbackMs != nil {
		wait, ok := parsePushback(*req.GrpcRetryPushbackMs)
		if !ok {
			return deny(pb.DenyReason_DENY_REASON_SERVER_PUSHBACK, 9, "the server asked not to retry")
		}
		floor = &wait
	} else if wait, ok := ParseRetryAfter(req.GetRetryAfter(), time.Now()); ok {
		floor = &wait
	}
	verdict, refresh := pb.Verdict_VERDICT_DENY, false
	switch {
	case effective == pb.Evidence_EVIDENCE_NOT_SENT || effective == pb.Evidence_EVIDENCE_SENT_NO_RESPONSE:
		verdict = pb.Verdict_VERDICT_RETRY
	case effective == pb.Evidence_EVIDENCE_PARTIAL_RESPONSE && (httpStatus == 0 || (httpStatus >= 200 && httpStatus < 400)):
		verdict = retryIf(safe)
	case httpStatus == 502 || httpStatus == 503 || httpStatus == 504:
		verdict = retryIf(safe)
	case grpcCode == codes.Unavailable || grpcCode == codes.DeadlineExceeded:
		verdict = retryIf(safe)
	case !safe:
	case httpStatus == 408 || httpStatus == 429 || (httpStatus == 425 && attempt == 1):
		verdict = pb.Verdict_VERDICT_RETRY
	case grpcCode == codes.ResourceExhausted && floor != nil:
		verdict = pb.Verdict_VERDICT_RETRY
	case (httpStatus == 401 || grpcCode == codes.Unauthenticated) && idempotency == pb.Idempotency_IDEMPOTENCY_SAFE && !req.GetAuthRefreshAttempted():
		verdict, refresh = pb.Verdict_VERDICT_RETRY, true
	}
	switch verdict {
	case pb.Verdict_VERDICT_AMBIGUOUS:
		return answer(verdict, 0, 9, "the request may have taken effect", 0, false)
	case pb.Verdict_VERDICT_DENY:
		what := fmt.Sprintf("status %d", httpStatus)
		if grpcCode != 0 {
			what = "gRPC " + grpcCode.String()
		}
		return deny(pb.DenyReason_DENY_REASON_STATUS_NOT_RETRYABLE, 9, what+" is not retried locally")
	}

	var backoff time.Duration
	if !refresh {
		cap := policy.Base << (attempt - 1)
		if cap > policy.MaxBackoff || cap <= 0 || attempt > 32 {
			cap = policy.MaxBackoff
		}
		backoff = jittered(cap)
	}
	if floor != nil {
		if *floor > policy.MaxRetryAfter {
			return deny(pb.DenyReason_DENY_REASON_DEADLINE, 6, "the server's wait exceeds the local maximum")
		}
		if *floor > backoff {
			backoff = *floor
		}
	}
	if deadline != nil {
		room := *deadline - policy.MinAttemptBudget
		if floor != nil && *floor > room {
			return deny(pb.DenyReason_DENY_REASON_DEADLINE, 6, "the server's wait does not fit the deadline")
		}
		if backoff > room {
			backoff = room
		}
		if backoff < 0 {
			backoff = 0
		}
	}
	return answer(pb.Verdict_VERDICT_RETRY, 0, 9, "retry "+strings.TrimPrefix(effective.String(), "EVIDENCE_"), backoff, refresh)
}

// unknownOutcome is the mark of issue 36 for req, given its effective
// evidence: the same definition as retryd's engine (outcome.rs). It is
// computed from the facts alone, never from the verdict, so that no rule
// (an attempt limit, an empty budget, a deadline) hides that a call may have
// happened. Set where rule 8 or the status rules would answer AMBIGUOUS
// (for a keyed call: would, were it not keyed): the evidence
// (SENT_NO_RESPONSE; a partial 2xx/3xx response, or one with no status) or
// the status (502, 503, 504, gRPC UNAVAILABLE or DEADLINE_EXCEEDED) leaves
// the outcome open. Never on a proven NOT_SENT, nor after a final response
// (a 4xx, a 500).
func unknownOutcome(req *pb.DecideRequest, effective pb.Evidence) pb.UnknownOutcome {
	var mark pb.UnknownOutcome
	switch req.GetIdempotency() {
	case pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT:
		mark = pb.UnknownOutcome_UNKNOWN_OUTCOME_RECONCILE
	case pb.Idempotency_IDEMPOTENCY_IDEMPOTENT_WITH_KEY:
		mark = pb.UnknownOutcome_UNKNOWN_OUTCOME_RESEND_WITH_KEY
	default:
		return pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE
	}
	httpStatus, grpcCode := req.GetHttpStatus(), codes.Code(req.GetGrpcStatusCode())
	statusLeavesItOpen := func() bool {
		if httpStatus != 0 {
			return httpStatus >= 502 && httpStatus <= 504
		}
		return grpcCode == codes.Unavailable || grpcCode == codes.DeadlineExceeded
	}
	open := false
	switch effective {
	case pb.Evidence_EVIDENCE_SENT_NO_RESPONSE:
		open = true
	case pb.Evidence_EVIDENCE_PARTIAL_RESPONSE:
		// The effect happened and its result was lost on the way, unless an
		// error status says what happened.
		open = (httpStatus == 0 && grpcCode == codes.OK) || (httpStatus >= 200 && httpStatus < 400) || statusLeavesItOpen()
	case pb.Evidence_EVIDENCE_RESPONSE_RECEIVED:
		open = statusLeavesItOpen()
	}
	if !open {
		return pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE
	}
	return mark
}

func retryIf(safe bool) pb.Verdict {
	if safe {
		return pb.Verdict_VERDICT_RETRY
	}
	return pb.Verdict_VERDICT_AMBIGUOUS
}
