package retryd

import (
	"fmt"
	"strings"

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

// AmbiguousError is retryd's AMBIGUOUS answer: the request may have taken
// effect upstream, so it was not retried. Reconcile (query the upstream, or
// replay with an idempotency key) before doing it again.
type AmbiguousError struct {
	// Decision is the AMBIGUOUS decision.
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

// Error describes the failure in one line.
func (e *AmbiguousError) Error() string {
	what := "the request may have taken effect upstream"
	switch {
	case e.Err != nil:
		return fmt.Sprintf("retryd: AMBIGUOUS after %d attempt(s): %s (%v)", e.Attempts, what, e.Err)
	case e.StatusCode != 0:
		return fmt.Sprintf("retryd: AMBIGUOUS after %d attempt(s): %s (HTTP %d)", e.Attempts, what, e.StatusCode)
	}
	return fmt.Sprintf("retryd: AMBIGUOUS after %d attempt(s): %s", e.Attempts, what)
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
