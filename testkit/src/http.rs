//! A small HTTP/1.1 client for the tests and benches that drive a real server on loopback
//! (`pvisor-sandboxd`): one request per connection (`Connection: close`), the whole answer
//! read and unframed (chunked or not), and, for a streamed answer, when a given piece of it
//! first arrived (a command's first output); and tiny origin servers for the tests whose
//! VMs download or read an image ([`serve_body`], [`serve_dir`], [`read_head`]).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Spawns a server by `command` (its stderr set by the caller to the file `log`), and waits for
/// the readiness line it prints on stdout, one JSON object with its address under `listen`
/// (`pvisor-sandboxd`'s): the child and that address. A server that prints no such line is
/// killed (not left running behind a failed test or bench), and the error holds what it
/// printed and its log.
pub fn spawn_listening(
    command: &mut std::process::Command,
    log: &std::path::Path,
) -> Result<(std::process::Child, String), String> {
    use std::io::BufRead;
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the server: {e}"))?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = std::io::BufReader::new(out).read_line(&mut line);
    }
    let ready: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
    match ready["listen"].as_str() {
        Some(addr) => Ok((child, addr.to_owned())),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(log).unwrap_or_default();
            Err(format!("the server did not start: {line}{log}"))
        }
    }
}

/// How long a read may wait for the server.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// An HTTP answer.
#[derive(Debug)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The headers, as sent.
    pub headers: Vec<(String, String)>,
    /// The body, unframed.
    pub body: Vec<u8>,
}

impl Answer {
    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON (panics if it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{} is not JSON: {e}", self.text()))
    }

    /// The first header `name` (any case).
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    }

    /// The error body's code, checking it is `{code, message}` (panics if not).
    pub fn code(&self) -> String {
        let body = self.json();
        assert!(body["message"].is_string(), "{body}");
        body["code"].as_str().unwrap_or_default().to_owned()
    }
}

/// The bytes of a request (`Connection: close`; a body is sent as JSON).
pub fn raw_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Vec<u8> {
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(body) = body {
        raw.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    raw.push_str("\r\n");
    raw.push_str(body.unwrap_or(""));
    raw.into_bytes()
}

/// Sends one request and reads the whole answer (panics on a failure, as a test wants).
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Answer {
    send_raw(addr, &raw_request(addr, method, path, headers, body))
}

/// Sends `raw` and reads the answer (panics on a failure).
pub fn send_raw(addr: &str, raw: &[u8]) -> Answer {
    timed(addr, raw, b"")
        .map(|(answer, _)| answer)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Sends `raw`, reads the whole answer, and says how long after the request was written the
/// bytes `needle` first arrived (`None`: never, or `needle` is empty).
pub fn timed(addr: &str, raw: &[u8], needle: &[u8]) -> Result<(Answer, Option<Duration>), String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connect to {addr}: {e}"))?;
    stream
        .set_read_timeout(Some(READ_TIMEOUT))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(raw)
        .map_err(|e| format!("write to {addr}: {e}"))?;
    let sent = Instant::now();
    let mut seen = None;
    let mut bytes = Vec::new();
    // A server that answers before reading all of a body may reset the connection after.
    let mut chunk = [0u8; 16 << 10];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                // Only the new bytes and the needle's length before them need a look.
                let from = bytes.len().saturating_sub(needle.len());
                bytes.extend_from_slice(&chunk[..n]);
                if seen.is_none()
                    && !needle.is_empty()
                    && bytes[from..].windows(needle.len()).any(|w| w == needle)
                {
                    seen = Some(sent.elapsed());
                }
            }
            Err(e) if !bytes.is_empty() && e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => return Err(format!("reading the answer from {addr}: {e}")),
        }
    }
    Ok((parse(&bytes)?, seen))
}

/// An answer's status, headers and unframed body.
fn parse(bytes: &[u8]) -> Result<Answer, String> {
    let bad = |why: &str| format!("{why} in {:?}", String::from_utf8_lossy(bytes));
    let end = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no header end"))?;
    let head = String::from_utf8_lossy(&bytes[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no status"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut body = bytes[end + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        loop {
            let line_end = rest
                .windows(2)
                .position(|w| w == b"\r\n")
                .ok_or_else(|| bad("a chunk without its size line"))?;
            let size_text = String::from_utf8_lossy(&rest[..line_end]).into_owned();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| bad("a chunk size that is not hex"))?;
            rest = &rest[line_end + 2..];
            if size == 0 {
                break;
            }
            let data = rest.get(..size).ok_or_else(|| bad("a short chunk"))?;
            out.extend_from_slice(data);
            rest = rest.get(size + 2..).unwrap_or_default();
        }
        body = out;
    }
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// The JSON `data:` of each server-sent event of `text` (panics on one that is not JSON).
pub fn events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|frame| {
            let data: Vec<&str> = frame
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect();
            (!data.is_empty()).then(|| {
                serde_json::from_str(&data.join("\n"))
                    .unwrap_or_else(|e| panic!("event {data:?} is not JSON: {e}"))
            })
        })
        .collect()
}

/// Reads a request's head (request line and headers, up to the blank line or the end) from
/// `stream`; its path (empty if there is none).
pub fn read_head(stream: &TcpStream) -> String {
    use std::io::BufRead;
    let Ok(clone) = stream.try_clone() else {
        return String::new();
    };
    let mut reader = std::io::BufReader::new(clone);
    let mut line = String::new();
    let _ = reader.read_line(&mut line);
    let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
            return path;
        }
    }
}

/// An HTTP/1.1 origin on a thread of its own that answers every request, one at a time, with
/// `body`, its length announced; with `pause` `(at, for)`, the first `at` bytes, then the rest
/// `for` later. Its `http://127.0.0.1:PORT`.
pub fn serve_body(body: Vec<u8>, pause: Option<(usize, Duration)>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let url = format!("http://{}", listener.local_addr().expect("bound"));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            read_head(&stream);
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
            let _ = stream.write_all(head.as_bytes());
            let (at, wait) = pause.unwrap_or((body.len(), Duration::ZERO));
            let at = at.min(body.len());
            let _ = stream.write_all(&body[..at]);
            std::thread::sleep(wait);
            let _ = stream.write_all(&body[at..]);
        }
    });
    url
}

/// An HTTP/1.1 file server on a thread of its own for the files under `root`, one request at a
/// time: `GET /PATH` (`%XX` escapes decoded) answers the regular file at `root/PATH`, anything
/// else 404. Its `http://127.0.0.1:PORT` and the count of files it has served.
pub fn serve_dir(
    root: std::path::PathBuf,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let url = format!("http://{}", listener.local_addr().expect("bound"));
    let served = std::sync::Arc::new(AtomicU64::new(0));
    let counter = std::sync::Arc::clone(&served);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let path = percent_decoded(&read_head(&stream));
            let plain = path.split('/').skip(1).all(|c| !c.is_empty() && c != "..");
            let body = path
                .strip_prefix('/')
                .filter(|_| plain)
                .and_then(|p| std::fs::read(root.join(p)).ok());
            let Some(body) = body else {
                let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n");
                continue;
            };
            counter.fetch_add(1, Ordering::Relaxed);
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body);
        }
    });
    (url, served)
}

/// `path` with its `%XX` escapes decoded (bytes that are not UTF-8 replaced).
fn percent_decoded(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunked_answer_is_unframed_and_a_broken_one_is_an_error() {
        let answer = parse(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(
            (answer.status, answer.text().as_str()),
            (200, "hello world")
        );
        assert!(parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nhi").is_err());
        assert!(parse(b"garbage").is_err());
        let sse = "data: {\"type\":\"init\"}\n\ndata: {\"type\":\"stdout\",\"text\":\"x\"}\n\n";
        assert_eq!(events(sse)[1]["type"], "stdout");
    }
}
