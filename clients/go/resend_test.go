package retryd

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// Issue 38: no hidden re-sends. Every request the server reads is an attempt
// that was decided: net/http's own re-send on a broken reused connection is
// refused.

// pooledThenReset answers the first request on each connection with a
// keep-alive 200, then resets the connection after reading the second.
func pooledThenReset(t *testing.T) *rawServer {
	return startRaw(t, func(s *rawServer, conn net.Conn) {
		if _, err := s.readRequest(conn); err != nil {
			return
		}
		if _, err := io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"); err != nil {
			return
		}
		if _, err := s.readRequest(conn); err == nil {
			reset(conn)
		}
	})
}

// warm makes one successful call, so that its connection is pooled.
func warm(t *testing.T, transport http.RoundTripper, url string) {
	t.Helper()
	resp, err := get(t, safe(context.Background()), transport, url)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}

func TestGetDeclaredNonIdempotentIsNotResentOnABrokenPooledConnection(t *testing.T) {
	server := pooledThenReset(t)
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	warm(t, transport, server.url())

	ctx := WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT)
	resp, err := get(t, ctx, transport, server.url()+"/reserve")
	e := wantAmbiguous(t, resp, err)
	// Two reads in all: the warm-up and one of this call. net/http alone
	// would have read it twice and returned the second connection's 200.
	if got := server.requests.Load(); got != 2 || e.Attempts != 1 || len(e.Decisions) != 1 {
		t.Fatalf("requests read %d, attempts %d, decisions %d", got, e.Attempts, len(e.Decisions))
	}
}

func TestKeyedPostIsNotResentOnABrokenPooledConnection(t *testing.T) {
	server := pooledThenReset(t)
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	warm(t, transport, server.url())

	// net/http deems a POST with an Idempotency-Key and GetBody replayable.
	ctx := WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_NON_IDEMPOTENT)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, server.url()+"/charges", strings.NewReader(`{"amount": 1}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", "charge-8")
	resp, err := transport.RoundTrip(req)
	wantAmbiguous(t, resp, err)
	if got := server.requests.Load(); got != 2 {
		t.Fatalf("requests read %d, want 2", got)
	}
}

func TestSafeGetOnABrokenPooledConnectionIsRetriedOnlyAsDecided(t *testing.T) {
	server := pooledThenReset(t)
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	warm(t, transport, server.url())

	resp, err := get(t, safe(context.Background()), transport, server.url())
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	decisions := Decisions(resp)
	// This call's reads: the first attempt and one per RETRY decided.
	if got := server.requests.Load() - 1; got != int64(1+len(decisions)) || len(decisions) != 1 || !decisions[0].ShouldRetry() {
		t.Fatalf("requests read %d for %d decision(s) %+v", got, len(decisions), decisions)
	}
	if decisions[0].EffectiveEvidence != pb.Evidence_EVIDENCE_SENT_NO_RESPONSE {
		t.Fatalf("evidence %s", decisions[0].EffectiveEvidence)
	}
}

// The empty body the Transport gives a bodyless request is probed by
// net/http and sent as none: the wire is unchanged.
func TestBodylessRequestsStillGoWithoutABody(t *testing.T) {
	server, _ := counted(t, func(_ int64, w http.ResponseWriter, r *http.Request) {
		if len(r.TransferEncoding) != 0 || r.ContentLength != 0 || r.Header.Get("Content-Length") != "" {
			t.Errorf("%s went with a body: %v %d", r.Method, r.TransferEncoding, r.ContentLength)
		}
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	for _, method := range []string{http.MethodGet, http.MethodHead, http.MethodDelete, http.MethodOptions} {
		req, _ := http.NewRequestWithContext(safe(context.Background()), method, server.URL, nil)
		resp, err := testTransport(t, client).RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
}
