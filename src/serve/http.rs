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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest request head (request line + headers) accepted.
pub const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 96;
/// How long a connection may sit idle between requests.
const IDLE: Duration = Duration::from_secs(120);
/// How long an idle connection may stay while the server is crowded (more connections open
/// than `--max-connections`): idle sockets must not keep active clients out.
const IDLE_CROWDED: Duration = Duration::from_secs(1);
/// How long a request head may take from its first byte to its end, however it trickles in.
const HEAD_TIME: Duration = Duration::from_secs(10);
/// A body may take this long plus its length at `BODY_RATE`.
const BODY_TIME: Duration = Duration::from_secs(30);
/// The slowest body accepted, in bytes per second (beyond `BODY_TIME`).
const BODY_RATE: u64 = 64 << 10;
/// Open connections (idle ones included) per `--max-connections`: beyond this many, new
/// connections get 503 even though idle ones are being closed.
pub const OPEN_PER_ACTIVE: usize = 4;
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

/// The server's connection counts. A connection is *active* from the first byte of a
/// request until it waits for the next one; only active connections count against
/// `--max-connections`. Idle ones are closed early while more than that many are open.
#[derive(Debug, Default)]
pub struct Slots {
    pub max_active: usize,
    pub active: AtomicUsize,
    pub open: AtomicUsize,
}

impl Slots {
    pub fn new(max_active: usize) -> Slots {
        Slots {
            max_active,
            ..Slots::default()
        }
    }

    /// Whether a new connection is refused: all active slots taken, or too many open.
    pub fn full(&self) -> bool {
        self.active.load(Ordering::SeqCst) >= self.max_active
            || self.open.load(Ordering::SeqCst) >= self.max_active.saturating_mul(OPEN_PER_ACTIVE)
    }

    fn crowded(&self) -> bool {
        self.open.load(Ordering::SeqCst) > self.max_active
    }
}

/// One client connection.
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Path of the request being read (empty before its head is parsed), for error replies.
    pub path: String,
    slots: Option<Arc<Slots>>,
    /// Counted in `slots.active`.
    busy: bool,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.set_busy(false);
    }
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
            slots: None,
            busy: false,
        })
    }

    /// A connection counted in `slots` (see `Slots`).
    pub fn counted(stream: TcpStream, slots: Arc<Slots>) -> std::io::Result<Conn> {
        let mut c = Conn::new(stream)?;
        c.slots = Some(slots);
        Ok(c)
    }

    /// Mark the connection active or idle. Becoming active when every slot is taken fails.
    fn set_busy(&mut self, busy: bool) -> bool {
        if busy == self.busy {
            return true;
        }
        let Some(slots) = &self.slots else {
            self.busy = busy;
            return true;
        };
        if busy {
            let was = slots.active.fetch_add(1, Ordering::SeqCst);
            if was >= slots.max_active {
                slots.active.fetch_sub(1, Ordering::SeqCst);
                return false;
            }
        } else {
            slots.active.fetch_sub(1, Ordering::SeqCst);
        }
        self.busy = busy;
        true
    }

    /// Read the next request. `max_body`: largest body accepted (413 above it);
    /// `stopping`: when set while idle, give up with `Closed`.
    pub fn read_request(
        &mut self,
        max_body: usize,
        stopping: &AtomicBool,
    ) -> Result<Request, ReadError> {
        self.path.clear();
        let idle_since = Instant::now();
        // When the head's first byte came.
        let mut head_start = None;
        // The head.
        let (head_len, method, path, headers) = loop {
            if self.buf.is_empty() {
                self.set_busy(false);
            } else {
                if head_start.is_none() {
                    head_start = Some(Instant::now());
                    if !self.set_busy(true) {
                        return Err(ReadError::Bad {
                            status: 503,
                            message: "too many active connections (--max-connections)".into(),
                        });
                    }
                }
                let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
                let mut req = httparse::Request::new(&mut hs);
                match req.parse(&self.buf) {
                    Ok(httparse::Status::Complete(n)) if n > MAX_HEAD => {
                        return Err(ReadError::Bad {
                            status: 431,
                            message: format!("request head of {n} bytes is over {MAX_HEAD} bytes"),
                        })
                    }
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
            let deadline = match head_start {
                None => Deadline::Idle(idle_since),
                Some(t) => Deadline::At(t + HEAD_TIME),
            };
            match self.fill(deadline, stopping) {
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
        let len = content_length(&req.headers)?;
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
        let body_deadline = Instant::now() + body_time(len);
        while self.buf.len() < len {
            match self.fill(Deadline::At(body_deadline), stopping) {
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
        let deadline = Deadline::At(Instant::now() + body_time(len));
        loop {
            let take = left.min(self.buf.len());
            self.buf.drain(..take);
            left -= take;
            if left == 0 || !matches!(self.fill(deadline, stopping), Ok(true)) {
                return;
            }
        }
    }

    /// Read more bytes into the buffer. Ok(false): end of stream, or (idle) the server is
    /// stopping or crowded or the idle time is over. A request past its deadline gets 408,
    /// checked after every read, so a peer trickling bytes cannot keep it open.
    fn fill(&mut self, deadline: Deadline, stopping: &AtomicBool) -> Result<bool, ReadError> {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match deadline {
                Deadline::Idle(since) => {
                    let crowded = self.slots.as_ref().is_some_and(|s| s.crowded());
                    let idle = since.elapsed();
                    if stopping.load(Ordering::Relaxed)
                        || idle > IDLE
                        || (crowded && idle > IDLE_CROWDED)
                    {
                        return Ok(false);
                    }
                }
                Deadline::At(t) => {
                    if Instant::now() > t {
                        return Err(ReadError::Bad {
                            status: 408,
                            message: "request took too long to arrive".into(),
                        });
                    }
                }
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
                    ) => {}
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
        self.respond_with(status, content_type, body, keep_alive, &[])
    }

    /// Write a whole response with extra headers (`(name, value)`, written as given).
    pub fn respond_with(
        &mut self,
        status: u16,
        content_type: &str,
        body: &[u8],
        keep_alive: bool,
        headers: &[(&str, String)],
    ) -> std::io::Result<()> {
        let mut head = format!(
            "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n",
            reason(status),
            body.len()
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
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
        peer_closed(&self.stream)
    }

    /// A handle on this client's socket that another thread (the generator, once per step)
    /// can ask `PeerWatch::gone`; None if the socket cannot be shared.
    pub fn watch(&self) -> Option<PeerWatch> {
        self.stream.try_clone().ok().map(PeerWatch)
    }
}

/// A client's socket, watched for a disconnect (see `Conn::watch`).
pub struct PeerWatch(TcpStream);

impl PeerWatch {
    /// As `Conn::peer_gone`.
    pub fn gone(&self) -> bool {
        peer_closed(&self.0)
    }
}

/// The peer closed its side (a read would return end of file) or the socket failed. A
/// one-byte `recv` with `MSG_PEEK | MSG_DONTWAIT`: nothing is consumed, and no flag of the
/// socket (shared with the thread writing to it) changes.
fn peer_closed(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = 0u8;
    // SAFETY: a valid socket descriptor and a one-byte buffer that outlives the call.
    let n = unsafe {
        libc::recv(
            s.as_raw_fd(),
            (&mut b as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match n {
        0 => true,
        n if n > 0 => false,
        _ => {
            let e = std::io::Error::last_os_error();
            !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted)
        }
    }
}

/// How long `fill` may wait.
#[derive(Clone, Copy)]
enum Deadline {
    /// Between requests, idle since then (see `IDLE`, `IDLE_CROWDED`).
    Idle(Instant),
    /// Inside a request: give up with 408 after this.
    At(Instant),
}

/// Time allowed for a body of `len` bytes.
fn body_time(len: usize) -> Duration {
    BODY_TIME + Duration::from_secs(len as u64 / BODY_RATE)
}

/// The body length from the `Content-Length` headers: at most one value (repeats must agree),
/// digits only (no sign, no list), so two parsers of the same bytes cannot disagree on where
/// the body ends.
fn content_length(headers: &[(String, String)]) -> Result<usize, ReadError> {
    let bad = |message: String| ReadError::Bad {
        status: 400,
        message,
    };
    let mut len: Option<usize> = None;
    for (_, v) in headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case("content-length"))
    {
        if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) || v.len() > 19 {
            return Err(bad(format!(
                "bad Content-Length {v:?}: expected digits only"
            )));
        }
        let n: usize = v
            .parse()
            .map_err(|_| bad(format!("bad Content-Length {v:?}")))?;
        if len.is_some_and(|l| l != n) {
            return Err(bad("two different Content-Length headers".to_string()));
        }
        len = Some(n);
    }
    Ok(len.unwrap_or(0))
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
