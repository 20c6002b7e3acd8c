/** The fetch adapter: classification of real socket failures on 127.0.0.1 (and
 * of undici error shapes that cannot be provoked locally), and retryd-governed
 * retries end to end against a real retryd. */
import { strict as assert } from 'node:assert';
import { after, before, describe, test } from 'node:test';
import {
  AmbiguousExecutionError,
  bodyOf,
  classifyFetchError,
  classifyResponse,
  fetchWithRetries,
  RetrydClient,
  TrafficReporter,
  type Decision,
  type Outcome,
} from '../src';
import {
  CLIENT_TEST_CONFIG,
  closedPort,
  closeWithoutResponse,
  garbage,
  hang,
  resetWithoutResponse,
  respond,
  respondIf,
  ScriptedServer,
  startRetryd,
  truncatedBody,
  type Action,
  type Retryd,
} from './support';

async function failureOf(call: () => Promise<unknown>): Promise<Outcome> {
  try {
    await call();
  } catch (error) {
    return classifyFetchError(error);
  }
  throw new Error('expected fetch to fail');
}

async function withServer<T>(actions: Action[], body: (server: ScriptedServer) => Promise<T>, readRequest = true): Promise<T> {
  const server = await ScriptedServer.start(actions, readRequest);
  try {
    return await body(server);
  } finally {
    await server.close();
  }
}

// ------------------------------------------------------------------ real failures

describe('classification of real failures', () => {
  test('connection refused proves NOT_SENT', async () => {
    const port = await closedPort();
    assert.deepEqual(await failureOf(() => fetch(`http://127.0.0.1:${port}/`)), { evidence: 'NOT_SENT', failure: 'CONNECT' });
  });

  test('a close before the response is a connection reset', async () => {
    await withServer([closeWithoutResponse()], async (server) => {
      assert.deepEqual(await failureOf(() => fetch(server.url, { method: 'POST', body: 'x' })), {
        evidence: 'SENT_NO_RESPONSE',
        failure: 'CONNECTION_RESET',
      });
    });
  });

  test('an RST before the response is a connection reset', async () => {
    await withServer([resetWithoutResponse()], async (server) => {
      assert.deepEqual(await failureOf(() => fetch(server.url, { method: 'POST', body: 'x' })), {
        evidence: 'SENT_NO_RESPONSE',
        failure: 'CONNECTION_RESET',
      });
    });
  });

  test('a timeout before the headers is not NOT_SENT', async () => {
    await withServer([hang()], async (server) => {
      assert.deepEqual(await failureOf(() => fetch(server.url, { signal: AbortSignal.timeout(200) })), {
        evidence: 'SENT_NO_RESPONSE',
        failure: 'RESPONSE_HEADER_TIMEOUT',
      });
    });
  });

  test('a truncated body is a partial response', async () => {
    await withServer([truncatedBody(200)], async (server) => {
      const response = await fetch(server.url);
      await assert.rejects(response.arrayBuffer(), (error: unknown) => {
        assert.deepEqual(classifyFetchError(error, response), {
          evidence: 'PARTIAL_RESPONSE',
          failure: 'DECODE_RESET',
          httpStatus: 200,
          retryAfter: null,
        });
        return true;
      });
    });
  });

  test('a failed TLS handshake proves NOT_SENT', async () => {
    await withServer(
      [garbage()],
      async (server) => {
        assert.deepEqual(await failureOf(() => fetch(`https://127.0.0.1:${server.port}/`)), { evidence: 'NOT_SENT', failure: 'PRE_REQUEST_TLS' });
      },
      false,
    );
  });

  test('an unsupported scheme is a profile rejection', async () => {
    assert.deepEqual(await failureOf(() => fetch('ftp://127.0.0.1/')), { evidence: 'NOT_SENT', failure: 'PROFILE_REJECTION' });
  });
});

// ------------------------------------------------------------------ undici error shapes

/** What Node's fetch rejects with: TypeError('fetch failed') caused by an undici or system error. */
function fetchFailed(code: string, message = code, extra: Record<string, unknown> = {}): TypeError {
  return new TypeError('fetch failed', { cause: Object.assign(new Error(message), { code, ...extra }) });
}

test('undici and system error codes', () => {
  const table: [unknown, Outcome][] = [
    [fetchFailed('ENOTFOUND', 'getaddrinfo ENOTFOUND example.invalid', { syscall: 'getaddrinfo' }), { evidence: 'NOT_SENT', failure: 'DNS' }],
    [fetchFailed('EAI_AGAIN', 'getaddrinfo EAI_AGAIN', { syscall: 'getaddrinfo' }), { evidence: 'NOT_SENT', failure: 'DNS' }],
    [fetchFailed('UND_ERR_CONNECT_TIMEOUT', 'Connect Timeout Error'), { evidence: 'NOT_SENT', failure: 'CONNECT' }],
    [fetchFailed('ETIMEDOUT', 'connect ETIMEDOUT', { syscall: 'connect' }), { evidence: 'NOT_SENT', failure: 'CONNECT' }],
    [
      new TypeError('fetch failed', {
        cause: Object.assign(new AggregateError([Object.assign(new Error('x'), { code: 'ECONNREFUSED', syscall: 'connect' })]), { code: 'ECONNREFUSED' }),
      }),
      { evidence: 'NOT_SENT', failure: 'CONNECT' },
    ],
    [fetchFailed('DEPTH_ZERO_SELF_SIGNED_CERT', 'self-signed certificate'), { evidence: 'NOT_SENT', failure: 'TLS_CERTIFICATE_INVALID' }],
    [fetchFailed('CERT_HAS_EXPIRED', 'certificate has expired'), { evidence: 'NOT_SENT', failure: 'TLS_CERTIFICATE_INVALID' }],
    [fetchFailed('ERR_TLS_CERT_ALTNAME_INVALID', "Hostname/IP does not match certificate's altnames"), { evidence: 'NOT_SENT', failure: 'TLS_CERTIFICATE_INVALID' }],
    [fetchFailed('ERR_SSL_WRONG_VERSION_NUMBER'), { evidence: 'NOT_SENT', failure: 'PRE_REQUEST_TLS' }],
    [fetchFailed('ERR_HTTP2_STREAM_ERROR', 'Stream closed with error code NGHTTP2_REFUSED_STREAM'), { evidence: 'NOT_SENT', failure: 'HTTP2_REFUSED_STREAM' }],
    [fetchFailed('UND_ERR_HEADERS_TIMEOUT', 'Headers Timeout Error'), { evidence: 'SENT_NO_RESPONSE', failure: 'RESPONSE_HEADER_TIMEOUT' }],
    [fetchFailed('EPIPE', 'write EPIPE', { syscall: 'write' }), { evidence: 'SENT_NO_RESPONSE', failure: 'PARTIAL_WRITE' }],
    [fetchFailed('ECONNRESET', 'read ECONNRESET', { syscall: 'read' }), { evidence: 'SENT_NO_RESPONSE', failure: 'CONNECTION_RESET' }],
    [fetchFailed('UND_ERR_SOCKET', 'other side closed'), { evidence: 'SENT_NO_RESPONSE', failure: 'CONNECTION_RESET' }],
    [fetchFailed('UND_ERR_REQ_CONTENT_LENGTH_MISMATCH', 'Request body length does not match content-length header'), { evidence: 'SENT_NO_RESPONSE', failure: 'REQUEST_ENCODING' }],
    [fetchFailed('UND_ERR_INVALID_ARG', 'invalid method'), { evidence: 'NOT_SENT', failure: 'PROFILE_REJECTION' }],
    [new TypeError('fetch failed', { cause: new Error('something else') }), { evidence: 'SENT_NO_RESPONSE', failure: 'GENERIC_IO' }],
    [new Error('no cause at all'), { evidence: 'SENT_NO_RESPONSE', failure: 'GENERIC_IO' }],
  ];
  for (const [error, outcome] of table) {
    assert.deepEqual(classifyFetchError(error), outcome, String((error as Error & { cause?: Error }).cause?.message ?? error));
  }
  const response = new Response(null, { status: 503, headers: { 'retry-after': '4' } });
  assert.equal(classifyFetchError(fetchFailed('UND_ERR_BODY_TIMEOUT', 'Body Timeout Error'), response).failure, 'INTERRUPTED_STREAM');
  assert.equal(classifyFetchError(new TypeError('terminated', { cause: fetchFailed('UND_ERR_SOCKET', 'other side closed') }), response).failure, 'DECODE_RESET');
  assert.deepEqual(classifyResponse(response), { evidence: 'RESPONSE_RECEIVED', httpStatus: 503, retryAfter: '4' });
});

test('bodyOf', () => {
  assert.equal(bodyOf(undefined), undefined);
  assert.deepEqual(bodyOf('x'), { kind: 'BYTES' });
  assert.deepEqual(bodyOf(new Uint8Array(2)), { kind: 'BYTES' });
  assert.deepEqual(bodyOf(new Blob(['x'])), { kind: 'BYTES' });
  assert.deepEqual(bodyOf(new URLSearchParams({ a: '1' })), { kind: 'ENCODED_VALUE' });
  const form = new FormData();
  form.append('a', '1');
  form.append('f', new Blob(['x']), 'f.txt');
  assert.deepEqual(bodyOf(form), { kind: 'MULTIPART', parts: [{ kind: 'BYTES' }, { kind: 'BYTES' }] });
  assert.deepEqual(bodyOf(new ReadableStream()), { kind: 'INPUT_STREAM' });
});

// ------------------------------------------------------------------ retries through a real retryd

describe('fetchWithRetries through retryd', () => {
  let retryd: Retryd;
  let client: RetrydClient;
  const sleeps: number[] = [];
  const sleep = async (ms: number): Promise<void> => {
    sleeps.push(ms);
  };

  before(async () => {
    retryd = await startRetryd(CLIENT_TEST_CONFIG);
    client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, fallback: null });
  });
  after(async () => {
    client?.close();
    await retryd?.stop();
  });

  test('503s are retried until success', async () => {
    sleeps.length = 0;
    await withServer([respond(503), respond(503), respond(200, 'ok')], async (server) => {
      const response = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-e2e-503', idempotency: 'SAFE', sleep });
      assert.equal(response.status, 200);
      assert.equal(await response.text(), 'ok');
      assert.equal(server.requests.length, 3);
    });
    assert.equal(sleeps.length, 2);
    assert.ok(sleeps.every((ms) => ms >= 0 && ms <= 50));
  });

  test('NOT_SENT is retried even for a payment, up to max attempts', async () => {
    sleeps.length = 0;
    const port = await closedPort();
    await assert.rejects(
      fetchWithRetries(client, `http://127.0.0.1:${port}/charges`, { method: 'POST', body: '{}' }, { upstream: 'ts-e2e-refused', idempotency: 'NON_IDEMPOTENT', sleep }),
      (error: unknown) => {
        assert.ok(error instanceof TypeError);
        const decision = (error as TypeError & { retrydDecision: Decision }).retrydDecision;
        assert.equal(decision.denyReason, 'MAX_ATTEMPTS');
        return true;
      },
    );
    assert.equal(sleeps.length, 2);
  });

  test('a payment without a response is ambiguous', async () => {
    await withServer([closeWithoutResponse()], async (server) => {
      await assert.rejects(
        fetchWithRetries(client, `${server.url}/charges`, { method: 'POST', body: '{}' }, { upstream: 'ts-e2e-ambiguous', idempotency: 'NON_IDEMPOTENT', sleep }),
        (error: unknown) => {
          assert.ok(error instanceof AmbiguousExecutionError);
          assert.equal(error.decision.rule, 8);
          assert.ok(error.cause instanceof TypeError);
          return true;
        },
      );
      assert.equal(server.requests.length, 1);
    });
  });

  test('a payment with a truncated response is ambiguous', async () => {
    await withServer([truncatedBody(201)], async (server) => {
      await assert.rejects(
        fetchWithRetries(client, server.url, { method: 'POST', body: '{"amount":1}' }, { upstream: 'ts-e2e-partial', idempotency: 'NON_IDEMPOTENT', sleep }),
        (error: unknown) => {
          assert.ok(error instanceof AmbiguousExecutionError);
          assert.equal(error.decision.effectiveEvidence, 'PARTIAL_RESPONSE');
          assert.equal(error.response?.status, 201);
          return true;
        },
      );
    });
  });

  test('a payment answered 502 is ambiguous, with the response', async () => {
    await withServer([respond(502)], async (server) => {
      await assert.rejects(
        fetchWithRetries(client, server.url, { method: 'POST', body: '{}' }, { upstream: 'ts-e2e-502', idempotency: 'NON_IDEMPOTENT', sleep }),
        (error: unknown) => error instanceof AmbiguousExecutionError && error.response?.status === 502,
      );
    });
  });

  test('other statuses are returned at once', async () => {
    await withServer([respond(404, 'nope')], async (server) => {
      const response = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-e2e-404', idempotency: 'SAFE', sleep });
      assert.equal(response.status, 404);
      assert.equal(await response.text(), 'nope');
      assert.equal(server.requests.length, 1);
    });
  });

  test('a denied response is returned with a readable body', async () => {
    await withServer([respond(500, 'boom')], async (server) => {
      const response = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-e2e-500', idempotency: 'SAFE', sleep });
      assert.equal(response.status, 500);
      assert.equal(await response.text(), 'boom');
      assert.equal(server.requests.length, 1);
    });
  });

  test('a one-shot body is not replayed', async () => {
    await withServer([respond(503)], async (server) => {
      const stream = new ReadableStream({
        start(controller) {
          controller.enqueue(new TextEncoder().encode('part'));
          controller.close();
        },
      });
      const init = { method: 'PUT', body: stream, duplex: 'half' } as RequestInit;
      const response = await fetchWithRetries(client, server.url, init, { upstream: 'ts-e2e-oneshot', idempotency: 'IDEMPOTENT', sleep });
      assert.equal(response.status, 503);
      assert.equal(server.requests.length, 1);
    });
  });

  test('a 401 refreshes credentials once', async () => {
    const authorized = respondIf((request) => request.toString('latin1').toLowerCase().includes('authorization: bearer new'), respond(200), respond(401));
    await withServer([authorized], async (server) => {
      let refreshed = 0;
      const response = await fetchWithRetries(
        client,
        server.url,
        { headers: { authorization: 'Bearer old' } },
        {
          upstream: 'ts-e2e-401',
          idempotency: 'SAFE',
          sleep,
          onRefreshCredentials: (init) => {
            refreshed++;
            return { ...init, headers: { authorization: 'Bearer new' } };
          },
        },
      );
      assert.equal(response.status, 200);
      assert.equal(refreshed, 1);
      assert.equal(server.requests.length, 2);
    });
    await withServer([respond(401)], async (server) => {
      const response = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-e2e-401', idempotency: 'SAFE', sleep });
      assert.equal(response.status, 401);
      assert.equal(server.requests.length, 1);
    });
  });

  test('the deadline covers the whole call', async () => {
    await withServer([respond(503)], async (server) => {
      // ts-slow needs 300ms for an attempt: less than that is left.
      const response = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-slow', idempotency: 'SAFE', deadlineMs: 250, sleep });
      assert.equal(response.status, 503);
      assert.equal(server.requests.length, 1);
    });
  });

  test('an attempt timeout before the headers is retried for an idempotent call only', async () => {
    await withServer([hang(), respond(200)], async (server) => {
      const response = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-e2e-timeout', idempotency: 'IDEMPOTENT', attemptTimeoutMs: 200, sleep });
      assert.equal(response.status, 200);
      assert.equal(server.requests.length, 2);
    });
    await withServer([hang()], async (server) => {
      await assert.rejects(
        fetchWithRetries(client, server.url, { method: 'POST', body: '{}' }, { upstream: 'ts-e2e-timeout', idempotency: 'NON_IDEMPOTENT', attemptTimeoutMs: 200, sleep }),
        AmbiguousExecutionError,
      );
    });
  });

  test('a caller abort is rethrown at once', async () => {
    await withServer([hang()], async (server) => {
      const controller = new AbortController();
      setTimeout(() => controller.abort(), 100);
      await assert.rejects(
        fetchWithRetries(client, server.url, { signal: controller.signal }, { upstream: 'ts-e2e-abort', idempotency: 'SAFE', sleep }),
        (error: unknown) => (error as Error).name === 'AbortError',
      );
      assert.equal(server.requests.length, 1);
    });
  });

  test('a caller abort during the backoff is rethrown without waiting it out', async () => {
    await withServer([respond(429, '', { 'retry-after': '5' }), respond(200)], async (server) => {
      const controller = new AbortController();
      const started = performance.now();
      const pending = fetchWithRetries(client, server.url, { signal: controller.signal }, { upstream: 'ts-e2e-abort-backoff', idempotency: 'SAFE' });
      while (server.requests.length === 0) await new Promise((resolve) => setTimeout(resolve, 10));
      setTimeout(() => controller.abort(), 100);
      await assert.rejects(pending, (error: unknown) => (error as Error).name === 'AbortError');
      // Not a latency ceiling: the backoff it must not wait out is 5 s, and
      // waiting it out would end later than that however idle the machine.
      assert.ok(performance.now() - started < 5000, `${performance.now() - started} ms`);
      assert.equal(server.requests.length, 1);
    });
  });

  test('only first attempts are reported', async () => {
    const reporter = new TrafficReporter({ sendTrafficReport: async (traffic) => ({ accepted: traffic.length, alreadyApplied: 0 }) });
    await withServer([respond(503), respond(200)], async (server) => {
      await fetchWithRetries(client, server.url, {}, { upstream: 'ts-e2e-report', idempotency: 'SAFE', reporter, sleep });
    });
    assert.deepEqual(reporter.pending(), { 'ts-e2e-report': 1 });
  });
});

test('the local rule governs retries when retryd is down', async () => {
  const down = new RetrydClient('127.0.0.1:1', { timeoutMs: 200 });
  const sleeps: number[] = [];
  const sleep = async (ms: number): Promise<void> => {
    sleeps.push(ms);
  };
  try {
    const port = await closedPort();
    await assert.rejects(fetchWithRetries(down, `http://127.0.0.1:${port}/`, {}, { upstream: 'u', idempotency: 'SAFE', sleep }), TypeError);
    assert.equal(sleeps.length, 1); // the local limit of 2 attempts
    await withServer([closeWithoutResponse()], async (server) => {
      await assert.rejects(
        fetchWithRetries(down, server.url, { method: 'POST', body: '{}' }, { upstream: 'u', idempotency: 'NON_IDEMPOTENT', sleep }),
        (error: unknown) => error instanceof AmbiguousExecutionError && error.decision.fallback,
      );
    });
  } finally {
    down.close();
  }
});
