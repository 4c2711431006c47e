/* scheduler-grpc console: the navigation toggle on narrow screens, and relative times kept fresh
   (each <time datetime> element says "3 min ago"; its title holds the exact time). No framework. */
(function () {
  "use strict";
  function coarse(seconds) {
    if (seconds < 1) return "now";
    if (seconds < 60) return Math.floor(seconds) + " s";
    if (seconds < 3600) return Math.floor(seconds / 60) + " min";
    if (seconds < 86400) return Math.floor(seconds / 3600) + " h";
    return Math.floor(seconds / 86400) + " d";
  }
  function refresh() {
    var now = Date.now();
    document.querySelectorAll("time[datetime]").forEach(function (element) {
      var moment = Date.parse(element.getAttribute("datetime"));
      if (isNaN(moment)) return;
      var seconds = (now - moment) / 1000;
      var distance = coarse(Math.abs(seconds));
      element.textContent = distance === "now" ? "now" : seconds > 0 ? distance + " ago" : "in " + distance;
    });
  }
  document.addEventListener("DOMContentLoaded", function () {
    var toggle = document.getElementById("nav-toggle");
    if (toggle) {
      toggle.addEventListener("click", function () {
        var open = document.body.classList.toggle("nav-open");
        toggle.setAttribute("aria-expanded", open ? "true" : "false");
      });
    }
    setInterval(refresh, 15000);
  });
})();
