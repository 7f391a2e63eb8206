// The live dashboard: polls /v1/stats and redraws the tiles and charts.
"use strict";

const REFRESH_MS = 3000;
const SOURCES = ["device", "host", "remote", "prefix"];
const MB = 1024 * 1024;

const byId = (id) => document.getElementById(id);
const charts = {
  ttft: new LineChart(byId("chart-ttft"), {format: (v) => v.toFixed(0)}),
  tps: new LineChart(byId("chart-tps")),
  hit: new LineChart(byId("chart-hit"), {format: (v) => `${Math.round(v * 100)}%`, max: 1}),
  tiers: new LineChart(byId("chart-tiers")),
  arena: new LineChart(byId("chart-arena"), {integer: true}),
  evictions: new LineChart(byId("chart-evictions"), {integer: true}),
};

const ms = (v) => (v === null || v === undefined ? "–" : v < 10 ? v.toFixed(1) : Math.round(v).toString());
const mb = (bytes) => `${(bytes / MB).toFixed(bytes < 10 * MB ? 1 : 0)} MB`;
const percent = (v) => (v === null || v === undefined ? "–" : `${+(v * 100).toFixed(v < 0.1 ? 1 : 0)}%`);
const sum = (object) => Object.values(object || {}).reduce((a, b) => a + b, 0);

function tiles(stats) {
  const minute = stats.windows["1m"], five = stats.windows["5m"], now = stats.now;
  byId("tile-ttft").textContent = `${ms(minute.ttft_ms.p50)} / ${ms(minute.ttft_ms.p95)} / ${ms(minute.ttft_ms.p99)} ms`;
  byId("tile-itl").textContent = `${ms(minute.inter_token_ms.p50)} / ${ms(minute.inter_token_ms.p95)} ms`;
  byId("tile-tps").textContent = minute.tokens_per_s.toFixed(1);
  byId("tile-hit").textContent = percent(five.cache.hit_ratio);
  byId("tile-load").textContent = `${now.running} / ${now.waiting}`;
  byId("tile-sessions").textContent = `${now.sessions.connected} / ${now.sessions.idle}`;
  byId("tile-tiers").textContent = `${percent(now.tiers.device.usage)} / ${percent(now.tiers.host.usage)}`;
  byId("tile-evictions").textContent = `${sum(five.evictions)} / ${sum(five.corruptions)}`;
  const arena = now.arena || {};
  byId("tile-arena").textContent = arena.used_tokens === undefined ? "–"
    : `${arena.used_tokens} / ${arena.reserved_tokens} / ${arena.free_tokens}`;
  const device = now.tiers.device, shared = device.shared || {}, chunks = now.tiers.remote.chunks || {};
  byId("tile-shared").textContent = shared.segments === undefined ? "–"
    : `${shared.segments} / ${shared.sessions} · ${mb(device.bytes)} vs ${mb(device.private_kv_bytes)}`;
  byId("model").textContent = `${stats.model} · up ${Math.round(stats.uptime_s)} s`;

  const rows = [
    ["Turns", five.turns],
    ["TTFT p50 / p95 / p99", `${ms(five.ttft_ms.p50)} / ${ms(five.ttft_ms.p95)} / ${ms(five.ttft_ms.p99)} ms`],
    ["End-to-end p50 / p95", `${ms(five.e2e_ms.p50)} / ${ms(five.e2e_ms.p95)} ms`],
    ...Object.entries(five.cache.turns_by_source).map(([source, n]) => [`Turns from ${source}`, n]),
    ...Object.entries(five.cache.miss_reasons).map(([reason, n]) => [`Misses: ${reason}`, n]),
    ...Object.entries(five.corruptions).filter(([, n]) => n).map(([check, n]) => [`Corruptions: ${check}`, n]),
    ...Object.entries(five.errors).map(([code, n]) => [`Errors: ${code}`, n]),
    ["Device tier", `${mb(now.tiers.device.bytes)} of ${mb(now.tiers.device.budget_bytes)}, ${now.tiers.device.sessions ?? 0} sessions`],
    ["Host tier", `${mb(now.tiers.host.bytes)} of ${mb(now.tiers.host.budget_bytes)}, ${now.tiers.host.sessions ?? 0} sessions`],
    ["KV arena: longest free run", `${arena.largest_free_tokens ?? "–"} tokens`],
    ["KV arena: compactions", `${arena.compactions ?? 0} (${mb(arena.compaction_bytes ?? 0)} moved)`],
    ["Shared segments: device (warm) / host", `${shared.segments ?? 0} (${shared.pinned ?? 0}) / ${shared.host_segments ?? 0}`],
    ["Device: held / distinct KV / as private copies", `${mb(device.bytes)} / ${mb(device.kv_bytes ?? 0)} / ${mb(device.private_kv_bytes ?? 0)}`],
    ["Host: prompt chunk copies held / shared", `${now.tiers.host.chunks?.held ?? 0} / ${now.tiers.host.chunks?.shared ?? 0}`],
    ["Host offloads: written / not written again", `${mb(now.tiers.host.offload?.written_bytes ?? 0)} / ${mb(now.tiers.host.offload?.skipped_bytes ?? 0)}`],
    ["Redis chunks: known / written / renewed / fetched", `${chunks.known ?? 0} / ${chunks.written ?? 0} / ${chunks.renewed ?? 0} / ${chunks.fetched ?? 0}`],
    ["Redis chunks: bytes written / not moved", `${mb(chunks.written_bytes ?? 0)} / ${mb((chunks.not_sent_bytes ?? 0) + (chunks.not_copied_bytes ?? 0) + (chunks.not_fetched_bytes ?? 0))}`],
    ...engineRows(now.engine || {}, now.tiers.remote),
    ...redisRows(now.redis || {}),
    ...responsesSocketRows(now.responses_websocket || {}),
  ];
  const body = byId("summary");
  body.replaceChildren(...rows.map(([name, value]) => {
    const row = document.createElement("tr");
    for (const text of [name, value]) {
      const cell = document.createElement("td");
      cell.textContent = String(text);
      row.append(cell);
    }
    return row;
  }));
}

function engineRows(engine, remote) {
  const rows = [
    ["Engine threads: now / max (CPUs others take)",
      engine.threads === undefined || engine.threads === null ? "–"
        : `${engine.threads} / ${engine.threads_max} (${(engine.cpu_taken_by_others ?? 0).toFixed(1)})`],
    speculationRow(engine.speculation || {}),
  ];
  if (!remote.budget_bytes) return rows;  // no --remote-kv
  const fetches = remote.fetches || {}, queue = remote.queue || {}, dropped = queue.dropped || {};
  return rows.concat([
    ["Redis caches: fetched / recomputed / timed out", `${fetches.fetch ?? 0} / ${fetches.recompute ?? 0} / ${fetches.timeout ?? 0}`],
    ["Redis: round trip, turns fetching", `${ms(remote.round_trip_ms)} ms, ${engine.fetching ?? 0}`],
    ["Redis write queue: snapshots / dropped", `${queue.writes ?? 0} (${mb(queue.bytes ?? 0)}) / ${sum(dropped)}`],
  ]);
}

function responsesSocketRows(ws) {
  const steers = (outcome) => ws[`steers_${outcome}`] ?? 0;
  const refused = Object.entries(ws).filter(([key]) => key.startsWith("steers_") &&
    !["steers_accepted", "steers_successors", "steers_pending"].includes(key)).reduce((a, [, b]) => a + b, 0);
  return [
    ["Responses WebSockets: connections / lanes / queued creates", `${ws.connections ?? 0} / ${ws.lanes ?? 0} / ${ws.queued ?? 0}`],
    ["Responses WebSockets: creates / warm-ups", `${ws.creates ?? 0} / ${ws.warmups ?? 0}`],
    ["Steers: accepted / successors / pending / refused",
      `${steers("accepted")} / ${steers("successors")} / ${steers("pending")} / ${refused}`],
  ];
}

function speculationRow(speculation) {
  const name = "Speculation: draft tokens / accepted (acceptance)";
  if (!speculation.max_tokens) return [name, "off"];
  const acceptance = speculation.acceptance === null || speculation.acceptance === undefined ? "–"
    : `${(100 * speculation.acceptance).toFixed(0)}%`;
  return [name, `${speculation.draft_tokens ?? 0} / ${speculation.accepted_tokens ?? 0} (${acceptance})`];
}

function redisRows(redis) {
  if (!redis.mode) return [];  // sessions in memory
  const roles = (role) => (redis.nodes || []).filter((node) => node.role === role).length;
  const waits = redis.waits || {};
  return [
    ["Redis: mode, primaries / replicas", `${redis.mode}, ${roles("primary")} / ${roles("replica")}`],
    ["Redis: turns acknowledged / short of replicas", redis.wait_replicas
      ? `${waits.acked ?? 0} / ${(waits.short ?? 0) + (waits.failed ?? 0)} (waiting for ${redis.wait_replicas})` : "not waiting for replicas"],
    ["Redis: errors / retries / slot-map changes",
      `${Object.values(redis.errors || {}).reduce((a, b) => a + b, 0)} / ${redis.retries ?? 0} / ${redis.slot_map_changes ?? 0}`],
  ];
}

function draw(stats) {
  const points = stats.series.points;
  const line = (name, pick) => ({name, points: points.map((p) => [p.t, pick(p)])});
  charts.ttft.draw([line("p50", (p) => p.ttft_ms.p50), line("p95", (p) => p.ttft_ms.p95),
    line("p99", (p) => p.ttft_ms.p99)]);
  charts.tps.draw([line("tokens/s", (p) => p.tokens_per_s)]);
  charts.hit.draw(SOURCES.map((source) =>
    line(source, (p) => (p.cached_token_ratio === null ? null : p.cached_token_ratio[source] ?? 0))));
  const tiers = ["device", "host"].concat(stats.now.tiers.remote.budget_bytes ? ["remote"] : []);
  charts.tiers.draw(tiers.map((tier) => line(tier, (p) => (p.tier_bytes ? p.tier_bytes[tier] / MB : null))));
  charts.arena.draw(["used", "reserved", "free"].map((state) =>
    line(state, (p) => (p.arena_tokens ? p.arena_tokens[state] : null))));
  charts.evictions.draw([
    line("device evictions", (p) => (p.evictions ? p.evictions.device : null)),
    line("host evictions", (p) => (p.evictions ? p.evictions.host : null)),
    line("corruptions", (p) => p.corruptions),
  ]);
}

async function refresh() {
  const status = byId("updated");
  try {
    const response = await fetch("/v1/stats", {cache: "no-store"});
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const stats = await response.json();
    tiles(stats);
    draw(stats);
    byId("banner").hidden = true;
    status.dataset.state = "live";
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    status.dataset.state = "offline";
    status.textContent = "offline";
    byId("banner").textContent = `Cannot load /v1/stats from the chatd server (${error.message}); retrying every ${REFRESH_MS / 1000} s.`;
    byId("banner").hidden = false;
  }
}

refresh();
setInterval(refresh, REFRESH_MS);
window.addEventListener("resize", refresh);
