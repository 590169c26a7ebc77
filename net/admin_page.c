/* The status page the gateway serves at GET /admin/ (net/admin_page.h): one HTML document
 * with its CSS and script inline, no external assets, so it works with no network but the
 * server's. The script polls GET /admin/status every 500 ms and draws the cluster's topology
 * (nodes and links coloured by health), its replicas' load, the degradation level and the last
 * faults and recoveries; the document's layout is in tools/cluster_status.h. The markup uses
 * single quotes only, so the C strings below need few escapes; edit them in place. */
#include "net/admin_page.h"

#include <mbedtls/base64.h>
#include <mbedtls/md.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "base/auth.h"

static const char page[] =
    "<!doctype html>\n"
    "<html lang='en'>\n"
    "<head>\n"
    "<meta charset='utf-8'>\n"
    "<meta name='viewport' content='width=device-width, initial-scale=1'>\n"
    "<title>Shoal status</title>\n"
    "<style>\n"
    "body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f5f6f8; color: #1d2330; "
    "}\n"
    "header { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; padding: 10px 16px;\n"
    "  background: #1d2330; color: #fff; }\n"
    "header h1 { font-size: 17px; margin: 0 8px 0 0; }\n"
    ".pill { padding: 2px 10px; border-radius: 10px; background: #39425a; }\n"
    ".pill.ok { background: #2e9d5b; } .pill.bad { background: #d64040; }\n"
    "main { padding: 12px 16px; display: grid; gap: 14px; }\n"
    "section { background: #fff; border-radius: 8px; padding: 10px 14px; box-shadow: 0 1px 2px "
    "#0002; }\n"
    "h2 { font-size: 14px; margin: 0 0 8px; text-transform: uppercase; letter-spacing: .05em;\n"
    "  color: #5a6275; }\n"
    "table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }\n"
    "th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #e4e6eb; white-space: "
    "nowrap; }\n"
    "td.msg { white-space: normal; }\n"
    "th { font-weight: 600; color: #5a6275; }\n"
    ".alive { color: #1f7a44; } .joining { color: #a57b00; } .dead { color: #c62828; font-weight: "
    "600; }\n"
    ".serving { color: #1f7a44; } .paused { color: #a57b00; } .down { color: #c62828; }\n"
    ".k-dead, .k-fault, .k-removed, .k-drain { color: #c62828; }\n"
    ".k-alive, .k-resumed, .k-restarted, .k-promoted { color: #1f7a44; }\n"
    ".k-paused, .k-level, .k-policy { color: #a57b00; }\n"
    "svg text { font-family: system-ui, sans-serif; font-size: 12px; }\n"
    ".bar { display: inline-block; width: 80px; height: 8px; background: #e4e6eb; border-radius: "
    "4px;\n"
    "  vertical-align: middle; margin-right: 6px; overflow: hidden; }\n"
    ".bar i { display: block; height: 100%; background: #4a78c2; }\n"
    "#conn.bad { background: #d64040; }\n"
    ".muted { color: #8a90a0; }\n"
    "</style>\n"
    "</head>\n"
    "<body data-live='0' data-updates='0'>\n"
    "<header>\n"
    "<h1>Shoal</h1>\n"
    "<span id='model' class='pill'>-</span>\n"
    "<span id='mode' class='pill'>-</span>\n"
    "<span id='level' class='pill' title='degradation level (shoal_degradation_level)'>level "
    "-</span>\n"
    "<span id='conn' class='pill'>connecting</span>\n"
    "<span id='clock' class='muted'></span>\n"
    "</header>\n"
    "<main>\n"
    "<section><h2>Topology</h2><svg id='topo' width='400' height='120' role='img'\n"
    "aria-label='nodes and links coloured by health'></svg>\n"
    "<div class='muted'>green: alive, amber: joining, red: dead (health from the\n"
    "<span id='hsrc'>links</span>)</div></section>\n"
    "<section><h2>Replicas</h2><table id='replicas'><thead><tr><th>replica</th><th>model</th>\n"
    "<th>state</th><th>stages</th><th>running</th><th>waiting</th><th>KV blocks</th><th>load</th>\n"
    "<th>weight</th><th>routed</th><th>generated</th></tr></thead><tbody></tbody></table></"
    "section>\n"
    "<section><h2>Nodes</h2><table "
    "id='nodes'><thead><tr><th>node</th><th>role</th><th>health</th>\n"
    "<th>link</th><th>stages</th><th>reconnects</th><th>deaths</th><th>heartbeat</th><th>RSS</"
    "th><th>URL</th>\n"
    "<th>last error</th></tr></thead><tbody></tbody></table></section>\n"
    "<section><h2>Faults and recoveries</h2><table "
    "id='events'><thead><tr><th>time</th><th>kind</th>\n"
    "<th>node</th><th>replica</th><th>what</th></tr></thead><tbody></tbody></table>\n"
    "<div id='noevents' class='muted'>none yet</div></section>\n"
    "</main>\n"
    "<script>\n"
    "'use strict';\n"
    "// The status page of a Shoal server: polls GET /admin/status (same origin) every 500 ms and\n"
    "// draws it. With API keys, open it as /admin/?key=KEY: the key goes in the Authorization "
    "header.\n"
    "const key = new URLSearchParams(location.search).get('key');\n"
    "const url = location.pathname.replace(/\\/?$/, '/') + 'status';\n"
    "const colour = { alive: '#2e9d5b', joining: '#d9a400', dead: '#d64040' };\n"
    "const levelColour = ['#2e9d5b', '#b8a000', '#e08a00', '#e0531f', '#c62828'];\n"
    "const $ = (id) => document.getElementById(id);\n"
    "let lastOk = 0;\n"
    "const SVG_TAGS = new Set(['svg', 'g', 'rect', 'line', 'text', 'defs', 'marker', 'path']);\n"
    "window.shoal = { doc: null, updates: 0, error: '' };\n"
    "\n"
    "function el(tag, attrs, ...kids) {\n"
    "  const ns = SVG_TAGS.has(tag) || (tag === 'title' && attrs && attrs.svg);\n"
    "  const e = ns ? document.createElementNS('http://www.w3.org/2000/svg', tag)\n"
    "    : document.createElement(tag);\n"
    "  for (const [k, v] of Object.entries(attrs || {}))\n"
    "    if (k === 'style') e.style.cssText = v; /* CSSOM: the CSP allows no style attribute */\n"
    "    else if (k !== 'svg' && v !== null && v !== undefined) e.setAttribute(k, v);\n"
    "  for (const c of kids)\n"
    "    e.append(c instanceof Node ? c : document.createTextNode(c === null ? '-' : String(c)));\n"
    "  return e;\n"
    "}\n"
    "function fill(tbody, rows) { tbody.replaceChildren(...rows); }\n"
    "function bytes(n) {\n"
    "  if (n === null || n === undefined) return '-';\n"
    "  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB']; let i = 0;\n"
    "  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }\n"
    "  return n.toFixed(i ? 1 : 0) + ' ' + u[i];\n"
    "}\n"
    "function clock(ms) {\n"
    "  const d = new Date(ms);\n"
    "  return d.toLocaleTimeString([], { hour12: false }) + '.' + "
    "String(d.getMilliseconds()).padStart(3, '0');\n"
    "}\n"
    "\n"
    "// Topology: the front on the left; each replica a row of its stage nodes in pipeline order "
    "(a\n"
    "// node shared by several replicas is drawn once, where it first appears); nodes without a\n"
    "// stage (standbys) in a row of their own.\n"
    "function drawTopology(doc) {\n"
    "  const svg = $('topo');\n"
    "  const W = 130, H = 46, DX = 190, DY = 78;\n"
    "  const pos = {}, byName = {};\n"
    "  for (const n of doc.nodes) byName[n.name] = n;\n"
    "  const front = doc.nodes.find((n) => n.role !== 'worker') || doc.nodes[0];\n"
    "  const rows = Math.max(doc.replicas.length, 1);\n"
    "  let cols = 1;\n"
    "  doc.replicas.forEach((r, k) => {\n"
    "    let c = 1;\n"
    "    for (const st of r.stages) {\n"
    "      if (st.node === front.name || pos[st.node]) continue;\n"
    "      pos[st.node] = { x: 20 + c * DX, y: 14 + k * DY };\n"
    "      c++;\n"
    "    }\n"
    "    cols = Math.max(cols, c);\n"
    "  });\n"
    "  let spare = 0;\n"
    "  for (const n of doc.nodes)\n"
    "    if (n !== front && !pos[n.name]) pos[n.name] = { x: 20 + (1 + spare++) * DX, y: 14 + rows "
    "* DY };\n"
    "  cols = Math.max(cols, spare + 1);\n"
    "  pos[front.name] = { x: 20, y: 14 + (rows - 1) * DY / 2 };\n"
    "  const width = 40 + (cols - 1) * DX + W, height = 28 + (rows + (spare ? 1 : 0) - 1) * DY + "
    "H;\n"
    "  svg.setAttribute('width', width);\n"
    "  svg.setAttribute('height', height);\n"
    "  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);\n"
    "  const kids = [el('defs', {}, ...Object.entries(colour).map(([h, c]) =>\n"
    "    el('marker', { id: 'arrow-' + h, viewBox: '0 0 10 10', refX: 10, refY: 5, markerWidth: "
    "7,\n"
    "      markerHeight: 7, orient: 'auto-start-reverse' }, el('path', { d: 'M0,0 L10,5 L0,10 z', "
    "fill: c }))))];\n"
    "  for (const l of doc.links || []) {\n"
    "    const a = pos[l.from], b = pos[l.to];\n"
    "    if (!a || !b) continue;\n"
    "    const x1 = a.x + W, y1 = a.y + H / 2, x2 = b.x, y2 = b.y + H / 2;\n"
    "    kids.push(el('line', { x1, y1, x2: x2 - 2, y2, stroke: colour[l.health] || '#888',\n"
    "      'stroke-width': 3, 'stroke-dasharray': l.health === 'alive' ? null : '7 5',\n"
    "      'marker-end': `url(#arrow-${l.health})`, class: 'link', 'data-from': l.from,\n"
    "      'data-to': l.to, 'data-health': l.health },\n"
    "    el('title', { svg: 1 }, `${l.from} -> ${l.to} (replica ${l.replica + 1}): "
    "${l.health}`)));\n"
    "  }\n"
    "  for (const n of doc.nodes) {\n"
    "    const p = pos[n.name], h = n.health || 'alive';\n"
    "    const sub = n.role === 'worker' ? (n.stages.length ? 'stage ' + n.stages.join(', ') : "
    "'standby')\n"
    "      : n.role;\n"
    "    kids.push(el('g', { class: 'node', 'data-node': n.name, 'data-health': h,\n"
    "      transform: `translate(${p.x},${p.y})` },\n"
    "    el('rect', { width: W, height: H, rx: 8, fill: colour[h] || '#888', stroke: '#0003' }),\n"
    "    el('text', { x: 10, y: 19, fill: '#fff', 'font-weight': 600 }, n.name + (h === 'dead' ? ' "
    " \\u2715' : '')),\n"
    "    el('text', { x: 10, y: 36, fill: '#fff' }, `${sub} \\u00b7 ${h}`),\n"
    "    el('title', { svg: 1 }, `${n.name} (${n.role}) ${n.url}: ${h}, link ${n.state}`)));\n"
    "  }\n"
    "  svg.replaceChildren(...kids);\n"
    "}\n"
    "\n"
    "function draw(doc) {\n"
    "  $('model').textContent = `${doc.model.name} (${doc.model.layers} layers)`;\n"
    "  $('mode').textContent = doc.mode === 'cluster' ? `cluster, front node ${doc.node}` : "
    "'single "
    "process';\n"
    "  const lv = doc.degradation ? doc.degradation.level : null;\n"
    "  $('level').textContent = lv === null ? 'level -' : `level ${lv}`;\n"
    "  $('level').style.background = lv === null ? '' : levelColour[Math.min(Math.max(lv, 0), "
    "4)];\n"
    "  $('level').dataset.level = lv === null ? '' : lv;\n"
    "  $('clock').textContent = 'server time ' + clock(doc.time_unix_ms);\n"
    "  $('hsrc').textContent = doc.health_source === 'watchdog' ? 'watchdog heartbeats' : "
    "'front\\'s links';\n"
    "  drawTopology(doc);\n"
    "  fill($('replicas').tBodies[0], doc.replicas.map((r) => {\n"
    "    const used = r.kv_blocks_total ? r.kv_blocks_used / r.kv_blocks_total : 0;\n"
    "    return el('tr', { 'data-replica': r.replica, 'data-state': r.state },\n"
    "      el('td', {}, r.replica + 1), el('td', {}, r.model),\n"
    "      el('td', { class: r.state }, r.state),\n"
    "      el('td', {}, r.stages.map((s) => `${s.node} [${s.first_layer}, "
    "${s.last_layer})`).join(' \\u2192 ')),\n"
    "      el('td', {}, r.running), el('td', {}, r.waiting),\n"
    "      el('td', {}, el('span', { class: 'bar' }, el('i', { style: `width:${(used * "
    "100).toFixed(1)}%` })),\n"
    "        `${r.kv_blocks_used}/${r.kv_blocks_total}`),\n"
    "      el('td', {}, r.load), el('td', {}, r.weight === null ? null : r.weight.toFixed(2)),\n"
    "      el('td', {}, r.router ? r.router.routed : null), el('td', {}, r.generation_tokens));\n"
    "  }));\n"
    "  fill($('nodes').tBodies[0], doc.nodes.map((n) => el('tr', { 'data-node': n.name, "
    "'data-health': n.health },\n"
    "    el('td', {}, n.name), el('td', {}, n.role), el('td', { class: n.health }, n.health),\n"
    "    el('td', {}, n.state + (n.lost ? ' (lost)' : '')), el('td', {}, n.stages.join(', ') || "
    "null),\n"
    "    el('td', {}, n.reconnects), el('td', {}, n.deaths),\n"
    "    el('td', { title: 'round trip of the last heartbeat, and how long ago it came' },\n"
    "      n.heartbeat_rtt_ms === null ? null\n"
    "        : `${n.heartbeat_rtt_ms.toFixed(2)} ms, ${n.heartbeat_age_ms} ms ago`),\n"
    "    el('td', {}, bytes(n.rss_bytes)), el('td', {}, n.url || null),\n"
    "    el('td', { class: 'msg' }, n.last_error || null))));\n"
    "  const evs = (doc.events || []).slice(-20).reverse();\n"
    "  fill($('events').tBodies[0], evs.map((e) => el('tr', { 'data-kind': e.kind, 'data-seq': "
    "e.seq },\n"
    "    el('td', { title: `${((doc.time_unix_ms - e.unix_ms) / 1000).toFixed(1)} s ago` }, "
    "clock(e.unix_ms)),\n"
    "    el('td', { class: 'k-' + e.kind }, e.kind), el('td', {}, e.node),\n"
    "    el('td', {}, e.replica === null ? null : e.replica + 1), el('td', { class: 'msg' }, "
    "e.msg))));\n"
    "  $('noevents').style.display = evs.length ? 'none' : '';\n"
    "}\n"
    "\n"
    "function setConn(ok, text) {\n"
    "  const c = $('conn');\n"
    "  c.textContent = text;\n"
    "  c.className = 'pill ' + (ok ? 'ok' : 'bad');\n"
    "  document.body.dataset.live = ok ? '1' : '0';\n"
    "}\n"
    "\n"
    "async function poll() {\n"
    "  try {\n"
    "    const r = await fetch(url, { cache: 'no-store',\n"
    "      headers: key ? { Authorization: 'Bearer ' + key } : {} });\n"
    "    if (!r.ok) {\n"
    "      let msg = 'HTTP ' + r.status;\n"
    "      try { msg += ': ' + (await r.json()).error.message; } catch (e) { /* not JSON */ }\n"
    "      if (r.status === 401) msg += key ? ' (the key in ?key= is refused)' : ' (open this page "
    "as /admin/?key=KEY)';\n"
    "      throw new Error(msg);\n"
    "    }\n"
    "    const doc = await r.json();\n"
    "    window.shoal.doc = doc;\n"
    "    window.shoal.updates++;\n"
    "    window.shoal.error = '';\n"
    "    draw(doc);\n"
    "    lastOk = Date.now();\n"
    "    document.body.dataset.updates = window.shoal.updates;\n"
    "    setConn(true, 'live');\n"
    "  } catch (e) {\n"
    "    window.shoal.error = String(e.message || e);\n"
    "    setConn(false, Date.now() - lastOk < 3000 ? 'reconnecting' : 'no answer: ' + "
    "window.shoal.error);\n"
    "  }\n"
    "  setTimeout(poll, 500);\n"
    "}\n"
    "poll();\n"
    "</script>\n"
    "</body>\n"
    "</html>\n";

/* What GET /admin/ answers (401) when keys are set and none came: a form that reopens the page
 * with ?key=. */
static const char login[] =
    "<!doctype html>\n"
    "<html lang='en'>\n"
    "<head>\n"
    "<meta charset='utf-8'>\n"
    "<meta name='viewport' content='width=device-width, initial-scale=1'>\n"
    "<title>Shoal status: key needed</title>\n"
    "<style>\n"
    "body { font: 15px/1.4 system-ui, sans-serif; background: #f5f6f8; color: #1d2330; }\n"
    "form { max-width: 420px; margin: 12vh auto; background: #fff; padding: 20px 24px;\n"
    "  border-radius: 8px; box-shadow: 0 1px 3px #0003; }\n"
    "input { font: inherit; width: 100%; box-sizing: border-box; margin: 10px 0; padding: 6px; }\n"
    "</style>\n"
    "</head>\n"
    "<body>\n"
    "<form id='login' method='get'>\n"
    "<h1>Shoal status</h1>\n"
    "<p>This server requires an API key. The page sends it with every request as a bearer "
    "key.</p>\n"
    "<input id='key' name='key' type='password' placeholder='API key' autofocus required>\n"
    "<button type='submit'>Open the status page</button>\n"
    "</form>\n"
    "</body>\n"
    "</html>\n";

/* The Content-Security-Policy of each document: nothing may load or run but its own inline
 * blocks (allowed by their SHA-256, computed here once from the text above, so an edit of the
 * page cannot leave a stale hash), its fetches to this server, and no framing at all. */
static char page_csp[512], login_csp[384];
static pthread_once_t csp_once = PTHREAD_ONCE_INIT;

/* Appends " 'sha256-<base64>'" of the text between each `open` tag and the next `close` tag of
 * doc to out. */
static void add_hashes(char *out, size_t cap, const char *doc, const char *open, const char *close)
{
    const mbedtls_md_info_t *md = mbedtls_md_info_from_type(MBEDTLS_MD_SHA256);
    for (const char *p = strstr(doc, open); p; p = strstr(p, open)) {
        p += strlen(open);
        const char *end = strstr(p, close);
        if (!end)
            break;
        unsigned char h[32], b64[48];
        size_t n = 0;
        if (md && mbedtls_md(md, (const unsigned char *)p, (size_t)(end - p), h) == 0 &&
            mbedtls_base64_encode(b64, sizeof b64, &n, h, sizeof h) == 0) {
            size_t used = strlen(out);
            snprintf(out + used, cap - used, " 'sha256-%.*s'", (int)n, (const char *)b64);
        }
        p = end;
    }
}

static void make_csp(void)
{
    char script[128] = "", style[128] = "", lstyle[128] = "";
    add_hashes(script, sizeof script, page, "<script>", "</script>");
    add_hashes(style, sizeof style, page, "<style>", "</style>");
    add_hashes(lstyle, sizeof lstyle, login, "<style>", "</style>");
    snprintf(page_csp, sizeof page_csp,
             "default-src 'none'; script-src%s; style-src%s; connect-src 'self'; img-src 'self'; "
             "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
             script, style);
    snprintf(login_csp, sizeof login_csp,
             "default-src 'none'; style-src%s; base-uri 'none'; form-action 'self'; "
             "frame-ancestors 'none'",
             lstyle);
}

const char *sh__admin_page_csp(void)
{
    pthread_once(&csp_once, make_csp);
    return page_csp;
}

const char *sh__admin_page_login_csp(void)
{
    pthread_once(&csp_once, make_csp);
    return login_csp;
}

const char *sh__admin_page_html(size_t *len)
{
    *len = sizeof page - 1;
    return page;
}

const char *sh__admin_page_login_html(size_t *len)
{
    *len = sizeof login - 1;
    return login;
}

bool sh__admin_page_query_key(const char *query, char *out, size_t cap)
{
    for (const char *p = query; p && *p;) {
        const char *end = strchr(p, '&');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n > 4 && !strncmp(p, "key=", 4)) {
            size_t o = 0;
            for (size_t i = 4; i < n; i++) {
                int c = (unsigned char)p[i];
                if (c == '+') {
                    c = ' ';
                } else if (c == '%') {
                    uint8_t byte;
                    if (i + 2 >= n || !sh__auth_unhex(p + i + 1, 2, &byte, 1))
                        return false;
                    c = byte;
                    i += 2;
                }
                // A key is printable text; control bytes (CR, LF, NUL) never reach a header.
                if (c < 0x20 || c == 0x7f || o + 1 >= cap)
                    return false;
                out[o++] = (char)c;
            }
            out[o] = '\0';
            return true;
        }
        p = end ? end + 1 : NULL;
    }
    return false;
}
