//! A small HTTP/1.1 layer over one `TcpStream`: read a request (head parsed by `httparse`,
//! body by `Content-Length`), write a whole response or a chunked stream, and tell whether
//! the peer has gone away.
//!
//! Owns: the socket of one connection, its read buffer and the limits (head size, body size,
//! idle time). Does not own: routing or JSON (mod.rs, openai.rs, anthropic.rs).
//! Invariant: nothing read from the socket can panic or make it allocate more than the head
//! limit plus the body limit; a body over the limit is refused from its `Content-Length`
//! before it is read.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Longest request head (request line + headers) accepted.
pub const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 96;
/// How long a connection may sit idle between requests.
const IDLE: Duration = Duration::from_secs(120);
/// How long a started request may take to arrive.
const ARRIVAL: Duration = Duration::from_secs(60);
/// Read timeout of the socket, so the reader can look at the shutdown flag.
const POLL: Duration = Duration::from_millis(200);
/// An oversized body up to this size is read and dropped before the 413 goes out.
const DRAIN_LIMIT: usize = 256 << 20;

/// One parsed request.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    /// Path without the query string.
    pub path: String,
    headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The client wants the connection kept open after the response.
    pub keep_alive: bool,
}

impl Request {
    /// Value of a header (name case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Why no request came out of the socket.
#[derive(Debug)]
pub enum ReadError {
    /// The peer closed the connection (or it idled out, or the server is stopping) between
    /// requests: nothing to answer.
    Closed,
    /// A request that cannot be served; answer with this status and message, then close.
    Bad { status: u16, message: String },
}

/// One client connection.
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Path of the request being read (empty before its head is parsed), for error replies.
    pub path: String,
}

impl Conn {
    pub fn new(stream: TcpStream) -> std::io::Result<Conn> {
        stream.set_read_timeout(Some(POLL))?;
        stream.set_write_timeout(Some(Duration::from_secs(30)))?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            stream,
            buf: Vec::with_capacity(8192),
            path: String::new(),
        })
    }

    /// Read the next request. `max_body`: largest body accepted (413 above it);
    /// `stopping`: when set while idle, give up with `Closed`.
    pub fn read_request(
        &mut self,
        max_body: usize,
        stopping: &AtomicBool,
    ) -> Result<Request, ReadError> {
        let start = Instant::now();
        self.path.clear();
        // The head.
        let (head_len, method, path, headers) = loop {
            if !self.buf.is_empty() {
                let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
                let mut req = httparse::Request::new(&mut hs);
                match req.parse(&self.buf) {
                    Ok(httparse::Status::Complete(n)) => {
                        let method = req.method.unwrap_or("").to_string();
                        let target = req.path.unwrap_or("/");
                        let path = target.split('?').next().unwrap_or("/").to_string();
                        let version = req.version.unwrap_or(1);
                        let mut headers: Vec<(String, String)> = req
                            .headers
                            .iter()
                            .map(|h| {
                                (
                                    h.name.to_string(),
                                    String::from_utf8_lossy(h.value).trim().to_string(),
                                )
                            })
                            .collect();
                        headers.push((":version".into(), version.to_string()));
                        break (n, method, path, headers);
                    }
                    Ok(httparse::Status::Partial) => {}
                    Err(httparse::Error::TooManyHeaders) => {
                        return Err(ReadError::Bad {
                            status: 431,
                            message: format!("more than {MAX_HEADERS} request headers"),
                        })
                    }
                    Err(e) => {
                        return Err(ReadError::Bad {
                            status: 400,
                            message: format!("malformed HTTP request: {e}"),
                        })
                    }
                }
                if self.buf.len() > MAX_HEAD {
                    return Err(ReadError::Bad {
                        status: 431,
                        message: format!("request head over {MAX_HEAD} bytes"),
                    });
                }
            }
            let limit = if self.buf.is_empty() { IDLE } else { ARRIVAL };
            match self.fill(self.buf.is_empty(), start, limit, stopping) {
                Ok(true) => {}
                Ok(false) if self.buf.is_empty() => return Err(ReadError::Closed),
                Ok(false) => {
                    return Err(ReadError::Bad {
                        status: 400,
                        message: "connection closed inside the request head".into(),
                    })
                }
                Err(e) => return Err(e),
            }
        };
        self.path.clone_from(&path);
        let mut req = Request {
            method,
            path,
            headers,
            body: Vec::new(),
            keep_alive: true,
        };
        let http10 = req.header(":version") == Some("0");
        let conn = req
            .header("connection")
            .map(|v| v.to_ascii_lowercase())
            .unwrap_or_default();
        req.keep_alive = if http10 {
            conn.contains("keep-alive")
        } else {
            !conn.contains("close")
        };
        self.buf.drain(..head_len);

        if req
            .header("transfer-encoding")
            .is_some_and(|v| !v.eq_ignore_ascii_case("identity"))
        {
            return Err(ReadError::Bad {
                status: 411,
                message: "chunked request bodies are not accepted: send Content-Length".into(),
            });
        }
        let len = match req.header("content-length") {
            None => 0,
            Some(v) => v.parse::<usize>().map_err(|_| ReadError::Bad {
                status: 400,
                message: format!("bad Content-Length {v:?}"),
            })?,
        };
        if len > max_body {
            // Read and drop the body first: a client still sending would otherwise see the
            // connection reset instead of the answer.
            let waits = req
                .header("expect")
                .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
            if len <= DRAIN_LIMIT && !waits {
                self.drain(len, stopping);
            }
            return Err(ReadError::Bad { status: 413, message: format!("request body of {len} bytes is over the limit of {max_body} bytes (--max-body)") });
        }
        if len > 0
            && req
                .header("expect")
                .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"))
        {
            let _ = self.stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
        }
        let body_start = Instant::now();
        while self.buf.len() < len {
            match self.fill(false, body_start, ARRIVAL, stopping) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(ReadError::Bad {
                        status: 400,
                        message: format!(
                            "connection closed after {} of {len} body bytes",
                            self.buf.len()
                        ),
                    })
                }
                Err(e) => return Err(e),
            }
        }
        req.body = self.buf.drain(..len).collect();
        Ok(req)
    }

    /// Read and discard `len` bytes of body (what is buffered counts).
    fn drain(&mut self, len: usize, stopping: &AtomicBool) {
        let mut left = len;
        let start = Instant::now();
        loop {
            let take = left.min(self.buf.len());
            self.buf.drain(..take);
            left -= take;
            if left == 0 || !matches!(self.fill(false, start, ARRIVAL, stopping), Ok(true)) {
                return;
            }
        }
    }

    /// Read more bytes into the buffer. Ok(false): end of stream (or stop requested while
    /// `idle_stop`). Times out after `limit` from `since`.
    fn fill(
        &mut self,
        idle_stop: bool,
        since: Instant,
        limit: Duration,
        stopping: &AtomicBool,
    ) -> Result<bool, ReadError> {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            if idle_stop && stopping.load(Ordering::Relaxed) {
                return Ok(false);
            }
            match self.stream.read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(true);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) =>
                {
                    if since.elapsed() > limit {
                        return if self.buf.is_empty() {
                            Ok(false)
                        } else {
                            Err(ReadError::Bad {
                                status: 408,
                                message: "request took too long to arrive".into(),
                            })
                        };
                    }
                }
                Err(_) => return Ok(false),
            }
        }
    }

    /// Write a whole response.
    pub fn respond(
        &mut self,
        status: u16,
        content_type: &str,
        body: &[u8],
        keep_alive: bool,
    ) -> std::io::Result<()> {
        let mut head = format!(
            "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n",
            reason(status),
            body.len()
        );
        if !keep_alive {
            head.push_str("Connection: close\r\n");
        }
        head.push_str("\r\n");
        let mut out = Vec::with_capacity(head.len() + body.len());
        out.extend_from_slice(head.as_bytes());
        out.extend_from_slice(body);
        self.stream.write_all(&out)?;
        self.stream.flush()
    }

    /// Start a chunked response (server-sent events); follow with `chunk` and `end_chunks`.
    pub fn start_chunks(&mut self, status: u16, content_type: &str) -> std::io::Result<()> {
        let head = format!(
            "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n",
            reason(status)
        );
        self.stream.write_all(head.as_bytes())?;
        self.stream.flush()
    }

    /// One chunk of a chunked response, flushed at once.
    pub fn chunk(&mut self, data: &[u8]) -> std::io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut out = Vec::with_capacity(data.len() + 16);
        out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
        self.stream.write_all(&out)?;
        self.stream.flush()
    }

    pub fn end_chunks(&mut self) -> std::io::Result<()> {
        self.stream.write_all(b"0\r\n\r\n")?;
        self.stream.flush()
    }

    /// True when the peer has closed its side or the socket failed (a disconnect). Looks
    /// without blocking and without consuming anything it may have sent.
    pub fn peer_gone(&self) -> bool {
        if self.stream.set_nonblocking(true).is_err() {
            return true;
        }
        let mut b = [0u8; 1];
        let gone = match self.stream.peek(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
        };
        let _ = self.stream.set_nonblocking(false);
        gone
    }
}

pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Payload Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}
