// Live page of the streamproc edge. Follows one request with the browser's own EventSource.
// Everything the page received is kept in window.streamprocPage (tests read it): `received` holds
// the data of every ordinary event exactly as the browser's SSE parser delivered it, "[DONE]" included.
"use strict";

const page = (window.streamprocPage = {
  requestId: null, state: "idle", received: [], meta: [], verdict: null, source: null,
});
const RANK = { passthrough: 0, joined: 1, stitched: 2, omitted: 3 };
const $ = (id) => document.getElementById(id);

function setState(state) {
  page.state = state;
  const el = $("state");
  el.textContent = state;
  el.className = "badge " + ({ open: "joined", done: "passthrough", failed: "failed" }[state] || "none");
}

function setVerdict(verdict) {
  page.verdict = verdict;
  const el = $("verdict");
  el.textContent = verdict || "–";
  el.className = "badge " + (verdict || "none");
}

// The generated text of a body: the string values of `text` keys (top level or inside lists of objects).
function textOf(value, depth = 0) {
  if (depth > 3 || value === null || typeof value !== "object") return "";
  if (!Array.isArray(value) && typeof value.text === "string") return value.text;
  const items = Array.isArray(value) ? value : Object.values(value).filter(Array.isArray);
  return items.map((item) => textOf(item, depth + 1)).join("");
}

// Omission markers (`<field>_unavailable_reason`) anywhere in a body, as "field: reason".
function reasonsOf(value, out = [], depth = 0) {
  if (depth > 4 || value === null || typeof value !== "object") return out;
  for (const [key, inner] of Object.entries(value)) {
    if (key.endsWith("_unavailable_reason")) out.push(key.replace(/_unavailable_reason$/, "") + ": " + inner);
    else reasonsOf(inner, out, depth + 1);
  }
  return out;
}

function addRow(seq, meta, data) {
  const row = document.createElement("tr");
  const verdict = meta ? meta.error ? "error" : meta.verdict || "–" : "–";
  for (const [text, cls] of [[seq, ""], [verdict, "badge " + verdict], [new Blob([data]).size, ""], [data, "body"]]) {
    const cell = document.createElement("td");
    if (cls === "body") { cell.className = "body"; cell.title = data; cell.textContent = data; }
    else if (cls) { const badge = document.createElement("span"); badge.className = cls; badge.textContent = text; cell.append(badge); }
    else cell.textContent = text;
    row.append(cell);
  }
  $("chunks").append(row);
}

function follow(requestId) {
  if (page.source) page.source.close();
  Object.assign(page, { requestId, received: [], meta: [], verdict: null });
  $("current").textContent = requestId;
  $("tokens").textContent = "";
  $("chunks").textContent = "";
  $("reasons").textContent = "";
  $("count").textContent = "0 results";
  setVerdict(null);
  setState("connecting");
  history.replaceState(null, "", "?id=" + encodeURIComponent(requestId) + location.hash);  // keeps #access_token

  const source = new EventSource(edgeUrl("/v1/results/" + encodeURIComponent(requestId) + "?verdicts=1"));
  page.source = source;
  let lastMeta = null;
  source.onopen = () => setState("open");
  source.addEventListener("meta", (event) => {
    lastMeta = JSON.parse(event.data);
    page.meta.push(lastMeta);
  });
  source.onmessage = (event) => {
    page.received.push(event.data);
    if (event.data === "[DONE]") {
      source.close();
      setState(page.state === "failed" ? "failed" : "done");
      return;
    }
    const meta = lastMeta && String(lastMeta.seq) === event.lastEventId ? lastMeta : null;
    let doc = null;
    try { doc = JSON.parse(event.data); } catch (_) { /* opaque bytes are shown as they are */ }
    if (meta && meta.error) {
      setState("failed");
      setVerdict("error");
      $("reasons").textContent = meta.error + ": " + ((doc && doc.error && doc.error.message) || event.data);
    } else if (meta && meta.verdict && (page.verdict === null || RANK[meta.verdict] > RANK[page.verdict])) {
      setVerdict(meta.verdict);
    }
    if (doc) {
      $("tokens").textContent += textOf(doc);
      const reasons = reasonsOf(doc);
      if (reasons.length) $("reasons").textContent = "omitted " + reasons.join(", ");
    }
    addRow(event.lastEventId, meta, event.data);
    const n = $("chunks").children.length;
    $("count").textContent = n + (n === 1 ? " result" : " results");
  };
  source.onerror = () => {
    if (page.state === "done") return;
    setState(source.readyState === EventSource.CLOSED ? "closed" : "reconnecting");
  };
}

async function refreshRecent() {
  try {
    const response = await fetch(edgeUrl("/v1/recent"));
    if (!response.ok) return;
    const entries = await response.json();
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
