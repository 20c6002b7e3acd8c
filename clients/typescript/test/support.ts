/** Test helpers: a real retryd from $RETRYD_BIN, and a misbehaving HTTP server on 127.0.0.1. */
import { spawn, type ChildProcess } from 'node:child_process';
import { EventEmitter } from 'node:events';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import * as readline from 'node:readline';

/**
 * How long a test waits for a state it expects before failing: a guard
 * against a hang, never a latency claim (the Rust testkit's HANG_GUARD).
 */
export const HANG_GUARD_MS = 30_000;

export const REPO = path.resolve(__dirname, '..', '..', '..', '..');
/** The conformance vectors: the repository's, or $RETRYD_VECTORS (e.g. a newer copy). */
export const VECTORS = process.env.RETRYD_VECTORS || path.join(REPO, 'conformance', 'decisions.json');

/** Fast backoffs, so that end-to-end retry tests sleep milliseconds. */
export const CLIENT_TEST_CONFIG = `
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"

[defaults]
max_attempts = 3
min_attempt_budget = "20ms"
max_retry_after = "60s"
transient_500 = false
budget = { capacity = 1000.0, initial = 1000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "10ms", max = "50ms", jitter = "full" }

# A large minimum attempt budget, so deadline tests need no tight timing.
[upstreams."ts-slow"]
min_attempt_budget = "300ms"

[upstreams."ts-empty"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }

# Budgets that only reported traffic fills, one token per request: what a
# test finds there is exactly what was reported.
[upstreams."ts-report-default"]
budget = { capacity = 100.0, initial = 0.0, ratio = 1.0, min_per_second = 0.0 }

[upstreams."ts-report-optout"]
budget = { capacity = 100.0, initial = 0.0, ratio = 1.0, min_per_second = 0.0 }

[upstreams."ts-dedup"]
budget = { capacity = 100.0, initial = 0.0, ratio = 1.0, min_per_second = 0.0 }

# Budgets without refill, so that a spent token shows.
[upstreams."ts-encoding"]
budget = { capacity = 10.0, initial = 10.0, ratio = 0.0, min_per_second = 0.0 }

# Empty and never refilled by the little traffic a test reports: every
# retry is denied BUDGET_EXHAUSTED (issue 36).
[upstreams."ts-hold"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.1, min_per_second = 0.0 }

[upstreams."ts-frozen"]
budget = { capacity = 2.0, initial = 2.0, ratio = 0.0, min_per_second = 0.0 }

# Issue 33: hedged upstreams at the policy's defaults (p95, one hedge, 5% of
# first attempts, 100 samples over 30 s); the tests report the latencies.
[upstreams."ts-hedged".hedging]
quantile = 0.95

[upstreams."ts-hedged-grpc".hedging]
quantile = 0.95

[upstreams."ts-hedge-cap".hedging]
quantile = 0.95

# In shadow mode: retryd's hedge answers are not enforced.
[upstreams."ts-hedge-shadow"]
enforce = false

[upstreams."ts-hedge-shadow".hedging]
quantile = 0.95
`;

export interface Retryd {
  grpc: string;
  metrics: string;
  /** Sends a signal to the process (SIGSTOP freezes it, SIGCONT thaws it). */
  signal(signal: NodeJS.Signals): void;
  /** SIGSTOP, then waits until the kernel reports the process stopped (delivery is asynchronous). */
  freeze(): Promise<void>;
  stop(): Promise<void>;
  /** SIGKILL, as a crash would; resolves once the process is gone. */
  kill(): Promise<void>;
}

export function retrydBin(): string {
  const bin = process.env.RETRYD_BIN || path.join(REPO, 'target', 'debug', 'retryd');
  if (!fs.existsSync(bin)) {
    throw new Error(`retryd binary not found at ${bin}: build it (cargo build --bin retryd) or set RETRYD_BIN`);
  }
  return bin;
}

/** Starts `retryd serve` with a config and waits for its address line. */
export async function startRetryd(config: string, bin: string = retrydBin()): Promise<Retryd> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'retryd-ts-'));
  const configPath = path.join(dir, 'retryd.toml');
  fs.writeFileSync(configPath, config);
  const stderrPath = path.join(dir, 'stderr.log');
  const stderr = fs.openSync(stderrPath, 'w');
  const child: ChildProcess = spawn(bin, ['serve', '--config', configPath], {
    stdio: ['ignore', 'pipe', stderr],
  });
  fs.closeSync(stderr);
  const lines = readline.createInterface({ input: child.stdout! });
  const line = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('retryd printed no address line in 60s')), 60_000);
    lines.once('line', (text) => {
      clearTimeout(timer);
      resolve(text);
    });
    child.once('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`retryd exited with ${code}: ${fs.readFileSync(stderrPath, 'utf8').slice(-4000)}`));
    });
  });
  lines.on('line', () => undefined); // keep draining
  const addresses = JSON.parse(line) as { grpc: string; metrics: string };
  return {
    grpc: addresses.grpc,
    metrics: addresses.metrics,
    signal: (signal) => {
      child.kill(signal);
    },
    freeze: async () => {
      child.kill('SIGSTOP');
      // /proc/<pid>/stat: "pid (comm) S ...", state T once stopped.
      await waitFor('retryd to stop', () => /\) T /.test(fs.readFileSync(`/proc/${child.pid}/stat`, 'utf8')));
    },
    kill: () =>
      new Promise<void>((resolve) => {
        if (child.exitCode !== null || child.signalCode !== null) return resolve();
        child.once('exit', () => resolve());
        child.kill('SIGKILL');
      }),
    stop: () =>
      new Promise<void>((resolve) => {
        if (child.exitCode !== null || child.signalCode !== null) {
          fs.rmSync(dir, { recursive: true, force: true });
          return resolve();
        }
        child.kill('SIGCONT'); // a frozen process would keep SIGTERM pending
        const kill = setTimeout(() => child.kill('SIGKILL'), 10_000);
        child.once('exit', () => {
          clearTimeout(kill);
          fs.rmSync(dir, { recursive: true, force: true });
          resolve();
        });
        child.kill('SIGTERM');
      }),
  };
}

// ------------------------------------------------------------------ a scripted HTTP server

export type Action = (socket: net.Socket, request: Buffer) => void;

export const respond =
  (status: number, body = '', headers: Record<string, string> = {}): Action =>
  (socket) => {
    const head = [`HTTP/1.1 ${status} X`, `Content-Length: ${Buffer.byteLength(body)}`, 'Connection: close']
      .concat(Object.entries(headers).map(([key, value]) => `${key}: ${value}`))
      .join('\r\n');
    socket.end(`${head}\r\n\r\n${body}`);
  };

export const respondIf =
  (predicate: (request: Buffer) => boolean, yes: Action, no: Action): Action =>
  (socket, request) =>
    (predicate(request) ? yes : no)(socket, request);

/** Reads the request, then closes without a response. */
export const closeWithoutResponse = (): Action => (socket) => socket.end();

/** Reads the request, then resets the connection (TCP RST). */
export const resetWithoutResponse = (): Action => (socket) => socket.resetAndDestroy();

/** Headers announcing 100 bytes, 10 bytes, then a reset. */
export const truncatedBody =
  (status = 200): Action =>
  (socket) => {
    socket.write(`HTTP/1.1 ${status} X\r\nContent-Length: 100\r\n\r\n0123456789`, () => {
      setTimeout(() => socket.resetAndDestroy(), 20);
    });
  };

/** Reads the request and never answers (until the server closes). */
export const hang = (): Action => () => undefined;

/** Plain-text bytes where a TLS client expects a ServerHello. */
export const garbage = (): Action => (socket) => socket.end('HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n');

export class ScriptedServer {
  readonly requests: Buffer[] = [];
  private readonly arrivals = new EventEmitter();
  private readonly server: net.Server;
  private readonly sockets = new Set<net.Socket>();
  port = 0;

  constructor(private readonly actions: Action[], private readonly readRequest = true) {
    this.server = net.createServer((socket) => this.handle(socket));
  }

  static async start(actions: Action[], readRequest = true): Promise<ScriptedServer> {
    const server = new ScriptedServer(actions, readRequest);
    await new Promise<void>((resolve) => server.server.listen(0, '127.0.0.1', resolve));
    server.port = (server.server.address() as net.AddressInfo).port;
    return server;
  }

  get url(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  /** Resolves once `n` requests have been read: an event, no timer, so it also works under mock timers. */
  received(n: number): Promise<void> {
    return new Promise((resolve) => {
      const check = (): void => {
        if (this.requests.length < n) return;
        this.arrivals.off('request', check);
        resolve();
      };
      this.arrivals.on('request', check);
      check();
    });
  }

  private handle(socket: net.Socket): void {
    this.sockets.add(socket);
    socket.on('close', () => this.sockets.delete(socket));
    socket.on('error', () => undefined);
    const act = (request: Buffer): void => {
      const index = Math.min(this.requests.length, this.actions.length - 1);
      this.requests.push(request);
      this.arrivals.emit('request');
      this.actions[index]!(socket, request);
    };
    if (!this.readRequest) return act(Buffer.alloc(0));
    let data = Buffer.alloc(0);
    const onData = (chunk: Buffer): void => {
      data = Buffer.concat([data, chunk]);
      const end = data.indexOf('\r\n\r\n');
      if (end < 0) return;
      const head = data.subarray(0, end).toString('latin1');
      const lengthMatch = /\r\ncontent-length:\s*(\d+)/i.exec(head);
      const chunked = /\r\ntransfer-encoding:\s*chunked/i.test(head);
      const body = data.subarray(end + 4);
      if (lengthMatch && body.length < Number(lengthMatch[1])) return;
      if (chunked && !body.toString('latin1').endsWith('0\r\n\r\n')) return;
      socket.off('data', onData);
      act(data);
    };
    socket.on('data', onData);
  }

  async close(): Promise<void> {
    for (const socket of this.sockets) socket.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}

/** A loopback port with no listener (connections to it are refused). */
export async function closedPort(): Promise<number> {
  const probe = net.createServer();
  await new Promise<void>((resolve) => probe.listen(0, '127.0.0.1', resolve));
  const { port } = probe.address() as net.AddressInfo;
  await new Promise<void>((resolve) => probe.close(() => resolve()));
  return port;
}

/**
 * A TCP proxy to a loopback port that can lose answers: with
 * `dropResponses`, bytes from the server are discarded (the request still
 * arrives and is acted on; the caller never hears back), and `cut()` closes
 * every proxied connection, as a network failure would.
 */
export class LossyProxy {
  dropResponses = false;
  port = 0;
  private readonly server: net.Server;
  private readonly sockets = new Set<net.Socket>();

  private constructor(private readonly targetPort: number) {
    this.server = net.createServer((client) => {
      const upstream = net.connect(this.targetPort, '127.0.0.1');
      for (const socket of [client, upstream]) {
        this.sockets.add(socket);
        socket.on('error', () => undefined);
        socket.on('close', () => {
          this.sockets.delete(socket);
          client.destroy();
          upstream.destroy();
        });
      }
      client.on('data', (chunk) => upstream.write(chunk));
      upstream.on('data', (chunk) => {
        if (!this.dropResponses) client.write(chunk);
      });
    });
  }

  static async start(target: string): Promise<LossyProxy> {
    const proxy = new LossyProxy(Number(target.slice(target.lastIndexOf(':') + 1)));
    await new Promise<void>((resolve) => proxy.server.listen(0, '127.0.0.1', resolve));
    proxy.port = (proxy.server.address() as net.AddressInfo).port;
    return proxy;
  }

  get target(): string {
    return `127.0.0.1:${this.port}`;
  }

  cut(): void {
    for (const socket of this.sockets) socket.destroy();
  }

  async close(): Promise<void> {
    this.cut();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}

/** A logger that keeps what it was given. */
export class CapturingLogger {
  readonly warnings: string[] = [];
  readonly infos: string[] = [];
  warn(message: string): void {
    this.warnings.push(message);
  }
  info(message: string): void {
    this.infos.push(message);
  }
}

/** Polls `probe` until it returns true, failing after `timeoutMs`. */
export async function waitFor(what: string, probe: () => boolean | Promise<boolean>, timeoutMs = 5000): Promise<void> {
  const giveUp = Date.now() + timeoutMs;
  while (!(await probe())) {
    if (Date.now() > giveUp) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

// ------------------------------------------------------------------ a keep-alive HTTP server that counts

/** What a CountingServer does with the n-th request it reads. */
export type Reply = 'ok' | 'reset' | 'hold' | '503' | 'reset-if-reused';

/**
 * An HTTP/1.1 server that keeps connections open (so clients pool them) and
 * counts every request it reads and every connection it accepts: the
 * ground truth against which the attempts an adapter decided are checked.
 * The n-th request read gets script[n] (the last entry repeats).
 */
export class CountingServer {
  /**
   * Requests read, in order: the connection each came on (1-based), and
   * whether that connection had carried a request before (a pooled one).
   */
  readonly reads: { method: string; connection: number; reused: boolean }[] = [];
  connections = 0;
  port = 0;
  private readonly server: net.Server;
  private readonly sockets = new Set<net.Socket>();

  private constructor(private readonly script: Reply[]) {
    this.server = net.createServer((socket) => this.handle(socket));
  }

  static async start(script: Reply[]): Promise<CountingServer> {
    const server = new CountingServer(script);
    await new Promise<void>((resolve) => server.server.listen(0, '127.0.0.1', resolve));
    server.port = (server.server.address() as net.AddressInfo).port;
    return server;
  }

  get url(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  private handle(socket: net.Socket): void {
    const connection = ++this.connections;
    let served = 0;
    this.sockets.add(socket);
    socket.on('close', () => this.sockets.delete(socket));
    socket.on('error', () => undefined);
    let data = Buffer.alloc(0);
    socket.on('data', (chunk: Buffer) => {
      data = Buffer.concat([data, chunk]);
      for (;;) {
        const end = data.indexOf('\r\n\r\n');
        if (end < 0) return;
        const head = data.subarray(0, end).toString('latin1');
        const length = Number(/\r\ncontent-length:\s*(\d+)/i.exec(head)?.[1] ?? 0);
        if (data.length < end + 4 + length) return;
        data = data.subarray(end + 4 + length);
        const reply = this.script[Math.min(this.reads.length, this.script.length - 1)]!;
        const reused = served++ > 0;
        this.reads.push({ method: head.slice(0, head.indexOf(' ')), connection, reused });
        if (reply === 'reset' || (reply === 'reset-if-reused' && reused)) return void socket.resetAndDestroy();
        if (reply === 'hold') return;
        const status = reply === '503' ? '503 Service Unavailable' : '200 OK';
        socket.write(`HTTP/1.1 ${status}\r\nContent-Length: 2\r\nKeep-Alive: timeout=30\r\n\r\nok`);
      }
    });
  }

  async close(): Promise<void> {
    for (const socket of this.sockets) socket.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}

/** Lets pending I/O callbacks and promise reactions run, without a timer (mock timers do not touch setImmediate). */
export async function ioTurns(turns = 20): Promise<void> {
  for (let turn = 0; turn < turns; turn++) await new Promise((resolve) => setImmediate(resolve));
}
