// The chat page: a thin view over WsinferClient. The conversation is kept in
// sessionStorage beside the client's own state, so a reload shows the history
// and the client continues the answer that was in flight.

import { WsinferClient } from "/static/wsinfer.js";

const CHAT_KEY = "wsinfer-chat";
const $ = (id) => document.getElementById(id);
const els = {
  log: $("log"), input: $("input"), form: $("form"), send: $("send"), stop: $("stop"),
  pause: $("pause"), resume: $("resume"), conn: $("conn"), connText: $("conn-text"),
  error: $("error"), ttft: $("ttft"), tps: $("tps"), newChat: $("new-chat"),
  maxNew: $("max-new-tokens"), temperature: $("temperature"),
};

const query = new URLSearchParams(location.search);
if (query.has("max_new_tokens")) els.maxNew.value = query.get("max_new_tokens");
if (query.has("temperature")) els.temperature.value = query.get("temperature");

const client = new WsinferClient({ token: query.get("token") || undefined });
let chat = loadChat(); // {messages: [{role, content, note?}]}
let turn = null;
let view = null; // the assistant message being streamed: {li, content, note}

// ---- persistence -----------------------------------------------------------

function loadChat() {
  try {
    const c = JSON.parse(sessionStorage.getItem(CHAT_KEY) || "null");
    if (c && Array.isArray(c.messages)) return c;
  } catch { /* fall through */ }
  return { messages: [] };
}

function saveChat() {
  try { sessionStorage.setItem(CHAT_KEY, JSON.stringify(chat)); } catch { /* quota */ }
}

// ---- rendering -------------------------------------------------------------

function renderMessage(role, content, note) {
  const li = document.createElement("li");
  li.className = `msg ${role}`;
  li.dataset.role = role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "content";
  body.textContent = content;
  const noteEl = document.createElement("span");
  noteEl.className = "note";
  if (note) noteEl.textContent = note;
  li.append(who, body, noteEl);
  els.log.append(li);
  return { li, content: body, note: noteEl };
}

function scrollToEnd() {
  const main = els.log.parentElement;
  if (main.scrollHeight - main.scrollTop - main.clientHeight < 120) main.scrollTop = main.scrollHeight;
}

const CONN_TEXT = {
  idle: "Not connected", connecting: "Connecting…", open: "Connected",
  reconnecting: "Reconnecting…", resumed: "Reconnected, answer resumed", closed: "Disconnected",
};

let connTimer = null;

function showConn(state, detail = {}) {
  clearTimeout(connTimer);
  // "Resumed" is news: keep it readable a while, then settle on "Connected".
  if (state === "resumed") connTimer = setTimeout(() => showConn("open"), 5000);
  let text = CONN_TEXT[state] || state;
  if (state === "reconnecting" && detail.attempt) text = `Reconnecting (attempt ${detail.attempt})…`;
  if (state === "resumed" && detail.restored) text = "Connected, answer restored";
  if (state === "closed" && !detail.willReconnect) text = "Idle (reconnects when needed)";
  els.conn.dataset.state = state;
  els.connText.textContent = text;
}

const ERROR_TEXT = {
  overloaded: "The server is busy right now.",
  bad_request: "The server rejected the request",
  unauthorized: "Not authorised: check the API key.",
  not_found: "This conversation is no longer on the server; the next message starts a new one.",
  conflict: "An answer is still being generated; stop it first.",
  too_large: "The message is too long for the server.",
  engine_unavailable: "No model is available right now. Try again shortly.",
  internal: "The server had an internal error.",
  cancelled: "The conversation was closed.",
};

function showError(error) {
  if (!error) { els.error.hidden = true; els.error.textContent = ""; return; }
  let text = ERROR_TEXT[error.code] || "Something went wrong";
  if (error.code === "bad_request" && error.message) text += `: ${error.message}`;
  if (error.retryAfter != null) text += ` Try again in ${Math.ceil(error.retryAfter)} s.`;
  els.error.dataset.code = error.code || "";
  els.error.textContent = `${text} (${error.code})`;
  els.error.hidden = false;
}

function updateControls() {
  const status = turn ? turn.status : "idle";
  const active = turn && turn.active;
  setDisabled(els.send, !!active, els.stop);
  setDisabled(els.stop, !active, els.input);
  setDisabled(els.pause, status !== "running", els.resume);
  setDisabled(els.resume, status !== "paused", els.pause);
  document.body.dataset.turn = status;
}

// Disabling the focused button would drop focus to <body>: hand it on instead.
function setDisabled(button, disabled, next) {
  const hadFocus = document.activeElement === button;
  button.disabled = disabled;
  if (disabled && hadFocus) (next.disabled ? els.input : next).focus();
}

// ---- live speed readout -------------------------------------------------------

const speed = { lastAt: null, lastSeq: 0, tokens: 0, active: 0 };

function resetSpeed(seq) {
  Object.assign(speed, { lastAt: null, lastSeq: seq, tokens: 0, active: 0 });
  els.ttft.textContent = "–";
  els.tps.textContent = "–";
}

function onSpeedDelta(seq, time) {
  // Gaps over a second (pause, reconnect, reload) are not generation time.
  if (speed.lastAt !== null && time - speed.lastAt < 1000) {
    speed.active += time - speed.lastAt;
    speed.tokens += seq - speed.lastSeq;
  }
  speed.lastAt = time;
  speed.lastSeq = seq;
  if (turn.firstDeltaAt !== null && els.ttft.textContent === "–" && !turn.restored) {
    els.ttft.textContent = `${Math.round(turn.firstDeltaAt - turn.startedAt)} ms`;
  }
  if (speed.active > 0) els.tps.textContent = (speed.tokens / (speed.active / 1000)).toFixed(1);
}

// ---- turns -------------------------------------------------------------------

function attach(t) {
  turn = t;
  resetSpeed(t.seq);
  view = renderMessage("assistant", t.text);
  view.li.classList.add("streaming");
  view.li.setAttribute("aria-busy", "true");
  view.li.dataset.seq = String(t.seq);
  t.addEventListener("delta", (e) => {
    view.content.append(e.detail.text);
    view.li.dataset.seq = String(e.detail.seq);
    onSpeedDelta(e.detail.seq, e.detail.time);
    updateControls();
    scrollToEnd();
  });
  t.addEventListener("session", updateControls);
  t.addEventListener("paused", () => { view.note.textContent = "Paused"; updateControls(); });
  t.addEventListener("done", (e) => finishTurn(e.detail));
  t.addEventListener("error", (e) => {
    showError(e.error);
    if (e.fatal) failTurn(e.error);
  });
  updateControls();
}

function finishTurn(detail) {
  if (!view || detail.finishReason === "error") return; // failTurn handles it
  const note = detail.finishReason === "cancelled" ? "Stopped" : "";
  view.note.textContent = note;
  view.li.dataset.finish = detail.finishReason || "";
  view.li.classList.remove("streaming");
  view.li.removeAttribute("aria-busy");
  chat.messages.push({ role: "assistant", content: detail.text, note });
  saveChat();
  view = null;
  updateControls();
  if (document.activeElement === document.body) els.input.focus();
}

function failTurn(error) {
  if (!view) return;
  view.li.classList.remove("streaming");
  view.li.classList.add("failed");
  view.li.removeAttribute("aria-busy");
  view.li.dataset.finish = "error";
  if (turn.seq === 0) {
    // Nothing was generated: take the question back so it can be sent again.
    view.li.remove();
    const last = chat.messages[chat.messages.length - 1];
    if (last && last.role === "user") {
      chat.messages.pop();
      els.log.lastElementChild?.remove();
      if (!els.input.value) els.input.value = last.content;
    }
  } else {
    view.note.textContent = `Failed: ${error.code}`;
    chat.messages.push({ role: "assistant", content: turn.text, note: `Failed: ${error.code}` });
  }
  saveChat();
  view = null;
  updateControls();
}

function params() {
  const p = {};
  const n = parseInt(els.maxNew.value, 10);
  if (n > 0) p.max_new_tokens = n;
  const t = parseFloat(els.temperature.value);
  if (t >= 0) p.temperature = t;
  return p;
}

function send() {
  const text = els.input.value.trim();
  if (!text || (turn && turn.active)) return;
  showError(null);
  // A live session keeps the history server-side; a new one needs it all.
  const history = chat.messages.filter((m) => m.content).map(({ role, content }) => ({ role, content }));
  const messages = client.session ? [{ role: "user", content: text }] : [...history, { role: "user", content: text }];
  let t;
  try {
    t = client.generate({ messages, params: params() });
  } catch (err) {
    showError(err);
    return;
  }
  chat.messages.push({ role: "user", content: text });
  saveChat();
  renderMessage("user", text);
  els.input.value = "";
  attach(t);
  scrollToEnd();
}

// ---- wiring --------------------------------------------------------------------

for (const state of ["connecting", "open", "reconnecting", "resumed", "closed"]) {
  client.addEventListener(state, (e) => showConn(state, e.detail));
}
client.addEventListener("error", (e) => showError(e.error));

els.form.addEventListener("submit", (e) => { e.preventDefault(); send(); });
els.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
els.stop.addEventListener("click", () => turn && turn.stop());
els.pause.addEventListener("click", () => turn && turn.pause());
els.resume.addEventListener("click", () => {
  if (!turn) return;
  view.note.textContent = "";
  turn.resume();
  updateControls();
});
els.newChat.addEventListener("click", () => {
  if (view) { view.li.classList.remove("streaming"); view.li.removeAttribute("aria-busy"); view = null; }
  turn = null;
  client.close();
  chat = { messages: [] };
  saveChat();
  els.log.replaceChildren();
  showError(null);
  resetSpeed(0);
  updateControls();
  els.input.focus();
});

for (const m of chat.messages) renderMessage(m.role, m.content, m.note);
const restored = client.restoreTurn();
if (restored) {
  restored.restored = true;
  attach(restored);
  if (restored.status === "paused") view.note.textContent = "Paused";
} else {
  client.connect();
}
updateControls();
scrollToEnd();
window.wsinferChat = { client, get turn() { return turn; }, get chat() { return chat; } };
