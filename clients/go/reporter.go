package retryd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log"
	"sort"
	"sync"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ReporterOptions configures a [TrafficReporter]. The zero value is usable.
type ReporterOptions struct {
	// Interval is how often pending counts are sent (1s when zero).
	Interval time.Duration
	// MaxUpstreams bounds the distinct upstreams held while retryd is
	// unreachable (10000 when zero); counts for more are dropped (their
	// requests counted in Dropped, their outcomes with them).
	MaxUpstreams int
	// Logger receives the warnings; nil means the standard logger.
	Logger *log.Logger
}

// Traffic is what a report carries for one upstream: the first attempts
// sent, how attempts ended (see [TrafficReporter.RecordOutcome]), and the
// hedged calls a hedge answered (see [TrafficReporter.RecordHedgeWon]).
type Traffic struct {
	Requests       uint64
	Successes      uint64
	Failures       uint64
	RetrySuccesses uint64
	RetryFailures  uint64
	HedgesWon      uint64
}

func (t *Traffic) add(o Traffic) {
	t.Requests += o.Requests
	t.Successes += o.Successes
	t.Failures += o.Failures
	t.RetrySuccesses += o.RetrySuccesses
	t.RetryFailures += o.RetryFailures
	t.HedgesWon += o.HedgesWon
}

// row is what is pending for one upstream: its counts and its latencies.
type row struct {
	Traffic
	latency Latency
}

func histogramOf(counts map[uint32]uint64) *pb.LatencyHistogram {
	if len(counts) == 0 {
		return nil
	}
	copied := make(map[uint32]uint64, len(counts))
	for b, n := range counts {
		copied[b] = n
	}
	return &pb.LatencyHistogram{Counts: copied}
}

func latencyOf(entry *pb.UpstreamTraffic) Latency {
	return Latency{Successes: entry.GetLatencySuccesses().GetCounts(), Failures: entry.GetLatencyFailures().GetCounts()}
}

func trafficOf(entry *pb.UpstreamTraffic) Traffic {
	return Traffic{
		Requests: entry.GetRequests(), Successes: entry.GetSuccesses(), Failures: entry.GetFailures(),
		RetrySuccesses: entry.GetRetrySuccesses(), RetryFailures: entry.GetRetryFailures(),
		HedgesWon: entry.GetHedgesWon(),
	}
}

// TrafficReporter batches first-attempt counts into ReportTraffic calls.
//
// Budgets fill from reported first attempts only ("retries never fund
// retries"), so call Record once per real request, never for a retry.
//
// Reports also carry outcomes, so that a budget can follow the upstream's
// health: call RecordOutcome once per finished attempt, first attempts
// (successes, failures) apart from retries (retry_successes,
// retry_failures). An attempt is a failure when the caller asked (or would
// ask) retryd or its local rule whether to retry it (not sent, no response,
// a retryable status); every other ending is a success, a 404 included. An
// attempt the caller cancelled or abandoned is neither. [Transport] and
// the unary interceptor record every attempt's outcome by default, and the
// hedged calls a hedge answered ([TrafficReporter.RecordHedgeWon]). A batch
// carries each upstream's requests and outcomes together, and a re-sent
// batch the same counts.
//
// Record and RecordOutcome only add to a counter under a lock; a goroutine sends the counts
// every Interval, in batches of at most MaxTrafficEntries entries, each with
// a random report_id.
//
// A batch retryd did not take (unreachable, timed out, ABORTED, a partial
// failure) is re-sent later with the same id and the same entries in the
// same order, so retryd applies each entry at most once; counts recorded
// meanwhile wait for the next batch. A batch refused for good
// (PERMISSION_DENIED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT) is dropped with
// one warning, and its requests are added to Dropped.
type TrafficReporter struct {
	client   *Client
	interval time.Duration
	max      int
	logger   *log.Logger

	mu      sync.Mutex
	pending map[string]*row
	dropped uint64

	sendMu  sync.Mutex                 // one flush at a time
	unsent  []*pb.ReportTrafficRequest // batches cut but not yet taken, oldest first
	stop    chan struct{}
	done    chan struct{}
	started bool
}

// NewTrafficReporter returns a reporter sending through client. Call Start
// to send in the background, or Flush yourself.
func NewTrafficReporter(client *Client, opts ReporterOptions) *TrafficReporter {
	r := &TrafficReporter{
		client:   client,
		interval: opts.Interval,
		max:      opts.MaxUpstreams,
		logger:   opts.Logger,
		pending:  map[string]*row{},
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
	}
	if r.interval <= 0 {
		r.interval = time.Second
	}
	if r.max <= 0 {
		r.max = 10000
	}
	if r.logger == nil {
		r.logger = log.Default()
	}
	return r
}

// Record counts n first attempts to upstream.
func (r *TrafficReporter) Record(upstream string, n uint64) {
	r.add(upstream, Traffic{Requests: n})
}

// RecordOutcome counts how n attempts to upstream ended: retry false for
// first attempts (successes, failures), true for the attempts after them
// (retry_successes, retry_failures). See [TrafficReporter] for the rule.
func (r *TrafficReporter) RecordOutcome(upstream string, success, retry bool, n uint64) {
	var t Traffic
	switch {
	case !retry && success:
		t.Successes = n
	case !retry:
		t.Failures = n
	case success:
		t.RetrySuccesses = n
	default:
		t.RetryFailures = n
	}
	r.add(upstream, t)
}

func (r *TrafficReporter) add(upstream string, t Traffic) {
	if t == (Traffic{}) || upstream == "" {
		return
	}
	r.mu.Lock()
	if pending := r.row(upstream); pending != nil {
		pending.add(t)
	} else {
		r.dropped += t.Requests // the outcomes go with them
	}
	r.mu.Unlock()
}

// RecordHedgeWon counts n hedged calls to upstream whose answer came from a
// hedge rather than from the first attempt (UpstreamTraffic.hedges_won in
// retryd.proto): only the caller knows which copy answered, and retryd
// counts them in retryd_hedges_won_total (granted minus won is the hedges
// that lost). A call answered by its first attempt is not counted, nor one
// whose every copy failed. [Transport] and the unary interceptor do this by
// default.
func (r *TrafficReporter) RecordHedgeWon(upstream string, n uint64) {
	r.add(upstream, Traffic{HedgesWon: n})
}

// row is upstream's pending row, made if there is room (nil if not); r.mu
// is held.
func (r *TrafficReporter) row(upstream string) *row {
	if pending, ok := r.pending[upstream]; ok {
		return pending
	}
	if len(r.pending) >= r.max {
		return nil
	}
	pending := &row{}
	r.pending[upstream] = pending
	return pending
}

// RecordLatency counts how long one first attempt to upstream took, from
// sending it to the end of its response, in the success or the failure
// histogram (the same classification as RecordOutcome). Retries and hedges
// must not be recorded; a first attempt cancelled because a hedge answered
// first is recorded as a success with the time it had run (see
// UpstreamTraffic.latency_successes in retryd.proto). [Transport] and the
// unary interceptor do this by default. The cost is a map increment under
// the reporter's lock (BENCHMARKS.md); a row holds at most 238 buckets per
// histogram, and upstreams beyond MaxUpstreams are dropped as for counts.
func (r *TrafficReporter) RecordLatency(upstream string, success bool, d time.Duration) {
	if upstream == "" {
		return
	}
	r.mu.Lock()
	if pending := r.row(upstream); pending != nil {
		pending.latency.record(success, d)
	}
	r.mu.Unlock()
}

// Pending returns the requests not yet sent: those recorded since the last
// batch was cut plus those of batches retryd has not taken yet.
func (r *TrafficReporter) Pending() map[string]uint64 {
	counts := map[string]uint64{}
	for upstream, t := range r.PendingTraffic() {
		if t.Requests > 0 {
			counts[upstream] = t.Requests
		}
	}
	return counts
}

// PendingTraffic is [TrafficReporter.Pending] with the outcomes.
func (r *TrafficReporter) PendingTraffic() map[string]Traffic {
	r.sendMu.Lock()
	defer r.sendMu.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	counts := make(map[string]Traffic, len(r.pending))
	for upstream, t := range r.pending {
		if t.Traffic != (Traffic{}) {
			counts[upstream] = t.Traffic
		}
	}
	for _, batch := range r.unsent {
		for _, entry := range batch.GetTraffic() {
			t := counts[entry.GetUpstream()]
			t.add(trafficOf(entry))
			counts[entry.GetUpstream()] = t
		}
	}
	return counts
}

// PendingLatency is [TrafficReporter.PendingTraffic] for the latency
// histograms: recorded since the last cut plus those of batches not taken.
func (r *TrafficReporter) PendingLatency() map[string]Latency {
	r.sendMu.Lock()
	defer r.sendMu.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	latencies := map[string]Latency{}
	add := func(upstream string, l Latency) {
		if l.empty() {
			return
		}
		sum := latencies[upstream]
		sum.add(l)
		latencies[upstream] = sum
	}
	for upstream, t := range r.pending {
		add(upstream, t.latency)
	}
	for _, batch := range r.unsent {
		for _, entry := range batch.GetTraffic() {
			add(entry.GetUpstream(), latencyOf(entry))
		}
	}
	return latencies
}

// Dropped is the number of requests never reported: over MaxUpstreams, or
// in a batch retryd refused for good.
func (r *TrafficReporter) Dropped() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.dropped
}

// newReportID is a random UUID (version 4), as the contract suggests.
func newReportID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		// crypto/rand does not fail on supported platforms; without an id
		// the report is still valid, only not deduplicated.
		return ""
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// cut turns the pending counts into batches (in upstream order, so a batch
// is deterministic) and empties them.
func (r *TrafficReporter) cut() []*pb.ReportTrafficRequest {
	r.mu.Lock()
	counts := r.pending
	r.pending = map[string]*row{}
	r.mu.Unlock()
	upstreams := make([]string, 0, len(counts))
	for upstream := range counts {
		upstreams = append(upstreams, upstream)
	}
	sort.Strings(upstreams)
	var batches []*pb.ReportTrafficRequest
	for start := 0; start < len(upstreams); start += MaxTrafficEntries {
		end := start + MaxTrafficEntries
		if end > len(upstreams) {
			end = len(upstreams)
		}
		batch := &pb.ReportTrafficRequest{ReportId: newReportID()}
		for _, upstream := range upstreams[start:end] {
			t := counts[upstream]
			// A re-sent batch is this very message: the same histograms.
			batch.Traffic = append(batch.Traffic, &pb.UpstreamTraffic{
				Upstream: upstream, Requests: t.Requests, Successes: t.Successes, Failures: t.Failures,
				RetrySuccesses: t.RetrySuccesses, RetryFailures: t.RetryFailures, HedgesWon: t.HedgesWon,
				LatencySuccesses: histogramOf(t.latency.Successes), LatencyFailures: histogramOf(t.latency.Failures),
			})
		}
		batches = append(batches, batch)
	}
	return batches
}

// isPermanent says whether retryd refused a report for good: re-sending the
// same batch would be refused again.
func isPermanent(code codes.Code) bool {
	switch code {
	case codes.PermissionDenied, codes.ResourceExhausted, codes.InvalidArgument:
		return true
	}
	return false
}

// Flush sends what is pending now: first the batches retryd has not taken
// yet (same ids), then, once they are all taken, the counts recorded since.
// It returns the first error of a batch that is kept for a re-send; a batch
// dropped for good is not an error (it is logged and counted in Dropped).
func (r *TrafficReporter) Flush(ctx context.Context) error {
	r.sendMu.Lock()
	defer r.sendMu.Unlock()
	// While old batches are unsent, new counts keep accumulating in pending
	// (bounded by MaxUpstreams) rather than in ever more batches.
	if len(r.unsent) == 0 {
		r.unsent = r.cut()
	}
	for len(r.unsent) > 0 {
		batch := r.unsent[0]
		_, err := r.client.ReportTraffic(ctx, batch)
		if err != nil {
			code := status.Code(err)
			if !isPermanent(code) {
				// Kept for a re-send; the client warns once per outage.
				r.client.outage.reportFailed(err.Error())
				return err
			}
			r.client.outage.answered() // retryd did answer, with a refusal
			var requests uint64
			for _, entry := range batch.GetTraffic() {
				requests += entry.GetRequests()
			}
			r.mu.Lock()
			r.dropped += requests
			r.mu.Unlock()
			r.logger.Printf("retryd: traffic report %s refused (%s), dropping its %d request(s) for %d upstream(s): %v",
				batch.GetReportId(), code, requests, len(batch.GetTraffic()), err)
		}
		r.unsent = r.unsent[1:]
		if len(r.unsent) == 0 {
			// Everything old is taken: what was recorded meanwhile goes now.
			r.unsent = r.cut()
		}
	}
	return nil
}

// Start sends pending counts every Interval until Close.
func (r *TrafficReporter) Start() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.started {
		return
	}
	r.started = true
	go r.run()
}

func (r *TrafficReporter) run() {
	defer close(r.done)
	ticker := time.NewTicker(r.interval)
	defer ticker.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-ticker.C:
			ctx, cancel := context.WithTimeout(context.Background(), r.interval+time.Second)
			_ = r.Flush(ctx) // a failure is logged and kept for the next tick
			cancel()
		}
	}
}

// Close stops the background goroutine and sends what is left, within ctx.
func (r *TrafficReporter) Close(ctx context.Context) error {
	r.mu.Lock()
	started := r.started
	r.started = false
	r.mu.Unlock()
	if started {
		close(r.stop)
		<-r.done
	}
	return r.Flush(ctx)
}

// FailureCodes are the gRPC codes that make an attempt a failure in the
// reporter's outcome counts: those the retry tables can retry (UNAVAILABLE
// and DEADLINE_EXCEEDED as 502-504 and "no response", RESOURCE_EXHAUSTED as
// 429, UNAUTHENTICATED as 401, INTERNAL and UNKNOWN as 500), the twins of
// DefaultRetryStatuses. Every other code is a success (the upstream
// answered, as a 404), except CANCELLED: the caller's own, counted as
// neither.
var FailureCodes = map[codes.Code]bool{
	codes.Unavailable: true, codes.DeadlineExceeded: true, codes.ResourceExhausted: true,
	codes.Unauthenticated: true, codes.Internal: true, codes.Unknown: true,
}

// recordAttempt counts one attempt's outcome on the client's reporter,
// and a first attempt's latency (elapsed), unless the caller cancelled ctx
// (an abandoned attempt is neither).
func (c *Client) recordAttempt(ctx context.Context, upstream string, attempt int, success bool, elapsed time.Duration) {
	if ctx.Err() == context.Canceled {
		return
	}
	reporter := c.Reporter()
	reporter.RecordOutcome(upstream, success, attempt > 1, 1)
	if attempt == 1 {
		reporter.RecordLatency(upstream, success, elapsed)
	}
}
