/**
 * What the client does with a shadow answer (`DecideResponse.shadow`).
 *
 * An upstream with `enforce = false` in retryd's policy is in shadow mode:
 * retryd decides as it would and spends a shadow budget, but does not enforce
 * the decision. The client then decides with its own configured behaviour,
 * the local rule of ./fallback, and acts on that. Where retryd's verdict or
 * deny reason differs from the local one, the difference is counted per
 * upstream and logged, at most one warning per upstream per interval; the
 * line says how many differences were not logged since the previous one.
 */
import type { Logger } from './reporter';
import type { Decision } from './types';

/** Milliseconds between two divergence warnings for one upstream, by default. */
export const DEFAULT_SHADOW_LOG_INTERVAL_MS = 60_000;

/** The verdict and, for a DENY, its reason: "DENY BUDGET_EXHAUSTED". */
export function describeDecision(decision: Decision): string {
  return decision.denyReason === null ? decision.verdict : `${decision.verdict} ${decision.denyReason}`;
}

/** Whether two decisions disagree on what to do (the backoff aside: it is jittered). */
export function decisionsDiffer(retryd: Decision, local: Decision): boolean {
  return retryd.verdict !== local.verdict || retryd.denyReason !== local.denyReason;
}

interface UpstreamState {
  count: number;
  unlogged: number;
  loggedAt: number | null;
}

/** Counts the differences between retryd's shadow decisions and the local rule, and rate-limits their warnings. */
export class ShadowDivergences {
  private readonly upstreams = new Map<string, UpstreamState>();

  /** `now` is a monotonic clock in ms (replaceable in tests). */
  constructor(
    readonly intervalMs: number,
    private readonly logger: Logger,
    public now: () => number = () => performance.now(),
  ) {
    if (!(intervalMs >= 0) || !Number.isFinite(intervalMs)) {
      throw new RangeError(`shadowLogIntervalMs: must be a finite number of ms, at least 0; got ${intervalMs}`);
    }
  }

  /** Counts one difference; logs it unless this upstream logged one less than the interval ago. */
  record(upstream: string, retryd: Decision, local: Decision): void {
    const now = this.now();
    let state = this.upstreams.get(upstream);
    if (state === undefined) {
      state = { count: 0, unlogged: 0, loggedAt: null };
      this.upstreams.set(upstream, state);
    }
    state.count += 1;
    if (state.loggedAt !== null && now - state.loggedAt < this.intervalMs) {
      state.unlogged += 1;
      return;
    }
    const unlogged = state.unlogged;
    state.unlogged = 0;
    state.loggedAt = now;
    this.logger.warn(
      `retryd shadow decision for upstream ${JSON.stringify(upstream)} differs from the local rule: ` +
        `retryd ${describeDecision(retryd)}, local rule ${describeDecision(local)} (acted on); ` +
        `${unlogged} more difference(s) for this upstream not logged since the last line`,
    );
  }

  /** Differences counted so far, per upstream (a copy). */
  counts(): Map<string, number> {
    return new Map([...this.upstreams].map(([upstream, state]) => [upstream, state.count]));
  }
}
