// Stopline browser client: one WebSocket, one generation at a time.
// The wire protocol is described in docs/protocol.md.

const WS_URL = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/ws`;
const RETRY_START_MS = 250;
const RETRY_CAP_MS = 5000;

const $ = (id) => document.getElementById(id);
const els = {
  prompt: $('prompt'), send: $('send'), stop: $('stop'), newChat: $('new-chat'),
  form: $('composer-form'), messages: $('messages'), scroller: $('scroller'),
  status: $('status'), statusText: $('status-text'), statusRetry: $('status-retry'),
  model: $('model'), notice: $('notice'),
  maxTokens: $('max-tokens'), temperature: $('temperature'), timeout: $('timeout'),
};

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
};
// For these codes the server's message carries useful detail (which field, how many tokens, what failed).
const ERROR_DETAIL = new Set(['invalid_field', 'prompt_too_long', 'internal_error']);

// What a cancel_ack status means for a message still showing "Stopping…".
const ACK_OUTCOME = {
  finished: ['done', 'Finished before the stop arrived'],
  cancelled: ['cancelled', 'Generation cancelled'],
  timeout: ['timeout', 'Timed out'],
  error: ['error', 'Error'],
  unknown: ['cancelled', 'Stopped'],
};

let ws = null;
let retryDelay = RETRY_START_MS;
let retryTimer = 0;
let tickTimer = 0;
let pageHidden = false;
let counter = 0;

let turns = [];               // [{ user: string, req }] in conversation order
let requests = new Map();     // request id -> req, for routing server frames
let current = null;           // the req still running, or null

// ---------- connection ----------

function connect() {
  clearTimers();
  setStatus('connecting', 'Connecting…');
  const sock = new WebSocket(WS_URL);
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
  sock.onclose = () => {
    for (const req of requests.values()) {
      if (req.sock === sock && !req.over) finish(req, 'interrupted', 'Interrupted: connection lost');
    }
    if (ws !== sock) return; // a late close of a socket we already replaced
    ws = null;
    if (pageHidden) setStatus('disconnected', 'Disconnected');
    else scheduleReconnect();
  };
}

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
      if (msg.limits?.max_tokens) els.maxTokens.max = msg.limits.max_tokens;
      if (msg.limits?.timeout_s) els.timeout.max = msg.limits.timeout_s;
      break;

    case 'accepted':
      if (req && req.state === 'streaming' && req.text === '') {
        setMeta(req, msg.queue_position > 0 ? `Queued (position ${msg.queue_position})…` : 'Generating…');
      }
      break;

    case 'token':
      if (req && !req.over) appendToken(req, msg.index, msg.text);
      break;

    case 'done': {
      if (!req) break;
      const parts = [countTokens(msg.tokens_generated), DONE_REASONS[msg.reason] ?? msg.reason];
      // A Stop that lost the race: say so, or the user wonders why it did not cancel.
      if (req.state === 'stopping') parts.push('finished before the stop arrived');
      finish(req, 'done', join(parts));
      break;
    }

    case 'cancelled': {
      if (!req) break;
      const parts = [CANCEL_REASONS[msg.reason] ?? `Cancelled (${msg.reason})`, countTokens(msg.tokens_generated)];
      if (typeof msg.cancel_latency_ms === 'number') parts.push(`stopped in ${msg.cancel_latency_ms.toFixed(1)} ms`);
      finish(req, 'cancelled', join(parts));
      break;
    }

    case 'timeout': {
      if (!req) break;
      const text = msg.reason === 'first_token_timeout'
        ? 'Timed out: no first token within the limit'
        : `Timed out after ${seconds(msg.elapsed_ms)} s`;
      finish(req, 'timeout', join([text, countTokens(msg.tokens_generated)]));
      break;
    }

    case 'error': {
      let text = ERROR_TEXT[msg.code] ?? msg.message ?? 'Unknown error.';
      if (ERROR_DETAIL.has(msg.code) && msg.message) text += ` (${msg.message})`;
      if (req && !req.over) finish(req, 'error', `Error: ${text}`);
      else showNotice(`Server error: ${text}`); // not tied to a request we are waiting on
      break;
    }

    case 'cancel_ack':
      // The cancel found nothing to stop. Normally the terminal frame came first and
      // already ended "Stopping…"; if not, the ack is the last word on this request.
      if (req && req.state === 'stopping') {
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
  if (req.text === '' && req.state === 'streaming') setMeta(req, '');
  req.text += chunk;
  keepScrolled(() => req.textEl.append(chunk));
}

function finish(req, state, text) {
  req.over = true;
  setState(req, state);
  setMeta(req, text);
  if (current === req) current = null;
  updateControls();
}

// ---------- user actions ----------

function send() {
  const content = els.prompt.value.trim();
  if (!content || current || !isOpen()) return;

  const id = `c${++counter}-${Math.random().toString(36).slice(2, 8)}`;
  const frame = {
    type: 'generate',
    id,
    messages: [...history(), { role: 'user', content }],
    max_tokens: Math.round(readNumber(els.maxTokens, 256)),
    temperature: readNumber(els.temperature, 0.7),
    timeout_s: readNumber(els.timeout, 60),
  };

  addUserMessage(content);
  const req = addAssistantMessage(id);
  req.sock = ws;
  turns.push({ user: content, req });
  requests.set(id, req);
  current = req;
  sendFrame(frame);

  els.prompt.value = '';
  autosize();
  hideNotice();
  updateControls();
}

function stop() {
  if (!current || current.state !== 'streaming') return;
  setState(current, 'stopping');
  setMeta(current, 'Stopping…');
  sendFrame({ type: 'cancel', id: current.id });
  updateControls();
}

function newChat() {
  // Starting over must not leave the old answer burning server time.
  if (current) sendFrame({ type: 'cancel', id: current.id });
  current = null;
  turns = [];
  requests = new Map();
  els.messages.replaceChildren();
  hideNotice();
  updateControls();
  els.prompt.focus();
}

// Past turns as chat messages. Turns that errored never reached the model (or broke it),
// so they are left out; otherwise a too-long prompt would poison every later request.
function history() {
  return turns
    .filter((t) => t.req.state !== 'error')
    .flatMap((t) => (t.req.text
      ? [{ role: 'user', content: t.user }, { role: 'assistant', content: t.req.text }]
      : [{ role: 'user', content: t.user }]));
}

function readNumber(input, fallback) {
  const n = input.valueAsNumber;
  return Number.isFinite(n) ? n : fallback;
}

// ---------- rendering ----------

function addUserMessage(content) {
  const el = h('article', 'msg user');
  el.append(h('div', 'who', 'You'), h('div', 'text', content));
  keepScrolled(() => els.messages.append(el));
}

function addAssistantMessage(id) {
  const el = h('article', 'msg assistant');
  el.dataset.id = id;
  const textEl = h('div', 'text');
  const metaEl = h('div', 'meta', 'Waiting…');
  el.append(h('div', 'who', 'Assistant'), textEl, metaEl);
  const req = { id, el, textEl, metaEl, sock: null, text: '', next: 0, pending: new Map(), state: '', over: false };
  setState(req, 'streaming');
  keepScrolled(() => els.messages.append(el));
  return req;
}

function setState(req, state) {
  req.state = state;
  req.el.dataset.state = state;
}

function setMeta(req, text) {
  req.metaEl.textContent = text;
}

function updateControls() {
  const running = current !== null;
  els.send.disabled = running || !isOpen();
  els.stop.disabled = !running || current.state !== 'streaming';
  // A disabled button drops keyboard focus on the floor; hand it back to the prompt.
  const active = document.activeElement;
  if (active && active.disabled) els.prompt.focus();
}

function showNotice(text) {
  els.notice.textContent = text;
  els.notice.hidden = false;
}

function hideNotice() {
  els.notice.hidden = true;
  els.notice.textContent = '';
}

// Follow the stream only if the reader is already at the bottom; never yank them back up.
function keepScrolled(mutate) {
  const s = els.scroller;
  const atBottom = s.scrollHeight - s.scrollTop - s.clientHeight < 40;
  mutate();
  if (atBottom) s.scrollTop = s.scrollHeight;
}

function autosize() {
  const p = els.prompt;
  p.style.height = 'auto';
  p.style.height = `${Math.min(p.scrollHeight, 200)}px`;
}

function h(tag, className, text) {
  const el = document.createElement(tag);
  el.className = className;
  if (text) el.textContent = text;
  return el;
}

const countTokens = (n) => `${n ?? 0} token${n === 1 ? '' : 's'}`;
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

document.addEventListener('keydown', (e) => {
  if (e.key === 'Escape' && current) {
    e.preventDefault();
    stop();
  }
});

// Closing the socket is what stops the generation server-side; do it explicitly on unload.
window.addEventListener('pagehide', () => {
  pageHidden = true;
  clearTimers();
  if (ws) ws.close();
});
window.addEventListener('pageshow', (e) => {
  if (e.persisted) {
    pageHidden = false;
    connect();
  }
});

connect();
els.prompt.focus();
