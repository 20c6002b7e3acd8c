package dev.retryd.client;

import com.sun.net.httpserver.Filter;
import com.sun.net.httpserver.Headers;
import com.sun.net.httpserver.HttpContext;
import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpPrincipal;
import com.sun.net.httpserver.HttpsExchange;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.net.URI;
import java.util.Objects;

/**
 * The inbound side of a call chain (docs/lineage.md) for the JDK's {@code
 * com.sun.net.httpserver}: reads the request's {@code retryd.lineage} baggage
 * member into the handler's {@link io.grpc.Context} (see {@link Lineage}), and
 * adds {@code retryd-retried: <layer>} to a 5xx response when one of the
 * handler's outbound calls ended in failure after retryd's decision.
 *
 * <pre>{@code
 * HttpContext context = server.createContext("/", handler);
 * context.getFilters().add(LineageFilter.of(retryd));   // retryd.layer() names this layer
 * }</pre>
 *
 * <p>The JDK writes the status and headers in {@code sendResponseHeaders}, so
 * the handler (and the filters after this one) get the exchange wrapped: its
 * {@code sendResponseHeaders} adds the header first, when the status is 5xx and
 * the mark was set by then. An outbound call made on another thread must carry
 * the context there ({@code Context.current().wrap(task)}) and end before the
 * handler sends its status. On an {@code HttpsServer} the wrapped exchange is
 * an {@code HttpsExchange} with the same {@code SSLSession}.
 */
public final class LineageFilter extends Filter {
  private final String layer;

  private LineageFilter(String layer) {
    if (!Lineage.isValidLayer(layer)) {
      throw new IllegalArgumentException("layer: 1 to 64 bytes of [A-Za-z0-9._-], got " + layer);
    }
    this.layer = layer;
  }

  /** A filter naming this layer as {@code retryd}'s {@link RetrydClient#layer()}. */
  public static LineageFilter of(RetrydClient retryd) {
    return new LineageFilter(Objects.requireNonNull(retryd, "retryd").layer());
  }

  /** A filter naming this layer {@code layer} (the same name as the outbound adapters' client). */
  public static LineageFilter of(String layer) {
    return new LineageFilter(layer);
  }

  @Override
  public String description() {
    return "retryd lineage (docs/lineage.md): retryd.lineage baggage in, retryd-retried out";
  }

  @Override
  public void doFilter(HttpExchange exchange, Chain chain) throws IOException {
    Lineage.Inbound inbound =
        Lineage.inbound(Lineage.fromBaggage(exchange.getRequestHeaders().get("baggage")).orElse(""));
    Marking marking = new Marking(exchange, inbound, layer);
    // An HttpsServer's handler may read the TLS session: it gets an HttpsExchange still.
    HttpExchange wrapped = exchange instanceof HttpsExchange ? new MarkingHttps((HttpsExchange) exchange, marking) : marking;
    io.grpc.Context served = Lineage.withInbound(io.grpc.Context.current(), inbound);
    io.grpc.Context previous = served.attach();
    try {
      chain.doFilter(wrapped);
    } finally {
      served.detach(previous);
    }
  }

  /** The exchange, but its response headers get retryd-retried before a 5xx status is sent. */
  private static final class Marking extends HttpExchange {
    private final HttpExchange exchange;
    private final Lineage.Inbound inbound;
    private final String layer;

    Marking(HttpExchange exchange, Lineage.Inbound inbound, String layer) {
      this.exchange = exchange;
      this.inbound = inbound;
      this.layer = layer;
    }

    @Override
    public void sendResponseHeaders(int code, long length) throws IOException {
      if (code >= 500 && code <= 599 && inbound.failedAfterDecision()) {
        exchange.getResponseHeaders().set(Lineage.RETRIED_HEADER, layer);
      }
      exchange.sendResponseHeaders(code, length);
    }

    @Override
    public Headers getRequestHeaders() {
      return exchange.getRequestHeaders();
    }

    @Override
    public Headers getResponseHeaders() {
      return exchange.getResponseHeaders();
    }

    @Override
    public URI getRequestURI() {
      return exchange.getRequestURI();
    }

    @Override
    public String getRequestMethod() {
      return exchange.getRequestMethod();
    }

    @Override
    public HttpContext getHttpContext() {
      return exchange.getHttpContext();
    }

    @Override
    public void close() {
      exchange.close();
    }

    @Override
    public InputStream getRequestBody() {
      return exchange.getRequestBody();
    }

    @Override
    public OutputStream getResponseBody() {
      return exchange.getResponseBody();
    }

    @Override
    public InetSocketAddress getRemoteAddress() {
      return exchange.getRemoteAddress();
    }

    @Override
    public int getResponseCode() {
      return exchange.getResponseCode();
    }

    @Override
    public InetSocketAddress getLocalAddress() {
      return exchange.getLocalAddress();
    }

    @Override
    public String getProtocol() {
      return exchange.getProtocol();
    }

    @Override
    public Object getAttribute(String name) {
      return exchange.getAttribute(name);
    }

    @Override
    public void setAttribute(String name, Object value) {
      exchange.setAttribute(name, value);
    }

    @Override
    public void setStreams(InputStream input, OutputStream output) {
      exchange.setStreams(input, output);
    }

    @Override
    public HttpPrincipal getPrincipal() {
      return exchange.getPrincipal();
    }
  }

  /** {@link Marking} for an {@code HttpsServer}'s exchange: the same, plus its TLS session. */
  private static final class MarkingHttps extends HttpsExchange {
    private final HttpsExchange exchange;
    private final Marking marking;

    MarkingHttps(HttpsExchange exchange, Marking marking) {
      this.exchange = exchange;
      this.marking = marking;
    }

    @Override
    public javax.net.ssl.SSLSession getSSLSession() {
      return exchange.getSSLSession();
    }

    @Override
    public void sendResponseHeaders(int code, long length) throws IOException {
      marking.sendResponseHeaders(code, length);
    }

    @Override
    public Headers getRequestHeaders() {
      return marking.getRequestHeaders();
    }

    @Override
    public Headers getResponseHeaders() {
      return marking.getResponseHeaders();
    }

    @Override
    public URI getRequestURI() {
      return marking.getRequestURI();
    }

    @Override
    public String getRequestMethod() {
      return marking.getRequestMethod();
    }

    @Override
    public HttpContext getHttpContext() {
      return marking.getHttpContext();
    }

    @Override
    public void close() {
      marking.close();
    }

    @Override
    public InputStream getRequestBody() {
      return marking.getRequestBody();
    }

    @Override
    public OutputStream getResponseBody() {
      return marking.getResponseBody();
    }

    @Override
    public InetSocketAddress getRemoteAddress() {
      return marking.getRemoteAddress();
    }

    @Override
    public int getResponseCode() {
      return marking.getResponseCode();
    }

    @Override
    public InetSocketAddress getLocalAddress() {
      return marking.getLocalAddress();
    }

    @Override
    public String getProtocol() {
      return marking.getProtocol();
    }

    @Override
    public Object getAttribute(String name) {
      return marking.getAttribute(name);
    }

    @Override
    public void setAttribute(String name, Object value) {
      marking.setAttribute(name, value);
    }

    @Override
    public void setStreams(InputStream input, OutputStream output) {
      marking.setStreams(input, output);
    }

    @Override
    public HttpPrincipal getPrincipal() {
      return marking.getPrincipal();
    }
  }
}
