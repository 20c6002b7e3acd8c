package retryd

import (
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"testing"
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
