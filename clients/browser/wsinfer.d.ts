// Type declarations for wsinfer-client (wsinfer.js), wsinfer protocol v1.

import type { ControlType } from "./contract.js";

/** The controls of a turn, as declared in wsinfer/contract.py (generated). */
export type { ControlType };

export declare const PROTOCOL_VERSION: 1;
export declare const SUBPROTOCOL: "wsinfer.v1.json";

/** Error codes the server reports (wsinfer/contract.py `ErrorCode`). */
export type ServerErrorCode =
  | "bad_request"
  | "unauthorized"
  | "not_found"
  | "conflict"
  | "too_large"
  | "overloaded"
  | "engine_unavailable"
  | "internal";

/** Codes the client raises itself, the same as the Python client's (`ClientErrorCode`). */
export type ClientErrorCode = "connection_lost" | "client_closed";

export type ErrorCode = ServerErrorCode | ClientErrorCode | (string & {});

export declare const ErrorCode: { readonly [name: string]: ServerErrorCode };
export declare const ClientErrorCode: { readonly [name: string]: ClientErrorCode };

export interface Message {
  role: "system" | "user" | "assistant" | "tool";
  /** May be null in an assistant message that carries tool_calls. */
  content: string | null;
  /** An assistant's calls, as a turn's toolCalls (index optional). */
  tool_calls?: (Omit<ToolCall, "index"> & { index?: number })[];
  /** A tool's result: the call it answers. */
  tool_call_id?: string;
}

/** Sampling parameters; unknown keys are refused by the server. */
export interface GenerateParams {
  max_new_tokens?: number;
  /** 0 is greedy. */
  temperature?: number;
  top_p?: number;
  top_k?: number;
  repetition_penalty?: number;
  /** OpenAI's: -2 to 2, once a token has appeared in this turn. */
  presence_penalty?: number;
  /** OpenAI's: -2 to 2, per appearance of a token in this turn. */
  frequency_penalty?: number;
  /** Locally typical sampling: (0, 1], 1 is off. */
  typical_p?: number;
  seed?: number;
  stop?: string[];
  /** The end-of-sequence token does not end the turn: it runs to max_new_tokens. */
  ignore_eos?: boolean;
  /** No end-of-sequence token before this many tokens (at most max_new_tokens). */
  min_tokens?: number;
  /** Each delta carries its tokens' log-probabilities (docs/protocol.md). */
  logprobs?: boolean;
  /** 0-20 most likely tokens beside each drawn one; needs logprobs. */
  top_logprobs?: number;
  /** Structured output: every draw is held to the format (docs/protocol.md). */
  response_format?: ResponseFormat;
  /** Tools the model may call (docs/protocol.md, "Tool calling"). */
  tools?: Tool[];
  tool_choice?: "none" | "auto" | "required" | { type: "function"; function: { name: string } };
  /** false: at most one call. */
  parallel_tool_calls?: boolean;
}

/** OpenAI's function tool. */
export interface Tool {
  type: "function";
  function: { name: string; description?: string; parameters?: object; strict?: boolean };
}

/** A call the model made, OpenAI's shape: `arguments` is JSON text. */
export interface ToolCall {
  index: number;
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

/**
 * A part of a call drawn (a turn held to its calls: tool_choice "required" or a
 * named function): `arguments` is the next piece of the call's arguments' JSON
 * text; a call's first part also has `type` and `function.name`. A call's pieces
 * joined are its `arguments` in the delta's toolCalls that completes it.
 */
export interface ToolCallPart {
  index: number;
  id: string;
  type?: "function";
  function: { name?: string; arguments: string };
}

/** OpenAI's response_format shapes. */
export type ResponseFormat =
  | { type: "text" }
  | { type: "json_object" }
  | {
      type: "json_schema";
      json_schema: { name: string; schema?: object; strict?: boolean; description?: string };
    };

/** One token's log-probability (OpenAI's chat shape). */
export interface TokenLogprob {
  token: string;
  logprob: number;
  bytes: number[];
  top_logprobs?: { token: string; logprob: number; bytes: number[] }[];
}

/** Either `messages` (chat) or `prompt` (raw text) starts a turn. */
export interface GenerateRequest {
  messages?: Message[];
  prompt?: string;
  params?: GenerateParams;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  cached_tokens: number;
}

export type FinishReason = "stop" | "length" | "cancelled" | "error" | "tool_calls";
/** The server's status, plus "starting" (not answered yet) and "error" (failed here). */
export type TurnStatus = "starting" | "queued" | "running" | "paused" | "done" | "error";
export type ConnectionState = "idle" | "connecting" | "open" | "reconnecting" | "closed";

/** Where the client keeps session id, token and the in-flight turn (a Web Storage subset). */
export interface StorageLike {
  getItem(key: string): string | null;
  setItem(key: string, value: string): void;
  removeItem(key: string): void;
}

export interface ClientOptions {
  /** Default: ws(s)://<page host>/v1/ws. */
  url?: string;
  /** API key, sent as ?token= (browsers cannot set handshake headers). */
  token?: string;
  /** Default: sessionStorage (an in-memory map where storage is disabled). */
  storage?: StorageLike;
  /** Key under which this client's state lives in `storage` (default "wsinfer"). */
  storageKey?: string;
  /** Reconnect backoff bounds in milliseconds (defaults 250 and 10000). */
  minDelay?: number;
  maxDelay?: number;
  /** Give up after this many failed reconnects (default: never). */
  maxAttempts?: number;
  /** A WebSocket constructor, for tests or non-browser runtimes. */
  WebSocket?: new (url: string, protocols?: string | string[]) => WebSocket;
}

export declare class WsinferError extends Error {
  constructor(
    code: ErrorCode,
    message?: string,
    extra?: { retryAfter?: number | null; session?: string | null; id?: string | number | null },
  );
  readonly name: "WsinferError";
  code: ErrorCode;
  /** "request" or "service" for a code the server sends (docs/protocol.md "Error codes"), else null. */
  readonly fault: "request" | "service" | null;
  /** Whether the same request, sent again later, may succeed. */
  readonly retryable: boolean;
  /** Seconds to wait before retrying (overloaded), both spellings. */
  retryAfter: number | null;
  retry_after: number | null;
  session: string | null;
  id: string | number | null;
  static fromMessage(msg: { code?: string; message?: string; retry_after?: number; session?: string; id?: string | number }): WsinferError;
}

export interface DeltaDetail {
  text: string;
  seq: number;
  time: number;
  logprobs?: TokenLogprob[];
  toolCalls?: ToolCall[];
  toolCallParts?: ToolCallPart[];
}
export interface PausedDetail { seq: number; }
export interface SessionDetail { session: string; turn: number; }
export interface DoneDetail {
  text: string;
  seq: number;
  finishReason: FinishReason | null;
  usage: Usage | null;
  error?: WsinferError;
}

/** An `error` event: `fatal` means the turn ended with it. */
export interface WsinferErrorEvent extends ErrorEvent {
  readonly error: WsinferError;
  fatal?: boolean;
}

export interface TurnEventMap {
  delta: CustomEvent<DeltaDetail>;
  paused: CustomEvent<PausedDetail>;
  session: CustomEvent<SessionDetail>;
  done: CustomEvent<DoneDetail>;
  error: WsinferErrorEvent;
}

/** One turn: an async iterable of text deltas and an EventTarget. */
export declare class WsinferTurn extends EventTarget implements AsyncIterable<string> {
  readonly client: WsinferClient;
  /** The turn number in its session, once the server has answered. */
  turn: number | null;
  session: string | null;
  status: TurnStatus;
  /** Tokens generated so far (the last applied delta's seq). */
  seq: number;
  finishReason: FinishReason | null;
  usage: Usage | null;
  error: WsinferError | null;
  /** performance.now() at creation and at the first delta. */
  startedAt: number;
  firstDeltaAt: number | null;
  /** Resolves with the `done` detail; rejects with a WsinferError. */
  readonly finished: Promise<DoneDetail>;
  /** The whole text received so far. */
  readonly text: string;
  /** With params.logprobs: the entries received by this page, in order. */
  logprobs: TokenLogprob[];
  /** With params.tools: the calls received by this page, in order. */
  toolCalls: ToolCall[];
  /** starting, running or paused. */
  readonly active: boolean;
  /** A control of the turn by its type (`stop`, `pause`, `resume`...). */
  control(type: ControlType): void;
  stop(): void;
  pause(): void;
  resume(): void;
  /**
   * Extend a turn that ended with finishReason "length" by its max_new_tokens
   * again: the same turn goes on (the same `turn` number and seq numbering, the
   * KV cache the server kept), status queued then running, its deltas appended
   * to `text`, then a new `done` event. `finished` is replaced by a promise
   * for that `done` once the server has answered (status queued): until then
   * it is the ended one's, so listen for `done`. Refused (an `error` event, the
   * turn left done) for a turn that ended otherwise or is not the session's
   * latest, and by a server without the `continue` message.
   */
  continue(): void;
  [Symbol.asyncIterator](): AsyncIterator<string>;
  addEventListener<K extends keyof TurnEventMap>(
    type: K,
    listener: (this: WsinferTurn, ev: TurnEventMap[K]) => unknown,
    options?: boolean | AddEventListenerOptions,
  ): void;
  addEventListener(type: string, listener: EventListenerOrEventListenerObject | null, options?: boolean | AddEventListenerOptions): void;
  removeEventListener<K extends keyof TurnEventMap>(
    type: K,
    listener: (this: WsinferTurn, ev: TurnEventMap[K]) => unknown,
    options?: boolean | EventListenerOptions,
  ): void;
  removeEventListener(type: string, listener: EventListenerOrEventListenerObject | null, options?: boolean | EventListenerOptions): void;
}

export interface ConnectingDetail { attempt: number; }
export interface OpenDetail { reconnected: boolean; }
export interface ReconnectingDetail { attempt: number; delay: number; code?: number; }
export interface ResumedDetail { session: string; turn: number | null; after: number; restored?: boolean; }
export interface ClosedDetail { code: number; reason: string; willReconnect: boolean; }

export interface ClientEventMap {
  connecting: CustomEvent<ConnectingDetail>;
  open: CustomEvent<OpenDetail>;
  reconnecting: CustomEvent<ReconnectingDetail>;
  resumed: CustomEvent<ResumedDetail>;
  closed: CustomEvent<ClosedDetail>;
  error: WsinferErrorEvent;
}

export declare class WsinferClient extends EventTarget {
  constructor(options?: ClientOptions);
  readonly url: string;
  state: ConnectionState;
  /** The session id once the server has started one. */
  session: string | null;
  currentTurn: WsinferTurn | null;
  /** Open the connection now rather than at the first request. */
  connect(): void;
  /** Start a turn; later calls add turns to the same session. Throws `conflict` while one runs. */
  generate(request?: GenerateRequest): WsinferTurn;
  /** The turn in flight when the page was last left, continued; null if none. */
  restoreTurn(): WsinferTurn | null;
  /** Drop the connection, keep the session (here and on the server) for a later resume. */
  disconnect(): void;
  /** End the session (its state on the server is deleted) and the connection. */
  close(): void;
  addEventListener<K extends keyof ClientEventMap>(
    type: K,
    listener: (this: WsinferClient, ev: ClientEventMap[K]) => unknown,
    options?: boolean | AddEventListenerOptions,
  ): void;
  addEventListener(type: string, listener: EventListenerOrEventListenerObject | null, options?: boolean | AddEventListenerOptions): void;
  removeEventListener<K extends keyof ClientEventMap>(
    type: K,
    listener: (this: WsinferClient, ev: ClientEventMap[K]) => unknown,
    options?: boolean | EventListenerOptions,
  ): void;
  removeEventListener(type: string, listener: EventListenerOrEventListenerObject | null, options?: boolean | EventListenerOptions): void;
}

export default WsinferClient;
