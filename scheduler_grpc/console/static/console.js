// scheduler-grpc web console: the few things a server-rendered page cannot do alone.
// No framework, no build step; loaded as a file (the Content-Security-Policy forbids inline script).
"use strict";

(function () {
  // Confirmations: any button or form with data-confirm asks first.
  document.addEventListener("click", function (event) {
    var target = event.target.closest("[data-confirm]");
    if (target && !window.confirm(target.getAttribute("data-confirm"))) {
      event.preventDefault();
    }
  });

  // Live schedule preview: the next fire times of the cron expression as it is typed.
  function setupPreview() {
    var cron = document.getElementById("f-cron");
    var list = document.getElementById("preview-list");
    if (!cron || !list) return;
    var error = document.getElementById("preview-error");
    var fields = ["cron", "time_zone", "dst_gap_policy", "dst_fold_policy"];
    var timer = null;
    var sequence = 0;
    function update() {
      var params = new URLSearchParams();
      fields.forEach(function (name) {
        var element = document.getElementById("f-" + name);
        if (element) params.set(name, element.value);
      });
      if (!params.get("cron")) {
        list.textContent = "";
        error.textContent = "";
        return;
      }
      var mine = ++sequence;
      fetch("/api/preview?" + params.toString(), { credentials: "same-origin" })
        .then(function (response) { return response.json().then(function (body) { return [response.ok, body]; }); })
        .then(function (pair) {
          if (mine !== sequence) return; // a newer keystroke's answer wins
          list.textContent = "";
          error.textContent = "";
          if (!pair[0]) {
            error.textContent = (pair[1].field ? pair[1].field + ": " : "") + pair[1].error;
            return;
          }
          pair[1].fire_times.forEach(function (fire) {
            var item = document.createElement("li");
            item.textContent = fire.local.replace("T", " ") + " local = " + fire.instant.replace("T", " ") + " UTC";
            if (fire.dst !== "none") {
              var flag = document.createElement("span");
              flag.className = "dst dst-" + fire.dst;
              flag.textContent = fire.dst === "shifted" ? " DST: shifted (the slot did not exist)" : " DST: repeated (the slot happened twice)";
              item.appendChild(flag);
            }
            list.appendChild(item);
          });
          list.setAttribute("data-count", String(pair[1].fire_times.length));
          list.setAttribute("data-cron", params.get("cron"));
        })
        .catch(function () { if (mine === sequence) error.textContent = "preview unavailable"; });
    }
    fields.forEach(function (name) {
      var element = document.getElementById("f-" + name);
      if (!element) return;
      element.addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(update, 200); });
      element.addEventListener("change", update);
    });
    update();
  }

  // The schedule's kind follows what is typed: a cron expression makes a cron job, a run time a
  // one-shot job (the server applies the same rule, and refuses a contradiction under the field).
  function setupKind() {
    var kind = document.getElementById("f-schedule_kind");
    if (!kind) return;
    [["f-cron", "cron"], ["f-run_at", "once"]].forEach(function (pair) {
      var input = document.getElementById(pair[0]);
      if (!input) return;
      input.addEventListener("input", function () {
        if (input.value.trim() && kind.value !== "auto" && kind.value !== pair[1]) kind.value = pair[1];
      });
    });
  }

  // Live executions: Server-Sent Events from the same fan-out as WatchExecutions.
  var STATUS = { created: "queued", started: "running", retrying: "failed" };
  function cell(text, href) {
    var td = document.createElement("td");
    if (href) {
      var a = document.createElement("a");
      a.href = href;
      a.textContent = text;
      td.appendChild(a);
    } else {
      td.textContent = text;
    }
    return td;
  }
  function statusSpan(value) {
    var span = document.createElement("span");
    span.className = "status s-" + value;
    span.textContent = value;
    return span;
  }
  function setupLive() {
    var table = document.getElementById("executions");
    if (!table || !table.hasAttribute("data-live") || !window.EventSource) return;
    var body = table.tBodies[0];
    var indicator = document.getElementById("live-indicator");
    var states = (table.getAttribute("data-states") || "").split(",").filter(Boolean);
    var params = new URLSearchParams();
    if (table.getAttribute("data-cursor")) params.set("cursor", table.getAttribute("data-cursor"));
    if (table.getAttribute("data-job")) params.set("job", table.getAttribute("data-job"));
    if (table.getAttribute("data-handler")) params.set("handler", table.getAttribute("data-handler"));
    // EventSource reconnects by itself and sends the last event id: the stream resumes after it.
    var source = new EventSource("/events?" + params.toString());
    source.addEventListener("hello", function () { if (indicator) indicator.setAttribute("data-state", "connected"); });
    source.addEventListener("expired", function () { window.location.reload(); });
    source.onerror = function () { if (indicator) indicator.setAttribute("data-state", "reconnecting"); };
    source.onmessage = function (message) {
      var event = JSON.parse(message.data);
      var status = STATUS[event.type] || event.type;
      var row = body.querySelector('tr[data-execution="' + event.execution_id + '"]');
      if (!row) {
        if (states.length && states.indexOf(status) < 0) return;
        row = document.createElement("tr");
        row.setAttribute("data-execution", event.execution_id);
        row.setAttribute("data-run", event.run_id);
        row.appendChild(cell((event.time || "").replace("T", " ").slice(0, 19), "/executions/" + event.execution_id));
        row.appendChild(cell(event.job_name || event.job_id, "/jobs/" + event.job_id));
        row.appendChild(cell(event.handler));
        row.appendChild(cell(String(event.attempt)));
        row.appendChild(cell(event.trigger || ""));
        var state = cell("");
        state.className = "state";
        row.appendChild(state);
        var worker = cell("");
        worker.className = "worker";
        row.appendChild(worker);
        body.insertBefore(row, body.firstChild);
        var empty = document.getElementById("no-executions");
        if (empty) empty.remove();
      }
      var stateCell = row.querySelector("td.state");
      stateCell.textContent = "";
      stateCell.appendChild(statusSpan(status));
      if (event.worker_id) row.querySelector("td.worker").textContent = event.worker_id;
    };
    window.addEventListener("pagehide", function () { source.close(); });
  }

  document.addEventListener("DOMContentLoaded", function () {
    setupPreview();
    setupKind();
    setupLive();
  });
})();
