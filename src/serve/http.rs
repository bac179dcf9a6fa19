//! The HTTP/1.1 layer: hyper's server connections over tokio sockets (keep-alive, pipelining,
//! chunked request bodies, `Expect: 100-continue`), with this server's limits and timeouts
//! around them, and the bridge from hyper's async world to the blocking handlers.
//!
//! Why hyper (not axum): the server has eight fixed routes matched in one `match`
//! (mod.rs `route`), and everything it needs beyond HTTP itself is per connection (the
//! active/idle accounting of `--max-connections`, the head and idle timers): hyper's
//! connection API gives exactly that, axum's router and extractors would sit unused on top.
//!
//! Threads: tokio's runtime (two workers) owns every socket; an idle, slow or trickling client
//! costs a task and a timer, never a thread. A request, once its body is in, is handed to
//! `Service::handle` on tokio's blocking pool (the handlers render templates, tokenize and
//! wait on the generator); it answers through a `Conn`: a whole response through a one-shot
//! channel, or a server-sent-event stream whose body is an unbounded channel hyper drains at
//! the client's pace (a slow reader holds memory for its own tokens, never the handler).
//!
//! Owns: accepting, per-connection state (`Phase`) and its timers, the request body and its
//! limits, the response body. Does not own: routing, JSON, the error shapes (mod.rs,
//! openai.rs, anthropic.rs).
//! Invariant: a client that goes away (a closed or half-closed socket, a dropped stream) sets
//! its request's `PeerWatch`, which the handler and the generator (before every step) look
//! at, so its generation is cancelled within one step.

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CACHE_CONTROL, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, EXPECT};
use hyper::{Response, StatusCode, Version};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot};

/// Longest request head (request line + headers) accepted (431 above).
pub const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 96;
/// How long a connection may sit idle between requests.
const IDLE: Duration = Duration::from_secs(120);
/// How long an idle connection may stay while the server is crowded (more connections open
/// than `--max-connections`): idle sockets must not keep active clients out.
const IDLE_CROWDED: Duration = Duration::from_secs(1);
/// How long a request head may take from its first byte to its end, however it trickles in
/// (`--head-timeout`).
pub const HEAD_TIME: Duration = Duration::from_secs(10);
/// A body's grace (`--body-timeout`): at any moment since its head ended, a body may have
/// taken this long plus the time its bytes so far need at `BODY_RATE`.
pub const BODY_TIME: Duration = Duration::from_secs(30);
/// The slowest body accepted beyond its grace, in bytes per second: each byte that arrives
/// earns `1 / BODY_RATE` s more, so a trickle below the rate runs out of time after about the
/// grace, whatever length it declared.
const BODY_RATE: u64 = 64 << 10;
/// Open connections (idle ones included) per `--max-connections`: beyond this many, new
/// connections get 503 even though idle ones are being closed.
pub const OPEN_PER_ACTIVE: usize = 4;
/// How often a connection's timers are looked at.
const TICK: Duration = Duration::from_millis(250);
/// An oversized body up to this size is read and dropped before the 413 goes out.
const DRAIN_LIMIT: usize = 256 << 20;

/// One request, its body read.
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

/// The server's client timeouts (`--head-timeout`, `--body-timeout`).
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// A head, from its first byte to its end.
    pub head: Duration,
    /// A body's grace (see `BODY_TIME`).
    pub body: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            head: HEAD_TIME,
            body: BODY_TIME,
        }
    }
}

/// A request refused before its handler: answer with this status and message, then close.
#[derive(Debug)]
pub struct Refusal {
    /// The request's path ("-" when unknown), for the error shape and the log.
    pub path: String,
    pub status: u16,
    pub message: String,
}

/// What the HTTP layer calls.
pub(crate) trait Service: Send + Sync + 'static {
    /// The server is stopping: idle connections close, replies say `Connection: close`.
    fn stopping(&self) -> bool;
    /// Largest request body accepted (413 above it).
    fn max_body(&self) -> usize;
    /// How long a head and a body may take.
    fn timeouts(&self) -> Timeouts;
    /// Answer one request (or a refusal) through `conn`. Runs on a blocking thread, or on the
    /// runtime's own thread when `quick` says so.
    fn handle(&self, req: Result<Request, Refusal>, conn: Conn);
    /// The request is answered at once, without waiting on anything (`/health`, `/metrics`):
    /// no hand-over to the blocking pool.
    fn quick(&self, req: &Request) -> bool;
    /// A refusal this layer wrote itself (the head timeout's 408): count and log it.
    fn refused(&self, r: &Refusal);
}

/// The server's connection counts. A connection is *active* from the end of a request's head
/// until its response has gone out; only active connections count against
/// `--max-connections`. A head still arriving does not count (clients trickling heads cannot
/// take the slots; `HEAD_TIME` ends them); idle ones are closed early while more than that many
/// are open.
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

/// Where a connection is.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Between requests, since then.
    Idle(Instant),
    /// A request head has been arriving since then.
    Head(Instant),
    /// A request is being read or answered.
    Request,
}

/// One connection's phase and its active slot.
struct ConnState {
    slots: Arc<Slots>,
    track: Mutex<Track>,
    /// The connection's socket (owned by its hyper connection).
    fd: std::os::fd::RawFd,
}

struct Track {
    phase: Phase,
    /// Holds one of `slots.active`.
    counted: bool,
    /// Became active while every slot was taken: its request is answered 503.
    refused: bool,
}

/// What a connection's timer says.
enum Verdict {
    Keep,
    /// Idle too long, or idle while the server is crowded or stopping.
    Close,
    /// A head took longer than `HEAD_TIME`.
    HeadTimeout,
}

impl ConnState {
    fn new(slots: Arc<Slots>, fd: std::os::fd::RawFd) -> ConnState {
        ConnState {
            slots,
            fd,
            track: Mutex::new(Track {
                phase: Phase::Idle(Instant::now()),
                counted: false,
                refused: false,
            }),
        }
    }

    /// A second descriptor of the connection's socket, for the generator to look at between
    /// steps (see `Peer`); closed with the request, so an idle connection holds one descriptor.
    fn dup_socket(&self) -> Option<std::net::TcpStream> {
        // SAFETY: `fd` is the socket of the hyper connection whose request is being
        // dispatched; the connection (and so the socket) is alive while it polls `dispatch`.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd) };
        fd.try_clone_to_owned().ok().map(std::net::TcpStream::from)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Track> {
        self.track.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn acquire(&self, t: &mut Track) {
        if t.counted {
            return;
        }
        let was = self.slots.active.fetch_add(1, Ordering::SeqCst);
        if was >= self.slots.max_active {
            self.slots.active.fetch_sub(1, Ordering::SeqCst);
            t.refused = true;
        } else {
            t.counted = true;
            t.refused = false;
        }
    }

    fn release(&self, t: &mut Track) {
        if t.counted {
            self.slots.active.fetch_sub(1, Ordering::SeqCst);
        }
        t.counted = false;
        t.refused = false;
    }

    /// Bytes came in: an idle connection starts a head (it takes an active slot only once the
    /// head is complete, in `on_request`).
    fn on_bytes(&self) {
        let mut t = self.lock();
        if let Phase::Idle(_) = t.phase {
            t.phase = Phase::Head(Instant::now());
        }
    }

    /// A request's head is in; false if it must be refused (every active slot taken).
    fn on_request(&self) -> bool {
        let mut t = self.lock();
        t.phase = Phase::Request;
        self.acquire(&mut t);
        !t.refused
    }

    /// A response has gone out (its body is dropped).
    fn on_response_end(&self) {
        let mut t = self.lock();
        t.phase = Phase::Idle(Instant::now());
        self.release(&mut t);
    }

    fn on_close(&self) {
        let mut t = self.lock();
        self.release(&mut t);
    }

    fn check(&self, stopping: bool, head_time: Duration) -> Verdict {
        let t = self.lock();
        match t.phase {
            Phase::Idle(since) => {
                let idle = since.elapsed();
                if stopping || idle > IDLE || (self.slots.crowded() && idle > IDLE_CROWDED) {
                    Verdict::Close
                } else {
                    Verdict::Keep
                }
            }
            Phase::Head(since) if since.elapsed() > head_time => Verdict::HeadTimeout,
            Phase::Head(_) | Phase::Request => Verdict::Keep,
        }
    }
}

/// The client's socket, with every read that brings bytes reported to its `ConnState`.
struct Watched {
    io: tokio::net::TcpStream,
    state: Arc<ConnState>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.state.on_bytes();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Accept connections on `listener` until `stop` is set, serving them on `rt`; returns once
/// the listener is closed (connections already open go on, on the runtime's threads).
pub(crate) fn listen<S: Service>(
    rt: &tokio::runtime::Runtime,
    listener: std::net::TcpListener,
    svc: Arc<S>,
    slots: Arc<Slots>,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.max_header_size(MAX_HEAD)
        .max_headers(MAX_HEADERS)
        .title_case_headers(true)
        .keep_alive(true)
        .half_close(false);
    let http = Arc::new(http);
    rt.block_on(async {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        while !stop.load(Ordering::Relaxed) {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
            };
            let stream = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    eprintln!("[serve] accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            if slots.full() {
                // Answered as it is accepted, before anything is read.
                tokio::spawn(refuse_connection(stream));
                continue;
            }
            slots.open.fetch_add(1, Ordering::SeqCst);
            let (svc, slots, http) = (svc.clone(), slots.clone(), http.clone());
            tokio::spawn(async move {
                serve_connection(&http, stream, svc, slots.clone()).await;
                slots.open.fetch_sub(1, Ordering::SeqCst);
            });
        }
        Ok(())
    })
}

/// 503 to a connection over `--max-connections`, then close.
async fn refuse_connection(mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = r#"{"error":{"message":"too many open connections (--max-connections)","type":"server_error","param":null,"code":null}}"#;
    let bytes = raw_response(503, body);
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        stream.write_all(&bytes).await?;
        stream.shutdown().await
    })
    .await;
}

/// A whole response written below hyper (a connection refused at accept, a head timed out).
fn raw_response(status: u16, json: &str) -> Vec<u8> {
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Status");
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{json}",
        json.len()
    )
    .into_bytes()
}

async fn serve_connection<S: Service>(
    http: &hyper::server::conn::http1::Builder,
    stream: tokio::net::TcpStream,
    svc: Arc<S>,
    slots: Arc<Slots>,
) {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    let state = Arc::new(ConnState::new(slots, fd));
    let io = hyper_util::rt::TokioIo::new(Watched {
        io: stream,
        state: state.clone(),
    });
    let service = {
        let (svc, state) = (svc.clone(), state.clone());
        hyper::service::service_fn(move |req| dispatch(req, svc.clone(), state.clone()))
    };
    let conn = http.serve_connection(io, service);
    tokio::pin!(conn);
    let mut tick = tokio::time::interval(TICK);
    let mut closing = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => break,
            _ = tick.tick() => match state.check(svc.stopping(), svc.timeouts().head) {
                Verdict::Keep => {}
                Verdict::Close => {
                    if !closing {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
                Verdict::HeadTimeout => {
                    let r = Refusal {
                        path: "-".into(),
                        status: 408,
                        message: "request took too long to arrive".into(),
                    };
                    let body = super::ApiError::new(r.status, r.message.clone())
                        .to_json(super::error::Dialect::OpenAi)
                        .to_string();
                    let bytes = raw_response(408, &body);
                    // SAFETY: `fd` is the socket owned by `conn`, which is alive here (it is
                    // dropped after the loop); hyper is inside a request head, so it writes
                    // nothing meanwhile. A non-blocking send of a few hundred bytes.
                    unsafe {
                        libc::send(
                            fd,
                            bytes.as_ptr().cast(),
                            bytes.len(),
                            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                        );
                    }
                    svc.refused(&r);
                    break;
                }
            },
        }
    }
    state.on_close();
}

/// The client's keep-alive wish: HTTP/1.0 keeps only with `Connection: keep-alive`, 1.1
/// unless `Connection: close`.
fn wants_keep_alive(version: Version, headers: &hyper::HeaderMap) -> bool {
    let conn = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",")
        .to_ascii_lowercase();
    if version == Version::HTTP_10 {
        conn.contains("keep-alive")
    } else {
        !conn.contains("close")
    }
}

/// One request, as its head arrives: answered by a task of its own (`answer`), so that a
/// request whose client leaves as soon as it is written still reaches its handler (which
/// finds the client gone, and its generation is cancelled and counted like any other). The
/// future hyper polls only waits for the response; hyper drops it when the connection ends,
/// which marks the client gone.
fn dispatch<S: Service>(
    req: hyper::Request<Incoming>,
    svc: Arc<S>,
    state: Arc<ConnState>,
) -> impl std::future::Future<Output = Result<Response<ReplyBody>, Infallible>> {
    let admitted = state.on_request();
    let peer = Arc::new(Peer {
        gone: AtomicBool::new(false),
        sock: state.dup_socket(),
    });
    let alive = Alive(Some(peer.clone()));
    let (tx, rx) = oneshot::channel();
    tokio::spawn(answer(req, svc, admitted, peer, tx));
    async move {
        let mut resp = match rx.await {
            Ok(r) => r,
            // The handler ended without an answer (it panicked).
            Err(_) => {
                let mut r = Response::new(ReplyBody::full(Vec::new()));
                *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                r.headers_mut()
                    .insert(CONNECTION, HeaderValue::from_static("close"));
                r
            }
        };
        let b = resp.body_mut();
        b.alive = Some(alive);
        b.end = Some(EndGuard(state));
        Ok(resp)
    }
}

/// Read the request's body within the limits and hand it to the service on a blocking
/// thread; its response goes to `reply`.
async fn answer<S: Service>(
    req: hyper::Request<Incoming>,
    svc: Arc<S>,
    admitted: bool,
    peer: Arc<Peer>,
    reply: oneshot::Sender<Response<ReplyBody>>,
) {
    let (parts, mut body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let keep = wants_keep_alive(parts.version, &parts.headers) && !svc.stopping();
    let refuse = |status: u16, message: String| Refusal {
        path: path.clone(),
        status,
        message,
    };
    let outcome = if !admitted {
        Err(refuse(
            503,
            "too many active connections (--max-connections)".into(),
        ))
    } else {
        read_body(
            &mut body,
            &parts.headers,
            svc.max_body(),
            svc.timeouts().body,
        )
        .await
        .map_err(|(status, message)| refuse(status, message))
        .map(|body| Request {
            method: parts.method.as_str().to_string(),
            path: path.clone(),
            headers: parts
                .headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.as_str().to_string(),
                        String::from_utf8_lossy(v.as_bytes()).trim().to_string(),
                    )
                })
                .collect(),
            body,
            keep_alive: keep,
        })
    };
    drop(body);
    let conn = Conn {
        reply: Some(reply),
        whole: None,
        stream: None,
        ended: false,
        peer,
        keep: keep && outcome.is_ok(),
    };
    if outcome.as_ref().is_ok_and(|r| svc.quick(r)) {
        svc.handle(outcome, conn);
    } else {
        let _ = tokio::task::spawn_blocking(move || svc.handle(outcome, conn)).await;
    }
}

/// Read a request body of at most `max` bytes, at `BODY_RATE` or faster after a grace of
/// `grace`. Err: status and message of the refusal.
async fn read_body(
    body: &mut Incoming,
    headers: &hyper::HeaderMap,
    max: usize,
    grace: Duration,
) -> Result<Vec<u8>, (u16, String)> {
    // hyper has checked Content-Length (digits only, repeats agree) and framed the body.
    let declared: Option<usize> = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let waits = headers
        .get(EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if let Some(len) = declared.filter(|&l| l > max) {
        // Read and drop the body first: a client still sending would otherwise see the
        // connection reset instead of the answer. One that waits for 100-continue gets none.
        if len <= DRAIN_LIMIT && !waits {
            drain(body, Pace::new(grace)).await;
        }
        return Err((
            413,
            format!("request body of {len} bytes is over the limit of {max} bytes (--max-body)"),
        ));
    }
    let pace = Pace::new(grace);
    let mut out = Vec::with_capacity(declared.unwrap_or(0));
    loop {
        let frame = tokio::time::timeout_at(pace.deadline(out.len()), next_frame(body)).await;
        match frame {
            Err(_) => return Err((408, "request took too long to arrive".into())),
            Ok(None) => break,
            Ok(Some(Err(_))) => {
                return Err((
                    400,
                    match declared {
                        Some(len) => {
                            format!("connection closed after {} of {len} body bytes", out.len())
                        }
                        None => format!(
                            "connection closed inside the chunked body after {} bytes",
                            out.len()
                        ),
                    },
                ))
            }
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    if out.len() + data.len() > max {
                        let at_least = out.len() + data.len();
                        drain(body, pace).await;
                        return Err((413, format!("request body of at least {at_least} bytes is over the limit of {max} bytes (--max-body)")));
                    }
                    out.extend_from_slice(&data);
                }
            }
        }
    }
    Ok(out)
}

async fn next_frame(body: &mut Incoming) -> Option<Result<Frame<Bytes>, hyper::Error>> {
    std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await
}

/// Read and discard up to `DRAIN_LIMIT` bytes of body at `pace`'s rate.
async fn drain(body: &mut Incoming, pace: Pace) {
    let mut n = 0usize;
    while n <= DRAIN_LIMIT {
        match tokio::time::timeout_at(pace.deadline(n), next_frame(body)).await {
            Ok(Some(Ok(f))) => n += f.data_ref().map_or(0, Bytes::len),
            _ => return,
        }
    }
}

/// The minimum byte rate of a body: `grace` from its start, plus `1 / BODY_RATE` s per byte
/// received.
#[derive(Clone, Copy)]
struct Pace {
    start: tokio::time::Instant,
    grace: Duration,
}

impl Pace {
    fn new(grace: Duration) -> Pace {
        Pace {
            start: tokio::time::Instant::now(),
            grace,
        }
    }

    /// When the body's time runs out if no more than `received` bytes have arrived by then.
    fn deadline(&self, received: usize) -> tokio::time::Instant {
        self.start + self.grace + Duration::from_secs_f64(received as f64 / BODY_RATE as f64)
    }
}

/// Set (to true) when the request's response is dropped before it has been written: the
/// client went away (hyper drops the pending response, or the stream's body, when its
/// connection fails or the peer closes its side).
struct Alive(Option<Arc<Peer>>);

impl Drop for Alive {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            p.gone.store(true, Ordering::SeqCst);
        }
    }
}

/// Marks the connection idle once its response is written (hyper drops the body then).
struct EndGuard(Arc<ConnState>);

impl Drop for EndGuard {
    fn drop(&mut self) {
        self.0.on_response_end();
    }
}

/// A response body: whole, or a stream of chunks from the handler.
pub(crate) struct ReplyBody {
    kind: BodyKind,
    /// Dropped with the body: marks the client gone if the stream did not end first.
    alive: Option<Alive>,
    end: Option<EndGuard>,
}

enum BodyKind {
    Full(Option<Bytes>),
    Stream {
        rx: mpsc::UnboundedReceiver<Bytes>,
        ended: bool,
    },
}

impl ReplyBody {
    fn full(b: Vec<u8>) -> ReplyBody {
        ReplyBody {
            kind: BodyKind::Full(Some(Bytes::from(b))),
            alive: None,
            end: None,
        }
    }
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        match &mut this.kind {
            BodyKind::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            BodyKind::Stream { rx, ended } => match rx.poll_recv(cx) {
                Poll::Ready(Some(b)) => Poll::Ready(Some(Ok(Frame::data(b)))),
                Poll::Ready(None) => {
                    *ended = true;
                    // The stream ended as the handler meant: not a disconnect.
                    if let Some(a) = &mut this.alive {
                        a.0 = None;
                    }
                    Poll::Ready(None)
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            BodyKind::Full(b) => b.is_none(),
            BodyKind::Stream { ended, .. } => *ended,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            BodyKind::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            BodyKind::Stream { .. } => SizeHint::default(),
        }
    }
}

/// Where a handler writes its response: a whole one (`respond`), or a stream (`start_chunks`,
/// `chunk`, `end_chunks`). A whole response, and the end of a stream, go out when the `Conn`
/// is dropped, after the handler has logged the request: a client that has its answer finds
/// the server's log line written.
pub struct Conn {
    reply: Option<oneshot::Sender<Response<ReplyBody>>>,
    /// A whole response, sent on drop.
    whole: Option<Response<ReplyBody>>,
    stream: Option<mpsc::UnboundedSender<Bytes>>,
    /// The stream has ended (its sender is dropped with the `Conn`).
    ended: bool,
    peer: Arc<Peer>,
    /// Keep the connection open after the response.
    keep: bool,
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let (Some(tx), Some(resp)) = (self.reply.take(), self.whole.take()) {
            let _ = tx.send(resp);
        }
    }
}

fn gone_error() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the client is gone")
}

impl Conn {
    /// Send a whole response (when the `Conn` is dropped). Err: a response was already given,
    /// or the client is gone.
    pub fn respond(
        &mut self,
        status: u16,
        content_type: &str,
        body: &[u8],
        keep_alive: bool,
    ) -> std::io::Result<()> {
        self.respond_with(status, content_type, body, keep_alive, &[])
    }

    /// Send a whole response with extra headers (`(name, value)`).
    pub fn respond_with(
        &mut self,
        status: u16,
        content_type: &str,
        body: &[u8],
        keep_alive: bool,
        headers: &[(&str, String)],
    ) -> std::io::Result<()> {
        if self.whole.is_some() || self.reply.as_ref().is_none_or(|r| r.is_closed()) {
            return Err(gone_error());
        }
        let mut b = Response::builder()
            .status(status)
            .header(CONTENT_TYPE, content_type);
        for (name, value) in headers {
            b = b.header(*name, value.as_str());
        }
        if !(keep_alive && self.keep) {
            b = b.header(CONNECTION, "close");
        }
        let resp = b
            .body(ReplyBody::full(body.to_vec()))
            .map_err(std::io::Error::other)?;
        self.whole = Some(resp);
        Ok(())
    }

    /// Start a streamed response (server-sent events); follow with `chunk` and `end_chunks`.
    pub fn start_chunks(&mut self, status: u16, content_type: &str) -> std::io::Result<()> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut b = Response::builder()
            .status(status)
            .header(CONTENT_TYPE, content_type)
            .header(CACHE_CONTROL, "no-cache");
        if !self.keep {
            b = b.header(CONNECTION, "close");
        }
        let resp = b
            .body(ReplyBody {
                kind: BodyKind::Stream { rx, ended: false },
                alive: None,
                end: None,
            })
            .map_err(std::io::Error::other)?;
        let reply = self.reply.take().ok_or_else(gone_error)?;
        reply.send(resp).map_err(|_| gone_error())?;
        self.stream = Some(tx);
        Ok(())
    }

    /// One chunk of a streamed response; hyper writes it as soon as the client can take it.
    pub fn chunk(&mut self, data: &[u8]) -> std::io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let tx = self
            .stream
            .as_ref()
            .filter(|_| !self.ended)
            .ok_or_else(gone_error)?;
        tx.send(Bytes::copy_from_slice(data))
            .map_err(|_| gone_error())
    }

    /// The end of a streamed response (it goes out when the `Conn` is dropped).
    pub fn end_chunks(&mut self) -> std::io::Result<()> {
        match &self.stream {
            Some(tx) if !self.ended && !tx.is_closed() => {
                self.ended = true;
                Ok(())
            }
            _ => Err(gone_error()),
        }
    }

    /// True when the client has gone away (its connection closed, half-closed or failed).
    pub fn peer_gone(&self) -> bool {
        self.peer.gone() || self.stream.as_ref().is_some_and(|s| s.is_closed())
    }

    /// A handle that another thread (the generator, once per step) can ask whether this
    /// client is gone.
    pub fn watch(&self) -> Option<PeerWatch> {
        Some(PeerWatch(self.peer.clone()))
    }
}

/// A request's client: marked gone by the HTTP layer (its pending response or its stream's
/// body was dropped, so hyper has seen the connection end), and looked at directly through a
/// second descriptor of its socket, so the generator sees a disconnect before every step
/// without waiting for the runtime's threads.
struct Peer {
    gone: AtomicBool,
    sock: Option<std::net::TcpStream>,
}

impl Peer {
    fn gone(&self) -> bool {
        self.gone.load(Ordering::SeqCst) || self.sock.as_ref().is_some_and(peer_closed)
    }
}

/// A client, watched for a disconnect (see `Conn::watch`).
pub struct PeerWatch(Arc<Peer>);

impl PeerWatch {
    /// As `Conn::peer_gone`.
    pub fn gone(&self) -> bool {
        self.0.gone()
    }
}

/// The peer closed its side (a read would return end of file) or the socket failed. A
/// one-byte `recv` with `MSG_PEEK | MSG_DONTWAIT`: nothing is consumed, and no flag of the
/// socket (shared with hyper, which reads and writes it) changes.
fn peer_closed(s: &std::net::TcpStream) -> bool {
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
            !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            )
        }
    }
}
