// The chat page: one websocket to chatd, one session kept across reloads (its id in localStorage),
// replies streamed token by token, a stop button, the typing hint, and reconnection with back-off.
"use strict";

const SESSION_KEY = "chatd.session_id";
const API_KEY = "chatd.api_key";
const MAX_NEW_TOKENS = 512;
const TYPING_EVERY_MS = 2000;
const BACKOFF_MS = [500, 1000, 2000, 4000, 8000, 10000];

const $ = (id) => document.getElementById(id);
const ui = {
  log: $("log"), empty: $("empty"), input: $("input"), send: $("send"), status: $("status"),
  banner: $("banner"), composer: $("composer"), newChat: $("new-chat"), auth: $("auth"), apiKey: $("api-key"),
};

const state = {
  socket: null,
  sessionId: localStorage.getItem(SESSION_KEY),
  ready: false,
  attempt: 0,
  turn: null, // {id, entry, text, lastSeq}: survives a dropped socket, to be resumed
  transcript: [], // [{role, content, meta}] as shown
  lastTyping: 0,
};

function wsUrl() {
  // The session id in the URL lets a proxy send every connection of a session to the same worker.
  const query = state.sessionId ? `?session_id=${encodeURIComponent(state.sessionId)}` : "";
  return `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws${query}`;
}

function setStatus(kind, text) {
  ui.status.dataset.state = kind;
  ui.status.textContent = text;
}

function showBanner(text) {
  ui.banner.textContent = text;
  ui.banner.hidden = !text;
}

function send(message) {
  if (state.socket && state.socket.readyState === WebSocket.OPEN) {
    state.socket.send(JSON.stringify(message));
    return true;
  }
  return false;
}

function connect() {
  setStatus(state.attempt ? "reconnecting" : "connecting", state.attempt ? "reconnecting…" : "connecting…");
  const socket = new WebSocket(wsUrl());
  state.socket = socket;
  socket.addEventListener("open", () => {
    state.attempt = 0;
    showBanner("");
    setStatus("connected", "connected");
    const key = localStorage.getItem(API_KEY);
    if (key) send({type: "auth", token: key});
    send({type: "session.open", session_id: state.sessionId});
  });
  socket.addEventListener("message", (event) => handle(JSON.parse(event.data)));
  socket.addEventListener("close", () => {
    if (state.socket !== socket) return;
    state.ready = false;
    if (state.turn) state.turn.entry.element.classList.add("waiting");
    const delay = BACKOFF_MS[Math.min(state.attempt, BACKOFF_MS.length - 1)];
    state.attempt += 1;
    setStatus("offline", "offline");
    showBanner(`Cannot reach the chatd server at ${wsUrl()}. Retrying in ${Math.round(delay / 100) / 10} s…`);
    updateComposer();
    setTimeout(connect, delay);
  });
}

function handle(message) {
  switch (message.type) {
    case "session.ready":
      state.sessionId = message.session_id;
      localStorage.setItem(SESSION_KEY, message.session_id);
      state.ready = true;
      if (state.turn) {
        // Reconnected in the middle of a reply: ask for what was missed, then the rest.
        send({type: "chat.resume", turn_id: state.turn.id, last_seq: state.turn.lastSeq});
      } else if (message.resumed) {
        restoreHistory(message.history || []);
      }
      break;
    case "auth.ok":
      ui.auth.hidden = true;
      break;
    case "chat.delta":
      if (state.turn && message.turn_id === state.turn.id && message.seq > state.turn.lastSeq) {
        state.turn.lastSeq = message.seq;
        appendText(message.delta.content);
      }
      break;
    case "chat.done":
      if (state.turn && message.turn_id === state.turn.id) finishTurn(message);
      break;
    case "session.closed":
      break;
    case "error":
      handleError(message);
      break;
  }
  updateComposer();
}

function handleError(error) {
  if (error.code === "unauthorized") {
    localStorage.removeItem(API_KEY);
    state.ready = false;
    ui.auth.hidden = false;
    ui.apiKey.focus();
    return;
  }
  if (error.code === "unknown_turn" && state.turn && error.turn_id === state.turn.id) {
    interruptTurn();  // the turn's log expired: the server's history has its recorded reply
    send({type: "session.open", session_id: state.sessionId});
    return;
  }
  if (error.code === "unknown_session" && !error.turn_id) {
    // The stored session expired or belongs to another server: start a new one.
    localStorage.removeItem(SESSION_KEY);
    state.sessionId = null;
    clearLog();
    send({type: "session.open", session_id: null});
    return;
  }
  if (state.turn && error.turn_id === state.turn.id) {
    failTurn(error);
    return;
  }
  showBanner(`${error.code}: ${error.message}`);
}

function restoreHistory(history) {
  // After a reload or reconnect the server's history is the truth; keep the cache notes already shown.
  const notes = state.transcript.map((entry) => entry.meta);
  clearLog();
  history.forEach((entry, index) => addMessage(entry.role, entry.content, notes[index]));
}

function clearLog() {
  state.transcript = [];
  ui.log.querySelectorAll(".message").forEach((node) => node.remove());
  ui.empty.hidden = false;
}

function addMessage(role, content, meta) {
  ui.empty.hidden = true;
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const bubble = document.createElement("div");
  bubble.className = "bubble";
  bubble.textContent = content;
  element.append(bubble);
  ui.log.append(element);
  const entry = {role, content, meta: meta || null, element};
  state.transcript.push(entry);
  if (meta) renderMeta(entry, meta);
  scrollToEnd();
  return entry;
}

function renderMeta(entry, meta) {
  entry.meta = meta;
  entry.element.querySelector(".meta")?.remove();
  const line = document.createElement("div");
  line.className = "meta";
  for (const [text, kind] of meta) {
    const span = document.createElement("span");
    span.textContent = text;
    if (kind) span.className = `badge ${kind}`;
    line.append(span);
  }
  entry.element.append(line);
}

function describe(done) {
  const cache = done.cache;
  const hit = cache.source !== "miss";
  const source = hit ? `cache: ${cache.source}` : `cache: miss (${cache.miss_reason})`;
  const meta = [[source, hit ? "hit" : cache.miss_reason === "corrupt" ? "corrupt" : "miss"],
    [`${done.usage.cached_tokens}/${done.usage.prompt_tokens} prompt tokens cached`],
    [`TTFT ${Math.round(done.timings.ttft_ms)} ms`],
    [`${done.usage.completion_tokens} tokens, ${done.timings.tokens_per_s.toFixed(1)} tok/s`]];
  if (done.finish_reason === "cancelled") meta.unshift(["stopped", "cancelled"]);
  if (done.finish_reason === "length") meta.push(["length limit"]);
  return meta;
}

function startTurn(text) {
  const id = `t${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
  const sent = send({type: "chat.request", session_id: state.sessionId, turn_id: id, content: text,
    params: {max_new_tokens: MAX_NEW_TOKENS}});
  if (!sent) {
    showBanner("Not connected: your message was not sent.");
    return;
  }
  addMessage("user", text);
  const entry = addMessage("assistant", "");
  entry.element.classList.add("streaming");
  state.turn = {id, entry, text: "", lastSeq: -1};
}

function appendText(text) {
  state.turn.text += text;
  state.turn.entry.element.querySelector(".bubble").textContent = state.turn.text;
  state.turn.entry.content = state.turn.text;
  scrollToEnd();
}

function finishTurn(done) {
  const entry = state.turn.entry;
  entry.element.classList.remove("streaming", "waiting");
  entry.content = done.content;
  entry.element.querySelector(".bubble").textContent = done.content;
  renderMeta(entry, describe(done));
  scrollToEnd();
  state.lastTyping = 0;  // whatever is typed next is a new message: hint at once
  if (done.finish_reason === "cancelled") {
    // A stopped turn is not recorded: keep it on screen, but out of the transcript that mirrors the server.
    state.transcript.splice(state.transcript.length - 2, 2);
  }
  state.turn = null;
  ui.input.focus();
}

function failTurn(error) {
  const entry = state.turn.entry;
  entry.element.classList.remove("streaming");
  renderMeta(entry, [[error.code, "error"], [error.message]]);
  entry.element.querySelector(".meta").classList.add("error-text");
  state.transcript.splice(state.transcript.length - 2, 2);
  state.turn = null;
}

function interruptTurn() {
  if (!state.turn) return;
  const entry = state.turn.entry;
  entry.element.classList.remove("streaming", "waiting");
  renderMeta(entry, [["connection lost", "error"], ["the reply could not be resumed"]]);
  state.turn = null;
}

function scrollToEnd() {
  ui.log.scrollTop = ui.log.scrollHeight;
}

function updateComposer() {
  const streaming = Boolean(state.turn);
  ui.send.textContent = streaming ? "Stop" : "Send";
  ui.send.classList.toggle("stop", streaming);
  ui.send.disabled = !state.ready || (!streaming && !ui.input.value.trim());
}

function autoSize() {
  ui.input.style.height = "auto";
  ui.input.style.height = `${ui.input.scrollHeight}px`;
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  if (state.turn) {
    send({type: "chat.cancel", turn_id: state.turn.id});
    return;
  }
  const text = ui.input.value.trim();
  if (!text || !state.ready) return;
  ui.input.value = "";
  autoSize();
  startTurn(text);
  updateComposer();
});

ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    if (!state.turn) ui.composer.requestSubmit();
  }
});

ui.input.addEventListener("input", () => {
  autoSize();
  updateComposer();
  // A hint that a turn is coming, so the server can bring this session's cache back to the device.
  const now = Date.now();
  if (state.ready && !state.turn && now - state.lastTyping > TYPING_EVERY_MS) {
    state.lastTyping = now;
    send({type: "typing", session_id: state.sessionId});
  }
});

ui.auth.addEventListener("submit", (event) => {
  event.preventDefault();
  const key = ui.apiKey.value.trim();
  if (!key) return;
  localStorage.setItem(API_KEY, key);
  ui.apiKey.value = "";
  send({type: "auth", token: key});
  send({type: "session.open", session_id: state.sessionId});
});

ui.newChat.addEventListener("click", () => {
  if (state.turn) send({type: "chat.cancel", turn_id: state.turn.id});
  state.turn = null;
  localStorage.removeItem(SESSION_KEY);
  state.sessionId = null;
  state.ready = false;
  clearLog();
  send({type: "session.open", session_id: null});
  updateComposer();
  ui.input.focus();
});

connect();
updateComposer();
