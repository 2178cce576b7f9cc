/* The compare page: each job's loss curves overlaid, one line per job, in three charts (mean training loss and
 * eval loss per round; the trainers' mean training loss per step). The data is embedded in the page (#compare-runs-data, apps/dashboard/compare.py). */
(function () {
  "use strict";

  var PALETTE = ["#2f6fde", "#e07b39", "#1a7f4b", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d", "#d35400",
    "#2c3e50", "#27ae60", "#b7791f", "#6c5ce7"];

  function roundNumbers(runs) {
    var numbers = [];
    runs.forEach(function (run) {
      run.rounds.forEach(function (round) { if (numbers.indexOf(round.number) < 0) { numbers.push(round.number); } });
    });
    return numbers.sort(function (a, b) { return a - b; });
  }

  function datasets(runs, numbers, key) {
    return runs.map(function (run, index) {
      var byNumber = {};
      run.rounds.forEach(function (round) { byNumber[round.number] = round[key]; });
      var color = PALETTE[index % PALETTE.length];
      return {
        label: run.name,
        data: numbers.map(function (number) {
          var value = byNumber[number];
          return typeof value === "number" ? value : null;
        }),
        borderColor: color, backgroundColor: color, borderWidth: 2, tension: 0.2, pointRadius: 2
      };
    });
  }

  // Per step: each job's own steps ({x, y} points on a linear axis; jobs' buckets need not line up).
  function stepDatasets(runs) {
    return runs.map(function (run, index) {
      var color = PALETTE[index % PALETTE.length];
      var steps = (run.steps && run.steps.step) || [];
      return {
        label: run.name,
        data: steps.map(function (step, at) { return { x: step, y: run.steps.loss[at] }; }),
        borderColor: color, backgroundColor: color, borderWidth: 1.5, pointRadius: 0, tension: 0.1
      };
    });
  }

  function draw(canvas, labels, sets, xTitle) {
    var x = { title: { display: true, text: xTitle } };
    if (labels === null) { x.type = "linear"; }
    var data = labels === null ? { datasets: sets } : { labels: labels, datasets: sets };
    return new window.Chart(canvas, {
      type: "line",
      data: data,
      options: {
        animation: false, maintainAspectRatio: false, spanGaps: true,
        interaction: { mode: labels === null ? "nearest" : "index", intersect: false },
        scales: { x: x, y: { title: { display: true, text: "loss" } } },
        plugins: { legend: { position: "bottom" } }
      }
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var runs = JSON.parse(document.getElementById("compare-runs-data").textContent);
    document.querySelectorAll(".swatch").forEach(function (swatch) {
      swatch.style.background = PALETTE[Number(swatch.dataset.index) % PALETTE.length];
    });
    if (typeof window.Chart === "undefined") { return; }
    var numbers = roundNumbers(runs);
    var steps = stepDatasets(runs);
    document.getElementById("compare-steps-empty").hidden = steps.some(function (set) { return set.data.length; });
    window.hyphaCompareCharts = {
      train: draw(document.getElementById("compare-train-chart"), numbers, datasets(runs, numbers, "mean_loss"), "round"),
      eval: draw(document.getElementById("compare-eval-chart"), numbers, datasets(runs, numbers, "eval_loss"), "round"),
      steps: draw(document.getElementById("compare-steps-chart"), null, steps, "step")
    };
  });
})();
