// gpuhub pages: release buttons, the in-place limit editor, the usage and energy charts, the admin's
// live GPU grid, reclaims, borrowing and preemptions, and queue (cancel, move to front), and a
// user's own GPU use, idle warnings, preemption notices and waits in the queue (leave).
// Everything goes through the broker's REST API with JupyterHub's XSRF token.
// The usage chart is chart.js, served by the broker (static/vendor/, put there by
// scripts/setup: no CDN); the sparklines are small SVG drawn here.
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
    } else if (target.dataset.extend) {
      // "Extend by hours" on My GPUs: the broker decides; a refusal says why, in the alert
      const hours = Number(document.getElementById(`extend-${target.dataset.extend}`).value);
      target.disabled = true;
      try {
        await api("POST", `allocations/${target.dataset.extend}/extend`, { hours });
      } finally {
        target.disabled = false;
      }
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
    } else if (target.dataset.queueCancel || target.dataset.queueLeave || target.dataset.queueFront) {
      // the queue's buttons (admin: cancel, move to front; a user: leave): the live table
      // is redrawn from the API at once, without reloading the page
      const d = target.dataset;
      target.disabled = true;
      if (d.queueFront) await api("POST", `queue/${d.queueFront}/front`);
      else await api("DELETE", `queue/${d.queueCancel || d.queueLeave}`);
      if (refreshLive) await refreshLive();
      else location.reload();
    }
  } catch (err) {
    showError(err);
  }
});

// the limits editor: a row's GPU-hours window shows only where a GPU-hours quota is set
document.addEventListener("input", (ev) => {
  const t = ev.target;
  if (t.name !== "gpu_hours") return;
  const cell = t.closest("tr").querySelector("[data-window]");
  if (!cell) return;
  const quota = t.value !== "";
  cell.querySelector('[name="window_hours"]').classList.toggle("d-none", !quota);
  cell.querySelector("[data-no-quota]").classList.toggle("d-none", quota);
});

function fmt(v) {
  if (v === 0) return "0";
  return v >= 10 ? v.toFixed(0) : v >= 0.1 ? v.toFixed(1) : v.toPrecision(2);
}

function svg(tag, attrs, parent) {  // the admin grid's sparklines
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function usageQuery(container) {
  const params = new URLSearchParams({ since: `${container.dataset.usageDays}d` });
  if (container.dataset.usageUser) params.set("user", container.dataset.usageUser);
  return params;
}

function bucketAxis(usage) {
  // buckets are periods back from now (24 h by default): name each by the day it ends on,
  // and show its exact start and end on hover
  const starts = usage.buckets.map((b) => Date.parse(b));
  const step = starts.length > 1 ? starts[1] - starts[0] : Date.parse(usage.until) - starts[0];
  const iso = (ms) => new Date(ms).toISOString().slice(0, 16).replace("T", " ");
  return { starts, step, iso, labels: starts.map((t) => iso(t + step).slice(0, 10)) };
}

// GPU-hours per day per user as stacked bars (Chart.js, served by the broker itself:
// static/vendor/chart.umd.min.js); hovering a day shows each user's GPU-hours that day.
function drawPlot(container, usage) {
  const users = Object.keys(usage.series);
  const csv = el("a", { class: "btn btn-sm btn-outline-secondary mb-2", id: "usage-csv", download: "gpuhub-usage.csv",
    href: `${API}usage?${usageQuery(container)}&format=csv` }, "Download CSV");
  if (!users.length) {
    container.replaceChildren(csv, el("p", { class: "text-muted", id: "usage-plot" }, "No GPU usage in this period."));
    return;
  }
  const values = Object.values(usage.series).flat();
  if (!values.some((v) => v > 0)) { // all bars 0 (GPUs held for moments): an empty 0-1 chart says nothing
    container.replaceChildren(csv, el("p", { class: "text-muted", id: "usage-plot" },
      "No GPU-hours to chart in this period yet (under 0.0001)."));
    return;
  }
  if (!window.Chart) {
    container.replaceChildren(csv, el("p", { class: "text-warning", id: "usage-plot" },
      "The usage chart needs chart.js in the broker's static files (scripts/setup installs it)."));
    return;
  }
  const canvas = el("canvas", { id: "usage-plot", role: "img", "aria-label": "GPU-hours per day per user" });
  const box = el("div", { class: "usage-chart" });
  box.appendChild(canvas);
  container.replaceChildren(csv, box);
  const old = window.Chart.getChart(canvas);
  if (old) old.destroy();
  const { starts, step, iso, labels } = bucketAxis(usage);
  new window.Chart(canvas, {
    type: "bar",
    data: {
      labels,
      datasets: users.map((u, k) => ({
        label: `${u} (${fmt(usage.total[u])} h)`,
        gpuhubUser: u,
        data: usage.series[u],
        backgroundColor: COLORS[k % COLORS.length],
        stack: "gpu-hours",
      })),
    },
    options: {
      animation: false,
      maintainAspectRatio: false,
      interaction: { mode: "index", intersect: false },  // a day: every user's value
      scales: {
        x: { stacked: true, title: { display: true, text: "period ending on (UTC)" } },
        y: { stacked: true, beginAtZero: true, title: { display: true, text: "GPU-hours" } },
      },
      plugins: {
        tooltip: {
          callbacks: {
            title: (items) => `${iso(starts[items[0].dataIndex])} to ${iso(starts[items[0].dataIndex] + step)} UTC`,
            label: (ctx) => `${ctx.dataset.gpuhubUser}: ${fmt(ctx.parsed.y)} GPU-hours`,
          },
        },
      },
    },
  });
}

// ---- energy (GET me's and GET usage's "energy"): gpuhub's own readings of each GPU ----

function energyText(f, pue) {
  // as spawner.policy.energy.describe and gpu_magics.kernel.energy.energy_text: "2.000 kWh at
  // the GPUs (3.000 kWh at the meter, 0.60 EUR, 1.050 kg CO2e); 25 % of it idle"; the meter's
  // kWh only where the PUE is not 1, the cost and CO2e only where the broker gives them
  if (!f) return "not measured yet";
  let text = `${f.gpu_kwh.toFixed(3)} kWh at the GPUs`;
  const extra = [];
  if (pue !== null && pue !== undefined ? pue !== 1 : f.meter_kwh !== f.gpu_kwh) {
    extra.push(`${f.meter_kwh.toFixed(3)} kWh at the meter`);
  }
  if (f.cost !== null && f.cost !== undefined) extra.push(`${f.cost.toFixed(2)} ${f.currency || ""}`.trim());
  if (f.co2e_kg !== null && f.co2e_kg !== undefined) extra.push(`${f.co2e_kg.toFixed(3)} kg CO2e`);
  if (extra.length) text += ` (${extra.join(", ")})`;
  if (f.idle_share !== null && f.idle_share !== undefined) text += `; ${(f.idle_share * 100).toFixed(0)} % of it idle`;
  if (f.unknown_gpu_hours > 0) text += `; ${f.unknown_gpu_hours.toFixed(2)} GPU-hours not measured`;
  return text;
}

function costingText(c) {
  // where the figures come from, and the facility's numbers they are costed with
  const parts = [`Energy figures come from ${c.source}.`,
    `kWh at the meter: kWh at the GPUs times the facility's PUE (${c.pue}).`];
  if (c.currency) parts.push(`A kWh at the meter costs ${c.price_per_kwh} ${c.currency}.`);
  if (c.carbon_g_per_kwh !== null && c.carbon_g_per_kwh !== undefined) {
    parts.push(`CO2e: ${c.carbon_g_per_kwh} g per kWh at the meter.`);
  }
  return parts.join(" ");
}

function fillMyEnergy(me) {
  // My GPUs: each allocation's "Energy so far" line, and the note on where it comes from
  const live = new Map(me.allocations.map((a) => [a.id, a]));
  const pue = me.energy ? me.energy.pue : null;
  for (const span of document.querySelectorAll("[data-energy-allocation]")) {
    const a = live.get(Number(span.dataset.energyAllocation));
    if (!a || a.energy === undefined) continue;  // ended (its row says so), or an older broker
    span.textContent = `Energy so far: ${energyText(a.energy, pue)}`;
    span.dataset.gpuKwh = a.energy ? String(a.energy.gpu_kwh) : "";
  }
  const note = document.getElementById("gpuhub-energy-note");
  if (note && me.energy) {
    note.textContent = costingText(me.energy);
    note.classList.remove("d-none");
  }
}

function hatch(color) {
  // the idle part of a user's bars: the user's colour, lighter and hatched
  const c = document.createElement("canvas");
  c.width = c.height = 8;
  const ctx = c.getContext("2d");
  ctx.fillStyle = `${color}55`;
  ctx.fillRect(0, 0, 8, 8);
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  ctx.moveTo(0, 8);
  ctx.lineTo(8, 0);
  ctx.moveTo(-2, 2);
  ctx.lineTo(2, -2);
  ctx.moveTo(6, 10);
  ctx.lineTo(10, 6);
  ctx.stroke();
  return ctx.createPattern(c, "repeat") || `${color}55`;
}

function kwh(v) {
  return v.toFixed(3);
}

function drawEnergyChart(box, usage) {
  // kWh at the GPUs per user per bucket, stacked: the busy part, then the idle part (hatched)
  const energy = usage.energy;
  const users = Object.keys(energy.series);
  const old = document.getElementById("gpuhub-energy-chart");
  if (old && window.Chart && window.Chart.getChart(old)) window.Chart.getChart(old).destroy();
  const values = Object.values(energy.series).flatMap((s) => s.gpu_kwh);
  if (!users.length || !values.some((v) => v > 0)) {
    box.replaceChildren(el("p", { class: "text-muted", id: "gpuhub-energy-chart" },
      "No energy measured in this period."));
    return;
  }
  if (!window.Chart) {
    box.replaceChildren(el("p", { class: "text-warning", id: "gpuhub-energy-chart" },
      "The energy chart needs chart.js in the broker's static files (scripts/setup installs it)."));
    return;
  }
  const canvas = el("canvas", { id: "gpuhub-energy-chart", role: "img",
    "aria-label": "kWh at the GPUs per day per user, the idle part hatched" });
  const chartBox = el("div", { class: "usage-chart" });
  chartBox.appendChild(canvas);
  box.replaceChildren(chartBox);
  const { starts, step, iso, labels } = bucketAxis(usage);
  const datasets = [];
  users.forEach((u, k) => {
    const s = energy.series[u];
    const color = COLORS[k % COLORS.length];
    const total = energy.total[u] ? energy.total[u].gpu_kwh : s.gpu_kwh.reduce((a, b) => a + b, 0);
    datasets.push({
      label: `${u} (${kwh(total)} kWh)`,
      gpuhubUser: u,
      gpuhubPart: "busy",
      data: s.gpu_kwh.map((v, i) => Math.max(0, v - s.idle_kwh[i])),
      backgroundColor: color,
      stack: "kwh",
    }, {
      label: `${u} idle`,
      gpuhubUser: u,
      gpuhubPart: "idle",
      data: s.idle_kwh,
      backgroundColor: hatch(color),
      borderColor: color,
      borderWidth: 1,
      stack: "kwh",
    });
  });
  new window.Chart(canvas, {
    type: "bar",
    data: { labels, datasets },
    options: {
      animation: false,
      maintainAspectRatio: false,
      interaction: { mode: "index", intersect: false },
      scales: {
        x: { stacked: true, title: { display: true, text: "period ending on (UTC)" } },
        y: { stacked: true, beginAtZero: true, title: { display: true, text: "kWh at the GPUs" } },
      },
      plugins: {
        tooltip: {
          callbacks: {
            title: (items) => `${iso(starts[items[0].dataIndex])} to ${iso(starts[items[0].dataIndex] + step)} UTC`,
            label: (ctx) => `${ctx.dataset.gpuhubUser}${ctx.dataset.gpuhubPart === "idle" ? " idle" : " busy"}: ` +
              `${kwh(ctx.parsed.y)} kWh`,
          },
        },
      },
    },
  });
}

function energyColumns(costing) {
  // [header, figures => cell text, class] of the energy tables; cost and CO2e where set
  const cols = [
    ["kWh at the GPUs", (f) => kwh(f.gpu_kwh), "energy-gpu-kwh"],
    ["Idle kWh", (f) => kwh(f.idle_kwh), "energy-idle-kwh"],
    ["Idle", (f) => (f.idle_share === null ? "–" : `${(f.idle_share * 100).toFixed(0)} %`), "energy-idle-share"],
    ["kWh at the meter", (f) => kwh(f.meter_kwh), "energy-meter-kwh"],
  ];
  if (costing.currency) {
    cols.push([`Cost (${costing.currency})`, (f) => (f.cost === null ? "–" : f.cost.toFixed(2)), "energy-cost"]);
  }
  if (costing.carbon_g_per_kwh !== null && costing.carbon_g_per_kwh !== undefined) {
    cols.push(["CO2e (kg)", (f) => (f.co2e_kg === null ? "–" : f.co2e_kg.toFixed(3)), "energy-co2e"]);
  }
  cols.push(["GPU-hours not measured", (f) => f.unknown_gpu_hours.toFixed(2), "energy-unknown-hours"]);
  return cols;
}

function energyRow(cols, name, f, attrs, cell = "td") {
  const tr = el("tr", { ...attrs, "data-gpu-kwh": f.gpu_kwh });
  tr.append(el(cell, { class: "energy-name" }, name));
  for (const [, text, cls] of cols) tr.append(el(cell, { class: cls }, text(f)));
  return tr;
}

function energyHead(table, first, cols) {
  const tr = el("tr");
  tr.append(el("th", {}, first), ...cols.map(([h]) => el("th", {}, h)));
  table.querySelector("thead").replaceChildren(tr);
}

function fillEnergy(usage) {
  // the admin page: the chart, a row per user and one for all, a row per group
  const energy = usage.energy;
  const box = document.getElementById("gpuhub-energy-box");
  if (!box || !energy) return;
  drawEnergyChart(box, usage);
  const cols = energyColumns(energy.costing);
  const table = document.getElementById("gpuhub-energy-table");
  energyHead(table, "User", cols);
  const users = Object.entries(energy.total);
  table.querySelector("tbody").replaceChildren(...(users.length
    ? users.map(([u, f]) => energyRow(cols, u, f, { "data-user": u }))
    : [emptyRow(cols.length + 1, "No energy measured in this period.")]));
  table.querySelector("tfoot").replaceChildren(energyRow(cols, "All users", energy.all, { "data-all": "" }, "th"));
  const groups = document.getElementById("gpuhub-energy-groups");
  const named = Object.entries(energy.groups || {});
  if (groups) {
    energyHead(groups, "Group", cols);
    groups.querySelector("tbody").replaceChildren(...named.map(([g, f]) => energyRow(cols, g, f, { "data-group": g })));
    for (const e of document.querySelectorAll('[data-when-full="energy-groups"]')) {
      e.classList.toggle("d-none", energy.groups === undefined);
    }
    if (energy.groups !== undefined && !named.length) {
      groups.querySelector("tbody").replaceChildren(emptyRow(cols.length + 1, "No group used energy in this period."));
    }
  }
  const note = document.getElementById("gpuhub-energy-costing");
  if (note) note.textContent = costingText(energy.costing);
}

async function loadUsage() {
  for (const container of document.querySelectorAll(".usage-plot")) {
    try {
      const usage = await api("GET", `usage?${usageQuery(container)}`);
      drawPlot(container, usage);
      if (!container.dataset.usageUser) fillEnergy(usage);
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

// ---- live GPU use: the admin's grid and a user's own GPUs, polled from the API ----
// Every value from the API goes in with textContent (or as an SVG attribute number):
// user names, purposes and reasons are never parsed as HTML.

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function duration(seconds) {
  // as the broker's own messages (spawner.idle.duration): "45 s", "12 min", "2.5 h"
  if (seconds < 120) return `${Math.round(seconds)} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function pct(v) {
  return v === null || v === undefined ? "–" : String(Math.round(v));
}

function utcTime(iso) {
  // as gpu_magics.common.words.stamp: "2026-12-03 07:36:41 UTC"
  return iso ? `${iso.replace("T", " ").replace("Z", "")} UTC` : "";
}

function timeEl(iso) {  // a stamp in a table cell: on one line
  return el("span", { class: "text-nowrap" }, utcTime(iso) || "–");
}

function utcClock(d) {
  // as gpu_magics.common.words.clock: "07:36:41 UTC" (never the browser's local time)
  return `${d.toISOString().slice(11, 19)} UTC`;
}

function allocationWhat(a) {
  return `${a.purpose}${a.server_name ? " " + a.server_name : ""} #${a.allocation_id ?? a.id}`;
}

function idleBadge(idle) {
  // [bootstrap class, text, title] for an allocation's idle state; null when nothing to say
  if (!idle) return null;
  switch (idle.state) {
    case "warned":
      return idle.reclaim_in_seconds === null
        ? ["text-bg-warning", `idle ${duration(idle.idle_seconds)}`, idle.reason]
        : ["text-bg-warning", `reclaim in ${duration(idle.reclaim_in_seconds)}`, idle.reason];
    case "reclaim":
      return ["text-bg-danger", "reclaiming", idle.reason];
    case "exempt":
      return ["text-bg-info", "exempt", "never reclaimed: an exempt user or group"];
    case "unknown":
      return ["text-bg-secondary", "unknown", "no fresh utilization reports: not judged idle"];
    default:
      return null;
  }
}

function badgeEl(idle) {
  const b = idleBadge(idle);
  if (!b) return null;
  const span = el("span", { class: `badge gpu-idle ${b[0]}`, "data-idle-state": idle.state }, b[1]);
  if (b[2]) span.title = b[2];
  return span;
}

function borrowBadges(h, short = false) {
  // an allocation's borrowed GPUs ("2 of 3 borrowed") and its preemption ("taken back at ...")
  const out = [];
  if (!h) return out;
  if (h.borrowed) {
    out.push(el("span", { class: "badge text-bg-warning gpu-borrowed", "data-borrowed": h.borrowed,
      title: "beyond its user's limit: lent while idle, taken back when a request within its limit needs them" },
    `${h.borrowed} of ${h.gpu_count} borrowed`));
  }
  if (h.preemption) {
    out.push(el("span", { class: "badge text-bg-danger gpu-preempted", "data-preempt-due": h.preemption.due,
      title: `${utcTime(h.preemption.due)}: ${h.preemption.reason}` },
    `taken back at ${short ? utcClock(new Date(h.preemption.due)) : utcTime(h.preemption.due)}`));
  }
  return out;
}

function sparkline(history, seconds) {
  // utilization (0-100 %) over the readings the broker keeps, newest at the right, with its
  // caption; no line at all before the first reading
  const minutes = Math.max(1, Math.round(seconds / 60));
  if (!history.length) {
    return el("div", { class: "gpu-spark-caption small text-muted" }, "utilization: no samples yet");
  }
  const box = el("div", { class: "gpu-spark-box" });
  box.append(sparkSvg(history), el("div", { class: "gpu-spark-caption small text-muted" },
    `utilization, last ${minutes} min (0–100%)`));
  return box;
}

function sparkSvg(history) {
  const W = 120, H = 24;
  const root = svg("svg", { class: "gpu-spark", viewBox: `0 0 ${W} ${H}`, width: W, height: H,
    role: "img", "aria-label": "utilization history, 0 to 100%" });
  svg("rect", { x: 0.5, y: 0.5, width: W - 1, height: H - 1, fill: "none", stroke: "#dee2e6", "stroke-width": 1 }, root);
  const span = Math.max(1, -Math.min(...history.map((p) => p[0])));
  const x = (t) => W * (1 + t / span);
  const y = (v) => H - 1 - (Math.min(100, Math.max(0, v)) / 100) * (H - 2);
  const d = history.map(([t, v], i) => `${i ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  svg("path", { class: "spark-line", d, fill: "none", stroke: "#0d6efd", "stroke-width": 1.5 }, root);
  return root;
}

function utilBar(value, warn) {
  const bar = el("div", { class: "progress gpu-bar", role: "progressbar", "aria-valuemin": 0,
    "aria-valuemax": 100, "aria-valuenow": value ?? 0 });
  bar.style.height = "6px";
  const fill = el("div", { class: `progress-bar ${warn ? "bg-warning" : ""}` });
  fill.style.width = `${Math.min(100, Math.max(0, value ?? 0))}%`;
  bar.append(fill);
  return bar;
}

function memoryText(g) {
  if (g.memory_used_mib === null) return "no reading";
  const total = g.memory_total_mib ?? g.memory_mib;
  return `${g.memory_used_mib} / ${total ?? "?"} MiB`;
}

function gpuCell(g, idle, seconds) {
  const label = `${g.node}:${g.index}`;
  const slices = g.slices || [];
  const state = !g.present ? "absent" : g.holder ? "held" : slices.length ? "sliced" : "free";
  const cell = el("div", { class: "card gpu-cell", "data-gpu": label, "data-state": state });
  const body = el("div", { class: "card-body p-2" });
  const head = el("div", { class: "d-flex justify-content-between align-items-start gap-1" });
  head.append(el("strong", { class: "gpu-label" }, label));
  const badge = badgeEl(idle);
  if (badge) head.append(badge);
  body.append(head, el("div", { class: "gpu-model small text-muted" }, g.present ? g.model : `${g.model} (gone)`));
  const lent = borrowBadges(g.holder, true);
  if (lent.length) {
    const box = el("div", { class: "gpu-borrow" });
    box.append(...lent);
    body.append(box);
  }
  const holder = el("div", { class: "gpu-holder small" });
  if (g.holder) {
    holder.append(
      el("span", { class: "gpu-holder-user fw-semibold" }, g.holder.user), " ",
      el("span", { class: "gpu-holder-allocation" }, `#${g.holder.allocation_id}`), " ",
      el("span", { class: "gpu-holder-purpose text-muted" }, g.holder.purpose),
    );
  } else if (slices.length) {
    // a GPU held in slices: each slice with its holder (its readings are the whole GPU's)
    const parts = slices[0].parts;
    holder.append(el("span", { class: "gpu-slices-held text-muted" }, `${slices.length} of ${parts} slices held`));
    const list = el("ul", { class: "gpu-slices list-unstyled mb-0" });
    for (const s of slices) {
      const item = el("li", { class: "gpu-slice", "data-slice": s.label });
      item.append(
        el("span", { class: "gpu-slice-label" }, `1/${s.parts} #${s.part}`), " ",
        el("span", { class: "gpu-holder-user fw-semibold" }, s.holder.user), " ",
        el("span", { class: "gpu-holder-allocation" }, `#${s.holder.allocation_id}`),
      );
      list.append(item);
    }
    holder.append(list);
  } else {
    holder.append(el("span", { class: "gpu-holder-free text-success" }, "free"));
  }
  body.append(holder);
  if (g.utilization === null || g.utilization === undefined) {
    body.append(el("div", { class: "gpu-no-reading small text-muted" }, "no reading now"));
  } else {
    const util = el("div", { class: "gpu-util" });
    util.append(el("span", { class: "gpu-util-value fs-5" }, pct(g.utilization)), "%");
    body.append(util, utilBar(g.utilization, idle && idle.state === "warned"),
      el("div", { class: "gpu-mem small" }, memoryText(g)));
  }
  body.append(sparkline(g.history, seconds));
  cell.append(body);
  return cell;
}

function drawGrid(container, util) {
  const idle = new Map(util.allocations.map((a) => [a.id, a.idle]));
  const nodes = new Map();
  for (const g of util.gpus) {
    if (!nodes.has(g.node)) nodes.set(g.node, []);
    nodes.get(g.node).push(g);
  }
  const sections = [...nodes.entries()].map(([node, gpus]) => {
    const section = el("section", { class: "gpu-node mb-3", "data-node": node });
    const free = gpus.filter((g) => g.present && !g.holder && !(g.slices || []).length).length;
    const title = el("h3", { class: "h6" }, node);
    title.append(" ", el("small", { class: "text-muted" }, `${free} of ${gpus.length} free`));
    const cells = el("div", { class: "d-flex flex-wrap gap-2" });
    cells.append(...gpus.map((g) => gpuCell(g, g.holder ? idle.get(g.holder.allocation_id) : null, util.history_seconds)));
    section.append(title, cells);
    return section;
  });
  if (!sections.length) sections.push(el("p", { class: "text-muted" }, "No GPUs."));
  container.replaceChildren(...sections);
  const free = document.querySelector('[data-gpuhub="free"]');
  if (free) free.textContent = String(util.gpus.filter((g) => g.present && !g.holder && !(g.slices || []).length).length);
}

function row(cells, attrs = {}) {
  const tr = el("tr", attrs);
  for (const c of cells) {
    const td = el("td");
    td.append(c instanceof Node ? c : String(c)); // a string is appended as text
    tr.append(td);
  }
  return tr;
}

function showSection(name, full, count) {
  // a section with nothing to show says so in one line ([data-empty]) instead of its tables;
  // the page's table of contents says how many entries it has
  for (const e of document.querySelectorAll(`[data-empty="${name}"]`)) e.classList.toggle("d-none", full);
  for (const e of document.querySelectorAll(`[data-when-full="${name}"]`)) e.classList.toggle("d-none", !full);
  const toc = document.querySelector(`[data-toc="${name}"]`);
  if (toc) toc.textContent = full ? `(${count})` : "(none)";
}

function emptyRow(columns, text) {
  const tr = el("tr");
  tr.append(el("td", { colspan: columns, class: "text-muted" }, text));
  return tr;
}

function fillUserUtilization(util) {
  const body = document.querySelector("#user-utilization tbody");
  if (!body) return;
  const rows = util.users.map((u) => row(
    [u.user, u.gpus, u.mean_utilization === null ? "–" : `${pct(u.mean_utilization)} %`],
    { "data-user": u.user }));
  body.replaceChildren(...rows);
  showSection("user-utilization", rows.length > 0, rows.length);
}

function fillReclaims(rec) {
  const body = document.querySelector("#reclaims tbody");
  if (!body) return;
  const rows = rec.reclaims.map((r) => row(
    [timeEl(r.created), r.user, allocationWhat(r), r.gpus, duration(r.idle_seconds), fmt(r.gpu_hours),
      r.saved_kwh_estimate === null || r.saved_kwh_estimate === undefined ? "not measured" : `${r.saved_kwh_estimate.toFixed(3)} kWh`,
      r.reason],
    { "data-reclaim": r.id, "data-user": r.user }));
  body.replaceChildren(...rows);
  showSection("reclaims", rows.length > 0, rows.length);
  const users = document.querySelector("#reclaim-users tbody");
  const userRows = Object.entries(rec.users).map(([u, t]) => row([u, t.reclaims, fmt(t.gpu_hours)], { "data-user": u }));
  users.replaceChildren(...userRows);
  const total = document.getElementById("reclaim-total");
  total.replaceChildren(el("th", {}, "Total"), el("th", {}, rec.total.reclaims), el("th", {}, fmt(rec.total.gpu_hours)));
  const saved = document.getElementById("reclaim-saved");
  if (saved) saved.textContent = `${rec.total.saved_kwh_estimate.toFixed(3)} kWh at the GPUs`;
}

function fillPreemptions(pre) {
  const body = document.querySelector("#preemptions tbody");
  if (!body) return;
  const rows = pre.preemptions.map((p) => row(
    [timeEl(p.created), p.user, allocationWhat(p), `${p.borrowed} of ${p.gpus}`, p.for_user, timeEl(p.due),
      p.withdrawn ? `notice withdrawn at ${utcTime(p.withdrawn)}` : (p.ended ? timeEl(p.ended) : "not yet"), p.reason],
    { "data-preemption": p.id, "data-user": p.user }));
  body.replaceChildren(...(rows.length ? rows : [emptyRow(8, "No preemptions in this period.")]));
  const lent = Object.keys(pre.users).length;
  showSection("borrowing", lent > 0 || rows.length > 0, rows.length ? `${rows.length} preempted` : `${lent} borrowed`);
  document.getElementById("preemptions").classList.toggle("d-none", !rows.length);
  const users = document.querySelector("#borrowing-users tbody");
  const userRows = Object.entries(pre.users).map(([u, t]) => row(
    [u, el("span", { class: "borrowed-hours" }, fmt(t.borrowed_gpu_hours)),
      el("span", { class: "preemption-count" }, t.preemptions)], { "data-user": u }));
  users.replaceChildren(...(userRows.length ? userRows : [emptyRow(3, "Nobody borrowed GPUs in this period.")]));
  document.getElementById("borrowing-total").replaceChildren(el("th", {}, "Total"),
    el("th", {}, fmt(pre.total.borrowed_gpu_hours)), el("th", {}, pre.total.preemptions));
}

let refreshLive = null; // the page's live update, run at once after a button changed something

function livePoll(container, update) {
  // update() now and then every data-poll-seconds (default 3); the status line says when
  refreshLive = update;
  const ms = 1000 * Number(container.dataset.pollSeconds || 3);
  const status = document.querySelector("[data-live-status]");
  const tick = async () => {
    try {
      await update();
      if (status) {
        status.textContent = `updated ${utcClock(new Date())}`;
        status.classList.remove("text-danger");
      }
    } catch (err) {
      if (status) {
        status.textContent = `update failed: ${err.message}`;
        status.classList.add("text-danger");
      }
    }
    setTimeout(tick, ms);
  };
  tick();
}

// ---- the queue: what waits for GPUs (admin: everyone's; My GPUs: one's own) ----

const SURE_WORDS = { // as spawner/policy/waitline.py SURE_WORDS
  now: "GPUs are free for it now",
  firm: "when a notice or an idle reclaim is due",
  limit: "when a time limit ends",
  default: "cannot tell yet: no run here has ended yet to go by",
  likely: "from idle reclaims and leases",
  guess: "a guess from recent run lengths",
  slurm: "Slurm's estimate",
  unknown: "no estimate yet",
};

function queueWhat(q) {
  return `${q.purpose}${q.server_name ? " " + q.server_name : ""}`;
}

function queueGpus(q) {
  const amount = q.slice_parts ? `1/${q.slice_parts}` : `${q.gpus}`;  // a slice: its share of a GPU
  return `${amount}${q.gpu_model ? " " + q.gpu_model : ""}`;
}

function expectedEl(q) {
  const box = el("span", { class: "queue-expected", "data-sure": q.expected_sure });
  box.append(q.expected_start && q.expected_sure !== "default" ? utcTime(q.expected_start) : "–", " ",
    el("small", { class: "text-muted" }, `(${SURE_WORDS[q.expected_sure] || q.expected_sure})`));
  return box;
}

function factor(q, name) {
  // as the API rounds it (priority to 3 decimals, the factors to 4, GPU-hours to 3)
  const f = q.factors;
  return !f || f[name] === null || f[name] === undefined ? "–" : String(f[name]);
}

function button(text, cls, data) {
  const b = el("button", { class: `btn btn-sm ${cls}`, type: "button" }, text);
  for (const [k, v] of Object.entries(data)) b.dataset[k] = String(v);
  return b;
}

function fillQueue(queue) {
  const body = document.querySelector("#queue tbody");
  if (!body) return;
  const rows = queue.map((q) => {
    const who = el("span", { class: "queue-user" }, q.user);
    const user = el("span");
    user.append(who);
    if (q.factors && q.factors.front) user.append(" ", el("span", { class: "badge text-bg-info" }, "moved to front"));
    const actions = el("span", { class: "d-flex gap-1" });
    actions.append(
      button("Move to front", "btn-outline-primary", { queueFront: q.id }),
      button("Cancel", "btn-outline-danger", { queueCancel: q.id }),
    );
    const tr = row([
      el("span", { class: "queue-position" }, q.position), user, queueGpus(q), queueWhat(q), timeEl(q.created),
      duration(q.waited_seconds), expectedEl(q), el("span", { class: "queue-priority" }, factor(q, "priority")),
      el("span", { class: "queue-fairshare" }, factor(q, "fairshare")),
      el("span", { class: "queue-age" }, factor(q, "age")), el("span", { class: "queue-share" }, factor(q, "share")),
      el("span", { class: "queue-usage" }, factor(q, "recent_gpu_hours")), actions,
    ], { "data-queue-entry": q.id, "data-user": q.user });
    return tr;
  });
  body.replaceChildren(...rows);
  showSection("queue", rows.length > 0, `${rows.length} waiting`);
}

function fillMyQueue(queue) {
  const body = document.querySelector("#my-queue tbody");
  if (!body) return;
  const rows = queue.map((q) => row(
    [`#${q.id}`, queueWhat(q), queueGpus(q), el("span", { class: "queue-line" }, q.line), timeEl(q.created),
      button("Leave", "btn-outline-danger", { queueLeave: q.id })],
    { "data-queue-entry": q.id }));
  body.replaceChildren(...rows);
  showSection("my-queue", rows.length > 0, rows.length);
}

function startAdminGrid(grid) {
  livePoll(grid, async () => {
    const days = grid.dataset.reclaimDays || 7;
    const [util, rec, queue, pre] = await Promise.all([
      api("GET", "utilization"),
      api("GET", `reclaims?since=${days}d`),
      api("GET", "queue"),
      api("GET", `preemptions?since=${days}d`),
    ]);
    drawGrid(grid, util);
    fillUserUtilization(util);
    fillReclaims(rec);
    fillQueue(queue.queue);
    fillPreemptions(pre);
  });
}

function idleWarning(a) {
  const idle = a.idle;
  if (!idle || (idle.state !== "warned" && idle.state !== "reclaim")) return null;
  const box = el("div", { class: "alert alert-warning", role: "alert", "data-idle-warning": a.id });
  let text = `Your GPUs have been idle for ${duration(idle.idle_seconds)}; allocation ${a.id} `;
  if (idle.state === "reclaim") text += "is being reclaimed now.";
  else if (idle.reclaim_in_seconds === null) text += "is not reclaimed automatically, but please stop it if you no longer need its GPUs.";
  else text += `will be reclaimed in ${duration(idle.reclaim_in_seconds)} unless used.`;
  box.append(el("strong", {}, text));
  if (idle.reason) box.append(el("div", { class: "small" }, `${allocationWhat(a)}: ${idle.reason}.`));
  return box;
}

function reclaimNotice(r) {
  const which = r.server_name ? `Your server ${r.server_name}` : "Your server";
  return el("div", { class: "alert alert-info", role: "status", "data-reclaim": r.id },
    `${which} was stopped by gpuhub at ${utcTime(r.created)} because ${r.reason}. ` +
    "Your notebooks and files are saved; start the server again when you need GPUs.");
}

function preemptionNotice(p) {
  // as spawner/notices.py says it on the hub's home page
  const which = p.purpose === "server"
    ? (p.server_name ? `Your server ${p.server_name}'s` : "Your server's")
    : `Your burst #${p.allocation_id}'s`;
  const n = p.borrowed || p.gpus; // borrowed GPUs, or all of one that started ahead of the queue
  const gpus = p.borrowed ? `${p.borrowed} borrowed GPU${p.borrowed === 1 ? "" : "s"}`
    : `${p.gpus} GPU${p.gpus === 1 ? "" : "s"}, which started ahead of the queue,`;
  let text;
  if (p.withdrawn) { // the ledger's row says so: nothing is taken back
    const why = (p.withdrawn_reason || "").replace(/^withdrawn: /, "");
    text = `${which} ${gpus} will not be taken back: the notice of ${utcTime(p.created)} was withdrawn at ${utcTime(p.withdrawn)}${why ? ": " + why : ""}.`;
    const box = el("div", { class: "alert alert-info", role: "status", "data-preemption": p.id, "data-state": "withdrawn" });
    box.append(el("strong", {}, text));
    return box;
  }
  if (p.ended) {
    text = `${which} ${gpus} ${n === 1 ? "was" : "were"} taken back at ${utcTime(p.ended)} for a request within its limit` +
      (p.purpose === "server" ? ": gpuhub stopped the server. Your notebooks and files are saved." : ".");
  } else {
    const left = (Date.parse(p.due) - Date.now()) / 1000;
    const when = left > 0 ? `will be taken back at ${utcTime(p.due)}, in ${duration(left)},` : `${n === 1 ? "is" : "are"} being taken back now`;
    const then = p.purpose === "server" ? "gpuhub stops the server then" : "its engines stop then";
    text = `${which} ${gpus} ${when} for a request within its limit: ${then}. Save your work now.`;
  }
  const box = el("div", { class: `alert ${p.ended ? "alert-info" : "alert-warning"}`, role: "status",
    "data-preemption": p.id, "data-state": p.ended ? "done" : "pending" });
  box.append(el("strong", {}, text));  // p.reason says the same again: the admins' table shows it
  return box;
}

function fillMyUse(me, util) {
  const live = new Map(me.allocations.map((a) => [a.id, a]));
  for (const td of document.querySelectorAll("[data-allocation-use]")) {
    const id = Number(td.dataset.allocationUse);
    const a = live.get(id);
    if (!a) {
      td.replaceChildren(el("span", { class: "text-muted" }, "ended (reload the page)"));
      continue;
    }
    const held = (g) => (g.holder && g.holder.allocation_id === id)
      || (g.slices || []).some((s) => s.holder.allocation_id === id);
    const gpus = util.gpus.filter(held);
    const parts = gpus.map((g) => {
      const slice = (g.slices || []).find((s) => s.holder.allocation_id === id);
      const label = slice ? `${slice.label} (1/${slice.parts}; the whole GPU's use)` : `${g.node}:${g.index}`;
      const line = el("div", { class: "gpu-use", "data-gpu": `${g.node}:${g.index}` });
      line.append(el("span", { class: "gpu-label" }, label), " ");
      if (g.utilization === null || g.utilization === undefined) {
        line.append(el("span", { class: "gpu-no-samples text-muted" }, "no samples yet"));
        return line;
      }
      line.append(el("span", { class: "gpu-util-value fw-semibold" }, pct(g.utilization)), "% · ",
        el("span", { class: "gpu-mem" }, memoryText(g)));
      line.append(utilBar(g.utilization, a.idle && a.idle.state === "warned"));
      return line;
    });
    const badge = badgeEl(a.idle);
    if (badge) parts.push(badge);
    td.replaceChildren(...(parts.length ? parts : [el("span", { class: "text-muted" }, "–")]));
  }
  const warnings = document.getElementById("idle-warnings");
  warnings.replaceChildren(...me.allocations.map(idleWarning).filter(Boolean));
  document.getElementById("reclaim-notices").replaceChildren(...me.reclaimed.map(reclaimNotice));
  document.getElementById("preemption-notices").replaceChildren(...me.preempted.map(preemptionNotice));
}

function startUserLive(container) {
  const mine = `queue?user=${encodeURIComponent(container.dataset.user)}`; // an admin's own, too
  livePoll(container, async () => {
    const [me, util, queue] = await Promise.all([api("GET", "me"), api("GET", "utilization"), api("GET", mine)]);
    fillMyUse(me, util);
    fillMyEnergy(me);
    fillMyQueue(queue.queue);
  });
}

const liveGrid = document.getElementById("gpu-grid");
if (liveGrid) startAdminGrid(liveGrid);
const myUse = document.getElementById("my-gpu-live");
if (myUse) startUserLive(myUse);
