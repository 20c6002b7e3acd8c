// hedging.go: what the client knows of each upstream's hedging (learned
// from the traffic reports' responses), the local rule for hedges while
// retryd is unreachable, and the runner that sends a call's first attempt
// and its hedges and keeps the first answer. The Transport and the unary
// interceptor both run their first attempt through it.

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

// runHedged sends the first attempt with send(ctx, 0) and, each time plan's
// delay passes with no answer, asks decide(k, sent) for the k-th hedge and,
// on RETRY, sends it. The first copy whose answer ends the call wins; the
// others are cancelled and their late results given to discard. Every copy
// that ends before the winner is chosen, the winner included, is given to
// record (a cancelled loser never is); the
// first attempt, cancelled because a hedge won, is given to cancelledFirst
// with the time it had run. When every copy sent has failed, the last
// failure is returned and the normal retry path decides.
func runHedged[R any](ctx context.Context, plan hedgePlan,
	send func(ctx context.Context, copy int) (R, bool),
	decide func(k, sent int) (Decision, error),
	record func(r copyResult[R]),
	cancelledFirst func(elapsed time.Duration),
	discard func(R),
) hedged[R] {
	results := make(chan copyResult[R], plan.max+1)
	var cancels []context.CancelFunc
	starts := []time.Time{}
	launch := func(copy int) {
		copyCtx, cancel := context.WithCancel(ctx)
		cancels = append(cancels, cancel)
		start := time.Now()
		starts = append(starts, start)
		go func() {
			result, done := send(copyCtx, copy)
			results <- copyResult[R]{copy: copy, result: result, done: done, elapsed: time.Since(start)}
		}()
	}
	launch(0)
	out := hedged[R]{sent: 1}
	timer := time.NewTimer(plan.delay)
	defer timer.Stop()
	timerOn := true
	inFlight := 1
	var last *copyResult[R]
	firstRunning := true
	for {
		var fire <-chan time.Time
		if timerOn {
			fire = timer.C
		}
		select {
		case r := <-results:
			inFlight--
			if r.copy == 0 {
				firstRunning = false
			}
			record(r)
			if r.done {
				for i, cancel := range cancels {
					if i != r.copy {
						cancel()
					}
				}
				if firstRunning {
					// The first attempt was still running: the time it ran
					// is a lower bound of its latency (see the proto).
					cancelledFirst(time.Since(starts[0]))
				}
				if last != nil {
					discard(last.result) // an earlier copy's failure, superseded
				}
				drain(results, inFlight, discard)
				out.copyResult, out.cancel = r, cancels[r.copy]
				return out
			}
			if last != nil {
				discard(last.result)
				cancels[last.copy]()
			}
			last = &r
			if inFlight == 0 {
				out.copyResult, out.cancel = r, cancels[r.copy]
				return out
			}
		case <-fire:
			timerOn = false
			if out.sent-1 >= plan.max || ctx.Err() != nil {
				continue
			}
			decision, err := decide(out.sent, out.sent)
			if err != nil {
				// An invalid request is a bug: let the copies in flight
				// finish, without more hedges, and say nothing more here.
				continue
			}
			out.decisions = append(out.decisions, decision)
			if !decision.ShouldRetry() {
				continue // denied: no copy, and no more hedges for this call
			}
			if len(results) > 0 {
				// A copy ended while retryd decided: handle it first rather
				// than send a copy the call may no longer need.
				continue
			}
			launch(out.sent)
			out.sent++
			inFlight++
			if out.sent-1 < plan.max {
				timer.Reset(plan.delay)
				timerOn = true
			}
		}
	}
}

// drain hands the late results of cancelled copies to discard, in the
// background: a cancelled copy ends promptly, but the winner need not wait.
func drain[R any](results chan copyResult[R], n int, discard func(R)) {
	if n == 0 {
		return
	}
	go func() {
		for i := 0; i < n; i++ {
			discard((<-results).result)
		}
	}()
}
