// What both pages share: the API key (asked for on a 401, kept for this tab, sent as Bearer),
// fetch with it, error messages out of the server's error bodies, and an SSE reader over fetch
// (EventSource cannot send an Authorization header).
"use strict";

const KEY_STORE = "inferlab.api_key";

function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

let keyWaiters = [];

// Show the key form; resolves once the user has entered a key.
function askKey(message) {
  const form = document.getElementById("key-form");
  document.getElementById("key-message").textContent = message || "This server needs an API key.";
  form.hidden = false;
  document.getElementById("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function setUpKeyForm() {
  const form = document.getElementById("key-form");
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = document.getElementById("key-input").value.trim();
    if (!value) return;
    sessionStorage.setItem(KEY_STORE, value);
    form.hidden = true;
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((w) => w());
  });
}

// fetch with the key; a 401 asks for the key and tries again (as often as the user answers).
async function apiFetch(path, options) {
  for (;;) {
    const opts = Object.assign({}, options || {});
    opts.headers = authHeaders(opts.headers);
    const resp = await fetch(path, opts);
    if (resp.status !== 401) return resp;
    const msg = await errorText(resp);
    await askKey(apiKey() ? "The key was refused (" + msg + "). Enter another:" : "This server needs an API key.");
  }
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return body.error.message;
    return JSON.stringify(body);
  } catch (e) {
    return "HTTP " + resp.status + " " + resp.statusText;
  }
}

// Calls onData(parsed JSON or "[DONE]") for each `data:` event of a streamed response.
async function readSSE(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      onData(data === "[DONE]" ? data : JSON.parse(data));
    }
  }
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toFixed(digits === undefined ? 1 : digits);
}
