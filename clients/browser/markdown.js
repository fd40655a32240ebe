// Markdown for the chat page: the model's text, parsed by marked, code
// highlighted by highlight.js, then sanitized by DOMPurify before it touches
// the DOM. The model's output is untrusted: raw HTML in it is shown as text
// (never parsed), and DOMPurify removes anything executable that Markdown
// itself could produce (javascript: links and the like).

import { Marked } from "marked";
import DOMPurify from "dompurify";
import hljs from "highlight.js";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);

function highlight(code, lang) {
  const language = (lang || "").trim().split(/\s+/)[0].toLowerCase();
  if (language && hljs.getLanguage(language)) {
    const html = hljs.highlight(code, { language, ignoreIllegals: true }).value;
    return { html, language };
  }
  return { html: escapeHtml(code), language: language.replace(/[^a-z0-9+#-]/g, "") };
}

const marked = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    // Raw HTML from the model is text, as it was typed.
    html: ({ text }) => escapeHtml(text),
    // An image would load a remote URL (a tracking pixel at best): link it instead.
    image: ({ href, text }) => `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`,
    code({ text, lang }) {
      const { html, language } = highlight(text, lang);
      const label = language ? ` data-lang="${escapeHtml(language)}"` : "";
      return `<pre${label}><code class="hljs${language ? ` language-${language}` : ""}">${html}</code></pre>\n`;
    },
  },
});

const PURIFY = {
  FORBID_TAGS: ["style", "img", "form", "input", "button", "textarea", "select", "iframe", "svg", "math"],
  FORBID_ATTR: ["style"],
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

/** Safe HTML for a Markdown text (possibly cut mid-stream). */
export function toSafeHtml(markdown) {
  return DOMPurify.sanitize(marked.parse(markdown), PURIFY);
}

/** Put `markdown` into `el` (sanitized) and give each code block a copy button. */
export function renderMarkdown(el, markdown) {
  el.innerHTML = toSafeHtml(markdown);
  el.source = markdown;
  for (const pre of el.querySelectorAll("pre")) addCopyButton(pre);
}

function addCopyButton(pre) {
  const bar = document.createElement("div");
  bar.className = "code-bar";
  const lang = document.createElement("span");
  lang.className = "code-lang";
  lang.textContent = pre.dataset.lang || "text";
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy";
  button.textContent = "Copy";
  button.setAttribute("aria-label", "Copy code");
  button.addEventListener("click", () => copyCode(pre, button));
  bar.append(lang, button);
  pre.prepend(bar);
}

async function copyCode(pre, button) {
  const text = pre.querySelector("code")?.textContent ?? "";
  let ok = false;
  try {
    await navigator.clipboard.writeText(text);
    ok = true;
  } catch {
    ok = legacyCopy(text); // no clipboard API (plain http on a LAN address)
  }
  button.textContent = ok ? "Copied" : "Copy failed";
  button.dataset.copied = String(ok);
  setTimeout(() => { button.textContent = "Copy"; delete button.dataset.copied; }, 1500);
}

function legacyCopy(text) {
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch { ok = false; }
  area.remove();
  return ok;
}

/**
 * Re-renders a streaming message at most once per `interval` ms, and spends
 * at most a fifth of the time rendering: each render parses the whole text,
 * so a long answer on a slow device renders less often instead of falling
 * behind the stream.
 */
export class StreamingMarkdown {
  constructor(el, interval = 50) {
    this.el = el;
    this.minInterval = interval;
    this.interval = interval;
    this.text = "";
    this.timer = null;
  }

  set(text) {
    this.text = text;
    this.el.source = text;
    if (this.timer === null) this.timer = setTimeout(() => this.flush(), this.interval);
  }

  flush() {
    clearTimeout(this.timer);
    this.timer = null;
    const started = performance.now();
    renderMarkdown(this.el, this.text);
    this.interval = Math.max(this.minInterval, 4 * (performance.now() - started));
  }
}
