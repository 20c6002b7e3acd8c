/**
 * The Java client of retryd: ask it whether a failed outbound call may be
 * retried, report real traffic to fill the budgets, and let the adapters turn
 * what the JDK's {@link java.net.http.HttpClient} or grpc-java raised into
 * honest evidence.
 *
 * <ul>
 *   <li>{@link dev.retryd.client.RetrydClient}: {@code decide},
 *       {@code decideStream}, {@code reportTraffic}, with a short timeout bounded
 *       by the caller's deadline and the conservative {@link dev.retryd.client.LocalRule}
 *       when retryd cannot answer.</li>
 *   <li>{@link dev.retryd.client.TrafficReporter}: a daemon thread batching
 *       first-attempt counts, re-sending a failed batch under the same report id.</li>
 *   <li>{@link dev.retryd.client.RetryingHttpClient}: {@code send(request,
 *       bodyHandler, options)} over {@link java.net.http.HttpClient}.</li>
 *   <li>{@link dev.retryd.client.RetrydClientInterceptor}: the same contract for
 *       grpc-java unary calls.</li>
 * </ul>
 *
 * <p>Requests and enums are the types generated from
 * {@code proto/retryd/v1/retryd.proto} ({@code retryd.v1.Retryd.*}), so every
 * field of the contract, including ones added later, can be passed through.
 */
package dev.retryd.client;
