// tpuserve's built-in page: a chat playground on /v1/chat/completions (streamed) and a live view of
// /metrics. Plain browser JavaScript, no dependencies. With --api-key, every call carries the key as
// "Authorization: Bearer", as an OpenAI client would; the key is kept in sessionStorage (this tab only).
"use strict";

const KEY_STORAGE = "tpuserve.apiKey";
const POLL_MS = 1000;
const WINDOW_S = 300; // the plot and the windowed rates cover the last 5 minutes
const RETRY_MS = 3000;

const $ = (id) => document.getElementById(id);

let apiKey = sessionStorage.getItem(KEY_STORAGE) || "";
let needsKey = false;
let turns = []; // the conversation sent with each request: {role, content}
let inFlight = null; // AbortController of the answer being streamed
let samples = []; // metric samples of the last WINDOW_S seconds, oldest first
let pollTimer = null;

class Unauthorized extends Error {}

// ---- HTTP ----

async function api(path, init = {}) {
  const headers = new Headers(init.headers || {});
  if (apiKey) headers.set("Authorization", `Bearer ${apiKey}`);
  const response = await fetch(path, { ...init, headers });
  if (response.status === 401) {
    needsKey = true;
    throw new Unauthorized("the server needs an API key");
  }
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error.message || message;
    } catch (_) {
      // not an OpenAI-shaped error body: the status line says enough
    }
    throw new Error(message);
  }
  return response;
}

// Yields the data of each server-sent event of a fetch response body.
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

// ---- connecting and the API key ----

async function connect() {
  try {
    const models = (await (await api("/v1/models")).json()).data;
    const select = $("model");
    const previous = select.value;
    select.replaceChildren(
      ...models.map((m) => {
        const option = new Option(m.id, m.id);
        option.title = m.root || m.id;
        return option;
      }),
    );
    if (models.some((m) => m.id === previous)) select.value = previous;
    const context = models[0] && models[0].max_model_len ? ` · context ${models[0].max_model_len} tokens` : "";
    $("server-state").textContent = `connected${needsKey ? " with API key" : ""}${context}`;
    $("server-state").className = "muted";
    $("key-change").hidden = !needsKey;
    setBusy(false);
    startPolling();
  } catch (e) {
    if (e instanceof Unauthorized) {
      askForKey(apiKey ? "The server rejected this key." : "");
    } else {
      showState(`cannot reach the server (${e.message}); retrying`, true);
      setTimeout(connect, RETRY_MS);
    }
  }
}

function askForKey(message) {
  stopPolling();
  $("send").disabled = true;
  $("key-change").hidden = false;
  showState("API key needed", true);
  $("key-error").textContent = message;
  $("key-error").hidden = !message;
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
  $("api-key").focus();
}

function useKey(event) {
  event.preventDefault();
  apiKey = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORAGE, apiKey);
  $("key-dialog").close();
  connect();
}

function showState(text, isError) {
  $("server-state").textContent = text;
  $("server-state").className = isError ? "error" : "muted";
}

// ---- chat ----

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text; // always text, never markup
  el.append(label, body);
  $("conversation").append(el);
  scrollToEnd();
  return { el, body };
}

function scrollToEnd() {
  const box = $("conversation");
  box.scrollTop = box.scrollHeight;
}

function setBusy(busy) {
  $("send").disabled = busy || !$("model").value;
  $("stop").disabled = !busy;
}

function numberInput(id, fallback) {
  const x = Number($(id).value);
  return $(id).value !== "" && Number.isFinite(x) ? x : fallback;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || inFlight) return;
  $("prompt").value = "";
  turns.push({ role: "user", content: text });
  addMessage("user", text);
  const view = addMessage("assistant", "");
  view.el.dataset.state = "streaming";
  const stats = document.createElement("div");
  stats.className = "stats";
  view.el.append(stats);

  const system = $("system").value;
  const request = {
    model: $("model").value,
    messages: [...(system.trim() ? [{ role: "system", content: system }] : []), ...turns],
    temperature: numberInput("temperature", 1),
    top_p: numberInput("top-p", 1),
    max_tokens: Math.max(1, Math.round(numberInput("max-tokens", 256))),
    stream: true,
    stream_options: { include_usage: true },
  };
  const controller = new AbortController();
  inFlight = controller;
  setBusy(true);
  const start = performance.now();
  let firstAt = null;
  let answer = "";
  let chunks = 0;
  let usage = null;
  let finish = null;
  let state = "done";
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(request),
      signal: controller.signal,
    });
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          if (firstAt === null) firstAt = performance.now();
          answer += delta;
          chunks += 1;
          view.body.textContent = answer;
          scrollToEnd();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  } catch (e) {
    if (controller.signal.aborted) {
      state = "stopped"; // the connection is closed: the server aborts the request
    } else {
      state = "error";
      view.body.textContent = answer ? `${answer}\n\n[${e.message}]` : e.message;
      if (e instanceof Unauthorized) askForKey("The server rejected this key.");
    }
  } finally {
    inFlight = null;
    setBusy(false);
  }
  const end = performance.now();
  if (answer) turns.push({ role: "assistant", content: answer });
  else turns.pop(); // nothing came back: the next request should not repeat this question unanswered
  view.el.dataset.state = state;
  describeAnswer(stats, { state, start, firstAt, end, chunks, usage, finish });
  scrollToEnd();
}

function describeAnswer(stats, a) {
  const parts = [];
  const completion = a.usage ? a.usage.completion_tokens : a.chunks;
  if (a.usage) {
    const cached = a.usage.prompt_tokens_details && a.usage.prompt_tokens_details.cached_tokens;
    parts.push(`${a.usage.prompt_tokens} prompt tokens${cached ? ` (${cached} cached)` : ""}`);
    parts.push(`${completion} answer tokens`);
  } else if (a.chunks) {
    parts.push(`~${completion} answer tokens`); // one streamed chunk per token, about
  }
  if (a.firstAt !== null) {
    const ttft = a.firstAt - a.start;
    parts.push(`time to first token ${ttft < 1000 ? `${ttft.toFixed(0)} ms` : `${(ttft / 1000).toFixed(2)} s`}`);
    stats.dataset.ttftMs = ttft.toFixed(1);
    const decodeS = (a.end - a.firstAt) / 1000;
    if (completion > 1 && decodeS > 0) parts.push(`${((completion - 1) / decodeS).toFixed(1)} tokens/s`);
  }
  if (a.state === "stopped") parts.push("stopped");
  else if (a.finish) parts.push(`finish: ${a.finish}`);
  stats.dataset.completionTokens = String(completion);
  if (a.usage) stats.dataset.promptTokens = String(a.usage.prompt_tokens);
  stats.textContent = parts.join(" · ");
}

function stop() {
  if (inFlight) inFlight.abort();
}

function clearConversation() {
  stop();
  turns = [];
  $("conversation").replaceChildren();
}

// ---- live metrics ----

// Prometheus text format -> Map(metric name -> value summed over its label sets).
function parseMetrics(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{.*\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const value = Number(m[2]);
    if (Number.isFinite(value)) values.set(m[1], (values.get(m[1]) || 0) + value);
  }
  return values;
}

function sampleOf(metrics, t) {
  const get = (name) => metrics.get(name) || 0;
  return {
    t,
    generated: get("vllm:generation_tokens_total"),
    prompt: get("vllm:prompt_tokens_total"),
    running: get("vllm:num_requests_running"),
    waiting: get("vllm:num_requests_waiting"),
    kv: get("vllm:kv_cache_usage_perc"),
    prefixHits: get("vllm:prefix_cache_hits_total"),
    prefixQueries: get("vllm:prefix_cache_queries_total"),
    specOn: metrics.has("vllm:spec_decode_num_draft_tokens_total"),
    specDrafts: get("vllm:spec_decode_num_drafts_total"),
    specDraftTokens: get("vllm:spec_decode_num_draft_tokens_total"),
    specAccepted: get("vllm:spec_decode_num_accepted_tokens_total"),
    finished: get("vllm:request_success_total"),
  };
}

async function poll() {
  pollTimer = null;
  try {
    const text = await (await api("/metrics")).text();
    const now = performance.now() / 1000;
    const s = sampleOf(parseMetrics(text), now);
    const last = samples[samples.length - 1];
    if (last && s.generated < last.generated) samples = []; // the server restarted
    samples.push(s);
    while (samples.length && samples[0].t < now - WINDOW_S - 2) samples.shift();
    s.genRate = last ? (s.generated - last.generated) / (s.t - last.t) : 0;
    s.promptRate = last ? (s.prompt - last.prompt) / (s.t - last.t) : 0;
    showMetrics(s);
    $("metrics-age").textContent = `· updated ${new Date().toLocaleTimeString()}`;
    $("metrics-age").className = "muted";
  } catch (e) {
    if (e instanceof Unauthorized) {
      askForKey("The server rejected this key.");
      return;
    }
    $("metrics-age").textContent = `· metrics unavailable (${e.message})`;
    $("metrics-age").className = "error";
  }
  if (!pollTimer) pollTimer = setTimeout(poll, POLL_MS);
}

function startPolling() {
  if (!pollTimer) pollTimer = setTimeout(poll, 0);
}

function stopPolling() {
  clearTimeout(pollTimer);
  pollTimer = null;
}

function percent(x) {
  return `${(100 * x).toFixed(x < 0.1 ? 1 : 0)}%`;
}

function showMetrics(s) {
  $("stat-tps").textContent = s.genRate.toFixed(1);
  $("stat-prompt-tps").textContent = s.promptRate.toFixed(1);
  $("stat-running").textContent = String(s.running);
  $("stat-waiting").textContent = String(s.waiting);
  $("stat-kv").textContent = percent(s.kv);
  $("stat-done").textContent = String(s.finished);
  // Prefix hits over the window; since start when nothing was looked up in it.
  const first = samples[0];
  let queries = s.prefixQueries - first.prefixQueries;
  let hits = s.prefixHits - first.prefixHits;
  if (queries <= 0) {
    queries = s.prefixQueries;
    hits = s.prefixHits;
  }
  $("stat-prefix").textContent = queries > 0 ? percent(hits / queries) : "–";
  if (!s.specOn) {
    $("stat-spec").textContent = "off";
  } else if (s.specDraftTokens > 0) {
    const perStep = s.specDrafts > 0 ? ` · ${(1 + s.specAccepted / s.specDrafts).toFixed(2)}/step` : "";
    $("stat-spec").textContent = `${percent(s.specAccepted / s.specDraftTokens)}${perStep}`;
  } else {
    $("stat-spec").textContent = "–";
  }
  drawPlot();
}

// Scales up to 1, 2 or 5 times a power of ten, so axis labels stay round.
function niceMax(x) {
  if (x <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(x));
  return [1, 2, 5, 10].map((k) => k * p).find((v) => v >= x);
}

function drawPlot() {
  const canvas = $("plot");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const style = getComputedStyle(document.documentElement);
  const color = (name) => style.getPropertyValue(name).trim();
  const pad = { left: 42, right: 40, top: 10, bottom: 20 };
  const w = width - pad.left - pad.right;
  const h = height - pad.top - pad.bottom;
  const now = performance.now() / 1000;
  const x = (t) => pad.left + w * (1 - (now - t) / WINDOW_S);
  const tpsMax = niceMax(Math.max(...samples.map((s) => s.genRate || 0)));
  const runMax = niceMax(Math.max(1, ...samples.map((s) => s.running)));

  g.font = "11px system-ui, sans-serif";
  g.lineWidth = 1;
  g.strokeStyle = color("--line");
  g.fillStyle = color("--muted");
  for (let i = 0; i <= 4; i++) {
    const y = pad.top + (h * i) / 4;
    g.beginPath();
    g.moveTo(pad.left, y);
    g.lineTo(pad.left + w, y);
    g.stroke();
  }
  g.textAlign = "right";
  g.fillText(String(tpsMax), pad.left - 4, pad.top + 8);
  g.fillText("0", pad.left - 4, pad.top + h);
  g.textAlign = "left";
  g.fillText("100%", pad.left + w + 4, pad.top + 8);
  g.fillText(`${runMax} req`, pad.left + w + 4, pad.top + 22);
  g.textAlign = "center";
  for (let m = 0; m <= WINDOW_S / 60; m++) {
    g.fillText(m === 0 ? "now" : `-${m} min`, x(now - 60 * m), height - 5);
  }

  const line = (value, max, stroke, fill) => {
    const points = samples.filter((s) => now - s.t <= WINDOW_S);
    if (points.length < 2) return;
    const y = (v) => pad.top + h * (1 - Math.min(v, max) / max);
    g.beginPath();
    points.forEach((s, i) => (i ? g.lineTo(x(s.t), y(value(s))) : g.moveTo(x(s.t), y(value(s)))));
    g.strokeStyle = stroke;
    g.lineWidth = 1.5;
    g.stroke();
    if (fill) {
      g.lineTo(x(points[points.length - 1].t), pad.top + h);
      g.lineTo(x(points[0].t), pad.top + h);
      g.closePath();
      g.globalAlpha = 0.15;
      g.fillStyle = stroke;
      g.fill();
      g.globalAlpha = 1;
    }
  };
  line((s) => s.genRate || 0, tpsMax, color("--tps"), true);
  line((s) => 100 * s.kv, 100, color("--kv"), false);
  line((s) => s.running, runMax, color("--run"), false);
}

// ---- wiring ----

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clearConversation);
  $("key-form").addEventListener("submit", useKey);
  $("key-change").addEventListener("click", () => askForKey(""));
  // Escape closes the dialog without a new key: check the one we have (asks again if it fails).
  $("key-dialog").addEventListener("cancel", () => setTimeout(connect, 0));
  window.addEventListener("resize", drawPlot);
  connect();
});
