//! `sluice serve`: an HTTP server speaking OpenAI's (`/v1/chat/completions`,
//! `/v1/completions`, `/v1/models`) and Anthropic's (`/v1/messages`) APIs, plus `/health` and
//! Prometheus `/metrics`.
//!
//! Map: `http.rs` serves HTTP/1.1 (hyper on tokio) and hands each request to a handler;
//! `openai.rs` and
//! `anthropic.rs` turn requests into token jobs and events into each API's JSON and SSE;
//! `params.rs` validates fields; `engine.rs` is the single generator thread with its queue,
//! feeding jobs to `crate::engine::Engine` (the decode loop, prompt reuse, `--kv-dir`
//! sessions, cancellation); `tools.rs` parses tool calls; `metrics.rs` counts; `error.rs`
//! shapes errors.
//!
//! Threads: tokio's runtime (two threads) owns every socket, idle or slow ones included; a
//! request whose body is in runs its handler on tokio's blocking pool (renders the chat
//! template, tokenizes, then waits on its job's events, writing a whole response or an SSE
//! stream through a channel hyper drains); one generator (which also looks at each running
//! job's client mark before every step: a client that leaves is cancelled within one step).
//! Back-pressure: a job waits in the queue only while every
//! sequence slot is busy; beyond `--max-queue` waiting, 503 with `Retry-After`.
//! The engine (model, placement, session) is opened by the caller and moved into the
//! generator thread; it comes back when the server stops, for the end-of-run figures.
//! Invariant: a connection's failure (bad input, a disconnect) ends that connection only; the
//! generator and every other connection go on.

mod anthropic;
mod engine;
mod error;
mod http;
/// Sessions on disk moved to the engine; kept here under their old path.
pub use crate::engine::kv_store;
mod limits;
mod metrics;
mod openai;
mod params;
pub(crate) mod reasoning;
mod tools;

pub use error::{ApiError, ServeError};
pub use http::Timeouts;

use crate::chat::render_chat_json;
use crate::sample::SamplingParams;
use crate::tokenizer::Tokenizer;
use engine::{Event, Finished, Generator, Job, Queue};
use error::Dialect;
use http::{Conn, Refusal, Request};
use metrics::Metrics;
use serde_json::{json, Value};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything `sluice serve` is told on its command line.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    /// Required key: `Authorization: Bearer KEY` (OpenAI routes) or `x-api-key: KEY`
    /// (Anthropic route; Bearer is accepted there too).
    pub api_key: Option<String>,
    /// The model name clients must ask for (and `/v1/models` lists).
    pub model_id: String,
    /// A chat template that replaces the model's own (`--chat-template`).
    pub chat_template: Option<String>,
    /// Split reasoning (`<think>` blocks, harmony's analysis channel) off the content of chat
    /// replies (`--reasoning-format auto`, the default); false leaves it in the text.
    pub split_reasoning: bool,
    /// Context length (the engine passed to `run` must hold this many positions).
    pub ctx: usize,
    /// Sampling defaults for fields a request leaves out.
    pub sampling: SamplingParams,
    pub max_body: usize,
    pub max_queue: usize,
    pub max_connections: usize,
    /// How long a request head and a body may take (`--head-timeout`, `--body-timeout`).
    pub timeouts: Timeouts,
    /// On SIGINT/SIGTERM, how long a running generation may go on before it is cancelled.
    pub shutdown_grace: Duration,
}

/// State every connection thread shares.
pub(crate) struct Shared {
    pub cfg: ServeConfig,
    pub tok: Tokenizer,
    pub template: Option<String>,
    /// How this model writes tool calls (from its template, else its family).
    pub tool_format: tools::ToolFormat,
    /// How this model marks its reasoning (from its template), when replies split it off.
    pub reasoning: Option<reasoning::ReasoningFormat>,
    pub queue: Queue,
    pub metrics: Arc<Metrics>,
    pub stopping: AtomicBool,
    /// HTTP connections open and active (`--max-connections`).
    pub slots: Arc<http::Slots>,
    /// Unix seconds at start (`created` of the model entry).
    pub started: u64,
}

/// Serve `engine` (opened with its placement and, for `--kv-dir`, its session store) until
/// SIGINT or SIGTERM; then stop accepting, let the running generation finish (up to the grace
/// time), answer queued requests 503, and return the engine.
pub fn run(
    engine: crate::engine::Engine,
    cfg: ServeConfig,
) -> Result<crate::engine::Engine, ServeError> {
    if engine.ctx != cfg.ctx {
        return Err(ServeError::Model(crate::model::ModelError::Input(format!(
            "the engine holds {} positions, --ctx-size is {}",
            engine.ctx, cfg.ctx
        ))));
    }
    let tok = engine.tok.clone();
    let metrics = Arc::new(Metrics::default());
    if let (Some(dir), Some(n)) = (&engine.opts.kv_dir, engine.saved_sessions()) {
        eprintln!(
            "[serve] --kv-dir {}: {n} saved session(s) of this model",
            dir.display()
        );
    }
    let template = cfg
        .chat_template
        .clone()
        .or_else(|| tok.chat_template().map(str::to_string));
    if let Some(t) = &cfg.chat_template {
        // A template given on the command line must render a plain conversation now, not fail
        // every request later.
        let hello = [json!({"role": "user", "content": "Hello"})];
        render_chat_json(
            t,
            &hello,
            true,
            tok.bos_token().unwrap_or(""),
            tok.eos_token().unwrap_or(""),
            None,
        )
        .map_err(|e| ServeError::ChatTemplate(e.to_string()))?;
    }
    let tool_format = tools::ToolFormat::detect(template.as_deref(), engine.model.cfg.family);
    let reasoning = reasoning::ReasoningFormat::detect(template.as_deref());
    let reasoning = reasoning.filter(|_| cfg.split_reasoning);
    let generator = Generator::new(engine, metrics.clone());

    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = TcpListener::bind(&addr).map_err(|err| ServeError::Bind {
        addr: addr.clone(),
        err,
    })?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // A second signal while stopping ends the process at once.
        signal_hook::flag::register_conditional_default(sig, stop.clone())
            .map_err(ServeError::Signal)?;
        signal_hook::flag::register(sig, stop.clone()).map_err(ServeError::Signal)?;
    }

    if template.is_none() {
        eprintln!("[serve] warning: the model has no chat template; /v1/chat/completions and /v1/messages will answer 400");
    }
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let max_connections = cfg.max_connections;
    let shared = Arc::new(Shared {
        queue: Queue::new(cfg.max_queue, metrics.clone()),
        cfg,
        tok,
        template,
        tool_format,
        reasoning,
        metrics,
        stopping: AtomicBool::new(false),
        slots: Arc::new(http::Slots::new(max_connections)),
        started,
    });
    let abort = Arc::new(AtomicBool::new(false));
    let worker = {
        let sh = shared.clone();
        let abort = abort.clone();
        std::thread::Builder::new()
            .name("sluice-generator".into())
            .spawn(move || generator.run(&sh.queue, &abort))?
    };
    eprintln!(
        "[serve] model {:?} (context {}, tool calls parsed as {}, reasoning {}) listening on http://{local}",
        shared.cfg.model_id,
        shared.cfg.ctx,
        if shared.reasoning == Some(reasoning::ReasoningFormat::Harmony) {
            "harmony channels"
        } else {
            shared.tool_format.name()
        },
        match shared.reasoning {
            Some(f) => format!("split off as reasoning_content: {}", f.name()),
            None if shared.cfg.split_reasoning => "not marked by the template".into(),
            None => "left in the content (--reasoning-format none)".into(),
        }
    );

    // Only connections inside a request count against --max-connections (http::Slots).
    let slots = shared.slots.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("sluice-http")
        .enable_io()
        .enable_time()
        .build()?;
    http::listen(&rt, listener, shared.clone(), slots.clone(), &stop)?;

    // Shutdown: stop accepting, refuse what is queued, let the running job finish or cancel it.
    eprintln!(
        "[serve] stopping: no new connections; finishing the running generation (up to {:?})",
        shared.cfg.shutdown_grace
    );
    shared.stopping.store(true, Ordering::SeqCst);
    shared.queue.close();
    let t = Instant::now();
    while shared.queue.busy() && t.elapsed() < shared.cfg.shutdown_grace {
        std::thread::sleep(Duration::from_millis(20));
    }
    abort.store(true, Ordering::SeqCst);
    let engine = worker
        .join()
        .map_err(|_| ServeError::Io(std::io::Error::other("the generator thread panicked")))?;
    // Give connections a moment to write their last bytes.
    let t = Instant::now();
    while slots.open.load(Ordering::SeqCst) > 0 && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(20));
    }
    rt.shutdown_timeout(Duration::from_secs(1));
    eprintln!("[serve] stopped");
    Ok(engine)
}

/// What a handler did, for the log line.
pub(crate) struct Handled {
    pub status: u16,
    /// The response was cut short (a client gone, an error mid-stream); hyper closes the
    /// connection after it.
    pub close: bool,
    pub note: String,
}

impl http::Service for Shared {
    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    fn max_body(&self) -> usize {
        self.cfg.max_body
    }

    fn timeouts(&self) -> http::Timeouts {
        self.cfg.timeouts
    }

    fn handle(&self, req: Result<Request, Refusal>, mut conn: Conn) {
        let req = match req {
            Ok(r) => r,
            Err(r) => {
                let dialect = if r.path.starts_with("/v1/messages") {
                    Dialect::Anthropic
                } else {
                    Dialect::OpenAi
                };
                let e = ApiError::new(r.status, r.message.clone());
                let _ = conn.respond(
                    r.status,
                    "application/json",
                    e.to_json(dialect).to_string().as_bytes(),
                    false,
                );
                self.refused(&r);
                return;
            }
        };
        let t = Instant::now();
        let keep = req.keep_alive && !self.stopping.load(Ordering::Relaxed);
        let h = route(self, &req, &mut conn, keep);
        self.metrics.count_request(route_label(&req.path), h.status);
        if req.path != "/health" && req.path != "/metrics" {
            log_line(format!(
                "[serve] {} {} {} {:.2}s{}{}",
                req.method,
                req.path,
                h.status,
                t.elapsed().as_secs_f64(),
                h.note,
                if h.close { " (response cut short)" } else { "" }
            ));
        }
        // `conn` is dropped here: the response goes out after its log line.
    }

    fn quick(&self, req: &Request) -> bool {
        req.method == "GET" && matches!(req.path.as_str(), "/health" | "/metrics")
    }

    fn refused(&self, r: &Refusal) {
        self.metrics.count_request(route_label(&r.path), r.status);
        log_line(format!("[serve] {} {} {}", r.path, r.status, r.message));
    }
}

/// One line on stderr in one write, so a reader sees it whole (and at once) however many
/// threads log.
fn log_line(mut line: String) {
    use std::io::Write;
    line.push('\n');
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// The label a path is counted under (unknown paths share one, so clients cannot grow the
/// metrics without bound).
fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/messages" => "/v1/messages",
        "/v1/messages/count_tokens" => "/v1/messages/count_tokens",
        "/health" => "/health",
        "/metrics" => "/metrics",
        p if p.starts_with("/v1/models") => "/v1/models",
        _ => "other",
    }
}

fn route(sh: &Shared, req: &Request, conn: &mut Conn, keep: bool) -> Handled {
    let dialect = if req.path.starts_with("/v1/messages") {
        Dialect::Anthropic
    } else {
        Dialect::OpenAi
    };
    let method = req.method.as_str();
    let want = |m: &str| -> Result<(), ApiError> {
        if method == m {
            Ok(())
        } else {
            Err(ApiError::new(
                405,
                format!("{} takes {m}, not {method}", req.path),
            ))
        }
    };
    let res: Result<Handled, ApiError> = (|| {
        match req.path.as_str() {
        "/health" => {
            want("GET")?;
            let body = json!({"status": "ok", "model": sh.cfg.model_id, "queue": sh.queue.len(), "busy": sh.queue.busy()});
            Ok(send_json(conn, 200, &body, keep))
        }
        "/metrics" => {
            want("GET")?;
            let conns = (sh.slots.open.load(Ordering::Relaxed), sh.slots.active.load(Ordering::Relaxed));
            let text = sh.metrics.render(sh.queue.len(), conns, &sh.cfg.model_id);
            let ok = conn.respond(200, "text/plain; version=0.0.4", text.as_bytes(), keep).is_ok();
            Ok(Handled { status: 200, close: !ok, note: String::new() })
        }
        "/v1/models" => {
            want("GET")?;
            authorize(sh, req, dialect)?;
            let body = json!({"object": "list", "data": [model_entry(sh)]});
            Ok(send_json(conn, 200, &body, keep))
        }
        p if p.starts_with("/v1/models/") => {
            want("GET")?;
            authorize(sh, req, dialect)?;
            let id = &p["/v1/models/".len()..];
            if id != sh.cfg.model_id {
                return Err(unknown_model(sh, id));
            }
            Ok(send_json(conn, 200, &model_entry(sh), keep))
        }
        "/v1/chat/completions" => {
            want("POST")?;
            authorize(sh, req, dialect)?;
            openai::chat(sh, req, conn, keep)
        }
        "/v1/completions" => {
            want("POST")?;
            authorize(sh, req, dialect)?;
            openai::completions(sh, req, conn, keep)
        }
        "/v1/messages" => {
            want("POST")?;
            authorize(sh, req, dialect)?;
            anthropic::messages(sh, req, conn, keep)
        }
        "/v1/messages/count_tokens" => {
            want("POST")?;
            authorize(sh, req, dialect)?;
            anthropic::count_tokens(sh, req, conn, keep)
        }
        other => Err(ApiError::new(404, format!("no route {other} (this server has /v1/chat/completions, /v1/completions, /v1/models, /v1/messages, /health, /metrics)"))),
    }
    })();
    match res {
        Ok(h) => h,
        Err(e) => send_error(conn, &e, dialect, keep),
    }
}

fn model_entry(sh: &Shared) -> Value {
    json!({
        "id": sh.cfg.model_id,
        "object": "model",
        "created": sh.started,
        "owned_by": "sluice",
        // Anthropic's listing fields.
        "type": "model",
        "display_name": sh.cfg.model_id,
        "context_length": sh.cfg.ctx,
    })
}

/// 404 for a model this server does not serve.
pub(crate) fn unknown_model(sh: &Shared, asked: &str) -> ApiError {
    ApiError {
        status: 404,
        message: format!(
            "the model `{asked}` does not exist here; this server serves `{}`",
            sh.cfg.model_id
        ),
        param: Some("model".into()),
        code: Some("model_not_found"),
        retry_after: None,
    }
}

/// The request's `model` must be the served one.
pub(crate) fn check_model(sh: &Shared, o: &params::Obj) -> Result<(), ApiError> {
    let m = params::req_str(o, "model")?;
    if m != sh.cfg.model_id {
        return Err(unknown_model(sh, m));
    }
    Ok(())
}

fn authorize(sh: &Shared, req: &Request, dialect: Dialect) -> Result<(), ApiError> {
    let Some(key) = &sh.cfg.api_key else {
        return Ok(());
    };
    let bearer = req.header("authorization").and_then(|v| {
        v.strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))
    });
    let x_api = req.header("x-api-key");
    let given = match dialect {
        Dialect::OpenAi => bearer.or(x_api),
        Dialect::Anthropic => x_api.or(bearer),
    };
    match given {
        Some(g) if same_secret(g.trim().as_bytes(), key.as_bytes()) => Ok(()),
        Some(_) => Err(ApiError::new(401, "invalid API key").with_code("invalid_api_key")),
        None => Err(ApiError::new(
            401,
            match dialect {
                Dialect::OpenAi => "missing API key: send `Authorization: Bearer KEY`",
                Dialect::Anthropic => "missing API key: send `x-api-key: KEY`",
            },
        )
        .with_code("invalid_api_key")),
    }
}

/// Comparison whose time does not depend on where the inputs differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

pub(crate) fn send_json(conn: &mut Conn, status: u16, body: &Value, keep: bool) -> Handled {
    let ok = conn
        .respond(
            status,
            "application/json",
            body.to_string().as_bytes(),
            keep,
        )
        .is_ok();
    Handled {
        status,
        close: !ok,
        note: String::new(),
    }
}

pub(crate) fn send_error(conn: &mut Conn, e: &ApiError, dialect: Dialect, keep: bool) -> Handled {
    let headers: Vec<(&str, String)> = e
        .retry_after
        .map(|s| ("Retry-After", s.to_string()))
        .into_iter()
        .collect();
    let ok = conn
        .respond_with(
            e.status,
            "application/json",
            e.to_json(dialect).to_string().as_bytes(),
            keep,
            &headers,
        )
        .is_ok();
    Handled {
        status: e.status,
        close: !ok,
        note: format!(" {}", e.message),
    }
}

/// A new id: `prefix` and 24 hex digits, unique in this process and unlikely to repeat
/// across restarts.
pub(crate) fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x =
        t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (std::process::id() as u64).rotate_left(32);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    format!("{prefix}{x:016x}{:08x}", n as u32)
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A rendered, tokenized chat prompt.
pub(crate) struct ChatPrompt {
    pub tokens: Vec<u32>,
    /// The template opened the reasoning block (the reply starts inside it).
    pub opens_reasoning: bool,
}

/// Render the chat template over template-ready messages and tokenize the result.
pub(crate) fn chat_tokens(
    sh: &Shared,
    messages: &[Value],
    extra: &serde_json::Map<String, Value>,
) -> Result<ChatPrompt, ApiError> {
    let template = sh.template.as_deref().ok_or_else(|| {
        ApiError::new(
            400,
            "this model has no chat template: use /v1/completions with a raw prompt",
        )
    })?;
    let extra = Value::Object(extra.clone());
    let text = render_chat_json(
        template,
        messages,
        true,
        sh.tok.bos_token().unwrap_or(""),
        sh.tok.eos_token().unwrap_or(""),
        Some(&extra),
    )
    .map_err(|e| ApiError::param("messages", e.to_string()))?;
    Ok(ChatPrompt {
        tokens: limits::encode_prompt(&sh.tok, &text, false, sh.cfg.ctx, "messages")?,
        opens_reasoning: sh.reasoning.is_some_and(|f| f.opens_in_prompt(&text)),
    })
}

/// What a generation endpoint asks of the generator.
pub(crate) struct GenRequest {
    pub tokens: Vec<u32>,
    pub max_tokens: Option<u64>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Render control tokens in the text (tool-call markers are control tokens in some
    /// families' vocabularies, e.g. GLM-4.5's `<tool_call>`).
    pub special: bool,
}

/// A submitted job, seen from its connection.
pub(crate) struct Pending {
    rx: Receiver<Event>,
    cancel: Arc<AtomicBool>,
    pub prompt_tokens: usize,
}

/// What the connection gets next.
pub(crate) enum Step {
    Started {
        reused: usize,
        prefilled: usize,
    },
    Text(String),
    Done(Finished),
    Failed(ApiError),
    /// The client closed the connection; the generation is cancelled.
    Gone,
}

impl Pending {
    /// Wait for the next event, watching the socket: a client that goes away cancels the job.
    ///
    /// The socket is looked at after every event as well as every 20 ms without one: a
    /// non-streaming reply writes nothing until the end, so only this check sees its client
    /// leave (a closed socket or a half-closed one, whose write side sent FIN), and looking
    /// after each token keeps the cancellation within one token of the disconnect.
    pub fn next(&self, conn: &Conn) -> Step {
        loop {
            let step = match self.rx.recv_timeout(Duration::from_millis(20)) {
                Ok(Event::Started { reused, prefilled }) => Step::Started { reused, prefilled },
                Ok(Event::Text(t)) => Step::Text(t),
                // A generation cancelled, or a job refused as cancelled, because its client
                // left (the generator saw it first): the client is gone.
                Ok(Event::Done(f))
                    if f.reason == engine::FinishReason::Cancelled && conn.peer_gone() =>
                {
                    self.cancel();
                    return Step::Gone;
                }
                Ok(Event::Failed(e)) if e.status == 499 && conn.peer_gone() => {
                    self.cancel();
                    return Step::Gone;
                }
                // The reply is complete: deliver it even if the client is leaving.
                Ok(Event::Done(f)) => return Step::Done(f),
                Ok(Event::Failed(e)) => return Step::Failed(e),
                Err(RecvTimeoutError::Timeout) => {
                    if conn.peer_gone() {
                        self.cancel();
                        return Step::Gone;
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Step::Failed(ApiError::new(500, "the generator stopped"))
                }
            };
            if conn.peer_gone() {
                self.cancel();
                return Step::Gone;
            }
            return step;
        }
    }

    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // A handler that returns early (write failure, error) abandons its job.
        self.cancel();
    }
}

/// Check the prompt against the context and queue the job.
/// `conn`'s socket goes with the job: the generator looks at it before every step, so a
/// client that leaves is cancelled within one step.
pub(crate) fn submit(sh: &Shared, g: GenRequest, conn: &Conn) -> Result<Pending, ApiError> {
    let n = g.tokens.len();
    if n == 0 {
        return Err(ApiError::param(
            "prompt",
            "the prompt is empty after tokenization",
        ));
    }
    if n >= sh.cfg.ctx {
        return Err(engine::context_error(n, sh.cfg.ctx));
    }
    let room = sh.cfg.ctx - n;
    let max_tokens = match g.max_tokens {
        Some(0) => {
            return Err(ApiError::param(
                "max_tokens",
                "`max_tokens` must be at least 1",
            ))
        }
        Some(m) => (m.min(usize::MAX as u64) as usize).min(room),
        None => room,
    };
    let (tx, rx) = mpsc::channel();
    let cancel = Arc::new(AtomicBool::new(false));
    sh.queue
        .push(Job {
            tokens: g.tokens,
            max_tokens,
            sampling: g.sampling,
            stop: g.stop,
            ignore_eos: g.ignore_eos,
            special: g.special,
            cancel: cancel.clone(),
            peer: conn.watch(),
            events: tx,
        })
        .map_err(|mut e| {
            if e.retry_after.is_some() {
                e.retry_after = Some(retry_after_secs(&sh.metrics));
            }
            e
        })?;
    Ok(Pending {
        rx,
        cancel,
        prompt_tokens: n,
    })
}

/// `Retry-After` of a 503 for a full queue: when a place is likely free again, the mean
/// request time so far (prefill and decode) over the slots, as whole seconds in 1..=60; 1
/// before any request has finished. (llama-server queues without a bound and sends no
/// Retry-After; its 503s carry `{"error":{"code":503,"type":"unavailable_error"}}`.)
fn retry_after_secs(m: &Metrics) -> u64 {
    let n = m.generations.load(Ordering::Relaxed);
    if n == 0 {
        return 1;
    }
    let us = m.prefill_us.load(Ordering::Relaxed) + m.decode_us.load(Ordering::Relaxed);
    let slots = m.slots.load(Ordering::Relaxed).max(1);
    let secs = us as f64 / 1e6 / n as f64 / slots as f64;
    (secs.ceil() as u64).clamp(1, 60)
}

/// Note for the log line.
pub(crate) fn note(f: &Finished) -> String {
    format!(
        " prompt {} (reused {}, prefilled {}) generated {} [{}] prefill {:.2}s decode {:.2}s",
        f.prompt_tokens,
        f.reused,
        f.prefilled,
        f.completion_tokens,
        match &f.reason {
            engine::FinishReason::Eos => "eos".to_string(),
            engine::FinishReason::Length => "length".to_string(),
            engine::FinishReason::Stop(s) => format!("stop {s:?}"),
            engine::FinishReason::Cancelled => "cancelled".to_string(),
        },
        f.prefill_secs,
        f.decode_secs
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_comparison() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
        assert!(!same_secret(b"", b"a"));
    }

    #[test]
    fn ids_differ() {
        assert_ne!(new_id("x"), new_id("x"));
        assert!(new_id("chatcmpl-").starts_with("chatcmpl-"));
    }
}
