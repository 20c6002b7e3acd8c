//! Fuzz target `trace_context`: W3C `traceparent` and `tracestate`.

use retryd::telemetry::TraceContext;

/// Fuzz target `trace_context`: the input's first line as `traceparent`,
/// the rest, if there is a line break, as `tracestate`.
pub fn trace_context(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match text.split_once('\n') {
        Some((traceparent, tracestate)) => check_trace_context(traceparent, Some(tracestate)),
        None => check_trace_context(&text, None),
    }
}

/// Lower-case hex, as W3C trace context spells ids.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Parsing never panics; what parses has non-zero ids, a bounded
/// `tracestate`, a version the specification allows, and re-encodes to a
/// `traceparent` that parses back to the same context.
pub fn check_trace_context(traceparent: &str, tracestate: Option<&str>) {
    let Some(context) = TraceContext::parse(traceparent, tracestate) else {
        return;
    };
    assert_ne!(context.trace_id, [0; 16]);
    assert_ne!(context.span_id, [0; 8]);
    let expected_state = tracestate.filter(|state| state.len() <= 512).unwrap_or("");
    assert_eq!(context.trace_state, expected_state);
    // W3C Trace Context §3.2.2.1: `version = 2HEXDIGLC`, and ff is invalid.
    let version = traceparent.trim().split('-').next().unwrap_or_default();
    assert!(
        version.len() == 2
            && version
                .bytes()
                .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte))
            && version != "ff",
        "traceparent version {version:?} accepted: {traceparent:?}"
    );
    let encoded = format!(
        "00-{}-{}-{:02x}",
        hex(&context.trace_id),
        hex(&context.span_id),
        u8::from(context.sampled)
    );
    let again = TraceContext::parse(&encoded, Some(&context.trace_state));
    assert_eq!(again.as_ref(), Some(&context), "{encoded:?}");
}
