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
    function setState(state) { if (indicator) { indicator.dataset.state = state; } }
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

  function bytes(value) {
    if (typeof value !== "number") { return num(null); }
    var units = ["B", "KB", "MB", "GB", "TB"];
    var index = 0;
    while (value >= 1024 && index < units.length - 1) { value /= 1024; index += 1; }
    return num((index === 0 ? value : value.toFixed(1)) + " " + units[index]);
  }

  function badge(text, kind) { return element("span", text, "badge " + kind + "-" + text); }

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
      document.getElementById("model-link").hidden = !job.model_ready;
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
            return row([workerLink(lease.worker, lease.worker_id), badge(lease.status, "lease"), num(lease.price),
              num(lease.renewals), lease.expires_at]);
          });
        replaceRows(roleBox.querySelector("tbody"), rows, "None yet.", 5);
      });
    }

    function renderLogs() {
      var box = document.getElementById("logs");
      var tasks = (state.tasks || []).filter(function (task) { return task.log_tail || task.reason; });
      box.replaceChildren();
      if (!tasks.length) { box.appendChild(element("p", (state.tasks || []).length ? "No output yet: a task's last lines appear when it exits." : "No task yet.", "muted")); return; }
      tasks.forEach(function (task) {
        var details = element("details");
        details.open = true;
        var exit = task.exit_code === null || task.exit_code === undefined ? "" : " (exit " + task.exit_code + ")";
        details.appendChild(element("summary", task.role + " on " + task.worker + " — " + task.status + exit +
          (task.reason ? ": " + task.reason : "")));
        details.appendChild(element("pre", task.log_tail, "log"));
        box.appendChild(details);
      });
    }

    function renderProblems() {
      // The same rows as GET /api/jobs/<id>/'s transfer_problems: each task's, with its worker, oldest first.
      var problems = [];
      (state.tasks || []).forEach(function (task) {
        (task.transfer_problems || []).forEach(function (problem) {
          problems.push(Object.assign({ worker: task.worker }, problem));
        });
      });
      problems.sort(function (a, b) { return a.since < b.since ? -1 : a.since > b.since ? 1 : 0; });
      document.getElementById("problems-card").hidden = !problems.length;
      replaceRows(document.getElementById("problems"), problems.map(function (problem) {
        return row([
          problem.worker, problem.role + " " + problem.peer, { text: problem.url, className: "mono small" },
          problem.operation, { text: problem.cause, className: "error" }, num(problem.attempts),
          { text: problem.since, className: "mono small" }
        ]);
      }), "None.", 7);
    }

    function sortedRounds() {
      return (state.rounds || []).slice().sort(function (a, b) { return a.number - b.number; });
    }

    function renderRounds() {
      var rows = sortedRounds().map(function (round) {
        var tr = row([
          num(round.number), round.closed ? "yes" : "no", num((round.participants || []).length),
          num((round.left_out || []).length), num(round.samples),
          num(typeof round.duration === "number" ? round.duration.toFixed(2) + " s" : null),
          bytes(round.bytes_in), bytes(round.bytes_out), sentAs(round), fixed(round.mean_loss, 4),
          round.eval_error ? { text: "none: " + round.eval_error, className: "error" } : fixed(round.eval_loss, 4)
        ]);
        tr.dataset.round = round.number;
        return tr;
      });
      replaceRows(document.getElementById("rounds"), rows, "No round recorded yet.", 11);
    }

    // The round's encoding and path: "int8 · relay 12.3 MB" (bytes through the relay) or "float32 · direct".
    function sentAs(round) {
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

    function recordHistory(before, after) {
      // The status history is rendered with the page; later changes are added on top as they arrive.
      if (!before || (before.status === after.status && before.status_reason === after.status_reason)) { return; }
      var tbody = document.getElementById("history-rows");
      if (!tbody) { return; }
      var tr = row([{ text: new Date().toISOString(), className: "mono small" }, before.status, after.status,
        after.status_reason]);
      tbody.insertBefore(tr, tbody.firstChild);
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
        renderChart();
      } else if (event.type === "job") {
        recordHistory(state.job, event.job);
        state.job = event.job; state.leases = event.leases; state.tasks = event.tasks; state.data = event.data;
        state.workers = Object.assign(state.workers || {}, event.workers || {});
        renderHead(); renderLeases(); renderProblems(); renderLogs(); renderData();
      } else if (event.type === "round") {
        upsertRound(event.round);
        state.trainers = event.trainers; state.data = event.data;
        renderRounds(); renderChart(); renderTrainers(); renderData();
      } else if (event.type === "progress") {
        state.trainers = event.trainers; state.data = event.data;
        renderTrainers(); renderData();
      }
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
