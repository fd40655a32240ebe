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
