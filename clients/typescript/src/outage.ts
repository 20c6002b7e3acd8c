/**
 * One warning per outage: a line when retryd stops answering, one when it
 * answers again, with how many times it failed in between. A busy caller
 * decides (and the reporter sends) far too often for a line per failure,
 * which would bury everything else in the log. Used by the client's
 * fallback and by the traffic reporter, each with its own instance.
 */
import type { Logger } from './reporter';

export class OutageLog {
  private failures = 0;
  private startedAt = 0;

  constructor(
    private readonly logger: Logger,
    /** The first line of an outage, from the failure that began it. */
    private readonly down: (detail: string) => string,
    /** The line when it is over: the failures counted and how long it lasted. */
    private readonly up: (failures: number, lastedMs: number) => string,
    private readonly now: () => number = Date.now,
  ) {}

  /** Whether the last call failed. */
  get inOutage(): boolean {
    return this.failures > 0;
  }

  /** Counts one failure; warns only for the first of an outage. */
  failed(detail: string): void {
    if (this.failures++ === 0) {
      this.startedAt = this.now();
      this.logger.warn(this.down(detail));
    }
  }

  /** Ends the outage, if there was one, with one line that says what it cost. */
  recovered(): void {
    if (this.failures === 0) return;
    const line = this.up(this.failures, this.now() - this.startedAt);
    this.failures = 0;
    if (this.logger.info) this.logger.info(line);
    else this.logger.warn(line);
  }
}
