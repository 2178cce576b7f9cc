/* The job page's run charts (docs/dashboard.md, "Per-step metrics and the run charts"), drawn with the vendored
 * Chart.js from GET /api/jobs/<id>/metrics/: training loss per step (each trainer and their mean), learning rate
 * per step, samples/s and tokens/s over time, bytes per round, and each trainer's samples/s and tokens/s per round.
 *
 * Controls: EMA smoothing (TensorBoard's debiased exponential moving average; the raw mean stays as a faint line),
 * a log-scale toggle for the loss and lr axes, and an x-range zoom: drag across a chart to zoom it to that range,
 * "Reset zoom" to undo (the vendored build has no zoom plugin). The data is fetched again every POLL_MS while the
 * job runs, and at once when the page's websocket says a round was recorded (dashboard.js's hypha:job-event).
 * The charts are exposed as window.hyphaRunCharts for tests.
 */
(function () {
  "use strict";

  var POLL_MS = 5000;
  var MAX_POINTS = 1000;
  var PALETTE = ["#e07b39", "#8e44ad", "#16a085", "#c0392b", "#7f8c8d", "#2c3e50", "#d35400", "#27ae60"];
  var MEAN_COLOR = "#2f6fde";

  // TensorBoard's smoothing: an EMA debiased for its start, skipping missing values (they stay gaps).
  function smooth(values, weight) {
    if (!weight) { return values.slice(); }
    var last = 0;
    var count = 0;
    return values.map(function (value) {
      if (value === null || value === undefined || !isFinite(value)) { return null; }
      last = last * weight + (1 - weight) * value;
      count += 1;
      return last / (1 - Math.pow(weight, count));
    });
  }

  function points(xs, ys) {
    var out = [];
    for (var index = 0; index < xs.length; index += 1) { out.push({ x: xs[index], y: ys[index] }); }
    return out;
  }

  // --- the x-range zoom: drag to select, drawn by a small plugin ------------------------------------------

  var selectionPlugin = {
    id: "hyphaSelection",
    afterDraw: function (chart) {
      var selection = chart.$hyphaSelection;
      if (!selection || selection.to === null) { return; }
      var area = chart.chartArea;
      var left = Math.max(area.left, Math.min(selection.from, selection.to));
      var right = Math.min(area.right, Math.max(selection.from, selection.to));
      var context = chart.ctx;
      context.save();
      context.fillStyle = "rgba(47, 111, 222, 0.15)";
      context.fillRect(left, area.top, right - left, area.bottom - area.top);
      context.restore();
    }
  };

  function zoomable(chart) {
    var canvas = chart.canvas;
    function offset(event) { return event.clientX - canvas.getBoundingClientRect().left; }
    canvas.addEventListener("mousedown", function (event) {
      var x = offset(event);
      if (x < chart.chartArea.left || x > chart.chartArea.right) { return; }
      chart.$hyphaSelection = { from: x, to: null };
    });
    canvas.addEventListener("mousemove", function (event) {
      if (!chart.$hyphaSelection) { return; }
      chart.$hyphaSelection.to = offset(event);
      chart.draw();
    });
    function finish(event) {
      var selection = chart.$hyphaSelection;
      chart.$hyphaSelection = null;
      if (!selection) { return; }
      var to = offset(event);
      if (Math.abs(to - selection.from) < 5) { chart.draw(); return; }  // a click, not a drag
      var scale = chart.scales.x;
      zoomTo(chart, scale.getValueForPixel(Math.min(selection.from, to)),
        scale.getValueForPixel(Math.max(selection.from, to)));
    }
    canvas.addEventListener("mouseup", finish);
    canvas.addEventListener("mouseleave", function () {
      if (chart.$hyphaSelection) { chart.$hyphaSelection = null; chart.draw(); }
    });
  }

  function zoomTo(chart, min, max) {
    chart.options.scales.x.min = min;
    chart.options.scales.x.max = max;
    chart.canvas.dataset.zoomed = "true";
    chart.update("none");
  }

  function resetZoom(chart) {
    delete chart.options.scales.x.min;
    delete chart.options.scales.x.max;
    chart.canvas.dataset.zoomed = "false";
    chart.update("none");
  }

  // --- the charts -----------------------------------------------------------------------------------------

  function lineChart(canvas, xTitle, yTitle) {
    var chart = new window.Chart(canvas, {
      type: "line",
      data: { datasets: [] },
      options: {
        animation: false, maintainAspectRatio: false, spanGaps: true, parsing: false, normalized: true,
        interaction: { mode: "nearest", axis: "x", intersect: false },
        elements: { point: { radius: 0, hitRadius: 6 }, line: { borderWidth: 1.5 } },
        scales: {
          x: { type: "linear", title: { display: true, text: xTitle } },
          y: { type: "linear", title: { display: true, text: yTitle } }
        },
        plugins: { legend: { position: "bottom" } }
      },
      plugins: [selectionPlugin]
    });
    zoomable(chart);
    return chart;
  }

  function barChart(canvas) {
    return new window.Chart(canvas, {
      type: "bar",
      data: { labels: [], datasets: [] },
      options: {
        animation: false, maintainAspectRatio: false,
        scales: { x: { title: { display: true, text: "round" } }, y: { title: { display: true, text: "bytes" } } },
        plugins: { legend: { position: "bottom" } }
      }
    });
  }

  // Samples/s (solid, left axis) and tokens/s (dashed, right axis) of each trainer in each round, from the rounds'
  // `throughput` (apps/jobs/throughput.py): what the trainers reported with each round's metrics.
  function roundThroughputChart(canvas) {
    var chart = lineChart(canvas, "round", "samples/s");
    chart.options.scales.y1 = { type: "linear", position: "right", title: { display: true, text: "tokens/s" },
      grid: { drawOnChartArea: false } };
    chart.options.elements.point.radius = 2;
    return chart;
  }

  function roundThroughputDatasets(rounds, trainers) {
    var names = {};
    trainers.forEach(function (trainer) { names[String(trainer.worker_id)] = trainer.worker; });
    var workers = [];
    rounds.forEach(function (round) {
      Object.keys((round.throughput && round.throughput.trainers) || {}).forEach(function (worker) {
        if (workers.indexOf(worker) < 0) { workers.push(worker); }
      });
    });
    var datasets = [];
    workers.forEach(function (worker, index) {
      var color = PALETTE[index % PALETTE.length];
      var label = "trainer " + (names[worker] || worker.slice(0, 8));
      function series(field) {
        return rounds.map(function (round) {
          var facts = ((round.throughput && round.throughput.trainers) || {})[worker] || {};
          return { x: round.number, y: facts[field] === undefined ? null : facts[field] };
        });
      }
      var samples = series("samples_per_second");
      var tokens = series("tokens_per_second");
      if (samples.some(function (point) { return point.y !== null; })) {
        datasets.push({ label: label + " samples/s", borderColor: color, backgroundColor: color, yAxisID: "y", data: samples });
      }
      if (tokens.some(function (point) { return point.y !== null; })) {
        datasets.push({ label: label + " tokens/s", borderColor: color, backgroundColor: color, borderDash: [5, 4],
          yAxisID: "y1", data: tokens });
      }
    });
    return datasets;
  }

  // Replace a chart's datasets, keeping the objects of those with the same label (Chart.js keeps their state:
  // hidden by a legend click stays hidden).
  function setDatasets(chart, datasets) {
    var old = {};
    chart.data.datasets.forEach(function (dataset) { old[dataset.label] = dataset; });
    chart.data.datasets = datasets.map(function (dataset) {
      var kept = old[dataset.label];
      if (!kept) { return dataset; }
      Object.keys(dataset).forEach(function (key) { kept[key] = dataset[key]; });
      return kept;
    });
  }

  function start(card) {
    if (typeof window.Chart === "undefined") { return; }
    // At most MAX_POINTS points per trainer: more than a chart's width in pixels, and a poll stays small.
    var url = card.dataset.metricsUrl + "?max_points=" + MAX_POINTS;
    var slider = document.getElementById("smoothing");
    var sliderValue = document.getElementById("smoothing-value");
    var logToggle = document.getElementById("log-scale");
    var charts = {
      loss: lineChart(document.getElementById("step-loss-chart"), "step", "training loss"),
      lr: lineChart(document.getElementById("lr-chart"), "step", "learning rate"),
      samples: lineChart(document.getElementById("samples-chart"), "seconds since the first step", "samples/s"),
      tokens: lineChart(document.getElementById("tokens-chart"), "seconds since the first step", "tokens/s"),
      bytes: barChart(document.getElementById("bytes-chart")),
      throughput: roundThroughputChart(document.getElementById("round-throughput-chart"))
    };
    window.hyphaRunCharts = charts;
    var metrics = null;
    var timer = null;

    // A trainer's label: its worker's name, with its task's id when the worker ran several of the job's trainer
    // tasks (a replacement): labels key the datasets (setDatasets).
    function name(trainer) {
      var worker = trainer.worker || String(trainer.task).slice(0, 8);
      var same = (metrics.trainers || []).filter(function (other) { return other.worker === trainer.worker; });
      return same.length > 1 ? worker + " (" + String(trainer.task).slice(0, 8) + ")" : worker;
    }

    function render() {
      if (!metrics) { return; }
      var weight = Number(slider.value);
      sliderValue.textContent = weight.toFixed(2);
      var log = logToggle.checked;
      var trainers = metrics.trainers || [];
      var start = null;
      trainers.forEach(function (trainer) {
        trainer.points.time.forEach(function (time) { if (time !== null && (start === null || time < start)) { start = time; } });
      });

      var loss = [];
      trainers.forEach(function (trainer, index) {
        var color = PALETTE[index % PALETTE.length];
        loss.push({ label: "trainer " + name(trainer), borderColor: color, backgroundColor: color, borderWidth: 1,
          data: points(trainer.points.step, smooth(trainer.points.loss, weight)) });
      });
      var mean = metrics.mean || { step: [], loss: [] };
      loss.push({ label: "mean (raw)", borderColor: "rgba(47, 111, 222, 0.25)", backgroundColor: "rgba(47, 111, 222, 0.25)",
        borderWidth: 1, data: points(mean.step, mean.loss) });
      loss.push({ label: "mean", borderColor: MEAN_COLOR, backgroundColor: MEAN_COLOR, borderWidth: 2.5,
        data: points(mean.step, smooth(mean.loss, weight)) });
      setDatasets(charts.loss, loss);

      function perTrainer(field, xOf) {
        return trainers.map(function (trainer, index) {
          var color = PALETTE[index % PALETTE.length];
          var xs = trainer.points[xOf === "time" ? "time" : "step"].map(function (x) {
            return xOf === "time" && x !== null ? x - start : x;
          });
          return { label: "trainer " + name(trainer), borderColor: color, backgroundColor: color,
            data: points(xs, field === "lr" ? trainer.points[field] : smooth(trainer.points[field], weight)) };
        });
      }
      setDatasets(charts.lr, perTrainer("lr", "step"));
      setDatasets(charts.samples, perTrainer("samples_per_second", "time"));
      setDatasets(charts.tokens, perTrainer("tokens_per_second", "time"));

      [charts.loss, charts.lr].forEach(function (chart) {
        chart.options.scales.y.type = log ? "logarithmic" : "linear";
      });
      Object.keys(charts).forEach(function (key) {
        if (key !== "bytes" && key !== "throughput") { charts[key].update("none"); }
      });

      var rounds = metrics.rounds || [];
      charts.bytes.data.labels = rounds.map(function (round) { return round.number; });
      setDatasets(charts.bytes, [
        { label: "bytes in (updates)", backgroundColor: "#2f6fde", data: rounds.map(function (round) { return round.bytes_in; }) },
        { label: "bytes out (results)", backgroundColor: "#1a7f4b", data: rounds.map(function (round) { return round.bytes_out; }) }
      ]);
      charts.bytes.update("none");
      setDatasets(charts.throughput, roundThroughputDatasets(rounds, trainers));
      charts.throughput.update("none");

      // For tests and readers of the page: how many stored points each chart drew from.
      card.dataset.trainers = String(trainers.length);
      card.dataset.points = String(mean.step.length);
      card.dataset.rounds = String(rounds.length);
      document.getElementById("run-charts-empty").hidden = mean.step.length > 0 || rounds.length > 0;
    }

    function load() {
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) { return response.ok ? response.json() : null; })
        .then(function (body) {
          if (body === null) { return; }
          metrics = body;
          render();
          card.dataset.loaded = String(Number(card.dataset.loaded || 0) + 1);
          if (body.final && timer !== null) { window.clearInterval(timer); timer = null; }
        })
        .catch(function () {});
    }

    slider.addEventListener("input", render);
    logToggle.addEventListener("change", render);
    document.getElementById("reset-zoom").addEventListener("click", function () {
      Object.keys(charts).forEach(function (key) { if (key !== "bytes") { resetZoom(charts[key]); } });
    });
    // A recorded round (eval loss, bytes) or a job that ended: fetch now rather than at the next poll.
    document.addEventListener("hypha:job-event", function (event) {
      var type = event.detail && event.detail.type;
      if (type === "round" || type === "job") { load(); }
    });
    load();
    if (card.dataset.final !== "true") { timer = window.setInterval(load, POLL_MS); }
  }

  document.addEventListener("DOMContentLoaded", function () {
    var card = document.getElementById("run-charts");
    if (card) { start(card); }
  });
})();
