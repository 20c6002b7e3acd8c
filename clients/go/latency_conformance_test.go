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
		MaxBucket uint32          `json:"max_bucket"`
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
	for _, pair := range append(vectors.Starts, vectors.Pairs...) {
		micros, err := strconv.ParseUint(pair[0].String(), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		bucket, err := strconv.ParseUint(pair[1].String(), 10, 32)
		if err != nil {
			t.Fatal(err)
		}
		if got := LatencyBucket(micros); got != uint32(bucket) {
			t.Errorf("LatencyBucket(%d) = %d, want %d", micros, got, bucket)
		}
	}
}
