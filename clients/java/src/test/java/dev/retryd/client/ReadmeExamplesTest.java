package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.List;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.tools.JavaCompiler;
import javax.tools.ToolProvider;
import org.junit.jupiter.api.Test;

/**
 * Issue 38: every ```java block of README.md compiles against this build's
 * classes, so that a broken example fails the suite. A block's imports go to
 * the top of its file; its statements become the body of a method of a class
 * extending {@code Glue} below, which declares what the fragments take as given
 * (a client, a channel, a request, a logger) and stands in for the two things
 * this build does not have (OpenTelemetry's Span, an application's stub).
 */
class ReadmeExamplesTest {
  private static final String IMPORTS =
      String.join(
          "\n",
          "import dev.retryd.client.*;",
          "import retryd.v1.Retryd.*;",
          "import io.grpc.Channel;",
          "import io.grpc.ClientInterceptor;",
          "import io.grpc.ClientInterceptors;",
          "import io.grpc.ManagedChannel;",
          "import java.net.URI;",
          "import java.net.http.HttpClient;",
          "import java.net.http.HttpRequest;",
          "import java.net.http.HttpResponse;",
          "import java.time.Duration;",
          "import java.util.concurrent.TimeUnit;",
          "");

  private static final String GLUE =
      String.join(
          "\n",
          "package readme;",
          IMPORTS,
          "/** What the README's fragments take as given. */",
          "abstract class Glue {",
          "  RetrydClient retryd;",
          "  RetryingHttpClient http;",
          "  HttpRequest charge;",
          "  ManagedChannel managedChannel;",
          "  ClientInterceptor yourAuthInterceptor;",
          "  io.grpc.BindableService yourService;",
          "  Object request;",
          "  String target;",
          "  java.util.logging.Logger log;",
          "}",
          "/** An application's generated stub, as the gRPC example uses it. */",
          "final class InventoryGrpc {",
          "  static Stub newBlockingStub(Channel channel) { return new Stub(channel, io.grpc.CallOptions.DEFAULT); }",
          "  static final class Stub extends io.grpc.stub.AbstractBlockingStub<Stub> {",
          "    Stub(Channel channel, io.grpc.CallOptions options) { super(channel, options); }",
          "    @Override protected Stub build(Channel channel, io.grpc.CallOptions options) { return new Stub(channel, options); }",
          "    Object getItem(Object request) { return request; }",
          "  }",
          "}",
          "/** OpenTelemetry's io.opentelemetry.api.trace.Span, as far as the tracing example reads it. */",
          "interface Span {",
          "  static Span current() { return () -> null; }",
          "  SpanContext getSpanContext();",
          "}",
          "interface SpanContext {",
          "  boolean isValid(); String getTraceId(); String getSpanId(); boolean isSampled();",
          "}",
          "");

  @Test
  void everyJavaBlockOfTheReadmeCompiles() throws Exception {
    String readme = Files.readString(Paths.get("README.md"), StandardCharsets.UTF_8);
    Matcher block = Pattern.compile("```java\\n(.*?)```", Pattern.DOTALL).matcher(readme);
    Path sources = Files.createTempDirectory("readme-examples-");
    List<String> files = new ArrayList<>();
    files.add(Files.writeString(sources.resolve("Glue.java"), GLUE).toString());
    int n = 0;
    while (block.find()) {
      n++;
      StringBuilder imports = new StringBuilder();
      StringBuilder body = new StringBuilder();
      for (String line : block.group(1).split("\n", -1)) {
        (line.startsWith("import ") ? imports : body).append(line).append('\n');
      }
      String source =
          "package readme;\n" + IMPORTS + imports + "class Example" + n + " extends Glue {\n"
              + "  @SuppressWarnings(\"unused\") void example() throws Exception {\n" + body + "  }\n}\n";
      files.add(Files.writeString(sources.resolve("Example" + n + ".java"), source).toString());
    }
    assertTrue(n >= 6, "expected the README's java blocks, found " + n);
    JavaCompiler javac = ToolProvider.getSystemJavaCompiler();
    String classpath = System.getProperty("surefire.test.class.path", System.getProperty("java.class.path"));
    List<String> arguments = new ArrayList<>(List.of("-proc:none", "-cp", classpath, "-d", sources.resolve("classes").toString()));
    arguments.addAll(files);
    java.io.ByteArrayOutputStream errors = new java.io.ByteArrayOutputStream();
    int status = javac.run(null, errors, errors, arguments.toArray(new String[0]));
    assertTrue(status == 0, "README examples do not compile (sources in " + sources + "):\n" + errors.toString(StandardCharsets.UTF_8));
  }
}
