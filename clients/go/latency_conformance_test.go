package retryd

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// Every vector of conformance/latency_buckets.json (each bucket's first
// value, the values around it, and values up to 2^64-1), through
// LatencyBucket: the same buckets as retryd and the other clients.
func TestLatencyBucketsOfTheConformanceVectors(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "..", "conformance", "latency_buckets.json"))
	if err != nil {
		t.Fatal(err)
	}
	var vectors struct {
		MaxBucket uint32           `json:"max_bucket"`
		Starts    [][2]json.Number `json:"starts"`
		Pairs     [][2]json.Number `json:"pairs"`
	}
	decoder := json.NewDecoder(bytes.NewReader(data))
	decoder.UseNumber() // values beyond 2^53 do not survive a float64
	if err := decoder.Decode(&vectors); err != nil {
		t.Fatal(err)
	}
	if vectors.MaxBucket != MaxLatencyBucket || len(vectors.Starts) != MaxLatencyBucket+1 || len(vectors.Pairs) == 0 {
		t.Fatalf("max_bucket %d, %d starts, %d pairs", vectors.MaxBucket, len(vectors.Starts), len(vectors.Pairs))
	}
	check := func(micros, bucket json.Number) {
		v, err := strconv.ParseUint(micros.String(), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		b, err := strconv.ParseUint(bucket.String(), 10, 32)
		if err != nil {
			t.Fatal(err)
		}
		if got := LatencyBucket(v); got != uint32(b) {
			t.Errorf("LatencyBucket(%d) = %d, want %d", v, got, b)
		}
	}
	for i, start := range vectors.Starts { // [bucket, its first microsecond]
		if start[0].String() != strconv.Itoa(i) {
			t.Fatalf("starts[%d] is bucket %s", i, start[0])
		}
		check(start[1], start[0])
	}
	for _, pair := range vectors.Pairs { // [microseconds, bucket]
		check(pair[0], pair[1])
	}
}
