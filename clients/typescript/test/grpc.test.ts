/** The @grpc/grpc-js interceptors: classification of real failures on
 * 127.0.0.1 (grpc-js 1.14.7, as pinned in package-lock.json), and
 * retryd-governed retries against a real retryd and real gRPC servers of the
 * test's own that count the calls they receive. */
import { strict as assert } from 'node:assert';
import * as http2 from 'node:http2';
import * as net from 'node:net';
import { after, before, describe, test } from 'node:test';
import * as grpc from '@grpc/grpc-js';
import {
  ambiguousExecutionOf,
  classifyingInterceptor,
  decisionOf,
  grpcOutcomeOf,
  retryingInterceptor,
  RetrydClient,
  type GrpcOutcome,
  type GrpcRetryOptions,
} from '../src';
import { CLIENT_TEST_CONFIG, closedPort, startRetryd, type Retryd } from './support';

// ------------------------------------------------------------------ a service of our own

const bytes = { serialize: (value: Buffer) => value, deserialize: (value: Buffer) => value };
const STOCK = {
  Reserve: {
    path: '/inventory.v1.Stock/Reserve',
    requestStream: false,
    responseStream: false,
    requestSerialize: bytes.serialize,
    requestDeserialize: bytes.deserialize,
    responseSerialize: bytes.serialize,
    responseDeserialize: bytes.deserialize,
  },
  Watch: {
    path: '/inventory.v1.Stock/Watch',
    requestStream: false,
    responseStream: true,
    requestSerialize: bytes.serialize,
    requestDeserialize: bytes.deserialize,
    responseSerialize: bytes.serialize,
    responseDeserialize: bytes.deserialize,
  },
} as const;
const StockClient = grpc.makeGenericClientConstructor(STOCK, 'Stock');
type Stock = grpc.Client & {
  Reserve(request: Buffer, options: grpc.CallOptions, callback: grpc.requestCallback<Buffer>): grpc.ClientUnaryCall;
  Reserve(request: Buffer, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<Buffer>): grpc.ClientUnaryCall;
  Watch(request: Buffer, options: grpc.CallOptions): grpc.ClientReadableStream<Buffer>;
};

type Unary = (call: grpc.ServerUnaryCall<Buffer, Buffer>, callback: grpc.sendUnaryData<Buffer>) => void;

/** Answers the n-th Reserve call with script[n] (the last entry repeats); counts calls and when they came. */
class StockServer {
  readonly received: { at: number; metadata: grpc.Metadata }[] = [];
  private readonly server = new grpc.Server();
  port = 0;
  constructor(private readonly script: Unary[], watch?: (call: grpc.ServerWritableStream<Buffer, Buffer>) => void) {
    this.server.addService(STOCK, {
      Reserve: (call: grpc.ServerUnaryCall<Buffer, Buffer>, callback: grpc.sendUnaryData<Buffer>) => {
        const index = Math.min(this.received.length, this.script.length - 1);
        this.received.push({ at: performance.now(), metadata: call.metadata });
        this.script[index]!(call, callback);
      },
      Watch: watch ?? ((call: grpc.ServerWritableStream<Buffer, Buffer>) => call.end()),
    });
  }
  static async start(script: Unary[], watch?: (call: grpc.ServerWritableStream<Buffer, Buffer>) => void): Promise<StockServer> {
    const server = new StockServer(script, watch);
    server.port = await new Promise<number>((resolve, reject) =>
      server.server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (error, port) => (error ? reject(error) : resolve(port))),
    );
    return server;
  }
  get target(): string {
    return `127.0.0.1:${this.port}`;
  }
  close(): void {
    this.server.forceShutdown();
  }
}

const ok: Unary = (call, callback) => callback(null, Buffer.from(`reserved ${call.request.toString()}`));
const fail =
  (code: grpc.status, details = 'failed', trailers: Record<string, string> = {}): Unary =>
  (_call, callback) => {
    const metadata = new grpc.Metadata();
    for (const [key, value] of Object.entries(trailers)) metadata.set(key, value);
    callback({ code, details, metadata });
  };

/**
 * A Stock server on node:http2 whose script can hold a call without ever
 * answering. A grpc-js server cannot: it answers DEADLINE_EXCEEDED itself
 * when the call's grpc-timeout runs out, which on a busy machine can come
 * before the client's own deadline and turn "no response" into a server's
 * status. A hung upstream (and a grpc-go or tonic server) says nothing.
 */
class HoldingServer {
  private constructor(
    private readonly listening: { port: number; close(): void },
    readonly received: { at: number }[],
  ) {}
  static async start(script: ('hold' | 'ok')[]): Promise<HoldingServer> {
    const h2 = http2.createServer();
    const received: { at: number }[] = [];
    h2.on('stream', (stream) => {
      stream.on('error', () => undefined);
      const chunks: Buffer[] = [];
      stream.on('data', (chunk: Buffer) => chunks.push(chunk));
      stream.on('end', () => {
        const index = Math.min(received.length, script.length - 1);
        received.push({ at: performance.now() });
        if (script[index] === 'hold') return;
        // One length-prefixed message, then the OK trailers.
        const message = Buffer.from(`reserved ${Buffer.concat(chunks).subarray(5).toString()}`);
        const frame = Buffer.alloc(5 + message.length);
        frame.writeUInt32BE(message.length, 1);
        message.copy(frame, 5);
        stream.respond({ ':status': 200, 'content-type': 'application/grpc' }, { waitForTrailers: true });
        stream.on('wantTrailers', () => stream.sendTrailers({ 'grpc-status': '0' }));
        stream.end(frame);
      });
    });
    return new HoldingServer(await listen(h2), received);
  }
  get target(): string {
    return `127.0.0.1:${this.listening.port}`;
  }
  close(): void {
    this.listening.close();
  }
}

/**
 * Listens on a loopback port for failures a gRPC server would not produce;
 * `close()` also ends the connections, which would otherwise keep the test
 * process alive.
 */
async function listen(server: net.Server | http2.Http2Server): Promise<{ port: number; close(): void }> {
  const sockets = new Set<net.Socket>();
  server.on('connection', (socket: net.Socket) => {
    sockets.add(socket);
    socket.on('close', () => sockets.delete(socket));
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    port: (server.address() as net.AddressInfo).port,
    close: () => {
      server.close();
      for (const socket of sockets) socket.destroy();
    },
  };
}

function client(target: string, interceptor: grpc.Interceptor): Stock {
  return new StockClient(target, grpc.credentials.createInsecure(), { interceptors: [interceptor] }) as unknown as Stock;
}

interface Result {
  error: grpc.ServiceError | null;
  value?: Buffer;
  ms: number;
}

function reserve(stock: Stock, deadlineMs = 5000, metadata = new grpc.Metadata()): Promise<Result> {
  const started = performance.now();
  return new Promise((resolve) => {
    stock.Reserve(Buffer.from('sku-7'), metadata, { deadline: Date.now() + deadlineMs }, (error, value) =>
      resolve({ error: error ?? null, value, ms: performance.now() - started }),
    );
  });
}

/** The outcome the classifying interceptor reports for one Reserve call. */
async function classifyReserve(target: string, deadlineMs = 5000): Promise<GrpcOutcome> {
  const outcomes: GrpcOutcome[] = [];
  const stock = client(target, classifyingInterceptor((outcome) => outcomes.push(outcome)));
  try {
    const { error } = await reserve(stock, deadlineMs);
    assert.ok(error, 'the call must fail');
    assert.equal(outcomes.length, 1);
    assert.deepEqual(grpcOutcomeOf(error), outcomes[0], 'the outcome is reachable from the error');
    return outcomes[0]!;
  } finally {
    stock.close();
  }
}

// ------------------------------------------------------------------ classification of real failures

describe('classification of real gRPC failures', { timeout: 60_000 }, () => {
  test('a refused port proves NOT_SENT', async () => {
    const port = await closedPort();
    assert.deepEqual(await classifyReserve(`127.0.0.1:${port}`), { evidence: 'NOT_SENT', failure: 'CONNECT', grpcStatusCode: 14, firstByteDelivered: false });
  });

  test('a channel that never became ready proves NOT_SENT', async () => {
    // Accepts the TCP connection and never speaks HTTP/2.
    const silent = await listen(net.createServer((socket) => socket.on('error', () => undefined)));
    try {
      assert.deepEqual(await classifyReserve(`127.0.0.1:${silent.port}`, 500), { evidence: 'NOT_SENT', failure: 'CONNECT', grpcStatusCode: 4, firstByteDelivered: false });
    } finally {
      silent.close();
    }
  });

  test('a deadline after the request was written is SENT_NO_RESPONSE', async () => {
    const server = await HoldingServer.start(['hold']);
    try {
      assert.deepEqual(await classifyReserve(server.target, 500), {
        evidence: 'SENT_NO_RESPONSE',
        failure: 'RESPONSE_HEADER_TIMEOUT',
        grpcStatusCode: 4,
        firstByteDelivered: false,
      });
      assert.equal(server.received.length, 1);
    } finally {
      server.close();
    }
  });

  test('HTTP/2 REFUSED_STREAM proves NOT_SENT', async () => {
    let streams = 0;
    const refusing = http2.createServer();
    refusing.on('stream', (stream) => {
      streams++;
      stream.on('error', () => undefined);
      stream.close(http2.constants.NGHTTP2_REFUSED_STREAM);
    });
    const listening = await listen(refusing);
    try {
      assert.deepEqual(await classifyReserve(`127.0.0.1:${listening.port}`), {
        evidence: 'NOT_SENT',
        failure: 'HTTP2_REFUSED_STREAM',
        grpcStatusCode: 14,
        firstByteDelivered: false,
      });
      assert.equal(streams, 2, "grpc-js's one transparent retry of a refused stream");
    } finally {
      listening.close();
    }
  });

  test('a connection reset after the request was read is SENT_NO_RESPONSE', async () => {
    const sockets: net.Socket[] = [];
    const h2 = http2.createServer();
    h2.on('stream', (stream) => {
      stream.on('error', () => undefined);
      stream.resume();
      stream.on('end', () => sockets.at(-1)?.resetAndDestroy());
    });
    const raw = net.createServer((socket) => {
      sockets.push(socket);
      socket.on('error', () => undefined);
      h2.emit('connection', socket);
    });
    const listening = await listen(raw);
    try {
      const outcome = await classifyReserve(`127.0.0.1:${listening.port}`);
      assert.deepEqual(outcome, { evidence: 'SENT_NO_RESPONSE', failure: 'CONNECTION_RESET', grpcStatusCode: 14, firstByteDelivered: false });
    } finally {
      listening.close();
    }
  });

  test('a status the server sent is RESPONSE_RECEIVED, with its pushback trailer raw', async () => {
    const cases: [grpc.Metadata | Record<string, string>, grpc.status, GrpcOutcome][] = [
      [{}, grpc.status.UNAVAILABLE, { evidence: 'RESPONSE_RECEIVED', grpcStatusCode: 14, firstByteDelivered: false }],
      [{ 'grpc-retry-pushback-ms': '300' }, grpc.status.RESOURCE_EXHAUSTED, { evidence: 'RESPONSE_RECEIVED', grpcStatusCode: 8, grpcRetryPushbackMs: '300', firstByteDelivered: false }],
      [{ 'grpc-retry-pushback-ms': '-1' }, grpc.status.UNAVAILABLE, { evidence: 'RESPONSE_RECEIVED', grpcStatusCode: 14, grpcRetryPushbackMs: '-1', firstByteDelivered: false }],
      [{ 'grpc-retry-pushback-ms': 'soon' }, grpc.status.DEADLINE_EXCEEDED, { evidence: 'RESPONSE_RECEIVED', grpcStatusCode: 4, grpcRetryPushbackMs: 'soon', firstByteDelivered: false }],
    ];
    for (const [trailers, code, expected] of cases) {
      const server = await StockServer.start([fail(code, 'from the server', trailers as Record<string, string>)]);
      try {
        assert.deepEqual(await classifyReserve(server.target), expected, JSON.stringify(trailers));
      } finally {
        server.close();
      }
    }
  });

  test("a server wording its status like grpc-js's own failures is still RESPONSE_RECEIVED", async () => {
    for (const [code, details] of [
      [grpc.status.UNAVAILABLE, 'No connection established. Last error: made up'],
      [grpc.status.UNAVAILABLE, 'Stream refused by server'],
      [grpc.status.DEADLINE_EXCEEDED, 'Deadline exceeded after 1s,Waiting for LB pick'],
    ] as const) {
      const server = await StockServer.start([fail(code, details)]);
      try {
        assert.equal((await classifyReserve(server.target)).evidence, 'RESPONSE_RECEIVED', details);
      } finally {
        server.close();
      }
    }
  });

  test('a response stream that delivered messages is first_byte_delivered', async () => {
    const server = await StockServer.start([ok], (call) => {
      call.write(Buffer.from('a'));
      call.write(Buffer.from('b'));
      setTimeout(() => call.emit('error', { code: grpc.status.UNAVAILABLE, details: 'going away' }), 20);
    });
    const outcomes: GrpcOutcome[] = [];
    const stock = client(server.target, classifyingInterceptor((outcome) => outcomes.push(outcome)));
    try {
      const received: string[] = [];
      const error = await new Promise<grpc.ServiceError>((resolve) => {
        const stream = stock.Watch(Buffer.from('sku-7'), { deadline: Date.now() + 5000 });
        stream.on('data', (chunk: Buffer) => received.push(chunk.toString()));
        stream.on('error', resolve);
      });
      assert.deepEqual(received, ['a', 'b']);
      assert.equal(error.code, grpc.status.UNAVAILABLE);
      assert.deepEqual(outcomes, [{ evidence: 'RESPONSE_RECEIVED', grpcStatusCode: 14, firstByteDelivered: true }]);
    } finally {
      stock.close();
      server.close();
    }
  });
});

// ------------------------------------------------------------------ retries through a real retryd

describe('retryingInterceptor through retryd', { timeout: 60_000 }, () => {
  let retryd: Retryd;
  let decider: RetrydClient;

  before(async () => {
    retryd = await startRetryd(CLIENT_TEST_CONFIG);
    decider = new RetrydClient(retryd.grpc, { timeoutMs: 5000, fallback: null, reporting: false });
  });
  after(async () => {
    await decider?.close();
    await retryd?.stop();
  });

  async function run(server: StockServer | HoldingServer | string, options: Partial<GrpcRetryOptions>, deadlineMs = 5000, metadata?: grpc.Metadata): Promise<Result> {
    const stock = client(typeof server === 'string' ? server : server.target, retryingInterceptor(decider, { upstream: 'ts-grpc', idempotency: 'SAFE', ...options }));
    try {
      return await reserve(stock, deadlineMs, metadata);
    } finally {
      stock.close();
    }
  }

  test('UNAVAILABLE is retried for a safe call until it succeeds', async () => {
    const server = await StockServer.start([fail(grpc.status.UNAVAILABLE), fail(grpc.status.UNAVAILABLE), ok]);
    try {
      const { error, value } = await run(server, {});
      assert.equal(error, null, String(error));
      assert.equal(value?.toString(), 'reserved sku-7');
      assert.equal(server.received.length, 3);
    } finally {
      server.close();
    }
  });

  test('a refused port is retried even for a non-idempotent call, up to max attempts', async () => {
    const port = await closedPort();
    const attempts: GrpcOutcome[] = [];
    const { error } = await run(`127.0.0.1:${port}`, { idempotency: 'NON_IDEMPOTENT', onAttempt: (outcome) => attempts.push(outcome) });
    assert.equal(error?.code, grpc.status.UNAVAILABLE);
    assert.equal(attempts.length, 3);
    assert.ok(attempts.every((outcome) => outcome.evidence === 'NOT_SENT'));
    assert.deepEqual([decisionOf(error)?.verdict, decisionOf(error)?.denyReason], ['DENY', 'MAX_ATTEMPTS']);
  });

  test('a non-idempotent call answered UNAVAILABLE after the server read it is AMBIGUOUS, never re-sent', async () => {
    const server = await StockServer.start([fail(grpc.status.UNAVAILABLE, 'overloaded'), ok]);
    try {
      const { error } = await run(server, { idempotency: 'NON_IDEMPOTENT' });
      assert.equal(error?.code, grpc.status.UNAVAILABLE);
      assert.equal(decisionOf(error)?.verdict, 'AMBIGUOUS');
      assert.equal(grpcOutcomeOf(error)?.evidence, 'RESPONSE_RECEIVED');
      assert.equal(server.received.length, 1);
    } finally {
      server.close();
    }
  });

  test('a non-idempotent call held past the attempt timeout on an empty budget is an ambiguous execution carrying BUDGET_EXHAUSTED', async () => {
    const server = await HoldingServer.start(['hold', 'ok']);
    try {
      const { error } = await run(server, { upstream: 'ts-hold', idempotency: 'NON_IDEMPOTENT', attemptTimeoutMs: 300 });
      assert.equal(error?.code, grpc.status.DEADLINE_EXCEEDED);
      const ambiguous = ambiguousExecutionOf(error);
      assert.ok(ambiguous, 'the ServiceError carries the ambiguous execution');
      assert.deepEqual([ambiguous.denyReason, ambiguous.unknownOutcome, ambiguous.resendWithSameKey], ['BUDGET_EXHAUSTED', 'RECONCILE', false]);
      assert.equal(ambiguous.decision, decisionOf(error));
      assert.equal(server.received.length, 1, 'never re-sent');
    } finally {
      server.close();
    }
  });

  test('a keyed call denied on an empty budget says: re-send with the same key', async () => {
    const server = await HoldingServer.start(['hold', 'ok']);
    try {
      const { error } = await run(server, { upstream: 'ts-hold', idempotency: 'IDEMPOTENT_WITH_KEY', attemptTimeoutMs: 300 });
      assert.deepEqual([ambiguousExecutionOf(error)?.denyReason, ambiguousExecutionOf(error)?.resendWithSameKey], ['BUDGET_EXHAUSTED', true]);
      assert.equal(server.received.length, 1);
    } finally {
      server.close();
    }
  });

  test('a plain DENY carries no ambiguous execution', async () => {
    const server = await StockServer.start([fail(grpc.status.INVALID_ARGUMENT, 'bad sku')]);
    try {
      const { error } = await run(server, { idempotency: 'NON_IDEMPOTENT' });
      assert.equal(decisionOf(error)?.verdict, 'DENY');
      assert.equal(ambiguousExecutionOf(error), undefined);
    } finally {
      server.close();
    }
  });

  test('attemptTimeoutMs ends a hung attempt and leaves the caller time for the next', async () => {
    const server = await HoldingServer.start(['hold', 'ok']);
    const attempts: GrpcOutcome[] = [];
    try {
      const { error, value } = await run(server, { attemptTimeoutMs: 300, onAttempt: (outcome) => attempts.push(outcome) }, 10_000);
      assert.equal(error, null, String(error));
      assert.equal(value?.toString(), 'reserved sku-7');
      assert.deepEqual(attempts.map((outcome) => [outcome.evidence, outcome.failure]), [['SENT_NO_RESPONSE', 'RESPONSE_HEADER_TIMEOUT']]);
      assert.equal(server.received.length, 2);
    } finally {
      server.close();
    }
  });

  test("a non-idempotent call running into the caller's deadline is an ambiguous execution, decided locally", async () => {
    const server = await HoldingServer.start(['hold', 'ok']);
    try {
      const { error } = await run(server, { idempotency: 'NON_IDEMPOTENT' }, 500);
      assert.equal(error?.code, grpc.status.DEADLINE_EXCEEDED);
      const ambiguous = ambiguousExecutionOf(error);
      assert.deepEqual([ambiguous?.denyReason, ambiguous?.unknownOutcome], ['DEADLINE', 'RECONCILE']);
      assert.equal(ambiguous?.decision.decisionId, '', 'no question went to retryd');
      assert.equal(server.received.length, 1);
    } finally {
      server.close();
    }
  });

  test('RESOURCE_EXHAUSTED with a 300 ms pushback waits at least that long', async () => {
    const server = await StockServer.start([fail(grpc.status.RESOURCE_EXHAUSTED, 'slow down', { 'grpc-retry-pushback-ms': '300' }), ok]);
    try {
      const { error } = await run(server, {});
      assert.equal(error, null, String(error));
      assert.equal(server.received.length, 2);
      const gap = server.received[1]!.at - server.received[0]!.at;
      assert.ok(gap >= 300 && gap < 2300, `the second attempt came ${gap} ms after the first`);
    } finally {
      server.close();
    }
  });

  test('a negative pushback is not retried', async () => {
    const server = await StockServer.start([fail(grpc.status.RESOURCE_EXHAUSTED, 'go away', { 'grpc-retry-pushback-ms': '-1' }), ok]);
    try {
      // An upstream of its own: a negative pushback stops the upstream's
      // retries fleet-wide for a while (retryd's pushback_stop_window).
      const { error } = await run(server, { upstream: 'ts-stopped' });
      assert.equal(error?.code, grpc.status.RESOURCE_EXHAUSTED);
      assert.deepEqual([decisionOf(error)?.verdict, decisionOf(error)?.denyReason], ['DENY', 'SERVER_PUSHBACK']);
      assert.equal(server.received.length, 1);
    } finally {
      server.close();
    }
  });

  test('UNAUTHENTICATED refreshes credentials once and replays', async () => {
    const authorized: Unary = (call, callback) =>
      call.metadata.get('authorization')[0] === 'Bearer new' ? ok(call, callback) : fail(grpc.status.UNAUTHENTICATED, 'expired token')(call, callback);
    const server = await StockServer.start([authorized]);
    try {
      let refreshed = 0;
      const metadata = new grpc.Metadata();
      metadata.set('authorization', 'Bearer old');
      const { error } = await run(
        server,
        {
          onRefreshCredentials: (copy) => {
            refreshed++;
            copy.set('authorization', 'Bearer new');
          },
        },
        5000,
        metadata,
      );
      assert.equal(error, null, String(error));
      assert.equal(refreshed, 1);
      assert.deepEqual(server.received.map((call) => call.metadata.get('authorization')[0]), ['Bearer old', 'Bearer new']);
    } finally {
      server.close();
    }
  });

  test('the caller deadline bounds every attempt, and ends the call without asking retryd', async () => {
    const server = await HoldingServer.start(['hold']);
    try {
      const { error, ms } = await run(server, {}, 1000);
      assert.equal(error?.code, grpc.status.DEADLINE_EXCEEDED);
      assert.ok(ms >= 990, `settled after ${ms} ms, before the deadline`);
      // The caller's deadline ended the attempt, so nothing was left to ask
      // retryd with: decided locally, at once (no wall-clock ceiling needed).
      assert.deepEqual([decisionOf(error)?.denyReason, decisionOf(error)?.rule, decisionOf(error)?.decisionId], ['DEADLINE', 6, '']);
      assert.equal(server.received.length, 1);
    } finally {
      server.close();
    }
  });

  test('a cancel during the backoff ends the call at once', async () => {
    const server = await StockServer.start([fail(grpc.status.RESOURCE_EXHAUSTED, 'slow down', { 'grpc-retry-pushback-ms': '3000' }), ok]);
    const stock = client(server.target, retryingInterceptor(decider, { upstream: 'ts-grpc', idempotency: 'SAFE' }));
    try {
      const started = performance.now();
      const error = await new Promise<grpc.ServiceError | null>((resolve) => {
        const call = stock.Reserve(Buffer.from('sku-7'), { deadline: Date.now() + 10_000 }, (failure) => resolve(failure));
        const poll = setInterval(() => {
          if (server.received.length === 1) {
            clearInterval(poll);
            setTimeout(() => call.cancel(), 100); // inside the 3 s backoff
          }
        }, 10);
      });
      assert.equal(error?.code, grpc.status.CANCELLED);
      // Not a latency ceiling: waiting out the 3 s backoff would end later
      // than 3 s after the start however idle the machine.
      assert.ok(performance.now() - started < 3000, `${performance.now() - started} ms`);
      assert.equal(server.received.length, 1);
    } finally {
      stock.close();
      server.close();
    }
  });

  test('a cancel while retryd is deciding ends the call at once', async () => {
    // A frozen retryd keeps the decision pending for the decider's 5 s timeout.
    const server = await StockServer.start([fail(grpc.status.UNAVAILABLE), ok]);
    const stock = client(server.target, retryingInterceptor(decider, { upstream: 'ts-grpc', idempotency: 'SAFE' }));
    let call: grpc.ClientUnaryCall | undefined;
    try {
      await retryd.freeze();
      const started = performance.now();
      const error = await new Promise<grpc.ServiceError | null>((resolve) => {
        call = stock.Reserve(Buffer.from('sku-7'), { deadline: Date.now() + 10_000 }, (failure) => resolve(failure));
        const poll = setInterval(() => {
          if (server.received.length === 1) {
            clearInterval(poll);
            setTimeout(() => call!.cancel(), 100);
          }
        }, 10);
      });
      assert.equal(error?.code, grpc.status.CANCELLED);
      // Not a latency ceiling: waiting for the frozen retryd would end at
      // the decider's 5 s timeout, later than this however idle the machine.
      assert.ok(performance.now() - started < 5000, `${performance.now() - started} ms`);
      assert.equal(server.received.length, 1);
    } finally {
      retryd.signal('SIGCONT');
      stock.close();
      server.close();
    }
  });

  test('first attempts are counted as traffic, retries are not', async () => {
    const own = new RetrydClient(retryd.grpc, { timeoutMs: 5000, fallback: null, reporting: { intervalMs: 3_600_000 } });
    const server = await StockServer.start([fail(grpc.status.UNAVAILABLE), ok]);
    const stock = client(server.target, retryingInterceptor(own, { upstream: 'ts-grpc-report', idempotency: 'SAFE' }));
    try {
      assert.equal((await reserve(stock)).error, null);
      assert.equal((await reserve(stock)).error, null);
      assert.equal(server.received.length, 3);
      assert.deepEqual(own.reporter?.pending(), { 'ts-grpc-report': 2 });
      // A streaming call is real traffic too, though never retried.
      await new Promise<void>((resolve) => stock.Watch(Buffer.from('sku-7'), { deadline: Date.now() + 5000 }).on('end', resolve).resume());
      assert.deepEqual(own.reporter?.pending(), { 'ts-grpc-report': 3 });
    } finally {
      stock.close();
      server.close();
      await own.close();
    }
  });
});
