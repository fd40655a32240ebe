// The chat page's API key. A server started with --api-key refuses the WebSocket
// handshake with HTTP 401, which a browser reports only as a closed socket (so the
// client would retry for ever). The page asks /v1/models, which answers 401 to the
// same missing or wrong key, and then asks the user. The key lives in this tab's
// sessionStorage (localStorage if asked to remember it), never in the address bar,
// the history or a Referer.

const KEY_ITEM = "wsinfer.apiKey";

/** A `?token=` link: take the key, then drop it from the address bar. */
function takeKeyFromUrl(query) {
  if (!query.has("token")) return null;
  const key = query.get("token");
  query.delete("token");
  const search = query.toString();
  history.replaceState(null, "", `${location.pathname}${search ? `?${search}` : ""}${location.hash}`);
  sessionStorage.setItem(KEY_ITEM, key);
  return key || null;
}

async function keyAccepted(key) {
  try {
    const headers = key ? { Authorization: `Bearer ${key}` } : {};
    const response = await fetch("/v1/models", { headers, cache: "no-store" });
    return response.status !== 401;
  } catch {
    return true; // the server is unreachable: the connection state says so
  }
}

/**
 * The key (`value`), `check()` (ask for one if the server refuses ours) and
 * `submit` (the dialog's form handler). `on.asking()` runs when the dialog
 * opens, `on.accepted()` once a new key is taken.
 */
export function apiKeyGate(els, query, on) {
  let apiKey = takeKeyFromUrl(query) ?? sessionStorage.getItem(KEY_ITEM) ?? localStorage.getItem(KEY_ITEM) ?? undefined;
  let checkingKey = false;

  async function check() {
    if (checkingKey || els.keyDialog.open) return;
    checkingKey = true;
    try {
      if (!(await keyAccepted(apiKey))) askForKey(Boolean(apiKey));
    } finally {
      checkingKey = false;
    }
  }

  function askForKey(refused) {
    on.asking();
    els.keyError.hidden = !refused;
    if (!els.keyDialog.open) els.keyDialog.showModal();
    els.keyInput.focus();
  }

  async function submit(event) {
    event.preventDefault();
    const key = els.keyInput.value.trim();
    if (!key) return;
    if (!(await keyAccepted(key))) { askForKey(true); return; }
    apiKey = key;
    sessionStorage.setItem(KEY_ITEM, key);
    if (els.rememberKey.checked) localStorage.setItem(KEY_ITEM, key);
    else localStorage.removeItem(KEY_ITEM);
    els.keyInput.value = "";
    els.keyDialog.close();
    on.accepted();
  }

  return { get value() { return apiKey; }, check, submit };
}
