//! A small WebDriver client for Debian's `chromium` through `chromium-driver`: the W3C protocol's
//! JSON over HTTP, enough to open pages, read elements, run a script, take a screenshot and read
//! the browser's console log.
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A headless chromium session, ended (and its driver killed) when dropped.
pub struct Browser {
    driver: Child,
    addr: String,
    session: String,
}

/// One HTTP/1.1 request with a JSON body; returns (status, body).
pub fn http_json(addr: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    // The driver may keep the connection open: the answer ends where its length says.
    let mut answer = Vec::new();
    let mut buf = [0u8; 8192];
    let body_at = loop {
        if let Some(at) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "{addr} closed before its answer's head");
        answer.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&answer[..body_at]).to_string();
    let length = (head.lines())
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok());
    loop {
        let have = answer.len() - body_at;
        let complete = match length {
            Some(length) => have >= length,
            None => answer.ends_with(b"0\r\n\r\n"),
        };
        if complete {
            break;
        }
        let n = stream.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
    }
    let body = String::from_utf8_lossy(&answer[body_at..]).to_string();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = decode_chunked(&head, &body);
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// The body as sent, undoing `transfer-encoding: chunked` when the head says so.
fn decode_chunked(head: &str, body: &str) -> String {
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return body.to_string();
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        out.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
    out
}

impl Browser {
    /// Starts `chromedriver` on a free port and a headless chromium session (console logged).
    pub fn start(dir: &Path) -> Browser {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let log = std::fs::File::create(dir.join("chromedriver.log")).unwrap();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("Debian's chromium-driver is installed (cargo xtask ci installs it)");
        let addr = format!("127.0.0.1:{port}");
        let up = crate::agent::wait_until(Duration::from_secs(30), || {
            TcpStream::connect(&addr).is_ok() && http_json(&addr, "GET", "/status", None).0 == 200
        });
        assert!(up, "chromedriver never answered");
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,1000"]
            },
            "goog:loggingPrefs": {"browser": "ALL"}
        }}});
        let (status, answer) = http_json(&addr, "POST", "/session", Some(&capabilities));
        assert_eq!(status, 200, "no browser session: {answer}");
        let session = answer["value"]["sessionId"].as_str().unwrap().to_string();
        Browser {
            driver,
            addr,
            session,
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let path = format!("/session/{}{path}", self.session);
        let (status, answer) = http_json(&self.addr, method, &path, body.as_ref());
        assert_eq!(status, 200, "{method} {path}: {answer}");
        answer["value"].clone()
    }

    pub fn goto(&self, url: &str) {
        self.call("POST", "/url", Some(json!({ "url": url })));
    }

    pub fn url(&self) -> String {
        self.call("GET", "/url", None)
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Runs `script` (a function body; `arguments` holds `args`) and returns what it returns.
    pub fn run(&self, script: &str, args: Value) -> Value {
        self.call(
            "POST",
            "/execute/sync",
            Some(json!({ "script": script, "args": args })),
        )
    }

    /// The text of the first element `css` selects, or None when none does.
    pub fn text(&self, css: &str) -> Option<String> {
        let script = "var e=document.querySelector(arguments[0]);return e?e.textContent:null;";
        self.run(script, json!([css])).as_str().map(str::to_string)
    }

    /// How many elements `css` selects.
    pub fn count(&self, css: &str) -> usize {
        let script = "return document.querySelectorAll(arguments[0]).length;";
        self.run(script, json!([css])).as_u64().unwrap_or(0) as usize
    }

    /// The WebDriver id of the first element `css` selects.
    fn element(&self, css: &str) -> String {
        let found = self.call(
            "POST",
            "/element",
            Some(json!({ "using": "css selector", "value": css })),
        );
        found
            .as_object()
            .and_then(|o| o.values().next())
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no element {css}"))
            .to_string()
    }

    /// Clicks the first element `css` selects. An element the page replaced between the find and
    /// the click (a stale reference) is found again, as a person's next try would.
    pub fn click(&self, css: &str) {
        for _ in 0..5 {
            let id = self.element(css);
            let path = format!("/session/{}/element/{id}/click", self.session);
            let (status, answer) = http_json(&self.addr, "POST", &path, Some(&json!({})));
            match status {
                200 => return,
                _ if answer["value"]["error"] == "stale element reference" => continue,
                _ => panic!("clicking {css}: {answer}"),
            }
        }
        panic!("{css} went stale five times in a row");
    }

    /// Types `text` into the first element `css` selects, as a person would.
    pub fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css);
        self.call(
            "POST",
            &format!("/element/{id}/value"),
            Some(json!({ "text": text })),
        );
    }

    /// The browser's console entries since the last call (level, message).
    pub fn console(&self) -> Vec<Value> {
        let log = self.call("POST", "/se/log", Some(json!({ "type": "browser" })));
        log.as_array().cloned().unwrap_or_default()
    }

    /// A PNG of the window.
    pub fn screenshot(&self, to: &Path) {
        use base64::Engine as _;
        let png = self.call("GET", "/screenshot", None);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap())
            .unwrap();
        std::fs::write(to, bytes).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let path = format!("/session/{}", self.session);
        let _ = std::panic::catch_unwind(|| http_json(&self.addr, "DELETE", &path, None));
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
