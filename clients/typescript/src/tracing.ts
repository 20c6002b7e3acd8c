/**
 * W3C trace context for retryd calls, from the active OpenTelemetry context.
 *
 * @opentelemetry/api is an optional peer dependency: without it, or without
 * an active valid span, nothing is added. With one, the span context is sent
 * as `traceparent` (and `tracestate`), so retryd's `retry.decide` span joins
 * the caller's trace. Only the sampled flag is sent: newer SDKs also set the
 * Level 2 "random" bit, and some version-00 parsers (the opentelemetry Rust
 * propagator among them) reject flags above 0x02.
 */
import type * as OtelApi from '@opentelemetry/api';

let api: typeof OtelApi | null | undefined;

function otel(): typeof OtelApi | null {
  if (api === undefined) {
    try {
      // eslint-disable-next-line @typescript-eslint/no-require-imports
      api = require('@opentelemetry/api') as typeof OtelApi;
    } catch {
      api = null;
    }
  }
  return api;
}

/** [key, value] pairs of gRPC metadata carrying the active trace context. */
export function traceMetadata(): [string, string][] {
  const otelApi = otel();
  if (otelApi === null) return [];
  const span = otelApi.trace.getSpan(otelApi.context.active());
  const spanContext = span?.spanContext();
  if (spanContext === undefined || !otelApi.trace.isSpanContextValid(spanContext)) return [];
  const flags = (spanContext.traceFlags & 0x01).toString(16).padStart(2, '0');
  const pairs: [string, string][] = [['traceparent', `00-${spanContext.traceId}-${spanContext.spanId}-${flags}`]];
  const state = spanContext.traceState?.serialize();
  if (state) pairs.push(['tracestate', state]);
  return pairs;
}

/**
 * Runs `fn` in the active OpenTelemetry context with one more baggage entry
 * (replacing one of the same key), so that an instrumentation whose W3C
 * baggage propagator writes the `baggage` header (replacing the one the
 * adapter set) still sends it. Without @opentelemetry/api, or without a
 * context manager, it only runs `fn`.
 */
export function withBaggageEntry<T>(key: string, value: string, fn: () => T): T {
  const otelApi = otel();
  if (otelApi === null) return fn();
  const active = otelApi.context.active();
  const baggage = otelApi.propagation.getBaggage(active) ?? otelApi.propagation.createBaggage();
  return otelApi.context.with(otelApi.propagation.setBaggage(active, baggage.setEntry(key, { value })), fn);
}
