package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import org.junit.jupiter.api.Test;

/**
 * Every vector of conformance/latency_buckets.json (each bucket's first value,
 * the values around it, and values up to 2^64-1) through {@link Latency#bucket}:
 * the same buckets as retryd and the other clients.
 */
class LatencyConformanceTest {
  @Test
  void everyVectorFallsInItsBucket() throws Exception {
    JsonObject vectors =
        JsonParser.parseString(
                new String(Files.readAllBytes(RetrydServer.repo().resolve("conformance/latency_buckets.json")), StandardCharsets.UTF_8))
            .getAsJsonObject();
    assertEquals(Latency.MAX_BUCKET, vectors.get("max_bucket").getAsInt());
    JsonArray starts = vectors.getAsJsonArray("starts");
    assertEquals(Latency.MAX_BUCKET + 1, starts.size());
    for (int b = 0; b < starts.size(); b++) { // [bucket, its first microsecond]
      JsonArray start = starts.get(b).getAsJsonArray();
      assertEquals(b, start.get(0).getAsInt());
      assertEquals(b, Latency.bucket(start.get(1).getAsBigInteger().longValue()), "start of bucket " + b);
    }
    JsonArray pairs = vectors.getAsJsonArray("pairs");
    assertTrue(pairs.size() > 0);
    for (JsonElement element : pairs) { // [microseconds, bucket]
      JsonArray pair = element.getAsJsonArray();
      // Read as unsigned 64-bit: longValue() of a value at or above 2^63 is its two's complement.
      long micros = pair.get(0).getAsBigInteger().longValue();
      assertEquals(pair.get(1).getAsInt(), Latency.bucket(micros), "bucket(" + pair.get(0) + ")");
    }
  }
}
