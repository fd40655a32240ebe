// The chat page: a view over the npm package wsinfer-client (resolved by the
// import map in index.html). Conversations live in localStorage (store.js),
// each with its own WsinferClient whose state (session, token, the turn in
// flight) is kept under the conversation's key: a reload, a new tab or
// reopening a conversation from the list resumes it.

import { WsinferClient, WsinferTurn } from "wsinfer-client";
import { renderMarkdown, StreamingMarkdown } from "./markdown.js";
import { apiKeyGate } from "./apikey.js";
import { conversationList } from "./conversations.js";
import { sharing } from "./share.js";
import { SpeedReadout } from "./speed.js";
import {
  ChatStore, clientKey, failureText, FINISH_NOTE, fork, leaveOutOldest, newConversation, switchVersion, titleFor, versionsOf,
} from "./store.js";

const $ = (id) => document.getElementById(id);
const els = {
  log: $("log"), input: $("input"), form: $("form"), send: $("send"), stop: $("stop"),
  pause: $("pause"), resume: $("resume"), conn: $("conn"), connText: $("conn-text"),
  error: $("error"), ttft: $("ttft"), tps: $("tps"), newChat: $("new-chat"), title: $("title"),
  list: $("conversations"), menu: $("menu"), closeSidebar: $("close-sidebar"), scrim: $("scrim"),
  theme: $("theme"), openSettings: $("open-settings"), settings: $("settings"),
  maxNew: $("max-new-tokens"), temperature: $("temperature"), system: $("system"),
  themeSelect: $("theme-select"), main: $("main"),
  keyDialog: $("api-key-dialog"), keyForm: $("api-key-form"), keyInput: $("api-key"),
  keyError: $("api-key-refused"), rememberKey: $("remember-key"),
  share: $("share"), shareDialog: $("share-dialog"), shareLink: $("share-link"), shareQr: $("share-qr"),
  shareNote: $("share-note"), copyLink: $("copy-link"), shareBody: $("share-body"),
  search: $("search"), noMatch: $("no-match"), toast: $("toast"), toastText: $("toast-text"),
  undo: $("undo"), toBottom: $("to-bottom"), model: $("model"),
};

const query = new URLSearchParams(location.search);
const store = new ChatStore();
let settings = store.settings();
let conv = null; // {id, title, messages: [{role, content, note?}]}
let client = null;
let turn = null;
let view = null; // the assistant message being streamed: {li, content, note, md}

// ---- API key (apikey.js) -------------------------------------------------------

const keys = apiKeyGate(els, query, {
  asking() {
    if (client) client.disconnect(); // no retries against a closed door meanwhile
    showConn("auth");
  },
  accepted() {
    showModel();
    openConversation(conv ? conv.id : null); // a client with the key; resumes what was open
  },
});

// ---- settings and theme ----------------------------------------------------------

function applySettings() {
  els.temperature.value = settings.temperature;
  els.maxNew.value = settings.maxNewTokens;
  els.system.value = settings.system;
  els.themeSelect.value = settings.theme;
  applyTheme();
}

function applyTheme() {
  document.documentElement.dataset.theme = settings.theme;
  els.theme.setAttribute("aria-label", `Theme: ${settings.theme}`);
  els.theme.title = `Theme: ${settings.theme} (click to change)`;
  els.theme.textContent = { system: "◐", light: "☀", dark: "☾" }[settings.theme] || "◐";
}

function readSettings() {
  const t = parseFloat(els.temperature.value);
  const n = parseInt(els.maxNew.value, 10);
  settings = {
    temperature: t >= 0 ? t : settings.temperature,
    maxNewTokens: n > 0 ? n : settings.maxNewTokens,
    system: els.system.value,
    theme: els.themeSelect.value,
  };
  store.saveSettings(settings);
  applyTheme();
}

function params() {
  const p = {};
  const n = parseInt(els.maxNew.value, 10);
  if (n > 0) p.max_new_tokens = n;
  const t = parseFloat(els.temperature.value);
  if (t >= 0) p.temperature = t;
  return p;
}

// ---- rendering -----------------------------------------------------------------------

function actionButton(label, name, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = name;
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

// A question asked on another device, which the server did not give back (one
// without GET /v1/sessions/{id}/messages); one it gave back is shown, marked.
const REMOTE_QUESTION = "A question asked on another device. This server does not give questions back, so only its answer is shown here.";

/** One message of the log; `index` is its place in conv.messages (for its versions). */
function renderMessage(m, index = null) {
  const { role } = m;
  const li = document.createElement("li");
  li.className = `msg ${role}`;
  li.dataset.role = role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "content";
  if (role === "user") {
    body.textContent = m.remote ? m.remote === true ? REMOTE_QUESTION : m.remote : m.content;
    body.source = m.content;
    if (m.remote) li.classList.add("remote");
    if (m.elsewhere) { li.classList.add("elsewhere"); li.title = "Asked on another device"; }
  } else renderMarkdown(body, m.content);
  const noteEl = document.createElement("span");
  noteEl.className = "note";
  if (m.note) noteEl.textContent = m.note;
  if (m.error) { li.classList.add("failed"); li.dataset.error = m.error; }
  if (m.omitted) li.classList.add("left-out");
  if (m.finish) li.dataset.finish = m.finish;
  li.append(who, body, noteEl, messageActions(li, m, index));
  els.log.append(li);
  return { li, content: body, note: noteEl };
}

function messageActions(li, m, index) {
  const bar = document.createElement("div");
  bar.className = "actions";
  const nav = versionNav(m, index);
  if (nav) bar.append(nav);
  if (m.role === "user") {
    if (!m.remote) bar.append(actionButton("Edit", "edit", () => startEdit(li)));
    return bar;
  }
  bar.append(
    actionButton("Copy", "copy-answer", (e) => copyAnswer(li, e.currentTarget)),
    actionButton(m.error ? "Retry" : "Regenerate", "regenerate", () => regenerate()),
  );
  if (m.finish === "length") bar.append(actionButton("Continue", "continue", () => continueAnswer()));
  return bar;
}

/** `‹ 1/2 ›` on a message that Regenerate or Edit gave several versions. */
function versionNav(m, index) {
  const v = versionsOf(m);
  if (!v || index == null) return null;
  const nav = document.createElement("span");
  nav.className = "versions";
  nav.setAttribute("role", "group");
  nav.setAttribute("aria-label", `Version ${v.at + 1} of ${v.count}`);
  const prev = actionButton("‹", "prev-version", () => showVersion(index, v.at - 1));
  prev.setAttribute("aria-label", "Previous version");
  prev.disabled = v.at === 0;
  const label = document.createElement("span");
  label.className = "version-label";
  label.textContent = `${v.at + 1}/${v.count}`;
  const next = actionButton("›", "next-version", () => showVersion(index, v.at + 1));
  next.setAttribute("aria-label", "Next version");
  next.disabled = v.at === v.count - 1;
  nav.append(prev, label, next);
  return nav;
}

function showVersion(index, at) {
  if (turn && turn.active) return;
  switchVersion(conv, index, at);
  saveConv();
  renderLog();
}

async function copyAnswer(li, button) {
  try {
    await navigator.clipboard.writeText(li.querySelector(".content").source || "");
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

const LEFT_OUT = "The model no longer reads the messages above: the conversation outgrew its context. They stay here; it answers from what follows.";

function renderLog() {
  els.log.replaceChildren();
  conv.messages.forEach((m, i) => {
    if (!m.omitted && conv.messages[i - 1]?.omitted) {
      const mark = document.createElement("li");
      mark.className = "left-out-mark";
      mark.textContent = LEFT_OUT;
      els.log.append(mark);
    }
    renderMessage(m, i);
  });
  refreshActions();
}

// Regenerate belongs to the last answer only; a question left without an answer
// (refused, or the page closed before the server took it) can be retried.
function refreshActions() {
  for (const b of els.log.querySelectorAll(".regenerate, .retry, .continue")) {
    if (b.classList.contains("retry")) b.remove(); else b.hidden = true;
  }
  const last = els.log.lastElementChild;
  if (!last) return;
  for (const b of last.querySelectorAll(".regenerate, .continue")) b.hidden = false;
  if (last.dataset.role === "user" && !last.classList.contains("editing")) last.querySelector(".actions").append(actionButton("Retry", "retry", () => regenerate()));
}

// Whether the log follows new text: it does while the reader was at the end
// when they last scrolled (growth of the text fires no scroll event).
let atEnd = true;

function scrollToEnd(force = false) {
  const main = els.main;
  if (force || atEnd) main.scrollTop = main.scrollHeight;
  showToBottom();
}

/** The ↓ button, while the latest message is out of view. */
function showToBottom() {
  const main = els.main;
  const gap = main.scrollHeight - main.scrollTop - main.clientHeight;
  els.toBottom.hidden = gap < 200;
  return gap;
}

function onScroll() {
  atEnd = showToBottom() < 120;
}

// The model's name, from GET /v1/models (the one model this server answers to).
async function showModel() {
  try {
    const headers = keys.value ? { Authorization: `Bearer ${keys.value}` } : {};
    const r = await fetch("/v1/models", { headers, cache: "no-store" });
    const id = r.ok ? (await r.json()).data?.[0]?.id : null;
    if (!id) return;
    const name = String(id).split("/").pop();
    els.model.textContent = name;
    els.model.title = `Model: ${id}`;
    els.model.hidden = false;
    els.input.placeholder = `Message ${name}`;
  } catch {
    // no name shown: the connection state says what is wrong
  }
}

const CONN_TEXT = {
  idle: "Not connected", connecting: "Connecting…", open: "Connected",
  reconnecting: "Reconnecting…", resumed: "Reconnected, answer resumed", closed: "Disconnected",
  auth: "API key needed",
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
  els.conn.title = text;
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
  client_closed: "The conversation was closed.",
  connection_lost: "The connection to the server was lost; the next message reconnects.",
};

function showError(error) {
  if (!error) { els.error.hidden = true; els.error.textContent = ""; return; }
  let text = ERROR_TEXT[error.code] || "Something went wrong";
  if (error.code === "bad_request" && error.message) text += `: ${error.message}`;
  if (error.retryAfter != null) text += ` Try again in ${Math.ceil(error.retryAfter)} s.`;
  els.error.dataset.code = error.code || "";
  els.error.dataset.kind = "error";
  els.error.setAttribute("role", "alert");
  els.error.textContent = `${text} (${error.code})`;
  els.error.hidden = false;
}

function updateControls() {
  const status = turn ? turn.status : "idle";
  const active = !!(turn && turn.active);
  setDisabled(els.send, active, els.stop);
  setDisabled(els.stop, !active, els.input);
  setDisabled(els.pause, status !== "running" && status !== "queued", els.resume);
  setDisabled(els.resume, status !== "paused", els.pause);
  document.body.dataset.turn = active ? status : "idle";
}

// Disabling the focused button would drop focus to <body>: hand it on instead.
function setDisabled(button, disabled, next) {
  const hadFocus = document.activeElement === button;
  button.disabled = disabled;
  if (disabled && hadFocus) (next.disabled ? els.input : next).focus();
}

function saveConv() {
  if (!conv.messages.length) return;
  store.save(conv, client.session);
  if (location.hash !== `#c=${conv.id}`) history.replaceState(null, "", `${location.pathname}${location.search}#c=${conv.id}`);
  els.title.textContent = conv.title;
  renderList();
}

function makeClient(id) {
  const c = new WsinferClient({ token: keys.value, storage: store.storage, storageKey: clientKey(id) });
  for (const state of ["connecting", "open", "reconnecting", "resumed", "closed"]) {
    c.addEventListener(state, (e) => { if (c === client) showConn(state, e.detail); });
  }
  // A refused handshake looks like a dropped connection: see whether the key is why.
  for (const state of ["reconnecting", "closed"]) {
    c.addEventListener(state, () => { if (c === client) keys.check(); });
  }
  c.addEventListener("error", (e) => { if (c === client) showError(e.error); });
  // (A Continue whose connection drops before its answer is the client's to
  // settle: it re-joins the turn and asks again only if the server never had it.)
  return c;
}

/** Show conversation `id` (a new, empty one for null), resuming its answer in flight. */
function openConversation(id) {
  const old = client;
  client = null;
  if (old) old.disconnect(); // the session stays, for when this one is reopened
  turn = view = null;
  conv = (id && store.load(id)) || newConversation();
  client = makeClient(conv.id);
  els.title.textContent = conv.messages.length ? conv.title : "wsinfer chat";
  if (!conv.messages.length && location.hash) history.replaceState(null, "", location.pathname + location.search);
  else if (conv.messages.length) history.replaceState(null, "", `${location.pathname}${location.search}#c=${conv.id}`);
  showError(null);
  speed.reset(0);
  renderLog();
  renderList();
  restoreOrConnect();
  updateControls();
  scrollToEnd(true);
  share.catchUp();
}

function restoreOrConnect() {
  const restored = client.restoreTurn();
  if (!restored) { client.connect(); return; }
  restored.restored = true;
  attach(restored);
  if (restored.status === "paused") view.note.textContent = "Paused";
}

const speed = new SpeedReadout(els.ttft, els.tps); // speed.js

// ---- turns -------------------------------------------------------------------

function attach(t) {
  turn = t;
  speed.reset(t.seq);
  if (continuedMessage(t)) view = reopenView(t);
  else {
    const { versions, at } = conv.pending || {};
    view = renderMessage({ role: "assistant", content: t.text, versions, at }, conv.messages.length);
    view.md = new StreamingMarkdown(view.content);
    streamInto(view, t);
  }
  listen(t);
  updateControls();
}

function streamInto(v, t) {
  v.li.classList.add("streaming");
  v.li.setAttribute("aria-busy", "true");
  v.li.dataset.seq = String(t.seq);
  refreshActions();
}

/** What the page does with turn `t`'s events while it is the page's turn. */
function listen(t) {
  t.addEventListener("delta", (e) => {
    if (t !== turn) return;
    view.md.set(t.text);
    view.li.dataset.seq = String(e.detail.seq);
    speed.delta(t, e.detail.seq, e.detail.time);
    updateControls();
    scrollToEnd();
  });
  t.addEventListener("session", () => {
    if (t !== turn) return;
    conv.lastSession = client.session;
    conv.lastTurn = t.turn;
    saveConv();
    updateControls();
  });
  t.addEventListener("paused", () => { if (t === turn) { view.note.textContent = "Paused"; updateControls(); } });
  t.addEventListener("done", (e) => { if (t === turn) finishTurn(e.detail); });
  t.addEventListener("error", (e) => {
    if (t !== turn) return;
    if (continueRefused(t)) { continueInNewTurn(`The server could not extend this answer in place (${e.error.code})`); return; }
    if (e.fatal && outgrown(t, e.error)) return;
    showError(e.error);
    if (e.fatal) failTurn(e.error);
  });
}

// A turn the engine ended because the conversation no longer fits the model's
// context (a `done` with too_large: a refused `generate` has no turn number):
// its oldest exchanges are left out of the prompt, and it is asked again.
function outgrown(t, error) {
  if (error.code !== "too_large" || t.turn == null || !view || view.continues != null) return false;
  if (!leaveOutOldest(conv, error.message)) return false; // the question alone is too long
  const n = conv.messages.filter((m) => m.omitted).length;
  view = null;
  resendAll();
  showNotice(`This conversation outgrew the model's context, so its oldest ${n} messages are left out of what the model reads (marked in the conversation); the question was asked again without them.`);
  return true;
}

// ---- Continue: a cut answer goes on ---------------------------------------------
// The `continue` message extends the turn itself (the same turn number, seq
// numbering and KV cache), so the answer grows in place; its cut mark stays
// until it ends again. A server that refuses it (an older one, or the answer is
// no longer the session's latest turn) gets today's request instead: a new turn
// asking for the rest, as a person would, and the page says so.

/** The shown answer that turn `t` goes on with (a continued turn), or null. */
function continuedMessage(t) {
  const m = conv.messages.at(-1);
  const same = m && m.role === "assistant" && t.turn != null && m.turn === t.turn && m.session === client.session;
  return same ? m : null;
}

/** The shown last answer as the view a continued turn streams into. */
function reopenView(t) {
  const li = els.log.lastElementChild;
  const v = { li, content: li.querySelector(".content"), note: li.querySelector(".note"), continues: conv.messages.length - 1 };
  v.md = new StreamingMarkdown(v.content);
  if (t.text) v.md.set(t.text); // a reload mid-way: what came since the cut too
  else v.md.text = v.content.source ?? "";
  streamInto(v, t);
  li.querySelector(".continue")?.setAttribute("hidden", "");
  return v;
}

/** The finished turn of the last answer, to continue (after a reload, one built for it), or null. */
function turnToContinue(m) {
  if (m.session !== client.session || m.turn == null || m.turn !== conv.lastTurn || !pathIsSession()) return null;
  if (turn && turn.turn === m.turn && turn.status === "done" && client.currentTurn === turn) return turn;
  // From seq 0: the server's replay restates the whole text before what is new.
  const t = new WsinferTurn(client, { turn: m.turn, status: "done" });
  client.currentTurn = t;
  attach(t);
  return t;
}

function continueAnswer() {
  const m = conv.messages.at(-1);
  if (view || (turn && turn.active) || !m || m.role !== "assistant" || m.finish !== "length") return;
  showError(null);
  const t = turnToContinue(m);
  if (!t) { continueInNewTurn("This answer is no longer the latest of its session on the server"); return; }
  if (!view) { speed.reset(t.seq, performance.now()); view = reopenView(t); }
  t.continue();
  updateControls();
}

// Continue refused: the client has put the turn back as it ended (an error
// event while the answer's view is reopened for it is that refusal).
function continueRefused(t) {
  return Boolean(t && view && view.continues != null && t.status === "done");
}

/** The answer as it was before Continue: ended, cut, offering Continue again. */
function continueSettled() {
  view.li.classList.remove("streaming");
  view.li.removeAttribute("aria-busy");
  view = null;
  refreshActions();
}

function continueInNewTurn(why) {
  if (view) continueSettled();
  send("Continue");
  showNotice(`${why}, so Continue asked for the rest in a new message.`);
}

function endView(finish) {
  view.md.flush();
  view.li.classList.remove("streaming");
  view.li.removeAttribute("aria-busy");
  view.li.dataset.finish = finish;
}

/** The message a turn leaves in the conversation, with its place on the server. */
function answerMessage(content, extra) {
  const m = { role: "assistant", content, ...extra };
  if (turn && turn.turn != null) Object.assign(m, { session: client.session, turn: turn.turn, seq: turn.seq });
  const shown = view && view.continues != null ? conv.messages[view.continues] : null;
  if (shown && shown.versions) Object.assign(m, { versions: shown.versions, at: shown.at });
  if (conv.pending) Object.assign(m, conv.pending);
  delete conv.pending;
  return m;
}

function finishTurn(detail) {
  if (!view || detail.finishReason === "error") return; // failTurn handles it
  const finish = detail.finishReason || "";
  const note = FINISH_NOTE[finish] || "";
  view.md.set(detail.text);
  endView(finish);
  view.note.textContent = note;
  afterTurn(answerMessage(detail.text, { note, finish }));
}

// Whatever the server answered, the question and what came of it stay: a
// refusal or a failure is an answer that says, in words, what happened.
function failTurn(error) {
  if (!view) return;
  const note = failureText(error);
  endView("error");
  view.li.classList.add("failed");
  view.note.textContent = note;
  view.li.dataset.error = error.code;
  afterTurn(answerMessage(turn.text, { note, finish: "error", error: error.code }));
}

/** The turn's answer `m` joins the conversation; its view keeps its place (and data-seq). */
function afterTurn(m) {
  const followed = turn && turn.restored;
  if (view.continues != null) conv.messages[view.continues] = m; // the same answer, longer
  else conv.messages.push(m);
  saveConv();
  view.li.querySelector(".actions").replaceWith(messageActions(view.li, m, conv.messages.indexOf(m)));
  view = null;
  refreshActions();
  updateControls();
  scrollToEnd();
  if (document.activeElement === document.body) els.input.focus();
  if (followed) share.catchUp(); // another device may have gone on meanwhile
}

/** The whole conversation for a new session: system prompt first. */
function fullHistory() {
  const history = conv.messages.filter((m) => m.content && !m.error && !m.omitted).map(({ role, content }) => ({ role, content }));
  return settings.system.trim() ? [{ role: "system", content: settings.system }, ...history] : history;
}

// The server's history of the session is the shown path while the path's
// latest turn is the session's latest: after a switch to another version it
// is not, and the next question starts a session with the path's history.
function pathIsSession() {
  const last = conv.messages.findLast((m) => m.turn != null);
  return !last || (last.session === client.session && last.turn === conv.lastTurn);
}

function startTurn(messages) {
  try {
    return client.generate({ messages, params: params() });
  } catch (err) {
    showError(err);
    return null;
  }
}

function send(asked = null) {
  const text = asked ?? els.input.value.trim();
  if (!text || (turn && turn.active)) return;
  showError(null);
  if (!conv.messages.length) conv.title = titleFor(text);
  if (client.session && !pathIsSession()) client.close();
  conv.messages.push({ role: "user", content: text });
  // A live session keeps the history server-side; a new one needs it all.
  const t = startTurn(client.session ? [{ role: "user", content: text }] : fullHistory());
  if (!t) { conv.messages.pop(); return; }
  renderMessage(conv.messages.at(-1), conv.messages.length - 1);
  if (asked === null) { els.input.value = ""; autoGrow(); }
  attach(t);
  saveConv();
  scrollToEnd(true);
}

/**
 * Answer the conversation as it now stands (ending in a question) in a new
 * session: the server's history of the old one includes what was replaced.
 */
function resendAll() {
  showError(null);
  client.close(); // the old session's history is obsolete: end it on the server
  const t = startTurn(fullHistory());
  if (!t) return;
  renderLog();
  attach(t);
  saveConv();
  scrollToEnd(true);
}

/** A new version of the last answer; the old one stays, behind `‹ n/m ›`. */
function regenerate() {
  if (turn && turn.active) return;
  const i = conv.messages.length - 1;
  const last = conv.messages[i];
  if (!last) return;
  if (last.role === "assistant" && last.error && !last.content) {
    conv.messages.pop(); // a refusal is no version worth keeping: its place is the new answer's
    if (last.versions) conv.pending = { versions: last.versions, at: last.at };
  } else if (last.role === "assistant") {
    conv.pending = fork(conv, i);
  }
  if (!conv.messages.length) return;
  resendAll();
}

function startEdit(li) {
  if (turn && turn.active) return;
  const index = [...els.log.querySelectorAll(":scope > .msg")].indexOf(li);
  const content = li.querySelector(".content");
  const box = document.createElement("textarea");
  box.className = "edit-box";
  box.value = conv.messages[index].content;
  box.setAttribute("aria-label", "Edit your message");
  const save = actionButton("Send", "save-edit primary", () => finishEdit(index, box.value));
  const cancel = actionButton("Cancel", "cancel-edit", () => renderLog());
  const actions = document.createElement("div");
  actions.className = "edit-actions";
  actions.append(cancel, save);
  li.classList.add("editing");
  content.replaceChildren(box, actions);
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); finishEdit(index, box.value); }
    if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); renderLog(); }
  });
  box.focus();
}

/** An edited question branches: what followed the old one stays behind `‹ n/m ›`. */
function finishEdit(index, text) {
  text = text.trim();
  if (!text || (turn && turn.active)) return;
  const { versions, at } = fork(conv, index);
  conv.messages.push({ role: "user", content: text, versions, at });
  if (index === 0) conv.title = titleFor(text);
  resendAll();
}

// ---- the conversation list (conversations.js) ----------------------------------

const list = conversationList({
  els, store, actionButton, openConversation, closeSidebar,
  get conv() { return conv; },
  get turn() { return turn; },
  get apiKey() { return keys.value; },
});
function renderList() { list.renderList(); }

// ---- continue on another device (share.js) -------------------------------------

const share = sharing({
  els, store, pathIsSession, refollow,
  get conv() { return conv; },
  get client() { return client; },
  get turn() { return turn; },
  get apiKey() { return keys.value; },
});

/** A new client for the conversation, following what share.js wrote to its storage. */
function refollow() {
  const c = client;
  saveConv();
  client = null;
  c.disconnect();
  client = makeClient(conv.id);
  renderLog();
  restoreOrConnect();
  updateControls();
  scrollToEnd(true);
}

/** Something the person should know that is no failure: said, not in red. */
function showNotice(text) {
  els.error.dataset.code = "";
  els.error.dataset.kind = "notice";
  els.error.setAttribute("role", "status");
  els.error.textContent = text;
  els.error.hidden = false;
}

// ---- wiring --------------------------------------------------------------------

function autoGrow() {
  els.input.style.height = "auto";
  els.input.style.height = `${Math.min(els.input.scrollHeight, window.innerHeight * 0.4)}px`;
}

function openSidebar() {
  document.body.classList.add("sidebar-open");
  els.scrim.hidden = false;
  els.menu.setAttribute("aria-expanded", "true");
}

function closeSidebar() {
  document.body.classList.remove("sidebar-open");
  els.scrim.hidden = true;
  els.menu.setAttribute("aria-expanded", "false");
}

function wire() {
  els.form.addEventListener("submit", (e) => { e.preventDefault(); send(); });
  els.share.addEventListener("click", share.openShare);
  els.search.addEventListener("input", renderList);
  els.undo.addEventListener("click", list.undoDelete);
  els.toBottom.addEventListener("click", () => { scrollToEnd(true); els.input.focus(); });
  els.main.addEventListener("scroll", onScroll, { passive: true });
  window.addEventListener("pagehide", list.endDeletion);
  els.copyLink.addEventListener("click", share.copyLink);
  // Back on this page: another device may have gone on with the conversation.
  document.addEventListener("visibilitychange", () => { if (!document.hidden) share.catchUp(); });
  window.addEventListener("focus", () => share.catchUp());
  els.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  els.input.addEventListener("input", autoGrow);
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape" || els.settings.open) return;
    if (turn && turn.active) { e.preventDefault(); turn.stop(); } else closeSidebar();
  });
  els.stop.addEventListener("click", () => turn && turn.stop());
  els.pause.addEventListener("click", () => turn && turn.pause());
  els.resume.addEventListener("click", () => {
    if (!turn) return;
    view.note.textContent = "";
    turn.resume();
    updateControls();
  });
  els.newChat.addEventListener("click", () => { openConversation(null); closeSidebar(); els.input.focus(); });
  els.menu.addEventListener("click", openSidebar);
  els.closeSidebar.addEventListener("click", closeSidebar);
  els.scrim.addEventListener("click", closeSidebar);
  els.openSettings.addEventListener("click", () => els.settings.showModal());
  els.keyForm.addEventListener("submit", keys.submit);
  for (const el of [els.temperature, els.maxNew, els.system, els.themeSelect]) el.addEventListener("change", readSettings);
  els.theme.addEventListener("click", () => {
    const order = ["system", "light", "dark"];
    els.themeSelect.value = order[(order.indexOf(settings.theme) + 1) % order.length];
    readSettings();
  });
  // Another tab changed the list (a new conversation, a title, a deletion).
  window.addEventListener("storage", (e) => { if (ChatStore.affectsList(e.key)) renderList(); });
  setInterval(renderList, 60_000); // keep "n min ago" honest
}

applySettings();
// URL overrides for this page only (links, tests): not saved as settings.
if (query.has("max_new_tokens")) els.maxNew.value = query.get("max_new_tokens");
if (query.has("temperature")) els.temperature.value = query.get("temperature");
wire();

async function boot() {
  showModel();
  const hash = new URLSearchParams(location.hash.slice(1));
  const link = hash.has("follow") ? await share.importLink(hash.get("follow")) : { id: hash.get("c") };
  openConversation(link.id);
  if (link.notice) showNotice(link.notice);
}
boot();
window.wsinferChat = {
  get client() { return client; },
  get turn() { return turn; },
  get conversation() { return conv; },
  store,
};
