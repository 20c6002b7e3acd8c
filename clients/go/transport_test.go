package retryd

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// rawServer is a TCP server of the test's own on 127.0.0.1 that misbehaves
// as handle says. It counts the requests whose head it read.
type rawServer struct {
	listener net.Listener
	requests atomic.Int64
	conns    atomic.Int64
	wg       sync.WaitGroup
}

func startRaw(t *testing.T, handle func(s *rawServer, conn net.Conn)) *rawServer {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &rawServer{listener: l}
	var open sync.Map
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			s.conns.Add(1)
			open.Store(conn, true)
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer conn.Close()
				handle(s, conn)
			}()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		open.Range(func(conn, _ interface{}) bool { conn.(net.Conn).Close(); return true })
		s.wg.Wait()
	})
	return s
}

func (s *rawServer) url() string { return "http://" + s.listener.Addr().String() }

// readRequest reads one request head and its body (Content-Length only),
// and counts it.
func (s *rawServer) readRequest(conn net.Conn) (*http.Request, error) {
	req, err := http.ReadRequest(bufio.NewReader(conn))
	if err != nil {
		return nil, err
	}
	if _, err := io.Copy(io.Discard, req.Body); err != nil {
		return nil, err
	}
	s.requests.Add(1)
	return req, nil
}

// reset closes conn with an RST instead of a FIN.
func reset(conn net.Conn) {
	if tcp, ok := conn.(*net.TCPConn); ok {
		_ = tcp.SetLinger(0)
	}
	conn.Close()
}

// blockUntilClosed holds conn open, reading nothing more, until the peer
// or the test closes it.
func blockUntilClosed(conn net.Conn) { _, _ = io.Copy(io.Discard, conn) }

// counted is an httptest server whose handler gets the 1-based request
// number.
func counted(t *testing.T, handler func(n int64, w http.ResponseWriter, r *http.Request)) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var n atomic.Int64
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		handler(n.Add(1), w, r)
	}))
	t.Cleanup(server.Close)
	return server, &n
}

func testTransport(t *testing.T, client *Client) *Transport {
	return &Transport{Base: &http.Transport{}, Client: client, Upstream: "go-http", DisableReporting: true}
}

func safe(ctx context.Context) context.Context {
	return WithIdempotency(ctx, pb.Idempotency_IDEMPOTENCY_SAFE)
}

func get(t *testing.T, ctx context.Context, transport http.RoundTripper, url string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	return transport.RoundTrip(req)
}

func post(t *testing.T, ctx context.Context, transport http.RoundTripper, url, body string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return transport.RoundTrip(req)
}

// classify runs one attempt through the Transport and returns what it says
// the attempt proves.
func classify(t *testing.T, transport *Transport, req *http.Request) outcome {
	t.Helper()
	resp, failed, _ := transport.attempt(req.Context(), req, LineageMember+"=test:1", DefaultErrorBodyLimit)
	closeResponse(resp)
	if failed == nil {
		t.Fatalf("the attempt did not fail")
	}
	return failed.outcome
}

func newGet(t *testing.T, ctx context.Context, url string) *http.Request {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	return req
}

func wantOutcome(t *testing.T, got outcome, evidence pb.Evidence, failure pb.FailureKind) {
	t.Helper()
	if got.evidence != evidence || got.failure != failure {
		t.Fatalf("outcome %s/%s, want %s/%s", got.evidence, got.failure, evidence, failure)
	}
}

func wantError(t *testing.T, resp *http.Response, err error) *Error {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		closeResponse(resp)
		t.Fatalf("want *retryd.Error, got %v (%v)", err, resp)
	}
	return e
}

func wantAmbiguous(t *testing.T, resp *http.Response, err error) *AmbiguousError {
	t.Helper()
	var e *AmbiguousError
	if !errors.As(err, &e) {
		closeResponse(resp)
		t.Fatalf("want *retryd.AmbiguousError, got %v (%v)", err, resp)
	}
	return e
}

// --- what each failure proves (one attempt, real sockets) ---

func TestRefusedConnectionProvesNotSent(t *testing.T) {
	transport := testTransport(t, nil)
	got := classify(t, transport, newGet(t, context.Background(), "http://"+closedAddr(t)+"/x"))
	wantOutcome(t, got, pb.Evidence_EVIDENCE_NOT_SENT, pb.FailureKind_FAILURE_KIND_CONNECT)
}

func TestResetAfterReadingTheRequestIsSentNoResponse(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		if _, err := s.readRequest(conn); err == nil {
			reset(conn)
		}
	})
	got := classify(t, testTransport(t, nil), newGet(t, context.Background(), server.url()))
	wantOutcome(t, got, pb.Evidence_EVIDENCE_SENT_NO_RESPONSE, pb.FailureKind_FAILURE_KIND_CONNECTION_RESET)
}

func TestNeverAnsweredIsAResponseHeaderTimeout(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		if _, err := s.readRequest(conn); err == nil {
			blockUntilClosed(conn)
		}
	})
	transport := testTransport(t, nil)
	transport.AttemptTimeout = 200 * time.Millisecond
	got := classify(t, transport, newGet(t, context.Background(), server.url()))
	wantOutcome(t, got, pb.Evidence_EVIDENCE_SENT_NO_RESPONSE, pb.FailureKind_FAILURE_KIND_RESPONSE_HEADER_TIMEOUT)
}

func TestTruncatedBodyIsAPartialResponse(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		if _, err := s.readRequest(conn); err == nil {
			fmt.Fprint(conn, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\nonly ten b")
		}
	})
	got := classify(t, testTransport(t, nil), newGet(t, context.Background(), server.url()))
	wantOutcome(t, got, pb.Evidence_EVIDENCE_PARTIAL_RESPONSE, pb.FailureKind_FAILURE_KIND_DECODE_RESET)
	if got.httpStatus != 503 {
		t.Fatalf("status %d", got.httpStatus)
	}
}

func TestGarbageInTheTLSHandshakeProvesNotSent(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		_, _ = conn.Write([]byte("this is not a TLS server hello\r\n\r\n"))
		blockUntilClosed(conn)
	})
	transport := testTransport(t, nil)
	transport.Base = &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}
	url := strings.Replace(server.url(), "http://", "https://", 1)
	got := classify(t, transport, newGet(t, context.Background(), url))
	wantOutcome(t, got, pb.Evidence_EVIDENCE_NOT_SENT, pb.FailureKind_FAILURE_KIND_PRE_REQUEST_TLS)
	if server.requests.Load() != 0 {
		t.Fatal("a request was read")
	}
}

func TestUntrustedCertificateIsPermanent(t *testing.T) {
	server := httptest.NewTLSServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer server.Close()
	got := classify(t, testTransport(t, nil), newGet(t, context.Background(), server.URL))
	wantOutcome(t, got, pb.Evidence_EVIDENCE_NOT_SENT, pb.FailureKind_FAILURE_KIND_TLS_CERTIFICATE_INVALID)
}

func TestPoolWaitThatTimesOutProvesNotSent(t *testing.T) {
	release := make(chan struct{})
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) { <-release })
	defer close(release)
	base := &http.Transport{MaxConnsPerHost: 1}
	defer base.CloseIdleConnections()
	// The only connection is taken by a request that hangs.
	go func() {
		resp, err := base.RoundTrip(newGet(t, context.Background(), server.URL))
		if err == nil {
			resp.Body.Close()
		}
	}()
	for deadline := time.Now().Add(hangGuard); hits.Load() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first request never arrived")
		}
	}
	transport := testTransport(t, nil)
	transport.Base = base
	transport.AttemptTimeout = 200 * time.Millisecond
	got := classify(t, transport, newGet(t, context.Background(), server.URL))
	wantOutcome(t, got, pb.Evidence_EVIDENCE_NOT_SENT, pb.FailureKind_FAILURE_KIND_POOL_TIMEOUT)
	if hits.Load() != 1 {
		t.Fatalf("%d requests reached the server", hits.Load())
	}
}

func TestUnsupportedSchemeIsAProfileRejection(t *testing.T) {
	got := classify(t, testTransport(t, nil), newGet(t, context.Background(), "ftp://127.0.0.1/x"))
	wantOutcome(t, got, pb.Evidence_EVIDENCE_NOT_SENT, pb.FailureKind_FAILURE_KIND_PROFILE_REJECTION)
}

func TestBodyReplayability(t *testing.T) {
	cases := []struct {
		body func() *http.Request
		want *pb.Body
	}{
		{func() *http.Request { r, _ := http.NewRequest("GET", "http://x/", nil); return r }, nil},
		{func() *http.Request { r, _ := http.NewRequest("POST", "http://x/", strings.NewReader("a")); return r },
			&pb.Body{Kind: pb.BodyKind_BODY_KIND_REOPENABLE_SUPPLIER}},
		{func() *http.Request {
			r, _ := http.NewRequest("POST", "http://x/", io.NopCloser(strings.NewReader("a")))
			return r
		}, &pb.Body{Kind: pb.BodyKind_BODY_KIND_INPUT_STREAM}},
	}
	for i, c := range cases {
		got := bodyOf(c.body())
		if (got == nil) != (c.want == nil) || (got != nil && got.Kind != c.want.Kind) {
			t.Errorf("case %d: %v, want %v", i, got, c.want)
		}
	}
}

// --- the whole call against a real retryd ---

func TestRefusedIsRetriedEvenForAPayment(t *testing.T) {
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	resp, err := post(t, context.Background(), testTransport(t, client), "http://"+closedAddr(t)+"/charges", "{}")
	e := wantError(t, resp, err)
	if e.Attempts != 3 || len(e.Decisions) != 3 {
		t.Fatalf("%d attempts, %d decisions: %v", e.Attempts, len(e.Decisions), err)
	}
	for _, d := range e.Decisions[:2] {
		if !d.ShouldRetry() || d.EffectiveEvidence != pb.Evidence_EVIDENCE_NOT_SENT || d.EvidenceAdjusted {
			t.Fatalf("decision %+v", d)
		}
	}
	if last := e.Decisions[2]; last.DenyReason != pb.DenyReason_DENY_REASON_MAX_ATTEMPTS {
		t.Fatalf("last decision %+v", last)
	}
}

func TestPaymentResetAfterTheServerReadItIsAmbiguousAndSentOnce(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		if _, err := s.readRequest(conn); err == nil {
			reset(conn)
		}
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	resp, err := post(t, context.Background(), testTransport(t, client), server.url()+"/charges", `{"amount": 1}`)
	e := wantAmbiguous(t, resp, err)
	if e.Attempts != 1 || server.requests.Load() != 1 || e.Decision.Rule != 8 {
		t.Fatalf("attempts %d, requests %d, decision %+v", e.Attempts, server.requests.Load(), e.Decision)
	}
	if e.Decision.EffectiveEvidence != pb.Evidence_EVIDENCE_SENT_NO_RESPONSE {
		t.Fatalf("evidence %s", e.Decision.EffectiveEvidence)
	}
}

func TestSafeCallResetAfterReadingIsRetried(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		if _, err := s.readRequest(conn); err == nil {
			reset(conn)
		}
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	resp, err := get(t, safe(context.Background()), testTransport(t, client), server.url())
	e := wantError(t, resp, err)
	if e.Attempts != 3 || server.requests.Load() != 3 {
		t.Fatalf("attempts %d, requests %d", e.Attempts, server.requests.Load())
	}
}

func TestNeverAnsweredSafeCallIsRetriedAndAPaymentIsAmbiguous(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		if _, err := s.readRequest(conn); err == nil {
			blockUntilClosed(conn)
		}
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	transport.AttemptTimeout = 150 * time.Millisecond
	resp, err := get(t, safe(context.Background()), transport, server.url())
	if e := wantError(t, resp, err); e.Attempts != 3 {
		t.Fatalf("%d attempts", e.Attempts)
	}
	before := server.requests.Load()
	resp, err = post(t, context.Background(), transport, server.url(), "pay")
	wantAmbiguous(t, resp, err)
	if got := server.requests.Load() - before; got != 1 {
		t.Fatalf("the payment was sent %d times", got)
	}
}

func TestContextDeadlineShorterThanTheHang(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		if _, err := s.readRequest(conn); err == nil {
			blockUntilClosed(conn)
		}
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	// Timed from before the deadline is made, so the lower bound holds.
	start := time.Now()
	ctx, cancel := context.WithTimeout(safe(context.Background()), 300*time.Millisecond)
	defer cancel()
	resp, err := get(t, ctx, testTransport(t, client), server.url())
	elapsed := time.Since(start)
	e := wantError(t, resp, err)
	// The context's deadline ended it (no ceiling on wall time: the error
	// says why it returned, and a hang fails the test's own timeout).
	if !errors.Is(err, context.DeadlineExceeded) || e.Attempts != 1 || server.requests.Load() != 1 || len(e.Decisions) != 0 {
		t.Fatalf("err %v, attempts %d, requests %d", err, e.Attempts, server.requests.Load())
	}
	if elapsed < 300*time.Millisecond {
		t.Fatalf("returned after %v, before the deadline", elapsed)
	}
}

func TestTruncatedBodyIsRetriedWhenBuffered(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		if _, err := s.readRequest(conn); err != nil {
			return
		}
		if s.requests.Load() == 1 {
			fmt.Fprint(conn, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
			return
		}
		fmt.Fprint(conn, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nwhole")
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	transport.BufferResponses = true
	resp, err := get(t, safe(context.Background()), transport, server.url())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || string(body) != "whole" {
		t.Fatalf("body %q, %v", body, err)
	}
	decisions := Decisions(resp)
	if len(decisions) != 1 || decisions[0].EffectiveEvidence != pb.Evidence_EVIDENCE_PARTIAL_RESPONSE {
		t.Fatalf("decisions %+v", decisions)
	}
}

func TestTruncatedBodyUnbufferedFailsInTheCallersRead(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		if _, err := s.readRequest(conn); err == nil {
			fmt.Fprint(conn, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
		}
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	resp, err := get(t, safe(context.Background()), testTransport(t, client), server.url())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.ReadAll(resp.Body); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("read error %v", err)
	}
	if server.requests.Load() != 1 {
		t.Fatalf("%d requests", server.requests.Load())
	}
}

func TestGarbageTLSIsRetried(t *testing.T) {
	server := startRaw(t, func(s *rawServer, conn net.Conn) {
		_, _ = conn.Write([]byte("garbage, not a handshake\r\n\r\n"))
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	transport.Base = &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}
	resp, err := post(t, context.Background(), transport, strings.Replace(server.url(), "http", "https", 1), "pay")
	e := wantError(t, resp, err)
	// A payment, retried: NOT_SENT is proven by the failed handshake.
	if e.Attempts != 3 || server.conns.Load() != 3 || server.requests.Load() != 0 {
		t.Fatalf("attempts %d, connections %d", e.Attempts, server.conns.Load())
	}
}

func TestPoolWaitIsRetriedAndNothingReachesTheServer(t *testing.T) {
	release := make(chan struct{})
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) { <-release })
	defer close(release)
	base := &http.Transport{MaxConnsPerHost: 1}
	defer base.CloseIdleConnections()
	go func() {
		resp, err := base.RoundTrip(newGet(t, context.Background(), server.URL))
		if err == nil {
			resp.Body.Close()
		}
	}()
	for deadline := time.Now().Add(hangGuard); hits.Load() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first request never arrived")
		}
	}
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	transport.Base = base
	transport.AttemptTimeout = 100 * time.Millisecond
	resp, err := post(t, context.Background(), transport, server.URL, "pay")
	e := wantError(t, resp, err)
	if e.Attempts != 3 || e.Decisions[0].EffectiveEvidence != pb.Evidence_EVIDENCE_NOT_SENT || hits.Load() != 1 {
		t.Fatalf("attempts %d, decisions %+v, hits %d", e.Attempts, e.Decisions, hits.Load())
	}
}

func TestRetryAfterIsHonoured(t *testing.T) {
	for _, form := range []string{"seconds", "http-date"} {
		form := form
		t.Run(form, func(t *testing.T) {
			var wait time.Duration
			server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) {
				if n == 1 {
					if form == "seconds" {
						w.Header().Set("Retry-After", "1")
					} else {
						// An HTTP-date has whole seconds: 2s ahead is at least 1s.
						w.Header().Set("Retry-After", time.Now().Add(2*time.Second).UTC().Format(http.TimeFormat))
					}
					w.WriteHeader(429)
					return
				}
				w.WriteHeader(200)
			})
			wait = time.Second
			client := newClient(t, shared(t).grpc, Options{NoFallback: true})
			clock := withFakeClock(client)
			resp, err := get(t, safe(context.Background()), testTransport(t, client), server.URL)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 200 || hits.Load() != 2 {
				t.Fatalf("status %d after %d requests", resp.StatusCode, hits.Load())
			}
			// The wait between the attempts is retryd's backoff, floored by
			// the Retry-After: exactly what the Transport asked its clock for.
			d := Decisions(resp)
			if len(d) != 1 || d[0].Backoff < wait {
				t.Fatalf("decisions %+v", d)
			}
			if waits := clock.asked(); len(waits) != 1 || waits[0] != d[0].Backoff {
				t.Fatalf("waited %v, decided %v", waits, d[0].Backoff)
			}
		})
	}
}

func Test503Then200(t *testing.T) {
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) {
		if n == 1 {
			http.Error(w, "busy", 503)
			return
		}
		fmt.Fprint(w, "ok")
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	resp, err := get(t, safe(context.Background()), testTransport(t, client), server.URL)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "ok" || hits.Load() != 2 {
		t.Fatalf("status %d, body %q, requests %d", resp.StatusCode, body, hits.Load())
	}
	if d := Decisions(resp); len(d) != 1 || !d[0].ShouldRetry() || d[0].Fallback {
		t.Fatalf("decisions %+v", d)
	}
}

func TestOneShotBodyIsNotResentAfterA503(t *testing.T) {
	var received atomic.Int64
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		received.Add(int64(len(body)))
		http.Error(w, "busy", 503)
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	// io.NopCloser hides the reader's type: http.NewRequest sets no GetBody.
	req, _ := http.NewRequestWithContext(WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_IDEMPOTENT),
		http.MethodPut, server.URL, io.NopCloser(strings.NewReader("0123456789")))
	resp, err := testTransport(t, client).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(body), "busy") {
		t.Fatalf("status %d, body %q", resp.StatusCode, body)
	}
	if hits.Load() != 1 || received.Load() != 10 {
		t.Fatalf("%d requests, %d body bytes received", hits.Load(), received.Load())
	}
	if d := Decisions(resp); len(d) != 1 || d[0].DenyReason != pb.DenyReason_DENY_REASON_BODY_NOT_REPLAYABLE {
		t.Fatalf("decisions %+v", d)
	}
}

func TestReplayableBodyIsResentWhole(t *testing.T) {
	var bodies []string
	var mu sync.Mutex
	server, _ := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, string(body))
		mu.Unlock()
		if n == 1 {
			http.Error(w, "busy", 503)
		}
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	req, _ := http.NewRequestWithContext(WithIdempotency(context.Background(), pb.Idempotency_IDEMPOTENCY_IDEMPOTENT),
		http.MethodPut, server.URL, strings.NewReader("0123456789"))
	resp, err := testTransport(t, client).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || len(bodies) != 2 || bodies[0] != "0123456789" || bodies[1] != bodies[0] {
		t.Fatalf("status %d, bodies %q", resp.StatusCode, bodies)
	}
}

func TestPayment503IsAmbiguousWithTheResponse(t *testing.T) {
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) { http.Error(w, "upstream busy", 503) })
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	resp, err := post(t, context.Background(), testTransport(t, client), server.URL, "pay")
	e := wantAmbiguous(t, resp, err)
	if e.StatusCode != 503 || !strings.Contains(string(e.Body), "upstream busy") || hits.Load() != 1 {
		t.Fatalf("%+v, %d requests", e, hits.Load())
	}
}

func TestIdempotencyKeyHeaderMakesAPaymentRetryable(t *testing.T) {
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) {
		if n == 1 {
			http.Error(w, "busy", 503)
		}
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	req, _ := http.NewRequest(http.MethodPost, server.URL, strings.NewReader("pay"))
	req.Header.Set("Idempotency-Key", "k-1")
	resp, err := testTransport(t, client).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || hits.Load() != 2 {
		t.Fatalf("status %d, %d requests", resp.StatusCode, hits.Load())
	}
}

func TestOtherStatusesAreReturnedAtOnce(t *testing.T) {
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) { http.Error(w, "no", 404) })
	// No retryd at all: a 404 must not even ask.
	client := newClient(t, closedAddr(t), Options{NoFallback: true})
	resp, err := get(t, safe(context.Background()), testTransport(t, client), server.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 404 || hits.Load() != 1 || len(Decisions(resp)) != 0 {
		t.Fatalf("status %d, %d requests", resp.StatusCode, hits.Load())
	}
}

func Test401RefreshesCredentialsOnce(t *testing.T) {
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer fresh" {
			w.WriteHeader(401)
		}
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	refreshed := 0
	transport.RefreshCredentials = func(next *http.Request) error {
		refreshed++
		next.Header.Set("Authorization", "Bearer fresh")
		return nil
	}
	req, _ := http.NewRequestWithContext(safe(context.Background()), http.MethodGet, server.URL, nil)
	req.Header.Set("Authorization", "Bearer stale")
	resp, err := transport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || refreshed != 1 || hits.Load() != 2 {
		t.Fatalf("status %d, refreshed %d, requests %d", resp.StatusCode, refreshed, hits.Load())
	}
	if req.Header.Get("Authorization") != "Bearer stale" {
		t.Fatal("the caller's request was modified")
	}
	if d := Decisions(resp); len(d) != 1 || !d[0].RefreshCredentials {
		t.Fatalf("decisions %+v", d)
	}
}

func TestRemainingDeadlineIsPassedToRetryd(t *testing.T) {
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) { http.Error(w, "busy", 503) })
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	transport := testTransport(t, client)
	transport.Upstream = "go-slow" // min_attempt_budget 300ms
	ctx, cancel := context.WithTimeout(safe(context.Background()), 250*time.Millisecond)
	defer cancel()
	resp, err := get(t, ctx, transport, server.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if d := Decisions(resp); len(d) != 1 || d[0].DenyReason != pb.DenyReason_DENY_REASON_DEADLINE || hits.Load() != 1 {
		t.Fatalf("decisions %+v, %d requests", d, hits.Load())
	}
}

func TestBackoffStaysInsideTheDeadline(t *testing.T) {
	server, _ := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "1")
		http.Error(w, "slow down", 429)
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	clock := withFakeClock(client)
	ctx, cancel := context.WithTimeout(safe(context.Background()), 500*time.Millisecond)
	defer cancel()
	resp, err := get(t, ctx, testTransport(t, client), server.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	// A Retry-After of 1s does not fit 500ms: denied at once, not slept.
	if d := Decisions(resp); len(d) != 1 || d[0].DenyReason != pb.DenyReason_DENY_REASON_DEADLINE {
		t.Fatalf("decisions %+v", d)
	}
	if waits := clock.asked(); len(waits) != 0 {
		t.Fatalf("waited %v", waits)
	}
}

func TestOnlyFirstAttemptsAreReported(t *testing.T) {
	server, _ := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) {
		if n%2 == 1 {
			http.Error(w, "busy", 503)
		}
	})
	client := newClient(t, shared(t).grpc, Options{NoFallback: true, ReportInterval: time.Hour})
	transport := testTransport(t, client)
	transport.DisableReporting = false
	for i := 0; i < 3; i++ {
		resp, err := get(t, safe(context.Background()), transport, server.URL)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	if got := client.Reporter().Pending()["go-http"]; got != 3 {
		t.Fatalf("%d first attempts pending, want 3 (6 attempts were made)", got)
	}
	opted := testTransport(t, client) // DisableReporting
	resp, err := get(t, safe(context.Background()), opted, server.URL)
	if err == nil {
		resp.Body.Close()
	}
	if got := client.Reporter().Pending()["go-http"]; got != 3 {
		t.Fatalf("an opted-out call was counted: %d", got)
	}
}

func TestLocalRuleWhenRetrydIsStopped(t *testing.T) {
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) {
		if n == 1 {
			http.Error(w, "busy", 503)
		}
	})
	retryd := startRetryd(t, clientTestConfig, "")
	client := newClient(t, retryd.grpc, Options{})
	retryd.stop()
	resp, err := get(t, safe(context.Background()), testTransport(t, client), server.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	d := Decisions(resp)
	if resp.StatusCode != 200 || hits.Load() != 2 || len(d) != 1 || !d[0].Fallback || !d[0].ShouldRetry() {
		t.Fatalf("status %d, %d requests, decisions %+v", resp.StatusCode, hits.Load(), d)
	}
	// A stopped retryd refuses at once: the fallback did not wait out the
	// decision timeout (UNAVAILABLE, not DEADLINE_EXCEEDED).
	if !strings.Contains(d[0].Explanation, "Unavailable") {
		t.Fatalf("fallback after %q", d[0].Explanation)
	}
	// The local rule never retries a payment that may have been sent.
	resp, err = post(t, context.Background(), testTransport(t, client), server.URL, "pay")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if hits.Load() != 3 {
		t.Fatalf("%d requests", hits.Load())
	}
}

func TestLocalRuleWhenRetrydIsFrozen(t *testing.T) {
	server, hits := counted(t, func(n int64, w http.ResponseWriter, r *http.Request) {
		if n == 1 {
			http.Error(w, "busy", 503)
		}
	})
	retryd := startRetryd(t, clientTestConfig, "")
	client := newClient(t, retryd.grpc, Options{Timeout: 300 * time.Millisecond})
	// Connect first, so that the freeze hits an established connection.
	if _, err := client.GetBudget(context.Background(), "go-http"); err != nil {
		t.Fatal(err)
	}
	retryd.freeze()
	defer retryd.thaw()
	start := time.Now()
	resp, err := get(t, safe(context.Background()), testTransport(t, client), server.URL)
	elapsed := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	d := Decisions(resp)
	if resp.StatusCode != 200 || hits.Load() != 2 || len(d) != 1 || !d[0].Fallback {
		t.Fatalf("status %d, %d requests, decisions %+v", resp.StatusCode, hits.Load(), d)
	}
	// The decision timeout ended the wait for the frozen retryd: no sooner
	// than it, and because of it (no ceiling on wall time).
	if elapsed < 300*time.Millisecond || !strings.Contains(d[0].Explanation, "DeadlineExceeded") {
		t.Fatalf("fallback after %v: %q", elapsed, d[0].Explanation)
	}
}
