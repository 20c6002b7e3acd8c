package retryd

import (
	"context"
	"net/http"

	"google.golang.org/grpc/metadata"
)

type traceKey struct{}

type traceHeaders struct{ traceparent, tracestate string }

// WithTraceContext returns a context carrying a W3C traceparent (and
// tracestate, which may be empty) for the retryd calls made with it, for
// callers that propagate trace context by hand rather than with
// OpenTelemetry.
func WithTraceContext(ctx context.Context, traceparent, tracestate string) context.Context {
	return context.WithValue(ctx, traceKey{}, traceHeaders{traceparent, tracestate})
}

// W3CTraceContext is the default Options.TraceContext: the headers put on
// ctx by WithTraceContext (the Transport puts there the traceparent of the
// request it sends). When it returns none, the client still forwards a
// traceparent found in ctx's outgoing gRPC metadata (the interceptor's case).
func W3CTraceContext(ctx context.Context) (traceparent, tracestate string) {
	if headers, ok := ctx.Value(traceKey{}).(traceHeaders); ok {
		return headers.traceparent, headers.tracestate
	}
	return "", ""
}

// traceFromRequest puts an outbound HTTP request's own trace headers on ctx,
// unless ctx already carries some (or the request has none).
func traceFromRequest(ctx context.Context, header http.Header) context.Context {
	if _, ok := ctx.Value(traceKey{}).(traceHeaders); ok {
		return ctx
	}
	if md, ok := metadata.FromOutgoingContext(ctx); ok && len(md.Get("traceparent")) > 0 {
		return ctx
	}
	if traceparent := header.Get("traceparent"); traceparent != "" {
		return WithTraceContext(ctx, traceparent, header.Get("tracestate"))
	}
	return ctx
}
