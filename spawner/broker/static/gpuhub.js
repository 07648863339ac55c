// gpuhub pages: release buttons, the in-place limit editor, and the usage plot.
// Everything goes through the broker's REST API with JupyterHub's XSRF token.
// The plot is a small SVG line chart drawn here: no chart library from a CDN.
"use strict";

const API = document.querySelector('meta[name="gpuhub-api"]').content;
const XSRF = document.querySelector('meta[name="gpuhub-xsrf"]').content;
const COLORS = ["#0d6efd", "#dc3545", "#198754", "#fd7e14", "#6f42c1", "#20c997", "#6c757d", "#d63384"];

async function api(method, path, body) {
  const resp = await fetch(API + path, {
    method,
    headers: { "Content-Type": "application/json", "X-XSRFToken": XSRF },
    credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await resp.text();
  let data = {};
  try {
    data = text ? JSON.parse(text) : {};
  } catch {
    data = { message: `${resp.status} ${resp.statusText}` };
  }
  if (!resp.ok) throw new Error(data.message || resp.statusText);
  return data;
}

function splitKey(key) {
  // "user/NAME": only the first "/" separates; a group name may contain more
  const i = key.indexOf("/");
  return [key.slice(0, i), key.slice(i + 1)];
}

function showError(err) {
  const box = document.getElementById("gpuhub-alert");
  box.textContent = err.message;
  box.classList.remove("d-none");
}

document.addEventListener("click", async (ev) => {
  const target = ev.target;
  try {
    if (target.dataset.release) {
      await api("DELETE", `allocations/${target.dataset.release}`);
      location.reload();
    } else if ("saveLimit" in target.dataset) {
      const row = target.closest("tr");
      const field = (n) => row.querySelector(`[name="${n}"]`);
      let [scope, name] = splitKey(row.dataset.limit);
      if (row.dataset.limit === "new") {
        scope = field("scope").value;
        name = field("name").value.trim();
        if (!name) throw new Error(`Give the ${scope}'s name.`);
      }
      const num = (n) => (field(n).value === "" ? null : Number(field(n).value));
      const path = scope === "default" ? "limits/default" : `limits/${scope}/${encodeURIComponent(name)}`;
      await api("PUT", path, {
        max_gpus: num("max_gpus"),
        gpu_hours: num("gpu_hours"),
        window_hours: num("window_hours") ?? 168,
      });
      location.reload();
    } else if ("resetLimit" in target.dataset) {
      const [scope, name] = splitKey(target.closest("tr").dataset.limit);
      await api("DELETE", scope === "default" ? "limits/default" : `limits/${scope}/${encodeURIComponent(name)}`);
      location.reload();
    }
  } catch (err) {
    showError(err);
  }
});

function fmt(v) {
  if (v === 0) return "0";
  return v >= 10 ? v.toFixed(0) : v >= 0.1 ? v.toFixed(1) : v.toPrecision(2);
}

function svg(tag, attrs, parent) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function drawPlot(container, usage) {
  const W = 900, H = 280, L = 48, R = 130, T = 12, B = 36;
  const users = Object.keys(usage.series);
  const n = usage.buckets.length;
  const max = Math.max(1e-9, ...users.flatMap((u) => usage.series[u]));
  const x = (i) => L + (n <= 1 ? 0 : (i * (W - L - R)) / (n - 1));
  const y = (v) => H - B - (v / max) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, id: "usage-plot", role: "img",
    "aria-label": "GPU-hours per day per user" });
  svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }, root);
  svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }, root);
  for (const frac of [0, 0.5, 1]) {
    const t = svg("text", { x: L - 6, y: y(max * frac) + 4, "text-anchor": "end" }, root);
    t.textContent = fmt(max * frac);
  }
  usage.buckets.forEach((b, i) => {
    if (i % Math.ceil(n / 7) !== 0) return;
    const t = svg("text", { x: x(i), y: H - B + 16, "text-anchor": "middle" }, root);
    t.textContent = b.slice(5, 10);
  });
  users.forEach((u, k) => {
    const color = COLORS[k % COLORS.length];
    const d = usage.series[u].map((v, i) => `${i ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    svg("path", { class: "series", d, stroke: color, "data-user": u }, root);
    const label = svg("text", { x: W - R + 8, y: T + 14 + 16 * k, fill: color, class: "legend" }, root);
    label.textContent = `${u} (${fmt(usage.total[u])} h)`;
  });
  if (!users.length) {
    const t = svg("text", { x: L + 10, y: T + 20 }, root);
    t.textContent = "No GPU usage in this period.";
  }
  container.replaceChildren(root);
}

async function loadUsage() {
  for (const container of document.querySelectorAll(".usage-plot")) {
    const params = new URLSearchParams({ since: `${container.dataset.usageDays}d` });
    if (container.dataset.usageUser) params.set("user", container.dataset.usageUser);
    try {
      const usage = await api("GET", `usage?${params}`);
      drawPlot(container, usage);
      const table = document.querySelector("#usage-table tbody");
      if (table) {
        table.replaceChildren(...Object.entries(usage.total).map(([u, h]) => {
          const tr = document.createElement("tr");
          tr.innerHTML = "<td></td><td></td>";
          tr.children[0].textContent = u;
          tr.children[1].textContent = fmt(h);
          return tr;
        }));
      }
    } catch (err) {
      showError(err);
    }
  }
}

loadUsage();
