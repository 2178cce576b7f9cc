/* The Hypha dashboard's live pages: the overview and a job's page, updated over the browser websocket.
 *
 * Event shapes are documented in docs/dashboard.md. The job page starts from the snapshot embedded in the page
 * (#job-snapshot) and the one its websocket sends first; every later event is applied idempotently, so an
 * event that repeats what the snapshot holds changes nothing. Dynamic text is set with textContent only.
 */
(function () {
  "use strict";

  // --- the websocket, reconnected with exponential backoff and jitter ----------------------------------

  function liveSocket(path, onEvent) {
    var indicator = document.getElementById("live-indicator");
    var attempt = 0;
    function setState(state) {
      // A finished job's page says so whatever its socket does (it stays open: tasks may still report their end).
      if (indicator && indicator.dataset.state !== "finished") { indicator.dataset.state = state; }
    }
    function open() {
      var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
      var socket = new WebSocket(scheme + window.location.host + path);
      setState("connecting");
      socket.onopen = function () { attempt = 0; setState("open"); };
      socket.onmessage = function (message) {
        var event;
        try { event = JSON.parse(message.data); } catch (error) { return; }
        onEvent(event);
      };
      socket.onclose = function () {
        setState("closed");
        var delay = Math.min(30000, 1000 * Math.pow(2, attempt)) * (0.5 + Math.random() / 2);
        attempt += 1;
        window.setTimeout(open, delay);
      };
    }
    open();
  }

  // --- small helpers ------------------------------------------------------------------------------------

  function element(tag, text, className) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    if (className) { node.className = className; }
    return node;
  }

  function row(cells) {
    var tr = document.createElement("tr");
    cells.forEach(function (cell) {
      var td;
      if (cell instanceof Node) { td = element("td"); td.appendChild(cell); }
      else if (cell && cell.node instanceof Node) { td = element("td", null, cell.className); td.appendChild(cell.node); }
      else if (cell && typeof cell === "object") { td = element("td", cell.text, cell.className); }
      else { td = element("td", cell); }
      tr.appendChild(td);
    });
    return tr;
  }

  function num(value) { return { text: value === null || value === undefined ? "—" : value, className: "num" }; }

  function fixed(value, digits) {
    return num(typeof value === "number" ? value.toFixed(digits) : null);
  }

  // Django's filesizeformat, as the page's template writes sizes: "512 bytes", "4.0 KB" (no-break spaces).
  function bytes(value) {
    if (typeof value !== "number") { return num(null); }
    if (value < 1024) { return num(value + (value === 1 ? "\u00a0byte" : "\u00a0bytes")); }
    var units = ["KB", "MB", "GB", "TB", "PB"];
    var index = -1;
    while (value >= 1024 && index < units.length - 1) { value /= 1024; index += 1; }
    return num(value.toFixed(1) + "\u00a0" + units[index]);
  }

  function badge(text, kind) { return element("span", text, "badge " + kind + "-" + text); }

  // A time as the templates' |when filter writes it (apps/dashboard/templatetags/dashboard_format.py):
  // "2026-11-26 13:20:01 UTC", its ISO form in datetime, the relative time as its tooltip; "—" for none.
  function when(value) {
    var date = value ? new Date(value) : null;
    if (!date || isNaN(date.getTime())) { return element("span", value ? String(value) : "—"); }
    var node = element("time", date.toISOString().slice(0, 19).replace("T", " ") + " UTC");
    node.dateTime = date.toISOString();
    node.title = relative(date);
    return node;
  }

  function relative(date) {
    var seconds = Math.round((Date.now() - date.getTime()) / 1000);
    var size = Math.abs(seconds);
    if (size < 1) { return "just now"; }
    var units = [[86400, "day"], [3600, "hour"], [60, "minute"], [1, "second"]];
    for (var index = 0; index < units.length; index += 1) {
      if (size >= units[index][0]) {
        var count = Math.floor(size / units[index][0]);
        var text = count + " " + units[index][1] + (count === 1 ? "" : "s");
        return seconds > 0 ? text + " ago" : "in " + text;
      }
    }
    return "just now";
  }

  // A price as the templates' |price filter writes it: "120 credits/h", what that is as its tooltip
  // (worker_daemon/protocol.py: PRICE_UNIT, PRICE_MEANING).
  function price(value) {
    if (typeof value !== "number") { return num(null); }
    var node = element("span", (Number.isInteger(value) ? String(value) : value.toFixed(2)) + " credits/h", "price");
    node.title = "credits per hour of a lease, per worker";
    return { node: node, className: "num" };
  }

  function replaceRows(tbody, rows, emptyText, columns) {
    if (!tbody) { return; }
    tbody.replaceChildren();
    if (!rows.length) {
      var empty = element("tr", null, "empty");
      var td = element("td", emptyText, "muted");
      td.colSpan = columns;
      empty.appendChild(td);
      tbody.appendChild(empty);
      return;
    }
    rows.forEach(function (tr) { tbody.appendChild(tr); });
  }

  // --- the overview: re-render its sections from the server when something changed ---------------------

  function startOverview(container) {
    var pending = null;
    function refresh() {
      pending = null;
      fetch(container.dataset.fragmentUrl, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
        .then(function (response) { return response.ok ? response.text() : null; })
        .then(function (html) { if (html !== null) { container.innerHTML = html; } })
        .catch(function () {});
    }
    function soon() { if (pending === null) { pending = window.setTimeout(refresh, 400); } }
    liveSocket(container.dataset.websocket, function (event) { if (event.type === "job") { soon(); } });
    // Workers and the market have no live events: refresh them every 15 s.
    window.setInterval(soon, 15000);
  }

  // --- the job page ---------------------------------------------------------------------------------------

  var PALETTE = ["#e07b39", "#8e44ad", "#16a085", "#c0392b", "#7f8c8d", "#2c3e50", "#d35400", "#27ae60"];

  function startJob(head) {
    var state = JSON.parse(document.getElementById("job-snapshot").textContent);
    var canvas = document.getElementById("loss-chart");
    var chart = null;

    function workerName(id) { return (state.workers && state.workers[id]) || String(id).slice(0, 8); }

    // A worker's name as a link to its page (the page gives the URL with a placeholder id: #job-head).
    function workerLink(name, id) {
      if (!id || !head.dataset.workerUrl) { return name; }
      var link = element("a", name);
      link.href = head.dataset.workerUrl.replace("00000000-0000-0000-0000-000000000000", encodeURIComponent(id));
      return link;
    }

    function renderHead() {
      var job = state.job;
      var status = document.getElementById("job-status");
      status.textContent = job.status;
      status.className = "badge big status-" + job.status;
      document.getElementById("job-reason").textContent = job.status_reason;
      document.getElementById("cancel-form").hidden = job.final;
      var modelLink = document.getElementById("model-link");  // a training job's (an inference job has results)
      if (modelLink) { modelLink.hidden = !job.model_ready; }
      var indicator = document.getElementById("live-indicator");
      if (indicator && job.final) {
        indicator.dataset.state = "finished";
        indicator.textContent = "finished";
        indicator.title = "the job has ended";
      }
    }

    // The cost so far (#job-cost): the snapshot and every live event carry it, read by the server at the push
    // (each lease's price × its ACTIVE time up to then), so the tooltip says as of when.
    function renderCost(cost) {
      var node = document.getElementById("job-cost");
      var asOf = new Date(cost.as_of);
      if (!node || isNaN(asOf.getTime())) { return; }
      node.textContent = "Cost ";
      node.appendChild(element("strong", cost.credits + " credits"));
      if (cost.max_cost) { node.appendChild(document.createTextNode(" of its max_cost of " + cost.max_cost + " credits")); }
      node.title = "each lease's agreed price (credits per hour of a lease) × its ACTIVE time, as of " +
        asOf.toISOString().slice(0, 19).replace("T", " ") + " UTC (the last live update)";
    }

    function renderHistory() {
      // The template's rows from the same data (snapshot and job events carry the history): every transition,
      // the newest first, with the time the server recorded it.
      var tbody = document.getElementById("history-rows");
      if (!tbody || !state.events) { return; }
      tbody.replaceChildren();
      state.events.forEach(function (event) {
        tbody.appendChild(row([{ node: when(event.at), className: "mono small" }, event.from_status, event.to_status,
          event.reason]));
      });
    }

    function renderTrainers() {
      var rows = (state.trainers || []).map(function (trainer) {
        return row([
          // An eager trainer's steps of its next round while its update is out: "updating · 12 ahead".
          workerLink(trainer.worker, trainer.worker_id), trainer.status,
          trainer.sync_state + (trainer.ahead_steps ? " · " + trainer.ahead_steps + " ahead" : ""),
          num(trainer.round), num(trainer.steps_in_round),
          num(trainer.steps_total), num(trainer.samples_total), fixed(trainer.last_loss, 4),
          fixed(trainer.samples_per_second, 2)
        ]);
      });
      replaceRows(document.getElementById("trainers"), rows, "No trainer dispatched yet.", 9);
    }

    function renderData() {
      var data = state.data || {};
      var box = document.getElementById("data");
      box.replaceChildren();
      if (!data.total) { box.appendChild(element("p", "Slices are prepared when training starts.", "muted")); return; }
      var bar = element("div", null, "bar");
      ["used", "assigned", "available"].forEach(function (kind) {
        var part = element("span", null, kind);
        part.style.flex = String(data[kind]);
        bar.appendChild(part);
      });
      box.appendChild(bar);
      box.appendChild(element("p", "Epoch " + data.epoch + ": " + data.used + " used · " + data.assigned +
        " assigned · " + data.available + " available of " + data.total));
    }

    function renderLeases() {
      document.querySelectorAll("#leases .role").forEach(function (roleBox) {
        var rows = (state.leases || []).filter(function (lease) { return lease.role === roleBox.dataset.role; })
          .map(function (lease) {
            var devices = (lease.devices || []).join(",") || "\u2014";
            return row([workerLink(lease.worker, lease.worker_id), badge(lease.status, "lease"), devices,
              price(lease.price), num(lease.renewals), when(lease.expires_at)]);
          });
        replaceRows(roleBox.querySelector("tbody"), rows, "None yet.", 6);
      });
    }

    function renderLogs() {
      var box = document.getElementById("logs");
      var tasks = (state.tasks || []).filter(function (task) { return task.log_tail || task.reason; });
      box.replaceChildren();
      if (!tasks.length) { box.appendChild(element("p", (state.tasks || []).length ? "No output yet: a task's lines appear here every few seconds while it runs." : "No task yet.", "muted")); return; }
      tasks.forEach(function (task) {
        var details = element("details");
        details.open = true;
        var exit = task.exit_code === null || task.exit_code === undefined ? "" : " (exit " + task.exit_code + ")";
        var summary = element("summary", task.role + " on ");
        summary.append(workerLink(task.worker, task.worker_id), " — " + task.status + exit +
          (task.reason ? ": " + task.reason : ""));
        details.appendChild(summary);
        var logUrl = document.getElementById("logs-card").dataset.logUrl;
        if (logUrl) {  // the task's full log (GET /api/jobs/<id>/tasks/<task>/log)
          var link = element("a", "full log", "task-log");
          link.href = logUrl.replace("00000000-0000-0000-0000-000000000000", encodeURIComponent(task.id));
          link.setAttribute("download", "task-" + task.id + ".log");
          var line = element("p", null, "small");
          line.appendChild(link);
          details.appendChild(line);
        }
        details.appendChild(element("pre", task.log_tail, "log"));
        box.appendChild(details);
      });
    }

    function renderProblems() {
      // The same rows as GET /api/jobs/<id>/'s transfer_problems: each task's, with its worker, oldest first.
      var problems = [];
      (state.tasks || []).forEach(function (task) {
        (task.transfer_problems || []).forEach(function (problem) {
          problems.push(Object.assign({ worker: task.worker, worker_id: task.worker_id }, problem));
        });
      });
      problems.sort(function (a, b) { return a.since < b.since ? -1 : a.since > b.since ? 1 : 0; });
      document.getElementById("problems-card").hidden = !problems.length;
      replaceRows(document.getElementById("problems"), problems.map(function (problem) {
        return row([
          workerLink(problem.worker, problem.worker_id), problem.role + " " + problem.peer,
          { text: problem.url, className: "mono small" },
          problem.operation, { text: problem.cause, className: "error" }, num(problem.attempts),
          { node: when(problem.since), className: "mono small" }
        ]);
      }), "None.", 7);
    }

    function sortedRounds() {
      return (state.rounds || []).slice().sort(function (a, b) { return a.number - b.number; });
    }

    function renderRounds() {
      var rows = sortedRounds().map(function (round) {
        var tr = row([
          num(round.number), applied(round), num((round.participants || []).length),
          num((round.left_out || []).length), verdictCell(round.verdicts),
          num(round.reported ? round.samples : null),
          num(round.reported && typeof round.duration === "number" ? round.duration.toFixed(2) + " s" : null),
          round.reported ? bytes(round.bytes_in) : num(null), round.reported ? bytes(round.bytes_out) : num(null),
          sentAs(round), fixed(round.mean_loss, 4),
          round.eval_error ? { text: "none: " + round.eval_error, className: "error" } : fixed(round.eval_loss, 4)
        ]);
        tr.dataset.round = round.number;
        return tr;
      });
      replaceRows(document.getElementById("rounds"), rows, "No round recorded yet.", 12);
    }

    // The parameter server's verdicts, as the template's `verdicts` filter writes them: "rejected: 1 ·
    // down-weighted: 2" (or "accepted: 3", "—"), each update not simply accepted listed in the tooltip.
    function verdictCell(verdicts) {
      var order = ["rejected", "down-weighted", "accepted"];
      var counts = { "rejected": 0, "down-weighted": 0, "accepted": 0 };
      var lines = [];
      Object.keys(verdicts || {}).forEach(function (peer) {
        var body = verdicts[peer] || {};
        if (!(body.verdict in counts)) { return; }
        counts[body.verdict] += 1;
        if (body.verdict !== "accepted") {
          lines.push([order.indexOf(body.verdict),
            workerName(peer) + ": " + body.verdict + ": " + (body.reason || "no reason given")]);
        }
      });
      var total = counts.rejected + counts["down-weighted"] + counts.accepted;
      if (!total) { return num(null); }
      var shown = order.slice(0, 2).filter(function (kind) { return counts[kind]; })
        .map(function (kind) { return kind + ": " + counts[kind]; });
      lines.sort(function (a, b) { return a[0] - b[0] || (a[1] < b[1] ? -1 : a[1] > b[1] ? 1 : 0); });
      var node = element("span", shown.join(" · ") || "accepted: " + counts.accepted);
      node.title = lines.map(function (line) { return line[1]; }).join("\n") || "every update accepted";
      return { node: node, className: counts.rejected ? "verdicts error" : "verdicts" };
    }

    // Applied: "yes"; "yes, no report" for a round its checkpoint closed whose report never came (the job
    // ended first: its samples, duration and bytes are unknown); "no" while open. The owner's Discard button
    // follows it on the round that may be discarded.
    function applied(round) {
      if (!round.closed) { return "no"; }
      if (round.discarded) {  // rolled back: the previous weights and momentum stayed
        var discarded = element("span", "discarded");
        discarded.title = round.discard_reason || "the parameter server discarded the round";
        return { node: discarded, className: "error" };
      }
      var node = element("span", round.reported ? "yes" : "yes, no report");
      if (!round.reported) {
        node.title = "applied, but the job ended before the parameter server reported the round: its samples, " +
          "duration and bytes are unknown";
      }
      if (round.number !== discardableRound()) { return round.reported ? "yes" : node; }
      var cell = element("span");
      cell.appendChild(node);
      cell.appendChild(document.createTextNode(" "));
      var button = element("button", "Discard", "danger small discard-round");
      button.type = "button";
      button.dataset.round = round.number;
      button.title = "the next round goes back to the weights and momentum of the round before this one";
      cell.appendChild(button);
      return cell;
    }

    // The owner's Discard (docs/dashboard.md, "Discarding a round"): the page gives the API's URL (round 0 in
    // it) and the CSRF token to the job's owner only; the POST goes with the session and the token, as the
    // cancel form does. The button is on a running job's latest closed round, when it is neither discarded
    // nor asked to be and is not the job's last round (apps/dashboard/views.py, _discardable_round); the API
    // checks again and its refusal (409) is shown with its reason.
    var roundsCard = document.getElementById("rounds-card");
    var discardUrl = roundsCard ? roundsCard.dataset.discardUrl : "";

    function discardableRound() {
      if (!discardUrl || !state.job || state.job.status !== "running") { return null; }
      var closed = sortedRounds().filter(function (round) { return round.closed; });
      var last = closed[closed.length - 1];
      if (!last || last.discarded || last.discard_requested_at) { return null; }
      if (state.job.update_rounds && last.number >= state.job.update_rounds) { return null; }
      return last.number;
    }

    function showDiscardMessage(text, failed) {
      var message = document.getElementById("discard-message");
      message.textContent = text;
      message.className = failed ? "small error" : "small";
      message.hidden = false;
    }

    function discard(number, button) {
      if (!window.confirm("Discard round " + number + "? The next round goes back to the weights and momentum " +
          "of round " + (number - 1) + ": the steps of both rounds are undone.")) { return; }
      button.disabled = true;
      fetch(discardUrl.replace(/\/0\/discard\/$/, "/" + number + "/discard/"), {
        method: "POST",
        credentials: "same-origin",
        headers: { "X-CSRFToken": roundsCard.dataset.csrfToken, "Accept": "application/json" }
      }).then(function (response) {
        return response.json().catch(function () { return {}; }).then(function (body) {
          if (!response.ok) {
            button.disabled = false;
            showDiscardMessage("Round " + number + " was not discarded: " +
              (typeof body.detail === "string" ? body.detail : "HTTP " + response.status), true);
            return;
          }
          var answered = (body.rounds || []).filter(function (round) { return round.number === number; })[0];
          if (answered) { upsertRound(answered); }
          showDiscardMessage("Round " + number + " will be discarded: the next round goes back to the weights " +
            "and momentum of round " + (number - 1) + ".", false);
          renderRounds();
        });
      }).catch(function () {
        button.disabled = false;
        showDiscardMessage("Round " + number + " was not discarded: the server could not be reached.", true);
      });
    }

    if (discardUrl) {
      document.getElementById("rounds").addEventListener("click", function (event) {
        var button = event.target.closest("button.discard-round");
        if (button && !button.disabled) { discard(Number(button.dataset.round), button); }
      });
    }

    // The round's encoding and path: "int8 · relay 12.3 MB" (bytes through the relay) or "float32 · direct".
    function sentAs(round) {
      if (!round.reported) { return "—"; }  // unknown until the parameter server reports the round
      var relay = (round.transfers || {}).relay || {};
      var through = (relay.in || 0) + (relay.out || 0);
      return (round.encoding || "float32") + (through > 0 ? " · relay " + bytes(through).text : " · direct");
    }

    function chartData() {
      var rounds = sortedRounds();
      var labels = rounds.map(function (round) { return round.number; });
      var datasets = [
        { label: "mean training loss", data: rounds.map(function (r) { return r.mean_loss; }),
          borderColor: "#2f6fde", backgroundColor: "#2f6fde", borderWidth: 2.5, tension: 0.2 },
        { label: "eval loss", data: rounds.map(function (r) { return r.eval_loss; }),
          borderColor: "#1a7f4b", backgroundColor: "#1a7f4b", borderWidth: 2.5, tension: 0.2 }
      ];
      var trainerIds = [];
      rounds.forEach(function (round) {
        Object.keys(round.trainer_metrics || {}).forEach(function (id) {
          if (trainerIds.indexOf(id) < 0) { trainerIds.push(id); }
        });
      });
      trainerIds.forEach(function (id, index) {
        var color = PALETTE[index % PALETTE.length];
        datasets.push({
          label: "trainer " + workerName(id),
          data: rounds.map(function (round) {
            var metrics = (round.trainer_metrics || {})[id];
            return metrics && typeof metrics.loss === "number" ? metrics.loss : null;
          }),
          borderColor: color, backgroundColor: color, borderWidth: 1, borderDash: [4, 3], pointRadius: 2
        });
      });
      return { labels: labels, datasets: datasets };
    }

    function renderChart() {
      if (!canvas) { return; }  // an inference job's page has no loss chart
      var data = chartData();
      canvas.dataset.points = String(data.labels.length);
      document.getElementById("chart-empty").hidden = data.labels.length > 0;
      if (typeof window.Chart === "undefined") { return; }
      if (chart === null) {
        chart = new window.Chart(canvas, {
          type: "line",
          data: data,
          options: {
            animation: false, maintainAspectRatio: false, spanGaps: true,
            interaction: { mode: "index", intersect: false },
            scales: { x: { title: { display: true, text: "round" } }, y: { title: { display: true, text: "loss" } } },
            plugins: { legend: { position: "bottom" } }
          }
        });
        window.hyphaChart = chart;
        return;
      }
      chart.data.labels = data.labels;
      // Update the existing datasets in place (new trainers are appended) so Chart.js keeps their state.
      data.datasets.forEach(function (dataset, index) {
        if (index < chart.data.datasets.length) { chart.data.datasets[index].data = dataset.data; chart.data.datasets[index].label = dataset.label; }
        else { chart.data.datasets.push(dataset); }
      });
      chart.update("none");
    }

    // An inference job's workers and newest stored results (#inference-card), each result a download link:
    // the snapshot, job and progress events carry the whole section ("inference"; null for training).
    function renderInference() {
      var card = document.getElementById("inference-card");
      var section = state.inference;
      if (!card || !section) { return; }
      replaceRows(document.getElementById("inference-workers"), (section.workers || []).map(function (worker) {
        return row([workerLink(worker.worker, worker.worker_id), worker.status, num(worker.results),
          num(worker.samples_total), fixed(worker.samples_per_second, 2)]);
      }), "No worker dispatched yet.", 5);
      var results = section.results || [];
      replaceRows(document.getElementById("inference-results"), results.map(function (result) {
        var file = result.index + "." + result.format;
        var link = element("a", file, "result-link");
        link.href = result.url;
        link.setAttribute("download", file);
        var sha = element("span", String(result.sha256).slice(0, 12) + "\u2026");
        sha.title = result.sha256;
        var tr = row([num(result.index), link, result.status, bytes(result.size), result.worker || "\u2014",
          { node: sha, className: "mono small" }, { node: when(result.created_at), className: "mono small" }]);
        tr.dataset.index = result.index;
        return tr;
      }), "No result stored yet.", 7);
      var count = document.getElementById("results-count");
      if (count) {
        count.textContent = section.results_stored + " stored" + (section.results_stored > results.length ?
          "; the newest " + results.length + " below, every one in the zip" : "");
      }
    }

    function upsertRound(round) {
      var rounds = state.rounds || (state.rounds = []);
      for (var index = 0; index < rounds.length; index += 1) {
        if (rounds[index].number === round.number) { rounds[index] = round; return; }
      }
      rounds.push(round);
    }

    function apply(event) {
      if (event.type === "snapshot") {
        state = event;
        renderHead(); renderLeases(); renderProblems(); renderLogs(); renderTrainers(); renderData(); renderRounds();
        renderHistory(); renderChart(); renderInference();
      } else if (event.type === "job") {
        // A job event carries every section it may have changed, read after the change's commit: the page
        // re-renders them whole (as the snapshot), so several transitions in one commit, or a task's end,
        // are never lost between two events.
        state.job = event.job; state.leases = event.leases; state.tasks = event.tasks; state.data = event.data;
        if (event.trainers) { state.trainers = event.trainers; }
        if (event.events) { state.events = event.events; }
        state.workers = Object.assign(state.workers || {}, event.workers || {});
        if (event.inference) { state.inference = event.inference; }
        renderHead(); renderLeases(); renderProblems(); renderLogs(); renderTrainers(); renderData(); renderHistory();
        renderInference();
        if (discardUrl) { renderRounds(); }  // the Discard button is on a running job's rounds only
      } else if (event.type === "round") {
        upsertRound(event.round);
        state.trainers = event.trainers; state.data = event.data;
        renderRounds(); renderChart(); renderTrainers(); renderData();
      } else if (event.type === "progress") {
        state.trainers = event.trainers; state.data = event.data;
        if (event.inference) { state.inference = event.inference; }
        renderTrainers(); renderData(); renderInference();
      }
      if (event.cost) { renderCost(event.cost); }
      // Other scripts of the page (progress.js) follow the same events.
      document.dispatchEvent(new CustomEvent("hypha:job-event", { detail: event }));
    }

    renderChart();
    liveSocket(head.dataset.websocket, apply);
  }

  document.addEventListener("DOMContentLoaded", function () {
    var overview = document.getElementById("overview-sections");
    if (overview) { startOverview(overview); }
    var head = document.getElementById("job-head");
    if (head) { startJob(head); }
  });
})();
