// The chat page: messages through /v1/chat/completions (the server applies the model's chat template),
// streamed into the page as they arrive, with each reply's time to first token and tokens/s.

import { getJSON, streamEvents } from "./api.js";

const $ = (id) => document.getElementById(id);

export class Chat {
  constructor() {
    this.history = []; // {role, content} of the finished turns
    this.controller = null; // the AbortController of the reply streaming now
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); this.send(); }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("clear").addEventListener("click", () => { this.stop(); this.history = []; $("messages").replaceChildren(); });
  }

  // The base model and its adapters, from /v1/models.
  async loadModels() {
    const models = await getJSON("/v1/models");
    const select = $("model");
    const chosen = select.value;
    select.replaceChildren(...models.data.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.parent ? `${m.id} (adapter of ${m.parent})` : m.id;
      return option;
    }));
    if (chosen && models.data.some((m) => m.id === chosen)) select.value = chosen;
  }

  body(messages) {
    const body = {
      model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
      temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
    };
    if ($("seed").value !== "") body.seed = Number($("seed").value);
    const schema = $("schema").value.trim();
    if (schema) {
      body.response_format = { type: "json_schema", json_schema: { name: "console", schema: JSON.parse(schema) } };
    }
    return body;
  }

  async send() {
    const text = $("prompt").value;
    if (!text.trim() || this.controller) return;
    const system = $("system").value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...this.history,
      { role: "user", content: text }];
    let body;
    const reply = addMessage("assistant", "");
    try {
      body = this.body(messages);
    } catch (e) {
      return fail(reply, `the JSON schema does not parse: ${e.message}`);
    }
    addMessage("user", text, reply);
    $("prompt").value = "";
    this.controller = new AbortController();
    setStreaming(true);
    const sent = performance.now();
    let first = null;
    let last = sent;
    let tokens = null;
    const content = reply.querySelector(".content");
    try {
      await streamEvents("/v1/chat/completions", body, (event) => {
        if (event.usage) tokens = event.usage.completion_tokens;
        const delta = event.choices && event.choices[0] && event.choices[0].delta;
        if (delta && delta.content) {
          last = performance.now();
          if (first === null) first = last;
          content.textContent += delta.content;
          reply.scrollIntoView({ block: "end" });
        }
      }, this.controller.signal);
      this.history.push({ role: "user", content: text }, { role: "assistant", content: content.textContent });
      reply.classList.add("done");
    } catch (e) {
      if (e.name === "AbortError") {
        reply.classList.add("stopped");
      } else {
        fail(reply, e.message);
      }
    } finally {
      this.controller = null;
      setStreaming(false);
      showTimes(reply, sent, first, last, tokens);
    }
  }

  stop() {
    if (this.controller) this.controller.abort();
  }
}

// A message element: <div class="msg role"><div class="content"></div><div class="meta"></div></div>,
// placed before `before` (a reply waits below its prompt) or at the end.
function addMessage(role, text, before) {
  const msg = document.createElement("div");
  msg.className = `msg ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  msg.append(content, meta);
  $("messages").insertBefore(msg, before || null);
  return msg;
}

function fail(reply, message) {
  reply.classList.add("error");
  reply.querySelector(".meta").textContent = message;
}

function setStreaming(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

function showTimes(reply, sent, first, last, tokens) {
  if (first === null || reply.classList.contains("error")) {
    if (reply.classList.contains("stopped")) reply.querySelector(".meta").textContent = "stopped";
    return;
  }
  const parts = [`TTFT ${Math.round(first - sent)} ms`];
  if (tokens !== null) {
    parts.unshift(`${tokens} tokens`);
    if (tokens > 1 && last > first) parts.push(`${((tokens - 1) * 1000 / (last - first)).toFixed(1)} tokens/s`);
  }
  if (reply.classList.contains("stopped")) parts.push("stopped");
  reply.querySelector(".meta").textContent = parts.join(" · ");
}
