/**
 * A background reporter that batches real-traffic counts into ReportTraffic.
 *
 * Budgets fill from reported first attempts only ("retries never fund
 * retries"), so call record() once per real request, never for a retry.
 * record() only adds to an in-memory counter; an unref'd timer sends the
 * counts every `intervalMs`, in batches of at most 1024 entries. Counts that
 * could not be sent are kept for the next batch, up to `maxUpstreams`
 * distinct upstreams (beyond that new upstreams are dropped and counted in
 * `dropped`).
 */
import { RetrydError } from './errors';

export interface TrafficSink {
  reportTraffic(counts: Record<string, number>): Promise<number>;
}

export interface TrafficReporterOptions {
  intervalMs?: number;
  maxUpstreams?: number;
}

export class TrafficReporter {
  readonly intervalMs: number;
  readonly maxUpstreams: number;
  dropped = 0;
  private pendingCounts = new Map<string, number>();
  private timer: NodeJS.Timeout | undefined;
  private sending: Promise<boolean> | undefined;

  constructor(private readonly sink: TrafficSink, options: TrafficReporterOptions = {}) {
    this.intervalMs = options.intervalMs ?? 1000;
    this.maxUpstreams = options.maxUpstreams ?? 10_000;
  }

  /** Counts `requests` real (first-attempt) requests to `upstream`. */
  record(upstream: string, requests = 1): void {
    if (requests <= 0) return;
    this.add(upstream, requests);
  }

  /** A copy of the counts not yet sent. */
  pending(): Record<string, number> {
    return Object.fromEntries(this.pendingCounts);
  }

  /** Sends the pending counts now; resolves false (keeping them) if retryd failed. */
  async flush(): Promise<boolean> {
    while (this.sending) await this.sending;
    if (this.pendingCounts.size === 0) return true;
    const batch = this.pendingCounts;
    this.pendingCounts = new Map();
    this.sending = this.sink
      .reportTraffic(Object.fromEntries(batch))
      .then(() => true)
      .catch((error: unknown) => {
        if (!(error instanceof RetrydError)) throw error;
        for (const [upstream, n] of batch) this.add(upstream, n);
        return false;
      })
      .finally(() => {
        this.sending = undefined;
      });
    return this.sending;
  }

  start(): this {
    if (this.timer === undefined) {
      this.timer = setInterval(() => void this.flush().catch(() => undefined), this.intervalMs);
      this.timer.unref();
    }
    return this;
  }

  /** Stops the timer and sends what is left. */
  async close(): Promise<void> {
    if (this.timer !== undefined) clearInterval(this.timer);
    this.timer = undefined;
    await this.flush();
  }

  private add(upstream: string, n: number): void {
    const current = this.pendingCounts.get(upstream);
    if (current !== undefined) this.pendingCounts.set(upstream, current + n);
    else if (this.pendingCounts.size < this.maxUpstreams) this.pendingCounts.set(upstream, n);
    else this.dropped += n;
  }
}
