package dev.retryd.client;

import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import java.io.IOException;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.Executors;

/**
 * An ordinary HTTP server on 127.0.0.1 (com.sun.net.httpserver) that answers
 * the n-th request with the n-th step of its script (the last step repeats),
 * and records when each request arrived and how many body bytes it carried.
 */
final class ScriptedHttpServer implements AutoCloseable {
  interface Step {
    void answer(HttpExchange exchange) throws IOException;
  }

  static Step status(int code, String... headers) {
    return exchange -> {
      for (int i = 0; i + 1 < headers.length; i += 2) {
        exchange.getResponseHeaders().add(headers[i], headers[i + 1]);
      }
      byte[] body = ("status " + code).getBytes(StandardCharsets.UTF_8);
      exchange.sendResponseHeaders(code, body.length);
      exchange.getResponseBody().write(body);
      exchange.close();
    };
  }

  final HttpServer server;
  final List<Long> arrivalsNanos = new CopyOnWriteArrayList<>();
  /** Wall-clock arrival times, for comparing with an HTTP-date. */
  final List<Long> arrivalsMillis = new CopyOnWriteArrayList<>();
  final List<Integer> bodyBytes = new CopyOnWriteArrayList<>();
  final List<String> authorizations = new CopyOnWriteArrayList<>();

  ScriptedHttpServer(Step... script) throws IOException {
    server = HttpServer.create(new InetSocketAddress(InetAddress.getLoopbackAddress(), 0), 0);
    server.setExecutor(Executors.newCachedThreadPool(runnable -> {
      Thread thread = new Thread(runnable, "scripted-http");
      thread.setDaemon(true);
      return thread;
    }));
    server.createContext(
        "/",
        exchange -> {
          arrivalsMillis.add(System.currentTimeMillis());
          arrivalsNanos.add(System.nanoTime());
          bodyBytes.add(exchange.getRequestBody().readAllBytes().length);
          String authorization = exchange.getRequestHeaders().getFirst("Authorization");
          authorizations.add(authorization == null ? "" : authorization);
          int index = Math.min(arrivalsNanos.size(), script.length) - 1;
          script[index].answer(exchange);
        });
    server.start();
  }

  String url(String path) {
    return "http://127.0.0.1:" + server.getAddress().getPort() + path;
  }

  int requests() {
    return arrivalsNanos.size();
  }

  /** Seconds between the arrivals of request i and i+1. */
  double gapSeconds(int i) {
    return (arrivalsNanos.get(i + 1) - arrivalsNanos.get(i)) / 1e9;
  }

  @Override
  public void close() {
    server.stop(0);
  }
}
