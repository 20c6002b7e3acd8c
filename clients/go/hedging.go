// hedging.go: what the client knows of each upstream's hedging (learned
// from the traffic reports' responses), the local rule for hedges while
// retryd is unreachable, DecideHedge (the one hedge decision, public), and
// the runner that sends a call's first attempt and its hedges and keeps the
// first answer. The Transport and the unary interceptor both run their first
// attempt through it and ask every hedge with DecideHedge.

package retryd

import (
	"context"
	"fmt"
	"sync"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// Hedging is what the client knows of one upstream's hedging, as retryd last
// served it in a ReportTraffic response (Hedging in retryd.proto).
type Hedging struct {
	Enabled     bool
	Delay       time.Duration
	MaxHedges   uint32
	Idempotency []pb.Idempotency
	// Seen is when a response last carried it.
	Seen time.Time
}

// allows says whether a call of idempotency may be hedged under h. Never
// NON_IDEMPOTENT, whatever retryd sent.
func (h Hedging) allows(idempotency pb.Idempotency) bool {
	if !h.Enabled || h.Delay <= 0 || h.MaxHedges == 0 || idempotency == pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT {
		return false
	}
	for _, allowed := range h.Idempotency {
		if allowed == idempotency {
			return true
		}
	}
	return false
}

// hedgingStaleAfter is how many report intervals an entry outlives the last
// response that carried it. A response lists only the upstreams of its own
// report, so an upstream idle for one interval is absent from it without its
// policy having changed: dropping it at once would leave the next calls
// unhedged. Three intervals (3s by default) ride out an idle interval or
// two and a re-sent batch, while an entry from a retryd that stopped
// answering (no responses at all) is gone within seconds, so that the local
// rule's hedging, not a stale delay, applies in an outage.
const hedgingStaleAfter = 3

// hedgingTable is the per-upstream hedging, bounded like the reporter's rows.
type hedgingTable struct {
	mu      sync.RWMutex
	entries map[string]Hedging
	max     int
}

func newHedgingTable(max int) *hedgingTable {
	return &hedgingTable{entries: map[string]Hedging{}, max: max}
}

// update takes the hedging of one ReportTraffic response, and drops the
// entries not seen for stale.
func (t *hedgingTable) update(served []*pb.Hedging, now time.Time, stale time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for upstream, h := range t.entries {
		if now.Sub(h.Seen) > stale {
			delete(t.entries, upstream)
		}
	}
	for _, h := range served {
		upstream := h.GetUpstream()
		if _, ok := t.entries[upstream]; !ok && len(t.entries) >= t.max {
			continue
		}
		t.entries[upstream] = Hedging{
			Enabled:     h.GetEnabled(),
			Delay:       h.GetDelay().AsDuration(),
			MaxHedges:   h.GetMaxHedges(),
			Idempotency: append([]pb.Idempotency(nil), h.GetIdempotency()...),
			Seen:        now,
		}
	}
}

func (t *hedgingTable) lookup(upstream string, now time.Time, stale time.Duration) (Hedging, bool) {
	t.mu.RLock()
	h, ok := t.entries[upstream]
	t.mu.RUnlock()
	if !ok || now.Sub(h.Seen) > stale {
		return Hedging{}, false
	}
	return h, true
}

// Hedging returns what the client knows now of upstream's hedging, from the
// latest traffic report responses; ok is false when none carried it in the
// last three report intervals.
func (c *Client) Hedging(upstream string) (h Hedging, ok bool) {
	return c.hedging.lookup(upstream, time.Now(), c.hedgingStale())
}

func (c *Client) hedgingStale() time.Duration {
	interval := c.opts.ReportInterval
	if interval <= 0 {
		interval = time.Second
	}
	return hedgingStaleAfter * interval
}

// localHedges is the local rule's allowance of hedges while retryd is
// unreachable: per upstream, each first attempt earns LocalPolicy.HedgeLoad
// of a token (up to localHedgeBurst), each hedge spends one, so that local
// hedging adds at most that share of load, like retryd's cap.
type localHedges struct {
	mu     sync.Mutex
	tokens map[string]float64
	max    int
}

// localHedgeBurst caps the tokens an upstream saves up: a burst of slow
// calls after a long quiet spell hedges at most this many.
const localHedgeBurst = 10

func (l *localHedges) earn(upstream string, load float64) {
	if load <= 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	tokens, ok := l.tokens[upstream]
	if !ok && len(l.tokens) >= l.max {
		return
	}
	tokens += load
	if tokens > localHedgeBurst {
		tokens = localHedgeBurst
	}
	l.tokens[upstream] = tokens
}

func (l *localHedges) spend(upstream string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.tokens[upstream] < 1 {
		return false
	}
	l.tokens[upstream]--
	return true
}

// localHedgeDecide is the local rule for a hedge (req.hedge >= 1): RETRY
// (backoff 0) when LocalPolicy.HedgeDelay is set, the call's idempotency is
// safe, the deadline leaves room and the upstream's local tokens allow it;
// DENY otherwise.
func (c *Client) localHedgeDecide(req *pb.DecideRequest, reason string) Decision {
	answer := func(verdict pb.Verdict, deny pb.DenyReason, why string) Decision {
		return Decision{
			Verdict: verdict, DenyReason: deny, Rule: 1, TokensRemaining: nan,
			EffectiveEvidence: pb.Evidence_EVIDENCE_SENT_NO_RESPONSE,
			Explanation:       reason + "; local rule: " + why,
			Fallback:          true,
		}
	}
	switch {
	case c.policy.HedgeDelay <= 0:
		return answer(pb.Verdict_VERDICT_DENY, pb.DenyReason_DENY_REASON_HEDGING_OFF, "no local hedging (LocalPolicy.HedgeDelay is 0)")
	case !isSafelyIdempotent(req.GetIdempotency()):
		return answer(pb.Verdict_VERDICT_DENY, pb.DenyReason_DENY_REASON_HEDGING_OFF, "only safely idempotent calls are hedged")
	case req.GetHedge() > c.policy.localMaxHedges():
		return answer(pb.Verdict_VERDICT_DENY, pb.DenyReason_DENY_REASON_HEDGING_OFF, fmt.Sprintf("hedge %d is beyond the local limit %d", req.GetHedge(), c.policy.localMaxHedges()))
	case req.DeadlineRemaining != nil && req.DeadlineRemaining.AsDuration() < c.policy.MinAttemptBudget:
		return answer(pb.Verdict_VERDICT_DENY, pb.DenyReason_DENY_REASON_DEADLINE, "the deadline leaves no room for another attempt")
	case !c.localHedges.spend(req.GetUpstream()):
		return answer(pb.Verdict_VERDICT_DENY, pb.DenyReason_DENY_REASON_HEDGE_CAP, "the local hedge allowance is spent")
	}
	return answer(pb.Verdict_VERDICT_RETRY, pb.DenyReason_DENY_REASON_UNSPECIFIED, "hedge at the local delay")
}

// HedgeRequest asks whether to send the Hedge-th hedge of a call whose first
// attempt (and the hedges before this one) are still running. Nothing has
// failed, so it carries no evidence, failure, status or Retry-After: retryd
// rejects a hedge that does.
type HedgeRequest struct {
	// Upstream and Operation name the call as its Decide would.
	Upstream  string
	Operation string
	// Idempotency is the call's declared level (required).
	Idempotency pb.Idempotency
	// Body is the call's body; nil sends none (no body: replayable).
	Body *pb.Body
	// Hedge is k >= 1, the k-th hedge of the call (retryd takes 1 to 16).
	Hedge uint32
	// Attempt is the copies sent so far: the first attempt and the hedges
	// granted before this one, so k for the k-th hedge (0 means Hedge).
	Attempt uint32
	// MaxAttempts is the call's own lower limit on attempts (0: the policy's).
	MaxAttempts uint32
	// Lineage is the call's inbound lineage (docs/lineage.md), "" for none.
	Lineage string
	// Deadline is when the call must be over; its remainder is sent as
	// deadline_remaining (zero: no deadline; past: nothing remains).
	Deadline time.Time
}

// decideRequest is the DecideRequest of h: every field as given, the
// deadline as the time left now.
func (h HedgeRequest) decideRequest() *pb.DecideRequest {
	attempt := h.Attempt
	if attempt == 0 {
		attempt = h.Hedge
	}
	req := &pb.DecideRequest{
		Upstream: h.Upstream, Operation: h.Operation, Idempotency: h.Idempotency,
		Body: h.Body, Attempt: attempt, Hedge: h.Hedge,
		MaxAttempts: h.MaxAttempts, Lineage: h.Lineage,
	}
	if !h.Deadline.IsZero() {
		req.DeadlineRemaining = remainingUntil(h.Deadline)
	}
	return req
}

// DecideHedge asks retryd whether to send the hedge h describes: RETRY
// (backoff 0) sends it now; a DENY (HEDGE_CAP, HEDGING_OFF,
// UNIFORMLY_SLOW, BUDGET_EXHAUSTED, DEADLINE, ...) sends no copy. A granted
// hedge spends a token of the upstream's retry budget. The Transport and the
// unary interceptor ask every hedge through it.
//
// Errors and fallback are Decide's: an invalid request (Hedge 0 among them,
// refused here: a failed attempt is asked with Decide) is an
// *InvalidRequestError naming the field. When retryd does not answer, the
// local hedge rule decides (Decision.Fallback: RETRY only with
// LocalPolicy.HedgeDelay set, for SAFE and IDEMPOTENT calls, within
// LocalPolicy.MaxHedges, the deadline and the local allowance; DENY
// otherwise), or, with Options.NoFallback, an *UnavailableError is
// returned. For an upstream in shadow mode the local hedge rule decides and
// retryd's answer is in Decision.Retryd.
func (c *Client) DecideHedge(ctx context.Context, h HedgeRequest) (Decision, error) {
	if h.Hedge == 0 {
		return Decision{}, newInvalidRequest("hedge: must be at least 1 (a failed attempt is asked with Decide)")
	}
	return c.Decide(ctx, h.decideRequest())
}

func (p LocalPolicy) localMaxHedges() uint32 {
	if p.MaxHedges == 0 {
		return 1
	}
	return p.MaxHedges
}

// hedgePlan is how one call is hedged: after delay, up to max hedges.
type hedgePlan struct {
	delay time.Duration
	max   int
}

// hedgePlanFor says whether and how a call to upstream of idempotency is
// hedged: as retryd last served it, or, with no entry while retryd is
// unreachable, at LocalPolicy.HedgeDelay (0: not at all).
func (c *Client) hedgePlanFor(upstream string, idempotency pb.Idempotency) (hedgePlan, bool) {
	if h, ok := c.Hedging(upstream); ok {
		if !h.allows(idempotency) {
			return hedgePlan{}, false
		}
		return hedgePlan{delay: h.Delay, max: int(h.MaxHedges)}, true
	}
	if c.policy.HedgeDelay > 0 && isSafelyIdempotent(idempotency) && c.outage.isDown() {
		return hedgePlan{delay: c.policy.HedgeDelay, max: int(c.policy.localMaxHedges())}, true
	}
	return hedgePlan{}, false
}

// copyResult is how one copy of a call (0: the first attempt, k: the k-th
// hedge) ended.
type copyResult[R any] struct {
	copy    int
	result  R
	done    bool // an answer that ends the call (not a retryable failure)
	elapsed time.Duration
}

// hedged is the outcome of a hedged first attempt: the winning copy (or the
// last failure when every copy failed), how many copies were sent, and the
// hedge decisions made.
type hedged[R any] struct {
	copyResult[R]
	sent      int
	decisions []Decision
	// cancel releases the winner's context; the caller calls it once done
	// with the result (for HTTP, when the body is closed).
	cancel context.CancelFunc
}

// runHedged sends the first attempt with send(ctx, 0) on the caller's
// goroutine, as an unhedged call is (a fast call costs a timer more, no
// goroutine hop: waiting on a goroutine for it cost ~100us a call on this
// loaded machine, BenchmarkTransportHedgedUpstream). Each time plan's delay
// passes with no answer, a timer asks decide(k, sent) for the k-th hedge and,
// on RETRY, sends it in a goroutine. The first copy whose answer ends the call
// wins; the others are cancelled (the first attempt by cancelling its context,
// which makes its send return) and their late results given to discard. Every
// copy that ends on its own is given to record, the winner included (a
// cancelled loser never is); the first attempt, cancelled because a hedge won,
// is given to cancelledFirst with the time it had run. When every copy sent
// has failed, the last failure is returned and the normal retry path decides.
func runHedged[R any](ctx context.Context, plan hedgePlan,
	send func(ctx context.Context, copy int) (R, bool),
	decide func(k, sent int) (Decision, error),
	record func(r copyResult[R]),
	cancelledFirst func(elapsed time.Duration),
	discard func(R),
) hedged[R] {
	var (
		mu        sync.Mutex // guards everything below
		firstDone bool       // the first attempt's send returned: no hedge wins it, none is sent
		winner    *copyResult[R]
		lost      = map[int]bool{} // hedges cancelled by us: recorded nowhere
		cancels   []context.CancelFunc
		sent      = 1
		decisions []Decision
		timer     *time.Timer
		// Hedges that ended on their own and did not win at once, sent under
		// mu (so never lost to a cancel racing them); never blocks.
		ended = make(chan copyResult[R], plan.max)
	)
	firstCtx, cancelFirst := context.WithCancel(ctx)
	cancels = append(cancels, cancelFirst)
	hedgeEnded := func(r copyResult[R]) {
		mu.Lock()
		defer mu.Unlock()
		if lost[r.copy] {
			discard(r.result)
			return
		}
		record(r)
		if r.done && !firstDone && winner == nil {
			winner = &r
			cancelFirst() // the first attempt's send returns; the caller takes this one
			return
		}
		ended <- r
	}
	var onTimer func()
	onTimer = func() {
		mu.Lock()
		if firstDone || winner != nil || sent-1 >= plan.max || ctx.Err() != nil {
			mu.Unlock()
			return
		}
		k := sent
		mu.Unlock()
		decision, err := decide(k, k) // on the timer's goroutine, never the caller's
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			return // an invalid request is a bug: no hedge, the first attempt runs on
		}
		decisions = append(decisions, decision)
		if !decision.ShouldRetry() || firstDone || winner != nil {
			return // denied: no copy and no more hedges; or no longer needed
		}
		copyCtx, cancel := context.WithCancel(ctx)
		cancels = append(cancels, cancel)
		copy := sent
		sent++
		if sent-1 < plan.max {
			timer = time.AfterFunc(plan.delay, onTimer)
		}
		start := time.Now()
		go func() {
			result, done := send(copyCtx, copy)
			hedgeEnded(copyResult[R]{copy: copy, result: result, done: done, elapsed: time.Since(start)})
		}()
	}
	start := time.Now() // the delay counts from here
	mu.Lock()
	timer = time.AfterFunc(plan.delay, onTimer)
	mu.Unlock()
	result, done := send(firstCtx, 0)
	first := copyResult[R]{copy: 0, result: result, done: done, elapsed: time.Since(start)}

	mu.Lock()
	firstDone = true
	timer.Stop()
	w := winner
	// loseAll cancels every hedge but keep and hands what they left to
	// discard; mu is held.
	loseAll := func(keep int) {
		for i := 1; i < len(cancels); i++ {
			if i != keep {
				lost[i] = true
				cancels[i]()
			}
		}
		for {
			select {
			case r := <-ended:
				if r.copy != keep {
					discard(r.result)
				}
			default:
				return
			}
		}
	}
	out := hedged[R]{sent: sent}
	if w != nil {
		// A hedge won and cancelled the first attempt: its result is the
		// cancellation, and the time it ran a lower bound of its latency.
		discard(first.result)
		cancelledFirst(first.elapsed)
		loseAll(w.copy)
		out.copyResult, out.cancel, out.decisions = *w, cancels[w.copy], decisions
		mu.Unlock()
		return out
	}
	record(first)
	if first.done || sent == 1 {
		loseAll(-1)
		out.copyResult, out.cancel, out.decisions = first, cancelFirst, decisions
		mu.Unlock()
		return out
	}
	waiting := sent - 1 // every hedge sent and not lost ends in ended
	mu.Unlock()
	// The first attempt failed with hedges sent: the first of them to end
	// the call wins, else the last failure goes to the retry path.
	last := first
	for i := 0; i < waiting; i++ {
		r := <-ended
		discard(last.result)
		cancels[last.copy]()
		last = r
		if r.done {
			mu.Lock()
			loseAll(r.copy)
			out.decisions = decisions
			mu.Unlock()
			out.copyResult, out.cancel = r, cancels[r.copy]
			return out
		}
	}
	mu.Lock()
	out.decisions = decisions
	mu.Unlock()
	out.copyResult, out.cancel = last, cancels[last.copy]
	return out
}

// recordHedgeWon counts a hedged call whose answer came from a hedge (won,
// see copyResult.won) on the client's reporter, unless the caller cancelled
// ctx (an abandoned call is counted nowhere, as its attempts are not). A
// call its first attempt answered, or whose every copy failed (the retry
// path takes the last failure), is not a hedge won: retryd knows the hedges
// it granted, and granted minus won is the hedges that lost.
func (c *Client) recordHedgeWon(ctx context.Context, upstream string, won bool) {
	if !won || ctx.Err() == context.Canceled {
		return
	}
	c.Reporter().RecordHedgeWon(upstream, 1)
}

// won says whether a hedge (copy 1 or later) answered and its answer ended
// the call: a success, or a status that is no retryable failure.
func (r copyResult[R]) won() bool { return r.copy > 0 && r.done }
