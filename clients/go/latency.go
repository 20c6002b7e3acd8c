package retryd

import (
	"math/bits"
	"time"
)

// MaxLatencyBucket is the bucket of one hour, the longest latency a
// histogram tells apart (a longer one counts as one hour).
const MaxLatencyBucket = 237

// maxLatencyMicros is one hour in microseconds.
const maxLatencyMicros = uint64(time.Hour / time.Microsecond)

// LatencyBucket is the bucket of a latency of micros microseconds in the
// contract's log-linear histogram (LatencyHistogram in retryd.proto), the
// same in every client: micros itself below 16, otherwise 8*(e-2) + (m-8)
// with e = floor(log2 micros) and m its top four bits (8 to 15). Integer
// arithmetic only, so that no client rounds a boundary differently.
func LatencyBucket(micros uint64) uint32 {
	if micros > maxLatencyMicros {
		micros = maxLatencyMicros
	}
	if micros < 16 {
		return uint32(micros)
	}
	e := uint(bits.Len64(micros) - 1)
	m := micros >> (e - 3)
	return uint32(8*(e-2)) + uint32(m-8)
}

// latencyBucketOf is the bucket of d (a negative d, from a clock step,
// counts as 0).
func latencyBucketOf(d time.Duration) uint32 {
	if d < 0 {
		d = 0
	}
	return LatencyBucket(uint64(d / time.Microsecond))
}

// Latency is what a report carries of one upstream's first-attempt
// latencies: bucket (see [LatencyBucket]) -> count, for the successes and,
// apart, the failures. Empty buckets are absent.
type Latency struct {
	Successes map[uint32]uint64
	Failures  map[uint32]uint64
}

func (l *Latency) empty() bool { return len(l.Successes) == 0 && len(l.Failures) == 0 }

// record counts one latency. At most MaxLatencyBucket+1 buckets each, so a
// row is bounded whatever the traffic.
func (l *Latency) record(success bool, d time.Duration) {
	target := &l.Failures
	if success {
		target = &l.Successes
	}
	if *target == nil {
		*target = make(map[uint32]uint64, 8)
	}
	(*target)[latencyBucketOf(d)]++
}

func addCounts(into *map[uint32]uint64, from map[uint32]uint64) {
	if len(from) == 0 {
		return
	}
	if *into == nil {
		*into = make(map[uint32]uint64, len(from))
	}
	for b, n := range from {
		(*into)[b] += n
	}
}

func (l *Latency) add(o Latency) {
	addCounts(&l.Successes, o.Successes)
	addCounts(&l.Failures, o.Failures)
}
