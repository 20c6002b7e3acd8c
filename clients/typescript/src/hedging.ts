/**
 * Hedging on the client: what retryd serves per upstream, the local
 * fallback's fixed delay, and the race of a call's copies.
 *
 * retryd answers every ReportTraffic with the current hedging of each
 * reported upstream that has a hedging policy (ReportTrafficResponse.hedging):
 * whether to hedge, the delay (the fleet's chosen quantile of first-attempt
 * latency), how many hedges and which idempotency levels. The reporter sends
 * a batch every interval anyway, so the delay reaches the client off the
 * request path, with no stream to hold open: a call only reads this table.
 * An upstream missing from the latest answers keeps its entry for three
 * report intervals (a report that failed once, an interval without traffic to
 * it), then drops it: an older delay no longer describes the fleet, and would
 * hedge too early (load) or too late (no help).
 *
 * runHedged() races the copies: the first is sent with a timer of the delay;
 * only when the timer fires with no answer yet is retryd asked (a Decide with
 * `hedge` = k: a fast call never asks); on RETRY a copy is sent (and below
 * maxHedges the timer starts again); a DENY, or retryd not answering, ends
 * the hedging of the call. The first final answer wins and the others are
 * aborted; when every copy failed, the last failure goes back to the normal
 * retry path. A cancelled loser is never an outcome; a cancelled first
 * attempt's elapsed time is a success latency (leaving it out would hide the
 * very tail hedging is for).
 */
import type { Hedging__Output } from './generated/retryd/v1/Hedging';
import type { Decision, Idempotency } from './types';

/** One upstream's hedging, as retryd served it. */
export interface Hedging {
  upstream: string;
  enabled: boolean;
  /** Wait this long after sending before asking for a hedge. */
  delayMs: number;
  maxHedges: number;
  /** The idempotency levels the policy hedges (never NON_IDEMPOTENT). */
  idempotency: ReadonlySet<Idempotency | 'UNSPECIFIED'>;
}

export function hedgingFromPb(message: Hedging__Output): Hedging {
  const delay = message.delay;
  return {
    upstream: message.upstream,
    enabled: message.enabled,
    delayMs: delay === null ? 0 : Number(delay.seconds) * 1000 + delay.nanos / 1e6,
    maxHedges: message.maxHedges,
    idempotency: new Set(
      message.idempotency.map((level) =>
        typeof level === 'string' && level.startsWith('IDEMPOTENCY_') ? (level.slice(12) as Idempotency) : 'UNSPECIFIED',
      ),
    ),
  };
}

/**
 * Hedging while retryd is unreachable (the `localHedging` client option;
 * default none): a fixed delay is a guess, and one that is too short doubles
 * the load on a slow upstream, so it is opt-in and paid from a local bucket
 * that earns `maxExtraLoad` tokens per first attempt (default 0.05, the
 * issue's 5% cap) up to `capacity` (default 10); a hedge spends one. Only
 * SAFE and IDEMPOTENT calls are hedged locally.
 */
export interface LocalHedging {
  delayMs: number;
  maxHedges?: number;
  maxExtraLoad?: number;
  capacity?: number;
}

/** How to hedge one call. */
export interface HedgePlan {
  delayMs: number;
  maxHedges: number;
  /** The local fallback's fixed delay (retryd unreachable). */
  local: boolean;
}

const LOCAL_LEVELS = new Set<string>(['SAFE', 'IDEMPOTENT']);

function levelName(idempotency: Idempotency | number): string {
  if (typeof idempotency === 'string') return idempotency;
  return ['UNSPECIFIED', 'SAFE', 'IDEMPOTENT', 'IDEMPOTENT_WITH_KEY', 'NON_IDEMPOTENT'][idempotency] ?? 'UNSPECIFIED';
}

/** Per upstream, the latest hedging retryd served, with its age; and the local fallback's bucket. */
export class HedgingTable {
  /** True from a failed report or hedge decision until the next answered report. */
  unreachable = false;
  private readonly entries = new Map<string, { hedging: Hedging; seen: number }>();
  private tokens = 0;
  readonly local: Required<LocalHedging> | null;

  constructor(
    readonly keepForMs: number,
    local: LocalHedging | null = null,
    private readonly now: () => number = () => performance.now(),
  ) {
    if (local !== null) {
      if (!(local.delayMs > 0)) throw new RangeError(`localHedging.delayMs: must be positive, got ${local.delayMs}`);
      const maxExtraLoad = local.maxExtraLoad ?? 0.05;
      if (!(maxExtraLoad >= 0 && maxExtraLoad <= 1)) throw new RangeError(`localHedging.maxExtraLoad: must be within 0..1, got ${maxExtraLoad}`);
      this.local = { delayMs: local.delayMs, maxHedges: local.maxHedges ?? 1, maxExtraLoad, capacity: local.capacity ?? 10 };
    } else {
      this.local = null;
    }
  }

  /** Takes one report response's entries; drops those too old to trust. */
  update(served: Iterable<Hedging>): void {
    const now = this.now();
    this.unreachable = false;
    for (const hedging of served) this.entries.set(hedging.upstream, { hedging, seen: now });
    // Bounded by the upstreams reported within keepForMs, which the reporter's maxUpstreams bounds.
    for (const [upstream, entry] of this.entries) if (now - entry.seen > this.keepForMs) this.entries.delete(upstream);
  }

  /** The upstream's hedging, if retryd served it within keepForMs. */
  current(upstream: string): Hedging | undefined {
    const entry = this.entries.get(upstream);
    if (entry === undefined || this.now() - entry.seen > this.keepForMs) return undefined;
    return entry.hedging;
  }

  /** How to hedge a call now: retryd's delay, the local fallback's, or undefined (do not). */
  plan(upstream: string, idempotency: Idempotency | number): HedgePlan | undefined {
    const level = levelName(idempotency);
    const served = this.current(upstream);
    if (served !== undefined) {
      const allowed =
        served.enabled && served.delayMs > 0 && served.maxHedges >= 1 && level !== 'NON_IDEMPOTENT' && served.idempotency.has(level as Idempotency);
      return allowed ? { delayMs: served.delayMs, maxHedges: served.maxHedges, local: false } : undefined;
    }
    if (this.local !== null && this.unreachable && LOCAL_LEVELS.has(level)) {
      return { delayMs: this.local.delayMs, maxHedges: this.local.maxHedges, local: true };
    }
    return undefined;
  }

  /** Counts a first attempt toward the local fallback's hedge tokens. */
  firstAttempt(): void {
    if (this.local !== null) this.tokens = Math.min(this.local.capacity, this.tokens + this.local.maxExtraLoad);
  }

  /** Spends one local hedge token; false when none is left. */
  spendLocal(): boolean {
    if (this.local === null || this.tokens < 1) return false;
    this.tokens -= 1;
    return true;
  }
}

/** What the fallback answers to a hedge while retryd is unreachable. */
export function localHedgeDecision(table: HedgingTable, hedge: number, idempotency: Idempotency | number, deadlineRemainingMs: number | undefined, reason: string): Decision {
  const answer = (verdict: 'RETRY' | 'DENY', denyReason: Decision['denyReason'], why: string): Decision => ({
    verdict,
    backoffMs: 0,
    denyReason,
    refreshCredentials: false,
    rule: 0,
    effectiveEvidence: 'UNSPECIFIED',
    evidenceAdjusted: false,
    decisionId: '',
    tokensRemaining: NaN,
    explanation: `${reason}; local hedging: ${why}`,
    fallback: true,
    shadow: false,
    retrydDecision: null,
    unknownOutcome: 'NONE',
  });
  const local = table.local;
  if (local === null) return answer('DENY', 'HEDGING_OFF', 'not configured');
  if (!LOCAL_LEVELS.has(levelName(idempotency))) return answer('DENY', 'HEDGING_OFF', 'only SAFE and IDEMPOTENT calls are hedged locally');
  if (hedge > local.maxHedges) return answer('DENY', 'HEDGING_OFF', `hedge ${hedge} beyond ${local.maxHedges}`);
  if (deadlineRemainingMs !== undefined && deadlineRemainingMs <= 0) return answer('DENY', 'DEADLINE', 'the deadline has passed');
  if (!table.spendLocal()) return answer('DENY', 'HEDGE_CAP', 'no local hedge token left');
  return answer('RETRY', null, `hedge ${hedge} after ${local.delayMs} ms`);
}

/** What a hedged round ended with. */
export interface HedgeRound<R> {
  result: R;
  /** The copy that produced it: 0 the first attempt, k the k-th hedge. */
  copy: number;
  /** Copies sent, the first included. */
  sent: number;
  /** retryd's answers to the hedge requests, in order. */
  decisions: Decision[];
}

export interface HedgeRace<R> {
  plan: HedgePlan;
  /** Sends copy k; `signal` aborts it when another copy wins. */
  startCopy(copy: number, signal: AbortSignal): Promise<R>;
  /** Whether a copy's result ends the call (not a retryable failure). */
  isFinal(result: R): boolean;
  /** Asks retryd for the k-th hedge. */
  ask(hedge: number): Promise<Decision>;
  /** A copy answered (win or failure), after `elapsedMs`. */
  onEnd(copy: number, result: R, elapsedMs: number): void;
  /** The first attempt was cancelled because a hedge won, after `elapsedMs`. */
  onFirstCancelled(elapsedMs: number): void;
  /** What is left of the caller's deadline (undefined: none). */
  remaining(): number | undefined;
  now?: () => number;
}

/** Races copies of a call as the module doc says. Rejects when a copy rejects (the caller aborted). */
export function runHedged<R>(race: HedgeRace<R>): Promise<HedgeRound<R>> {
  const now = race.now ?? (() => performance.now());
  return new Promise<HedgeRound<R>>((resolve, reject) => {
    const running = new Map<number, { controller: AbortController; started: number }>();
    const decisions: Decision[] = [];
    let sent = 0;
    let hedging = race.plan.maxHedges >= 1;
    let settled = false;
    let timer: NodeJS.Timeout | undefined;

    const settle = (): void => {
      settled = true;
      clearTimeout(timer);
      const at = now();
      for (const [copy, entry] of running) {
        if (copy === 0) race.onFirstCancelled(at - entry.started);
        entry.controller.abort(new DOMException('a hedge of this call answered first', 'AbortError'));
      }
      running.clear();
    };
    const arm = (): void => {
      if (hedging && !settled) timer = setTimeout(fire, race.plan.delayMs);
    };
    const launch = (): void => {
      const copy = sent++;
      const controller = new AbortController();
      running.set(copy, { controller, started: now() });
      race.startCopy(copy, controller.signal).then(
        (result) => ended(copy, result),
        (error: unknown) => {
          if (settled || !running.has(copy)) return; // a loser we aborted
          settle();
          reject(error);
        },
      );
    };
    const ended = (copy: number, result: R): void => {
      const entry = running.get(copy);
      if (settled || entry === undefined) return;
      running.delete(copy);
      race.onEnd(copy, result, now() - entry.started);
      if (race.isFinal(result)) {
        settle();
        resolve({ result, copy, sent, decisions });
        return;
      }
      if (running.size === 0) {
        // Every copy failed: the normal retry path decides about the last.
        settle();
        resolve({ result, copy, sent, decisions });
      }
    };
    const fire = (): void => {
      timer = undefined;
      if (settled || running.size === 0) return;
      const left = race.remaining();
      if (left !== undefined && left <= 0) {
        hedging = false;
        return;
      }
      race.ask(sent).then(
        (decision) => {
          decisions.push(decision);
          if (settled) return;
          if (decision.verdict === 'RETRY' && running.size > 0) {
            launch();
            hedging = sent <= race.plan.maxHedges;
            arm();
          } else {
            hedging = false;
          }
        },
        () => {
          // retryd refused or could not answer and no local hedging decided:
          // the call goes on unhedged.
          hedging = false;
        },
      );
    };
    launch();
    arm();
  });
}
