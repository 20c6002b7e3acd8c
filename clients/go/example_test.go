package retryd_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"time"

	retryd "github.com/retryd/retryd/clients/go"
	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// An http.Client whose retries retryd decides. Here retryd is not running,
// so the conservative local rule decides (a safe GET after a 503 is retried
// once); with retryd at the address, retryd does.
func ExampleTransport() {
	var calls atomic.Int32
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprint(w, "item 7")
	}))
	defer upstream.Close()

	client, err := retryd.New("127.0.0.1:1", retryd.Options{Logger: log.New(io.Discard, "", 0)})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	http := &http.Client{Transport: &retryd.Transport{Client: client, Upstream: "catalog"}}

	// Idempotency is declared, never guessed from the method.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ctx = retryd.WithIdempotency(ctx, pb.Idempotency_IDEMPOTENCY_SAFE)
	req, _ := httpNewRequest(ctx, upstream.URL+"/items/7")
	resp, err := http.Do(req)
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	decisions := retryd.Decisions(resp)
	fmt.Println(resp.StatusCode, string(body))
	fmt.Println(len(decisions), decisions[0].Verdict, decisions[0].Fallback)
	// Output:
	// 200 item 7
	// 1 VERDICT_RETRY true
}
