package retryd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"sync"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// DefaultTimeout bounds every decision call unless Options.Timeout says
// otherwise: a decision that takes longer is made by the local rule.
const DefaultTimeout = 200 * time.Millisecond

// minCallTimeout is the least a decision call gets when the caller's own
// deadline is nearly over: enough for retryd to answer DENY DEADLINE itself.
const minCallTimeout = 50 * time.Millisecond

// MaxTrafficEntries is the most entries one ReportTraffic call may carry.
const MaxTrafficEntries = 1024

// Options configures a [Client]. The zero value is usable.
type Options struct {
	// Timeout bounds every Decide call (DefaultTimeout when zero), and is
	// further bounded by the context's deadline and by the request's
	// deadline_remaining (but never below 50ms, so that retryd can still say
	// DENY DEADLINE itself). Traffic and admin calls get at least 1s.
	Timeout time.Duration
	// LocalPolicy is the local rule used when retryd cannot answer; nil
	// means DefaultLocalPolicy.
	LocalPolicy *LocalPolicy
	// NoFallback makes Decide return an *UnavailableError instead of a
	// local decision when retryd cannot answer.
	NoFallback bool
	// DialOptions are added to the client's own (after them, so they win).
	// Without grpc.WithTransportCredentials among them the connection is
	// plaintext, as for a retryd sidecar on loopback.
	DialOptions []grpc.DialOption
	// Metadata is sent with every call (an authorization header, say).
	Metadata metadata.MD
	// TraceContext returns the W3C traceparent and tracestate of ctx, so
	// that retryd's span joins the caller's trace; "" sends none. nil means
	// [W3CTraceContext]. With OpenTelemetry, see the README for the
	// three-line function that reads the active span.
	TraceContext func(ctx context.Context) (traceparent, tracestate string)
	// Logger receives the warnings: one when retryd becomes unreachable and
	// one when it answers again (with the number of fallback decisions and
	// traffic batches not taken meanwhile), and the shadow and drop
	// warnings; nil means the standard logger.
	Logger *log.Logger
	// ReportInterval is how often the client's own TrafficReporter sends
	// (1s when zero).
	ReportInterval time.Duration
	// ConnectTimeout bounds how long New waits for the connection to retryd
	// (DefaultConnectTimeout when zero; negative: New does not wait). The
	// wait ends early once connecting has failed (retryd is down: the local
	// rule decides meanwhile), so it costs a start-up only while retryd is
	// slow to accept. It keeps connecting out of the first decision's
	// Timeout.
	ConnectTimeout time.Duration
	// ShadowLogInterval is the least time between two warnings, per
	// upstream, about shadow decisions that differ from the local rule
	// (DefaultShadowLogInterval, a minute, when zero; negative is refused).
	// Every difference is counted in Client.ShadowDivergences whatever it is.
	ShadowLogInterval time.Duration
	// Layer is this service's name in a call chain (docs/lineage.md): the
	// entry `<Layer>:<attempt>` the Transport and the client interceptor add
	// to the retryd.lineage baggage member of each attempt, and the value of
	// the retryd-retried header the inbound middleware sets. 1 to 64 bytes
	// of [A-Za-z0-9._-]; "" means DefaultLayer().
	Layer string
}

// Client talks to one retryd. It is safe for concurrent use; share one per
// process and Close it on shutdown.
//
// For an upstream in shadow mode (retryd answers with shadow = true), the
// client acts on its own local rule, not on retryd's decision (see
// Decision.Shadow and Decision.Retryd); differences are counted in
// [Client.ShadowDivergences] and logged at most once per upstream every
// Options.ShadowLogInterval.
type Client struct {
	conn    *grpc.ClientConn
	decider pb.RetryDeciderClient
	admin   pb.RetryAdminClient
	opts    Options
	policy  LocalPolicy
	logger  *log.Logger
	shadow  *shadowLog
	outage  *outageLog
	clock   clock
	// hedging is learned from the traffic reports' responses.
	hedging     *hedgingTable
	localHedges *localHedges

	reporterOnce sync.Once
	reporter     *TrafficReporter
}

// ReconnectBackoff is the connection backoff the client dials with: after
// retryd restarts it is reached again within 2s (grpc-go's default backs off
// for up to two minutes, all of which the fallback would have to cover).
var ReconnectBackoff = backoff.Config{
	BaseDelay:  100 * time.Millisecond,
	Multiplier: 1.6,
	Jitter:     0.2,
	MaxDelay:   2 * time.Second,
}

// DefaultConnectTimeout is how long New waits for its connection to retryd
// unless Options.ConnectTimeout says otherwise.
const DefaultConnectTimeout = time.Second

// New connects to retryd at target (a gRPC target such as
// "127.0.0.1:50051"). It connects eagerly and waits, up to
// Options.ConnectTimeout, until the connection is up or has failed, so that
// the first decision is retryd's and not charged with connecting. It never
// fails because retryd is down: a Decide made while it is falls back.
func New(target string, opts Options) (*Client, error) {
	if target == "" {
		return nil, errors.New("retryd: empty target")
	}
	if opts.ShadowLogInterval < 0 {
		return nil, fmt.Errorf("retryd: Options.ShadowLogInterval: must not be negative, got %s", opts.ShadowLogInterval)
	}
	if opts.Layer != "" && !ValidLayer(opts.Layer) {
		return nil, fmt.Errorf("retryd: Options.Layer: %q is not 1 to 64 bytes of [A-Za-z0-9._-]", opts.Layer)
	}
	if opts.Layer == "" {
		opts.Layer = DefaultLayer()
	}
	dial := []grpc.DialOption{
		grpc.WithInsecure(),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: ReconnectBackoff, MinConnectTimeout: time.Second}),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(protoCodec{})),
		// retryd decides retries; grpc-go must not add its own.
		grpc.WithDisableRetry(),
	}
	dial = append(dial, opts.DialOptions...)
	conn, err := grpc.Dial(target, dial...)
	if err != nil {
		return nil, fmt.Errorf("retryd: dial %s: %w", target, err)
	}
	c := &Client{
		conn:        conn,
		decider:     pb.NewRetryDeciderClient(conn),
		admin:       pb.NewRetryAdminClient(conn),
		opts:        opts,
		policy:      DefaultLocalPolicy,
		logger:      opts.Logger,
		clock:       realClock{},
		hedging:     newHedgingTable(10000),
		localHedges: &localHedges{tokens: map[string]float64{}, max: 10000},
	}
	if opts.LocalPolicy != nil {
		c.policy = *opts.LocalPolicy
	}
	if c.logger == nil {
		c.logger = log.Default()
	}
	if c.policy.HedgeLoad <= 0 {
		c.policy.HedgeLoad = 0.05
	}
	if c.opts.Timeout <= 0 {
		c.opts.Timeout = DefaultTimeout
	}
	if c.opts.TraceContext == nil {
		c.opts.TraceContext = W3CTraceContext
	}
	interval := opts.ShadowLogInterval
	if interval == 0 {
		interval = DefaultShadowLogInterval
	}
	c.shadow = newShadowLog(interval, c.logger)
	c.outage = newOutageLog(c.logger)
	connectTimeout := opts.ConnectTimeout
	if connectTimeout == 0 {
		connectTimeout = DefaultConnectTimeout
	}
	if connectTimeout > 0 {
		c.awaitConnection(connectTimeout)
	}
	return c, nil
}

// awaitConnection waits until the connection is up or has failed once, or
// for timeout. grpc-go dials as soon as grpc.Dial returns; this only waits
// for it.
func (c *Client) awaitConnection(timeout time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		state := c.conn.GetState()
		if state != connectivity.Idle && state != connectivity.Connecting {
			return // READY, TRANSIENT_FAILURE or SHUTDOWN
		}
		if !c.conn.WaitForStateChange(ctx, state) {
			return // timed out
		}
	}
}

// Layer is the client's layer name in a call chain: Options.Layer, or
// DefaultLayer() when that was empty.
func (c *Client) Layer() string { return c.opts.Layer }

// Close flushes the client's TrafficReporter (if it was used), then closes
// the connection.
func (c *Client) Close() error {
	if c.reporter != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		c.reporter.Close(ctx)
		cancel()
	}
	return c.conn.Close()
}

// Reporter is the client's own TrafficReporter, started on first use and
// flushed by Close. The Transport and the interceptor count first attempts
// on it unless told not to.
func (c *Client) Reporter() *TrafficReporter {
	c.reporterOnce.Do(func() {
		c.reporter = NewTrafficReporter(c, ReporterOptions{Interval: c.opts.ReportInterval, Logger: c.logger})
		c.reporter.Start()
	})
	return c.reporter
}

// outgoing is ctx with the metadata of a retryd call: the trace context and
// Options.Metadata, and nothing else. The caller's own outgoing metadata is
// replaced, not added to: it is meant for the caller's upstream (its
// credentials, say), not for retryd.
func (c *Client) outgoing(ctx context.Context) context.Context {
	md := metadata.MD{}
	traceparent, tracestate := c.opts.TraceContext(ctx)
	if traceparent == "" {
		if theirs, ok := metadata.FromOutgoingContext(ctx); ok && len(theirs.Get("traceparent")) > 0 {
			traceparent = theirs.Get("traceparent")[0]
			if states := theirs.Get("tracestate"); len(states) > 0 {
				tracestate = states[0]
			}
		}
	}
	if traceparent != "" {
		md.Set("traceparent", traceparent)
		if tracestate != "" {
			md.Set("tracestate", tracestate)
		}
	}
	for key, values := range c.opts.Metadata {
		md.Append(key, values...)
	}
	return metadata.NewOutgoingContext(ctx, md)
}

// callTimeout is the Decide timeout for req: Options.Timeout, bounded by
// the request's own deadline (with a floor so retryd can still answer).
func (c *Client) callTimeout(req *pb.DecideRequest) time.Duration {
	limit := c.opts.Timeout
	if req.DeadlineRemaining != nil {
		remaining := req.DeadlineRemaining.AsDuration()
		if remaining < minCallTimeout {
			remaining = minCallTimeout
		}
		if remaining < limit {
			limit = remaining
		}
	}
	return limit
}

// Decide asks retryd whether the failed attempt described by req may be
// retried. Every field of req is sent as it is (see retryd.proto); req is
// not modified. The call is bounded by Options.Timeout and by ctx.
//
// An invalid request returns an *InvalidRequestError. When retryd does not
// answer (down, slow, overloaded) the local rule decides (Decision.Fallback)
// and a warning is logged, unless Options.NoFallback is set, in which case
// an *UnavailableError is returned. For an upstream in shadow mode the
// local rule decides too, and retryd's answer is in Decision.Retryd.
func (c *Client) Decide(ctx context.Context, req *pb.DecideRequest) (Decision, error) {
	callCtx, cancel := context.WithTimeout(c.outgoing(ctx), c.callTimeout(req))
	defer cancel()
	response, err := c.decider.Decide(callCtx, req)
	if err != nil {
		return c.onError(err, req)
	}
	return c.actedOn(req, response), nil
}

func (c *Client) onError(err error, req *pb.DecideRequest) (Decision, error) {
	st := status.Convert(err)
	if st.Code() == codes.InvalidArgument {
		return Decision{}, newInvalidRequest(st.Message())
	}
	if c.opts.NoFallback {
		return Decision{}, &UnavailableError{Code: st.Code(), Message: st.Message()}
	}
	if invalid := validateLocally(req); invalid != nil {
		return Decision{}, invalid
	}
	c.outage.fallback(fmt.Sprintf("%s: %s", st.Code(), st.Message()))
	return c.localDecide(req, fmt.Sprintf("retryd unreachable (%s)", st.Code())), nil
}

// localDecide is the local rule's decision: for a hedge its own rule (see
// LocalPolicy.HedgeDelay), for a failed attempt LocalDecide.
func (c *Client) localDecide(req *pb.DecideRequest, reason string) Decision {
	if req.GetHedge() > 0 {
		return c.localHedgeDecide(req, reason)
	}
	return LocalDecide(c.policy, req, reason)
}

// firstAttemptSent counts a first attempt toward the local hedge allowance
// (only used while retryd is unreachable, and only with a HedgeDelay).
func (c *Client) firstAttemptSent(upstream string) {
	if c.policy.HedgeDelay > 0 {
		c.localHedges.earn(upstream, c.policy.HedgeLoad)
	}
}

// ReportTraffic sends one batch of first-attempt counts as it is (at most
// MaxTrafficEntries entries; see retryd.proto for report_id). Most callers
// use a [TrafficReporter] instead. Errors are *UnavailableError or
// *InvalidRequestError; status.Code works on both.
func (c *Client) ReportTraffic(ctx context.Context, req *pb.ReportTrafficRequest) (*pb.ReportTrafficResponse, error) {
	callCtx, cancel := context.WithTimeout(c.outgoing(ctx), c.slowTimeout())
	defer cancel()
	response, err := c.decider.ReportTraffic(callCtx, req)
	if err != nil {
		return nil, callError(err)
	}
	c.outage.answered()
	// Hedge delays come with the reports' answers, off the request path.
	c.hedging.update(response.GetHedging(), time.Now(), c.hedgingStale())
	return response, nil
}

func (c *Client) slowTimeout() time.Duration {
	if c.opts.Timeout > time.Second {
		return c.opts.Timeout
	}
	return time.Second
}

// SetRetriesEnabled switches retries on or off for an upstream, fleet-wide
// (admin credentials needed once retryd has authentication). It returns the
// state before the call.
func (c *Client) SetRetriesEnabled(ctx context.Context, upstream string, enabled bool, reason string) (previous bool, err error) {
	callCtx, cancel := context.WithTimeout(c.outgoing(ctx), c.slowTimeout())
	defer cancel()
	response, err := c.admin.SetRetriesEnabled(callCtx, &pb.SetRetriesEnabledRequest{Upstream: upstream, Enabled: enabled, Reason: reason})
	if err != nil {
		return false, callError(err)
	}
	return response.GetPrevious(), nil
}

// GetBudget returns the current state of one upstream's budget (admin).
func (c *Client) GetBudget(ctx context.Context, upstream string) (*pb.Budget, error) {
	callCtx, cancel := context.WithTimeout(c.outgoing(ctx), c.slowTimeout())
	defer cancel()
	response, err := c.admin.GetBudget(callCtx, &pb.GetBudgetRequest{Upstream: upstream})
	if err != nil {
		return nil, callError(err)
	}
	return response.GetBudget(), nil
}

// DecideStream is one DecideStream call to retryd, used for one decision
// after another: [DecideStream.Decide] sends a request and waits for its
// answer. It is safe for concurrent use (decisions are serialized, which is
// what the stream's in-order answers require). A stream that breaks is
// reopened by the next Decide; meanwhile the local rule decides, as for
// Client.Decide.
type DecideStream struct {
	client *Client
	ctx    context.Context

	mu     sync.Mutex
	stream pb.RetryDecider_DecideStreamClient
	cancel context.CancelFunc
	closed bool
	opened int // streams opened so far (the tests check that one suffices)
}

// DecideStream opens a stream of decisions that lives until ctx ends or
// Close is called. Opening does not wait for retryd.
func (c *Client) DecideStream(ctx context.Context) *DecideStream {
	return &DecideStream{client: c, ctx: ctx}
}

func (s *DecideStream) open() error {
	ctx, cancel := context.WithCancel(s.client.outgoing(s.ctx))
	stream, err := s.client.decider.DecideStream(ctx)
	if err != nil {
		cancel()
		return err
	}
	s.stream, s.cancel = stream, cancel
	s.opened++
	return nil
}

func (s *DecideStream) reset() {
	if s.cancel != nil {
		s.cancel()
	}
	s.stream, s.cancel = nil, nil
}

// Decide sends req on the stream and returns its decision, with the same
// errors, timeout and fallback as Client.Decide. An item retryd rejects as
// invalid is an *InvalidRequestError and leaves the stream open.
func (s *DecideStream) Decide(req *pb.DecideRequest) (Decision, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return Decision{}, errors.New("retryd: DecideStream used after Close")
	}
	if s.stream == nil {
		if err := s.open(); err != nil {
			return s.client.onError(err, req)
		}
	}
	// A stream item has no deadline of its own: if retryd does not answer in
	// time, the stream is cancelled (and reopened by the next Decide).
	timer := time.AfterFunc(s.client.callTimeout(req), s.cancel)
	response, err := s.roundTrip(req)
	stopped := timer.Stop()
	if err != nil {
		s.reset()
		if !stopped {
			err = status.Error(codes.DeadlineExceeded, "no answer on the stream in time")
		}
		return s.client.onError(err, req)
	}
	if item := response.GetError(); item != nil {
		if codes.Code(item.GetCode()) == codes.InvalidArgument {
			return Decision{}, newInvalidRequest(item.GetMessage())
		}
		return s.client.onError(status.Error(codes.Code(item.GetCode()), item.GetMessage()), req)
	}
	return s.client.actedOn(req, response), nil
}

func (s *DecideStream) roundTrip(req *pb.DecideRequest) (*pb.DecideResponse, error) {
	if err := s.stream.Send(req); err != nil {
		if err == io.EOF {
			// The real error comes from Recv.
			_, err = s.stream.Recv()
		}
		return nil, err
	}
	return s.stream.Recv()
}

// Close ends the stream.
func (s *DecideStream) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.stream != nil {
		_ = s.stream.CloseSend()
	}
	s.reset()
	return nil
}
