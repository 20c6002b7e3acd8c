package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Paths;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

/**
 * Issue 38: the first decision of a fresh JVM, at the client's default settings,
 * is retryd's, not the fallback's (it was the fallback's in 4 runs of 4 when the
 * connection was made on the first decision's 200ms). Three fresh JVMs; the time
 * from JVM start to the decision is printed (a measurement, not a ceiling).
 */
class FirstDecisionTest {
  @Test
  void theFirstDecisionOfAFreshJvmIsRetrydsAtTheDefaults() throws Exception {
    try (RetrydServer server = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG)) {
      String java = Paths.get(System.getProperty("java.home"), "bin", "java").toString();
      String classpath = System.getProperty("surefire.test.class.path", System.getProperty("java.class.path"));
      for (int run = 1; run <= 3; run++) {
        Process process =
            new ProcessBuilder(java, "-cp", classpath, FirstDecisionMain.class.getName(), server.target())
                .redirectErrorStream(true)
                .start();
        String first = null;
        StringBuilder output = new StringBuilder();
        try (BufferedReader out = new BufferedReader(new InputStreamReader(process.getInputStream(), StandardCharsets.UTF_8))) {
          for (String line; (line = out.readLine()) != null; ) {
            output.append(line).append('\n');
            if (line.startsWith("FIRST ")) {
              first = line;
            }
          }
        }
        // Not a latency bound: only so that a hung child cannot hang the suite.
        if (!process.waitFor(120, TimeUnit.SECONDS)) {
          process.destroyForcibly();
        }
        assertNotNull(first, "run " + run + " printed no decision:\n" + output);
        System.out.println("FirstDecisionTest run " + run + ": " + first);
        assertEquals("false", first.replaceAll(".*fallback=(\\S+).*", "$1"), "run " + run + " fell back:\n" + output);
      }
    }
  }
}
