// Package retryd is the Go client of retryd, the service that decides
// whether a failed outbound call may be retried: RETRY after a backoff,
// DENY with a reason, or AMBIGUOUS (the request may have taken effect
// upstream: reconcile, do not retry).
//
// It has four parts:
//
//   - [Client] asks retryd ([Client.Decide], [Client.DecideStream]) and
//     reports real traffic ([Client.ReportTraffic]). When retryd cannot
//     answer in time it decides with a conservative local rule
//     ([LocalPolicy]; [Decision.Fallback] is then true). For an upstream in
//     shadow mode it decides with the same rule and keeps retryd's answer
//     beside it ([Decision.Shadow], [Decision.Retryd],
//     [Client.ShadowDivergences]).
//   - [TrafficReporter] batches first-attempt counts, which are what fill
//     retryd's per-upstream retry budgets, and sends them in the background.
//   - [Transport] is an [net/http.RoundTripper] that retries under retryd's
//     decisions, with the evidence of how far each attempt got taken from
//     [net/http/httptrace].
//   - [Client.UnaryClientInterceptor] does the same for grpc-go unary calls,
//     and [Client.StreamClientInterceptor] for streams (those it can send
//     again: opens that failed, and server-streaming calls before their
//     first response message).
//
// The generated contract (proto/retryd/v1/retryd.proto) is the package
// [github.com/retryd/retryd/clients/go/retrydv1]; requests are its
// DecideRequest, and its enums are used as they are.
package retryd
