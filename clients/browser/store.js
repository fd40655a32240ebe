// The chat page's browser storage: the conversation list, each conversation's
// messages, and the settings, in localStorage so that every tab sees them and
// they survive closing the browser. Each conversation's wsinfer session (id,
// token, the turn in flight) is kept by its own WsinferClient under
// clientKey(id) in the same storage, so reopening a conversation resumes it.

const PREFIX = "wsinfer-chat:";
const INDEX_KEY = `${PREFIX}index`;
const SETTINGS_KEY = `${PREFIX}settings`;
const convKey = (id) => `${PREFIX}conv:${id}`;

export const clientKey = (id) => `${PREFIX}client:${id}`;

export const DEFAULT_SETTINGS = Object.freeze({
  temperature: 0.7,
  maxNewTokens: 256,
  system: "",
  theme: "system", // system, light, dark
});

function memoryStorage() {
  const data = new Map();
  return {
    getItem: (k) => (data.has(k) ? data.get(k) : null),
    setItem: (k, v) => data.set(k, String(v)),
    removeItem: (k) => data.delete(k),
  };
}

/** localStorage, or a per-page map where the browser refuses storage. */
export function pageStorage() {
  try {
    const s = globalThis.localStorage;
    s.getItem(INDEX_KEY);
    return s;
  } catch {
    return memoryStorage();
  }
}

export class ChatStore {
  constructor(storage = pageStorage()) {
    this.storage = storage;
  }

  _get(key, fallback) {
    try {
      const value = JSON.parse(this.storage.getItem(key) || "null");
      return value ?? fallback;
    } catch {
      return fallback;
    }
  }

  _set(key, value) {
    try {
      this.storage.setItem(key, JSON.stringify(value));
      return true;
    } catch {
      return false; // quota: the page goes on, this change is not kept
    }
  }

  /** [{id, title, updated, session}], most recently used first. */
  list() {
    const index = this._get(INDEX_KEY, []);
    return Array.isArray(index) ? index.slice().sort((a, b) => b.updated - a.updated) : [];
  }

  /** The conversation, or null: {id, title, created, updated, messages: [{role, content, note?}]}. */
  load(id) {
    const conv = this._get(convKey(id), null);
    return conv && Array.isArray(conv.messages) ? conv : null;
  }

  save(conv, session = null) {
    conv.updated = Date.now();
    this._set(convKey(conv.id), conv);
    const index = this._get(INDEX_KEY, []).filter((c) => c.id !== conv.id);
    index.push({ id: conv.id, title: conv.title, updated: conv.updated, session });
    this._set(INDEX_KEY, index);
  }

  remove(id) {
    this.storage.removeItem(convKey(id));
    this.storage.removeItem(clientKey(id));
    this._set(INDEX_KEY, this._get(INDEX_KEY, []).filter((c) => c.id !== id));
  }

  /** A new title for conversation `id`; false if there is no such conversation. */
  rename(id, title) {
    const conv = this.load(id);
    if (!conv) return false;
    conv.title = title;
    const entry = this._get(INDEX_KEY, []).find((c) => c.id === id);
    this.save(conv, entry ? entry.session : null);
    return true;
  }

  /** Whether conversation `id`'s title or any of its messages contains `query` (any case). */
  matches(id, title, query) {
    const q = query.toLocaleLowerCase();
    if (title.toLocaleLowerCase().includes(q)) return true;
    const conv = this.load(id);
    return Boolean(conv && conv.messages.some((m) => (m.content || "").toLocaleLowerCase().includes(q)));
  }

  /** Everything kept of conversation `id`, for `restore` (an undone deletion). */
  snapshot(id) {
    const entry = this._get(INDEX_KEY, []).find((c) => c.id === id) || null;
    return { id, entry, conv: this.storage.getItem(convKey(id)), client: this.storage.getItem(clientKey(id)) };
  }

  restore(snap) {
    if (snap.conv) this.storage.setItem(convKey(snap.id), snap.conv);
    if (snap.client) this.storage.setItem(clientKey(snap.id), snap.client);
    if (snap.entry) this._set(INDEX_KEY, [...this._get(INDEX_KEY, []).filter((c) => c.id !== snap.id), snap.entry]);
  }

  settings() {
    const saved = this._get(SETTINGS_KEY, {});
    return { ...DEFAULT_SETTINGS, ...(typeof saved === "object" ? saved : {}) };
  }

  saveSettings(settings) {
    this._set(SETTINGS_KEY, settings);
  }

  /** True when a change to `key` (from a `storage` event) concerns the list. */
  static affectsList(key) {
    return key === null || key === INDEX_KEY;
  }
}

export function newConversation() {
  const id = globalThis.crypto?.randomUUID?.() ?? `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
  return { id, title: "New chat", created: Date.now(), updated: Date.now(), messages: [] };
}

export function titleFor(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 60 ? `${line.slice(0, 57)}…` : line || "New chat";
}

// ---- how an answer ended, in words (kept with the answer) -------------------------

export const FINISH_NOTE = {
  cancelled: "Stopped",
  length: "Cut off: the answer reached its length limit (Max new tokens, in Settings).",
};

// What went wrong, in words, for the answer it concerns (kept with it).
const FAILED_TEXT = {
  not_found: "The server no longer has this conversation (it restarted without keeping it, or it expired), so this answer was lost. Retry asks again in a new session.",
  too_large: "Not answered: the conversation is longer than the model can read. Edit an earlier question, or start a new chat.",
  overloaded: "Not answered: the server was busy. Retry in a moment.",
  engine_unavailable: "Not answered: no model was running on the server. Retry in a moment.",
  internal: "The server failed while answering this.",
  conflict: "Not answered: another answer of this conversation was still being written (on another device?).",
  unauthorized: "Not answered: the server refused the API key.",
  bad_request: "The server refused the request",
  connection_lost: "The connection to the server was lost before the answer was complete.",
  client_closed: "The conversation was closed before the answer was complete.",
};

export function failureText(error) {
  const text = Object.hasOwn(FAILED_TEXT, error.code) ? FAILED_TEXT[error.code] : "Something went wrong with this answer.";
  return error.code === "bad_request" && error.message ? `${text}: ${error.message}` : text;
}

// ---- versions: Regenerate and Edit keep what they replace --------------------------
// conv.messages is the path the page shows. Where the conversation forks, the
// message at the fork carries `versions` (one tail of messages per version,
// from that message to the end of its branch; the shown one is null, since it
// is the path itself) and `at`, the index of the shown one. Tails nest: a
// branch may fork again further down.

/** The message's version count and the shown one's index, or null if it has one version. */
export function versionsOf(m) {
  return m && Array.isArray(m.versions) && m.versions.length > 1 ? { at: m.at ?? 0, count: m.versions.length } : null;
}

// The tail from index i, as a version, into the list of versions it belongs to.
function detach(messages, i) {
  const tail = messages.slice(i);
  const head = { ...tail[0] };
  const versions = Array.isArray(head.versions) ? head.versions.slice() : [null];
  versions[head.at ?? 0] = tail;
  delete head.versions;
  delete head.at;
  tail[0] = head;
  return versions;
}

/**
 * Keep the path from index i on as a version and cut it off the shown path:
 * returns {versions, at} for the message that takes index i next.
 */
export function fork(conv, i) {
  const versions = detach(conv.messages, i);
  versions.push(null);
  conv.messages = conv.messages.slice(0, i);
  return { versions, at: versions.length - 1 };
}

/** Show version j of the fork at index i (and the rest of that branch). */
export function switchVersion(conv, i, j) {
  const versions = detach(conv.messages, i);
  const tail = versions[j];
  if (!tail) return;
  versions[j] = null;
  conv.messages = [...conv.messages.slice(0, i), { ...tail[0], versions, at: j }, ...tail.slice(1)];
}

// ---- links that carry a conversation to another device ---------------------------
// The link's fragment (#follow=...) holds the session id, its token and the
// conversation so far, deflated and base64url-encoded: a fragment never
// reaches a server or its logs. The server has no route that gives a
// session's messages back, so the link carries them, up to MAX_LINK_CHARS.

export const MAX_LINK_CHARS = 64 * 1024;

async function pipe(bytes, stream) {
  const out = new Blob([bytes]).stream().pipeThrough(stream);
  return new Uint8Array(await new Response(out).arrayBuffer());
}

function toBase64Url(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
}

function fromBase64Url(text) {
  const s = atob(text.replaceAll("-", "+").replaceAll("_", "/"));
  return Uint8Array.from(s, (c) => c.charCodeAt(0));
}

/** The fragment's value for `payload` (any JSON). */
export async function packLink(payload) {
  const json = new TextEncoder().encode(JSON.stringify(payload));
  return toBase64Url(await pipe(json, new CompressionStream("deflate-raw")));
}

/** The payload of a fragment value; throws on one that is cut or garbled. */
export async function unpackLink(text) {
  const bytes = await pipe(fromBase64Url(text), new DecompressionStream("deflate-raw"));
  return JSON.parse(new TextDecoder().decode(bytes));
}

/**
 * What a link carries: the session, its token, the turn being written (`t`,
 * `p` if paused), the latest turn the page knows of (`l`) and the shown path.
 * Notes and sessions are not carried: the other page derives them (a shorter
 * QR code).
 */
export function linkPayload(conv, session, token, live, paused) {
  const m = conv.messages.map(({ role, content, finish, error, turn, remote, omitted }) => ({ role, content, finish, error, turn, remote, omitted }));
  return { v: 1, s: session, k: token, n: conv.title, t: live, p: paused ? 1 : 0, l: conv.lastTurn ?? null, m };
}

const linkMessage = (m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string";
const FINISHES = ["stop", "length", "cancelled", "tool_calls", "error"];

// A link is input from anywhere: only the fields this page writes, of their types.
function fromLink(m, session) {
  const out = { role: m.role, content: m.content };
  if (FINISHES.includes(m.finish)) out.finish = m.finish;
  if (typeof m.error === "string") out.error = m.error.slice(0, 64);
  if (Number.isSafeInteger(m.turn)) Object.assign(out, { turn: m.turn, session });
  if (m.role === "user" && m.remote === true) out.remote = true;
  if (m.omitted === true) out.omitted = true; // left out of the session's prompt
  const note = out.error ? failureText({ code: out.error }) : Object.hasOwn(FINISH_NOTE, out.finish) && FINISH_NOTE[out.finish];
  if (note) out.note = note;
  return out;
}

export function validLink(p) {
  const live = p && (p.t == null || Number.isSafeInteger(p.t));
  return Boolean(live) && p.v === 1 && typeof p.s === "string" && typeof p.k === "string" && Array.isArray(p.m);
}

/** A new conversation of this page from a link's payload. */
export function conversationFromLink(p) {
  const c = newConversation();
  c.title = typeof p.n === "string" ? p.n : "Shared chat";
  c.messages = p.m.filter(linkMessage).map((m) => fromLink(m, p.s));
  if (Number.isSafeInteger(p.d) && p.d > 0) c.messages.unshift({ role: "user", content: "", remote: `${p.d} earlier messages stayed on the other device: the link can carry only so much.` });
  c.lastSession = p.s;
  const last = Number.isSafeInteger(p.t) ? p.t : p.l;
  c.lastTurn = Number.isSafeInteger(last) ? last : null;
  return c;
}

// ---- a conversation longer than the model's context ------------------------------
// The engine ends a turn whose prompt does not fit the model's context with a
// `done` whose error is too_large ("prompt of N tokens does not fit the context
// of M"). The page then leaves the oldest exchanges out of the prompt (they stay
// in the conversation, marked `omitted`) and asks again in a new session.

/**
 * Mark the oldest messages still in the prompt of `conv` (which ends with the
 * question being asked) as left out: whole exchanges, at least one message,
 * about enough for the prompt to fit. How many it marked; 0 when only the
 * question is left.
 */
export function leaveOutOldest(conv, message = "") {
  const ms = conv.messages;
  const question = ms.length - 1;
  if (question < 1 || ms[question].role !== "user") return 0;
  const inPrompt = ms.slice(0, question).filter((m) => !m.omitted);
  const [, total, context] = /(\d+) tokens does not fit the context of (\d+)/.exec(message) || [];
  const share = total && context ? (0.75 * context) / total : 0.5; // of the prompt that fits, roughly
  const size = (m) => (m.content || "").length + 16; // characters, and the template's per message
  const all = inPrompt.reduce((n, m) => n + size(m), size(ms[question]));
  let left = all;
  let k = 0;
  // The prompt that is left starts with a question.
  while (k < inPrompt.length && (k === 0 || left > share * all || inPrompt[k].role !== "user")) left -= size(inPrompt[k++]);
  for (const m of inPrompt.slice(0, k)) m.omitted = true;
  return k;
}
