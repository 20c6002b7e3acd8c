package retryd

import (
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/protobuf/types/known/durationpb"
)

// The Transport's own cost per successful call, against the bare
// http.Transport on the same loopback server: a successful attempt asks
// retryd nothing (it is not even running here), it only counts the first
// attempt for the batched report and traces the attempt.
//
//	go test -run '^$' -bench 'Transport' -benchmem -count 5 .
func benchmarkServer(b *testing.B) *httptest.Server {
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("ok"))
	}))
	b.Cleanup(server.Close)
	return server
}

func runRequests(b *testing.B, rt http.RoundTripper, ctx context.Context, url string) {
	client := &http.Client{Transport: rt}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

func BenchmarkTransportBare(b *testing.B) {
	server := benchmarkServer(b)
	runRequests(b, &http.Transport{}, context.Background(), server.URL)
}

func BenchmarkTransportRetryd(b *testing.B) {
	server := benchmarkServer(b)
	client, err := New(closedAddr(b), Options{Logger: log.New(io.Discard, "", 0)})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { client.Close() })
	transport := &Transport{Base: &http.Transport{}, Client: client, Upstream: "bench"}
	runRequests(b, transport, safe(context.Background()), server.URL)
	if client.Reporter().Pending()["bench"] == 0 && client.Reporter().Dropped() == 0 {
		b.Fatal("no first attempt was counted")
	}
}

// The reporter's cost per recorded first attempt: its outcome and its latency
// (what the Transport and the interceptor add to every completed first
// attempt), and the latency alone, with latencies spread over ~20 buckets
// as a real upstream's would be.
//
//	go test -run '^$' -bench 'Record' -benchmem -count 5 .
func benchmarkReporter(b *testing.B) *TrafficReporter {
	client, err := New(closedAddr(b), Options{Logger: log.New(io.Discard, "", 0), ConnectTimeout: -1})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { client.Close() })
	return NewTrafficReporter(client, ReporterOptions{})
}

func latencies() []time.Duration {
	spread := make([]time.Duration, 64)
	for i := range spread {
		spread[i] = time.Duration(500+i*i*37) * time.Microsecond
	}
	return spread
}

func BenchmarkRecordLatency(b *testing.B) {
	reporter, spread := benchmarkReporter(b), latencies()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		reporter.RecordLatency("bench", true, spread[i&63])
	}
}

func BenchmarkRecordFirstAttempt(b *testing.B) {
	reporter, spread := benchmarkReporter(b), latencies()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		reporter.RecordOutcome("bench", true, false, 1)
		reporter.RecordLatency("bench", true, spread[i&63])
	}
}

func BenchmarkRecordOutcomeOnly(b *testing.B) {
	reporter := benchmarkReporter(b)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		reporter.RecordOutcome("bench", true, false, 1)
	}
}

// A successful call on an upstream whose hedging retryd serves (a delay of
// 200ms that no call here reaches: the first attempt runs in a goroutine
// with a hedge timer) against the same call on an upstream without hedging.
//
//	go test -run '^$' -bench 'TransportHedg|TransportRetryd' -benchmem -count 5 .
func BenchmarkTransportHedgedUpstream(b *testing.B) {
	server := benchmarkServer(b)
	// The entry outlives three report intervals: an hour here.
	client, err := New(closedAddr(b), Options{Logger: log.New(io.Discard, "", 0), ReportInterval: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { client.Close() })
	// As a ReportTraffic response would have served it.
	client.hedging.update([]*pb.Hedging{{
		Upstream: "bench-hedged", Enabled: true, Delay: durationpb.New(200 * time.Millisecond), MaxHedges: 1,
		Idempotency: []pb.Idempotency{pb.Idempotency_IDEMPOTENCY_SAFE},
	}}, time.Now(), time.Hour)
	transport := &Transport{Base: &http.Transport{}, Client: client, Upstream: "bench-hedged"}
	runRequests(b, transport, safe(context.Background()), server.URL)
	if _, ok := client.Hedging("bench-hedged"); !ok {
		b.Fatal("the hedging entry went stale during the run")
	}
}
