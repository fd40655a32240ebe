// wsinfer browser client: protocol v1 over the browser's own WebSocket.
//
// Dependency-free ES module, no build step; published on npm as
// `wsinfer-client` (types in wsinfer.d.ts) and served by wsinfer at
// /static/wsinfer.js:
//
//   import { WsinferClient } from "wsinfer-client";
//   const client = new WsinferClient();              // ws(s)://<page host>/v1/ws
//   const turn = client.generate({ prompt: "Hi", params: { max_new_tokens: 64 } });
//   for await (const text of turn) out.append(text);
//
// A turn is also an EventTarget (`delta`, `paused`, `done`, `error`); the client
// emits connection events (`connecting`, `open`, `reconnecting`, `resumed`,
// `closed`). Session id, token, turn number, last applied seq and the text so
// far live in sessionStorage (or the `storage` you pass), so a reload
// continues the answer (`restoreTurn`).
//
// The contract is the Python client's (clients/protocol.py): requests carry
// ids; a `generate` carries a random `idempotency_key` and is re-sent, same id
// and key, until it is answered, so a drop before its answer never starts a
// second turn; after a drop the client repeats stop, resumes from the last
// applied seq, then repeats pause; `status` is what the server's `session`
// answer and events say. Codes and types come from contract.js, generated from
// wsinfer/contract.py.

import {
  CLIENT_MESSAGES,
  ClientErrorCode,
  ClientMessageType as Send,
  ERROR_CLASSES,
  ErrorCode,
  FinishReason,
  IDEMPOTENCY_KEY_HEX,
  ServerMessageType,
  Subprotocol,
  TurnStatus,
} from "./contract.js";

export { ClientErrorCode, ErrorCode };

export const PROTOCOL_VERSION = 1;
export const SUBPROTOCOL = Subprotocol.JSON;

/** A refusal or failure reported by the server (or the transport). */
export class WsinferError extends Error {
  constructor(code, message, { retryAfter = null, session = null, id = null } = {}) {
    super(message || code);
    this.name = "WsinferError";
    this.code = code;
    // Both spellings: `retry_after` matches the wire, `retryAfter` the JS habit.
    this.retryAfter = retryAfter;
    this.retry_after = retryAfter;
    this.session = session;
    this.id = id;
  }

  /** "request" or "service" for a code the server sends, else null
   * (docs/protocol.md "Error codes", the same table as the Python client's). */
  get fault() {
    return ERROR_CLASSES[this.code]?.fault ?? null;
  }

  /** Whether the same request, sent again later, may succeed (a lost
   * connection may: the turn may still run). */
  get retryable() {
    if (this.code === ClientErrorCode.CONNECTION_LOST) return true;
    return ERROR_CLASSES[this.code]?.retryable ?? false;
  }

  static fromMessage(msg) {
    return new WsinferError(msg.code || ErrorCode.INTERNAL, msg.message || msg.code, {
      retryAfter: msg.retry_after ?? null,
      session: msg.session ?? null,
      id: msg.id ?? null,
    });
  }
}

function idempotencyKey() {
  const bytes = new Uint8Array(IDEMPOTENCY_KEY_HEX / 2);
  globalThis.crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// Client-only statuses around the server's TurnStatus: "starting" (no answer
// yet) and "error" (failed here, whatever the server did).
const STARTING = "starting";
const FAILED = "error";
const LIVE = new Set([STARTING, TurnStatus.QUEUED, TurnStatus.RUNNING]);

function event(type, detail) {
  return new CustomEvent(type, { detail });
}

function defaultUrl() {
  const loc = globalThis.location;
  if (!loc || !loc.host) throw new TypeError("WsinferClient: no page location, pass {url}");
  return `${loc.protocol === "https:" ? "wss:" : "ws:"}//${loc.host}/v1/ws`;
}

function memoryStorage() {
  const data = new Map();
  return {
    getItem: (k) => (data.has(k) ? data.get(k) : null),
    setItem: (k, v) => data.set(k, String(v)),
    removeItem: (k) => data.delete(k),
  };
}

function defaultStorage() {
  try {
    const s = globalThis.sessionStorage;
    s.getItem("wsinfer-probe");
    return s;
  } catch {
    return memoryStorage(); // storage disabled (privacy mode, sandboxed frame)
  }
}

/**
 * One turn of a conversation: an async iterator of text deltas and an
 * EventTarget. `status` is one of starting, queued, running, paused, done,
 * error: the server's word, except starting (not answered yet) and error.
 */
export class WsinferTurn extends EventTarget {
  constructor(client, { text = "", seq = 0, turn = null, status = STARTING } = {}) {
    super();
    this.client = client;
    this.turn = turn;
    this.session = client.session;
    this.status = status;
    this.seq = seq;
    this.finishReason = null;
    this.usage = null;
    this.error = null;
    this.startedAt = performance.now();
    this.firstDeltaAt = null;
    this._chunks = text ? [text] : [];
    // With params.logprobs: each token's entry received by this page (a turn restored
    // after a reload starts with none for the text it already had).
    this.logprobs = [];
    // With params.tools: each call received by this page, in order.
    this.toolCalls = [];
    this._wakers = [];
    this._endSeq = 0; // the seq of the `done` applied (past `seq` if its last tokens had no text)
    // A `continue` not yet answered: the end it went on from, so that a refusal
    // restores it and a replay after a reconnect tells whether it was applied.
    this._continued = null;
    this._continueRepeated = false; // sent again on a fresh connection
    this.finished = new Promise((resolve, reject) => {
      this._resolve = resolve;
      this._reject = reject;
    });
    this.finished.catch(() => {}); // a caller that only listens to events must not see unhandled rejections
  }

  /** The whole text received so far. */
  get text() {
    return this._chunks.join("");
  }

  get active() {
    return LIVE.has(this.status) || this.status === TurnStatus.PAUSED;
  }

  /** Whether a fresh connection re-joins it: the Python client's rule
   * (docs/protocol.md "Clients"; tests/clients/rejoin_cases.json holds both).
   * A turn last seen paused is left paused, whoever paused it, unless the
   * caller asked to stop it. */
  get live() {
    if (this.status === TurnStatus.PAUSED) return this.client._asked(this, Send.STOP);
    return LIVE.has(this.status);
  }

  /** Send a control of the turn (contract.js `CLIENT_MESSAGES`): one answered
   * `session` (a resume) follows the turn again from the last applied seq. */
  control(type) {
    if (CLIENT_MESSAGES[type]?.rejoins) this.client._resumeTurn(this, false, type);
    else this.client._control(this, type);
  }

  /** End the turn now; it finishes with `done`, finishReason "cancelled". */
  stop() {
    if (!this.active) return;
    this.control(Send.STOP);
  }

  /** Halt generation but keep the turn; answered by a `paused` event. */
  pause() {
    if (!this.live) return;
    this.control(Send.PAUSE);
  }

  /** Extend a turn that ended with finishReason "length" by as many tokens again:
   * the same turn goes on (status queued, then deltas), and `finished` is a new
   * promise for its next `done`. Anything else is refused (an `error` event). */
  continue() {
    if (this.status !== TurnStatus.DONE || this._continued) return;
    // Followed again at once (queued), so that a connection that drops before
    // the answer re-joins the turn: the Python client's rule too.
    this._continued = { seq: this._endSeq, finishReason: this.finishReason, usage: this.usage };
    this._reopen(TurnStatus.QUEUED);
    this.control(Send.CONTINUE);
  }

  /** The `continue` was refused: the turn ended as it had. */
  _undoContinue() {
    const end = this._continued;
    this._continueWentOn();
    if (!end || this.status === FAILED) return;
    Object.assign(this, { status: TurnStatus.DONE, finishReason: end.finishReason, usage: end.usage, _endSeq: end.seq });
    this._resolve({ text: this.text, seq: this.seq, finishReason: end.finishReason, usage: end.usage });
    this._wake();
  }

  /** Whether `msg` is the very end an unanswered `continue` went on from,
   * replayed after a reconnect: that continue was lost with its connection. */
  _continuedEnd(msg) {
    const end = this._continued;
    return end !== null && msg.seq <= end.seq && msg.finish_reason === end.finishReason;
  }

  /** An event past the end a `continue` went on from: the server applied it. */
  _passed(seq) {
    if (this._continued && seq > this._continued.seq) this._continueWentOn();
  }

  /** The server applied the `continue`: nothing of it to restore or repeat. */
  _continueWentOn() {
    this._continued = null;
    this._continueRepeated = false;
  }

  _reopen(status) {
    this.status = status;
    this.finishReason = null;
    this.usage = null;
    this.finished = new Promise((resolve, reject) => {
      this._resolve = resolve;
      this._reject = reject;
    });
    this.finished.catch(() => {});
    this._wake();
  }

  /** Continue a paused turn (or re-attach after anything): no gap, no repeat. */
  resume() {
    if (!this.active) return;
    if (this.status === TurnStatus.PAUSED) this.status = TurnStatus.RUNNING; // the server continues it
    this.control(Send.RESUME);
  }

  [Symbol.asyncIterator]() {
    let index = 0;
    const next = async () => {
      for (;;) {
        if (index < this._chunks.length) return { value: this._chunks[index++], done: false };
        if (this.status === FAILED) throw this.error;
        if (this.status === TurnStatus.DONE) return { value: undefined, done: true };
        await new Promise((wake) => this._wakers.push(wake));
      }
    };
    return { next, return: async () => ({ value: undefined, done: true }), [Symbol.asyncIterator]() { return this; } };
  }

  _wake() {
    const wakers = this._wakers;
    this._wakers = [];
    for (const wake of wakers) wake();
  }

  _applyDelta(seq, text, logprobs, toolCalls, toolCallParts) {
    if (seq <= this.seq) return false; // already applied: a replay after resume
    const now = performance.now();
    if (this.firstDeltaAt === null) this.firstDeltaAt = now;
    this.seq = seq;
    if (text) this._chunks.push(text);
    if (logprobs) this.logprobs.push(...logprobs);
    if (toolCalls) this.toolCalls.push(...toolCalls);
    this.status = TurnStatus.RUNNING; // a delta is the server saying so
    const detail = { text, seq, time: now };
    if (logprobs) detail.logprobs = logprobs;
    if (toolCalls) detail.toolCalls = toolCalls;
    // A call's arguments as they are drawn; its whole comes in toolCalls.
    if (toolCallParts) detail.toolCallParts = toolCallParts;
    this.dispatchEvent(event("delta", detail));
    this._wake();
    return true;
  }

  _setPaused(seq) {
    if (!this.active) return;
    this.status = TurnStatus.PAUSED;
    this.dispatchEvent(event("paused", { seq: seq ?? this.seq }));
  }

  _finish(msg) {
    if (!this.active) return;
    this.finishReason = msg.finish_reason ?? null;
    this.usage = msg.usage ?? null;
    this._endSeq = msg.seq ?? this.seq;
    if (this.finishReason === FinishReason.ERROR) {
      const err = msg.error || {};
      this._fail(new WsinferError(err.code || ErrorCode.INTERNAL, err.message, { session: msg.session }), msg);
      return;
    }
    this.status = TurnStatus.DONE;
    const detail = { text: this.text, seq: this.seq, finishReason: this.finishReason, usage: this.usage };
    this.dispatchEvent(event("done", detail));
    this._resolve(detail);
    this._wake();
  }

  _fail(error, doneMsg = null) {
    if (!this.active) return;
    this.status = FAILED;
    this.error = error;
    const ev = new ErrorEvent("error", { error, message: error.message });
    ev.fatal = true;
    this.dispatchEvent(ev);
    if (doneMsg) {
      this.dispatchEvent(event("done", { text: this.text, seq: this.seq, finishReason: FinishReason.ERROR, usage: this.usage, error }));
    }
    this._reject(error);
    this._wake();
  }

  /** A refused control request (e.g. stop of a turn that just ended): the turn goes on. */
  _warn(error) {
    const ev = new ErrorEvent("error", { error, message: error.message });
    ev.fatal = false;
    this.dispatchEvent(ev);
  }
}

/**
 * A protocol v1 client. Options: url (default: /v1/ws on the page's host),
 * token (API key, sent as ?token=), storage (default sessionStorage),
 * storageKey, minDelay/maxDelay (reconnect backoff, ms), maxAttempts,
 * WebSocket (constructor, for tests).
 */
export class WsinferClient extends EventTarget {
  constructor(options = {}) {
    super();
    this.url = options.url || defaultUrl();
    this.apiKey = options.token ?? null;
    this.storage = options.storage || defaultStorage();
    this.storageKey = options.storageKey || "wsinfer";
    this.minDelay = options.minDelay ?? 250;
    this.maxDelay = options.maxDelay ?? 10000;
    this.maxAttempts = options.maxAttempts ?? Infinity;
    this._WebSocket = options.WebSocket || globalThis.WebSocket;
    this.state = "idle"; // idle, connecting, open, reconnecting, closed
    this.session = null;
    this.sessionToken = null;
    this.currentTurn = null;
    this._ws = null;
    this._queue = [];
    this._pending = new Map(); // request id -> {type, turn}
    this._announce = new Set(); // ids of restoring resumes
    this._nextId = 1;
    this._idPrefix = Math.random().toString(36).slice(2, 8);
    this._attempt = 0;
    this._timer = null;
    this._everOpened = false;
    this._load();
  }

  // ---- public API ---------------------------------------------------------

  /** Open the connection now rather than at the first request (shows state early). */
  connect() {
    this._ensureSocket();
  }

  /** Start a turn. Later calls add turns to the same session. */
  generate({ messages, prompt, params } = {}) {
    if (this.currentTurn && this.currentTurn.active) {
      throw new WsinferError(ErrorCode.CONFLICT, "a turn is still running; stop it first");
    }
    const msg = { type: Send.GENERATE, idempotency_key: idempotencyKey() };
    if (messages !== undefined) msg.messages = messages;
    if (prompt !== undefined) msg.prompt = prompt;
    if (params && Object.keys(params).length) msg.params = params;
    const turn = new WsinferTurn(this);
    this.currentTurn = turn;
    turn._request = msg;
    this._request(msg, turn);
    return turn;
  }

  /**
   * The turn that was in flight when the page was last unloaded, continued
   * from the last applied seq (or left paused), or null if there is none.
   */
  restoreTurn() {
    const s = this._saved;
    if (!s || !s.session || s.turn == null || !s.status) return null;
    if (this.currentTurn) return this.currentTurn;
    const status = s.status === TurnStatus.PAUSED ? TurnStatus.PAUSED : TurnStatus.RUNNING;
    const turn = new WsinferTurn(this, { text: s.text || "", seq: s.seq || 0, turn: s.turn, status });
    this.currentTurn = turn;
    if (turn.live) this._resumeTurn(turn, true);
    else this._ensureSocket();
    return turn;
  }

  /**
   * Drop the connection but keep the session, here and on the server: a later
   * client with the same storage resumes it (`restoreTurn`, or the next
   * `generate` adds a turn). A running turn keeps generating server-side;
   * its turn object here gets nothing more: `restoreTurn()` (on this client
   * or a new one) continues it from the last applied seq.
   */
  disconnect() {
    if (this.currentTurn && this.currentTurn.active) this._save();
    this.currentTurn = null;
    this._disconnect();
  }

  /** End the session (deleting its state on the server) and the connection. */
  close() {
    if (this.currentTurn && this.currentTurn.active) {
      this.currentTurn._fail(new WsinferError(ClientErrorCode.CLIENT_CLOSED, "the session was closed"));
    }
    if (this.session && this._ws && this._ws.readyState === 1) {
      this._ws.send(JSON.stringify({ type: Send.CLOSE, session: this.session, token: this.sessionToken }));
    }
    this.session = this.sessionToken = null;
    this.currentTurn = null;
    this._saved = null;
    this.storage.removeItem(this.storageKey);
    this._disconnect();
  }

  // ---- requests -----------------------------------------------------------

  _newId() {
    return `${this._idPrefix}-${this._nextId++}`;
  }

  _request(msg, turn) {
    msg.id ??= this._newId();
    if (msg.type === Send.GENERATE && this.session) {
      msg.session = this.session;
      msg.token = this.sessionToken;
    }
    this._pending.set(msg.id, { type: msg.type, turn, msg });
    this._send(msg);
  }

  _control(turn, type) {
    if (turn.status === STARTING && turn.turn == null) {
      turn._deferred = type; // sent once the server has told us the session
      return;
    }
    this._request({ type, session: this.session, token: this.sessionToken }, turn);
  }

  /** Whether the caller asked `type` (a control) of the turn, not answered yet. */
  _asked(turn, type) {
    if (turn._deferred === type) return true;
    for (const p of this._pending.values()) if (p.turn === turn && p.type === type) return true;
    return false;
  }

  _resumeTurn(turn, restoring = false, type = Send.RESUME) {
    if (!this.session) return;
    const msg = { type, session: this.session, token: this.sessionToken, after: turn.seq };
    if (turn.turn != null) msg.turn = turn.turn;
    if (restoring) this._announce.add(msg.id = this._newId()); // say "resumed" once it is sent
    this._request(msg, turn);
  }

  _send(msg) {
    if (this._ws && this._ws.readyState === 1 && this.state === "open") {
      this._ws.send(JSON.stringify(msg));
    } else {
      this._queue.push(msg);
      this._ensureSocket();
    }
  }

  // ---- connection ---------------------------------------------------------

  _socketUrl() {
    if (!this.apiKey) return this.url;
    const u = new URL(this.url, globalThis.location?.href);
    u.searchParams.set("token", this.apiKey);
    return u.toString();
  }

  _setState(state, detail = {}) {
    this.state = state;
    this.dispatchEvent(event(state, detail));
  }

  _ensureSocket() {
    if (this._ws || this._timer) return;
    this._connect();
  }

  _connect() {
    this._timer = null;
    if (!this._everOpened) this._setState("connecting", { attempt: this._attempt });
    else if (this.state !== "reconnecting") this._setState("reconnecting", { attempt: this._attempt, delay: 0 });
    let ws;
    try {
      ws = new this._WebSocket(this._socketUrl(), SUBPROTOCOL);
    } catch (err) {
      this._dispatchClientError(new WsinferError(ClientErrorCode.CONNECTION_LOST, `cannot open ${this.url}: ${err.message}`));
      this._setState("closed", { code: 0, reason: err.message, willReconnect: false });
      return;
    }
    this._ws = ws;
    ws.onopen = () => this._onOpen(ws);
    ws.onmessage = (ev) => this._onMessage(ev);
    ws.onclose = (ev) => this._onClose(ws, ev);
    ws.onerror = () => {}; // always followed by close, which decides what to do
  }

  _onOpen(ws) {
    if (ws !== this._ws) return;
    const reconnected = this._everOpened;
    this._everOpened = true;
    this._attempt = 0;
    this._setState("open", { reconnected });
    // The order of the Python client's rejoin: unanswered generates and stops,
    // then the live turn's resume (so the controls after it act on a followed
    // session, and a stop goes out before a resume could un-pause), then pauses.
    const queue = this._queue;
    this._queue = [];
    const early = (m) => m.type === Send.GENERATE || m.type === Send.STOP;
    const send = (m) => ws.send(JSON.stringify(m));
    queue.filter(early).forEach(send);
    let resumed = reconnected ? this._rejoin(ws) : null;
    for (const msg of queue.filter((m) => !early(m))) {
      if (msg.type === Send.RESUME && resumed) {
        this._pending.delete(msg.id); // just sent a fresher one: this one is never answered
        continue;
      }
      send(msg);
      if (this._announce.delete(msg.id)) {
        resumed = { session: msg.session, turn: msg.turn ?? null, after: msg.after, restored: true };
      }
    }
    if (resumed) this.dispatchEvent(event("resumed", resumed));
  }

  /** Resume the live turn from the last applied seq on a fresh connection. */
  _rejoin(ws) {
    const turn = this.currentTurn;
    if (!turn || !turn.live || !this.session || turn.turn == null) return null;
    const msg = { type: Send.RESUME, session: this.session, token: this.sessionToken, after: turn.seq, turn: turn.turn };
    msg.id = this._newId();
    this._pending.set(msg.id, { type: Send.RESUME, turn, msg });
    ws.send(JSON.stringify(msg));
    return { session: this.session, turn: turn.turn, after: turn.seq };
  }

  _onClose(ws, ev) {
    if (ws !== this._ws) return;
    this._ws = null;
    // Requests sent on the dead socket: generate is re-sent as it was (same id
    // and idempotency key: the server answers the turn it may have started),
    // controls are re-sent, resume is rebuilt from the current seq on open.
    for (const [id, p] of this._pending) {
      if (this._queue.includes(p.msg)) continue; // never sent: goes out as it is
      // A resume (or a continue: its turn is followed again) is rebuilt on open.
      if (CLIENT_MESSAGES[p.type]?.rejoins || !p.turn.active) this._pending.delete(id);
      else this._queue.push(p.msg); // unanswered (its answer may be lost): ask again
    }
    if (this.state === "closed") return;
    const wanted = this._queue.length > 0 || (this.currentTurn && this.currentTurn.live);
    if (!wanted || this._attempt >= this.maxAttempts) {
      this._setState("closed", { code: ev.code, reason: ev.reason, willReconnect: false });
      if (this._attempt >= this.maxAttempts && this.currentTurn) {
        const lost = new WsinferError(ClientErrorCode.CONNECTION_LOST, "connection lost; gave up reconnecting");
        this.currentTurn._fail(lost);
      }
      return;
    }
    const delay = this._backoff(this._attempt++);
    this._setState("reconnecting", { attempt: this._attempt, delay, code: ev.code });
    this._timer = setTimeout(() => this._connect(), delay);
  }

  _backoff(attempt) {
    const base = Math.min(this.maxDelay, this.minDelay * 2 ** attempt);
    return Math.round(base / 2 + Math.random() * (base / 2)); // "equal jitter"
  }

  _disconnect() {
    clearTimeout(this._timer);
    this._timer = null;
    this._queue = [];
    this._pending.clear();
    const ws = this._ws;
    this._ws = null;
    this._everOpened = false;
    this._setState("closed", { code: 1000, reason: "closed by client", willReconnect: false });
    if (ws) ws.close(1000);
  }

  // ---- incoming -----------------------------------------------------------

  _onMessage(ev) {
    if (typeof ev.data !== "string") return; // we only asked for JSON
    let msg;
    try {
      msg = JSON.parse(ev.data);
    } catch {
      return;
    }
    if (!Object.values(ServerMessageType).includes(msg.type)) return; // a newer server's type
    this[`_on_${msg.type}`](msg);
  }

  _turnFor(msg) {
    const turn = this.currentTurn;
    if (!turn || msg.session !== this.session) return null;
    return msg.turn === turn.turn ? turn : null;
  }

  _on_session(msg) {
    const p = msg.id != null ? this._pending.get(msg.id) : null;
    if (p) this._pending.delete(msg.id);
    if (!p) return;
    const turn = p.turn;
    if (p.type !== Send.GENERATE) {
      // A resume answered with the turn's status; its replay follows.
      turn._refused = false;
      if (p.type === Send.CONTINUE && msg.status === TurnStatus.DONE) {
        turn._undoContinue(); // not applied: the turn stays as it ended
        return;
      }
      if (p.type === Send.CONTINUE || (msg.status && msg.status !== TurnStatus.DONE)) turn._continueWentOn();
      if (msg.status && turn.active && msg.status !== TurnStatus.DONE) turn.status = msg.status;
      // A done turn that went on (a continue): followed again until its next done.
      else if (msg.status && msg.status !== TurnStatus.DONE && turn.status === TurnStatus.DONE) turn._reopen(msg.status);
      return;
    }
    this.session = msg.session;
    this.sessionToken = msg.token;
    turn.session = msg.session;
    turn.turn = msg.turn;
    // The server's word; an older server says nothing, and a turn it answered is running.
    // "done" (a re-sent generate whose turn ended meanwhile) waits for the
    // replay's deltas and its `done`: a turn marked done here would drop them.
    if (turn.status === STARTING) {
      turn.status = msg.status && msg.status !== TurnStatus.DONE ? msg.status : TurnStatus.RUNNING;
    }
    this._save();
    turn.dispatchEvent(event("session", { session: msg.session, turn: msg.turn }));
    if (turn._deferred) this._control(turn, turn._deferred);
  }

  // Controls are answered by their effect, not by id: forget them once it shows.
  _settle(turn, types) {
    for (const [id, p] of this._pending) {
      if (p.turn === turn && types.includes(p.type)) this._pending.delete(id);
    }
  }

  // Until a resume is answered, the turn's events come from the feed it
  // replaces (the connection's earlier one, or one a stop attached at the
  // server's seq). A delta carries no start: applying one could skip text,
  // and the replay after the answer, merged from our seq, would repeat what
  // the old feed gave. The replay restates it all, so these are dropped, and
  // after a refused resume too, until one is answered.
  _restarting(turn) {
    if (turn._refused) return true; // events since were dropped: wait for a replay
    for (const p of this._pending.values()) {
      if (p.turn === turn && CLIENT_MESSAGES[p.type]?.rejoins) return true;
    }
    return false;
  }

  _on_delta(msg) {
    const turn = this._turnFor(msg);
    if (!turn || !turn.active || this._restarting(turn)) return;
    turn._passed(msg.seq);
    const applied = turn._applyDelta(
      msg.seq, msg.text, msg.logprobs, msg.tool_calls, msg.tool_call_parts,
    );
    if (applied) this._save();
  }

  _on_paused(msg) {
    const turn = this._turnFor(msg);
    if (!turn || this._restarting(turn)) return;
    this._settle(turn, [Send.PAUSE]);
    turn._setPaused(msg.seq);
    this._save();
  }

  _on_done(msg) {
    const turn = this._turnFor(msg);
    if (!turn || this._restarting(turn)) return;
    if (turn._continuedEnd(msg)) {
      // The continue was lost with its connection: ask again.
      turn._continueRepeated = true;
      this._resumeTurn(turn, false, Send.CONTINUE);
      return;
    }
    turn._passed(msg.seq);
    this._settle(turn, [Send.PAUSE, Send.STOP]);
    turn._finish(msg);
    this._save();
  }

  _on_error(msg) {
    const error = WsinferError.fromMessage(msg);
    const p = msg.id != null ? this._pending.get(msg.id) : null;
    if (p) this._pending.delete(msg.id);
    if (!p) return this._dispatchClientError(error);
    const turn = p.turn;
    if (p.type === Send.CONTINUE && turn._continueRepeated && error.code === ErrorCode.CONFLICT) {
      // The first one was applied after all (a continue is applied once): follow it.
      turn._continueWentOn();
      this._resumeTurn(turn);
    } else if (p.type === Send.CONTINUE) {
      turn._undoContinue();
      turn._warn(error);
    } else if (p.type === Send.GENERATE) {
      turn._fail(error);
    } else if (p.type === Send.RESUME && error.code === ErrorCode.NOT_FOUND) {
      this.session = this.sessionToken = null; // expired or closed: start afresh next time
      turn._fail(error);
    } else if (p.type === Send.RESUME) {
      // Refused (e.g. over the request rate): the events dropped while it was
      // pending are missing here, so ask again once the server allows it.
      turn._refused = true;
      turn._warn(error);
      this._retryResume(turn, error.retryAfter);
    } else {
      turn._warn(error);
    }
    this._save();
  }

  _retryResume(turn, retryAfter) {
    const delay = retryAfter != null ? retryAfter * 1000 : this.minDelay;
    setTimeout(() => {
      if (turn === this.currentTurn && turn.active && turn.status !== TurnStatus.PAUSED) this._resumeTurn(turn);
    }, delay);
  }

  _dispatchClientError(error) {
    const ev = new ErrorEvent("error", { error, message: error.message });
    this.dispatchEvent(ev);
  }

  // ---- persistence ----------------------------------------------------------

  _load() {
    let saved = null;
    try {
      saved = JSON.parse(this.storage.getItem(this.storageKey) || "null");
    } catch {
      saved = null;
    }
    this._saved = saved;
    if (saved && saved.session && saved.url === this.url) {
      this.session = saved.session;
      this.sessionToken = saved.token;
    } else {
      this._saved = null;
    }
  }

  _save() {
    const turn = this.currentTurn;
    const state = { url: this.url, session: this.session, token: this.sessionToken };
    if (turn && turn.turn != null && turn.active) {
      Object.assign(state, { turn: turn.turn, seq: turn.seq, text: turn.text, status: turn.status });
    }
    this._saved = state;
    try {
      this.storage.setItem(this.storageKey, JSON.stringify(state));
    } catch {
      // quota: the live session still works, only a reload would lose it
    }
  }
}

export default WsinferClient;
