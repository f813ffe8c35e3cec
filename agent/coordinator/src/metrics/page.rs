//! The status page: read-only HTML rendered here, on the metrics listener. The fleet at a glance
//! (`/`), the nodes table (`/nodes`, filtered, sorted and paged), a set (`/sets/ID`), a run
//! (`/runs/ID`) and the fleet's coordinators (`/coordinators`). Each page holds one server-sent
//! event stream (`/events?view=PAGE`) that sends the page's body again every second, so an open
//! page follows the fleet without a request per row. It reads through the same intents as the CLI
//! (`nodes`, `status`).
use crate::Coordinator;
use crate::nodes::{NodeState, NodeView};
use crate::runs::RunView;
use fleet_proto::clock::now_ms;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

/// Rows on one page of the nodes table.
pub(crate) const PAGE_ROWS: usize = 50;

/// A page that does not exist (404) or a query that does not parse (400), with its line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PageError {
    NotFound(String),
    BadQuery(String),
    Store(String),
}

/// The pages, parsed from a request's target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Page {
    Fleet,
    Nodes(NodeQuery),
    Set(String),
    Run(String),
    Coordinators,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct NodeQuery {
    state: Option<String>,
    arch: Option<String>,
    version: Option<String>,
    /// `key=value`, matched against the node's labels.
    label: Option<(String, String)>,
    sort: NodeSort,
    /// From 1.
    page: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum NodeSort {
    /// The fewest runs out first (idle machines, the ones a pool drains), then the longest unheard.
    #[default]
    Idle,
    /// The longest without a heartbeat first: the ones to look at.
    Heard,
    Joined,
    Name,
}

impl NodeSort {
    fn name(self) -> &'static str {
        match self {
            NodeSort::Idle => "idle",
            NodeSort::Heard => "heard",
            NodeSort::Joined => "joined",
            NodeSort::Name => "name",
        }
    }
}

impl Page {
    /// The page `target` names (path and query), or why none does.
    pub(crate) fn parse(target: &str) -> Result<Page, PageError> {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let pairs = parse_query(query)?;
        let one = |segment: &str| -> Result<String, PageError> {
            let id = percent_decode(segment)?;
            let plain = !id.is_empty()
                && (id.bytes()).all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            match plain {
                true => Ok(id),
                false => Err(PageError::NotFound(format!("no such id: {id:?}"))),
            }
        };
        match path {
            "/" => Ok(Page::Fleet),
            "/nodes" => Ok(Page::Nodes(NodeQuery::from_pairs(pairs)?)),
            "/coordinators" => Ok(Page::Coordinators),
            _ => {
                if let Some(id) = path.strip_prefix("/sets/") {
                    Ok(Page::Set(one(id)?))
                } else if let Some(id) = path.strip_prefix("/runs/") {
                    Ok(Page::Run(one(id)?))
                } else {
                    Err(PageError::NotFound(format!("no page {path}")))
                }
            }
        }
    }
}

impl NodeQuery {
    fn from_pairs(pairs: Vec<(String, String)>) -> Result<NodeQuery, PageError> {
        let mut q = NodeQuery {
            page: 1,
            ..NodeQuery::default()
        };
        for (key, value) in pairs {
            let value = Some(value).filter(|v| !v.is_empty());
            match key.as_str() {
                "state" => q.state = value,
                "arch" => q.arch = value,
                "version" => q.version = value,
                "label" => {
                    q.label = match value {
                        None => None,
                        Some(v) => Some(
                            v.split_once('=')
                                .map(|(k, v)| (k.into(), v.into()))
                                .ok_or_else(|| {
                                    PageError::BadQuery(format!("label={v:?} is not KEY=VALUE"))
                                })?,
                        ),
                    }
                }
                "sort" => {
                    q.sort = match value.as_deref() {
                        None | Some("idle") => NodeSort::Idle,
                        Some("heard") => NodeSort::Heard,
                        Some("joined") => NodeSort::Joined,
                        Some("name") => NodeSort::Name,
                        Some(other) => {
                            return Err(PageError::BadQuery(format!(
                                "sort={other:?}: sort by idle, heard, joined or name"
                            )));
                        }
                    }
                }
                "page" => {
                    q.page = (value.as_deref().unwrap_or("1").parse::<usize>().ok())
                        .filter(|p| *p >= 1)
                        .ok_or_else(|| PageError::BadQuery("page is a number from 1".into()))?;
                }
                other => {
                    return Err(PageError::BadQuery(format!(
                        "unknown parameter {other:?}: filter by state, arch, version or label=KEY=VALUE; sort, page"
                    )));
                }
            }
        }
        Ok(q)
    }

    fn matches(&self, node: &NodeView) -> bool {
        let facts = node.facts.as_ref();
        self.state
            .as_ref()
            .is_none_or(|s| s.eq_ignore_ascii_case(node.state.as_str()))
            && (self.arch.as_ref()).is_none_or(|a| facts.is_some_and(|f| &f.arch == a))
            && (self.version.as_ref()).is_none_or(|v| facts.is_some_and(|f| &f.agent_version == v))
            && (self.label.as_ref()).is_none_or(|(k, v)| node.labels.get(k) == Some(v))
    }

    /// This query with another page (or sort), as a link.
    fn link(&self, page: usize) -> String {
        let mut out = String::from("/nodes?");
        let mut add = |k: &str, v: &str| {
            let _ = write!(out, "{k}={}&", percent_encode(v));
        };
        for (k, v) in [
            ("state", &self.state),
            ("arch", &self.arch),
            ("version", &self.version),
        ] {
            if let Some(v) = v {
                add(k, v);
            }
        }
        if let Some((k, v)) = &self.label {
            add("label", &format!("{k}={v}"));
        }
        add("sort", self.sort.name());
        let _ = write!(out, "page={page}");
        out
    }
}

fn parse_query(query: &str) -> Result<Vec<(String, String)>, PageError> {
    (query.split('&'))
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            Ok((percent_decode(k)?, percent_decode(v)?))
        })
        .collect()
}

fn percent_decode(text: &str) -> Result<String, PageError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok());
                let byte = hex
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| {
                        PageError::BadQuery(format!(
                            "{text:?} has a % not followed by two hex digits"
                        ))
                    })?;
                out.push(byte);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| PageError::BadQuery(format!("{text:?} is not UTF-8")))
}

/// One component of a URL (a query value) as text.
pub(crate) fn decode_component(text: &str) -> Result<String, PageError> {
    percent_decode(text)
}

/// `main` as one server-sent event: a `data:` line per line of it.
pub(crate) fn event_message(main: &str) -> String {
    let mut out = String::with_capacity(main.len() + 16);
    for line in main.split('\n') {
        out.push_str("data: ");
        out.push_str(line.trim_end_matches('\r'));
        out.push('\n');
    }
    out.push('\n');
    out
}

/// Text made safe inside HTML.
pub(crate) fn escape(text: &str) -> String {
    esc(text)
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Text made safe inside HTML elements and attribute values.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// What the fleet page draws beside the store's view: the heartbeat period, and runs ended per
/// minute over the last hour (oldest first).
#[derive(Debug, Clone)]
pub(crate) struct Context {
    pub heartbeat_ms: u64,
    pub ended_per_minute: Vec<u64>,
}

/// The page's `<main>`: what the stream sends again every second.
/// A page's body, and for the nodes table how many pages it has.
#[derive(Debug, Clone)]
pub(crate) struct Rendered {
    pub main: String,
    pub pages: usize,
}

impl From<String> for Rendered {
    fn from(main: String) -> Rendered {
        Rendered { main, pages: 1 }
    }
}

pub(crate) fn render_main(
    coordinator: &Coordinator,
    page: &Page,
    context: &Context,
) -> Result<Rendered, PageError> {
    let store = |e: crate::CoordinatorError| PageError::Store(e.to_string());
    match page {
        Page::Fleet => Ok(fleet(&coordinator.nodes().map_err(store)?, context).into()),
        Page::Nodes(query) => {
            let all = coordinator.nodes().map_err(store)?;
            let active =
                (coordinator.store().active_runs()).map_err(|e| PageError::Store(e.to_string()))?;
            let mut runs_out: HashMap<&str, usize> = HashMap::new();
            for run in &active {
                *runs_out.entry(run.node_id.as_str()).or_default() += 1;
            }
            Ok(nodes(&all, &runs_out, query))
        }
        Page::Set(id) => match coordinator.status(Some(id), None) {
            Ok(rows) => Ok(set(id, &rows).into()),
            Err(crate::CoordinatorError::Request(line)) => Err(PageError::NotFound(line)),
            Err(e) => Err(store(e)),
        },
        Page::Run(id) => match coordinator.status(None, Some(id)) {
            Ok(rows) => Ok(rows.first().map(run).unwrap_or_default().into()),
            Err(crate::CoordinatorError::Request(line)) => Err(PageError::NotFound(line)),
            Err(e) => Err(store(e)),
        },
        Page::Coordinators => {
            let members = coordinator.fleet().members();
            let mut out = String::from(
                "<h1>Coordinators</h1><table id=\"coordinators\"><tr><th>address</th></tr>",
            );
            for m in &members {
                let _ = write!(out, "<tr><td>{}</td></tr>", esc(m));
            }
            if members.is_empty() {
                out.push_str("<tr><td>this coordinator alone</td></tr>");
            }
            out.push_str("</table>");
            Ok(out.into())
        }
    }
}

/// The whole document around `main`, with the one stream that keeps it current.
pub(crate) fn document(page: &Page, view: &str, rendered: &Rendered) -> String {
    // The filter form and the pager stand outside `main`, which the stream replaces: what is
    // typed stays, and a link is never swapped under a click.
    let (form, pager) = match page {
        Page::Nodes(query) => (filter_form(query), pager(query, rendered.pages)),
        _ => (String::new(), String::new()),
    };
    let main = &rendered.main;
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title} · fleet</title>\
<link rel=\"icon\" href=\"data:,\"><meta name=\"viewport\" content=\"width=device-width\">\
<style>{STYLE}</style></head><body><nav><a href=\"/\">fleet</a> <a href=\"/nodes\">nodes</a> \
<a href=\"/coordinators\">coordinators</a> <span id=\"live\">live</span></nav>{form}\
<main data-view=\"{view}\">{main}</main>{pager}<script>{SCRIPT}</script></body></html>",
        title = esc(&title(page)),
        view = esc(view),
    )
}

/// The nodes table's filters and sort as a plain form (a GET of `/nodes`).
fn filter_form(query: &NodeQuery) -> String {
    let select = |name: &str, options: &[&str], chosen: &str| {
        let mut out = format!("<select name=\"{name}\" id=\"filter-{name}\">");
        for option in options {
            let selected = if *option == chosen { " selected" } else { "" };
            let _ = write!(out, "<option{selected}>{option}</option>");
        }
        out.push_str("</select>");
        out
    };
    let text = |name: &str, value: &Option<String>| {
        format!(
            "<input name=\"{name}\" id=\"filter-{name}\" size=\"10\" value=\"{}\">",
            esc(value.as_deref().unwrap_or(""))
        )
    };
    let label = query.label.as_ref().map(|(k, v)| format!("{k}={v}"));
    let sort = query.sort.name();
    format!(
        "<form id=\"filter\" method=\"get\" action=\"/nodes\">state {} arch {} version {} label {} sort {} <button id=\"filter-apply\">filter</button></form>",
        select(
            "state",
            &["", "joined", "lost", "failed"],
            query.state.as_deref().unwrap_or("")
        ),
        text("arch", &query.arch),
        text("version", &query.version),
        text("label", &label),
        select("sort", &["idle", "heard", "joined", "name"], sort),
    )
}

fn title(page: &Page) -> String {
    match page {
        Page::Fleet => "Fleet".into(),
        Page::Nodes(_) => "Nodes".into(),
        Page::Set(id) => format!("Set {id}"),
        Page::Run(id) => format!("Run {id}"),
        Page::Coordinators => "Coordinators".into(),
    }
}

const STYLE: &str = "body{font:14px system-ui,sans-serif;margin:1em 2em;color:#222}form{margin:.5em 0}\
nav a{margin-right:1em}#live{color:#888;font-size:12px}table{border-collapse:collapse;margin:.5em 0}\
td,th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:left}.lost,.failed{color:#b00}\
.Joined{color:#070}.counts span{display:inline-block;margin-right:2em;font-size:18px}\
svg{background:#fafafa;border:1px solid #ddd}pre{background:#f4f4f4;padding:.5em;white-space:pre-wrap}";

/// One stream for the whole page: the server sends the page's body again, the script puts it in
/// when it changed (a link in a page that did not change is never swapped under a click).
const SCRIPT: &str = "(function(){var m=document.querySelector('main');\
var s=new EventSource('/events?view='+encodeURIComponent(m.dataset.view));\
var live=document.getElementById('live');\
var last=null;s.onmessage=function(e){if(e.data!==last){last=e.data;m.innerHTML=e.data;}\
live.textContent='live '+new Date().toLocaleTimeString();};\
s.onerror=function(){live.textContent='reconnecting';};})();";

fn fleet(nodes: &[NodeView], context: &Context) -> String {
    let count = |state: NodeState| nodes.iter().filter(|n| n.state == state).count();
    let mut versions: BTreeMap<&str, usize> = BTreeMap::new();
    for n in nodes.iter().filter(|n| n.state == NodeState::Joined) {
        let v = n
            .facts
            .as_ref()
            .map_or("unknown", |f| f.agent_version.as_str());
        *versions.entry(v).or_default() += 1;
    }
    let mut out = String::from("<h1>Fleet</h1><div class=\"counts\">");
    for (id, label, state) in [
        ("joined", "joined", NodeState::Joined),
        ("lost", "lost", NodeState::Lost),
        ("failed", "failed", NodeState::Failed),
    ] {
        let _ = write!(
            out,
            "<span><a href=\"/nodes?state={label}\">{label}</a> <b id=\"count-{id}\">{}</b></span>",
            count(state)
        );
    }
    out.push_str("</div><h2>Agent versions</h2><table id=\"versions\"><tr><th>version</th><th>joined nodes</th></tr>");
    for (v, n) in &versions {
        let _ = write!(
            out,
            "<tr><td><a href=\"/nodes?version={}\">{}</a></td><td>{n}</td></tr>",
            percent_encode(v),
            esc(v)
        );
    }
    out.push_str("</table><h2>Heartbeat age of joined nodes</h2>");
    out.push_str(&heartbeat_chart(nodes, context.heartbeat_ms.max(1)));
    out.push_str("<h2>Runs ended per minute, last hour</h2>");
    out.push_str(&bars(
        "runs-per-minute",
        &context.ended_per_minute,
        &["-60 min", "now"],
    ));
    out
}

/// Joined nodes counted by how many heartbeat periods ago they were last heard.
fn heartbeat_chart(nodes: &[NodeView], heartbeat_ms: u64) -> String {
    let now = now_ms();
    let mut buckets = [0u64; 5];
    for n in nodes.iter().filter(|n| n.state == NodeState::Joined) {
        let age = now.saturating_sub(n.last_heartbeat_ms.unwrap_or(n.joined_at_ms));
        let periods = age / heartbeat_ms;
        buckets[match periods {
            0 => 0,
            1 => 1,
            2..=3 => 2,
            4..=7 => 3,
            _ => 4,
        }] += 1;
    }
    bars(
        "heartbeat-age",
        &buckets,
        &["< 1 period", "1", "2-3", "4-7", "8+ periods"],
    )
}

/// A bar chart as SVG: one bar a value, `labels` spread under it.
fn bars(id: &str, values: &[u64], labels: &[&str]) -> String {
    let (width, height) = (600.0, 120.0);
    let max = values.iter().copied().max().unwrap_or(0).max(1) as f64;
    let step = width / values.len().max(1) as f64;
    let mut out = format!(
        "<svg id=\"{id}\" width=\"{width}\" height=\"{}\" role=\"img\">",
        height + 20.0
    );
    for (i, v) in values.iter().enumerate() {
        let h = (*v as f64 / max) * height;
        let _ = write!(
            out,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"#4a7\"><title>{v}</title></rect>",
            i as f64 * step + 1.0,
            height - h,
            (step - 2.0).max(1.0)
        );
    }
    // A label under each bar, or labels spread from the left edge to the right one.
    let under_bars = labels.len() == values.len();
    let gap = width / (labels.len().max(2) - 1) as f64;
    for (i, l) in labels.iter().enumerate() {
        let last = !under_bars && i + 1 == labels.len() && i > 0;
        let gap = if under_bars { step } else { gap };
        let _ = write!(
            out,
            "<text x=\"{:.1}\" y=\"{}\" font-size=\"11\" text-anchor=\"{}\">{}</text>",
            if last {
                width - 2.0
            } else {
                i as f64 * gap + 2.0
            },
            height + 15.0,
            if last { "end" } else { "start" },
            esc(l)
        );
    }
    out.push_str("</svg>");
    out
}

fn nodes(all: &[NodeView], runs_out: &HashMap<&str, usize>, query: &NodeQuery) -> Rendered {
    let now = now_ms();
    let mut rows: Vec<&NodeView> = all.iter().filter(|n| query.matches(n)).collect();
    let idle = |n: &NodeView| now.saturating_sub(n.last_heartbeat_ms.unwrap_or(n.joined_at_ms));
    let out_of = |n: &NodeView| runs_out.get(n.id.as_str()).copied().unwrap_or(0);
    match query.sort {
        NodeSort::Idle => rows.sort_by_key(|n| (out_of(n), std::cmp::Reverse(idle(n)))),
        NodeSort::Heard => rows.sort_by_key(|n| std::cmp::Reverse(idle(n))),
        NodeSort::Joined => rows.sort_by_key(|n| n.joined_at_ms),
        NodeSort::Name => rows.sort_by(|a, b| a.name.cmp(&b.name).then(a.id.cmp(&b.id))),
    }
    let pages = rows.len().div_ceil(PAGE_ROWS).max(1);
    let page = query.page.min(pages);
    let mut out = format!(
        "<h1>Nodes</h1><p id=\"matching\">{} of {} nodes match; page {page} of {pages}</p>",
        rows.len(),
        all.len()
    );
    out.push_str("<table id=\"nodes\"><tr><th>id</th><th>name</th><th>state</th><th>arch</th><th>agent</th><th>labels</th><th>runs out</th><th>last heard</th></tr>");
    for n in rows.iter().skip((page - 1) * PAGE_ROWS).take(PAGE_ROWS) {
        let facts = n.facts.as_ref();
        let labels: Vec<String> = (n.labels.iter()).map(|(k, v)| format!("{k}={v}")).collect();
        let _ = write!(
            out,
            "<tr id=\"node-{id}\"><td>{id}</td><td>{name}</td><td class=\"{state}\">{state}</td><td>{arch}</td><td>{version}</td><td>{labels}</td><td>{out}</td><td>{idle}</td></tr>",
            id = esc(&n.id),
            name = esc(n.name.as_deref().unwrap_or("")),
            state = n.state.as_str(),
            arch = esc(facts.map_or("", |f| f.arch.as_str())),
            version = esc(facts.map_or("", |f| f.agent_version.as_str())),
            labels = esc(&labels.join(" ")),
            out = out_of(n),
            idle = match n.last_heartbeat_ms {
                Some(_) => format!("{:.1} s ago", idle(n) as f64 / 1000.0),
                None => "never".into(),
            },
        );
    }
    out.push_str("</table>");
    Rendered { main: out, pages }
}

/// The links to the pages before and after, outside the body the stream replaces (a click on
/// them never meets a link that was just swapped).
fn pager(query: &NodeQuery, pages: usize) -> String {
    let page = query.page.min(pages);
    let mut out = String::from("<p id=\"pager\">");
    if page > 1 {
        let _ = write!(
            out,
            "<a id=\"prev\" href=\"{}\">previous</a> ",
            esc(&query.link(page - 1))
        );
    }
    if page < pages {
        let _ = write!(
            out,
            "<a id=\"next\" href=\"{}\">next</a>",
            esc(&query.link(page + 1))
        );
    }
    out.push_str("</p>");
    out
}

fn set(id: &str, rows: &[RunView]) -> String {
    let mut out = format!(
        "<h1>Set {}</h1><table id=\"runs\"><tr><th>run</th><th>node</th><th>state</th><th>exit</th><th>error</th></tr>",
        esc(id)
    );
    for r in rows {
        let exit = (r.outcome.as_ref())
            .and_then(|o| o.exit_code)
            .map(|c| c.to_string());
        let _ = write!(
            out,
            "<tr><td><a href=\"/runs/{run}\">{run}</a></td><td>{node}</td><td class=\"{state}\">{state}</td><td>{exit}</td><td>{error}</td></tr>",
            run = esc(r.run_id.as_str()),
            node = esc(r.node_id.as_str()),
            state = r.state,
            exit = exit.unwrap_or_default(),
            error = esc(r.error.as_deref().unwrap_or("")),
        );
    }
    out.push_str("</table>");
    out
}

fn run(r: &RunView) -> String {
    let mut out = format!(
        "<h1>Run {id}</h1><table id=\"run\"><tr><th>set</th><td><a href=\"/sets/{set}\">{set}</a></td></tr>\
<tr><th>node</th><td>{node}</td></tr><tr><th>state</th><td id=\"run-state\" class=\"{state}\">{state}</td></tr>",
        id = esc(r.run_id.as_str()),
        set = esc(r.set_id.as_str()),
        node = esc(r.node_id.as_str()),
        state = r.state,
    );
    if let Some(o) = &r.outcome {
        let fields = [
            ("exit code", o.exit_code.map(|c| c.to_string())),
            ("signal", o.signal.map(|s| s.to_string())),
            ("timed out", Some(o.timed_out.to_string())),
            ("stopped", Some(o.stopped.to_string())),
            ("started", o.started_at.clone()),
            ("ended", o.ended_at.clone()),
        ];
        for (name, value) in fields {
            if let Some(v) = value {
                let _ = write!(out, "<tr><th>{name}</th><td>{}</td></tr>", esc(&v));
            }
        }
    }
    if let Some(e) = &r.error {
        let _ = write!(out, "<tr><th>error</th><td>{}</td></tr>", esc(e));
    }
    out.push_str("</table>");
    if let Some(o) = &r.outcome {
        for (name, end) in [("stdout", &o.stdout), ("stderr", &o.stderr)] {
            if let Some(end) = end {
                let _ = write!(
                    out,
                    "<h2>{name}: {} bytes, the last {} kept</h2><pre id=\"{name}\">{}</pre>",
                    end.bytes,
                    end.last.0.len(),
                    esc(&String::from_utf8_lossy(&end.last.0))
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_parse_and_garbage_is_a_bad_query_never_a_panic() {
        assert_eq!(Page::parse("/"), Ok(Page::Fleet));
        let Ok(Page::Nodes(q)) = Page::parse("/nodes?state=lost&label=pool%3Dlab&page=2&sort=name")
        else {
            panic!("a nodes page");
        };
        assert_eq!(q.state.as_deref(), Some("lost"));
        assert_eq!(q.label, Some(("pool".into(), "lab".into())));
        assert_eq!((q.page, q.sort), (2, NodeSort::Name));
        assert_eq!(
            Page::parse(&q.link(3)).map(|p| matches!(p, Page::Nodes(n) if n.page == 3)),
            Ok(true)
        );
        for garbage in [
            "/nodes?state=%zz",
            "/nodes?page=0",
            "/nodes?page=x",
            "/nodes?sort=up",
            "/nodes?x=1",
            "/nodes?label=nokey",
            "/nodes?state=%ff",
        ] {
            assert!(
                matches!(Page::parse(garbage), Err(PageError::BadQuery(_))),
                "{garbage}"
            );
        }
        assert!(matches!(
            Page::parse("/sets/../x"),
            Err(PageError::NotFound(_))
        ));
        assert!(matches!(Page::parse("/nope"), Err(PageError::NotFound(_))));
        assert_eq!(Page::parse("/runs/r-1"), Ok(Page::Run("r-1".into())));
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }
}
