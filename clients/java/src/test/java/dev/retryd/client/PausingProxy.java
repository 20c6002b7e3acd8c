package dev.retryd.client;

import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;

/**
 * A TCP proxy on 127.0.0.1 whose server-to-client direction can be held: the
 * server's answers wait in the proxy (nothing is lost or reordered) while the
 * requests still get through. That is how "retryd applied it, but its answer
 * never came" is made on loopback.
 */
final class PausingProxy implements AutoCloseable {
  private final ServerSocket listener;
  private final List<Socket> sockets = new CopyOnWriteArrayList<>();
  private volatile boolean holding;

  PausingProxy(int targetPort) throws IOException {
    listener = new ServerSocket(0, 50, InetAddress.getLoopbackAddress());
    Thread acceptor =
        new Thread(
            () -> {
              while (!listener.isClosed()) {
                try {
                  Socket client = listener.accept();
                  Socket server = new Socket(InetAddress.getLoopbackAddress(), targetPort);
                  client.setTcpNoDelay(true);
                  server.setTcpNoDelay(true);
                  sockets.add(client);
                  sockets.add(server);
                  pump(client.getInputStream(), server.getOutputStream(), false);
                  pump(server.getInputStream(), client.getOutputStream(), true);
                } catch (IOException closed) {
                  return;
                }
              }
            },
            "pausing-proxy");
    acceptor.setDaemon(true);
    acceptor.start();
  }

  int port() {
    return listener.getLocalPort();
  }

  /** Holds (true) or releases (false) everything the server sends. */
  void hold(boolean value) {
    holding = value;
  }

  private void pump(InputStream in, OutputStream out, boolean holdable) {
    Thread thread =
        new Thread(
            () -> {
              byte[] buffer = new byte[16384];
              try {
                int n;
                while ((n = in.read(buffer)) >= 0) {
                  while (holdable && holding) {
                    Thread.sleep(5);
                  }
                  out.write(buffer, 0, n);
                  out.flush();
                }
              } catch (IOException | InterruptedException closed) {
                // either side went away
              }
            },
            "pausing-proxy-pump");
    thread.setDaemon(true);
    thread.start();
  }

  @Override
  public void close() throws IOException {
    listener.close();
    for (Socket socket : sockets) {
      socket.close();
    }
  }
}
