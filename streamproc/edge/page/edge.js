// Live page of the streamproc edge. Follows one request with the browser's own EventSource.
// What the page received is kept in window.streamprocPage (tests read it): `received` holds the data
// of the ordinary events exactly as the browser's SSE parser delivered them, "[DONE]" included, the
// newest RECEIVED_CHARS of them (`dropped` counts the older ones let go, `results` every result).
"use strict";

const page = (window.streamprocPage = {
  requestId: null, state: "idle", received: [], meta: [], verdict: null, source: null, textNode: null,
  dropped: 0, keptChars: 0, results: 0, textChars: 0,
});
const RANK = { passthrough: 0, joined: 1, stitched: 2, omitted: 3 };
const $ = (id) => document.getElementById(id);
// Seconds the stream may stay open without a result before the page says it is waiting.
const WAITING_AFTER = 1.0;
// Table rows kept: past this the oldest leaves the DOM (the count stays exact, `received` keeps every
// body). A row per result without a bound made a tab following a long request ever slower.
const MAX_ROWS = 1000;
// Bounds on what one request's results cost the tab, whatever its worker sends (docs/security.md):
// a row shows a body's first ROW_PREVIEW characters until clicked (a row holding a whole 900 KB body
// took ~12 MB of renderer memory to lay out, generated text ~80 MB per million characters, and the
// tab fell so far behind that the edge ended its stream); `received` keeps the newest RECEIVED_CHARS
// of bodies (each charged ENTRY_CHARS more), the text its last TEXT_CHARS characters.
const ROW_PREVIEW = 8192;
const RECEIVED_CHARS = 16 * 1024 * 1024;
const ENTRY_CHARS = 64;
const TEXT_CHARS = 256 * 1024;
const MAX_META = 10000;

// Keep `data` in `received`, letting the oldest go past RECEIVED_CHARS (down to three quarters of it,
// so a flood of small bodies does not move the whole array per result).
function keep(data) {
  page.received.push(data);
  page.keptChars += data.length + ENTRY_CHARS;
  if (page.keptChars <= RECEIVED_CHARS) return;
  let n = 0, freed = 0;
  while (n < page.received.length - 1 && page.keptChars - freed > RECEIVED_CHARS * 3 / 4) {
    freed += page.received[n].length + ENTRY_CHARS;
    n += 1;
  }
  page.received.splice(0, n);
  page.keptChars -= freed;
  page.dropped += n;
}

// Append generated text, keeping its last TEXT_CHARS characters (behind a note of how many went).
function appendText(text) {
  const node = page.textNode;
  node.appendData(text);
  page.textChars += text.length;
  const excess = node.length - TEXT_CHARS;
  if (excess > TEXT_CHARS / 4) {
    node.deleteData(0, excess);
    $("tokens-cut").textContent = "… (the first " + (page.textChars - node.length) + " characters are not shown)";
  }
}

// Every URL the page fetches or streams from is built here (one place for a prefix or a credential):
// access.js's edgeUrl() appends the operator's access_token when the page was opened with one.
function apiUrl(path) {
  return edgeUrl(path);
}

function setState(state, notice) {
  page.state = state;
  const el = $("state");
  el.textContent = state;
  el.className = "badge " + ({ open: "joined", done: "passthrough", failed: "failed", waiting: "waiting",
    invalid: "invalid", refused: "refused" }[state] || "none");
  if (notice !== undefined) showNotice(state, notice);
}

// Why nothing arrives. A finished request the edge saw on P.results.> would have been replayed at
// once from a JetStream results stream; if it was not, the edge reads core NATS (live results only).
function waitingNotice() {
  const entry = (page.recent || []).find((e) => e.request_id === page.requestId);
  if (entry && entry.final) {
    return "request " + page.requestId + " already finished (" + entry.results + " results), but this edge " +
      "cannot replay it: it has no JetStream results stream (start it with --ensure-results-stream)";
  }
  return "waiting for request " + page.requestId + ": no result yet. It has not started, or its first chunk is " +
    "still on its way; results appear here as the processor publishes them.";
}

// The one-line explanation under the summary: why the page waits, or what went wrong.
function showNotice(kind, text) {
  const el = $("notice");
  el.className = text ? kind : "";
  el.textContent = text || "";
}

// The stream closed without a result: ask the edge why with a plain request, which gets the same
// refusal (400 for an invalid id, 503 when NATS is down or too many streams are open) as JSON.
async function diagnose(requestId) {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), 3000);
  try {
    const response = await fetch(apiUrl("/v1/results/" + encodeURIComponent(requestId) + "?stream=false"),
      { signal: abort.signal, headers: { Accept: "application/json" } });
    if (page.requestId !== requestId || response.status < 400) return;
    // an answer of the request's results (a worker's error body carries the engine's 4xx/5xx:
    // Streamproc-Results; a stored error result its kind's: Streamproc-Error): the stream was
    // refused, but this is no refusal to show
    if (response.headers.has("Streamproc-Results") || response.headers.has("Streamproc-Error")) return;
    let message = "HTTP " + response.status;
    try { message = (await response.json()).error.message || message; } catch (_) { /* not JSON */ }
    page.refusal = { status: response.status, message };
    if (response.status === 400) setState("invalid", "invalid request id (the edge answered 400): " + message);
    else setState("refused", "the edge refused the stream (HTTP " + response.status + "): " + message);
  } catch (_) { /* no answer within 3 s: nothing better to say than "closed" */ } finally { clearTimeout(timer); }
}

function setVerdict(verdict) {
  page.verdict = verdict;
  const el = $("verdict");
  el.textContent = verdict || "–";
  el.className = "badge " + (verdict || "none");
}

// The format's generated-text field (GET /v1/info, text_field; null: its bodies carry none). Until
// the edge has answered, text is not shown; then what was received so far is rendered at once.
let textField = null;
edgeAccess.info.then((info) => {
  textField = info.text_field || null;
  if (page.textNode) {  // the node follow() appends to
    page.textNode.data = "";
    page.textChars = 0;
    appendText(page.received.map((data) => {
      try { return textOf(JSON.parse(data)); } catch (_) { return ""; }
    }).join(""));
  }
});

// The generated text of a body: the string values of the format's text field (top level or inside
// lists of objects).
function textOf(value, depth = 0) {
  if (textField === null || depth > 3 || value === null || typeof value !== "object") return "";
  if (!Array.isArray(value) && typeof value[textField] === "string") return value[textField];
  const items = Array.isArray(value) ? value : Object.values(value).filter(Array.isArray);
  return items.map((item) => textOf(item, depth + 1)).join("");
}

// A value a body chose, as text: a string as it is, anything else as its JSON ("[object Object]" told
// nothing), cut as the processor cuts a worker's value (errors.shown): its first 64 characters and length.
const SHOWN_CHARS = 64;
function shownValue(value) {
  let text = typeof value === "string" ? value : JSON.stringify(value);
  if (typeof text !== "string") text = String(value);  // undefined, a function
  return text.length <= SHOWN_CHARS ? text : text.slice(0, SHOWN_CHARS) + "... (" + text.length + " characters)";
}

// Omission markers (`<field>_unavailable_reason`) anywhere in a body, as "field: reason".
function reasonsOf(value, out = [], depth = 0) {
  if (depth > 4 || value === null || typeof value !== "object") return out;
  for (const [key, inner] of Object.entries(value)) {
    if (key.endsWith("_unavailable_reason")) out.push(key.replace(/_unavailable_reason$/, "") + ": " + shownValue(inner));
    else reasonsOf(inner, out, depth + 1);
  }
  return out;
}

// The row shows at most ROW_PREVIEW characters; a click shows the whole body while `received` still
// holds it (`at`: its place among everything received), and says so when it has been let go.
function bodyCell(data, at) {
  const cell = document.createElement("td");
  cell.className = "body";
  const more = data.length - ROW_PREVIEW;
  const preview = more > 0 ? data.slice(0, ROW_PREVIEW) + " … (" + more + " more characters: click for all of them)" : data;
  cell.textContent = preview;
  cell.addEventListener("click", () => {
    const expanded = cell.classList.toggle("expanded");
    if (more <= 0) return;
    const whole = page.received[at - page.dropped];
    cell.textContent = !expanded ? preview : at >= page.dropped && whole !== undefined ? whole :
      preview + " (the page no longer holds the rest: it keeps the newest " + RECEIVED_CHARS + " characters of bodies)";
  });
  return cell;
}

function addRow(seq, meta, data, at) {
  const row = document.createElement("tr");
  const verdict = meta ? meta.error ? "error" : meta.verdict || "–" : "–";
  for (const [text, cls] of [[seq, ""], [verdict, "badge " + verdict], [new Blob([data]).size, ""]]) {
    const cell = document.createElement("td");
    if (cls) { const badge = document.createElement("span"); badge.className = cls; badge.textContent = text; cell.append(badge); }
    else cell.textContent = text;
    row.append(cell);
  }
  row.append(bodyCell(data, at));
  const table = $("chunks");
  table.append(row);
  if (table.children.length > MAX_ROWS) table.firstElementChild.remove();
}

function showCount() {
  const n = page.results;
  $("count").textContent = n + (n === 1 ? " result" : " results") +
    (n > MAX_ROWS ? " (the last " + MAX_ROWS + " shown)" : "");
}

function follow(requestId) {
  if (page.source) page.source.close();
  Object.assign(page, { requestId, received: [], meta: [], verdict: null, refusal: null, error: null,
    dropped: 0, keptChars: 0, results: 0, textChars: 0 });
  $("current").textContent = requestId;
  page.textNode = document.createTextNode("");  // appended to, never rewritten: `textContent +=` per result
  $("tokens").replaceChildren(page.textNode);    // copied the whole text each time (quadratic in the stream)
  $("tokens-cut").textContent = "";
  $("chunks").textContent = "";
  $("reasons").textContent = "";
  $("count").textContent = "0 results";
  setVerdict(null);
  setState("connecting", "");
  if (window.streamprocExperts) window.streamprocExperts.reset();
  const params = new URLSearchParams(location.search);  // keeps the page's other settings (topk)
  params.set("id", requestId);
  history.replaceState(null, "", "?" + params + location.hash);  // (access.js took the token out of it)

  const source = new EventSource(apiUrl("/v1/results/" + encodeURIComponent(requestId) + "?verdicts=1"));
  page.source = source;
  let lastMeta = null;
  let lastId = "";  // the last result's id: an event without id: (the edge's own) keeps it (EventSource)
  let waiting = null;
  source.onopen = () => {
    setState("open");
    waiting = setTimeout(() => {
      if (page.source === source && page.state === "open" && !page.received.length) {
        setState("waiting", waitingNotice());
      }
    }, WAITING_AFTER * 1000);
  };
  source.addEventListener("meta", (event) => {
    lastMeta = JSON.parse(event.data);
    page.meta.push(lastMeta);
    if (page.meta.length > 2 * MAX_META) page.meta.splice(0, MAX_META);
  });
  source.onmessage = (event) => {
    keep(event.data);
    clearTimeout(waiting);
    const fresh = event.lastEventId !== lastId;  // every result sets a new id (seq order); the edge's frames none
    // The end is the edge's own "[DONE]", which has no id: a result's body is its worker's bytes and may
    // be "[DONE]" too (a passthrough body is not checked), which ended the stream here early.
    if (event.data === "[DONE]" && !fresh) {
      source.close();
      setState(page.state === "failed" ? "failed" : "done");
      if (window.streamprocExperts) window.streamprocExperts.show(page);
      return;
    }
    if (page.state === "waiting") setState("open", "");
    page.results += 1;
    if (fresh) lastId = event.lastEventId;
    const meta = fresh && lastMeta && String(lastMeta.seq) === event.lastEventId ? lastMeta : null;
    let doc = null;
    try { doc = JSON.parse(event.data); } catch (_) { /* opaque bytes are shown as they are */ }
    // An error result (meta.error), or the edge's own error body (no id: a timeout or a gap).
    const edgeError = !fresh && doc && doc.error ? "edge" : null;
    if ((meta && meta.error) || edgeError) {
      const kind = (meta && meta.error) || (doc.error.type || "error");
      const message = (doc && doc.error && doc.error.message) || event.data;
      page.error = { kind, message, from: meta && meta.error ? "processor" : "edge" };
      setState("failed", (page.error.from === "edge" ? "the edge ended the stream (" : "error result (") +
        kind + "): " + message);
      setVerdict("error");
    } else if (meta && meta.verdict && (page.verdict === null || RANK[meta.verdict] > RANK[page.verdict])) {
      setVerdict(meta.verdict);
    }
    if (doc) {
      appendText(textOf(doc));
      const reasons = reasonsOf(doc);
      if (reasons.length) $("reasons").textContent = "omitted " + reasons.join(", ");
    }
    addRow(fresh ? event.lastEventId : "", meta, event.data, page.dropped + page.received.length - 1);
    showCount();
  };
  source.onerror = () => {
    if (page.state === "done" || page.state === "failed") return;
    clearTimeout(waiting);
    const closed = source.readyState === EventSource.CLOSED;
    setState(closed ? "closed" : "reconnecting");
    if (closed && !page.received.length) diagnose(requestId);
  };
}

async function refreshRecent() {
  try {
    const response = await fetch(apiUrl("/v1/recent"));
    if (!response.ok) return;
    const entries = await response.json();
    page.recent = entries;
    if (page.state === "waiting") showNotice("waiting", waitingNotice());
    const list = $("recent");
    list.textContent = "";
    if (!entries.length) { list.innerHTML = '<li class="muted">none seen yet</li>'; return; }
    for (const entry of entries) {
      const item = document.createElement("li");
      const button = document.createElement("button");
      const verdicts = Object.entries(entry.verdicts).map(([v, n]) => v + "×" + n).join(" ");
      button.textContent = entry.request_id + "  ·  " + entry.results + (entry.final ? " ✓ " : " … ") +
        (entry.error ? "error:" + entry.error : verdicts);
      button.dataset.requestId = entry.request_id;
      button.addEventListener("click", () => { $("request-id").value = entry.request_id; follow(entry.request_id); });
      item.append(button);
      list.append(item);
    }
  } catch (_) { /* the edge may be restarting; try again on the next tick */ }
}

$("follow-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const requestId = $("request-id").value.trim();
  if (requestId) follow(requestId);
});
const initial = new URLSearchParams(location.search).get("id");
if (initial) { $("request-id").value = initial; follow(initial); }
refreshRecent();
setInterval(refreshRecent, 2000);
