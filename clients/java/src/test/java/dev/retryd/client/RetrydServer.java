package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.fail;

import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;

/** A real retryd ($RETRYD_BIN, default <repo>/target/debug/retryd) on 127.0.0.1 ports of its own. */
final class RetrydServer implements AutoCloseable {
  /** Fast backoffs, so that end-to-end retry tests sleep milliseconds; like the Python suite's. */
  static final String CLIENT_TEST_CONFIG =
      String.join(
          "\n",
          "[server]",
          "listen = \"127.0.0.1:0\"",
          "metrics_listen = \"127.0.0.1:0\"",
          "",
          "[defaults]",
          "max_attempts = 3",
          "min_attempt_budget = \"20ms\"",
          "max_retry_after = \"60s\"",
          "transient_500 = false",
          "budget = { capacity = 1000.0, initial = 1000.0, ratio = 0.1, min_per_second = 1.0 }",
          "backoff = { base = \"10ms\", max = \"50ms\", jitter = \"full\" }",
          "",
          "# A large minimum attempt budget, so deadline tests need no tight timing.",
          "[upstreams.\"java-slow\"]",
          "min_attempt_budget = \"300ms\"",
          "",
          "# An empty budget that traffic hardly refills (issue 36: a denied retry keeps its mark).",
          "[upstreams.\"java-budgetless\"]",
          "budget = { capacity = 10.0, initial = 0.0, ratio = 0.1, min_per_second = 0.0 }",
          "",
          "[upstreams.\"java-empty\"]",
          "budget = { capacity = 10.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }",
          "",
          "# Budgets that show exactly what traffic reports deposited (one token a request, no refill).",
          "[upstreams.\"java-report\"]",
          "budget = { capacity = 1000.0, initial = 0.0, ratio = 1.0, min_per_second = 0.0 }",
          "[upstreams.\"java-report-resend\"]",
          "budget = { capacity = 1000.0, initial = 0.0, ratio = 1.0, min_per_second = 0.0 }",
          "[upstreams.\"java-reported\"]",
          "budget = { capacity = 1000.0, initial = 10.0, ratio = 1.0, min_per_second = 0.0 }",
          "[upstreams.\"java-report-unanswered\"]",
          "budget = { capacity = 1000.0, initial = 0.0, ratio = 1.0, min_per_second = 0.0 }",
          "[upstreams.\"java-frozen-budget\"]",
          "budget = { capacity = 10.0, initial = 10.0, ratio = 1.0, min_per_second = 0.0 }",
          "[upstreams.\"java-report-daemon\"]",
          "budget = { capacity = 1000.0, initial = 0.0, ratio = 1.0, min_per_second = 0.0 }",
          "");

  /** The client test configuration on a fixed gRPC port (for restart tests). */
  static String clientTestConfigOn(int port) {
    return CLIENT_TEST_CONFIG.replaceFirst("listen = \"127.0.0.1:0\"", "listen = \"127.0.0.1:" + port + "\"");
  }

  final String grpc;
  final String metrics;
  final Path directory;
  private final Process process;

  private RetrydServer(String grpc, String metrics, Path directory, Process process) {
    this.grpc = grpc;
    this.metrics = metrics;
    this.directory = directory;
    this.process = process;
  }

  static Path repo() {
    return Paths.get(System.getProperty("retryd.repo", "../..")).toAbsolutePath().normalize();
  }

  static Path binary() {
    String env = System.getenv("RETRYD_BIN");
    Path path = env == null || env.isEmpty() ? repo().resolve("target/debug/retryd") : Paths.get(env);
    if (!Files.isExecutable(path)) {
      fail("retryd binary not found at " + path + ": build it (cargo build --bin retryd) or set RETRYD_BIN");
    }
    return path;
  }

  static RetrydServer start(String config) throws IOException {
    Path directory = Files.createTempDirectory("retryd-java-");
    Path configFile = directory.resolve("retryd.toml");
    Files.writeString(configFile, config);
    return start(configFile, directory);
  }

  /** Starts retryd on a configuration file; for a restart, pass a config with fixed ports. */
  static RetrydServer start(Path configFile, Path directory) throws IOException {
    Process process =
        new ProcessBuilder(binary().toString(), "serve", "--config", configFile.toString())
            .redirectInput(ProcessBuilder.Redirect.from(new java.io.File("/dev/null")))
            .redirectError(ProcessBuilder.Redirect.appendTo(directory.resolve("retryd.stderr").toFile()))
            .start();
    BufferedReader stdout = new BufferedReader(new InputStreamReader(process.getInputStream(), StandardCharsets.UTF_8));
    CompletableFuture<String> firstLine = new CompletableFuture<>();
    Thread reader =
        new Thread(
            () -> {
              try {
                firstLine.complete(stdout.readLine());
                while (stdout.readLine() != null) {
                  // keep draining, so that retryd never blocks on a full pipe
                }
              } catch (IOException closed) {
                firstLine.complete(null);
              }
            },
            "retryd-stdout");
    reader.setDaemon(true);
    reader.start();
    String line;
    try {
      line = firstLine.get(60, TimeUnit.SECONDS);
      if (line == null) {
        throw new IOException("retryd exited before printing its addresses");
      }
      JsonObject addresses = JsonParser.parseString(line).getAsJsonObject();
      return new RetrydServer(addresses.get("grpc").getAsString(), addresses.get("metrics").getAsString(), directory, process);
    } catch (Exception error) {
      process.destroyForcibly();
      String log = Files.exists(directory.resolve("retryd.stderr")) ? Files.readString(directory.resolve("retryd.stderr")) : "";
      fail("retryd did not start (" + error + "); stderr:\n" + log.substring(Math.max(0, log.length() - 4000)));
      throw new AssertionError("unreachable");
    }
  }

  /** "127.0.0.1:PORT" of the gRPC listener. */
  String target() {
    return grpc.replaceFirst("^https?://", "");
  }

  int port() {
    return Integer.parseInt(target().substring(target().lastIndexOf(':') + 1));
  }

  void signal(String name) throws IOException, InterruptedException {
    Process kill = new ProcessBuilder("kill", "-" + name, Long.toString(process.pid())).inheritIO().start();
    if (kill.waitFor() != 0) {
      throw new IOException("kill -" + name + " failed");
    }
  }

  /**
   * Freezes retryd (SIGSTOP): connections stay open, nothing answers. Returns once
   * every thread of it is stopped: kill(2) returns when the signal is queued, and
   * on a loaded machine a worker thread went on to answer the next decision
   * before the group stop reached it (OutageWarningTest, about 1 run in 4).
   */
  void freeze() throws IOException, InterruptedException {
    signal("STOP");
    Path tasks = Paths.get("/proc", Long.toString(process.pid()), "task");
    long until = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
    while (!allStopped(tasks)) {
      if (System.nanoTime() > until) {
        throw new IOException("retryd's threads did not all stop within 10s of SIGSTOP");
      }
      Thread.sleep(1);
    }
  }

  /** Whether every thread under /proc/PID/task is in state T (stopped). */
  private static boolean allStopped(Path tasks) throws IOException {
    try (java.util.stream.Stream<Path> threads = Files.list(tasks)) {
      return threads.allMatch(
          thread -> {
            try {
              String stat = Files.readString(thread.resolve("stat"));
              // "pid (comm) S ...": the state follows the last ')'.
              char state = stat.charAt(stat.lastIndexOf(')') + 2);
              return state == 'T' || state == 't';
            } catch (IOException gone) {
              return true; // a thread that exited answers nothing
            }
          });
    }
  }

  /** Thaws a frozen retryd (SIGCONT). */
  void thaw() throws IOException, InterruptedException {
    signal("CONT");
  }

  @Override
  public void close() throws InterruptedException {
    try {
      signal("CONT"); // a frozen process would not act on SIGTERM
    } catch (IOException alreadyGone) {
      // exited
    }
    process.destroy(); // SIGTERM
    if (!process.waitFor(10, TimeUnit.SECONDS)) {
      process.destroyForcibly();
      process.waitFor(10, TimeUnit.SECONDS);
    }
  }
}
