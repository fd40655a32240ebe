// The browser client (clients/browser/wsinfer.js) driven one step at a time,
// for the model-based test (tests/clients/model_world.py).
//
// One JSON command a line on stdin, one JSON reply a line on stdout:
// {sent: [messages the client sent since the last reply], state}. The
// WebSocket is a stand-in that the driver opens, feeds and drops on command,
// and timers (the reconnect backoff, a refused resume's retry) run only on
// `open` and `tick`, so every order is the test's choice, not the clock's.

import { createInterface } from "node:readline";

if (typeof globalThis.ErrorEvent === "undefined") {
  globalThis.ErrorEvent = class ErrorEvent extends Event {
    constructor(type, init = {}) {
      super(type);
      this.error = init.error;
      this.message = init.message;
    }
  };
}

let timers = [];
globalThis.setTimeout = (fn) => timers.push(fn);
globalThis.clearTimeout = (id) => {
  if (id) timers[id - 1] = null;
};

let socket = null;
let sent = [];

class StandInSocket {
  constructor(url, protocol) {
    this.url = url;
    this.protocol = protocol;
    this.readyState = 0;
    socket = this;
  }

  send(data) {
    if (this.readyState !== 1) throw new Error("send on a socket that is not open");
    if (this === socket) sent.push(JSON.parse(data));
  }

  close() {
    this.readyState = 3;
  }
}

const { WsinferClient } = await import(new URL("../../clients/browser/wsinfer.js", import.meta.url));

let client = null;
let turn = null;
let seen = [];

function runTimers() {
  const due = timers;
  timers = [];
  for (const fn of due) if (fn) fn();
}

const commands = {
  reset() {
    timers = [];
    socket = null;
    seen = [];
    client = new WsinferClient({ url: "ws://model/v1/ws", WebSocket: StandInSocket, minDelay: 0, storage: memory() });
    turn = client.generate({ prompt: "p" });
    turn.addEventListener("delta", (ev) => seen.push(ev.detail.text || ""));
  },
  open() {
    runTimers();
    if (socket && socket.readyState === 0) {
      socket.readyState = 1;
      socket.onopen();
    }
  },
  drop() {
    if (!socket || socket.readyState !== 1) return;
    const ws = socket;
    ws.readyState = 3;
    ws.onclose({ code: 1006, reason: "" });
  },
  recv(msg) {
    if (socket && socket.readyState === 1) socket.onmessage({ data: JSON.stringify(msg) });
  },
  resume() {
    turn.resume();
  },
  continue() {
    turn.continue();
  },
  tick() {
    runTimers();
  },
};

function memory() {
  const data = new Map();
  return {
    getItem: (k) => (data.has(k) ? data.get(k) : null),
    setItem: (k, v) => data.set(k, String(v)),
    removeItem: (k) => data.delete(k),
  };
}

function state() {
  const connected = socket !== null && socket.readyState === 1;
  const dialing = socket !== null && socket.readyState === 0;
  return {
    seq: turn.seq,
    text: turn.text,
    app_text: seen.join(""),
    done: turn.status === "done",
    failed: turn.status === "error",
    connected,
    wants: !connected && (dialing || timers.some((t) => t !== null)),
  };
}

for await (const line of createInterface({ input: process.stdin })) {
  let reply;
  try {
    const { cmd, msg } = JSON.parse(line);
    commands[cmd](msg);
    reply = { sent, state: state() };
  } catch (err) {
    reply = { error: String(err && err.stack ? err.stack : err), sent: [], state: {} };
  }
  sent = [];
  process.stdout.write(JSON.stringify(reply) + "\n");
}
