// Edge capability plumbing for the live page (docs/security.md, "Edge capabilities").
// An operator opens the page as /#access_token=<token> (`streamproc token --operator`): the fragment
// never reaches a server or its log. The page then takes the token out of its address (so it is in
// no history entry, bookmark or copied link) and keeps it in this tab's sessionStorage (a reload
// keeps it; closing the tab forgets it). Every API and EventSource URL the page builds goes through
// edgeUrl(), which appends access_token= (RFC 6750 2.3: EventSource cannot set an Authorization
// header). GET /v1/info says whether the edge runs as an --insecure-demo, which the page states, and
// names the format's routed-experts field (edgeAccess.info).
"use strict";

const edgeAccess = (() => {
  const KEY = "streamproc.access_token";
  const fragment = new URLSearchParams(location.hash.slice(1));
  let token = fragment.get("access_token");
  if (token !== null) {  // a new one (an empty one forgets the last)
    fragment.delete("access_token");
    const rest = fragment.toString();
    history.replaceState(history.state, "", location.pathname + location.search + (rest ? "#" + rest : ""));
    try { sessionStorage.setItem(KEY, token); } catch (_) { /* storage off: this page load only */ }
  } else {
    try { token = sessionStorage.getItem(KEY); } catch (_) { token = null; }
  }
  token = token || "";

  function edgeUrl(path) {
    if (!token) return path;
    return path + (path.includes("?") ? "&" : "?") + "access_token=" + encodeURIComponent(token);
  }

  function show(text, kind) {
    const banner = document.getElementById("auth-banner");
    if (!banner) return;
    banner.textContent = text;
    banner.className = "auth-banner " + kind;
    banner.hidden = false;
  }

  // The edge's answer, shared: experts.js reads the format's routed-experts field name from it.
  const info = fetch("/v1/info").then((r) => r.json());
  info.then((info) => {
    if (info.auth === "insecure-demo") {
      show("Insecure demo: this edge serves every request's results to anyone (--insecure-demo).", "insecure");
    } else if (!token) {
      show("This edge needs an operator capability: open the page as /#access_token=<token> " +
           "(streamproc token --operator).", "needs-token");
    }
  }).catch(() => {});

  return { token, edgeUrl, info: info.catch(() => ({})) };
})();
const edgeUrl = edgeAccess.edgeUrl;
