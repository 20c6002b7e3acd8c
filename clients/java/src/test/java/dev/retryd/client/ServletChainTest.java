package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.sun.net.httpserver.HttpServer;
import java.io.IOException;
import java.net.InetSocketAddress;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.EnumSet;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.atomic.AtomicReference;
import javax.servlet.DispatcherType;
import javax.servlet.ServletException;
import javax.servlet.http.HttpServlet;
import javax.servlet.http.HttpServletRequest;
import javax.servlet.http.HttpServletResponse;
import org.eclipse.jetty.server.Server;
import org.eclipse.jetty.server.ServerConnector;
import org.eclipse.jetty.servlet.FilterHolder;
import org.eclipse.jetty.servlet.ServletContextHandler;
import org.eclipse.jetty.servlet.ServletHolder;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.Idempotency;

/**
 * {@link LineageServletFilter} in a real servlet container: an embedded Jetty
 * 9.4 on loopback is the middle of a chain, its servlet calls a back end
 * ({@code com.sun.net.httpserver}, 503 or 200 or 404 by path) through {@link
 * RetryingHttpClient} with no lineage code of its own, against a real retryd.
 * The servlet answers in the way the request's {@code answer} parameter says,
 * so that each way a servlet can commit its response is seen: the container at
 * the end ({@code setStatus}), {@code sendError}, a body written and flushed,
 * an exception.
 *
 * <p>retryd must apply the chain rule: the suite fails, not skips, on one that does not.
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
class ServletChainTest {
  private RetrydServer retrydServer;
  private RetrydClient edgeRetryd;
  private RetrydClient middleRetryd;
  private RetryingHttpClient middleHttp;
  private RetryingHttpClient edgeHttp;
  private HttpServer backEnd;
  private Server jetty;
  private final List<String> backEndBaggage = new CopyOnWriteArrayList<>();
  private final List<String> middleLineage = new CopyOnWriteArrayList<>();
  private final AtomicReference<Decision> middleDecision = new AtomicReference<>();
  private final AtomicReference<Boolean> committedByServlet = new AtomicReference<>();

  @BeforeAll
  void start() throws Exception {
    retrydServer = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
    edgeRetryd = RetrydClient.builder(retrydServer.target()).timeout(Duration.ofSeconds(5)).layer("edge").build();
    middleRetryd = RetrydClient.builder(retrydServer.target()).timeout(Duration.ofSeconds(5)).layer("middle").build();
    Decision probe =
        edgeRetryd.decide(
            DecideRequest.newBuilder().setUpstream("java-servlet-probe").setIdempotency(Idempotency.IDEMPOTENCY_SAFE).setAttempt(1)
                .setEvidence(Evidence.EVIDENCE_RESPONSE_RECEIVED).setHttpStatus(503).setRetriedBelow("probe").build());
    assertFalse(probe.fallback(), "retryd must answer the probe");
    // A retryd without the chain rule fails the suite rather than skipping it.
    assertEquals(DenyReason.DENY_REASON_RETRIED_BELOW, probe.denyReason(), "this retryd does not apply the chain rule: " + RetrydServer.binary());

    backEnd = HttpServer.create(new InetSocketAddress("127.0.0.1", 0), 0);
    backEnd.createContext(
        "/",
        exchange -> {
          backEndBaggage.add(String.join("|", exchange.getRequestHeaders().getOrDefault("baggage", List.of())));
          exchange.getRequestBody().readAllBytes();
          String path = exchange.getRequestURI().getPath();
          exchange.sendResponseHeaders(path.equals("/ok") ? 200 : path.equals("/missing") ? 404 : 503, -1);
          exchange.close();
        });
    backEnd.start();
    middleHttp = RetryingHttpClient.builder(HttpClient.newHttpClient(), middleRetryd).noTrafficReport().build();
    edgeHttp = RetryingHttpClient.builder(HttpClient.newHttpClient(), edgeRetryd).noTrafficReport().build();

    ServletContextHandler context = new ServletContextHandler();
    context.addServlet(new ServletHolder(new Middle()), "/*");
    context.addFilter(new FilterHolder(LineageServletFilter.of(middleRetryd)), "/*", EnumSet.of(DispatcherType.REQUEST));
    // As a web.xml declares it: made by the container, named by its init parameter.
    ServletContextHandler declared = new ServletContextHandler();
    declared.setContextPath("/declared");
    declared.addServlet(new ServletHolder(new Middle()), "/*");
    FilterHolder holder = new FilterHolder(LineageServletFilter.class);
    holder.setInitParameter(LineageServletFilter.LAYER_PARAMETER, "middle-declared");
    declared.addFilter(holder, "/*", EnumSet.of(DispatcherType.REQUEST));
    org.eclipse.jetty.server.handler.ContextHandlerCollection contexts = new org.eclipse.jetty.server.handler.ContextHandlerCollection();
    contexts.addHandler(declared);
    contexts.addHandler(context);
    jetty = new Server(new InetSocketAddress("127.0.0.1", 0));
    jetty.setHandler(contexts);
    jetty.start();
  }

  /** The middle's servlet: calls the back end's {@code below} path, answers as {@code answer} says. */
  private final class Middle extends HttpServlet {
    private static final long serialVersionUID = 1L;

    @Override
    protected void doGet(HttpServletRequest request, HttpServletResponse response) throws IOException, ServletException {
      middleLineage.add(Lineage.current().map(Lineage.Inbound::lineage).orElse("<none>"));
      String answer = request.getParameter("answer");
      int status = 503; // answer=own: the servlet's own failure, no call below
      if (!"own".equals(answer)) {
        try {
          RetriedResponse<Void> below =
              middleHttp.send(
                  HttpRequest.newBuilder(URI.create("http://127.0.0.1:" + backEnd.getAddress().getPort() + "/" + request.getParameter("below"))).build(),
                  HttpResponse.BodyHandlers.discarding(),
                  RetryOptions.builder("java-servlet-back").idempotency(Idempotency.IDEMPOTENCY_SAFE).deadline(Duration.ofSeconds(5)).build());
          middleDecision.set(below.decision().orElse(null));
          status = below.statusCode() >= 500 ? 503 : below.statusCode();
        } catch (InterruptedException interrupted) {
          Thread.currentThread().interrupt();
          throw new ServletException(interrupted);
        }
      }
      switch (answer) {
        case "sendError":
          response.sendError(status, "dependency failed");
          committedByServlet.set(response.isCommitted());
          break;
        case "flush":
          response.setStatus(status);
          response.setContentType("text/plain");
          response.getOutputStream().write("answered\n".getBytes(StandardCharsets.UTF_8));
          response.getOutputStream().flush();
          committedByServlet.set(response.isCommitted());
          break;
        case "writer":
          response.setStatus(status);
          response.getWriter().println("answered");
          response.flushBuffer();
          committedByServlet.set(response.isCommitted());
          break;
        case "throw":
          if (status >= 500) {
            throw new ServletException("dependency failed");
          }
          break;
        default:
          response.setStatus(status);
      }
    }
  }

  @BeforeEach
  void reset() {
    backEndBaggage.clear();
    middleLineage.clear();
    middleDecision.set(null);
    committedByServlet.set(null);
  }

  @AfterAll
  void stop() throws Exception {
    jetty.stop();
    backEnd.stop(0);
    middleHttp.close();
    edgeHttp.close();
    edgeRetryd.close();
    middleRetryd.close();
    retrydServer.close();
  }

  private URI middle(String query) {
    return URI.create("http://127.0.0.1:" + ((ServerConnector) jetty.getConnectors()[0]).getLocalPort() + "/orders?" + query);
  }

  private static HttpResponse<String> plainGet(URI uri, String baggage) throws Exception {
    HttpRequest.Builder request = HttpRequest.newBuilder(uri);
    if (baggage != null) {
      request.header("baggage", baggage);
    }
    return HttpClient.newHttpClient().send(request.build(), HttpResponse.BodyHandlers.ofString());
  }

  @Test
  void theLineageReachesEveryAttemptAndTheFailureIsMarked() throws Exception {
    // A plain client as the edge, so that what the middle does is seen whatever retryd's rule.
    HttpResponse<String> response = plainGet(middle("below=fail&answer=setStatus"), "userId=42,retryd.lineage=edge:1");
    assertEquals(503, response.statusCode());
    assertEquals(List.of("middle"), response.headers().allValues("retryd-retried"));
    assertEquals(List.of("edge:1"), middleLineage);
    // max_attempts = 3: each attempt carries the inbound lineage and its own number.
    assertEquals(
        List.of("retryd.lineage=edge:1/middle:1", "retryd.lineage=edge:1/middle:2", "retryd.lineage=edge:1/middle:3"), backEndBaggage);
    assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS, middleDecision.get().denyReason());
    assertFalse(middleDecision.get().fallback());
  }

  @Test
  void theMarkIsSetWhenTheServletCommitsTheResponseItself() throws Exception {
    for (String answer : List.of("sendError", "flush", "writer")) {
      reset();
      HttpResponse<String> response = plainGet(middle("below=fail&answer=" + answer), "retryd.lineage=edge:1");
      assertEquals(503, response.statusCode(), answer);
      assertEquals(List.of("middle"), response.headers().allValues("retryd-retried"), answer);
      assertEquals(3, backEndBaggage.size(), answer);
      if (!answer.equals("sendError")) {
        // Jetty 9.4 commits a sendError when the servlet returns; a flushed body at once.
        assertEquals(Boolean.TRUE, committedByServlet.get(), answer);
        assertTrue(response.body().startsWith("answered"), answer + ": " + response.body());
      }
    }
  }

  @Test
  void aServletThatThrowsAfterAFailedCallGetsItsContainer500Marked() throws Exception {
    HttpResponse<String> response = plainGet(middle("below=fail&answer=throw"), "retryd.lineage=edge:1");
    assertEquals(500, response.statusCode());
    assertEquals(List.of("middle"), response.headers().allValues("retryd-retried"));
  }

  @Test
  void onlyA5xxAfterAFailedDecisionIsMarked() throws Exception {
    // A success below, a 404 below (a success: no decision), the servlet's own 503 without a call.
    for (String query : List.of("below=ok&answer=setStatus", "below=ok&answer=flush", "below=missing&answer=sendError", "answer=own")) {
      HttpResponse<String> response = plainGet(middle(query), "retryd.lineage=edge:1");
      assertEquals(List.of(), response.headers().allValues("retryd-retried"), query);
    }
    assertEquals(List.of("retryd.lineage=edge:1/middle:1", "retryd.lineage=edge:1/middle:1", "retryd.lineage=edge:1/middle:1"), backEndBaggage);
    // No baggage at all: an empty lineage, still a request served by the filter.
    reset();
    HttpResponse<String> plain = plainGet(middle("below=ok&answer=setStatus"), null);
    assertEquals(200, plain.statusCode());
    assertEquals(List.of(""), middleLineage);
    assertEquals(List.of("retryd.lineage=middle:1"), backEndBaggage);
  }

  @Test
  void aCallInsideAnEnclosingRetryIsNotRetriedAndTheDecideSaysWhy() throws Exception {
    // The edge's second attempt reaches the middle: the back-end call is tried once.
    HttpResponse<String> response = plainGet(middle("below=fail&answer=setStatus"), "retryd.lineage=edge:2");
    assertEquals(List.of("retryd.lineage=edge:2/middle:1"), backEndBaggage);
    Decision decision = middleDecision.get();
    assertEquals(DenyReason.DENY_REASON_INSIDE_ENCLOSING_RETRY, decision.denyReason());
    assertFalse(decision.fallback());
    // The Decide carried the inbound lineage: retryd names the enclosing attempt.
    assertTrue(decision.explanation().contains("inside attempt 2 of layer edge"), decision.explanation());
    // Denied is "ended in failure after retryd's decision": the 503 is marked too.
    assertEquals(503, response.statusCode());
    assertEquals(List.of("middle"), response.headers().allValues("retryd-retried"));
  }

  @Test
  void theEdgeAboveReportsRetriedBelowAndDoesNotRetry() throws Exception {
    RetriedResponse<Void> response =
        edgeHttp.send(
            HttpRequest.newBuilder(middle("below=fail&answer=sendError")).header("baggage", "userId=42").build(),
            HttpResponse.BodyHandlers.discarding(),
            RetryOptions.builder("java-servlet-middle").idempotency(Idempotency.IDEMPOTENCY_SAFE).deadline(Duration.ofSeconds(10)).build());
    assertEquals(503, response.statusCode());
    assertEquals(1, response.attempts());
    Decision decision = response.decision().orElseThrow();
    assertEquals(DenyReason.DENY_REASON_RETRIED_BELOW, decision.denyReason());
    assertFalse(decision.fallback());
    assertTrue(decision.explanation().contains("retried by layer middle"), decision.explanation());
    assertEquals(List.of("edge:1"), middleLineage);
    assertEquals(3, backEndBaggage.size(), backEndBaggage.toString());
    assertEquals(
        List.of("retryd.lineage=edge:1/middle:1", "retryd.lineage=edge:1/middle:2", "retryd.lineage=edge:1/middle:3"), backEndBaggage);
  }

  @Test
  void aFilterTheContainerMakesTakesItsLayerFromTheInitParameter() throws Exception {
    URI declared = URI.create(middle("below=fail&answer=setStatus").toString().replace("/orders?", "/declared/orders?"));
    HttpResponse<String> response = plainGet(declared, "retryd.lineage=edge:1");
    assertEquals(503, response.statusCode());
    assertEquals(List.of("middle-declared"), response.headers().allValues("retryd-retried"));
    assertEquals(List.of("edge:1"), middleLineage);
    assertThrows(IllegalArgumentException.class, () -> LineageServletFilter.of("not a layer"));
  }
}
