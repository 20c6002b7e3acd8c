package retryd

import (
	"fmt"
	"strings"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// InvalidRequestError is a DecideRequest that retryd (or, when retryd is
// unreachable, this client) rejected as invalid. The fallback never hides
// it: an invalid request is a bug in the caller.
type InvalidRequestError struct {
	// Field is the offending field as retryd names it ("upstream",
	// "body.parts[0].declared"): the text of Message before the first ':'.
	Field string
	// Message is retryd's whole message, starting with the field.
	Message string
}

// Error describes the failure in one line.
func (e *InvalidRequestError) Error() string { return "retryd: invalid request: " + e.Message }

// GRPCStatus makes status.Code(err) answer INVALID_ARGUMENT.
func (e *InvalidRequestError) GRPCStatus() *status.Status {
	return status.New(codes.InvalidArgument, e.Message)
}

func newInvalidRequest(message string) *InvalidRequestError {
	field := message
	if i := strings.IndexByte(message, ':'); i >= 0 {
		field = message[:i]
	}
	return &InvalidRequestError{Field: field, Message: message}
}

// UnavailableError is a call retryd did not answer: returned by Decide only
// when the fallback is switched off ([Options.NoFallback]), and by the
// traffic and admin calls.
type UnavailableError struct {
	// Code is the gRPC code the call failed with.
	Code codes.Code
	// Message is the status message.
	Message string
}

// Error describes the failure in one line.
func (e *UnavailableError) Error() string {
	return fmt.Sprintf("retryd: %s: %s", e.Code, e.Message)
}

// GRPCStatus makes status.Code(err) answer the code the call failed with.
func (e *UnavailableError) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

// callError turns a failed retryd call into InvalidRequestError or
// UnavailableError.
func callError(err error) error {
	st := status.Convert(err)
	if st.Code() == codes.InvalidArgument {
		return newInvalidRequest(st.Message())
	}
	return &UnavailableError{Code: st.Code(), Message: st.Message()}
}

// AmbiguousError is a call that may have taken effect upstream and was not
// retried: retryd's AMBIGUOUS answer, or a DENY carrying an unknown-outcome
// mark (Decision.UnknownOutcome: an empty budget or the last attempt after a
// timeout, say), or a non-idempotent call that the caller's own deadline
// ended after it was sent. It is never a plain failure: reporting one would
// tell the caller the request did not happen, which may be false.
//
// Reconcile (query the upstream) before doing it again; for an
// IDEMPOTENT_WITH_KEY call, ResendWithSameKey says that re-sending with the
// same idempotency key is safe (a new key is not).
type AmbiguousError struct {
	// Decision is the decision that ended the call: AMBIGUOUS, or a DENY
	// with its DenyReason and UnknownOutcome.
	Decision Decision
	// Decisions are every decision made for the call, the last one included.
	Decisions []Decision
	// Attempts is the number of attempts made.
	Attempts int
	// StatusCode is the HTTP status of the last attempt (0 when no response
	// arrived, or for a gRPC call).
	StatusCode int
	// Body is the start of the last response's body, if one arrived (at most
	// the Transport's error-body limit).
	Body []byte
	// Err is the error of the last attempt: a transport error, or for gRPC
	// the call's status error; nil when a response arrived over HTTP.
	Err error
}

// DenyReason is why no further attempt was allowed, when the call was denied
// rather than answered AMBIGUOUS (DENY_REASON_UNSPECIFIED then).
func (e *AmbiguousError) DenyReason() pb.DenyReason { return e.Decision.DenyReason }

// ResendWithSameKey reports whether the call was IDEMPOTENT_WITH_KEY: its
// outcome is unknown, and sending it again with the same idempotency key is
// safe (the upstream deduplicates it). False means reconcile first.
func (e *AmbiguousError) ResendWithSameKey() bool {
	// Any attempt's mark says: a call's idempotency does not change between
	// attempts, and the last decision may be about an attempt that never
	// left (the earlier one is what may have happened).
	for _, d := range e.Decisions {
		if d.UnknownOutcome == pb.UnknownOutcome_UNKNOWN_OUTCOME_RESEND_WITH_KEY {
			return true
		}
	}
	return e.Decision.UnknownOutcome == pb.UnknownOutcome_UNKNOWN_OUTCOME_RESEND_WITH_KEY
}

// Error describes the failure in one line.
func (e *AmbiguousError) Error() string {
	what := fmt.Sprintf("retryd: %s after %d attempt(s): the request may have taken effect upstream", describeDecision(e.Decision), e.Attempts)
	switch {
	case e.Err != nil:
		what += fmt.Sprintf(" (%v)", e.Err)
	case e.StatusCode != 0:
		what += fmt.Sprintf(" (HTTP %d)", e.StatusCode)
	}
	if e.ResendWithSameKey() {
		return what + "; re-send it with the same idempotency key"
	}
	return what + "; reconcile before sending it again"
}

// Unwrap returns the last attempt's error.
func (e *AmbiguousError) Unwrap() error { return e.Err }

// GRPCStatus gives a gRPC caller the status the call ended with.
func (e *AmbiguousError) GRPCStatus() *status.Status {
	if st, ok := status.FromError(e.Err); ok && e.Err != nil {
		return st
	}
	return status.New(codes.Unknown, e.Error())
}

// Error is the last attempt's error when retryd did not allow another
// attempt (DENY), or when the caller's context ended. Err is the attempt's
// own error, so errors.Is(err, context.DeadlineExceeded) and the like work.
type Error struct {
	// Err is the last attempt's error.
	Err error
	// Attempts is the number of attempts made.
	Attempts int
	// Decisions are the decisions made, in order; the last one, if any, is
	// why there was no further attempt (none when the context ended first).
	Decisions []Decision
}

// Error is the attempt's error, with why no further attempt was made.
func (e *Error) Error() string {
	if n := len(e.Decisions); n > 0 {
		last := e.Decisions[n-1]
		return fmt.Sprintf("%v (retryd: %s after %d attempt(s): %s)", e.Err, verdictName(last), e.Attempts, last.Explanation)
	}
	return fmt.Sprintf("%v (after %d attempt(s))", e.Err, e.Attempts)
}

// Unwrap returns the last attempt's error.
func (e *Error) Unwrap() error { return e.Err }

// GRPCStatus gives a gRPC caller the status the call ended with.
func (e *Error) GRPCStatus() *status.Status { return status.Convert(e.Err) }
