// inferd's chat page. It uses only the public API (GET v1/models, POST v1/chat/completions
// with stream: true). Model output is always set as text (textContent), never as markup.
// Conversations live in localStorage; an API key, when the server asks for one, in
// sessionStorage (this tab only).
"use strict";

const STORE = "inferd.chat.conversations";
const SETTINGS = "inferd.chat.settings";
const KEY = "inferd.chat.apiKey";

const $ = (id) => document.getElementById(id);
const ui = {
  conversations: $("conversations"),
  newChat: $("new-chat"),
  model: $("model"),
  system: $("system"),
  temperature: $("temperature"),
  maxTokens: $("max-tokens"),
  messages: $("messages"),
  status: $("status"),
  composer: $("composer"),
  prompt: $("prompt"),
  attach: { image: $("attach-image"), audio: $("attach-audio"), video: $("attach-video") },
  files: { image: $("image"), audio: $("audio"), video: $("video") },
  attachments: $("attachments"),
  send: $("send"),
  stop: $("stop"),
  keyDialog: $("key-dialog"),
  keyForm: $("key-form"),
  key: $("key"),
  keyError: $("key-error"),
};

const state = {
  // [{id, title, updated, messages: [{role, content, attachments?, stats?, ...}]}]; an
  // attachment is {kind, name, url (a data: URL), format (audio)} or {kind, name, dropped}
  conversations: [],
  current: null, // id of the conversation shown
  models: new Map(), // id -> model card
  pending: [], // attachments of the next message, in the order chosen; url null while read
  controller: null, // AbortController of the answer streaming now
};

// -- storage -----------------------------------------------------------------------------------
function loadJSON(storage, name, fallback) {
  try {
    const raw = storage.getItem(name);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

function saveConversations() {
  const text = JSON.stringify(state.conversations);
  try {
    localStorage.setItem(STORE, text);
  } catch {
    // Over the quota (media are large): keep the words, drop the images, audio and video.
    const light = state.conversations.map((c) => ({ ...c, messages: c.messages.map(withoutMedia) }));
    try {
      localStorage.setItem(STORE, JSON.stringify(light));
      setStatus("Storage is full: images, audio and video are not kept after a reload.");
    } catch {
      setStatus("Storage is full: this conversation is not saved.");
    }
  }
}

function withoutMedia(message) {
  const attachments = attachmentsOf(message);
  if (attachments.length === 0) return message;
  const { image, imageDropped, ...rest } = message;
  return { ...rest, attachments: attachments.map(({ kind, name }) => ({ kind, name, dropped: true })) };
}

function saveSettings() {
  const settings = {
    model: ui.model.value,
    system: ui.system.value,
    temperature: ui.temperature.value,
    maxTokens: ui.maxTokens.value,
  };
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

function restoreSettings() {
  const s = loadJSON(localStorage, SETTINGS, {});
  if (typeof s.system === "string") ui.system.value = s.system;
  if (s.temperature) ui.temperature.value = s.temperature;
  if (s.maxTokens) ui.maxTokens.value = s.maxTokens;
  return s;
}

// -- API ---------------------------------------------------------------------------------------
function authHeaders() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function api(path, init = {}) {
  for (;;) {
    const headers = { ...(init.headers || {}), ...authHeaders() };
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    const hadKey = sessionStorage.getItem(KEY) !== null;
    await askForKey(hadKey ? "That key was not accepted." : "");
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch {
    // not JSON: fall through to the status line
  }
  return `${response.status} ${response.statusText}`;
}

function askForKey(problem) {
  ui.keyError.textContent = problem;
  ui.key.value = "";
  if (!ui.keyDialog.open) ui.keyDialog.showModal();
  ui.key.focus();
  return new Promise((resolve) => {
    ui.keyForm.addEventListener(
      "submit",
      (event) => {
        event.preventDefault();
        const key = ui.key.value.trim();
        if (key) sessionStorage.setItem(KEY, key);
        else sessionStorage.removeItem(KEY);
        ui.keyDialog.close();
        resolve();
      },
      { once: true },
    );
  });
}

// -- models ------------------------------------------------------------------------------------
async function loadModels(preferred) {
  const response = await api("v1/models");
  if (!response.ok) {
    setStatus(`Could not list the models: ${await errorMessage(response)}`);
    return;
  }
  const body = await response.json();
  ui.model.replaceChildren();
  state.models.clear();
  for (const card of body.data || []) {
    if (card.kind === "embedding" || card.alias_for) continue; // chat models, each once
    state.models.set(card.id, card);
    const option = document.createElement("option");
    option.value = card.id;
    option.textContent = card.status && card.status !== "loaded" ? `${card.id} (${card.status})` : card.id;
    ui.model.append(option);
  }
  if (preferred && state.models.has(preferred)) ui.model.value = preferred;
  if (state.models.size === 0) setStatus("This server has no chat model.");
  updateAttach();
}

function takes(kind) {
  const card = state.models.get(ui.model.value);
  return Boolean(card && card.modalities && (card.modalities.input || []).includes(kind));
}

function updateAttach() {
  // a button for each medium the selected model reads; what it does not read is not sent
  for (const kind of KINDS) ui.attach[kind].hidden = !takes(kind);
  const kept = state.pending.filter((a) => takes(a.kind));
  if (kept.length !== state.pending.length) {
    state.pending = kept;
    renderPending();
  }
}

// -- conversations -----------------------------------------------------------------------------
function currentConversation() {
  return state.conversations.find((c) => c.id === state.current) || null;
}

function newConversation() {
  const conversation = {
    id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`,
    title: "New chat",
    updated: Date.now(),
    messages: [],
  };
  state.conversations.unshift(conversation);
  state.current = conversation.id;
  return conversation;
}

function switchTo(id) {
  stopStreaming();
  state.current = id;
  render();
}

function deleteConversation(id) {
  if (id === state.current) stopStreaming();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (id === state.current) state.current = state.conversations[0]?.id ?? null;
  saveConversations();
  render();
}

// -- rendering (text only) ---------------------------------------------------------------------
function render() {
  renderList();
  renderMessages();
}

function renderList() {
  ui.conversations.replaceChildren();
  for (const c of state.conversations) {
    const item = document.createElement("li");
    item.classList.toggle("active", c.id === state.current);
    const open = document.createElement("button");
    open.type = "button";
    open.className = "title";
    open.textContent = c.title;
    open.title = c.title;
    open.addEventListener("click", () => switchTo(c.id));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Delete ${c.title}`);
    remove.addEventListener("click", () => deleteConversation(c.id));
    item.append(open, remove);
    ui.conversations.append(item);
  }
}

function renderMessages() {
  ui.messages.replaceChildren();
  const conversation = currentConversation();
  if (!conversation || conversation.messages.length === 0) {
    const empty = document.createElement("p");
    empty.className = "empty";
    empty.textContent = "Ask something to start.";
    ui.messages.append(empty);
    return;
  }
  for (const message of conversation.messages) ui.messages.append(messageView(message).root);
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function messageView(message) {
  const root = document.createElement("article");
  root.className = `message ${message.role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = message.role === "user" ? "You" : message.model || "Assistant";
  root.append(who);
  for (const attachment of attachmentsOf(message)) {
    if (isDataURL(attachment.url)) {
      root.append(mediaElement(attachment));
    } else {
      const note = document.createElement("div");
      note.className = "note";
      note.textContent = `(${attachment.kind} not kept)`;
      root.append(note);
    }
  }
  const reasoning = document.createElement("div");
  reasoning.className = "reasoning";
  reasoning.textContent = message.reasoning || "";
  reasoning.hidden = !message.reasoning;
  const text = document.createElement("div");
  text.className = "text";
  text.textContent = message.content;
  const meta = document.createElement("div");
  meta.className = "meta";
  root.append(reasoning, text, meta);
  const view = { root, reasoning, text, meta };
  showMeta(view, message);
  return view;
}

function showMeta(view, message) {
  const parts = [];
  const s = message.stats;
  if (s && s.tokens > 0) {
    if (s.ttft !== null) parts.push(`TTFT ${s.ttft.toFixed(2)} s`);
    if (s.tps !== null) parts.push(`${s.tps.toFixed(1)} tokens/s`);
    parts.push(`${s.tokens} tokens`);
  }
  if (message.stopped) parts.push("stopped");
  if (message.finish && message.finish !== "stop") parts.push(`finish: ${message.finish}`);
  view.meta.textContent = parts.join(" · ");
  view.meta.hidden = parts.length === 0 && !message.error;
  if (message.error) {
    const error = document.createElement("span");
    error.className = "error";
    error.textContent = `${parts.length ? " · " : ""}Error: ${message.error}`;
    view.meta.append(error);
  }
}

function setStatus(text) {
  ui.status.textContent = text;
}

// -- sending and streaming ---------------------------------------------------------------------
function requestMessages(conversation) {
  const out = [];
  const system = ui.system.value.trim();
  if (system) out.push({ role: "system", content: system });
  conversation.messages.forEach((m, i) => {
    if (m.role === "assistant" && !m.content) return; // failed or stopped before any text
    // a turn the server refused (an attachment over its limits, say) is not sent again: it
    // would be refused again, and every message after it with it
    const answer = conversation.messages[i + 1];
    if (m.role === "user" && answer && answer.error && !answer.content) return;
    const media = m.role === "user" ? attachmentsOf(m).filter((a) => isDataURL(a.url)) : [];
    if (media.length > 0) {
      const text = m.content ? [{ type: "text", text: m.content }] : [];
      out.push({ role: "user", content: [...text, ...media.map(requestPart)] });
    } else {
      out.push({ role: m.role, content: m.content });
    }
  });
  return out;
}

function numberOr(input, fallback) {
  const value = Number(input.value);
  return input.value !== "" && Number.isFinite(value) ? value : fallback;
}

async function send() {
  const text = ui.prompt.value.trim();
  const attachments = state.pending;
  if ((!text && attachments.length === 0) || state.controller || !ui.model.value) return;
  if (attachments.some((a) => a.url === null)) {
    setStatus("An attachment is still being read; send again in a moment.");
    return;
  }
  const conversation = currentConversation() || newConversation();
  const user = { role: "user", content: text };
  if (attachments.length > 0) user.attachments = attachments;
  if (conversation.messages.length === 0) {
    conversation.title = titleOf(text || LABELS[attachments[0].kind]);
  }
  conversation.messages.push(user);
  const answer = { role: "assistant", content: "", model: ui.model.value };
  conversation.messages.push(answer);
  conversation.updated = Date.now();
  // the conversation last written to leads the list
  state.conversations = [conversation, ...state.conversations.filter((c) => c !== conversation)];
  ui.prompt.value = "";
  clearPending();
  saveConversations();
  render();
  const view = ui.messages.lastElementChild && messageViewOf(ui.messages.lastElementChild);
  await stream(conversation, answer, view);
}

function titleOf(text) {
  const line = text.split("\n")[0];
  return line.length > 48 ? `${line.slice(0, 47)}…` : line;
}

function messageViewOf(root) {
  return {
    root,
    reasoning: root.querySelector(".reasoning"),
    text: root.querySelector(".text"),
    meta: root.querySelector(".meta"),
  };
}

function parseEvents(buffer, onData) {
  // SSE: an event ends with a blank line; only its `data:` lines matter here. Returns the rest
  // (an event not complete yet).
  let cut;
  while ((cut = buffer.indexOf("\n\n")) >= 0) {
    const block = buffer.slice(0, cut);
    buffer = buffer.slice(cut + 2);
    const data = block
      .split("\n")
      .filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(5).replace(/^ /, ""))
      .join("\n");
    if (data && data !== "[DONE]") onData(JSON.parse(data));
  }
  return buffer;
}

async function stream(conversation, answer, view) {
  const controller = new AbortController();
  state.controller = controller;
  ui.send.hidden = true;
  ui.stop.hidden = false;
  setStatus("");
  const started = performance.now();
  let first = null;
  let last = null;
  let pieces = 0;
  let usage = null;
  const follow = () => {
    const m = ui.messages;
    if (m.scrollHeight - m.scrollTop - m.clientHeight < 80) m.scrollTop = m.scrollHeight;
  };
  const onData = (event) => {
    if (event.error) throw new Error(event.error.message || "the server reported an error");
    if (event.usage) usage = event.usage;
    for (const choice of event.choices || []) {
      const delta = choice.delta || {};
      if (delta.reasoning_content) {
        answer.reasoning = (answer.reasoning || "") + delta.reasoning_content;
        view.reasoning.textContent = answer.reasoning;
        view.reasoning.hidden = false;
      }
      if (delta.content) {
        answer.content += delta.content;
        view.text.textContent = answer.content;
      }
      if (delta.content || delta.reasoning_content) {
        const now = performance.now();
        if (first === null) first = now;
        last = now;
        pieces += 1;
      }
      if (choice.finish_reason) answer.finish = choice.finish_reason;
    }
    follow();
  };
  try {
    const body = {
      model: ui.model.value,
      messages: requestMessages(conversation),
      stream: true,
      stream_options: { include_usage: true },
      temperature: numberOr(ui.temperature, 0.7),
      max_tokens: Math.max(1, Math.round(numberOr(ui.maxTokens, 512))),
    };
    const response = await api("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      const text = decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      buffer = parseEvents(buffer + text, onData);
    }
  } catch (error) {
    if (error.name === "AbortError") answer.stopped = true;
    else answer.error = error.message;
  } finally {
    const tokens = usage ? usage.completion_tokens : pieces;
    const seconds = first !== null && last !== null ? (last - first) / 1000 : 0;
    answer.stats = {
      ttft: first === null ? null : (first - started) / 1000,
      // decode speed: the tokens after the first, over the time since the first
      tps: tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null,
      tokens,
    };
    if (state.controller === controller) {
      state.controller = null;
      ui.send.hidden = false;
      ui.stop.hidden = true;
    }
    conversation.updated = Date.now();
    saveConversations();
    if (conversation.id === state.current && view.root.isConnected) showMeta(view, answer);
  }
}

function stopStreaming() {
  if (state.controller) state.controller.abort();
}

// -- attachments ------------------------------------------------------------------------------
// Each file goes as a data: URL the user chose (never anything from model output): an image as
// an image_url part, audio as an input_audio part (base64 and a format the server checks against
// the bytes), a video as a video_url part. Size and count limits are the server's: the page
// cannot read them, so an attachment over one comes back as the server's 400/413 message.
const KINDS = ["image", "audio", "video"];
const LABELS = { image: "Image", audio: "Audio", video: "Video" };
// the input_audio formats the server takes (inferd/server/media.py), by media type, then by
// the file name's extension when the browser gives no type
const AUDIO_TYPES = {
  "audio/wav": "wav",
  "audio/x-wav": "wav",
  "audio/wave": "wav",
  "audio/vnd.wave": "wav",
  "audio/mpeg": "mp3",
  "audio/mp3": "mp3",
  "audio/flac": "flac",
  "audio/x-flac": "flac",
  "audio/ogg": "ogg",
  "audio/opus": "ogg",
  "audio/mp4": "m4a",
  "audio/m4a": "m4a",
  "audio/x-m4a": "m4a",
  "audio/webm": "webm",
};
const AUDIO_EXTENSIONS = { wav: "wav", mp3: "mp3", flac: "flac", ogg: "ogg", oga: "ogg", opus: "ogg", m4a: "m4a", webm: "webm" };

function audioFormat(file) {
  const type = file.type.split(";")[0].trim().toLowerCase();
  const extension = file.name.includes(".") ? file.name.split(".").pop().toLowerCase() : "";
  return AUDIO_TYPES[type] || AUDIO_EXTENSIONS[extension] || null;
}

function attachmentsOf(message) {
  if (Array.isArray(message.attachments)) return message.attachments;
  // conversations stored before audio and video: one image, or the note that it was dropped
  if (message.image) return [{ kind: "image", name: "image", url: message.image }];
  if (message.imageDropped) return [{ kind: "image", name: "image", dropped: true }];
  return [];
}

function isDataURL(url) {
  return typeof url === "string" && url.startsWith("data:");
}

function requestPart(attachment) {
  const { kind, url } = attachment;
  if (kind === "audio") {
    const data = url.slice(url.indexOf(",") + 1);
    return { type: "input_audio", input_audio: { data, format: attachment.format } };
  }
  if (kind === "video") return { type: "video_url", video_url: { url } };
  return { type: "image_url", image_url: { url } };
}

function mediaElement(attachment) {
  const { kind, url, name } = attachment;
  const element = document.createElement(kind === "image" ? "img" : kind);
  if (kind === "image") element.alt = name || "Attached image";
  else element.controls = true;
  element.title = name || LABELS[kind];
  element.src = url; // a data: URL read from a file the user chose
  return element;
}

function ofKind(url, kind) {
  // a file the browser gave no type of its kind (application/octet-stream): say only its kind,
  // since the server refuses a video declared as something else and sniffs the bytes anyway
  const comma = url.indexOf(",");
  const type = url.slice(5, comma).split(";")[0];
  return type.startsWith(`${kind}/`) ? url : `data:${kind}/*;base64,${url.slice(comma + 1)}`;
}

function addFiles(kind, files) {
  for (const file of files) {
    if (file.size === 0) {
      setStatus(`${file.name} is empty.`);
      continue;
    }
    const format = kind === "audio" ? audioFormat(file) : undefined;
    if (kind === "audio" && !format) {
      setStatus(`${file.name}: send audio as wav, mp3, flac, ogg, m4a or webm.`);
      continue;
    }
    // in the list at once, so attachments keep the order chosen however long each read takes
    const attachment = { kind, name: file.name, url: null, ...(format ? { format } : {}) };
    state.pending.push(attachment);
    const reader = new FileReader();
    reader.addEventListener("load", () => {
      attachment.url = ofKind(reader.result, kind);
      renderPending();
    });
    reader.addEventListener("error", () => {
      state.pending = state.pending.filter((a) => a !== attachment);
      setStatus(`Could not read ${file.name}.`);
      renderPending();
    });
    reader.readAsDataURL(file);
  }
  renderPending();
}

function renderPending() {
  ui.attachments.replaceChildren();
  for (const attachment of state.pending) {
    const chip = document.createElement("div");
    chip.className = `chip ${attachment.kind}`;
    chip.title = attachment.name;
    if (attachment.url === null) {
      const reading = document.createElement("span");
      reading.className = "note";
      reading.textContent = `Reading ${attachment.name}…`;
      chip.append(reading);
    } else {
      chip.append(mediaElement(attachment));
    }
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove ${attachment.name}`);
    remove.addEventListener("click", () => {
      state.pending = state.pending.filter((a) => a !== attachment);
      renderPending();
    });
    chip.append(remove);
    ui.attachments.append(chip);
  }
  ui.attachments.hidden = state.pending.length === 0;
}

function clearPending() {
  state.pending = [];
  renderPending();
}

// -- wiring ------------------------------------------------------------------------------------
function wire() {
  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  ui.stop.addEventListener("click", stopStreaming);
  ui.newChat.addEventListener("click", () => {
    stopStreaming();
    newConversation();
    render();
    ui.prompt.focus();
  });
  ui.model.addEventListener("change", () => {
    saveSettings();
    updateAttach();
  });
  for (const input of [ui.system, ui.temperature, ui.maxTokens]) {
    input.addEventListener("change", saveSettings);
  }
  for (const kind of KINDS) {
    const input = ui.files[kind];
    input.addEventListener("change", () => {
      addFiles(kind, Array.from(input.files || []));
      input.value = ""; // the same file chosen again is a change too
    });
  }
  // Escape would close the key prompt with the request still waiting on it
  ui.keyDialog.addEventListener("cancel", (event) => event.preventDefault());
}

async function start() {
  wire();
  const settings = restoreSettings();
  const stored = loadJSON(localStorage, STORE, []);
  state.conversations = Array.isArray(stored) ? stored : [];
  state.conversations.sort((a, b) => b.updated - a.updated);
  state.current = state.conversations[0]?.id ?? null;
  render();
  try {
    await loadModels(settings.model);
  } catch (error) {
    setStatus(`Could not reach the server: ${error.message}`);
  }
  document.body.dataset.ready = "true"; // for tests and curious people
}

start();
