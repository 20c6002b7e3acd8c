package retryd

import (
	"log"
	"strings"
	"sync"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// DefaultShadowLogInterval is the least time between two warnings about
// shadow decisions that differ from the local rule, per upstream, unless
// Options.ShadowLogInterval says otherwise.
const DefaultShadowLogInterval = time.Minute

// shadowReason starts the explanation of a decision made by the local rule
// because retryd's answer was a shadow one.
const shadowReason = "retryd shadow answer, not enforced (upstream in shadow mode)"

// actedOn is the decision to act on for retryd's answer to req: retryd's
// own, or, for a shadow answer (an upstream with enforce = false), the
// local rule's with retryd's beside it. It is the same rule the client
// falls back to, with the client's LocalPolicy, whether or not NoFallback
// is set: retryd did answer, it only asked not to be obeyed.
func (c *Client) actedOn(req *pb.DecideRequest, response *pb.DecideResponse) Decision {
	c.outage.answered()
	answer := decisionOf(response)
	if !answer.Shadow {
		return answer
	}
	local := c.localDecide(req, shadowReason)
	if differ(answer, local) {
		c.shadow.record(req.GetUpstream(), answer, local)
	}
	local.Fallback = false
	local.Shadow = true
	local.DecisionID = answer.DecisionID
	local.Retryd = &answer
	return local
}

// ShadowDivergences returns how many shadow answers disagreed with the
// local rule (in verdict or deny reason), per upstream, since the client
// was made. Upstreams with no difference are absent. The map is a copy.
func (c *Client) ShadowDivergences() map[string]uint64 {
	return c.shadow.counts()
}

// differ reports whether two decisions disagree on what to do (the backoff
// aside: it is jittered).
func differ(retryd, local Decision) bool {
	return retryd.Verdict != local.Verdict || retryd.DenyReason != local.DenyReason
}

// describeDecision is the verdict and, for a DENY, its reason: "DENY BUDGET_EXHAUSTED".
func describeDecision(d Decision) string {
	if d.DenyReason == pb.DenyReason_DENY_REASON_UNSPECIFIED {
		return verdictName(d)
	}
	return verdictName(d) + " " + strings.TrimPrefix(d.DenyReason.String(), "DENY_REASON_")
}

// shadowLog counts the differences between retryd's shadow decisions and
// the local rule per upstream, and logs at most one line per upstream per
// interval, saying how many were not logged since the previous line.
type shadowLog struct {
	interval time.Duration
	logger   *log.Logger
	now      func() time.Time // replaceable in tests

	mu        sync.Mutex
	upstreams map[string]*shadowUpstream
}

type shadowUpstream struct {
	count    uint64
	unlogged uint64
	loggedAt time.Time // zero: never logged
}

func newShadowLog(interval time.Duration, logger *log.Logger) *shadowLog {
	return &shadowLog{interval: interval, logger: logger, now: time.Now, upstreams: map[string]*shadowUpstream{}}
}

func (s *shadowLog) record(upstream string, retryd, local Decision) {
	s.mu.Lock()
	now := s.now()
	state := s.upstreams[upstream]
	if state == nil {
		state = &shadowUpstream{}
		s.upstreams[upstream] = state
	}
	state.count++
	if !state.loggedAt.IsZero() && now.Sub(state.loggedAt) < s.interval {
		state.unlogged++
		s.mu.Unlock()
		return
	}
	unlogged := state.unlogged
	state.unlogged, state.loggedAt = 0, now
	s.mu.Unlock()
	s.logger.Printf("retryd: shadow decision for upstream %q differs from the local rule: retryd %s, local rule %s (acted on); %d more difference(s) for this upstream not logged since the last line",
		upstream, describeDecision(retryd), describeDecision(local), unlogged)
}

func (s *shadowLog) counts() map[string]uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]uint64, len(s.upstreams))
	for upstream, state := range s.upstreams {
		out[upstream] = state.count
	}
	return out
}
