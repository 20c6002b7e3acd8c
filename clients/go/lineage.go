// lineage.go is issue 31, "one layer retries" (docs/lineage.md): the
// retryd.lineage baggage member that tells a layer where it sits in a call
// chain, and the retryd-retried header or trailer that tells the layer above
// that a failure was already retried. The inbound half (an http.Handler
// middleware and grpc-go server interceptors) is here; the Transport and the
// client interceptor send and read what it keeps in the request's context.

package retryd

import (
	"bufio"
	"context"
	"errors"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

const (
	// LineageMember is the W3C baggage member that carries the lineage.
	LineageMember = "retryd.lineage"
	// RetriedHeader is the HTTP response header (and gRPC trailer) by which
	// a layer says it already retried (or was denied retrying) the failure
	// it answers with.
	RetriedHeader = "retryd-retried"
	// MaxLineageEntries and MaxLineageBytes bound a lineage (the contract's
	// limits; retryd refuses a longer one).
	MaxLineageEntries = 32
	MaxLineageBytes   = 1024
	maxLayerBytes     = 64
	maxLineageAttempt = 1000
)

// ValidLayer reports whether name is a layer name: 1 to 64 bytes of
// [A-Za-z0-9._-].
func ValidLayer(name string) bool {
	if name == "" || len(name) > maxLayerBytes {
		return false
	}
	for i := 0; i < len(name); i++ {
		if !layerByte(name[i]) {
			return false
		}
	}
	return true
}

func layerByte(b byte) bool {
	return b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '.' || b == '_' || b == '-'
}

// DefaultLayer is the layer name used when Options.Layer is empty:
// OTEL_SERVICE_NAME if it is set and a valid layer name, else the program's
// name with every byte outside the charset replaced by '_' (and cut to 64
// bytes), else "service".
func DefaultLayer() string {
	if name := os.Getenv("OTEL_SERVICE_NAME"); ValidLayer(name) {
		return name
	}
	if len(os.Args) > 0 {
		if name := sanitizeLayer(filepath.Base(os.Args[0])); name != "" {
			return name
		}
	}
	return "service"
}

func sanitizeLayer(name string) string {
	if name == "." || name == string(filepath.Separator) {
		return ""
	}
	b := []byte(name)
	for i := range b {
		if !layerByte(b[i]) {
			b[i] = '_'
		}
	}
	if len(b) > maxLayerBytes {
		b = b[:maxLayerBytes]
	}
	if strings.Trim(string(b), "_") == "" {
		return "" // nothing of the name survived
	}
	return string(b)
}

type lineageEntry struct {
	layer   string
	attempt int
}

// parseLineage reads a lineage leniently: it came from a caller we may not
// control, so an entry that is not `layer:attempt` is dropped rather than
// failing the request (or making retryd refuse the decision).
func parseLineage(raw string) []lineageEntry {
	if raw == "" {
		return nil
	}
	var entries []lineageEntry
	for _, part := range strings.Split(raw, "/") {
		i := strings.LastIndexByte(part, ':')
		if i < 0 {
			continue
		}
		layer, digits := part[:i], part[i+1:]
		if !ValidLayer(layer) || digits == "" || len(digits) > 4 || strings.Trim(digits, "0123456789") != "" {
			continue
		}
		attempt, _ := strconv.Atoi(digits)
		if attempt < 1 || attempt > maxLineageAttempt {
			continue
		}
		entries = append(entries, lineageEntry{layer: layer, attempt: attempt})
	}
	return entries
}

func formatLineage(entries []lineageEntry) string {
	var b strings.Builder
	for i, e := range entries {
		if i > 0 {
			b.WriteByte('/')
		}
		b.WriteString(e.layer)
		b.WriteByte(':')
		b.WriteString(strconv.Itoa(e.attempt))
	}
	return b.String()
}

func lineageBytes(entries []lineageEntry) int {
	n := 0
	for i, e := range entries {
		if i > 0 {
			n++
		}
		n += len(e.layer) + 1 + len(strconv.Itoa(e.attempt))
	}
	return n
}

// shortenLineage keeps entries within the limits by dropping the outermost
// ones. If a dropped entry had an attempt above 1, a first entry `...:<max>`
// keeps it visible: a layer inside an enclosing retry must still know it is.
func shortenLineage(entries []lineageEntry) []lineageEntry {
	fits := func(e []lineageEntry) bool {
		return len(e) <= MaxLineageEntries && lineageBytes(e) <= MaxLineageBytes
	}
	if fits(entries) {
		return entries
	}
	maxDropped := 0
	for drop := 1; drop <= len(entries); drop++ {
		if a := entries[drop-1].attempt; a > maxDropped {
			maxDropped = a
		}
		kept := entries[drop:]
		if maxDropped > 1 {
			kept = append([]lineageEntry{{layer: "...", attempt: maxDropped}}, kept...)
		}
		if fits(kept) {
			return kept
		}
	}
	return nil // unreachable: one entry always fits
}

// NormalizeLineage returns raw as this client sends it on: invalid entries
// dropped, shortened to the limits (see docs/lineage.md).
func NormalizeLineage(raw string) string {
	return formatLineage(shortenLineage(parseLineage(raw)))
}

// enclosingRetry is an entry of the lineage with an attempt above 1, if any:
// the call is made inside a retry of an enclosing call.
func enclosingRetry(raw string) (lineageEntry, bool) {
	for _, e := range parseLineage(raw) {
		if e.attempt > 1 {
			return e, true
		}
	}
	return lineageEntry{}, false
}

// outboundLineage is what an attempt sends: the inbound lineage plus this
// layer's own entry, within the limits.
func outboundLineage(inbound, layer string, attempt int) string {
	if attempt > maxLineageAttempt {
		attempt = maxLineageAttempt
	}
	entries := append(parseLineage(inbound), lineageEntry{layer: layer, attempt: attempt})
	return formatLineage(shortenLineage(entries))
}

// baggageLineage reads the retryd.lineage member from baggage header values
// (each a comma-separated list of members, key=value;properties).
func baggageLineage(values []string) string {
	for _, value := range values {
		for _, member := range strings.Split(value, ",") {
			key, rest, ok := strings.Cut(member, "=")
			if !ok || strings.TrimSpace(key) != LineageMember {
				continue
			}
			v, _, _ := strings.Cut(rest, ";")
			v = strings.TrimSpace(v)
			// A propagator may percent-encode what needs no encoding.
			if unescaped, err := url.PathUnescape(v); err == nil {
				v = unescaped
			}
			return NormalizeLineage(v)
		}
	}
	return ""
}

// withLineageMember is the baggage values with the retryd.lineage member
// set to lineage: any earlier one removed, the other members kept as they
// are, in one header value.
func withLineageMember(values []string, lineage string) string {
	var kept []string
	for _, value := range values {
		for _, member := range strings.Split(value, ",") {
			key, _, _ := strings.Cut(member, "=")
			if strings.TrimSpace(member) == "" || strings.TrimSpace(key) == LineageMember {
				continue
			}
			kept = append(kept, strings.TrimSpace(member))
		}
	}
	return strings.Join(append(kept, LineageMember+"="+lineage), ",")
}

// lineageState is what the inbound middleware keeps for one request being
// served: the lineage it came with, and whether an outbound call made while
// serving it ended in failure after retryd's decision.
type lineageState struct {
	inbound string
	retried atomic.Bool
}

type lineageKey struct{}

func lineageStateOf(ctx context.Context) *lineageState {
	state, _ := ctx.Value(lineageKey{}).(*lineageState)
	return state
}

// WithInboundLineage returns a context for serving a request that came with
// lineage (the value of its retryd.lineage baggage member; "" at the edge),
// for inbound requests that neither the HTTP middleware nor the gRPC server
// interceptors see (a queue consumer, say). The Transport and the client
// interceptor then send it on with each attempt, and [RetriedInside] says
// whether a call made with the context ended in failure after a decision.
func WithInboundLineage(ctx context.Context, lineage string) context.Context {
	return context.WithValue(ctx, lineageKey{}, &lineageState{inbound: NormalizeLineage(lineage)})
}

// InboundLineage is the lineage of the request being served with ctx, as
// the middleware read it ("" at the edge).
func InboundLineage(ctx context.Context) string {
	if state := lineageStateOf(ctx); state != nil {
		return state.inbound
	}
	return ""
}

// RetriedInside reports whether an outbound call made while serving the
// request of ctx ended in failure after retryd's decision (a DENY, an
// AMBIGUOUS, or the failed last attempt of a RETRY): a failed response to
// that request is then marked retryd-retried, by the middleware.
func RetriedInside(ctx context.Context) bool {
	state := lineageStateOf(ctx)
	return state != nil && state.retried.Load()
}

// markRetried records on ctx's request that a call failed after a decision.
func markRetried(ctx context.Context) {
	if state := lineageStateOf(ctx); state != nil {
		state.retried.Store(true)
	}
}

// retriedBelow is a failed response's retryd-retried value if it is a
// valid layer name: it came from an upstream we may not control, and
// retryd would refuse the decision over an invalid one.
func retriedBelow(value string) string {
	value = strings.TrimSpace(value)
	if ValidLayer(value) {
		return value
	}
	return ""
}

// LineageHandler returns next wrapped in the inbound half of the lineage
// contract: the request's retryd.lineage baggage member goes into its
// context (for the Transport and the client interceptor to send on), and a
// 5xx response gets `retryd-retried: <layer>` (the client's Layer) when an
// outbound call made with the request's context ended in failure after
// retryd's decision, so that the layer above does not retry it again.
//
// The ResponseWriter passed to next keeps http.Flusher, http.Hijacker and
// http.Pusher working when the server's writer has them.
func (c *Client) LineageHandler(next http.Handler) http.Handler {
	layer := c.Layer()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := WithInboundLineage(r.Context(), baggageLineage(r.Header.Values("Baggage")))
		next.ServeHTTP(&lineageWriter{ResponseWriter: w, ctx: ctx, layer: layer}, r.WithContext(ctx))
	})
}

// lineageWriter sets the retryd-retried header as the status is written:
// after WriteHeader a header can no longer be added.
type lineageWriter struct {
	http.ResponseWriter
	ctx         context.Context
	layer       string
	wroteHeader bool
}

func (w *lineageWriter) WriteHeader(code int) {
	if !w.wroteHeader {
		w.wroteHeader = true
		if code >= 500 && RetriedInside(w.ctx) {
			w.Header().Set(RetriedHeader, w.layer)
		}
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *lineageWriter) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(p)
}

// Flush flushes the server's writer, if it can.
func (w *lineageWriter) Flush() {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Hijack hijacks the server's connection, if its writer can.
func (w *lineageWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	if h, ok := w.ResponseWriter.(http.Hijacker); ok {
		return h.Hijack()
	}
	return nil, nil, errors.New("retryd: the ResponseWriter is not an http.Hijacker")
}

// Push pushes with the server's writer, if it can.
func (w *lineageWriter) Push(target string, opts *http.PushOptions) error {
	if p, ok := w.ResponseWriter.(http.Pusher); ok {
		return p.Push(target, opts)
	}
	return http.ErrNotSupported
}

// Unwrap gives the server's writer (for http.ResponseController, Go 1.20+).
func (w *lineageWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func incomingLineage(ctx context.Context) context.Context {
	md, _ := metadata.FromIncomingContext(ctx)
	return WithInboundLineage(ctx, baggageLineage(md.Get("baggage")))
}

// retriedTrailer is the trailer of a failed call that was retried (or
// denied) inside: grpc-retry-pushback-ms -1 so that a plain gRPC client
// (gRFC A6) does not retry it either.
func (c *Client) retriedTrailer() metadata.MD {
	return metadata.Pairs(RetriedHeader, c.Layer(), PushbackTrailer, "-1")
}

// LineageUnaryServerInterceptor is the inbound half of the lineage contract
// for grpc-go unary services (see [Client.LineageHandler]): the call's
// baggage goes into its context, and a non-OK status gets the trailers
// `retryd-retried: <layer>` and `grpc-retry-pushback-ms: -1` when an
// outbound call made with the context ended in failure after retryd's
// decision.
func (c *Client) LineageUnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req interface{}, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (interface{}, error) {
		ctx = incomingLineage(ctx)
		resp, err := handler(ctx, req)
		if err != nil && status.Code(err) != codes.OK && RetriedInside(ctx) {
			_ = grpc.SetTrailer(ctx, c.retriedTrailer())
		}
		return resp, err
	}
}

// LineageStreamServerInterceptor is [Client.LineageUnaryServerInterceptor]
// for streaming calls: the stream's Context carries the lineage.
func (c *Client) LineageStreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv interface{}, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx := incomingLineage(ss.Context())
		err := handler(srv, lineageStream{ServerStream: ss, ctx: ctx})
		if err != nil && status.Code(err) != codes.OK && RetriedInside(ctx) {
			ss.SetTrailer(c.retriedTrailer())
		}
		return err
	}
}

type lineageStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s lineageStream) Context() context.Context { return s.ctx }
