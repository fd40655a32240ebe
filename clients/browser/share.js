// Continue on another device: the chat page's "continue elsewhere" link and its
// QR code, the page that opens such a link, and catching up with turns that
// another device started in the same session.
//
// The link's fragment carries the session id, its token and the conversation
// (store.js packLink): the other browser writes them where its WsinferClient
// keeps a session, so restoreTurn() follows the answer in flight, live, as one
// more follower, and its next question is one more turn of the same session.

import { WsinferClient } from "wsinfer-client";
import { clientKey, conversationFromLink, linkPayload, MAX_LINK_CHARS, packLink, unpackLink, validLink } from "./store.js";

const QR_MAX_CHARS = 1800; // denser codes are hard to scan from a screen

/**
 * Sharing and following for the chat page. `page` gives what it reads of the
 * page's state, live (`conv`, `client`, `turn`, `apiKey` as getters), its
 * `els`, `store`, `pathIsSession()`, and `refollow()`: after followIn()
 * rewrote the client's storage, a new client for the conversation follows it.
 */
export function sharing(page) {
  const { els, store } = page;

  async function linkFor() {
    const { conv, client, turn } = page;
    const live = turn && turn.active && turn.turn != null ? turn.turn : null;
    const paused = live != null && turn.status === "paused";
    const payload = linkPayload(conv, client.session, client.sessionToken, live, paused);
    const base = `${location.origin}${location.pathname}#follow=`;
    let link = base + (await packLink(payload));
    // Too long for a link: carry the latest messages only, and say so.
    while (link.length > MAX_LINK_CHARS && payload.m.length > 2) {
      const drop = Math.max(1, Math.floor(payload.m.length / 4));
      payload.m = payload.m.slice(drop);
      payload.d = (payload.d || 0) + drop;
      link = base + (await packLink(payload));
    }
    return { link, dropped: payload.d || 0, fits: link.length <= MAX_LINK_CHARS };
  }

  async function openShare() {
    const { client } = page;
    els.shareQr.replaceChildren();
    els.shareLink.value = "";
    els.shareBody.hidden = !client.session;
    els.shareNote.textContent = client.session ? "" : "Send a message first: the link follows this conversation's session on the server.";
    if (!els.shareDialog.open) els.shareDialog.showModal();
    if (!client.session) return;
    const { link, dropped, fits } = await linkFor();
    if (!fits) {
      els.shareBody.hidden = true;
      els.shareNote.textContent = "This conversation's latest messages are too long to carry in a link.";
      return;
    }
    els.shareLink.value = link;
    const notes = [];
    if (dropped) notes.push(`The conversation is too long for a link: it carries the latest ${page.conv.messages.length - dropped} messages; the ${dropped} before them stay on this device.`);
    if (link.length <= QR_MAX_CHARS) await drawQr(link);
    else notes.push("The link is too long for a QR code: copy it instead.");
    els.shareNote.textContent = notes.join(" ");
  }

  async function drawQr(link) {
    const { renderSVG } = await import("uqr");
    // The SVG is the library's drawing of modules, with nothing of ours in it but colours.
    els.shareQr.innerHTML = renderSVG(link, { ecc: "L", border: 2, pixelSize: 4, whiteColor: "#ffffff", blackColor: "#000000" });
  }

  async function copyLink() {
    try {
      await navigator.clipboard.writeText(els.shareLink.value);
      els.copyLink.textContent = "Copied";
    } catch {
      els.shareLink.select();
      els.copyLink.textContent = "Select and copy";
    }
    setTimeout(() => { els.copyLink.textContent = "Copy link"; }, 1500);
  }

  /** Where this browser's WsinferClient for conversation `id` finds the session to follow. */
  function followIn(id, session, token, turnNo = null, paused = false) {
    const url = new WsinferClient({ storage: { getItem: () => null, setItem() {}, removeItem() {} } }).url;
    const state = { url, session, token };
    if (turnNo != null) Object.assign(state, { turn: turnNo, seq: 0, text: "", status: paused ? "paused" : "running" });
    store.storage.setItem(clientKey(id), JSON.stringify(state));
  }

  /** From a `#follow=` link: {id} of its conversation, or {notice} saying why there is none. */
  async function importLink(text) {
    history.replaceState(null, "", location.pathname + location.search); // the token leaves the address bar
    let p;
    try {
      p = await unpackLink(text);
    } catch {
      p = null;
    }
    if (!validLink(p)) return { id: null, notice: "This link is cut or damaged: copy it again from the other device." };
    const known = store.list().find((c) => c.session === p.s);
    if (known) return { id: known.id }; // already followed here (or the link's own device)
    const c = conversationFromLink(p);
    followIn(c.id, p.s, p.k, p.t ?? null, p.p === 1);
    store.save(c, p.s);
    return { id: c.id };
  }

  /** GET /v1/sessions/{session}{path} (docs/protocol.md "Sessions"), or null. */
  async function sessionGet(session, token, path = "") {
    const headers = { "X-Wsinfer-Token": token };
    if (page.apiKey) headers.Authorization = `Bearer ${page.apiKey}`;
    try {
      const r = await fetch(`/v1/sessions/${encodeURIComponent(session)}${path}`, { headers, cache: "no-store" });
      return r.ok ? await r.json() : null;
    } catch {
      return null;
    }
  }

  /** The question turn `n` asked (its request's last user message), if the server has it. */
  async function questionOf(session, token, n) {
    const history = await sessionGet(session, token, `/messages?after_turn=${n - 1}`);
    const asked = history?.turns?.[0]?.turn === n ? history.turns[0].messages : null;
    const question = Array.isArray(asked) ? asked.findLast((m) => m.role === "user") : null;
    return typeof question?.content === "string" ? question.content : null;
  }

  let catchingUp = false;
  const busy = () => Boolean(page.turn && page.turn.active);

  /**
   * Turns of this session that another device started: follow the next one
   * (its answer replayed, then live), its question read back from the server
   * (GET /v1/sessions/{id}/messages; a server without that route: shown as
   * asked elsewhere).
   */
  async function catchUp() {
    const c = page.client;
    const conv = page.conv;
    if (catchingUp || !c || !c.session || busy() || conv.lastSession !== c.session || conv.lastTurn == null || !page.pathIsSession()) return;
    catchingUp = true;
    try {
      const info = await sessionGet(c.session, c.sessionToken);
      if (!info || c !== page.client || busy()) return;
      if (info.turn > conv.lastTurn) {
        const question = await questionOf(c.session, c.sessionToken, conv.lastTurn + 1);
        if (c !== page.client || busy()) return;
        if (conv.messages.at(-1)?.role !== "user") {
          conv.messages.push(question != null ? { role: "user", content: question, elsewhere: true } : { role: "user", content: "", remote: true });
        }
        conv.lastTurn += 1;
      } else if (!continuedElsewhere(conv.messages.at(-1), c.session, info)) {
        return;
      }
      // (A continued answer is replayed whole into its own place: chat.js reopenView.)
      followIn(conv.id, c.session, c.sessionToken, conv.lastTurn, info.status === "paused" && info.turn === conv.lastTurn);
      page.refollow();
    } finally {
      catchingUp = false;
    }
  }

  /** Whether the shown last answer `m`, cut by the token limit, went on since
   * (a Continue on another device): its turn runs again, or has more tokens. */
  function continuedElsewhere(m, session, info) {
    if (!m || m.role !== "assistant" || m.finish !== "length" || m.session !== session) return false;
    if (m.turn !== info.turn || info.turn !== page.conv.lastTurn) return false;
    return info.status !== "done" || (m.seq != null && info.seq > m.seq);
  }

  return { openShare, copyLink, importLink, catchUp };
}
