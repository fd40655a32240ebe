// The chat page's live readout of an answer's speed: the time to its first token
// and its tokens per second. Gaps over a second (a pause, a reconnect, a reload)
// are not generation time.

export class SpeedReadout {
  constructor(ttft, tps) {
    this.ttft = ttft;
    this.tps = tps;
    this.reset(0);
  }

  /** An answer shown from `seq` on; `since`: when a Continue asked for more of it. */
  reset(seq, since = null) {
    Object.assign(this, { lastAt: null, lastSeq: seq, tokens: 0, active: 0, since });
    this.ttft.textContent = "–";
    this.tps.textContent = "–";
  }

  /** Turn `turn` reached `seq` at `time` (performance.now()). */
  delta(turn, seq, time) {
    if (this.lastAt !== null && time - this.lastAt < 1000) {
      this.active += time - this.lastAt;
      this.tokens += seq - this.lastSeq;
    }
    this.lastAt = time;
    this.lastSeq = seq;
    const [from, to] = this.since !== null ? [this.since, time] : [turn.startedAt, turn.firstDeltaAt];
    if (to !== null && this.ttft.textContent === "–" && !turn.restored) this.ttft.textContent = `${Math.round(to - from)} ms`;
    if (this.active > 0) this.tps.textContent = (this.tokens / (this.active / 1000)).toFixed(1);
  }
}
