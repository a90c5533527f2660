// Starts Swagger UI on /docs. A file, not an inline script: the page's Content-Security-Policy
// allows scripts from this origin only. The OpenAPI URL comes from the page (root path aware).
(function () {
  "use strict";
  var holder = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: holder.getAttribute("data-openapi-url"),
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  });
})();
