// Typesets the math pymdownx.arithmatex marks (generic mode: \( \) inline, \[ \] display) with
// the KaTeX this site serves itself (docs/assets/katex): no request leaves the site.
// document$ is Material's page observable: it fires on the first load and on every page change.
document$.subscribe(function () {
  document.querySelectorAll(".arithmatex").forEach(function (el) {
    var tex = el.textContent.trim();
    var display = tex.startsWith("\\[");
    katex.render(tex.slice(2, -2), el, { displayMode: display, throwOnError: false });
  });
});
