package dev.retryd.client;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * A misbehaving server on 127.0.0.1 (a ServerSocket on port 0): each accepted
 * connection is handed to the test's behaviour, which can read the request,
 * reset, hang, truncate or write garbage. Counts connections and requests read.
 */
final class RawServer implements AutoCloseable {
  interface Behaviour {
    void serve(Socket socket, RawServer server) throws Exception;
  }

  final ServerSocket socket;
  final AtomicInteger connections = new AtomicInteger();
  final AtomicInteger requests = new AtomicInteger();
  private final List<Socket> open = new CopyOnWriteArrayList<>();
  private final Thread acceptor;

  RawServer(Behaviour behaviour) throws IOException {
    socket = new ServerSocket(0, 50, InetAddress.getLoopbackAddress());
    acceptor =
        new Thread(
            () -> {
              while (!socket.isClosed()) {
                Socket client;
                try {
                  client = socket.accept();
                } catch (IOException closed) {
                  return;
                }
                connections.incrementAndGet();
                open.add(client);
                Thread worker =
                    new Thread(
                        () -> {
                          try {
                            behaviour.serve(client, this);
                          } catch (Exception ignored) {
                            // the client went away; that is what these servers provoke
                          }
                        },
                        "raw-server-conn");
                worker.setDaemon(true);
                worker.start();
              }
            },
            "raw-server");
    acceptor.setDaemon(true);
    acceptor.start();
  }

  int port() {
    return socket.getLocalPort();
  }

  String url(String scheme, String path) {
    return scheme + "://127.0.0.1:" + port() + path;
  }

  /** Reads one request (head and a Content-Length body); returns the head, or null at EOF. */
  String readRequest(Socket client) throws IOException {
    InputStream in = client.getInputStream();
    ByteArrayOutputStream head = new ByteArrayOutputStream();
    int matched = 0;
    while (matched < 4) {
      int b = in.read();
      if (b < 0) {
        return null;
      }
      head.write(b);
      matched = (b == "\r\n\r\n".charAt(matched)) ? matched + 1 : (b == '\r' ? 1 : 0);
    }
    String text = head.toString(StandardCharsets.ISO_8859_1);
    int length = 0;
    for (String line : text.split("\r\n")) {
      if (line.toLowerCase(Locale.ROOT).startsWith("content-length:")) {
        length = Integer.parseInt(line.substring(15).trim());
      }
    }
    in.readNBytes(length);
    requests.incrementAndGet();
    return text;
  }

  /** Resets the connection (RST, not FIN): SO_LINGER 0, then close. */
  static void reset(Socket client) throws IOException {
    client.setSoLinger(true, 0);
    client.close();
  }

  @Override
  public void close() throws IOException {
    socket.close();
    List<Socket> sockets = new ArrayList<>(open);
    for (Socket client : sockets) {
      client.close();
    }
  }
}
