// The playground: a chat streamed from /v1/chat/completions, each answer's timings and tokens.
"use strict";

const history = []; // [{role, content}]
let running = null; // {controller} while an answer streams

function num(id) {
  const v = document.getElementById(id).value;
  return v === "" ? null : Number(v);
}

function requestBody(messages) {
  const body = {
    model: document.getElementById("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    logprobs: true,
    top_logprobs: 1,
  };
  for (const k of ["temperature", "top_p", "top_k", "max_tokens", "seed"]) {
    const v = num(k);
    if (v !== null) body[k] = v;
  }
  if (document.getElementById("ignore_eos").checked) body.ignore_eos = true;
  Object.assign(body, structuredOutputs());
  return body;
}

// The structured-output fields for the chosen format: OpenAI's response_format for JSON, vLLM's
// structured_outputs for a regex or a list of choices. A schema that is not JSON is refused here,
// in the page; one the server cannot compile comes back as its 400.
function structuredOutputs() {
  const kind = document.getElementById("response_format").value;
  const text = document.getElementById("constraint").value.trim();
  if (kind === "json_object") return { response_format: { type: "json_object" } };
  if (kind === "json_schema") {
    let schema;
    try {
      schema = JSON.parse(text);
    } catch (e) {
      throw new Error("the JSON schema is not valid JSON: " + e.message);
    }
    return { response_format: { type: "json_schema", json_schema: { name: "playground", schema, strict: true } } };
  }
  if (kind === "regex") return { structured_outputs: { regex: text } };
  if (kind === "choice") return { structured_outputs: { choice: text.split("\n").map((c) => c.trim()).filter(Boolean) } };
  return {};
}

function chatMessages() {
  const system = document.getElementById("system").value.trim();
  return (system ? [{ role: "system", content: system }] : []).concat(history);
}

function addMessage(role, text) {
  const box = el("div", "msg " + role);
  box.appendChild(el("div", "content", text));
  document.getElementById("messages").appendChild(box);
  return box;
}

function timingsLine(t, clientTtft) {
  const parts = [];
  if (t) {
    parts.push(`queue ${fmt(t.queue_ms)} ms`);
    parts.push(`TTFT ${fmt(t.queue_ms + t.prompt_ms)} ms`);
    parts.push(`prefill ${fmt(t.prompt_per_second)} tok/s (${t.prompt_n} prompt + ${t.cache_n} cached tokens)`);
    parts.push(`decode ${fmt(t.predicted_per_second)} tok/s (${t.predicted_n} tokens)`);
  }
  if (clientTtft !== null) parts.push(`first text after ${fmt(clientTtft)} ms here`);
  return parts.join(" · ");
}

function setRunning(on) {
  document.getElementById("send").disabled = on;
  document.getElementById("stop").disabled = !on;
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const box = addMessage("assistant", "");
  const content = box.querySelector(".content");
  const timings = box.appendChild(el("div", "timings"));
  const status = box.appendChild(el("div", "status muted", "waiting for the first token…"));
  const messages = chatMessages();
  const answer = { text: "", tokens: [], id: null, messages };
  const controller = new AbortController();
  running = { controller };
  setRunning(true);
  const t0 = performance.now();
  let clientTtft = null;
  let finalTimings = null;
  let finish = null;
  try {
    const resp = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(messages)),
      signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    await readSSE(resp, (chunk) => {
      if (chunk === "[DONE]") return;
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.id) answer.id = chunk.id;
      if (chunk.timings) finalTimings = chunk.timings;
      for (const choice of chunk.choices || []) {
        const delta = (choice.delta && choice.delta.content) || "";
        if (delta) {
          if (clientTtft === null) clientTtft = performance.now() - t0;
          answer.text += delta;
          content.textContent = answer.text;
          status.textContent = "streaming…";
        }
        if (choice.logprobs && choice.logprobs.content) answer.tokens.push(...choice.logprobs.content);
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      timings.textContent = timingsLine(finalTimings, clientTtft);
    });
    status.textContent = `finished (${finish || "?"}) in ${fmt(performance.now() - t0)} ms`;
  } catch (e) {
    if (e.name === "AbortError") {
      status.textContent = `stopped after ${fmt(performance.now() - t0)} ms: the server cancels the request`;
      status.className = "status muted stopped";
    } else {
      status.textContent = "error: " + e.message;
      status.className = "status error";
    }
  } finally {
    running = null;
    setRunning(false);
  }
  timings.textContent = timingsLine(finalTimings, clientTtft);
  history.push({ role: "assistant", content: answer.text });
  addTools(box, answer);
}

function addTools(box, answer) {
  const tools = box.appendChild(el("div", "tools"));
  const view = el("div", "token-view");
  view.hidden = true;
  const button = tools.appendChild(el("button", "show-tokens", "tokens"));
  button.type = "button";
  button.addEventListener("click", async () => {
    view.hidden = !view.hidden;
    if (!view.hidden && !view.childElementCount) await renderTokens(view, answer);
  });
  if (answer.id) {
    const a = tools.appendChild(el("a", "trace-link", "trace"));
    a.href = "/dashboard#trace=" + encodeURIComponent(answer.id);
  }
  box.appendChild(view);
}

function probClass(lp) {
  if (lp === null || lp === undefined) return "pn";
  const p = Math.exp(lp);
  return p > 0.8 ? "p4" : p > 0.5 ? "p3" : p > 0.2 ? "p2" : p > 0.05 ? "p1" : "p0";
}

function tokenSpan(text, lp, i, kind) {
  const s = el("span", `tok ${kind} ${probClass(lp)}${i % 2 ? " odd" : ""}`, text);
  s.title = lp === null || lp === undefined
    ? `${JSON.stringify(text)} (first token: no logprob)`
    : `${JSON.stringify(text)} logprob ${lp.toFixed(3)} (p = ${Math.exp(lp).toFixed(3)})`;
  return s;
}

// The prompt's tokens (the chat template applied: /tokenize) scored by the model (completions
// with echo and max_tokens 0), then the answer's own tokens and logprobs from the stream.
async function renderTokens(view, answer) {
  view.appendChild(el("span", "muted", "loading tokens…"));
  try {
    const model = document.getElementById("model").value || undefined;
    const tok = await apiFetch("/tokenize", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model, messages: answer.messages, add_generation_prompt: true }),
    });
    if (!tok.ok) throw new Error(await errorText(tok));
    const ids = (await tok.json()).tokens;
    const scored = await apiFetch("/v1/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model, prompt: ids, echo: true, max_tokens: 0, logprobs: 0 }),
    });
    if (!scored.ok) throw new Error(await errorText(scored));
    const lp = (await scored.json()).choices[0].logprobs;
    view.replaceChildren();
    view.appendChild(el("h4", "", `prompt: ${ids.length} tokens`));
    const prompt = view.appendChild(el("div", "prompt-tokens"));
    lp.tokens.forEach((t, i) => prompt.appendChild(tokenSpan(t, lp.token_logprobs[i], i, "prompt")));
    view.appendChild(el("h4", "", `answer: ${answer.tokens.length} tokens`));
    const out = view.appendChild(el("div", "answer-tokens"));
    answer.tokens.forEach((t, i) => out.appendChild(tokenSpan(t.token, t.logprob, i, "answer")));
  } catch (e) {
    view.replaceChildren(el("span", "error", "tokens unavailable: " + e.message));
  }
}

async function loadModels() {
  const info = document.getElementById("model-info");
  try {
    const resp = await apiFetch("/v1/models");
    if (!resp.ok) throw new Error(await errorText(resp));
    const select = document.getElementById("model");
    for (const m of (await resp.json()).data) {
      const o = el("option", "", m.id);
      o.value = m.id;
      select.appendChild(o);
      info.textContent = `${m.id} · context ${m.max_model_len} tokens`;
    }
  } catch (e) {
    info.textContent = "server: " + e.message;
    info.className = "error";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  setUpKeyForm();
  const form = document.getElementById("chat-form");
  const prompt = document.getElementById("prompt");
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = prompt.value.trim();
    if (!text || running) return;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      form.requestSubmit();
    }
  });
  document.getElementById("stop").addEventListener("click", () => running && running.controller.abort());
  document.getElementById("clear").addEventListener("click", () => {
    history.length = 0;
    document.getElementById("messages").replaceChildren();
  });
  loadModels();
});
