// transport.go is the Transport: one http.RoundTripper that retries under
// retryd's decisions (its hedged first attempt is in transport_hedge.go).
// About 730 lines because the attempt loop, the
// httptrace evidence and the body handling are read together; the
// classification of errors is the part a reader checks against the issue.

package retryd

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"sync"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// DefaultRetryStatuses are the statuses the Transport asks retryd about;
// any other response is returned as it is.
var DefaultRetryStatuses = []int{401, 408, 425, 429, 500, 502, 503, 504}

// maxLoop is a hard stop on attempts, whatever retryd or the fallback says.
const maxLoop = 100

// DefaultErrorBodyLimit is how much of a failed response's body the
// Transport reads before deciding (so that the connection can be reused,
// and the body handed back intact when retryd denies a retry).
const DefaultErrorBodyLimit = 64 << 10

type callKey struct{}

// Call is what a caller declares about one call, through WithCall. The
// HTTP method never decides idempotency: undeclared, a request is
// NON_IDEMPOTENT, or IDEMPOTENT_WITH_KEY when it carries an Idempotency-Key
// header.
type Call struct {
	// Idempotency of the operation; IDEMPOTENCY_UNSPECIFIED means undeclared.
	Idempotency pb.Idempotency
	// Upstream names the budget and policy; "" means the Transport's, or
	// else the request's host.
	Upstream string
	// Operation is for retryd's audit; "" means "METHOD /path".
	Operation string
	// MaxAttempts is the caller's own attempt limit; 0 means retryd's.
	MaxAttempts uint32
}

// WithCall returns a context that declares call for the requests (or gRPC
// calls) made with it.
func WithCall(ctx context.Context, call Call) context.Context {
	return context.WithValue(ctx, callKey{}, call)
}

// WithIdempotency declares the idempotency of the requests made with ctx,
// keeping whatever else WithCall declared.
func WithIdempotency(ctx context.Context, idempotency pb.Idempotency) context.Context {
	call := callOf(ctx)
	call.Idempotency = idempotency
	return WithCall(ctx, call)
}

func callOf(ctx context.Context) Call {
	call, _ := ctx.Value(callKey{}).(Call)
	return call
}

// Transport is an http.RoundTripper that retries under retryd's decisions.
//
// Each attempt is traced with net/http/httptrace, and a failure becomes
// evidence: nothing written, with the stage that failed (DNS, connect, TLS
// handshake, a pool wait), is NOT_SENT; a request written without a
// response is SENT_NO_RESPONSE; a response whose body breaks off is
// PARTIAL_RESPONSE; an I/O error of unknown stage is never NOT_SENT.
// Responses with a status in RetryStatuses are decided too, with their
// Retry-After passed raw.
//
// The body is replayable when the request has GetBody (http.NewRequest sets
// it for in-memory bodies); a body without GetBody is one-shot, and retryd
// denies re-sending it. A failed response's body is read (up to
// ErrorBodyLimit) and closed before the backoff, which is slept holding no
// connection and never past the context's deadline; the remaining deadline
// is passed to retryd with each decision.
//
// RoundTrip returns the final response when it succeeds or retryd denies
// another attempt (Decisions finds the decisions made), an *Error wrapping
// the last transport error when retryd denies retrying it or the context
// ends, and an *AmbiguousError on AMBIGUOUS.
//
// First attempts are counted on the client's TrafficReporter unless
// DisableReporting is set, and so is every attempt's outcome: a failure when
// retryd is asked about it (a transport error, a status in RetryStatuses), a
// success otherwise (a 404 included); an attempt whose context the caller
// cancelled is neither. Go's own http.Transport re-sends by itself a
// request whose reused connection broke; the Transport lets it do so only
// when nothing of the request was written, and otherwise refuses the re-send
// (see refuseHiddenResend), so that every request that reaches the upstream
// is an attempt retryd allowed.
//
// A call to an upstream whose hedging retryd serves (see [Client.Hedging])
// is hedged when its idempotency is one the policy lists and its body is
// replayable: after the served delay with the first attempt still running,
// retryd is asked for a hedge, and on RETRY a copy is sent; the first answer
// that is not a retryable failure wins and the other copies are aborted
// (README, Hedging).
type Transport struct {
	// Base sends each attempt; nil means http.DefaultTransport.
	Base http.RoundTripper
	// Client is the retryd client; required.
	Client *Client
	// Upstream names the budget and policy, unless the call declares its
	// own; "" means the request's host.
	Upstream string
	// RetryStatuses are the statuses decided by retryd; nil means
	// DefaultRetryStatuses.
	RetryStatuses []int
	// AttemptTimeout bounds each attempt (0: only the context does),
	// reading the returned body included. An attempt that runs out of it is
	// a failure like any other: a pool wait (POOL_TIMEOUT), a connect
	// (CONNECT) or a wait for the response headers (RESPONSE_HEADER_TIMEOUT).
	AttemptTimeout time.Duration
	// RefreshCredentials is called before replaying a request that retryd
	// answered with refresh_credentials (after a 401), with the request of
	// the next attempt, to set fresh credentials on it. Without it such a
	// 401 is returned as it is.
	RefreshCredentials func(next *http.Request) error
	// BufferResponses makes each attempt read a successful response's body
	// in full (up to MaxBufferedBody bytes) before RoundTrip returns it, so
	// that a body that breaks off is PARTIAL_RESPONSE and decided by retryd
	// instead of failing in the caller's read, where no retry is possible.
	BufferResponses bool
	// MaxBufferedBody limits BufferResponses (8 MiB when zero); a longer
	// body is handed over unbuffered after its first MaxBufferedBody bytes.
	MaxBufferedBody int64
	// ErrorBodyLimit is how much of a failed response's body is read before
	// deciding (DefaultErrorBodyLimit when zero).
	ErrorBodyLimit int64
	// DisableReporting stops counting first attempts and outcomes on the
	// client's TrafficReporter.
	DisableReporting bool
}

// decisionsKey marks the request of a returned response with the
// decisions made for it.
type decisionsKey struct{}

// Decisions returns the decisions retryd (or the local rule) made for the
// call that produced resp, in order: none when the first attempt succeeded.
func Decisions(resp *http.Response) []Decision {
	if resp == nil || resp.Request == nil {
		return nil
	}
	decisions, _ := resp.Request.Context().Value(decisionsKey{}).([]Decision)
	return decisions
}

// attemptTrace records how far one attempt got. The hooks run on the
// transport's goroutines, hence the lock. The flags are sticky across
// http.Transport's own internal re-sends: once anything was written, it
// stays written.
type attemptTrace struct {
	mu                sync.Mutex
	getConn           bool
	connectStarted    bool
	connectErr        error
	dnsErr            error
	tlsErr            error
	gotConn           bool
	wroteHeaders      bool
	wroteRequest      bool
	gotFirstByte      bool
	wroteRequestError error
}

func (t *attemptTrace) hooks() *httptrace.ClientTrace {
	return &httptrace.ClientTrace{
		GetConn: func(string) { t.set(func() { t.getConn = true }) },
		DNSDone: func(info httptrace.DNSDoneInfo) {
			t.set(func() {
				if info.Err != nil {
					t.dnsErr = info.Err
				}
			})
		},
		ConnectStart: func(string, string) { t.set(func() { t.connectStarted = true }) },
		ConnectDone: func(_, _ string, err error) {
			t.set(func() {
				if err != nil {
					t.connectErr = err
				}
			})
		},
		TLSHandshakeDone: func(_ tls.ConnectionState, err error) {
			t.set(func() {
				if err != nil {
					t.tlsErr = err
				}
			})
		},
		GotConn:      func(httptrace.GotConnInfo) { t.set(func() { t.gotConn = true }) },
		WroteHeaders: func() { t.set(func() { t.wroteHeaders = true }) },
		WroteRequest: func(info httptrace.WroteRequestInfo) {
			t.set(func() {
				t.wroteRequest = true
				if info.Err != nil {
					t.wroteRequestError = info.Err
				}
			})
		},
		GotFirstResponseByte: func() { t.set(func() { t.gotFirstByte = true }) },
	}
}

func (t *attemptTrace) set(f func()) {
	t.mu.Lock()
	f()
	t.mu.Unlock()
}

// outcome is how far a failed attempt got, in retryd's terms.
type outcome struct {
	evidence   pb.Evidence
	failure    pb.FailureKind
	httpStatus int
	retryAfter string
	// retriedBelow is the response's valid retryd-retried header, if any.
	retriedBelow string
}

func isCertificateError(err error) bool {
	var unknownAuthority x509.UnknownAuthorityError
	var invalid x509.CertificateInvalidError
	var hostname x509.HostnameError
	return errors.As(err, &unknownAuthority) || errors.As(err, &invalid) || errors.As(err, &hostname)
}

// classifyError says what a RoundTrip error proves, given the trace.
// attemptTimedOut is true when the attempt's own timeout (not the caller's
// context) ended it.
func classifyError(err error, t *attemptTrace, attemptTimedOut bool) outcome {
	t.mu.Lock()
	defer t.mu.Unlock()
	sent := outcome{evidence: pb.Evidence_EVIDENCE_SENT_NO_RESPONSE}
	switch {
	case t.gotFirstByte:
		// Bytes came back, but no valid response header: not a response.
		sent.failure = pb.FailureKind_FAILURE_KIND_GENERIC_IO
	case t.wroteRequest:
		if attemptTimedOut || isTimeout(err) {
			sent.failure = pb.FailureKind_FAILURE_KIND_RESPONSE_HEADER_TIMEOUT
		} else {
			sent.failure = pb.FailureKind_FAILURE_KIND_CONNECTION_RESET
		}
	case t.wroteHeaders:
		sent.failure = pb.FailureKind_FAILURE_KIND_PARTIAL_WRITE
	case t.gotConn:
		// A connection was handed over: any of the request may be on the
		// wire, whatever the error says.
		sent.failure = pb.FailureKind_FAILURE_KIND_GENERIC_IO
	case t.tlsErr != nil:
		if isCertificateError(t.tlsErr) || isCertificateError(err) {
			return outcome{evidence: pb.Evidence_EVIDENCE_NOT_SENT, failure: pb.FailureKind_FAILURE_KIND_TLS_CERTIFICATE_INVALID}
		}
		return outcome{evidence: pb.Evidence_EVIDENCE_NOT_SENT, failure: pb.FailureKind_FAILURE_KIND_PRE_REQUEST_TLS}
	case t.dnsErr != nil:
		return outcome{evidence: pb.Evidence_EVIDENCE_NOT_SENT, failure: pb.FailureKind_FAILURE_KIND_DNS}
	case t.connectErr != nil || (t.connectStarted && attemptTimedOut):
		return outcome{evidence: pb.Evidence_EVIDENCE_NOT_SENT, failure: pb.FailureKind_FAILURE_KIND_CONNECT}
	case t.getConn && attemptTimedOut:
		// Waited for a connection (MaxConnsPerHost) and never got one.
		return outcome{evidence: pb.Evidence_EVIDENCE_NOT_SENT, failure: pb.FailureKind_FAILURE_KIND_POOL_TIMEOUT}
	case !t.getConn:
		// Refused before any connection was asked for: the transport's own
		// checks (scheme, header values, ...). Permanent.
		return outcome{evidence: pb.Evidence_EVIDENCE_NOT_SENT, failure: pb.FailureKind_FAILURE_KIND_PROFILE_REJECTION}
	default:
		sent.failure = pb.FailureKind_FAILURE_KIND_GENERIC_IO
	}
	return sent
}

func isTimeout(err error) bool {
	var timeout interface{ Timeout() bool }
	return errors.As(err, &timeout) && timeout.Timeout()
}

// bodyOf is the request body in the contract's terms.
func bodyOf(req *http.Request) *pb.Body {
	switch {
	case req.Body == nil || req.Body == http.NoBody:
		return nil
	case req.GetBody != nil:
		return &pb.Body{Kind: pb.BodyKind_BODY_KIND_REOPENABLE_SUPPLIER}
	}
	return &pb.Body{Kind: pb.BodyKind_BODY_KIND_INPUT_STREAM}
}

func (t *Transport) base() http.RoundTripper {
	if t.Base != nil {
		return t.Base
	}
	return http.DefaultTransport
}

func (t *Transport) isRetryStatus(code int) bool {
	statuses := t.RetryStatuses
	if statuses == nil {
		statuses = DefaultRetryStatuses
	}
	for _, s := range statuses {
		if s == code {
			return true
		}
	}
	return false
}

// readPrefix reads up to limit bytes of body; err is the read error, if the
// body broke off before its end or the limit.
func readPrefix(body io.Reader, limit int64) (prefix []byte, complete bool, err error) {
	var buf bytes.Buffer
	n, err := io.CopyN(&buf, body, limit+1)
	if err == io.EOF {
		return buf.Bytes(), true, nil
	}
	if err != nil {
		return buf.Bytes(), false, err
	}
	_ = n
	return buf.Bytes(), false, nil
}

// replayBody is a body made of an already-read prefix and the rest of the
// original body.
type replayBody struct {
	io.Reader
	closer io.Closer
}

func (b replayBody) Close() error { return b.closer.Close() }

// RoundTrip sends req, retrying as retryd decides. See Transport.
func (t *Transport) RoundTrip(req *http.Request) (resp *http.Response, err error) {
	if t.Client == nil {
		closeBody(req)
		return nil, errors.New("retryd: Transport.Client is nil")
	}
	ctx := req.Context()
	call := callOf(ctx)
	idempotency := call.Idempotency
	if idempotency == pb.Idempotency_IDEMPOTENCY_UNSPECIFIED {
		idempotency = pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT
		if req.Header.Get("Idempotency-Key") != "" {
			idempotency = pb.Idempotency_IDEMPOTENCY_IDEMPOTENT_WITH_KEY
		}
	}
	upstream := call.Upstream
	if upstream == "" {
		upstream = t.Upstream
	}
	if upstream == "" {
		upstream = req.URL.Host
	}
	operation := call.Operation
	if operation == "" {
		path := req.URL.EscapedPath()
		if path == "" {
			path = "/"
		}
		operation = req.Method + " " + path
		if len(operation) > 256 {
			operation = operation[:256]
		}
	}
	body := bodyOf(req)
	decideCtx := traceFromRequest(ctx, req.Header)
	errorBodyLimit := t.ErrorBodyLimit
	if errorBodyLimit <= 0 {
		errorBodyLimit = DefaultErrorBodyLimit
	}

	lineage := InboundLineage(ctx)
	baggage := req.Header.Values("Baggage")

	var decisions []Decision
	decided := false
	defer func() {
		// A call that ends in failure after a decision is one the layer
		// above must not retry again (docs/lineage.md): the inbound
		// middleware says so on its own failed response.
		if decided && (err != nil || (resp != nil && t.isRetryStatus(resp.StatusCode))) {
			markRetried(ctx)
		}
	}()
	var previousBackoff time.Duration
	authRefreshed := false
	next := req
	for attempt := 1; ; attempt++ {
		if attempt == 1 && !t.DisableReporting {
			t.Client.Reporter().Record(upstream, 1)
		}
		if attempt == 1 {
			t.Client.firstAttemptSent(upstream)
		}
		var resp *http.Response
		var failed *failure
		var attemptErr error
		plan, hedge := hedgePlan{}, false
		if attempt == 1 && (body == nil || req.GetBody != nil) {
			// A one-shot body cannot be sent twice: never hedged.
			plan, hedge = t.Client.hedgePlanFor(upstream, idempotency)
		}
		if hedge {
			first := t.hedgeFirst(ctx, decideCtx, req, plan, hedgeCall{
				upstream: upstream, operation: operation, idempotency: idempotency, body: body,
				maxAttempts: call.MaxAttempts, lineage: lineage, baggage: baggage, errorBodyLimit: errorBodyLimit,
			})
			resp, failed, attemptErr = first.resp, first.failed, first.err
			decisions = append(decisions, first.decisions...)
			if first.sent > 1 {
				decided = true
			}
			attempt = first.sent // the next retry, if any, counts every copy sent
		} else {
			member := withLineageMember(baggage, outboundLineage(lineage, t.Client.Layer(), attempt))
			start := time.Now()
			resp, failed, attemptErr = t.attempt(ctx, next, member, errorBodyLimit)
			if !t.DisableReporting {
				// A failure is an attempt retryd (or, past the deadline, the
				// local rule) is asked about; any other ending is a success.
				t.Client.recordAttempt(ctx, upstream, attempt, attemptErr == nil && failed == nil, time.Since(start))
			}
		}
		if attemptErr == nil && failed == nil {
			return withDecisions(resp, decisions), nil
		}
		o := failed.outcome
		decideReq := &pb.DecideRequest{
			Upstream:             upstream,
			Operation:            operation,
			Idempotency:          idempotency,
			Body:                 body,
			Attempt:              uint32(attempt),
			Evidence:             o.evidence,
			Failure:              o.failure,
			HttpStatus:           uint32(o.httpStatus),
			RetryAfter:           truncate(o.retryAfter, 256),
			AuthRefreshAttempted: authRefreshed,
			MaxAttempts:          call.MaxAttempts,
			Lineage:              lineage,
			RetriedBelow:         o.retriedBelow,
		}
		if ctx.Err() != nil {
			// The caller's deadline or cancellation ended the call: no time
			// for another attempt, and nothing to ask. A call that may have
			// been sent and is not idempotent is of unknown outcome.
			closeResponse(resp)
			if attemptErr == nil {
				attemptErr = ctx.Err()
			}
			if decision, ok := endedByCaller(ctx, decideReq); ok {
				decisions = append(decisions, decision)
				return nil, &AmbiguousError{Decision: decision, Decisions: decisions, Attempts: attempt, StatusCode: o.httpStatus, Body: failed.body, Err: attemptErr}
			}
			return nil, callFailed(attemptErr, attempt, decisions, 0, nil)
		}
		setTiming(ctx, decideReq, previousBackoff)
		decision, err := t.Client.Decide(decideCtx, decideReq)
		if err != nil {
			// An invalid request (a bug, not an outage): say so, with the
			// attempt's own failure.
			closeResponse(resp)
			return nil, fmt.Errorf("retryd: deciding attempt %d (%v): %w", attempt, describe(attemptErr, o), err)
		}
		decided = true
		decisions = append(decisions, decision)
		ambiguous := func() *AmbiguousError {
			closeResponse(resp)
			return &AmbiguousError{
				Decision: decision, Decisions: decisions, Attempts: attempt,
				StatusCode: o.httpStatus, Body: failed.body, Err: attemptErr,
			}
		}
		if decision.OutcomeUnknown() {
			return nil, ambiguous()
		}
		retry := decision.ShouldRetry() && attempt < maxLoop
		var replay *http.Request
		if retry {
			replay, err = nextRequest(req, ctx)
			if err != nil {
				retry = false // the body cannot be reopened after all
			}
		}
		if retry && decision.RefreshCredentials {
			if t.RefreshCredentials == nil {
				retry = false
			} else if err := t.RefreshCredentials(replay); err != nil {
				closeResponse(resp)
				return nil, callFailed(err, attempt, decisions, 0, nil)
			}
		}
		if !retry {
			closeBody(replay)
			if decision.UnknownOutcome != pb.UnknownOutcome_UNKNOWN_OUTCOME_NONE {
				// A RETRY that cannot be followed (the body cannot be
				// reopened, no RefreshCredentials) leaves the outcome as
				// open as a DENY would.
				return nil, ambiguous()
			}
			if attemptErr != nil {
				return nil, callFailed(attemptErr, attempt, decisions, 0, nil)
			}
			return withDecisions(resp, decisions), nil
		}
		// Give the connection back (the body was read up to the limit)
		// before waiting.
		closeResponse(resp)
		if decision.RefreshCredentials {
			authRefreshed = true
		}
		previousBackoff = decision.Backoff
		if err := t.Client.waitBackoff(ctx, decision.Backoff); err != nil {
			closeBody(replay)
			return nil, callFailed(err, attempt, decisions, 0, nil)
		}
		next = replay
	}
}

// failure is a failed attempt: its outcome and, for a response, the start of
// its body.
type failure struct {
	outcome outcome
	body    []byte
}

// attempt sends one attempt. It returns (resp, nil, nil) for a response to
// hand back as it is; (resp or nil, failure, err) for a failed attempt, where
// resp is the failed response (its body replaced by what was read, followed
// by the rest) and err the transport error, if any.
// baggage is the attempt's baggage header, with its retryd.lineage member.
func (t *Transport) attempt(ctx context.Context, req *http.Request, baggage string, errorBodyLimit int64) (*http.Response, *failure, error) {
	attemptCtx := ctx
	var attemptCancel context.CancelFunc = func() {}
	if t.AttemptTimeout > 0 {
		attemptCtx, attemptCancel = context.WithTimeout(ctx, t.AttemptTimeout)
	}
	trace := &attemptTrace{}
	sent := req.WithContext(httptrace.WithClientTrace(attemptCtx, trace.hooks()))
	// A RoundTripper must not change the caller's request: the headers are
	// the attempt's own copy.
	sent.Header = req.Header.Clone()
	if sent.Header == nil {
		sent.Header = http.Header{}
	}
	sent.Header.Set("Baggage", baggage)
	refuseHiddenResend(sent, trace)
	resp, err := t.base().RoundTrip(sent)
	attemptTimedOut := func() bool { return attemptCtx.Err() != nil && ctx.Err() == nil }
	if err != nil {
		attemptCancel()
		return nil, &failure{outcome: classifyError(err, trace, attemptTimedOut())}, err
	}
	// The response must stay readable after RoundTrip: the attempt's timeout
	// is released when the body is closed (or at once if none is set).
	resp.Body = cancelOnClose{ReadCloser: resp.Body, cancel: attemptCancel}
	retryAfter := resp.Header.Get("Retry-After")
	below := retriedBelow(resp.Header.Get(RetriedHeader))
	if t.isRetryStatus(resp.StatusCode) {
		prefix, complete, readErr := readPrefix(resp.Body, errorBodyLimit)
		if readErr != nil {
			resp.Body.Close()
			o := partialOutcome(resp.StatusCode, retryAfter, readErr, attemptTimedOut())
			o.retriedBelow = below
			return nil, &failure{outcome: o, body: prefix}, readErr
		}
		if complete {
			resp.Body.Close()
			resp.Body = io.NopCloser(bytes.NewReader(prefix))
		} else {
			resp.Body = replayBody{Reader: io.MultiReader(bytes.NewReader(prefix), resp.Body), closer: resp.Body}
		}
		return resp, &failure{
			outcome: outcome{evidence: pb.Evidence_EVIDENCE_RESPONSE_RECEIVED, httpStatus: resp.StatusCode, retryAfter: retryAfter, retriedBelow: below},
			body:    prefix,
		}, nil
	}
	if t.BufferResponses && req.Method != http.MethodHead {
		limit := t.MaxBufferedBody
		if limit <= 0 {
			limit = 8 << 20
		}
		prefix, complete, readErr := readPrefix(resp.Body, limit)
		if readErr != nil {
			resp.Body.Close()
			return nil, &failure{outcome: partialOutcome(resp.StatusCode, retryAfter, readErr, attemptTimedOut())}, readErr
		}
		if complete {
			resp.Body.Close()
			resp.Body = io.NopCloser(bytes.NewReader(prefix))
			resp.ContentLength = int64(len(prefix))
		} else {
			resp.Body = replayBody{Reader: io.MultiReader(bytes.NewReader(prefix), resp.Body), closer: resp.Body}
		}
	}
	return resp, nil, nil
}

// errHiddenResend is what net/http's own re-send of a request that may have
// been written gets instead of the request's body.
var errHiddenResend = errors.New("retryd: net/http's own re-send of a request that may have been sent was refused (retryd decides every re-send)")

// refuseHiddenResend stops http.Transport from sending sent a second time by
// itself. On a reused connection that breaks before the response (or that
// the server closed after reading the request), net/http re-sends a request
// it deems replayable: one without a body, or with GetBody, whose method is
// GET, HEAD, OPTIONS or TRACE or which has an Idempotency-Key or
// X-Idempotency-Key header (shouldRetryRequest and isReplayable in
// net/http/transport.go and request.go). Before that re-send it rewinds a
// body that was read by calling GetBody (rewindBody): that call is the one
// place an adapter can refuse it. So sent always has a body net/http must
// rewind: its own GetBody, guarded, or for a bodyless request an empty one
// (which net/http probes and sends as no body for GET, HEAD, DELETE and
// OPTIONS; other bodyless methods it would re-send get an empty chunked
// body). The guard lets a re-send through only if nothing of the request
// was written (net/http's nothingWrittenError: provably not sent, so no
// attempt), and refuses it otherwise, so that the attempt fails with what
// it proves and retryd decides.
func refuseHiddenResend(sent *http.Request, trace *attemptTrace) {
	getBody := sent.GetBody
	switch {
	case sent.Body == nil || sent.Body == http.NoBody:
		sent.Body = emptyBody{}
		sent.ContentLength = 0
		getBody = func() (io.ReadCloser, error) { return emptyBody{}, nil }
	case getBody == nil:
		return // one-shot: net/http never re-sends it
	}
	sent.GetBody = func() (io.ReadCloser, error) {
		trace.mu.Lock()
		written := trace.wroteHeaders || trace.wroteRequest
		trace.mu.Unlock()
		if written {
			return nil, errHiddenResend
		}
		return getBody()
	}
}

// emptyBody is a body of no bytes that is not http.NoBody (which net/http
// re-sends without rewinding it).
type emptyBody struct{}

func (emptyBody) Read([]byte) (int, error) { return 0, io.EOF }
func (emptyBody) Close() error             { return nil }

// partialOutcome is a response whose body broke off.
func partialOutcome(status int, retryAfter string, err error, attemptTimedOut bool) outcome {
	failure := pb.FailureKind_FAILURE_KIND_DECODE_RESET
	if attemptTimedOut || isTimeout(err) {
		failure = pb.FailureKind_FAILURE_KIND_INTERRUPTED_STREAM
	}
	return outcome{evidence: pb.Evidence_EVIDENCE_PARTIAL_RESPONSE, failure: failure, httpStatus: status, retryAfter: retryAfter}
}

type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (b cancelOnClose) Close() error {
	err := b.ReadCloser.Close()
	b.cancel()
	return err
}

// nextRequest is a copy of the caller's request for another attempt, with a
// fresh body.
func nextRequest(req *http.Request, ctx context.Context) (*http.Request, error) {
	replay := req.Clone(ctx)
	if req.Body != nil && req.Body != http.NoBody {
		if req.GetBody == nil {
			return nil, errors.New("retryd: one-shot body")
		}
		body, err := req.GetBody()
		if err != nil {
			return nil, err
		}
		replay.Body = body
	}
	return replay, nil
}

func withDecisions(resp *http.Response, decisions []Decision) *http.Response {
	if len(decisions) > 0 && resp.Request != nil {
		resp.Request = resp.Request.WithContext(context.WithValue(resp.Request.Context(), decisionsKey{}, decisions))
	}
	return resp
}

func closeResponse(resp *http.Response) {
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
}

func closeBody(req *http.Request) {
	if req != nil && req.Body != nil {
		req.Body.Close()
	}
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

func describe(err error, o outcome) string {
	if err != nil {
		return err.Error()
	}
	return fmt.Sprintf("HTTP %d", o.httpStatus)
}
