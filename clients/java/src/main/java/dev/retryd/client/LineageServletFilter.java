package dev.retryd.client;

import java.io.IOException;
import java.io.PrintWriter;
import java.io.Writer;
import java.util.Collections;
import java.util.Objects;
import javax.servlet.Filter;
import javax.servlet.FilterChain;
import javax.servlet.FilterConfig;
import javax.servlet.ServletException;
import javax.servlet.ServletOutputStream;
import javax.servlet.ServletRequest;
import javax.servlet.ServletResponse;
import javax.servlet.WriteListener;
import javax.servlet.http.HttpServletRequest;
import javax.servlet.http.HttpServletResponse;
import javax.servlet.http.HttpServletResponseWrapper;

/**
 * The inbound side of a call chain (docs/lineage.md) for servlets ({@code
 * javax.servlet} 3.1 and later; tested in Jetty 9.4): what {@link
 * LineageFilter} does for {@code com.sun.net.httpserver}. It reads the request's
 * {@code retryd.lineage} baggage member into the {@link io.grpc.Context} the
 * servlet runs in (see {@link Lineage}), so that {@link RetryingHttpClient} and
 * {@link RetrydClientInterceptor} send it with no code of yours, and adds {@code
 * retryd-retried: <layer>} to a 5xx response when one of the servlet's outbound
 * calls ended in failure after retryd's decision.
 *
 * <pre>{@code
 * ServletContextHandler context = new ServletContextHandler();
 * context.addFilter(new FilterHolder(LineageServletFilter.of(retryd)), "/*", EnumSet.of(DispatcherType.REQUEST));
 * }</pre>
 *
 * <p>In a {@code web.xml}, the class with no argument names its layer by the
 * init parameter {@code layer}, else by {@link Lineage#defaultLayer()}.
 *
 * <p>The servlet API is an optional ({@code provided}) dependency of this
 * client: only this class uses it, and the container brings it.
 *
 * <p>Headers cannot change once the response is committed, so the servlet gets
 * the response wrapped, and the header is added (if the status is 5xx and the
 * mark was set by then) at each point where the response may commit: {@code
 * sendError}, {@code flushBuffer}, each write or flush of its output stream or
 * writer, and when the servlet returns or throws with the response not yet
 * committed. An outbound call made on another thread must carry the context
 * there ({@code Context.current().wrap(task)}) and end before the servlet
 * writes its body. Asynchronous servlets ({@code startAsync}) run outside the
 * context once the filter has returned; carry it yourself (wrap the tasks you
 * start) and answer on the wrapped response ({@code startAsync(request, response)}).
 */
public final class LineageServletFilter implements Filter {
  /** The init parameter naming the layer, for a filter a container makes from {@code web.xml}. */
  public static final String LAYER_PARAMETER = "layer";

  private volatile String layer;

  /** For a container that makes the filter itself ({@code web.xml}): the layer comes from {@link #init}. */
  public LineageServletFilter() {
    this.layer = null;
  }

  private LineageServletFilter(String layer) {
    this.layer = validLayer(layer);
  }

  /** A filter naming this layer as {@code retryd}'s {@link RetrydClient#layer()}. */
  public static LineageServletFilter of(RetrydClient retryd) {
    return new LineageServletFilter(Objects.requireNonNull(retryd, "retryd").layer());
  }

  /** A filter naming this layer {@code layer} (the same name as the outbound adapters' client). */
  public static LineageServletFilter of(String layer) {
    return new LineageServletFilter(layer);
  }

  private static String validLayer(String layer) {
    if (!Lineage.isValidLayer(layer)) {
      throw new IllegalArgumentException("layer: 1 to 64 bytes of [A-Za-z0-9._-], got " + layer);
    }
    return layer;
  }

  /** The layer this filter names on a marked response. */
  public String layer() {
    String named = layer;
    return named != null ? named : Lineage.defaultLayer();
  }

  /**
   * Takes the init parameter {@code layer} if the filter was made without one
   * (a bad name fails the filter's start, naming the parameter).
   */
  @Override
  public void init(FilterConfig config) throws ServletException {
    if (layer != null || config == null) {
      return;
    }
    String parameter = config.getInitParameter(LAYER_PARAMETER);
    if (parameter == null) {
      layer = Lineage.defaultLayer();
      return;
    }
    if (!Lineage.isValidLayer(parameter.trim())) {
      throw new ServletException("init parameter " + LAYER_PARAMETER + ": 1 to 64 bytes of [A-Za-z0-9._-], got " + parameter);
    }
    layer = parameter.trim();
  }

  @Override
  public void doFilter(ServletRequest request, ServletResponse response, FilterChain chain) throws IOException, ServletException {
    if (!(request instanceof HttpServletRequest) || !(response instanceof HttpServletResponse)) {
      chain.doFilter(request, response);
      return;
    }
    HttpServletRequest http = (HttpServletRequest) request;
    java.util.Enumeration<String> baggage = http.getHeaders("baggage");
    Lineage.Inbound inbound =
        Lineage.inbound(Lineage.fromBaggage(baggage == null ? null : Collections.list(baggage)).orElse(""));
    Marking marking = new Marking((HttpServletResponse) response, inbound, layer());
    io.grpc.Context served = Lineage.withInbound(io.grpc.Context.current(), inbound);
    io.grpc.Context previous = served.attach();
    try {
      chain.doFilter(request, marking);
    } catch (IOException | ServletException | RuntimeException | Error thrown) {
      // The container answers an uncommitted response with a 500.
      marking.beforeCommit(500);
      throw thrown;
    } finally {
      served.detach(previous);
    }
    // The servlet returned without committing: its status is final now.
    marking.beforeCommit();
  }

  @Override
  public void destroy() {}

  /** The response, but {@code retryd-retried} is added before it can commit with a 5xx status. */
  private static final class Marking extends HttpServletResponseWrapper {
    private final HttpServletResponse response;
    private final Lineage.Inbound inbound;
    private final String layer;
    private ServletOutputStream stream;
    private PrintWriter writer;

    Marking(HttpServletResponse response, Lineage.Inbound inbound, String layer) {
      super(response);
      this.response = response;
      this.inbound = inbound;
      this.layer = layer;
    }

    /** Adds the header if the response is still open, {@code status} is 5xx and an outbound call failed after its decision. */
    void beforeCommit(int status) {
      if (status >= 500 && status <= 599 && inbound.failedAfterDecision() && !response.isCommitted()) {
        response.setHeader(Lineage.RETRIED_HEADER, layer);
      }
    }

    void beforeCommit() {
      beforeCommit(response.getStatus());
    }

    @Override
    public void sendError(int status) throws IOException {
      beforeCommit(status);
      super.sendError(status);
    }

    @Override
    public void sendError(int status, String message) throws IOException {
      beforeCommit(status);
      super.sendError(status, message);
    }

    @Override
    public void flushBuffer() throws IOException {
      beforeCommit();
      super.flushBuffer();
    }

    @Override
    public ServletOutputStream getOutputStream() throws IOException {
      if (stream == null) {
        stream = new MarkingStream(response.getOutputStream(), this);
      }
      return stream;
    }

    @Override
    public PrintWriter getWriter() throws IOException {
      if (writer == null) {
        writer = new MarkingWriter(response.getWriter(), this);
      }
      return writer;
    }
  }

  /** The response's output stream; each write or flush may commit, so the header goes first. */
  private static final class MarkingStream extends ServletOutputStream {
    private final ServletOutputStream out;
    private final Marking marking;

    MarkingStream(ServletOutputStream out, Marking marking) {
      this.out = out;
      this.marking = marking;
    }

    @Override
    public void write(int b) throws IOException {
      marking.beforeCommit();
      out.write(b);
    }

    @Override
    public void write(byte[] bytes, int offset, int length) throws IOException {
      marking.beforeCommit();
      out.write(bytes, offset, length);
    }

    @Override
    public void flush() throws IOException {
      marking.beforeCommit();
      out.flush();
    }

    @Override
    public void close() throws IOException {
      marking.beforeCommit();
      out.close();
    }

    @Override
    public boolean isReady() {
      return out.isReady();
    }

    @Override
    public void setWriteListener(WriteListener listener) {
      out.setWriteListener(listener);
    }
  }

  /** The response's writer, likewise (every print method of a PrintWriter ends in these). */
  private static final class MarkingWriter extends PrintWriter {
    private final Marking marking;

    MarkingWriter(Writer out, Marking marking) {
      super(out);
      this.marking = marking;
    }

    @Override
    public void write(int c) {
      marking.beforeCommit();
      super.write(c);
    }

    @Override
    public void write(char[] chars, int offset, int length) {
      marking.beforeCommit();
      super.write(chars, offset, length);
    }

    @Override
    public void write(String text, int offset, int length) {
      marking.beforeCommit();
      super.write(text, offset, length);
    }

    @Override
    public void flush() {
      marking.beforeCommit();
      super.flush();
    }

    @Override
    public void close() {
      marking.beforeCommit();
      super.close();
    }
  }
}
