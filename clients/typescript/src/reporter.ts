/**
 * A background reporter that batches real-traffic counts into ReportTraffic.
 *
 * Budgets fill from reported first attempts only ("retries never fund
 * retries"), so call record() once per real request, never for a retry.
 * Every RetrydClient owns one (`client.reporter`, flushed by
 * `client.close()`), and the adapters record their first attempts into it.
 *
 * record() only adds to an in-memory counter; an unref'd timer sends the
 * counts every `intervalMs`, in batches of at most 1024 entries. Each batch
 * gets a random `report_id` when it is formed and keeps it until retryd
 * acknowledges it, so re-sending a batch whose answer was lost (a timeout, a
 * failure half-way through the deposits) never counts a request twice:
 * retryd applies each entry of an id at most once. While a batch is
 * unacknowledged, new counts wait beside it (up to `maxUpstreams` distinct
 * upstreams; beyond that they are dropped and counted in `dropped`).
 *
 * A batch that retryd refuses for good (PERMISSION_DENIED,
 * RESOURCE_EXHAUSTED, INVALID_ARGUMENT: re-sending it would fail the same way
 * every interval forever) is dropped: its requests are added to `dropped`,
 * `droppedBatches` counts it, and one warning is logged per reason until a
 * report succeeds again.
 *
 * A report that fails for a passing reason (retryd unreachable or slow) is
 * kept for the next interval; the first such failure warns, and the first
 * report that goes through after it says how many failed meanwhile: one
 * pair of lines per outage, not one per failed batch.
 */
import { randomUUID } from 'node:crypto';
import { InvalidRequestError, RetrydError, RetrydUnavailableError } from './errors';
import { OutageLog } from './outage';

/** The most entries one ReportTraffic call may carry. */
export const MAX_TRAFFIC_ENTRIES = 1024;

/** What retryd answered to one report. */
export interface ReportResult {
  /** Entries applied by this call. */
  accepted: number;
  /** Entries an earlier call with the same report id had already applied. */
  alreadyApplied: number;
}

/** Where a reporter sends its batches (a RetrydClient). */
export interface TrafficSink {
  /** One ReportTraffic call: at most 1024 entries, with the batch's id. */
  sendTrafficReport(traffic: [string, number][], reportId: string): Promise<ReportResult>;
}

/** Where warnings go (default: console). */
export interface Logger {
  warn(message: string): void;
  info?(message: string): void;
}

export interface TrafficReporterOptions {
  /** How often the timer sends what was recorded, in ms (default 1000). */
  intervalMs?: number;
  /** The most distinct upstreams kept while retryd is unreachable (default 10 000). */
  maxUpstreams?: number;
  logger?: Logger;
}

/** gRPC codes after which re-sending the same batch cannot succeed. */
const PERMANENT_CODES = new Map<number, string>([
  [3, 'INVALID_ARGUMENT'],
  [7, 'PERMISSION_DENIED'],
  [8, 'RESOURCE_EXHAUSTED'],
]);

interface Batch {
  id: string;
  entries: [string, number][];
}

export class TrafficReporter {
  readonly intervalMs: number;
  readonly maxUpstreams: number;
  /** Requests recorded but never reported: beyond maxUpstreams, or in a dropped batch. */
  dropped = 0;
  /** Batches dropped because retryd refused them for good. */
  droppedBatches = 0;
  private readonly logger: Logger;
  private pendingCounts = new Map<string, number>();
  /** Formed, not yet acknowledged, each with the id it is re-sent with. */
  private unsent: Batch[] = [];
  private timer: NodeJS.Timeout | undefined;
  private sending: Promise<boolean> | undefined;
  /** The reason already warned about since the last successful report. */
  private warnedReason: string | undefined;
  private readonly outage: OutageLog;

  constructor(private readonly sink: TrafficSink, options: TrafficReporterOptions = {}) {
    this.intervalMs = options.intervalMs ?? 1000;
    this.maxUpstreams = options.maxUpstreams ?? 10_000;
    this.logger = options.logger ?? console;
    this.outage = new OutageLog(
      this.logger,
      (detail) => `traffic reports to retryd fail (${detail}); the counts are kept and re-sent every ${this.intervalMs} ms`,
      (failures, lastedMs) =>
        `traffic reports reach retryd again after ${Math.round(lastedMs)} ms; ${failures} report attempt(s) failed meanwhile (their counts were kept)`,
    );
  }

  /** Counts `requests` real (first-attempt) requests to `upstream`. */
  record(upstream: string, requests = 1): void {
    if (requests <= 0) return;
    this.add(upstream, requests);
  }

  /** A copy of the counts not yet acknowledged by retryd (unsent batches included). */
  pending(): Record<string, number> {
    const all = new Map<string, number>();
    for (const batch of this.unsent) for (const [upstream, n] of batch.entries) all.set(upstream, (all.get(upstream) ?? 0) + n);
    for (const [upstream, n] of this.pendingCounts) all.set(upstream, (all.get(upstream) ?? 0) + n);
    return Object.fromEntries(all);
  }

  /**
   * Sends what is pending now. Resolves true when everything was
   * acknowledged or dropped for good, false when retryd could not be reached
   * (the unacknowledged batches are kept, with their ids, for the next flush).
   */
  async flush(): Promise<boolean> {
    while (this.sending) await this.sending;
    this.sending = this.send().finally(() => {
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

  private async send(): Promise<boolean> {
    for (;;) {
      // New counts become batches only once the earlier ones are
      // acknowledged, so a re-sent batch always carries exactly the entries
      // of its first send.
      if (this.unsent.length === 0) {
        if (this.pendingCounts.size === 0) return true;
        const entries = [...this.pendingCounts];
        this.pendingCounts = new Map();
        for (let start = 0; start < entries.length; start += MAX_TRAFFIC_ENTRIES) {
          this.unsent.push({ id: randomUUID(), entries: entries.slice(start, start + MAX_TRAFFIC_ENTRIES) });
        }
      }
      if (!(await this.sendUnsent())) return false;
    }
  }

  /** Sends the formed batches in order; false at the first that retryd could not take now. */
  private async sendUnsent(): Promise<boolean> {
    while (this.unsent.length > 0) {
      const batch = this.unsent[0]!;
      try {
        await this.sink.sendTrafficReport(batch.entries, batch.id);
        this.warnedReason = undefined;
        this.outage.recovered();
      } catch (error) {
        if (!(error instanceof RetrydError)) throw error;
        const reason = permanentReason(error);
        if (reason === undefined) {
          this.outage.failed(error.message);
          return false; // kept, same id next time
        }
        // retryd answered (with a refusal): not an outage.
        this.outage.recovered();
        const requests = batch.entries.reduce((sum, [, n]) => sum + n, 0);
        this.dropped += requests;
        this.droppedBatches += 1;
        if (this.warnedReason !== reason) {
          this.warnedReason = reason;
          this.logger.warn(
            `retryd refused a traffic report (${error.message}); dropped ${requests} requests in ${batch.entries.length} entries, ` +
              `since re-sending would fail the same way. Later drops for ${reason} are counted in reporter.dropped without a warning.`,
          );
        }
      }
      this.unsent.shift();
    }
    return true;
  }

  private add(upstream: string, n: number): void {
    const current = this.pendingCounts.get(upstream);
    if (current !== undefined) this.pendingCounts.set(upstream, current + n);
    else if (this.pendingCounts.size < this.maxUpstreams) this.pendingCounts.set(upstream, n);
    else this.dropped += n;
  }
}

/** The code's name when the error is one re-sending cannot fix; undefined otherwise. */
function permanentReason(error: RetrydError): string | undefined {
  if (error instanceof InvalidRequestError) return 'INVALID_ARGUMENT';
  if (error instanceof RetrydUnavailableError) return PERMANENT_CODES.get(error.code);
  return undefined;
}
