/* The overview's job list: the jobs ticked for comparison stay ticked when the live refresh (dashboard.js)
 * swaps the list's HTML, and "Compare selected" is enabled once two are ticked. */
(function () {
  "use strict";

  var picked = [];

  function apply() {
    document.querySelectorAll(".compare-pick").forEach(function (box) { box.checked = picked.indexOf(box.value) >= 0; });
    var button = document.getElementById("compare-button");
    if (button) { button.disabled = picked.length < 2; }
  }

  document.addEventListener("change", function (event) {
    var box = event.target;
    if (!box.classList || !box.classList.contains("compare-pick")) { return; }
    var at = picked.indexOf(box.value);
    if (box.checked && at < 0) { picked.push(box.value); }
    if (!box.checked && at >= 0) { picked.splice(at, 1); }
    apply();
  });

  document.addEventListener("DOMContentLoaded", function () {
    var sections = document.getElementById("overview-sections");
    if (sections) { new MutationObserver(apply).observe(sections, { childList: true }); }
    apply();
  });
})();
