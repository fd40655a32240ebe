// The wire contract's vocabulary, generated from wsinfer/contract.py by
// `python -m wsinfer.clients.gen_contract`: do not edit by hand.

export const ClientMessageType = Object.freeze({
  GENERATE: "generate",
  STOP: "stop",
  PAUSE: "pause",
  RESUME: "resume",
  CONTINUE: "continue",
  CLOSE: "close",
});

export const ServerMessageType = Object.freeze({
  SESSION: "session",
  DELTA: "delta",
  PAUSED: "paused",
  DONE: "done",
  ERROR: "error",
});

export const ErrorCode = Object.freeze({
  BAD_REQUEST: "bad_request",
  UNAUTHORIZED: "unauthorized",
  NOT_FOUND: "not_found",
  CONFLICT: "conflict",
  TOO_LARGE: "too_large",
  OVERLOADED: "overloaded",
  ENGINE_UNAVAILABLE: "engine_unavailable",
  INTERNAL: "internal",
});

export const ClientErrorCode = Object.freeze({
  CONNECTION_LOST: "connection_lost",
  CLIENT_CLOSED: "client_closed",
});

export const FinishReason = Object.freeze({
  STOP: "stop",
  LENGTH: "length",
  CANCELLED: "cancelled",
  ERROR: "error",
  TOOL_CALLS: "tool_calls",
});

export const TurnStatus = Object.freeze({
  NEW: "new",
  QUEUED: "queued",
  RUNNING: "running",
  PAUSED: "paused",
  DONE: "done",
});

export const Subprotocol = Object.freeze({
  JSON: "wsinfer.v1.json",
  MSGPACK: "wsinfer.v1.msgpack",
});

export const FieldKind = Object.freeze({
  NAME: "name",
  COUNT: "count",
  ORDINAL: "ordinal",
  MESSAGES: "messages",
  TEXT: "text",
  PARAMS: "params",
  KEY: "key",
});

export const CloseCode = Object.freeze({
  SERVICE_RESTART: 1012,
});

export const CLIENT_MESSAGES = Object.freeze({
  generate: {"fields": [{"name": "messages", "kind": "messages", "required": false}, {"name": "prompt", "kind": "text", "required": false}, {"name": "params", "kind": "params", "required": false}, {"name": "session", "kind": "name", "required": false}, {"name": "token", "kind": "name", "required": false}, {"name": "idempotency_key", "kind": "key", "required": false}], "answers": ["session"], "controls_turn": false, "rejoins": false},
  stop: {"fields": [{"name": "session", "kind": "name", "required": true}, {"name": "token", "kind": "name", "required": true}], "answers": ["done"], "controls_turn": true, "rejoins": false},
  pause: {"fields": [{"name": "session", "kind": "name", "required": true}, {"name": "token", "kind": "name", "required": true}], "answers": ["paused", "done"], "controls_turn": true, "rejoins": false},
  resume: {"fields": [{"name": "session", "kind": "name", "required": true}, {"name": "token", "kind": "name", "required": true}, {"name": "after", "kind": "count", "required": false}, {"name": "turn", "kind": "ordinal", "required": false}], "answers": ["session"], "controls_turn": true, "rejoins": true},
  continue: {"fields": [{"name": "session", "kind": "name", "required": true}, {"name": "token", "kind": "name", "required": true}, {"name": "after", "kind": "count", "required": false}, {"name": "turn", "kind": "ordinal", "required": false}], "answers": ["session"], "controls_turn": true, "rejoins": true},
  close: {"fields": [{"name": "session", "kind": "name", "required": true}, {"name": "token", "kind": "name", "required": true}], "answers": [], "controls_turn": false, "rejoins": false},
});

export const CONTROL_ANSWERS = Object.freeze({
  stop: ["done"],
  pause: ["paused", "done"],
  resume: ["session"],
  continue: ["session"],
});

export const ERROR_CLASSES = Object.freeze({
  bad_request: {"fault": "request", "retryable": false},
  unauthorized: {"fault": "request", "retryable": false},
  not_found: {"fault": "request", "retryable": false},
  conflict: {"fault": "request", "retryable": false},
  too_large: {"fault": "request", "retryable": false},
  overloaded: {"fault": "service", "retryable": true},
  engine_unavailable: {"fault": "service", "retryable": true},
  internal: {"fault": "service", "retryable": true},
});

export const IDEMPOTENCY_KEY_HEX = 32;
