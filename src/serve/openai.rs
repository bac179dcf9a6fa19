//! OpenAI's API: `POST /v1/chat/completions` and `POST /v1/completions`, whole responses and
//! server-sent events (`chat.completion.chunk` / `text_completion` chunks ending in
//! `data: [DONE]`), `usage` with the prompt-reuse figures.
//!
//! Owns: translating OpenAI request JSON into a `GenRequest` (messages and tools for the chat
//! template, parameters) and the generator's events into OpenAI's response shapes, including
//! `tool_calls` parsed from the text (tools.rs). Does not own: HTTP, validation primitives
//! (params.rs), generation (engine.rs).
//! Invariant: fields this server cannot honour (`n` > 1, penalties, `logprobs`, ...) are
//! refused with a 400 naming them, never ignored.

use super::engine::{FinishReason, Finished};
use super::error::{ApiError, Dialect};
use super::http::{Conn, Request};
use super::params::{self, kind, Obj};
use super::reasoning::{Piece, ReasoningFormat, ReplyStream};
use super::tools::ToolCall;
use super::{
    chat_tokens, check_model, new_id, note, submit, unix_now, GenRequest, Handled, Pending, Shared,
    Step,
};
use serde_json::{json, Map, Value};

/// Fields refused unless they hold their neutral value.
fn neutral_fields() -> Vec<(&'static str, Value)> {
    vec![
        ("n", json!(1)),
        ("frequency_penalty", json!(0)),
        ("presence_penalty", json!(0)),
        ("logprobs", json!(false)),
        ("top_logprobs", json!(0)),
        ("best_of", json!(1)),
        ("echo", json!(false)),
        ("parallel_tool_calls", json!(true)),
    ]
}

fn refuse_common(o: &Obj) -> Result<(), ApiError> {
    params::refuse_unsupported(o, &neutral_fields())?;
    match o.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) if m.is_empty() => {}
        Some(_) => {
            return Err(ApiError::param(
                "logit_bias",
                "`logit_bias` is not supported by this server",
            ))
        }
    }
    Ok(())
}

fn usage(f: &Finished) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": f.reused },
        "reused_tokens": f.reused,
        "prefilled_tokens": f.prefilled,
    })
}

fn finish_reason(r: &FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// A chat reply's `finish_reason`: `tool_calls` when it made calls.
fn chat_finish_reason(r: &FinishReason, calls: &[ToolCall]) -> &'static str {
    if calls.is_empty() {
        finish_reason(r)
    } else {
        "tool_calls"
    }
}

/// The assistant `message` of a whole chat reply: the content (null when the reply is only
/// calls) and `tool_calls` in OpenAI's shape.
fn chat_message(content: String, calls: &[ToolCall]) -> Value {
    let mut message = json!({ "role": "assistant", "content": content });
    if !calls.is_empty() {
        if content.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = Value::Array(
            calls
                .iter()
                .enumerate()
                .map(|(i, c)| tool_call_json(i, c, false))
                .collect(),
        );
    }
    message
}

/// The stream delta that carries a reply's calls (each with its `index`).
fn tool_calls_delta(calls: &[ToolCall]) -> Value {
    let tc: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, c)| tool_call_json(i, c, true))
        .collect();
    json!({ "tool_calls": tc })
}

/// `POST /v1/chat/completions`.
pub fn chat(sh: &Shared, req: &Request, conn: &mut Conn, keep: bool) -> Result<Handled, ApiError> {
    let o = params::parse_object(&req.body)?;
    check_model(sh, &o)?;
    refuse_common(&o)?;
    if let Some(rf) = o.get("response_format").filter(|v| !v.is_null()) {
        if rf.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::param(
                "response_format",
                "only `{\"type\": \"text\"}` is supported by this server",
            ));
        }
    }
    let messages = match params::req(&o, "messages")? {
        Value::Array(a) if !a.is_empty() => a,
        Value::Array(_) => return Err(ApiError::param("messages", "`messages` is empty")),
        v => {
            return Err(ApiError::param(
                "messages",
                format!("`messages` must be an array, got {}", kind(v)),
            ))
        }
    };
    let mut msgs = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        msgs.push(template_message(i, m)?);
    }

    let mut extra = Map::new();
    if let Some(k) = o.get("chat_template_kwargs").filter(|v| !v.is_null()) {
        match k {
            Value::Object(m) => extra.extend(m.clone()),
            v => {
                return Err(ApiError::param(
                    "chat_template_kwargs",
                    format!("`chat_template_kwargs` must be an object, got {}", kind(v)),
                ))
            }
        }
    }
    let tools_on = match o.get("tool_choice").filter(|v| !v.is_null()) {
        None => true,
        Some(Value::String(s)) if s == "auto" => true,
        Some(Value::String(s)) if s == "none" => false,
        Some(v) => {
            return Err(ApiError::param("tool_choice", format!("`tool_choice` {v} is not supported (only \"auto\" and \"none\"): forcing a call needs constrained decoding")))
        }
    };
    let tools = openai_tools(&o)?;
    let tools_on = tools_on && !tools.is_empty();
    if tools_on {
        extra.insert("tools".into(), Value::Array(tools.clone()));
    }
    let prompt = chat_tokens(sh, &msgs, &extra)?;
    // llama-server's per-request `reasoning_format`: "none" leaves reasoning in the content.
    let split_reasoning = match o.get("reasoning_format").filter(|v| !v.is_null()) {
        None => true,
        Some(Value::String(s)) if matches!(s.as_str(), "auto" | "deepseek") => true,
        Some(Value::String(s)) if s == "none" => false,
        Some(v) => {
            return Err(ApiError::param(
                "reasoning_format",
                format!("`reasoning_format` must be \"auto\", \"deepseek\" or \"none\", got {v}"),
            ))
        }
    };
    let reasoning = sh
        .reasoning
        .filter(|_| split_reasoning)
        .map(|f| (f, prompt.opens_reasoning));
    let tokens = prompt.tokens;
    let max_tokens = match params::opt_u64(&o, "max_completion_tokens")? {
        Some(m) => Some(m),
        None => params::opt_u64(&o, "max_tokens")?,
    };
    let g = GenRequest {
        tokens,
        max_tokens,
        sampling: params::sampling(&o, &sh.cfg.sampling)?,
        stop: params::stop_list(&o, "stop")?,
        ignore_eos: params::opt_bool(&o, "ignore_eos")?.unwrap_or(false),
        // Harmony's channel markers are control tokens: the split needs them in the text.
        special: tools_on || matches!(reasoning, Some((ReasoningFormat::Harmony, _))),
    };
    let stream = params::opt_bool(&o, "stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options").filter(|v| !v.is_null()) {
        None => false,
        Some(Value::Object(so)) => params::opt_bool(so, "include_usage")?.unwrap_or(false),
        Some(v) => {
            return Err(ApiError::param(
                "stream_options",
                format!("`stream_options` must be an object, got {}", kind(v)),
            ))
        }
    };
    let p = submit(sh, g, conn)?;
    if let Err(h) = wait_start(&p, conn) {
        return h;
    }
    let id = new_id("chatcmpl-");
    let created = unix_now();
    let model = sh.cfg.model_id.as_str();
    if !stream {
        let (text, fin) = match collect(&p, conn) {
            Ok(x) => x,
            Err(h) => return h,
        };
        let reply = ReplyStream::new(reasoning, sh.tool_format, tools_on.then_some(tools));
        let (thought, content, calls) = reply.whole(&text, &mut || new_id("call_"));
        let reason = chat_finish_reason(&fin.reason, &calls);
        let mut message = chat_message(content, &calls);
        if !thought.is_empty() {
            message["reasoning_content"] = json!(thought);
        }
        let body = json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{ "index": 0, "message": message, "logprobs": null, "finish_reason": reason }],
            "usage": usage(&fin),
        });
        let mut h = super::send_json(conn, 200, &body, keep);
        h.note = note(&fin);
        return Ok(h);
    }

    // Streaming.
    if conn.start_chunks(200, "text/event-stream").is_err() {
        return Ok(gone(&p));
    }
    let chunk = |delta: Value, reason: Option<&str>| {
        json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": reason }],
        })
    };
    if !sse(
        conn,
        &chunk(json!({"role": "assistant", "content": ""}), None),
    ) {
        return Ok(gone(&p));
    }
    let mut split = Some(ReplyStream::new(
        reasoning,
        sh.tool_format,
        tools_on.then_some(tools),
    ));
    // A piece as a delta: reasoning as `reasoning_content` (llama-server's field).
    let delta = |p: Piece| match p {
        Piece::Reasoning(r) => json!({ "reasoning_content": r }),
        Piece::Content(c) => json!({ "content": c }),
    };
    loop {
        match p.next(conn) {
            Step::Text(t) => {
                let pieces = split.as_mut().map(|s| s.push(&t)).unwrap_or_default();
                for piece in pieces {
                    if !sse(conn, &chunk(delta(piece), None)) {
                        return Ok(gone(&p));
                    }
                }
            }
            Step::Done(fin) => {
                if fin.reason == FinishReason::Cancelled {
                    let e = ApiError::new(503, "the server is shutting down; generation cancelled");
                    let _ = sse(conn, &e.to_json(Dialect::OpenAi));
                    let _ = conn.chunk(b"data: [DONE]\n\n");
                    let _ = conn.end_chunks();
                    return Ok(Handled {
                        status: 200,
                        close: true,
                        note: note(&fin),
                    });
                }
                let mut calls = Vec::new();
                if let Some(s) = split.take() {
                    let (rest, c) = s.finish(&mut || new_id("call_"));
                    for piece in rest {
                        if !sse(conn, &chunk(delta(piece), None)) {
                            return Ok(gone(&p));
                        }
                    }
                    calls = c;
                    if !calls.is_empty() && !sse(conn, &chunk(tool_calls_delta(&calls), None)) {
                        return Ok(gone(&p));
                    }
                }
                let reason = chat_finish_reason(&fin.reason, &calls);
                let mut ok = sse(conn, &chunk(json!({}), Some(reason)));
                if include_usage && ok {
                    let u = json!({ "id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage(&fin) });
                    ok = sse(conn, &u);
                }
                let ok = ok && conn.chunk(b"data: [DONE]\n\n").is_ok() && conn.end_chunks().is_ok();
                return Ok(Handled {
                    status: 200,
                    close: !ok,
                    note: note(&fin),
                });
            }
            Step::Failed(e) => return Ok(stream_error(conn, &e)),
            Step::Gone => return Ok(gone(&p)),
            Step::Started { .. } => {}
        }
    }
}

/// OpenAI's shape of a tool call (`index` only in stream deltas).
fn tool_call_json(i: usize, c: &ToolCall, delta: bool) -> Value {
    let mut v = json!({ "id": c.id, "type": "function", "function": { "name": c.name, "arguments": c.arguments_text() } });
    if delta {
        v["index"] = json!(i);
    }
    v
}

/// `tools`, checked: a list of `{"type": "function", "function": {"name": ...}}`.
fn openai_tools(o: &Obj) -> Result<Vec<Value>, ApiError> {
    let Some(t) = o.get("tools").filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let Value::Array(list) = t else {
        return Err(ApiError::param(
            "tools",
            format!("`tools` must be an array, got {}", kind(t)),
        ));
    };
    for (i, tool) in list.iter().enumerate() {
        let name = tool
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str);
        if tool.get("type").and_then(Value::as_str) != Some("function") || name.is_none() {
            return Err(ApiError::param("tools", format!("`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")));
        }
    }
    Ok(list.clone())
}

/// One OpenAI message as the chat template wants it: string content, tool calls with
/// arguments as objects.
fn template_message(i: usize, m: &Value) -> Result<Value, ApiError> {
    let at = |what: &str| format!("messages[{i}]{what}");
    let Value::Object(mo) = m else {
        return Err(ApiError::param(
            "messages",
            format!("`{}` must be an object, got {}", at(""), kind(m)),
        ));
    };
    let role = match mo.get("role") {
        Some(Value::String(r)) => r.as_str(),
        Some(v) => {
            return Err(ApiError::param(
                "messages",
                format!("`{}` must be a string, got {}", at(".role"), kind(v)),
            ))
        }
        None => {
            return Err(ApiError::param(
                "messages",
                format!("`{}` is missing", at(".role")),
            ))
        }
    };
    let role = match role {
        "developer" => "system",
        "system" | "user" | "assistant" | "tool" => role,
        other => {
            return Err(ApiError::param(
                "messages",
                format!(
                    "`{}` is {other:?}: expected system, developer, user, assistant or tool",
                    at(".role")
                ),
            ))
        }
    };
    let content = text_content(mo.get("content"), &at(".content"))?;
    let mut out = Map::new();
    out.insert("role".into(), json!(role));
    out.insert("content".into(), json!(content));
    if let Some(Value::String(n)) = mo.get("name") {
        out.insert("name".into(), json!(n));
    }
    if let Some(Value::String(r)) = mo.get("reasoning_content") {
        out.insert("reasoning_content".into(), json!(r));
    }
    if role == "tool" {
        if let Some(Value::String(id)) = mo.get("tool_call_id") {
            out.insert("tool_call_id".into(), json!(id));
        }
    }
    if role == "assistant" {
        if let Some(tc) = mo.get("tool_calls").filter(|v| !v.is_null()) {
            let Value::Array(list) = tc else {
                return Err(ApiError::param(
                    "messages",
                    format!("`{}` must be an array", at(".tool_calls")),
                ));
            };
            let mut calls = Vec::with_capacity(list.len());
            for (j, c) in list.iter().enumerate() {
                let f = c.get("function");
                let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
                let Some(name) = name else {
                    return Err(ApiError::param(
                        "messages",
                        format!("`{}` needs function.name", at(&format!(".tool_calls[{j}]"))),
                    ));
                };
                let args = match f.and_then(|f| f.get("arguments")) {
                    Some(Value::String(s)) => {
                        serde_json::from_str::<Value>(s).unwrap_or_else(|_| json!(s))
                    }
                    Some(v) => v.clone(),
                    None => json!({}),
                };
                let mut call =
                    json!({ "type": "function", "function": { "name": name, "arguments": args } });
                if let Some(id) = c.get("id") {
                    call["id"] = id.clone();
                }
                calls.push(call);
            }
            out.insert("tool_calls".into(), Value::Array(calls));
        }
    }
    Ok(Value::Object(out))
}

/// A message's content as text: a string, null, or a list of `{"type": "text"}` parts.
pub(crate) fn text_content(c: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match c {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => s.push_str(t),
                    (Some(t), _) => {
                        return Err(ApiError::param(
                            "messages",
                            format!("`{at}[{j}]` is a {t:?} part: only text parts are supported"),
                        ))
                    }
                    _ => {
                        return Err(ApiError::param(
                            "messages",
                            format!("`{at}[{j}]` must be {{\"type\": \"text\", \"text\": ...}}"),
                        ))
                    }
                }
            }
            Ok(s)
        }
        Some(v) => Err(ApiError::param(
            "messages",
            format!(
                "`{at}` must be a string or a list of parts, got {}",
                kind(v)
            ),
        )),
    }
}

/// `POST /v1/completions`: a raw prompt, no template.
pub fn completions(
    sh: &Shared,
    req: &Request,
    conn: &mut Conn,
    keep: bool,
) -> Result<Handled, ApiError> {
    let o = params::parse_object(&req.body)?;
    check_model(sh, &o)?;
    refuse_common(&o)?;
    if o.get("suffix")
        .is_some_and(|v| !v.is_null() && v.as_str() != Some(""))
    {
        return Err(ApiError::param(
            "suffix",
            "`suffix` (fill-in-the-middle) is not supported by this server",
        ));
    }
    let vocab = sh.tok.vocab_size();
    let ids = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|x| match x.as_u64() {
                Some(t) if (t as usize) < vocab => Ok(t as u32),
                _ => Err(ApiError::param(
                    "prompt",
                    format!("`prompt` token {x} is not an id below the vocabulary size {vocab}"),
                )),
            })
            .collect()
    };
    let encode = |s: &str| super::limits::encode_prompt(&sh.tok, s, true, sh.cfg.ctx, "prompt");
    let tokens = match params::req(&o, "prompt")? {
        Value::String(s) => encode(s)?,
        Value::Array(a) if a.is_empty() => {
            return Err(ApiError::param("prompt", "`prompt` is empty"))
        }
        Value::Array(a) if a.iter().all(Value::is_number) => ids(a)?,
        Value::Array(a) if a.len() == 1 => match &a[0] {
            Value::String(s) => encode(s)?,
            Value::Array(inner) => ids(inner)?,
            v => {
                return Err(ApiError::param(
                    "prompt",
                    format!(
                        "`prompt[0]` must be a string or a list of token ids, got {}",
                        kind(v)
                    ),
                ))
            }
        },
        Value::Array(_) => {
            return Err(ApiError::param(
                "prompt",
                "several prompts in one request are not supported; send one",
            ))
        }
        v => {
            return Err(ApiError::param(
                "prompt",
                format!(
                    "`prompt` must be a string or a list of token ids, got {}",
                    kind(v)
                ),
            ))
        }
    };
    // OpenAI's default for this endpoint.
    let max_tokens = Some(params::opt_u64(&o, "max_tokens")?.unwrap_or(16));
    let g = GenRequest {
        tokens,
        max_tokens,
        sampling: params::sampling(&o, &sh.cfg.sampling)?,
        stop: params::stop_list(&o, "stop")?,
        ignore_eos: params::opt_bool(&o, "ignore_eos")?.unwrap_or(false),
        special: false,
    };
    let stream = params::opt_bool(&o, "stream")?.unwrap_or(false);
    let include_usage = o
        .get("stream_options")
        .and_then(|s| s.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let p = submit(sh, g, conn)?;
    if let Err(h) = wait_start(&p, conn) {
        return h;
    }
    let id = new_id("cmpl-");
    let created = unix_now();
    let model = sh.cfg.model_id.as_str();
    let chunk = |text: &str, reason: Option<&str>| {
        json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{ "text": text, "index": 0, "logprobs": null, "finish_reason": reason }],
        })
    };
    if !stream {
        let (text, fin) = match collect(&p, conn) {
            Ok(x) => x,
            Err(h) => return h,
        };
        let mut body = chunk(&text, Some(finish_reason(&fin.reason)));
        body["usage"] = usage(&fin);
        let mut h = super::send_json(conn, 200, &body, keep);
        h.note = note(&fin);
        return Ok(h);
    }
    if conn.start_chunks(200, "text/event-stream").is_err() {
        return Ok(gone(&p));
    }
    loop {
        match p.next(conn) {
            Step::Text(t) => {
                if !sse(conn, &chunk(&t, None)) {
                    return Ok(gone(&p));
                }
            }
            Step::Done(fin) if fin.reason == FinishReason::Cancelled => {
                return Ok(stream_error(
                    conn,
                    &ApiError::new(503, "the server is shutting down; generation cancelled"),
                ));
            }
            Step::Done(fin) => {
                let mut ok = sse(conn, &chunk("", Some(finish_reason(&fin.reason))));
                if include_usage && ok {
                    let u = json!({ "id": id, "object": "text_completion", "created": created, "model": model, "choices": [], "usage": usage(&fin) });
                    ok = sse(conn, &u);
                }
                let ok = ok && conn.chunk(b"data: [DONE]\n\n").is_ok() && conn.end_chunks().is_ok();
                return Ok(Handled {
                    status: 200,
                    close: !ok,
                    note: note(&fin),
                });
            }
            Step::Failed(e) => return Ok(stream_error(conn, &e)),
            Step::Gone => return Ok(gone(&p)),
            Step::Started { .. } => {}
        }
    }
}

/// Wait until the job leaves the queue. Err: the handler's result (an error to send, or the
/// client is gone).
pub(crate) fn wait_start(
    p: &Pending,
    conn: &Conn,
) -> Result<(usize, usize), Result<Handled, ApiError>> {
    loop {
        match p.next(conn) {
            Step::Started { reused, prefilled } => return Ok((reused, prefilled)),
            Step::Failed(e) => return Err(Err(e)),
            Step::Gone => return Err(Ok(gone(p))),
            Step::Text(_) | Step::Done(_) => {}
        }
    }
}

/// Gather a whole reply. Err: the handler's result.
pub(crate) fn collect(
    p: &Pending,
    conn: &Conn,
) -> Result<(String, Finished), Result<Handled, ApiError>> {
    let mut text = String::new();
    loop {
        match p.next(conn) {
            Step::Text(t) => text.push_str(&t),
            Step::Done(f) if f.reason == FinishReason::Cancelled => {
                return Err(Err(ApiError::new(
                    503,
                    "the server is shutting down; generation cancelled",
                )))
            }
            Step::Done(f) => return Ok((text, f)),
            Step::Failed(e) => return Err(Err(e)),
            Step::Gone => return Err(Ok(gone(p))),
            Step::Started { .. } => {}
        }
    }
}

/// The client went away: cancel and close.
pub(crate) fn gone(p: &Pending) -> Handled {
    p.cancel();
    Handled {
        status: 499,
        close: true,
        note: format!(
            " client disconnected, generation cancelled (prompt {})",
            p.prompt_tokens
        ),
    }
}

/// One `data:` event. False if the client is gone.
fn sse(conn: &mut Conn, v: &Value) -> bool {
    conn.chunk(format!("data: {v}\n\n").as_bytes()).is_ok()
}

/// An error after the stream started: one error event, then the end of the stream.
fn stream_error(conn: &mut Conn, e: &ApiError) -> Handled {
    let _ = sse(conn, &e.to_json(Dialect::OpenAi));
    let _ = conn.chunk(b"data: [DONE]\n\n");
    let _ = conn.end_chunks();
    Handled {
        status: 200,
        close: true,
        note: format!(" error mid-stream: {}", e.message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str, name: &str, args: Value) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: args,
        }
    }

    #[test]
    fn message_with_and_without_calls() {
        let m = chat_message("hello".into(), &[]);
        assert_eq!(m, json!({"role": "assistant", "content": "hello"}));
        assert_eq!(chat_finish_reason(&FinishReason::Eos, &[]), "stop");
        assert_eq!(chat_finish_reason(&FinishReason::Length, &[]), "length");

        let calls = [
            call("call_a", "get_weather", json!({"city": "Paris"})),
            call("call_b", "now", json!({})),
        ];
        let m = chat_message(String::new(), &calls);
        assert_eq!(
            m,
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ]})
        );
        // Text before the calls stays as content.
        let m = chat_message("Checking.".into(), &calls[..1]);
        assert_eq!(m["content"], "Checking.");
        assert_eq!(m["tool_calls"].as_array().map(Vec::len), Some(1));
        // A reply that made calls finishes with tool_calls, whatever ended the generation.
        for r in [
            FinishReason::Eos,
            FinishReason::Length,
            FinishReason::Stop("x".into()),
        ] {
            assert_eq!(chat_finish_reason(&r, &calls), "tool_calls");
        }
    }

    #[test]
    fn stream_delta_indexes_calls() {
        let calls = [call("c1", "f", json!({"x": 1})), call("c2", "g", json!({}))];
        assert_eq!(
            tool_calls_delta(&calls),
            json!({"tool_calls": [
                {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}},
                {"index": 1, "id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ]})
        );
    }
}
