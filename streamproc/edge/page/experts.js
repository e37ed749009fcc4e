// Routed-experts view of the followed request: a positions x layers heat map of expert ids.
// The page posts the result body that carries the format's routed-experts value (its name comes
// from GET /v1/info, experts_field) to the edge (POST /v1/experts), whose --format codec decodes it
// and answers with the id matrix as JSON, the rows attributed to legs by the request's verdict;
// see streamproc/edge/experts.py for why the browser does not decode it. State for tests:
// window.streamprocExperts.state ("none" | "loading" | "shown" | "omitted" | "problem" | "failed")
// and .view (the edge's answer).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  let FIELD = null;  // the format's field name, from GET /v1/info (null: this format has none)
  // What each omission reason means (docs/codecs.md, "Anything else removes the field"; every
  // OmissionReason, streamproc/core/codec.py, tests/test_docs_match_code.py).
  const REASONS = {
    prefill_timeout: "the prefill leg did not complete within --prefill-timeout",
    prefill_error: "the prefill leg ended with an abort/error",
    prefill_missing: "the prefill leg has no value although decode shows it was requested",
    decode_missing: "the decode leg has no value although prefill shows it was requested",
    prefill_corrupt: "prefill's value is undecodable or holds rows no real capture produces",
    decode_corrupt: "decode's value is undecodable or holds rows no real capture produces",
    length_mismatch: "decode's row count fits no reading of the token counts",
    shape_mismatch: "the legs advertise different dtypes",
    too_large: "the value decodes past what the body allows",
    decode_error: "the decode leg ended with an abort/error and did not carry the value",
    stitch_corrupt: "a resumed attempt's value cannot be stitched to the earlier attempts'",
    stitch_incomplete: "the value covers the whole output, and the lost attempt never published its part",
    fold_ambiguous: "the folded stream fits two unary values, and nothing in it says which",
    not_streamed: "the unary answer has this field, and no chunk of the folded stream carries it",
  };
  const PREFILL = "#3d5afe", DECODE = "#ff9100", AGG = "#90a4ae", JOINED = "#7e57c2", RESUMED = "#00897b";
  const SPLICE = "#d50000";
  // The edge's row spans (view.spans: worker | prefill | decode | joined | resumed) as band colours and labels.
  const SOURCES = { worker: [AGG, "aggregated"], prefill: [PREFILL, "prefill"], decode: [DECODE, "decode"],
    joined: [JOINED, "P/D, split unknown"], resumed: [RESUMED, "migrated, attempts not told apart"] };
  // Viridis, five stops: expert id 0 is dark blue, the largest id in the payload is yellow.
  const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const HEAD = 14, BAND = 8, LEFT = 34, BOTTOM = 16;  // pixels around the cells

  const experts = (window.streamprocExperts = { state: "none", view: null, body: null, topK: null, layout: null });

  function colour(fraction) {
    const x = Math.min(1, Math.max(0, fraction)) * (STOPS.length - 1);
    const i = Math.min(STOPS.length - 2, Math.floor(x)), t = x - i;
    const [a, b] = [STOPS[i], STOPS[i + 1]];
    return [0, 1, 2].map((k) => Math.round(a[k] + (b[k] - a[k]) * t));
  }

  // The object that holds the field, wherever the format nests it (depth-bounded).
  function holder(value, depth = 0) {
    if (FIELD === null || depth > 4 || value === null || typeof value !== "object") return null;
    if (!Array.isArray(value) && FIELD in value) return value;
    for (const inner of Array.isArray(value) ? value : Object.values(value)) {
      const found = holder(inner, depth + 1);
      if (found) return found;
    }
    return null;
  }

  // Top-k when the wire does not state it: the URL's ?topk=, else the largest usual top-k dividing the row.
  function guessTopK(view) {
    if (view.top_k) return view.top_k;
    const asked = Number(new URLSearchParams(location.search).get("topk"));
    if (asked > 0 && view.row_ids % asked === 0) return asked;
    return [8, 6, 4, 2, 1].find((k) => view.row_ids % k === 0) || 1;
  }

  function reset() {
    Object.assign(experts, { state: "none", view: null, body: null, layout: null });
    $("experts-panel").hidden = true;
    for (const id of ["experts-summary", "experts-omitted", "experts-legend", "experts-pager"]) $(id).textContent = "";
    $("experts-hover").innerHTML = "&nbsp;";
    $("experts-scroll").hidden = true;
    const canvas = $("experts-map");
    canvas.width = canvas.height = 10;
  }

  // What a reason means: own properties of REASONS only (a body's reason "constructor" found
  // Object's constructor through the prototype and showed its source), else plain text.
  function meaning(reason) {
    return typeof reason === "string" && Object.hasOwn(REASONS, reason) ? REASONS[reason]
      : "a reason this page does not know";
  }

  function listOmitted(omitted) {
    const list = $("experts-omitted");
    list.textContent = "";
    for (const [field, reason] of Object.entries(omitted)) {
      const item = document.createElement("li");
      item.textContent = "omitted " + field + ": " + shownValue(reason) + " (" + meaning(reason) + ")";
      list.append(item);
    }
  }

  // After [DONE]: the last body that carries the field goes to the edge for decoding.
  async function show(page) {
    reset();
    FIELD = (await edgeAccess.info).experts_field || null;
    const label = FIELD || "routed experts";
    const docs = page.received.map((data) => { try { return JSON.parse(data); } catch (_) { return null; } });
    const omitted = Object.create(null);  // field names are the body's: "__proto__" is one like any other
    docs.forEach((doc) => collectReasons(doc, omitted));
    const index = docs.map((doc) => holder(doc)).map((h) => h && h[FIELD] != null).lastIndexOf(true);
    if (index < 0 && !Object.keys(omitted).length) return;
    $("experts-panel").hidden = false;
    listOmitted(omitted);
    if (index < 0) {
      experts.state = "omitted";
      $("experts-summary").textContent = "no " + label + " in this request's results: " +
        (FIELD && FIELD in omitted ? "omitted, see why below; no heat map" : "not requested, or dropped by both legs");
      return;
    }
    experts.state = "loading";
    experts.body = page.received[index];
    // The strongest verdict the request's results had: the edge attributes the rows to legs by it.
    experts.verdict = ["omitted", "stitched", "joined"].find((v) => page.meta.some((m) => m && m.verdict === v))
      || "passthrough";
    experts.pd = experts.verdict !== "passthrough";
    experts.requestId = page.requestId;
    await load(0);
  }

  function collectReasons(value, out, depth = 0) {
    if (depth > 4 || value === null || typeof value !== "object") return;
    for (const [key, inner] of Object.entries(value)) {
      if (key.endsWith("_unavailable_reason")) {  // any value: listed, shown as text (shownValue)
        out[key.replace(/_unavailable_reason$/, "")] = inner;
      } else collectReasons(inner, out, depth + 1);
    }
  }

  async function load(offset) {
    const requestId = experts.requestId;
    let view;
    try {
      const query = "?offset=" + offset + "&verdict=" + encodeURIComponent(experts.verdict);
      const response = await fetch(apiUrl("/v1/experts" + query), {
        method: "POST", body: experts.body, headers: { "Content-Type": "application/json" },
      });
      view = await response.json();
      if (!response.ok) throw new Error((view.error && view.error.message) || "HTTP " + response.status);
    } catch (error) {
      if (experts.requestId !== requestId) return;
      experts.state = "failed";
      $("experts-summary").textContent = "the edge could not decode " + (FIELD || "routed experts") + ": " + error.message;
      return;
    }
    if (experts.requestId !== requestId) return;  // the user followed another request meanwhile
    experts.view = view;
    if (view.problem) {
      experts.state = "problem";
      $("experts-summary").textContent = (FIELD || "routed experts") + " present but not shown: " + view.problem;
      return;
    }
    experts.topK = guessTopK(view);
    draw();
    experts.state = "shown";
  }

  // Which worker computed a row: the span the edge's codec put it in.
  function sourceOf(row) {
    const span = experts.view.spans.find((s) => row >= s.start && row < s.stop);
    return span ? span.source : "worker";
  }

  // The row where decode's rows begin, when the body says so.
  function spliceOf(view) {
    const prefill = view.spans.find((s) => s.source === "prefill");
    const decode = view.spans.find((s) => s.source === "decode");
    return prefill && decode ? decode.start : null;
  }

  function summary(view, layers, topK) {
    const end = view.start + view.positions, splice = spliceOf(view);
    const sources = view.spans.map((s) => s.source);
    let text = view.positions + " positions [" + view.start + ", " + end + ") × " + layers + " layers × top-" +
      topK + " (" + view.row_ids + " " + view.dtype + " ids a row" + (view.top_k ? "" : "; top-k is not on the " +
      "wire, set it below") + ")";
    if (splice !== null) {
      const at = view.start + splice;
      text += " · P/D join: rows of positions " + view.start + "–" + (at - 1) + " from prefill, " +
        at + "–" + (end - 1) + " from decode; splice at position " + at;
    } else if (sources.includes("prefill")) {
      text += " · P/D join: every row from prefill (one-token decode)";
    } else if (sources.includes("joined")) {
      text += " · P/D join: this body does not say where prefill's rows end";
    } else if (sources.includes("resumed")) {
      text += " · migrated: rows of more than one attempt, not told apart in the body";
    } else {
      text += " · aggregated: every row from one worker, no splice";
    }
    return text;
  }

  function draw() {
    const view = experts.view, topK = experts.topK;
    const layers = Math.max(1, Math.floor(view.row_ids / topK));
    $("experts-summary").textContent = summary(view, layers, topK);
    // Top-k control and pager.
    const pager = $("experts-pager");
    pager.textContent = "";
    const label = document.createElement("label");
    label.textContent = "top-k ";
    const input = document.createElement("input");
    Object.assign(input, { id: "experts-topk", type: "number", min: 1, value: topK });
    input.addEventListener("change", () => {
      const k = Number(input.value);
      if (k > 0 && view.row_ids % k === 0) { experts.topK = k; draw(); }
    });
    label.append(input);
    pager.append(label);
    if (view.rows < view.positions) {
      const note = document.createElement("span");
      note.textContent = "  rows " + view.offset + "–" + (view.offset + view.rows - 1) + " of " + view.positions + " ";
      pager.append(note);
      for (const [text, to] of [["◀", view.offset - view.rows], ["▶", view.offset + view.rows]]) {
        const button = document.createElement("button");
        button.textContent = text;
        button.disabled = to < 0 || to >= view.positions;
        button.addEventListener("click", () => load(Math.max(0, to)));
        pager.append(button);
      }
    }
    const legend = $("experts-legend");
    legend.innerHTML = "";
    const shown = [...new Set(view.spans.map((s) => s.source))];
    const swatches = (shown.length ? shown : ["worker"]).map((source) => [SOURCES[source][0], SOURCES[source][1] + " rows"]);
    if (spliceOf(view) !== null) swatches.push([SPLICE, "splice boundary"]);
    for (const [fill, text] of [...swatches, ["linear-gradient(90deg,#440154,#21918c,#fde725)",
      "expert id 0 … " + view.max_id]]) {
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = fill;
      legend.append(swatch, text);
    }
    // Geometry: x = position, y = layer (top-k slots stacked inside each layer).
    $("experts-scroll").hidden = false;  // shown before it is measured
    const room = Math.max(200, $("experts-scroll").clientWidth - LEFT - 6);  // fit the panel when we can
    const cw = Math.max(1, Math.min(14, Math.floor(room / Math.max(1, view.rows))));
    const sh = Math.max(1, Math.min(6, Math.floor(420 / Math.max(1, view.row_ids))));
    const gap = sh >= 3 && topK > 1 ? 1 : 0;  // a white line between layers
    const lh = topK * sh + gap;
    const canvas = $("experts-map");
    canvas.width = LEFT + view.rows * cw + 4;
    canvas.height = HEAD + BAND + 2 + layers * lh + BOTTOM;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    const image = ctx.createImageData(view.rows * cw, layers * lh);
    const top = HEAD + BAND + 2;
    for (let r = 0; r < view.rows; r++) {
      for (let j = 0; j < view.row_ids; j++) {
        const [red, green, blue] = colour(view.max_id ? view.ids[r * view.row_ids + j] / view.max_id : 0);
        const layer = Math.floor(j / topK), slot = j % topK;
        const y0 = layer * lh + slot * sh;
        for (let dy = 0; dy < sh; dy++) {
          for (let dx = 0; dx < cw; dx++) {
            const p = ((y0 + dy) * view.rows * cw + r * cw + dx) * 4;
            image.data[p] = red; image.data[p + 1] = green; image.data[p + 2] = blue; image.data[p + 3] = 255;
          }
        }
      }
    }
    if (gap) {  // leave the layer separators white
      for (let layer = 1; layer < layers; layer++) {
        const y = layer * lh - 1;
        for (let x = 0; x < view.rows * cw; x++) {
          const p = (y * view.rows * cw + x) * 4;
          image.data[p] = image.data[p + 1] = image.data[p + 2] = image.data[p + 3] = 255;
        }
      }
    }
    ctx.putImageData(image, LEFT, top);
    // Band above the cells: which leg each position's row came from.
    const splice = spliceOf(view);
    for (let r = 0; r < view.rows; r++) {
      ctx.fillStyle = SOURCES[sourceOf(view.offset + r)][0];
      ctx.fillRect(LEFT + r * cw, HEAD, cw, BAND);
    }
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = "#4a5468";
    ctx.textBaseline = "alphabetic";
    ctx.fillText("layer", 0, top - 2);
    ctx.fillText("0", LEFT - 10, top + lh - 1);
    if (layers > 1) ctx.fillText(String(layers - 1), LEFT - 6 - 6 * String(layers - 1).length, top + layers * lh - 1);
    ctx.fillText("position " + (view.start + view.offset), LEFT, canvas.height - 4);
    const last = "" + (view.start + view.offset + view.rows - 1);
    ctx.fillText(last, Math.max(LEFT + 80, LEFT + view.rows * cw - 6 * last.length), canvas.height - 4);
    if (splice !== null && splice >= view.offset && splice < view.offset + view.rows) {
      const x = LEFT + (splice - view.offset) * cw;
      ctx.fillStyle = SPLICE;
      ctx.fillRect(x - 1, HEAD - 2, 2, canvas.height - HEAD - BOTTOM + 2);
      ctx.fillText("splice @ " + (view.start + splice), Math.max(LEFT, x - 30), 10);
    }
    experts.layout = { cw, sh, lh, top, layers, topK, splice };
    canvas.onmousemove = (event) => hover(event, canvas);
  }

  function hover(event, canvas) {
    const { cw, lh, sh, top, layers, topK } = experts.layout, view = experts.view;
    const scale = canvas.width / canvas.getBoundingClientRect().width;
    const x = event.offsetX * scale - LEFT, y = event.offsetY * scale - top;
    const r = Math.floor(x / cw), layer = Math.floor(y / lh), slot = Math.floor((y % lh) / sh);
    if (x < 0 || y < 0 || r >= view.rows || layer >= layers || slot >= topK) return;
    const row = view.offset + r;
    const leg = SOURCES[sourceOf(row)][1];
    $("experts-hover").textContent = "position " + (view.start + row) + " (" + leg + ") · layer " + layer +
      " · slot " + slot + " · expert " + view.ids[r * view.row_ids + layer * topK + slot];
  }

  Object.assign(experts, { show, reset });
})();
