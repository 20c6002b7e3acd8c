package retryd

import (
	"log"
	"sync"
	"time"
)

// outageLog turns the failures of calls to retryd into one warning when
// retryd becomes unreachable and one when it answers again, with what
// happened meanwhile: a fallback decision or a traffic batch not taken is a
// count, not a line. (Logging each one gave six warnings for six decisions,
// plus one per batch, for one outage.)
type outageLog struct {
	logger *log.Logger
	now    func() time.Time

	mu        sync.Mutex
	down      bool
	since     time.Time
	decisions uint64 // decided by the local rule since the outage began
	reports   uint64 // traffic batches not taken since the outage began
}

func newOutageLog(logger *log.Logger) *outageLog {
	return &outageLog{logger: logger, now: time.Now}
}

// begin marks retryd unreachable, reporting whether it was not already.
// The callers hold mu while they log, so that a line is written in the
// order of the state changes it describes: a test (or an operator) that
// sees retryd answer again also sees the line that says so.
func (o *outageLog) begin() (began bool) {
	if !o.down {
		o.down, o.since = true, o.now()
		o.decisions, o.reports = 0, 0
		return true
	}
	return false
}

// fallback records a decision the local rule made because retryd did not
// answer (cause says how).
func (o *outageLog) fallback(cause string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	began := o.begin()
	o.decisions++
	if began {
		o.logger.Printf("retryd: unreachable (%s); the local rule decides until it answers again (one warning per outage)", cause)
	}
}

// reportFailed records a traffic batch retryd did not take; it is kept and
// re-sent.
func (o *outageLog) reportFailed(cause string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	began := o.begin()
	o.reports++
	if began {
		o.logger.Printf("retryd: unreachable (%s); traffic counts are kept and re-sent when it answers again (one warning per outage)", cause)
	}
}

// answered records a call retryd answered, ending an outage if one was on.
func (o *outageLog) answered() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.down {
		return
	}
	o.down = false
	o.logger.Printf("retryd: answering again after %s unreachable; meanwhile %d decision(s) were made by the local rule and %d traffic batch(es) were not taken (kept, re-sent)",
		o.now().Sub(o.since).Round(time.Millisecond), o.decisions, o.reports)
}

// isDown says whether retryd is unreachable now (the last call to it failed).
func (o *outageLog) isDown() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.down
}
