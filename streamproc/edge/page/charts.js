// Small live charts from GET /v1/stats (streamproc/edge/stats.py), polled every second:
// results/s over all requests (the edge's P.results.> subscription) and the processors' join wait
// (mean and p95 of the P/D results that completed in each interval, from their histograms), with
// the joins' own CPU time beside it (mean per interval, streamproc_join_seconds).
// State for tests: window.streamprocCharts = { samples, rates, joins, computes, note }.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEEP = 30, EVERY = 1000;
  const charts = (window.streamprocCharts = { samples: 0, rates: [], joins: [], computes: [], note: "" });
  let previous = null;

  // The p-quantile of the observations between two cumulative bucket lists (upper bound of the
  // bucket it falls in, Prometheus' histogram_quantile without interpolation); null if none.
  function quantile(before, after, p) {
    const count = (b) => (b ? b.count : 0);
    const total = count(after) - count(before);
    if (total <= 0) return null;
    const old = new Map((before ? before.buckets : []).map(([le, n]) => [le === null ? Infinity : le, n]));
    for (const [le, n] of after.buckets) {
      const bound = le === null ? Infinity : le;
      if (n - (old.get(bound) || 0) >= p * total) return bound;
    }
    return null;
  }

  function plot(canvasId, series, colours) {
    const canvas = $(canvasId), ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height;
    ctx.clearRect(0, 0, w, h);
    const values = series.flat().filter((v) => v !== null && Number.isFinite(v));
    const max = Math.max(1, ...values) * 1.15;  // a flat zero line sits at the bottom of a 0..1 scale
    ctx.strokeStyle = "#eef0f4";
    ctx.beginPath(); ctx.moveTo(0, h - 0.5); ctx.lineTo(w, h - 0.5); ctx.stroke();
    series.forEach((points, i) => {
      ctx.strokeStyle = colours[i];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let pen = false;
      points.forEach((v, k) => {
        const x = w - (points.length - 1 - k) * (w / (KEEP - 1));
        if (v === null || !Number.isFinite(v)) { pen = false; return; }
        const y = h - 2 - (v / max) * (h - 6);
        if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        pen = true;
        ctx.fillStyle = colours[i];
        ctx.fillRect(x - 1.5, y - 1.5, 3, 3);  // a lone interval (one P/D burst) is still seen
      });
      ctx.stroke();
    });
    ctx.fillStyle = "#7a8499";
    ctx.font = "9px system-ui, sans-serif";
    ctx.fillText(max / 1.15 >= 10 ? (max / 1.15).toFixed(0) : (max / 1.15).toPrecision(2), 2, 9);
  }

  function push(list, value) {
    list.push(value);
    if (list.length > KEEP) list.shift();
  }

  async function poll() {
    let now;
    try {
      const response = await fetch(apiUrl("/v1/stats"));
      if (!response.ok) return;
      now = await response.json();
    } catch (_) { return; /* the edge may be restarting */ }
    charts.samples += 1;
    if (previous) {
      const dt = Math.max(1e-3, now.time - previous.time);
      // --recent 0: the edge does not watch every result; chart what it sent to clients instead.
      const key = now.results_seen === null ? "results_sent" : "results_seen";
      charts.ratesOf = key === "results_seen" ? "all requests" : "sent by this edge (--recent 0)";
      push(charts.rates, Math.max(0, (now[key] - previous[key]) / dt));
      $("rate-label").textContent = "results/s (" + charts.ratesOf + ")";
      const before = previous.join_wait, after = now.join_wait;
      if (after) {
        const n = after.count - (before ? before.count : 0);
        const mean = n > 0 ? ((after.sum - (before ? before.sum : 0)) / n) * 1000 : null;
        const p95 = quantile(before, after, 0.95);
        push(charts.joins, [mean, p95 === null || p95 === Infinity ? null : p95 * 1000, n]);
      } else {
        push(charts.joins, [null, null, 0]);
      }
      const ran = now.join, ranBefore = previous.join;  // the join's own CPU time (null: an older processor)
      const joined = ran ? ran.count - (ranBefore ? ranBefore.count : 0) : 0;
      push(charts.computes, joined > 0 ? ((ran.sum - (ranBefore ? ranBefore.sum : 0)) / joined) * 1000 : null);
      const rate = charts.rates[charts.rates.length - 1];
      $("rate-value").textContent = rate.toFixed(rate >= 10 ? 0 : 1) + "/s";
      plot("rate-chart", [charts.rates], ["#3d5afe"]);
      // The latest interval in which P/D results were published (quiet intervals have no wait).
      const latest = [...charts.joins].reverse().find((j) => j[0] !== null);
      $("join-value").textContent = !latest ? "–" :
        latest[0].toFixed(latest[0] >= 10 ? 0 : 2) + " · " + (latest[1] === null ? "–" : "≤" + latest[1]);
      const cpu = [...charts.computes].reverse().find((c) => c !== null);
      if (cpu !== undefined) $("join-value").textContent += " · cpu " + cpu.toFixed(cpu >= 10 ? 0 : 2);
      plot("join-chart", [charts.joins.map((j) => j[0]), charts.joins.map((j) => j[1]), charts.computes],
           ["#2e7d32", "#ff9100", "#6a1b9a"]);
    }
    const failing = (now.processors || []).filter((p) => !p.ok);
    charts.note = !(now.processors || []).length
      ? "join wait needs the processors' metrics: start the edge with --processor-metrics-url"
      : failing.length ? failing.length + " processor(s) not answering: " + failing.map((p) => p.url + " (" +
        p.error + ")").join(", ") : "from " + now.processors.length + " processor(s)";
    $("join-note").textContent = charts.note;
    previous = now;
  }

  poll();
  setInterval(poll, EVERY);
})();
