/* The job page's progress bar: redrawn from the "progress" member of each event the page's websocket brings
 * (snapshot, job, round and progress events; computed server-side by apps/dashboard/progress.py). dashboard.js
 * re-dispatches every event as a "hypha:job-event" on the document. */
(function () {
  "use strict";

  function render(progress) {
    var box = document.getElementById("run-progress");
    if (!box || !progress) { return; }
    var percent = typeof progress.percent === "number" ? progress.percent : 0;
    box.dataset.fraction = progress.fraction === null || progress.fraction === undefined ? "" : String(progress.fraction);
    document.getElementById("progress-fill").style.width = percent + "%";
    box.querySelector("[role=progressbar]").setAttribute("aria-valuenow", String(percent));
    document.getElementById("progress-text").textContent = progress.text || "";
  }

  document.addEventListener("hypha:job-event", function (event) {
    if (event.detail && event.detail.progress) { render(event.detail.progress); }
  });
})();
