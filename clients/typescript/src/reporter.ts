/**
 * A background reporter that batches real-traffic counts into ReportTraffic.
 *
 * Budgets fill from reported first attempts only ("retries never fund
 * retries"), so call record() once per real request, never for a retry.
 * Every RetrydClient owns one (`client.reporter`, flushed by
 * `client.close()`), and the adapters record their first attempts into it.
 *
 * Reports also carry outcomes, so that a budget can follow the upstream's
 * health: recordOutcome(upstream, success, retry) once per finished attempt,
 * first attempts (`successes`/`failures`) apart from retries
 * (`retrySuccesses`/`retryFailures`). An attempt is a failure when the
 * caller asked (or would ask) retryd or its local rule whether to retry it
 * (not sent, no response, a retryable status); every other ending is a
 * success, a 404 included. An attempt the caller cancelled or abandoned is
 * neither. The adapters record every attempt's outcome by default. A batch
 * carries the requests and the four outcome counts of each upstream
 * together, and a re-sent batch the same counts.
 *
 * record() and recordOutcome() only add to in-memory counters; an unref'd timer sends the
 * counts every `intervalMs`, in batches of at most 1024 entries. Each batch
 * gets a random `report_id` when it is formed and keeps it until retryd
 * acknowledges it, so re-sending a batch whose answer was lost (a timeout, a
 * failure half-way through the deposits) never counts a request twice:
 * retryd applies each entry of an id at most once. While a batch is
 * unacknowledged, new counts wait beside it (up to `maxUpstreams` distinct
 * upstreams; beyond that they are dropped, with their outcomes, and their
 * requests counted in `dropped`).
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
 *
 * Latencies: recordLatency(upstream, success, ms) counts how long a completed
 * first attempt took, from sending to the end of the response, in the
 * upstream's success or failure histogram (./latency: at most 238 buckets
 * each, so memory stays bounded by maxUpstreams too). retryd adds them up
 * fleet-wide to serve hedge delays. Hedges and retries are never recorded; a
 * first attempt cancelled because its hedge answered first is recorded as a
 * success with the time it had run. The adapters do this by default. A batch
 * carries the histograms beside the counts, and a re-sent batch the same.
 *
 * Hedges won: recordHedgeWon(upstream) counts a hedged call whose answer came
 * from a hedge, not from its first attempt (`hedgesWon`; retryd counts it in
 * `retryd_hedges_won_total`). Only the caller knows which copy won, so the
 * hedging adapters count it by default, once per call.
 */
import { randomUUID } from 'node:crypto';
import { InvalidRequestError, RetrydError, RetrydUnavailableError } from './errors';
import type { Hedging } from './hedging';
import { latencyBucketOfMs } from './latency';
import { OutageLog } from './outage';

/** The most entries one ReportTraffic call may carry. */
export const MAX_TRAFFIC_ENTRIES = 1024;

/** What retryd answered to one report. */
export interface ReportResult {
  /** Entries applied by this call. */
  accepted: number;
  /** Entries an earlier call with the same report id had already applied. */
  alreadyApplied: number;
  /** The hedging retryd serves for the reported upstreams that have a policy. */
  hedging?: Hedging[];
}

/** A latency histogram: bucket index (./latency) to count; empty buckets absent. */
export type LatencyCounts = Record<number, number>;

/** One entry of a report: first attempts sent, and how attempts ended. */
export interface TrafficEntry {
  upstream: string;
  /** First attempts sent. */
  requests: number;
  /** First attempts that succeeded / failed (see the module doc for the rule). */
  successes: number;
  failures: number;
  /** Retries (attempts after the first) that succeeded / failed. */
  retrySuccesses: number;
  retryFailures: number;
  /** First-attempt latencies of successes and of failures; absent when none was recorded. */
  latencySuccesses?: LatencyCounts;
  latencyFailures?: LatencyCounts;
  /** Hedged calls whose answer came from a hedge; absent when none. */
  hedgesWon?: number;
}

/** Where a reporter sends its batches (a RetrydClient). */
export interface TrafficSink {
  /** One ReportTraffic call: at most 1024 entries, with the batch's id. */
  sendTrafficReport(traffic: TrafficEntry[], reportId: string): Promise<ReportResult>;
}

/** A pending row: requests, successes, failures, retrySuccesses, retryFailures, hedgesWon. */
type Counts = [number, number, number, number, number, number];
const REQUESTS = 0;
const HEDGES_WON = 5;

/** One upstream's pending counts and its two latency histograms (bucket -> count). */
interface Row {
  counts: Counts;
  latencySuccesses: Map<number, number>;
  latencyFailures: Map<number, number>;
}

const newRow = (): Row => ({ counts: [0, 0, 0, 0, 0, 0], latencySuccesses: new Map(), latencyFailures: new Map() });

function addHistogram(into: Map<number, number>, from: LatencyCounts | Map<number, number> | undefined): void {
  if (from === undefined) return;
  const pairs = from instanceof Map ? [...from] : Object.entries(from).map(([k, n]) => [Number(k), n] as const);
  for (const [index, n] of pairs) into.set(index, (into.get(index) ?? 0) + n);
}

function histogramOf(map: Map<number, number>): LatencyCounts | undefined {
  if (map.size === 0) return undefined;
  return Object.fromEntries([...map].sort(([a], [b]) => a - b));
}

function entryOf(upstream: string, row: Row): TrafficEntry {
  const [requests, successes, failures, retrySuccesses, retryFailures, hedgesWon] = row.counts;
  const entry: TrafficEntry = { upstream, requests, successes, failures, retrySuccesses, retryFailures };
  if (hedgesWon > 0) entry.hedgesWon = hedgesWon;
  const latencySuccesses = histogramOf(row.latencySuccesses);
  const latencyFailures = histogramOf(row.latencyFailures);
  if (latencySuccesses !== undefined) entry.latencySuccesses = latencySuccesses;
  if (latencyFailures !== undefined) entry.latencyFailures = latencyFailures;
  return entry;
}

function addEntry(row: Row, e: TrafficEntry): void {
  const counts = [e.requests, e.successes, e.failures, e.retrySuccesses, e.retryFailures, e.hedgesWon ?? 0];
  for (let i = 0; i < counts.length; i++) row.counts[i]! += counts[i]!;
  addHistogram(row.latencySuccesses, e.latencySuccesses);
  addHistogram(row.latencyFailures, e.latencyFailures);
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
  entries: TrafficEntry[];
}

export class TrafficReporter {
  readonly intervalMs: number;
  readonly maxUpstreams: number;
  /** Requests recorded but never reported: beyond maxUpstreams, or in a dropped batch. */
  dropped = 0;
  /** Batches dropped because retryd refused them for good. */
  droppedBatches = 0;
  private readonly logger: Logger;
  private pendingCounts = new Map<string, Row>();
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
    this.add(upstream, REQUESTS, requests);
  }

  /**
   * Counts how `count` attempts to `upstream` ended: `retry` false for first
   * attempts (successes/failures), true for the attempts after them
   * (retrySuccesses/retryFailures). See the module doc for the rule.
   */
  recordOutcome(upstream: string, success: boolean, retry = false, count = 1): void {
    this.add(upstream, retry ? (success ? 3 : 4) : success ? 1 : 2, count);
  }

  /** Counts one completed first attempt's latency, in ms (see the module doc for the rule). */
  recordLatency(upstream: string, success: boolean, ms: number): void {
    const row = this.row(upstream);
    if (row === undefined) return;
    const histogram = success ? row.latencySuccesses : row.latencyFailures;
    const index = latencyBucketOfMs(ms);
    histogram.set(index, (histogram.get(index) ?? 0) + 1);
  }

  /** Counts `count` hedged calls to `upstream` answered by a hedge (see the module doc). */
  recordHedgeWon(upstream: string, count = 1): void {
    this.add(upstream, HEDGES_WON, count);
  }

  /** A copy of the requests not yet acknowledged by retryd (unsent batches included). */
  pending(): Record<string, number> {
    const all: Record<string, number> = {};
    for (const [upstream, entry] of Object.entries(this.pendingTraffic())) if (entry.requests > 0) all[upstream] = entry.requests;
    return all;
  }

  /** A copy of every count not yet acknowledged (outcomes too, unsent batches included), per upstream. */
  pendingTraffic(): Record<string, TrafficEntry> {
    const all = new Map<string, Row>();
    const add = (e: TrafficEntry): void => {
      const row = all.get(e.upstream) ?? newRow();
      addEntry(row, e);
      all.set(e.upstream, row);
    };
    for (const batch of this.unsent) for (const e of batch.entries) add(e);
    for (const [upstream, row] of this.pendingCounts) add(entryOf(upstream, row));
    return Object.fromEntries([...all].map(([upstream, row]) => [upstream, entryOf(upstream, row)]));
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
        const entries = [...this.pendingCounts].map(([upstream, row]) => entryOf(upstream, row));
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
        const requests = batch.entries.reduce((sum, entry) => sum + entry.requests, 0);
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

  private add(upstream: string, index: number, n: number): void {
    if (n <= 0) return;
    const row = this.row(upstream);
    if (row === undefined) {
      if (index === REQUESTS) this.dropped += n;
      return;
    }
    row.counts[index]! += n;
  }

  /** The upstream's pending row, made if the maxUpstreams bound allows. */
  private row(upstream: string): Row | undefined {
    let row = this.pendingCounts.get(upstream);
    if (row === undefined) {
      if (this.pendingCounts.size >= this.maxUpstreams) return undefined;
      row = newRow();
      this.pendingCounts.set(upstream, row);
    }
    return row;
  }
}

/** The code's name when the error is one re-sending cannot fix; undefined otherwise. */
function permanentReason(error: RetrydError): string | undefined {
  if (error instanceof InvalidRequestError) return 'INVALID_ARGUMENT';
  if (error instanceof RetrydUnavailableError) return PERMANENT_CODES.get(error.code);
  return undefined;
}
