// The chat page's conversation list (the sidebar): search, open, rename, and
// delete with undo. A deletion waits UNDO_MS for Undo before the server's session
// is ended: until then the conversation is only out of the list (and out of
// storage, so other tabs see it gone), kept here to be put back.

import { WsinferClient } from "wsinfer-client";

const UNDO_MS = 8000;

/**
 * The list for the page `page`: its `els`, `store`, `actionButton`,
 * `openConversation(id)`, `closeSidebar()`, and (getters, read live) the
 * shown `conv`, its `turn` and the `apiKey`.
 */
export function conversationList(page) {
  const { els, store, actionButton } = page;
  let pendingDelete = null; // {snap, timer}

  function timeAgo(t) {
    const s = Math.max(0, (Date.now() - t) / 1000);
    if (s < 60) return "just now";
    if (s < 3600) return `${Math.floor(s / 60)} min ago`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
    return new Date(t).toLocaleDateString();
  }

  function renderList() {
    const query = els.search.value.trim();
    const shown = store.list().filter((c) => !query || store.matches(c.id, c.title, query));
    els.noMatch.hidden = !query || shown.length > 0;
    els.list.replaceChildren(...shown.map(listItem));
  }

  function listItem(c) {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    if (c.session) li.dataset.session = c.session;
    if (page.conv && c.id === page.conv.id) li.setAttribute("aria-current", "true");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    const title = document.createElement("span");
    title.textContent = c.title;
    const when = document.createElement("small");
    when.textContent = timeAgo(c.updated);
    open.append(title, when);
    open.addEventListener("click", () => { page.openConversation(c.id); page.closeSidebar(); });
    const rename = actionButton("✎", "rename", () => startRename(li, c));
    rename.setAttribute("aria-label", `Rename “${c.title}”`);
    const del = actionButton("✕", "delete", () => deleteConversation(c.id));
    del.setAttribute("aria-label", `Delete “${c.title}”`);
    li.append(open, rename, del);
    return li;
  }

  function startRename(li, c) {
    const box = document.createElement("input");
    box.className = "rename-box";
    box.value = c.title;
    box.setAttribute("aria-label", "New title");
    let done = false;
    const finish = (keep) => {
      if (done) return;
      done = true;
      const title = box.value.trim();
      const { conv } = page;
      if (keep && title && title !== c.title && store.rename(c.id, title) && conv && conv.id === c.id) {
        conv.title = title;
        els.title.textContent = title;
      }
      renderList();
    };
    box.addEventListener("keydown", (e) => {
      if (e.key === "Enter") { e.preventDefault(); finish(true); }
      if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); finish(false); }
    });
    box.addEventListener("blur", () => finish(true));
    li.replaceChildren(box);
    box.focus();
    box.select();
  }

  function deleteConversation(id) {
    endDeletion(); // one undo at a time: an earlier deletion is final now
    if (page.conv && id === page.conv.id) {
      const { turn } = page;
      if (turn && turn.active) turn.stop();
      page.openConversation(null); // disconnects: the session stays until the undo is over
    }
    const snap = store.snapshot(id); // as the disconnect left it
    store.remove(id);
    renderList();
    pendingDelete = { snap, timer: setTimeout(endDeletion, UNDO_MS) };
    const title = snap.entry ? snap.entry.title : "the conversation";
    els.toastText.textContent = `Deleted “${title}”.`;
    els.toast.hidden = false;
  }

  function undoDelete() {
    if (!pendingDelete) return;
    const { snap, timer } = pendingDelete;
    clearTimeout(timer);
    pendingDelete = null;
    els.toast.hidden = true;
    store.restore(snap);
    page.openConversation(snap.id);
  }

  /** The undo time is over: end the deleted conversation's session on the server. */
  function endDeletion() {
    if (!pendingDelete) return;
    const { snap, timer } = pendingDelete;
    clearTimeout(timer);
    pendingDelete = null;
    els.toast.hidden = true;
    if (!snap.client) return;
    const scratch = new Map([["s", snap.client]]);
    const storage = { getItem: (k) => scratch.get(k) ?? null, setItem: (k, v) => scratch.set(k, v), removeItem: (k) => scratch.delete(k) };
    const other = new WsinferClient({ storage, storageKey: "s", token: page.apiKey });
    if (!other.session) return;
    other.addEventListener("open", () => other.close(), { once: true });
    other.connect();
  }

  return { renderList, undoDelete, endDeletion };
}
