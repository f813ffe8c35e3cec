//! An artifact read through an external HTTP URL (an object store's presigned URL, say): one GET
//! asking for the bytes from the offset already held, its body streamed into
//! [`crate::content::land`]. The URL is the whole credential and is never logged.
use fleet_proto::Digest;
use fleet_proto::content::ContentError;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

const CONNECT: Duration = Duration::from_secs(10);
/// The answer's status line and headers, at most.
const MAX_HEAD: usize = 16 << 10;

/// Asks `url` for the content from `offset`; gives the body, the whole size and the offset the
/// body starts at (0 when the server answers the whole content). Refused once `deadline` passed.
pub async fn open(
    url: &str,
    digest: &Digest,
    offset: u64,
    deadline: Instant,
) -> Result<(BufReader<TcpStream>, u64, u64), ContentError> {
    let failed = |reason: String| ContentError::Failed {
        digest: digest.clone(),
        reason,
    };
    let cut = |cause: String| ContentError::Cut {
        digest: digest.clone(),
        got: offset,
        size: 0,
        cause,
    };
    if Instant::now() >= deadline {
        return Err(failed(
            "its URL read expired before the copy began; mint a new one".into(),
        ));
    }
    let rest = if let Some(rest) = url.strip_prefix("http://") {
        rest
    } else if url.starts_with("https://") {
        return Err(failed(
            "https URLs are not supported by this agent yet; serve it over http or through a coordinator ticket".into(),
        ));
    } else {
        return Err(failed("its URL is not http://HOST[:PORT]/PATH".into()));
    };
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let address = if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:80")
    };
    let mut stream = tokio::time::timeout(CONNECT, TcpStream::connect(&address))
        .await
        .map_err(|_| cut(format!("connecting to {host} timed out")))?
        .map_err(|e| cut(format!("cannot reach {host}: {e}")))?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nRange: bytes={offset}-\r\nConnection: close\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| cut(e.to_string()))?;
    let mut reader = BufReader::new(stream);
    let mut head = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader
            .read_line(&mut line)
            .await
            .map_err(|e| cut(e.to_string()))?;
        if n == 0 {
            return Err(cut(
                "the server closed the connection before answering".into()
            ));
        }
        if line == "\r\n" || line == "\n" {
            break;
        }
        head.push(line.trim_end().to_string());
        if head.iter().map(String::len).sum::<usize>() > MAX_HEAD {
            return Err(failed(format!(
                "{host} answered with over {MAX_HEAD} bytes of headers"
            )));
        }
    }
    let status: u16 = head
        .first()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| failed(format!("{host} did not answer HTTP")))?;
    let header = |name: &str| {
        head.iter().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let length = || {
        header("content-length")
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| failed(format!("{host} sent no Content-Length")))
    };
    match status {
        200 => Ok((reader, length()?, 0)),
        206 => {
            // Content-Range: bytes FROM-TO/SIZE
            let range = header("content-range").unwrap_or_default();
            let parsed = range.strip_prefix("bytes ").and_then(|r| {
                let (span, size) = r.split_once('/')?;
                let (from, _) = span.split_once('-')?;
                Some((from.parse::<u64>().ok()?, size.parse::<u64>().ok()?))
            });
            let (from, size) = parsed.ok_or_else(|| {
                failed(format!(
                    "{host} sent a partial answer without a usable Content-Range"
                ))
            })?;
            Ok((reader, size, from))
        }
        code => Err(failed(format!(
            "the URL answered HTTP {code}; the read may be expired or wrong, mint a new one"
        ))),
    }
}
