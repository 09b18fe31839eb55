// The server's API as the console calls it: the key the user gave (kept in this browser), JSON calls, and
// the server-sent events of a streaming completion.

const KEY_ITEM = "numaserve.apiKey";

export class Unauthorized extends Error {}

export function apiKey() {
  return localStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_ITEM, key);
  else localStorage.removeItem(KEY_ITEM);
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (apiKey()) h["Authorization"] = `Bearer ${apiKey()}`;
  return h;
}

// The OpenAI error body's message, or the status line.
async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON */ }
  return response.status === 401 ? new Unauthorized(message) : new Error(message);
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers(false) });
  if (!response.ok) throw await failure(response);
  return response.json();
}

// POST body with stream: true; calls onEvent(parsed JSON) per event until [DONE]. signal aborts it (the
// server sees the connection close and aborts the request).
export async function streamEvents(path, body, onEvent, signal) {
  const response = await fetch(path, {
    method: "POST", headers: headers(true), body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue; // keep-alive comments, blank lines
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new Error(parsed.error.message);
        onEvent(parsed);
      }
    }
  }
}
