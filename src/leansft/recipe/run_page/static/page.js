// The run page's one renderer: live (asks /api/runs and /api/run/NAME every data-refresh seconds) or static
// (report.html: the runs' state in <script id="runs-data">). Everything a run wrote is set as text
// (textContent), never as markup.
"use strict";

const refresh = parseFloat(new URLSearchParams(location.search).get("refresh") || document.body.dataset.refresh);
const charts = {};      // id -> {plot, series}: kept across refreshes, so a zoom survives new points
const chosen = new Set(); // runs drawn; the first is the one whose details are shown
let known = [];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}

function fmt(x, digits = 4) {
  if (x == null || Number.isNaN(x)) return "-";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return x.toLocaleString("en-US");
  return Math.abs(x) >= 1000 ? Math.round(x).toLocaleString("en-US") : x.toPrecision(digits);
}

// A value axis's tick labels with as many decimals as its ticks need to read apart and exact (uPlot's own stop at
// three: an lr axis of 0, 0.0005, 0.001 read 0, 0.001, 0.001).
function tickLabels(u, splits, axis, space, incr) {
  let d = 0;
  const exact = v => Math.abs(v - Number(v.toFixed(d))) <= Math.abs(incr || v || 1) * 1e-6;
  while (d < 12 && !splits.every(exact)) d += 1;
  return splits.map(v => (v == null ? "" : v.toLocaleString("en-US", {minimumFractionDigits: d,
                                                                       maximumFractionDigits: d})));
}

function duration(s) {
  if (s == null || !isFinite(s)) return "-";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h ? `${h} h ${m} min` : m ? `${m} min ${s % 60} s` : `${s} s`;
}

function smooth(values, alpha = 0.9) {  // an exponential moving average, bias-corrected as TensorBoard's
  let avg = 0, n = 0;
  return values.map(v => {
    if (v == null) return null;
    n += 1; avg = alpha * avg + (1 - alpha) * v;
    return avg / (1 - Math.pow(alpha, n));
  });
}

// One chart: xs and named series (arrays aligned with xs, null where a series has no point).
function chart(id, title, xLabel, xs, series, parent, range) {
  let box = document.getElementById(id);
  if (!box) {
    box = el("section", {class: "chart", id}, el("h3", {text: title}));
    parent.append(box);
  }
  const points = series.length ? series[0].values.filter(v => v != null).length : 0;
  box.dataset.points = String(points);
  const data = [xs, ...series.map(s => s.values)];
  const key = series.map(s => s.label).join("|") + "|" + xLabel;
  const old = charts[id];
  if (old && old.key === key && old.box === box) { old.plot.setData(data); return; }
  if (old) old.plot.destroy();
  const width = Math.max(320, Math.min(560, box.clientWidth || 520));
  const colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
  const opts = {
    width, height: 220, legend: {live: false},
    scales: {x: range ? {time: false, range: () => range} : {time: false}},
    axes: [{label: xLabel}, {size: 60, values: tickLabels}],
    series: [{label: xLabel}, ...series.map((s, i) => ({
      label: s.label, stroke: s.color || colors[i % colors.length], width: s.width || 1.5, spanGaps: true,
      points: {show: s.points || false, size: 5},
      ...(s.bars ? {paths: uPlot.paths.bars({size: [0.9]}), fill: "#9ecae1"} : {}),
    }))],
  };
  charts[id] = {plot: new uPlot(opts, data, box), key, box};
}

function column(records, key) { return records.map(r => (r[key] == null ? null : r[key])); }

function statusLine(state) {
  const p = state.progress || {};
  const steps = state.metrics.filter(r => "loss" in r);
  const step = p.step != null ? p.step : (steps.length ? steps[steps.length - 1].step : 0);
  const total = p.total_steps;
  const parts = [`step ${fmt(step)}${total ? " of " + fmt(total) : ""}`];
  if (p.world_size > 1) parts.push(`rank 0's figures, ${p.world_size} ranks`);
  if (p.finished) parts.push("finished");
  else if (p.stopped) parts.push("stopped");
  else if (total && step > p.first_step && p.since_start_s > 0) {  // this process's pace (a resumed run's own)
    const per = p.since_start_s / (step - p.first_step);
    parts.push(`about ${duration(per * (total - step))} left`);
  }
  if (p.wall_s != null) parts.push(`${duration(p.wall_s)} so far`);
  return {text: parts.join(" · "), fraction: total ? Math.min(1, step / total) : null};
}

function drawRun(state, main) {
  const m = state.metrics;
  const train = m.filter(r => "loss" in r);
  const evals = m.filter(r => "eval_loss" in r);
  const byTokens = document.getElementById("x-axis") && document.getElementById("x-axis").value === "tokens";
  // one x axis for training and eval points: the union of their steps (eval at step 0 included)
  const steps = [...new Set([...train.map(r => r.step), ...evals.map(r => r.step)])].sort((a, b) => a - b);
  const at = (records, key) => {
    const map = new Map(records.map(r => [r.step, r[key]]));
    return steps.map(s => (map.has(s) && map.get(s) != null ? map.get(s) : null));
  };
  const tokensAt = new Map(train.map(r => [r.step, r.tokens_seen]));
  let xs = steps, xLabel = "step";
  if (byTokens) { xs = steps.map(s => (s === 0 ? 0 : tokensAt.get(s))); xLabel = "tokens seen"; }
  const keep = xs.map(x => x != null);
  const pick = a => a.filter((_, i) => keep[i]);
  const loss = at(train, "loss");
  let charts_ = document.getElementById("charts");
  if (!charts_) { charts_ = el("div", {id: "charts", class: "grid"}); main.append(charts_); }
  chart("chart-loss", "loss", xLabel, pick(xs), [
    {label: "train", values: pick(loss), width: 1, color: "#9ecae1"},
    {label: "train, smoothed", values: pick(smooth(loss)), width: 2, color: "#1f77b4"},
    {label: "held-out", values: pick(at(evals, "eval_loss")), width: 2, color: "#d62728", points: true},
  ], charts_);
  const trainXs = train.map(r => r.step);
  chart("chart-lr", "learning rate", "step", trainXs, [{label: "lr", values: column(train, "lr")}], charts_);
  chart("chart-grad", "gradient norm", "step", trainXs, [{label: "grad norm", values: column(train, "grad_norm")}],
        charts_);
  chart("chart-speed", "tokens/s", "step", trainXs, [
    {label: "real", values: column(train, "real_tokens_per_s")},
    {label: "target", values: column(train, "target_tokens_per_s")},
  ], charts_);
  chart("chart-padding", "padding share", "step", trainXs, [{label: "padding", values: column(train, "padding_share")}],
        charts_);
  if (train.some(r => r.mfu != null))
    chart("chart-mfu", "MFU", "step", trainXs, [{label: "MFU", values: column(train, "mfu")}], charts_);
  const suites = [...new Set(m.flatMap(r => Object.keys(r).filter(k => k.startsWith("suite_"))))];
  if (suites.length) {  // eval.suites: each suite's score at step 0 (the base model) and as it trains
    const scored = m.filter(r => suites.some(k => k in r));
    chart("chart-suites", "suites (score)", "step", scored.map(r => r.step),
          suites.map(k => ({label: k.slice(6), values: column(scored, k), points: true})), charts_);
  }
  chart("chart-memory", "peak memory (GB)", "step", trainXs, [
    {label: "peak", values: train.map(r => (r.peak_memory_bytes == null ? null : r.peak_memory_bytes / 1e9))},
  ], charts_);
}

function table(headers, rows) {
  return el("table", {}, el("thead", {}, el("tr", {}, ...headers.map(h => el("th", {text: h})))),
            el("tbody", {}, ...rows.map(r => el("tr", {}, ...r.map(c => (c instanceof Node ? el("td", {}, c)
                                                                                  : el("td", {text: fmt(c)})))))));
}

function replace(id, title, content, main) {
  let box = document.getElementById(id);
  const fresh = el("section", {id, class: "block"}, el("h2", {text: title}), content);
  if (box) box.replaceWith(fresh); else main.append(fresh);
}

function drawDetails(state, main) {
  // samples: for each prompt the answer before training (step 0) beside the newest
  const byPrompt = new Map();
  for (const s of state.samples) {
    const entry = byPrompt.get(s.prompt) || {before: null, latest: null};
    if (s.step === 0) entry.before = s; else entry.latest = s;
    byPrompt.set(s.prompt, entry);
  }
  const rows = [...byPrompt.entries()].map(([prompt, e]) => [
    el("pre", {text: prompt}), el("pre", {text: e.before ? e.before.answer : "-"}),
    el("pre", {text: e.latest ? e.latest.answer : "-"}), e.latest ? e.latest.step : "-"]);
  replace("samples", "samples", rows.length ? table(["prompt", "before training", "latest", "step"], rows)
                                             : el("p", {class: "muted", text: "no samples yet (eval.samples_every)"}),
          main);
  // eval.suites: each suite's score before training and at its last run, the change and its 95% interval
  const change = r => (typeof r.delta !== "number" ? "n/a" : `${r.delta >= 0 ? "+" : ""}${r.delta.toFixed(3)} (` +
    `${fmt((r.delta_ci95 || [])[0], 3)} to ${fmt((r.delta_ci95 || [])[1], 3)})`);
  const score = (x, step) => (x == null ? "n/a" : `${fmt(x, 3)} (step ${fmt(step)})`);
  const su = (state.suites || []).map(r => [r.suite, r.metric, r.n, score(r.before, r.before_step),
                                            score(r.after, r.after_step), change(r)]);
  if (su.length) replace("suites", "suites before and after", table(["suite", "metric", "items", "before", "after",
                                                                      "change (95% interval)"], su), main);
  const ck = state.checkpoints.map(c => [c.name, c.step, c.eval_loss, c.best ? "best" : ""]);
  replace("checkpoints", "checkpoints", ck.length ? table(["checkpoint", "step", "held-out loss", ""], ck)
                                                  : el("p", {class: "muted", text: "none yet"}), main);
  const d = state.data_report;
  if (d) {
    const mixed = (d.sources || []).some(s => s.share_asked != null);  // data.mix.mode: interleave
    const sources = (d.sources || []).map(s => [s.path, s.format, s.rows_read, s.bad_rows, s.examples, s.tokens,
      ...(mixed ? [s.share_asked, s.share_got, s.times_seen] : [])]);
    const headers = ["source", "format", "rows read", "bad rows", "examples", "tokens",
                     ...(mixed ? ["share asked", "share in the mix", "times seen"] : [])];
    const totals = Object.entries(d).filter(([k, v]) => typeof v === "number").map(([k, v]) => [k, v]);
    const hist = el("div", {class: "grid"});
    replace("data", "data", el("div", {}, table(headers, sources), table(["", "count"], totals), hist), main);
    const h = d.length_histogram;
    if (h && h.counts && h.counts.length) {  // a new element each refresh: drawn again, not updated
      if (charts["chart-lengths"]) { charts["chart-lengths"].plot.destroy(); delete charts["chart-lengths"]; }
      chart("chart-lengths", "training examples by length (tokens, after truncation)", "tokens",
            h.edges.slice(0, -1).map((e, i) => (e + h.edges[i + 1]) / 2),
            [{label: "examples", values: h.counts, bars: true}], hist, [h.edges[0], h.edges[h.edges.length - 1]]);
    }
  }
  if (state.config != null) replace("config", "config", el("pre", {class: "config", text: state.config}), main);
}

function drawCompare(states, main) {
  let box = document.getElementById("compare-block");
  if (states.length < 2) { if (box) box.remove(); return; }
  if (!box) { box = el("section", {id: "compare-block", class: "block"}, el("h2", {text: "runs compared"})); main.prepend(box); }
  const steps = [...new Set(states.flatMap(s => s.metrics.filter(r => "loss" in r).map(r => r.step)))].sort((a, b) => a - b);
  const series = [];
  for (const s of states) {
    const train = s.metrics.filter(r => "loss" in r);
    const values = smooth(train.map(r => r.loss));
    const sm = new Map(train.map((r, i) => [r.step, values[i]]));
    series.push({label: `${s.name} (train, smoothed)`, values: steps.map(x => (sm.has(x) ? sm.get(x) : null))});
    const ev = new Map(s.metrics.filter(r => "eval_loss" in r).map(r => [r.step, r.eval_loss]));
    if (ev.size) series.push({label: `${s.name} (held-out)`, values: steps.map(x => (ev.has(x) ? ev.get(x) : null)),
                              points: true});
  }
  chart("chart-compare", "loss", "step", steps, series, box);
}

function render(states) {
  const main = document.getElementById("page");
  if (!states.length) return;
  const placeholder = main.querySelector(".muted:only-child");
  if (placeholder) placeholder.remove();
  const first = states[0];
  document.getElementById("title").textContent = `leansft · ${first.name}`;
  const st = statusLine(first);
  const status = document.getElementById("status");
  status.textContent = st.text;
  let bar = document.getElementById("progress");
  if (st.fraction != null) {
    if (!bar) { bar = el("progress", {id: "progress", max: "1"}); status.after(bar); }
    bar.value = st.fraction;
  }
  if (!document.getElementById("x-axis")) {
    const select = el("select", {id: "x-axis"}, el("option", {value: "steps", text: "loss against steps"}),
                      el("option", {value: "tokens", text: "loss against tokens seen"}));
    select.addEventListener("change", () => { delete charts["chart-loss"]; document.getElementById("chart-loss").remove(); render(last); });
    main.append(el("div", {class: "controls"}, select));
  }
  drawCompare(states, main);
  drawRun(first, main);
  drawDetails(first, main);
}

let last = [];

function drawRunList() {
  const nav = document.getElementById("runs");
  nav.replaceChildren();
  if (known.length < 2) return;
  nav.append(el("span", {text: "runs: "}));
  for (const r of known) {
    const box = el("input", {type: "checkbox", "data-run": r.name});
    box.checked = chosen.has(r.name);
    box.addEventListener("change", () => { if (box.checked) chosen.add(r.name); else chosen.delete(r.name); tick(false); });
    nav.append(el("label", {title: r.folder}, box, document.createTextNode(" " + r.name)));
  }
}

async function tick(again = true) {
  try {
    const listing = await (await fetch("/api/runs", {cache: "no-store"})).json();
    const names = listing.map(r => r.name).join("|");
    if (names !== known.map(r => r.name).join("|")) {
      if (!chosen.size && listing.length) chosen.add(listing[0].name);
      known = listing;
      drawRunList();
    }
    const wanted = known.filter(r => chosen.has(r.name)).map(r => r.name);
    last = await Promise.all(wanted.map(async n => (await fetch("/api/run/" + encodeURIComponent(n),
                                                                 {cache: "no-store"})).json()));
    render(last);
  } catch (err) {
    document.getElementById("status").textContent = "the run page server does not answer (" + err + ")";
  }
  if (again && refresh > 0) setTimeout(tick, refresh * 1000);
}

const embedded = document.getElementById("runs-data");
if (embedded) {
  last = JSON.parse(embedded.textContent);
  known = last.map(s => ({name: s.name, folder: s.name}));
  render(last);
} else {
  tick();
}
