// Stopline browser client: one WebSocket, one generation at a time, chats kept in localStorage.
// The wire protocol is described in docs/protocol.md.

const WS_URL = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/ws`;
const RETRY_START_MS = 250;
const RETRY_CAP_MS = 5000;
const CHATS_KEY = 'stopline.chats.v1';
const SETTINGS_KEY = 'stopline.settings.v1';
const OPEN_KEY = 'stopline.open-chat.v1';
const API_KEY_KEY = 'stopline.api-key.v1';
// The server's close code for a missing or wrong API key (docs/protocol.md#api-keys).
const CLOSE_UNAUTHORIZED = 4401;
const MAX_CHATS = 100;

const $ = (id) => document.getElementById(id);
const els = {
  prompt: $('prompt'), send: $('send'), stop: $('stop'), newChat: $('new-chat'),
  form: $('composer-form'), messages: $('messages'), scroller: $('scroller'),
  status: $('status'), statusText: $('status-text'), statusRetry: $('status-retry'),
  model: $('model'), notice: $('notice'), announcer: $('announcer'),
  maxTokens: $('max-tokens'), temperature: $('temperature'), timeout: $('timeout'), system: $('system-prompt'),
  topP: $('top-p'), topK: $('top-k'), repetitionPenalty: $('repetition-penalty'), seed: $('seed'),
  theme: $('theme'), chatList: $('chat-list'), noChats: $('no-chats'), chatsToggle: $('chats-toggle'),
  sidebar: $('sidebar'), exportMd: $('export-md'), exportJson: $('export-json'), apiKey: $('api-key'),
};

// The numeric settings: the storage key, its input and the generate frame's field.
const NUMBER_SETTINGS = [
  ['maxTokens', els.maxTokens, 'max_tokens', Math.round],
  ['temperature', els.temperature, 'temperature'],
  ['topP', els.topP, 'top_p'],
  ['topK', els.topK, 'top_k', Math.round],
  ['repetitionPenalty', els.repetitionPenalty, 'repetition_penalty'],
  ['seed', els.seed, 'seed', Math.round],
  ['timeout', els.timeout, 'timeout_s'],
];

const DONE_REASONS = {
  eos: 'end of text',
  max_tokens: 'max tokens reached',
  stop_sequence: 'stop sequence',
};

const CANCEL_REASONS = {
  user_cancelled: 'Generation cancelled',
  shutdown: 'Cancelled: the server is shutting down',
  slow_consumer: 'Cancelled: the connection could not keep up',
};

const ERROR_TEXT = {
  invalid_json: 'The server could not read the request (invalid JSON).',
  invalid_frame: 'The server rejected a malformed frame.',
  unknown_type: 'The server did not recognise the request type.',
  invalid_field: 'A setting is missing or out of range.',
  binary_frame: 'The server accepts text frames only.',
  duplicate_id: 'A request with this id is already running.',
  prompt_too_long: 'The conversation is too long for the model’s context. Start a new chat.',
  too_many_requests: 'Too many requests are running on this connection.',
  busy: 'The server is busy. Try again in a moment.',
  rate_limited: 'Too many messages too quickly. Slow down a little.',
  internal_error: 'The model failed.',
  unauthorized: 'The API key was refused. Check it in Settings.',
  quota_exceeded: 'This API key has reached a limit.',
};
// For these codes the server's message carries useful detail (which field, how many tokens, what failed).
const ERROR_DETAIL = new Set(['invalid_field', 'prompt_too_long', 'internal_error', 'quota_exceeded']);

// What a cancel_ack status means for a message still showing "Stopping…".
const ACK_OUTCOME = {
  finished: ['done', 'Finished before the stop arrived'],
  cancelled: ['cancelled', 'Generation cancelled'],
  timeout: ['timeout', 'Timed out'],
  error: ['error', 'Error'],
  unknown: ['cancelled', 'Stopped'],
};

// Answers that ended early keep their text and can be continued from where they ended.
const STOPPED = new Set(['cancelled', 'timeout', 'interrupted']);
const THEMES = { auto: 'Theme: Auto', light: 'Theme: Light', dark: 'Theme: Dark' };
const NEXT_THEME = { auto: 'light', light: 'dark', dark: 'auto' };

let ws = null;
let retryDelay = RETRY_START_MS;
let retryTimer = 0;
let tickTimer = 0;
let pageHidden = false;
let counter = 0;

// A chat is { id, title, updated, trimmed?, messages: [{ role, content, state?, meta? }] }; only this
// is stored. `trimmed` counts the oldest messages left out of what the model sees: they no longer
// fit its context with room for the answer (answerRoom).
let chats = loadChats();
let chat = null;                  // the chat on screen, or null for a new, empty one
const views = new Map();          // message -> its elements, for the chat on screen
const requests = new Map();       // request id -> req, for routing server frames
let current = null;               // the req still running, or null
let editing = null;               // the user message being edited, or null
let unsaved = false;              // tokens arrived since the chats were last saved
let pinned = true;                // the view follows the conversation: the reader has not scrolled up
let contextLength = 0;            // the model's context in tokens, from the server's hello
let defaultMaxTokens = 0;         // the answer length a frame without max_tokens gets, from the hello

// ---------- markdown ----------

// Model output is untrusted. Raw HTML in it is shown as text (marked), and whatever
// markup marked produces is sanitized (DOMPurify): no scripts, no event handlers, and
// links only to http(s) and mailto. The page's Content-Security-Policy forbids inline
// scripts as a last line.
const renderMarkdown = (() => {
  const { marked, DOMPurify } = window;
  if (!marked || !DOMPurify) return null; // the libraries failed to load: plain text it is
  const parser = new marked.Marked({ gfm: true, breaks: true });
  parser.use({ renderer: { html: (token) => escapeHtml(token.text).replace(/\n(?!$)/g, '<br>\n') } });
  DOMPurify.addHook('afterSanitizeAttributes', (node) => {
    if (node.tagName === 'A') {
      node.setAttribute('target', '_blank');
      node.setAttribute('rel', 'noopener noreferrer nofollow');
    }
  });
  const options = {
    FORBID_TAGS: ['style', 'form', 'input', 'button', 'textarea', 'select', 'iframe', 'object', 'embed'],
    FORBID_ATTR: ['style'],
    ALLOWED_URI_REGEXP: /^(?:https?:|mailto:)/i,
  };
  return (text) => DOMPurify.sanitize(parser.parse(text), options);
})();

if (window.hljs) window.hljs.configure({ ignoreUnescapedHTML: true });

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function renderText(view, text) {
  if (renderMarkdown) view.textEl.innerHTML = renderMarkdown(text);
  else view.textEl.textContent = text;
}

// Highlighting and code copy buttons once an answer is final (not on every token).
function decorate(view) {
  for (const pre of view.textEl.querySelectorAll('pre')) {
    const code = pre.querySelector('code');
    if (!code || pre.querySelector('.copy-code')) continue;
    if (window.hljs) window.hljs.highlightElement(code);
    const button = h('button', 'copy-code', 'Copy');
    button.type = 'button';
    button.setAttribute('aria-label', 'Copy code');
    button.addEventListener('click', () => copy(code.textContent, button));
    pre.prepend(button);
  }
}

// ---------- storage ----------

function loadChats() {
  let stored = [];
  try {
    stored = JSON.parse(localStorage.getItem(CHATS_KEY) ?? '[]');
  } catch { /* unreadable or storage off: start empty */ }
  if (!Array.isArray(stored)) return [];
  for (const c of stored) {
    for (const m of c.messages ?? []) {
      // The page went away while it was answering; the server cancelled that answer.
      if (m.state === 'streaming' || m.state === 'stopping') {
        m.state = 'interrupted';
        m.meta = 'Interrupted: the page was closed while answering';
      }
    }
  }
  return stored.filter((c) => c && typeof c.id === 'string' && Array.isArray(c.messages));
}

function saveChats() {
  unsaved = false;
  const list = chats.slice(0, MAX_CHATS);
  for (;;) {
    try {
      localStorage.setItem(CHATS_KEY, JSON.stringify(list));
      return;
    } catch {
      if (list.length <= 1) return; // storage off or full: the chat lives in this page only
      list.pop(); // drop the oldest and try again
    }
  }
}

function openedBefore() {
  let id = null;
  try { id = localStorage.getItem(OPEN_KEY); } catch { /* storage off */ }
  if (id === null) return chats[0] ?? null;
  return chats.find((c) => c.id === id) ?? null;
}

function loadSettings() {
  let s = {};
  try { s = JSON.parse(localStorage.getItem(SETTINGS_KEY) ?? '{}') ?? {}; } catch { /* defaults */ }
  if (typeof s.system === 'string') els.system.value = s.system;
  for (const [key, input] of NUMBER_SETTINGS) {
    if (typeof s[key] === 'number') input.value = String(s[key]);
  }
}

function saveSettings() {
  const s = { system: els.system.value };
  for (const [key, input] of NUMBER_SETTINGS) s[key] = readNumber(input);
  try { localStorage.setItem(SETTINGS_KEY, JSON.stringify(s)); } catch { /* storage off */ }
}

function touch(c) {
  if (c !== chat && !chats.includes(c)) return; // deleted while its answer was ending
  c.updated = Date.now();
  chats = [c, ...chats.filter((x) => x !== c)];
  saveChats();
  renderChatList();
}

// ---------- connection ----------

function connect() {
  clearTimers();
  setStatus('connecting', 'Connecting…');
  const sock = openSocket();
  ws = sock;
  sock.onopen = () => {
    retryDelay = RETRY_START_MS;
    setStatus('connected', 'Connected');
  };
  sock.onmessage = (event) => {
    let msg;
    try { msg = JSON.parse(event.data); } catch { return; }
    if (msg && typeof msg === 'object') onFrame(msg);
  };
  // 'error' is always followed by 'close', so all the cleanup lives here.
  sock.onclose = (event) => {
    for (const req of requests.values()) {
      if (req.sock === sock && !req.over) finish(req, 'interrupted', 'Interrupted: connection lost');
    }
    if (ws !== sock) return; // a late close of a socket we already replaced
    ws = null;
    if (event.code === CLOSE_UNAUTHORIZED) askForKey();
    else if (pageHidden) setStatus('disconnected', 'Disconnected');
    else scheduleReconnect();
  };
}

// ---------- API key: sent as a second subprotocol, since a page cannot set handshake headers ----------

function openSocket() {
  const key = els.apiKey.value.trim();
  return key ? new WebSocket(WS_URL, ['stopline', `stopline.bearer.${key}`]) : new WebSocket(WS_URL);
}

// No retrying with a key the server refused: ask for one, and connect once it is given.
function askForKey() {
  clearTimers();
  setStatus('disconnected', 'API key needed');
  showNotice(els.apiKey.value
    ? 'The server refused this API key. Enter another one in Settings.'
    : 'This server needs an API key. Enter it in Settings.');
  document.querySelector('details.settings').open = true;
  els.apiKey.focus();
}

els.apiKey.addEventListener('change', () => {
  const key = els.apiKey.value.trim();
  try {
    if (key) localStorage.setItem(API_KEY_KEY, key);
    else localStorage.removeItem(API_KEY_KEY);
  } catch { /* storage off: the key lasts until the page closes */ }
  hideNotice();
  if (ws) {
    const old = ws;
    ws = null; // its close must not schedule a reconnect of its own
    old.close();
  }
  connect();
});

function scheduleReconnect() {
  const delay = retryDelay;
  retryDelay = Math.min(retryDelay * 2, RETRY_CAP_MS);
  const at = Date.now() + delay;
  setStatus('disconnected', 'Disconnected');
  const tick = () => {
    const s = Math.max(1, Math.ceil((at - Date.now()) / 1000));
    els.statusRetry.textContent = `· reconnecting in ${s} s`;
  };
  tick();
  tickTimer = setInterval(tick, 250);
  retryTimer = setTimeout(connect, delay);
}

function clearTimers() {
  clearTimeout(retryTimer);
  clearInterval(tickTimer);
  els.statusRetry.textContent = '';
}

function setStatus(state, text) {
  els.status.dataset.state = state;
  els.statusText.textContent = text;
  if (state !== 'disconnected') els.statusRetry.textContent = '';
  updateControls();
}

function isOpen() {
  return ws !== null && ws.readyState === WebSocket.OPEN;
}

function sendFrame(frame) {
  if (!isOpen()) return false;
  ws.send(JSON.stringify(frame));
  return true;
}

// ---------- server frames ----------

function onFrame(msg) {
  const req = msg.id != null ? requests.get(msg.id) : undefined;
  switch (msg.type) {
    case 'hello':
      if (msg.model) {
        els.model.textContent = msg.model;
        els.model.hidden = false;
      }
      if (msg.limits?.max_tokens) {
        // The longest answer the server accepts is its context length.
        contextLength = msg.limits.max_tokens;
        els.maxTokens.max = contextLength;
        if (els.maxTokens.valueAsNumber > contextLength) els.maxTokens.value = String(contextLength);
      }
      if (msg.limits?.timeout_s) els.timeout.max = msg.limits.timeout_s;
      // A setting left empty is left out of the frame: its box shows the server's default.
      for (const [field, input] of [['max_tokens', els.maxTokens], ['top_p', els.topP], ['top_k', els.topK],
        ['repetition_penalty', els.repetitionPenalty]]) {
        if (typeof msg.defaults?.[field] === 'number') input.placeholder = String(msg.defaults[field]);
      }
      if (typeof msg.defaults?.max_tokens === 'number') defaultMaxTokens = msg.defaults.max_tokens;
      break;

    case 'accepted':
      if (req && req.msg.state === 'streaming' && req.text === '') {
        setMeta(req.msg, msg.queue_position > 0 ? `Queued (position ${msg.queue_position})…` : 'Generating…');
      }
      break;

    case 'token':
      if (req && !req.over) appendToken(req, msg.index, msg.text);
      break;

    case 'done': {
      if (!req) break;
      const parts = [countTokens(msg.tokens_generated), DONE_REASONS[msg.reason] ?? msg.reason];
      // A Stop that lost the race: say so, or the user wonders why it did not cancel.
      if (req.msg.state === 'stopping') parts.push('finished before the stop arrived');
      parts.push(speed(msg));
      finish(req, 'done', join(parts));
      break;
    }

    case 'cancelled': {
      if (!req) break;
      const parts = [CANCEL_REASONS[msg.reason] ?? `Cancelled (${msg.reason})`, countTokens(msg.tokens_generated)];
      if (typeof msg.cancel_latency_ms === 'number') parts.push(`stopped in ${msg.cancel_latency_ms.toFixed(1)} ms`);
      parts.push(speed(msg));
      finish(req, 'cancelled', join(parts));
      break;
    }

    case 'timeout': {
      if (!req) break;
      const text = msg.reason === 'first_token_timeout'
        ? 'Timed out: no first token within the limit'
        : `Timed out after ${seconds(msg.duration_ms)} s`;
      finish(req, 'timeout', join([text, countTokens(msg.tokens_generated)]));
      break;
    }

    case 'error': {
      // A chat that outgrew the context, or left too little room for the answer: leave its
      // oldest turn out and ask again. With nothing left to leave out, answer in the room there is.
      if (req && !req.over && msg.code === 'prompt_too_long') {
        if (trimOldestTurn(req.chat)) {
          retry(req);
          break;
        }
        if (req.room > 1) {
          retry(req, 1);
          break;
        }
      }
      let text = ERROR_TEXT[msg.code] ?? msg.message ?? 'Unknown error.';
      if (ERROR_DETAIL.has(msg.code) && msg.message) text += ` (${msg.message})`;
      if (req && !req.over) finish(req, 'error', `Error: ${text}`);
      else showNotice(`Server error: ${text}`); // not tied to a request we are waiting on
      break;
    }

    case 'cancel_ack':
      // The cancel found nothing to stop. Normally the terminal frame came first and
      // already ended "Stopping…"; if not, the ack is the last word on this request.
      if (req && req.msg.state === 'stopping') {
        const [state, text] = ACK_OUTCOME[msg.status] ?? ACK_OUTCOME.unknown;
        finish(req, state, text);
      }
      break;

    default:
      break; // newer server, unknown frame: ignore rather than break the page
  }
}

function appendToken(req, index, text) {
  // Frames arrive in order on one socket, but buffering by index keeps the text exact regardless.
  req.pending.set(index, text);
  let chunk = '';
  while (req.pending.has(req.next)) {
    chunk += req.pending.get(req.next);
    req.pending.delete(req.next);
    req.next += 1;
  }
  if (!chunk) return;
  if (req.text === '' && req.msg.state === 'streaming') setMeta(req.msg, '');
  req.text += chunk;
  req.msg.content = req.base + req.text;
  unsaved = true;
  scheduleRender(req);
}

// Re-render the answer at most once a frame; a burst of tokens costs one parse.
function scheduleRender(req) {
  if (req.frame) return;
  req.frame = requestAnimationFrame(() => {
    req.frame = 0;
    const view = views.get(req.msg);
    if (view) renderText(view, req.msg.content);
  });
}

function finish(req, state, text) {
  req.over = true;
  cancelAnimationFrame(req.frame);
  req.frame = 0;
  const { msg } = req;
  msg.state = state;
  msg.meta = text;
  const view = views.get(msg);
  if (view) {
    renderText(view, msg.content);
    view.el.dataset.state = state;
    view.el.removeAttribute('aria-busy');
    view.metaEl.textContent = text;
    setTimeout(() => decorate(view), 0); // off the path from the terminal frame to the screen
  }
  requests.delete(req.id);
  if (current === req) current = null;
  if (req.chat) touch(req.chat);
  refreshActions();
  updateControls();
}

// ---------- user actions ----------

function send() {
  const content = els.prompt.value.trim();
  if (!content || current || !isOpen()) return;
  if (!chat) {
    chat = { id: `chat-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`,
      title: content.replace(/\s+/g, ' ').slice(0, 80), updated: Date.now(), messages: [] };
  }
  const user = { role: 'user', content };
  chat.messages.push(user);
  // Sending is reading on: the view follows the question and its answer.
  pinned = true;
  els.messages.append(messageView(user).el);
  answer();
  els.prompt.value = '';
  autosize();
}

// Ask for a reply to the conversation as it stands; with `partial`, continue that answer instead.
// The room in the context each answer is asked to have (the generate frame's min_answer_tokens):
// its max tokens (the server's default when the box is empty), but no more than a quarter of the context. A chat is trimmed until its prompt
// leaves that much; a prompt that merely fits the context could leave the answer a few words.
function answerRoom() {
  if (!contextLength) return undefined; // no hello yet: the server's own minimum
  const wanted = readNumber(els.maxTokens, Math.round) ?? (defaultMaxTokens || contextLength);
  return Math.max(1, Math.min(wanted, Math.floor(contextLength / 4)));
}

function answer(partial = null, room = answerRoom()) {
  hideNotice();
  const history = conversation();
  let msg = partial;
  if (!msg) {
    msg = { role: 'assistant', content: '', state: '', meta: '' };
    chat.messages.push(msg);
    els.messages.append(messageView(msg).el);
  }
  const id = `c${++counter}-${Math.random().toString(36).slice(2, 8)}`;
  const req = { id, msg, chat, room, sock: ws, base: msg.content, text: '', next: 0, pending: new Map(), over: false, frame: 0 };
  requests.set(id, req);
  current = req;
  const view = views.get(msg);
  view.el.dataset.id = id;
  view.el.setAttribute('aria-busy', 'true'); // announce the answer once it is complete, not token by token
  setState(msg, 'streaming');
  setMeta(msg, partial?.content ? 'Continuing…' : 'Waiting…');
  const frame = { type: 'generate', id, messages: history };
  for (const [, input, field, round] of NUMBER_SETTINGS) frame[field] = readNumber(input, round);
  frame.min_answer_tokens = room;
  sendFrame(frame);
  touch(chat);
  try { localStorage.setItem(OPEN_KEY, chat.id); } catch { /* storage off */ }
  refreshActions();
  updateControls();
}

function stop() {
  if (!current || current.msg.state !== 'streaming') return;
  setState(current.msg, 'stopping');
  setMeta(current.msg, 'Stopping…');
  sendFrame({ type: 'cancel', id: current.id });
  updateControls();
}

// Starting over or switching chats must not leave an answer burning server time.
function leaveCurrent() {
  if (current) {
    stop();
    current = null;
  }
  editing = null;
}

function newChat() {
  leaveCurrent();
  showChat(null);
  els.prompt.focus();
}

function regenerate() {
  const last = chat?.messages.at(-1);
  if (current || !isOpen() || last?.role !== 'assistant') return;
  chat.messages.pop();
  views.get(last)?.el.remove();
  views.delete(last);
  answer();
}

function continueAnswer() {
  const last = chat?.messages.at(-1);
  if (current || !isOpen() || last?.role !== 'assistant' || !STOPPED.has(last.state) || !last.content) return;
  answer(last);
}

function startEdit(msg) {
  if (current || editing) return;
  editing = msg;
  const view = views.get(msg);
  const form = h('form', 'edit');
  const box = h('textarea', 'edit-text');
  box.value = msg.content;
  box.rows = Math.min(8, msg.content.split('\n').length + 1);
  box.setAttribute('aria-label', 'Edit message');
  const save = h('button', 'edit-send', 'Send');
  save.type = 'submit';
  const cancel = h('button', 'secondary edit-cancel', 'Cancel');
  cancel.type = 'button';
  const buttons = h('div', 'edit-actions');
  buttons.append(save, cancel);
  form.append(box, buttons);
  view.textEl.hidden = true;
  view.actionsEl.hidden = true;
  view.el.insertBefore(form, view.actionsEl);
  const close = () => {
    form.remove();
    view.textEl.hidden = false;
    view.actionsEl.hidden = false;
    editing = null;
    refreshActions();
  };
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    const content = box.value.trim();
    if (!content || !isOpen() || current) return;
    close();
    resendFrom(msg, content);
  });
  box.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      form.requestSubmit();
    } else if (e.key === 'Escape') {
      e.preventDefault();
      e.stopPropagation();
      close();
      view.actionsEl.querySelector('.edit')?.focus();
    }
  });
  cancel.addEventListener('click', () => {
    close();
    view.actionsEl.querySelector('.edit')?.focus();
  });
  refreshActions();
  box.focus();
}

// Ask again for the same answer, once its conversation has been trimmed to fit.
function retry(req, room = req.room) {
  req.over = true;
  requests.delete(req.id);
  if (current === req) current = null;
  answer(req.msg, room);
}

// Leave the oldest turn (a question and its answers) out of what the model sees; never the
// system prompt, which is not a message of the chat, nor the question being answered.
// False when nothing is left to leave out.
function trimOldestTurn(c) {
  const list = c.messages;
  const lastQuestion = list.findLastIndex((m) => m.role === 'user');
  let next = (c.trimmed ?? 0) + 1;
  while (next < list.length && list[next].role !== 'user') next += 1;
  if (next > lastQuestion) return false;
  c.trimmed = next;
  if (c === chat) showTrimmed();
  announce('The oldest messages were left out to fit the model’s context');
  return true;
}

// The chat says, where it happens, which messages the model no longer sees.
function showTrimmed() {
  els.messages.querySelector('.trim-note')?.remove();
  const n = chat?.trimmed ?? 0;
  for (const [m, view] of views) view.el.classList.toggle('trimmed', chat.messages.indexOf(m) < n);
  if (!n) return;
  const limit = contextLength ? ` of ${contextLength} tokens` : '';
  const note = h('p', 'trim-note',
    `The ${n} oldest message${n === 1 ? '' : 's'} above no longer fit the model’s context${limit} `
    + 'with room for the answer: the model does not see them. The system prompt is always kept.');
  note.setAttribute('role', 'note');
  views.get(chat.messages[n])?.el.before(note);
}

// Edit-and-resend: the conversation after the edited message is dropped and answered anew.
function resendFrom(msg, content) {
  const at = chat.messages.indexOf(msg);
  chat.trimmed = Math.min(chat.trimmed ?? 0, at);
  for (const later of chat.messages.splice(at + 1)) {
    views.get(later)?.el.remove();
    views.delete(later);
  }
  msg.content = content;
  views.get(msg).textEl.textContent = content;
  answer();
}

function deleteChat(c) {
  if (current?.chat === c) leaveCurrent();
  chats = chats.filter((x) => x !== c);
  saveChats();
  if (chat === c) showChat(null);
  else renderChatList();
  announce(`Deleted “${c.title}”`);
  els.prompt.focus();
}

function openChat(c) {
  if (c === chat) return;
  leaveCurrent();
  showChat(c);
  closeSidebarIfOverlay();
  els.prompt.focus();
}

// Past turns as chat messages, with the system prompt first. Turns that errored never
// reached the model (or broke it), so they are left out; otherwise a too-long prompt would
// poison every later request. An empty answer (stopped before its first token) is left out too.
function conversation() {
  const out = [];
  const system = els.system.value.trim();
  if (system) out.push({ role: 'system', content: system });
  const list = chat.messages;
  for (let i = chat.trimmed ?? 0; i < list.length; i += 1) {
    const m = list[i];
    if (m.role === 'user' && list[i + 1]?.state === 'error') {
      i += 1;
      continue;
    }
    if (m.role === 'assistant' && (!m.content || m.state === 'error')) continue;
    out.push({ role: m.role, content: m.content });
  }
  return out;
}

// A setting's number; undefined when the box holds none, which leaves the field
// out of the frame (JSON drops it) so that the server's default applies.
function readNumber(input, round = (n) => n) {
  const n = input.valueAsNumber;
  return Number.isFinite(n) ? round(n) : undefined;
}

async function copy(text, button) {
  let ok = false;
  try {
    await navigator.clipboard.writeText(text);
    ok = true;
  } catch {
    // No clipboard API (an insecure origin, say): the older way.
    const area = h('textarea', 'visually-hidden');
    area.value = text;
    document.body.append(area);
    area.select();
    try { ok = document.execCommand('copy'); } catch { ok = false; }
    area.remove();
  }
  const label = button.textContent;
  button.textContent = ok ? 'Copied' : 'Copy failed';
  announce(ok ? 'Copied to the clipboard' : 'Could not copy');
  setTimeout(() => { button.textContent = label; }, 1500);
}

// ---------- rendering ----------

function showChat(c) {
  chat = c;
  try { localStorage.setItem(OPEN_KEY, c?.id ?? ''); } catch { /* storage off */ }
  views.clear();
  els.messages.replaceChildren(...(c ? c.messages.map((m) => messageView(m).el) : []));
  showTrimmed();
  hideNotice();
  renderChatList();
  refreshActions();
  updateControls();
  pinned = true;
  els.scroller.scrollTop = els.scroller.scrollHeight;
}

function messageView(msg) {
  const assistant = msg.role === 'assistant';
  const el = h('article', `msg ${msg.role}`);
  const textEl = h('div', assistant ? 'text markdown' : 'text');
  const actionsEl = h('div', 'msg-actions');
  const view = { el, textEl, actionsEl, metaEl: null, buttons: {} };
  views.set(msg, view);
  const button = (name, label, aria, onClick) => {
    const b = h('button', `link ${name}`, label);
    b.type = 'button';
    b.setAttribute('aria-label', aria);
    b.addEventListener('click', onClick);
    actionsEl.append(b);
    view.buttons[name] = b;
  };
  button('copy', 'Copy', assistant ? 'Copy answer' : 'Copy message', (e) => copy(msg.content, e.currentTarget));
  if (assistant) {
    view.metaEl = h('div', 'meta', msg.meta ?? '');
    el.dataset.state = msg.state || 'done';
    renderText(view, msg.content);
    button('regenerate', 'Regenerate', 'Regenerate this answer', regenerate);
    button('continue', 'Continue', 'Continue this answer', continueAnswer);
    el.append(h('div', 'who', 'Assistant'), textEl, view.metaEl, actionsEl);
    if (msg.content) setTimeout(() => decorate(view), 0);
  } else {
    textEl.textContent = msg.content;
    button('edit', 'Edit', 'Edit and resend this message', () => startEdit(msg));
    el.append(h('div', 'who', 'You'), textEl, actionsEl);
  }
  return view;
}

// Which actions a message offers depends on the whole conversation: only the last answer can be
// regenerated or continued, and nothing is offered while an answer is being written.
function refreshActions() {
  if (!chat) return;
  const idle = current === null && editing === null;
  const last = chat.messages.at(-1);
  for (const msg of chat.messages) {
    const view = views.get(msg);
    if (!view) continue;
    const { buttons } = view;
    const busy = msg === current?.msg;
    buttons.copy.hidden = busy || !msg.content;
    if (msg.role === 'assistant') {
      buttons.regenerate.hidden = !(idle && msg === last);
      buttons.continue.hidden = !(idle && msg === last && STOPPED.has(msg.state) && msg.content);
    } else {
      buttons.edit.hidden = !idle;
    }
  }
}

function renderChatList() {
  els.chatList.replaceChildren(...chats.map((c) => {
    const li = h('li', 'chat-item');
    const open = h('button', 'chat-open', c.title || 'Untitled');
    open.type = 'button';
    open.title = c.title;
    if (c === chat) open.setAttribute('aria-current', 'true');
    open.addEventListener('click', () => openChat(c));
    const del = h('button', 'chat-delete', '×');
    del.type = 'button';
    del.setAttribute('aria-label', `Delete chat “${c.title}”`);
    del.addEventListener('click', () => deleteChat(c));
    li.append(open, del);
    return li;
  }));
  els.noChats.hidden = chats.length > 0;
}

function setState(msg, state) {
  msg.state = state;
  const view = views.get(msg);
  if (view) view.el.dataset.state = state;
}

function setMeta(msg, text) {
  msg.meta = text;
  const view = views.get(msg);
  if (view) view.metaEl.textContent = text;
}

function updateControls() {
  const running = current !== null;
  els.exportMd.disabled = els.exportJson.disabled = !chat?.messages.length;
  els.send.disabled = running || !isOpen();
  els.stop.disabled = !running || current.msg.state !== 'streaming';
  for (const b of els.messages.querySelectorAll('.regenerate, .continue, .edit-send')) b.disabled = !isOpen();
  // A disabled button drops keyboard focus on the floor; hand it back to the prompt.
  const active = document.activeElement;
  if (active && (active.disabled || active.hidden)) els.prompt.focus();
}

function showNotice(text) {
  els.notice.textContent = text;
  els.notice.hidden = false;
}

function hideNotice() {
  els.notice.hidden = true;
  els.notice.textContent = '';
}

function announce(text) {
  els.announcer.textContent = '';
  // A new text node in a live region is announced even when the words repeat.
  requestAnimationFrame(() => { els.announcer.textContent = text; });
}

// Follow the conversation while the reader is at the bottom; never yank them back up. Whether
// they are is decided by their scrolling alone, not by the height of what was just added: an
// answer's meta line and buttons appearing must not unpin the view.
function atBottom() {
  const s = els.scroller;
  return s.scrollHeight - s.scrollTop - s.clientHeight < 40;
}

function follow() {
  if (pinned) els.scroller.scrollTop = els.scroller.scrollHeight;
}

// ---------- export ----------

function exportChat(kind) {
  if (!chat?.messages.length) return;
  const system = els.system.value.trim();
  const messages = chat.messages.map((m) => ({ role: m.role, content: m.content, ...(m.meta ? { meta: m.meta } : {}) }));
  let body;
  if (kind === 'json') {
    body = JSON.stringify({ title: chat.title, exported: new Date().toISOString(), system, messages }, null, 2);
  } else {
    const parts = [`# ${chat.title}`];
    if (system) parts.push(`**System prompt:** ${system}`);
    for (const m of messages) {
      parts.push(`## ${m.role === 'user' ? 'You' : 'Assistant'}`, m.content);
      if (m.meta) parts.push(`*${m.meta}*`);
    }
    body = `${parts.join('\n\n')}\n`;
  }
  const type = kind === 'json' ? 'application/json' : 'text/markdown';
  const url = URL.createObjectURL(new Blob([body], { type: `${type};charset=utf-8` }));
  const link = h('a', 'visually-hidden');
  link.href = url;
  link.download = `${(chat.title || 'chat').replace(/[^\w\- ]+/g, '').trim().slice(0, 60) || 'chat'}.${kind === 'json' ? 'json' : 'md'}`;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

function autosize() {
  const p = els.prompt;
  p.style.height = 'auto';
  p.style.height = `${Math.min(p.scrollHeight, 200)}px`;
}

function showTheme(choice) {
  els.theme.textContent = THEMES[choice];
  const next = NEXT_THEME[choice];
  const now = choice === 'auto' ? 'follows the system' : choice;
  els.theme.setAttribute('aria-label', `Theme: ${now}. Switch to ${next === 'auto' ? 'the system theme' : next}`);
}

function closeSidebarIfOverlay() {
  if (document.body.classList.contains('sidebar-open')) toggleSidebar(false);
}

function toggleSidebar(open) {
  document.body.classList.toggle('sidebar-open', open);
  els.chatsToggle.setAttribute('aria-expanded', String(open));
  if (open) els.chatList.querySelector('button')?.focus();
}

function h(tag, className, text) {
  const el = document.createElement(tag);
  el.className = className;
  if (text) el.textContent = text;
  return el;
}

const countTokens = (n) => `${n ?? 0} token${n === 1 ? '' : 's'}`;
// The server's figure (decode speed, docs/protocol.md), the one its console shows too.
const speed = (f) => (typeof f.tokens_per_s === 'number' ? `${f.tokens_per_s.toFixed(1)} tokens/s` : '');
const seconds = (ms) => String(Math.round((ms ?? 0) / 100) / 10);
const join = (parts) => parts.filter(Boolean).join(' · ');

// ---------- wiring ----------

els.form.addEventListener('submit', (e) => {
  e.preventDefault();
  send();
});

els.prompt.addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
els.prompt.addEventListener('input', autosize);

els.stop.addEventListener('click', stop);
els.newChat.addEventListener('click', newChat);
els.theme.addEventListener('click', () => {
  const next = NEXT_THEME[window.stoplineTheme.saved()];
  window.stoplineTheme.set(next);
  showTheme(next);
});
els.chatsToggle.addEventListener('click', () => toggleSidebar(!document.body.classList.contains('sidebar-open')));
for (const input of [els.system, ...NUMBER_SETTINGS.map(([, i]) => i)]) {
  input.addEventListener('change', saveSettings);
}
els.exportMd.addEventListener('click', () => exportChat('md'));
els.exportJson.addEventListener('click', () => exportChat('json'));
// Only a move up unpins the view: a scroll event can arrive after more of the answer was
// added, and the distance to the bottom then says nothing about what the reader did.
let lastScrollTop = 0;
els.scroller.addEventListener('scroll', () => {
  const top = els.scroller.scrollTop;
  if (atBottom()) pinned = true;
  else if (top < lastScrollTop) pinned = false;
  lastScrollTop = top;
}, { passive: true });
// Whatever grows the conversation (tokens, a meta line, buttons, highlighting), the view follows.
const growth = new ResizeObserver(follow);
growth.observe(els.messages);
growth.observe(els.scroller);
els.system.addEventListener('input', saveSettings);

document.addEventListener('keydown', (e) => {
  if (e.key !== 'Escape') return;
  if (current) {
    e.preventDefault();
    stop();
  } else if (document.body.classList.contains('sidebar-open')) {
    toggleSidebar(false);
    els.chatsToggle.focus();
  }
});

// Closing the socket is what stops the generation server-side; do it explicitly on unload.
window.addEventListener('pagehide', () => {
  pageHidden = true;
  clearTimers();
  if (unsaved) saveChats(); // an answer in progress: keep what arrived
  if (ws) ws.close();
});
// Another tab changed the chats: show its list (this tab's open chat stays as it is here).
window.addEventListener('storage', (e) => {
  if (e.key !== CHATS_KEY) return;
  chats = loadChats().map((c) => (c.id === chat?.id ? chat : c));
  renderChatList();
});
window.addEventListener('pageshow', (e) => {
  if (e.persisted) {
    pageHidden = false;
    connect();
  }
});

loadSettings();
try { els.apiKey.value = localStorage.getItem(API_KEY_KEY) ?? ''; } catch { /* storage off */ }
showTheme(window.stoplineTheme.saved());
// Open the chat that was on screen, so a reload keeps the conversation.
showChat(openedBefore());
connect();
els.prompt.focus();
