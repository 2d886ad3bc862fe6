// The verispec chat page: multi-turn chat over /v1/chat/completions (streaming), each token coloured by
// provenance from the chunks' "verispec" field (see verispec/server/app.py): drafted-and-accepted or
// produced by the target. Optionally the same prompt again with plain decoding ("drafter": "none"), side
// by side, with timings. Nothing is fetched from anywhere but this server.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "verispec.apiKey";
const history = [];  // [{role, content}] of the conversation so far
let busy = null;     // the AbortController of the request in flight

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

async function loadModels() {
  const response = await fetch("/v1/models", {headers: headers()});
  if (!response.ok) {
    showError("Could not list the models (" + await errorMessage(response) + ")" +
              (response.status === 401 ? ": check the API key." : ""));
    return false;
  }
  const models = (await response.json()).data || [];
  const model = $("model"), drafter = $("drafter");
  const keepModel = model.value, keepDrafter = drafter.value;
  model.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  if (keepModel) model.value = keepModel;
  const offered = (models[0] && models[0].verispec) || {drafters: ["none"]};
  drafter.replaceChildren(...offered.drafters.map((d) =>
    new Option(d === "none" ? "none (plain decoding)" : `${d} (k=${offered.num_draft_tokens})`, d)));
  if (keepDrafter && offered.drafters.includes(keepDrafter)) drafter.value = keepDrafter;
  showError("");
  return true;
}

function number(id, fallback) {
  const v = parseFloat($(id).value);
  return Number.isFinite(v) ? v : fallback;
}

function requestBody(messages, drafter) {
  return {
    model: $("model").value, messages, stream: true, drafter,
    temperature: number("temperature", 0), top_p: number("top-p", 1),
    max_tokens: Math.max(1, Math.round(number("max-tokens", 256))),
  };
}

// Reads an SSE response; calls onChunk(object) for every "data:" event but [DONE].
async function readEvents(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

function column(turn, title, kind) {
  const box = document.createElement("section");
  box.className = "column " + kind;
  const h = document.createElement("h2");
  h.textContent = title;
  const text = document.createElement("div");
  text.className = "text msg assistant";
  const timing = document.createElement("div");
  timing.className = "timing";
  box.append(h, text, timing);
  turn.append(box);
  return {box, text, timing};
}

function formatStats(s) {
  const parts = [`${s.tokens} tokens`, `${s.tokensPerSecond.toFixed(1)} tok/s`];
  if (s.drafted !== undefined) {
    parts.push(`acceptance ${(100 * s.acceptanceRate).toFixed(1)}% (${s.accepted}/${s.drafted})`);
    parts.push(`mean accepted length ${s.meanLength.toFixed(2)}`);
  } else {
    parts.push(`${s.accepted} drafted-and-accepted, ${s.target} by the target`);
    if (s.target) parts.push(`${((s.accepted + s.target) / s.target).toFixed(2)} tokens per target token`);
  }
  return parts.join(" · ");
}

// Streams one reply into `col`; returns {text, tokens, accepted, target, seconds, final}.
async function streamReply(messages, drafter, col, live) {
  const started = performance.now();
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages, drafter)),
    signal: busy.signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  const out = {text: "", tokens: 0, accepted: 0, target: 0, seconds: 0, final: null, stopped: false};
  const reading = readEvents(response, (chunk) => {
    if (chunk.error) throw new Error(chunk.error.message);
    const choice = chunk.choices && chunk.choices[0];
    if (choice && choice.finish_reason) out.final = chunk.verispec || null;
    else if (chunk.verispec) {
      for (const [text, source] of chunk.verispec.spans) {
        const span = document.createElement("span");
        span.className = "tok " + source;
        span.textContent = text;
        col.text.append(span);
      }
      out.accepted += chunk.verispec.accepted;
      out.target += chunk.verispec.target;
      out.tokens = out.accepted + out.target;
      out.text += (choice && choice.delta && choice.delta.content) || "";
      col.text.dataset.accepted = out.accepted;
      col.text.dataset.target = out.target;
    }
    out.seconds = (performance.now() - started) / 1000;
    if (live) {
      $("stats").textContent = formatStats({tokens: out.tokens, accepted: out.accepted, target: out.target,
                                             tokensPerSecond: out.tokens / Math.max(out.seconds, 1e-3)});
    }
  });
  try {
    await reading;
  } catch (e) {  // Stop: what streamed so far stays, in the page and in the conversation
    if (e.name !== "AbortError") throw e;
    out.stopped = true;
  }
  out.seconds = (performance.now() - started) / 1000;
  col.timing.textContent = `${out.tokens} tokens in ${out.seconds.toFixed(2)} s ` +
                           `(${(out.tokens / Math.max(out.seconds, 1e-3)).toFixed(1)} tok/s)`;
  return out;
}

function finalStats(reply) {
  const f = reply.final || {};
  const s = {tokens: reply.tokens, accepted: reply.accepted, target: reply.target,
             tokensPerSecond: f.tokens_per_second || reply.tokens / Math.max(reply.seconds, 1e-3)};
  if (f.drafted) Object.assign(s, {drafted: f.drafted, accepted: f.accepted, acceptanceRate: f.acceptance_rate,
                                   meanLength: f.mean_accepted_length});
  return formatStats(s);
}

async function send(message) {
  showError("");
  const user = document.createElement("div");
  user.className = "msg user";
  user.textContent = message;
  const turn = document.createElement("div");
  turn.className = "turn";
  $("messages").append(user, turn);
  const messages = history.concat([{role: "user", content: message}]);
  const drafter = $("drafter").value || undefined;
  const compare = $("compare").checked && drafter !== "none";
  if (compare) turn.classList.add("compare");
  const spec = column(turn, drafter === "none" ? "plain decoding" : `speculative (${drafter})`, "speculative");
  const plain = compare ? column(turn, "plain decoding", "plain") : null;
  busy = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    const reply = await streamReply(messages, drafter, spec, true);
    history.push({role: "user", content: message}, {role: "assistant", content: reply.text});
    let line = finalStats(reply) + (reply.stopped ? " · stopped" : "");
    if (plain && !reply.stopped) {
      $("stats").textContent = line + " · running plain decoding…";
      const base = await streamReply(messages, "none", plain, false);
      if (base.stopped) line += " · plain decoding stopped";
      const speedup = (reply.tokens / reply.seconds) / (base.tokens / base.seconds);
      line += ` · plain ${base.seconds.toFixed(2)} s → speedup ${speedup.toFixed(2)}x`;
      if (base.text !== reply.text) line += " (the texts differ)";
    }
    $("stats").textContent = line;
  } catch (e) {
    const failed = e.name === "AbortError" ? "stopped" : "failed: " + String(e.message || e);
    for (const col of [spec, plain]) if (col && !col.timing.textContent) col.timing.textContent = failed;
    if (e.name !== "AbortError") showError(String(e.message || e));
  } finally {
    busy = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function init() {
  const key = $("api-key");
  key.value = localStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, key.value.trim());
    loadModels();
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const message = $("prompt").value;
    if (!message.trim() || busy) return;
    $("prompt").value = "";
    send(message);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => busy && busy.abort());
  $("new-chat").addEventListener("click", () => {
    history.length = 0;
    $("messages").replaceChildren();
    $("stats").textContent = "no generation yet";
    showError("");
  });
  loadModels();
}

init();
