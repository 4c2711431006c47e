// The flow run page, live: on each event of the flow run's jobs (Server-Sent Events, the console's
// live mechanism), the server-rendered graph is fetched again and swapped in. No framework, no build.
"use strict";

(function () {
  var MIN_INTERVAL_MS = 300; // at most this often: a busy flow run does not flood the server
  var SETTLE_MS = 1000;

  function setup() {
    var box = document.getElementById("flow-live");
    if (!box || !window.EventSource) return;
    var graph = document.getElementById("flow-graph");
    if (!graph || graph.getAttribute("data-state") !== "running") return;
    var flow = box.getAttribute("data-flow");
    var params = new URLSearchParams();
    if (box.getAttribute("data-cursor")) params.set("cursor", box.getAttribute("data-cursor"));
    var source = new EventSource("/flows/" + encodeURIComponent(flow) + "/events?" + params.toString());
    var timer = null;
    var inflight = false;
    var again = false;
    var last = 0;

    function indicator(state) {
      var element = document.getElementById("live-indicator");
      if (element) element.setAttribute("data-state", state);
    }
    function refresh() {
      timer = null;
      if (inflight) { again = true; return; }
      inflight = true;
      last = Date.now();
      fetch("/flows/" + encodeURIComponent(flow) + "/graph", { credentials: "same-origin" })
        .then(function (response) { return response.ok ? response.text() : Promise.reject(response.status); })
        .then(function (html) {
          var parsed = new DOMParser().parseFromString(html, "text/html");
          var fresh = parsed.getElementById("flow-graph");
          var current = document.getElementById("flow-graph");
          if (fresh && current) {
            current.replaceWith(document.adoptNode(fresh));
            if (fresh.getAttribute("data-state") !== "running") {
              source.close();
              return;
            }
            indicator("connected");
            // Every job has finished but the leader has not closed the flow run yet: that step
            // publishes no execution event, so look again shortly.
            if (fresh.getAttribute("data-open-nodes") === "0") setTimeout(schedule, SETTLE_MS);
          }
        })
        .catch(function () { indicator("reconnecting"); })
        .then(function () {
          inflight = false;
          if (again) { again = false; schedule(); }
        });
    }
    function schedule() {
      if (timer !== null) return;
      timer = setTimeout(refresh, Math.max(0, MIN_INTERVAL_MS - (Date.now() - last)));
    }
    source.addEventListener("hello", function () { indicator("connected"); schedule(); });
    source.addEventListener("done", function () { source.close(); schedule(); });
    source.addEventListener("expired", function () { window.location.reload(); });
    source.onerror = function () { indicator("reconnecting"); };
    source.onmessage = schedule;
    window.addEventListener("pagehide", function () { source.close(); });
  }

  document.addEventListener("DOMContentLoaded", setup);
})();
