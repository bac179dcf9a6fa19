//! Anthropic's Messages API: `POST /v1/messages` (whole responses and the event stream
//! `message_start`, `content_block_start`, `ping`, `content_block_delta`,
//! `content_block_stop`, `message_delta`, `message_stop`) and `POST /v1/messages/count_tokens`.
//!
//! Owns: translating Anthropic requests (system, content blocks, `tool_use`/`tool_result`,
//! tools with `input_schema`) into chat-template messages, and events into Anthropic's shapes.
//! Usage: `input_tokens` counts the prompt tokens that were prefilled,
//! `cache_read_input_tokens` those reused from the KV cache (their sum is the prompt).
//! Does not own: HTTP, generation, tool-call parsing (tools.rs).
//! Invariant: errors on this route use Anthropic's error shape.

use super::engine::{FinishReason, Finished};
use super::error::{ApiError, Dialect};
use super::http::{Conn, Request};
use super::openai::{collect, gone, text_content, wait_start};
use super::params::{self, kind, Obj};
use super::reasoning::{Piece, ReasoningFormat, ReplyStream};
use super::tools::ToolCall;
use super::{
    chat_tokens, check_model, new_id, note, submit, ChatPrompt, GenRequest, Handled, Shared, Step,
};
use serde_json::{json, Map, Value};

/// The prompt's tokens and, when tools are on, the tools (in the OpenAI shape templates take).
fn prompt(sh: &Shared, o: &Obj) -> Result<(ChatPrompt, Option<Vec<Value>>), ApiError> {
    let mut msgs: Vec<Value> = Vec::new();
    match o.get("system").filter(|v| !v.is_null()) {
        None => {}
        Some(s) => {
            let text = text_content(Some(s), "system")
                .map_err(|e| ApiError::param("system", e.message))?;
            msgs.push(json!({ "role": "system", "content": text }));
        }
    }
    let messages = match params::req(o, "messages")? {
        Value::Array(a) if !a.is_empty() => a,
        Value::Array(_) => return Err(ApiError::param("messages", "`messages` is empty")),
        v => {
            return Err(ApiError::param(
                "messages",
                format!("`messages` must be an array, got {}", kind(v)),
            ))
        }
    };
    for (i, m) in messages.iter().enumerate() {
        convert_message(i, m, &mut msgs)?;
    }
    let mut extra = Map::new();
    let tools_on = match o.get("tool_choice").filter(|v| !v.is_null()) {
        None => true,
        Some(tc) => match tc.get("type").and_then(Value::as_str) {
            Some("auto") => true,
            Some("none") => false,
            _ => return Err(ApiError::param("tool_choice", format!("`tool_choice` {tc} is not supported (only auto and none): forcing a call needs constrained decoding"))),
        },
    };
    let tools = tools(o)?;
    let tools_on = tools_on && !tools.is_empty();
    if tools_on {
        extra.insert("tools".into(), Value::Array(tools.clone()));
    }
    if let Some(t) = o.get("thinking").filter(|v| !v.is_null()) {
        match t.get("type").and_then(Value::as_str) {
            Some("enabled") => extra.insert("enable_thinking".into(), json!(true)),
            Some("disabled") => extra.insert("enable_thinking".into(), json!(false)),
            _ => {
                return Err(ApiError::param(
                    "thinking",
                    "`thinking.type` must be \"enabled\" or \"disabled\"",
                ))
            }
        };
    }
    Ok((chat_tokens(sh, &msgs, &extra)?, tools_on.then_some(tools)))
}

/// Anthropic tools (`name`, `description`, `input_schema`) in the OpenAI shape chat templates
/// are written for.
fn tools(o: &Obj) -> Result<Vec<Value>, ApiError> {
    let Some(t) = o.get("tools").filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let Value::Array(list) = t else {
        return Err(ApiError::param(
            "tools",
            format!("`tools` must be an array, got {}", kind(t)),
        ));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let (Some(name), Some(schema)) = (
            tool.get("name").and_then(Value::as_str),
            tool.get("input_schema"),
        ) else {
            return Err(ApiError::param(
                "tools",
                format!(
                    "`tools[{i}]` needs `name` and `input_schema` (server tools are not supported)"
                ),
            ));
        };
        let mut f = json!({ "name": name, "parameters": schema });
        if let Some(d) = tool.get("description").and_then(Value::as_str) {
            f["description"] = json!(d);
        }
        out.push(json!({ "type": "function", "function": f }));
    }
    Ok(out)
}

/// One Anthropic message as template messages (a user turn with tool results becomes `tool`
/// messages followed by the user's text).
fn convert_message(i: usize, m: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let at = |what: &str| format!("messages[{i}]{what}");
    let role = match m.get("role") {
        Some(Value::String(r)) if r == "user" || r == "assistant" => r.as_str(),
        Some(v) => {
            return Err(ApiError::param(
                "messages",
                format!(
                    "`{}` must be \"user\" or \"assistant\", got {v}",
                    at(".role")
                ),
            ))
        }
        None => {
            return Err(ApiError::param(
                "messages",
                format!("`{}` is missing", at(".role")),
            ))
        }
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({ "role": role, "content": s }));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        Some(v) => {
            return Err(ApiError::param(
                "messages",
                format!(
                    "`{}` must be a string or a list of blocks, got {}",
                    at(".content"),
                    kind(v)
                ),
            ))
        }
        None => {
            return Err(ApiError::param(
                "messages",
                format!("`{}` is missing", at(".content")),
            ))
        }
    };
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let here = at(&format!(".content[{j}]"));
        match b.get("type").and_then(Value::as_str) {
            Some("text") => match b.get("text").and_then(Value::as_str) {
                Some(t) => text.push_str(t),
                None => {
                    return Err(ApiError::param(
                        "messages",
                        format!("`{here}.text` must be a string"),
                    ))
                }
            },
            Some("tool_use") if role == "assistant" => {
                let (Some(id), Some(name)) = (
                    b.get("id").and_then(Value::as_str),
                    b.get("name").and_then(Value::as_str),
                ) else {
                    return Err(ApiError::param(
                        "messages",
                        format!("`{here}` (tool_use) needs `id` and `name`"),
                    ));
                };
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({ "id": id, "type": "function", "function": { "name": name, "arguments": input } }));
            }
            Some("tool_result") if role == "user" => {
                let Some(id) = b.get("tool_use_id").and_then(Value::as_str) else {
                    return Err(ApiError::param(
                        "messages",
                        format!("`{here}` (tool_result) needs `tool_use_id`"),
                    ));
                };
                let content = text_content(b.get("content"), &format!("{here}.content"))?;
                out.push(json!({ "role": "tool", "content": content, "tool_call_id": id }));
            }
            Some("thinking") if role == "assistant" => {
                if let Some(t) = b.get("thinking").and_then(Value::as_str) {
                    reasoning.push_str(t);
                }
            }
            Some("redacted_thinking") if role == "assistant" => {}
            Some(t) => {
                return Err(ApiError::param(
                    "messages",
                    format!("`{here}` is a {t:?} block: not supported in a {role} message here"),
                ))
            }
            None => {
                return Err(ApiError::param(
                    "messages",
                    format!("`{here}` has no `type`"),
                ))
            }
        }
    }
    if role == "user" && text.is_empty() && out.last().is_some_and(|m| m["role"] == "tool") {
        return Ok(());
    }
    let mut msg = json!({ "role": role, "content": text });
    if !calls.is_empty() {
        msg["tool_calls"] = Value::Array(calls);
    }
    if !reasoning.is_empty() {
        msg["reasoning_content"] = json!(reasoning);
    }
    out.push(msg);
    Ok(())
}

fn usage(f: &Finished) -> Value {
    json!({
        "input_tokens": f.prefilled,
        "output_tokens": f.completion_tokens,
        "cache_read_input_tokens": f.reused,
        "cache_creation_input_tokens": 0,
    })
}

fn stop_reason(r: &FinishReason) -> (&'static str, Value) {
    match r {
        FinishReason::Length => ("max_tokens", Value::Null),
        FinishReason::Stop(s) => ("stop_sequence", json!(s)),
        _ => ("end_turn", Value::Null),
    }
}

fn tool_use_block(c: &ToolCall) -> Value {
    json!({ "type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments })
}

/// A whole reply's content blocks (a text block unless the reply is only calls, then one
/// `tool_use` block per call), `stop_reason` (`tool_use` when it made calls) and
/// `stop_sequence`.
fn reply_shape(
    text: String,
    calls: &[ToolCall],
    r: &FinishReason,
) -> (Vec<Value>, &'static str, Value) {
    let mut content = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        content.push(json!({ "type": "text", "text": text }));
    }
    content.extend(calls.iter().map(tool_use_block));
    let (reason, seq) = reply_stop(r, calls);
    (content, reason, seq)
}

/// `stop_reason` and `stop_sequence` of a reply that made `calls`.
fn reply_stop(r: &FinishReason, calls: &[ToolCall]) -> (&'static str, Value) {
    if calls.is_empty() {
        stop_reason(r)
    } else {
        ("tool_use", Value::Null)
    }
}

/// The stream events of a reply's calls: for each, a `tool_use` block starting at index
/// `first`, its input as one `input_json_delta`, its stop.
fn tool_use_events(calls: &[ToolCall], first: usize) -> Vec<(&'static str, Value)> {
    let mut out = Vec::with_capacity(3 * calls.len());
    for (i, c) in calls.iter().enumerate() {
        let idx = first + i;
        let block = json!({ "type": "tool_use", "id": c.id, "name": c.name, "input": {} });
        out.push((
            "content_block_start",
            json!({ "type": "content_block_start", "index": idx, "content_block": block }),
        ));
        out.push(("content_block_delta", json!({ "type": "content_block_delta", "index": idx, "delta": { "type": "input_json_delta", "partial_json": c.arguments_text() } })));
        out.push((
            "content_block_stop",
            json!({ "type": "content_block_stop", "index": idx }),
        ));
    }
    out
}

/// `POST /v1/messages`.
pub fn messages(
    sh: &Shared,
    req: &Request,
    conn: &mut Conn,
    keep: bool,
) -> Result<Handled, ApiError> {
    let o = params::parse_object(&req.body)?;
    check_model(sh, &o)?;
    let max_tokens = match params::opt_u64(&o, "max_tokens")? {
        Some(m) => m,
        None => {
            return Err(ApiError::param(
                "max_tokens",
                "missing required field `max_tokens`",
            ))
        }
    };
    let (prompt, tools) = prompt(sh, &o)?;
    let reasoning = sh.reasoning.map(|f| (f, prompt.opens_reasoning));
    let harmony = matches!(reasoning, Some((ReasoningFormat::Harmony, _)));
    let g = GenRequest {
        tokens: prompt.tokens,
        max_tokens: Some(max_tokens),
        sampling: params::sampling(&o, &sh.cfg.sampling)?,
        stop: params::stop_list(&o, "stop_sequences")?,
        ignore_eos: params::opt_bool(&o, "ignore_eos")?.unwrap_or(false),
        // Harmony's channel markers are control tokens: the split needs them in the text.
        special: tools.is_some() || harmony,
    };
    let stream = params::opt_bool(&o, "stream")?.unwrap_or(false);
    let p = submit(sh, g, conn)?;
    let (reused, prefilled) = match wait_start(&p, conn) {
        Ok(s) => s,
        Err(h) => return h,
    };
    let id = new_id("msg_");
    let model = sh.cfg.model_id.as_str();
    let tool_id = || new_id("toolu_");
    if !stream {
        let (text, fin) = match collect(&p, conn) {
            Ok(x) => x,
            Err(h) => return h,
        };
        let reply = ReplyStream::new(reasoning, sh.tool_format, tools);
        let (thought, text, calls) = reply.whole(&text, &mut || tool_id());
        let (mut content, reason, seq) = reply_shape(text, &calls, &fin.reason);
        if !thought.is_empty() {
            // A reply cut off while thinking has only its thinking block (as streamed).
            content.retain(|b| b != &json!({ "type": "text", "text": "" }));
            content.insert(0, thinking_block(&thought));
        }
        let body = json!({
            "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": usage(&fin),
        });
        let mut h = super::send_json(conn, 200, &body, keep);
        h.note = note(&fin);
        return Ok(h);
    }

    if conn.start_chunks(200, "text/event-stream").is_err() {
        return Ok(gone(&p));
    }
    let start = json!({
        "type": "message_start",
        "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": { "input_tokens": prefilled, "output_tokens": 0, "cache_read_input_tokens": reused, "cache_creation_input_tokens": 0 },
        }
    });
    // Without a reasoning format the text block opens at once (index 0); with one, blocks
    // open as pieces arrive: a `thinking` block, then the `text` block.
    let mut blocks = Blocks::default();
    let mut ok = event(conn, "message_start", &start);
    if reasoning.is_none() {
        ok = ok && blocks.open(conn, false);
    }
    if !(ok && event(conn, "ping", &json!({ "type": "ping" }))) {
        return Ok(gone(&p));
    }
    let mut split = Some(ReplyStream::new(reasoning, sh.tool_format, tools));
    loop {
        match p.next(conn) {
            Step::Text(t) => {
                let pieces = split.as_mut().map(|s| s.push(&t)).unwrap_or_default();
                for piece in pieces {
                    if !blocks.piece(conn, piece) {
                        return Ok(gone(&p));
                    }
                }
            }
            Step::Done(fin) => {
                if fin.reason == FinishReason::Cancelled {
                    let e = ApiError::new(503, "the server is shutting down; generation cancelled");
                    let _ = event(conn, "error", &e.to_json(Dialect::Anthropic));
                    let _ = conn.end_chunks();
                    return Ok(Handled {
                        status: 200,
                        close: true,
                        note: note(&fin),
                    });
                }
                let mut calls = Vec::new();
                if let Some(s) = split.take() {
                    let (rest, c) = s.finish(&mut || tool_id());
                    for piece in rest {
                        if !blocks.piece(conn, piece) {
                            return Ok(gone(&p));
                        }
                    }
                    calls = c;
                }
                // A reply with neither text nor calls still has its (empty) text block.
                let mut ok = true;
                if blocks.next == 0 && calls.is_empty() {
                    ok = blocks.open(conn, false);
                }
                ok = ok && blocks.close(conn);
                for (name, data) in tool_use_events(&calls, blocks.next) {
                    ok = ok && event(conn, name, &data);
                }
                let (reason, seq) = reply_stop(&fin.reason, &calls);
                let delta = json!({
                    "type": "message_delta",
                    "delta": { "stop_reason": reason, "stop_sequence": seq },
                    "usage": usage(&fin),
                });
                ok = ok
                    && event(conn, "message_delta", &delta)
                    && event(conn, "message_stop", &json!({ "type": "message_stop" }));
                let ok = ok && conn.end_chunks().is_ok();
                return Ok(Handled {
                    status: 200,
                    close: !ok,
                    note: note(&fin),
                });
            }
            Step::Failed(e) => {
                let _ = event(conn, "error", &e.to_json(Dialect::Anthropic));
                let _ = conn.end_chunks();
                return Ok(Handled {
                    status: 200,
                    close: true,
                    note: format!(" error mid-stream: {}", e.message),
                });
            }
            Step::Gone => return Ok(gone(&p)),
            Step::Started { .. } => {}
        }
    }
}

/// A thinking block of a whole reply (the signature is empty: this server signs nothing).
fn thinking_block(thought: &str) -> Value {
    json!({ "type": "thinking", "thinking": thought, "signature": "" })
}

/// The content blocks of a streamed reply: which one is open, and the next index.
#[derive(Default)]
struct Blocks {
    /// The open block: true for thinking, false for text.
    open: Option<bool>,
    next: usize,
}

impl Blocks {
    /// Open a thinking (`thinking`) or text block at the next index. False if the client is
    /// gone.
    fn open(&mut self, conn: &mut Conn, thinking: bool) -> bool {
        let block = if thinking {
            json!({ "type": "thinking", "thinking": "", "signature": "" })
        } else {
            json!({ "type": "text", "text": "" })
        };
        let e =
            json!({ "type": "content_block_start", "index": self.next, "content_block": block });
        self.open = Some(thinking);
        self.next += 1;
        event(conn, "content_block_start", &e)
    }

    fn close(&mut self, conn: &mut Conn) -> bool {
        match self.open.take() {
            None => true,
            Some(_) => event(
                conn,
                "content_block_stop",
                &json!({ "type": "content_block_stop", "index": self.next - 1 }),
            ),
        }
    }

    /// Send a piece, in the open block if it is of its kind, else in a new one.
    fn piece(&mut self, conn: &mut Conn, p: Piece) -> bool {
        let (thinking, delta) = match &p {
            Piece::Reasoning(t) => (true, json!({ "type": "thinking_delta", "thinking": t })),
            Piece::Content(t) => (false, json!({ "type": "text_delta", "text": t })),
        };
        if self.open != Some(thinking) && !(self.close(conn) && self.open(conn, thinking)) {
            return false;
        }
        let e = json!({ "type": "content_block_delta", "index": self.next - 1, "delta": delta });
        event(conn, "content_block_delta", &e)
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's length after the chat template.
pub fn count_tokens(
    sh: &Shared,
    req: &Request,
    conn: &mut Conn,
    keep: bool,
) -> Result<Handled, ApiError> {
    let o = params::parse_object(&req.body)?;
    check_model(sh, &o)?;
    let (prompt, _) = prompt(sh, &o)?;
    Ok(super::send_json(
        conn,
        200,
        &json!({ "input_tokens": prompt.tokens.len() }),
        keep,
    ))
}

/// One named server-sent event. False if the client is gone.
fn event(conn: &mut Conn, name: &str, data: &Value) -> bool {
    conn.chunk(format!("event: {name}\ndata: {data}\n\n").as_bytes())
        .is_ok()
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
    fn whole_reply_blocks_and_stop_reason() {
        let (content, reason, seq) = reply_shape("hi".into(), &[], &FinishReason::Eos);
        assert_eq!(content, vec![json!({"type": "text", "text": "hi"})]);
        assert_eq!((reason, seq), ("end_turn", Value::Null));
        let (content, reason, seq) =
            reply_shape(String::new(), &[], &FinishReason::Stop("##".into()));
        assert_eq!(content, vec![json!({"type": "text", "text": ""})]);
        assert_eq!((reason, seq), ("stop_sequence", json!("##")));

        let calls = [
            call("toolu_1", "get_weather", json!({"city": "Paris"})),
            call("toolu_2", "now", json!({})),
        ];
        let (content, reason, seq) = reply_shape(String::new(), &calls, &FinishReason::Eos);
        assert_eq!(
            content,
            vec![
                json!({"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}),
                json!({"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}),
            ]
        );
        assert_eq!((reason, seq), ("tool_use", Value::Null));
        let (content, reason, _) =
            reply_shape("Let me look.".into(), &calls[..1], &FinishReason::Length);
        assert_eq!(content[0], json!({"type": "text", "text": "Let me look."}));
        assert_eq!(content[1]["type"], "tool_use");
        assert_eq!(reason, "tool_use");
    }

    #[test]
    fn stream_events_of_calls() {
        let calls = [call("toolu_1", "f", json!({"x": [1, 2]}))];
        let ev = tool_use_events(&calls, 1);
        let names: Vec<&str> = ev.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "content_block_start",
                "content_block_delta",
                "content_block_stop"
            ]
        );
        assert_eq!(
            ev[0].1,
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}})
        );
        assert_eq!(
            ev[1].1,
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"x\":[1,2]}"}})
        );
        assert_eq!(ev[2].1, json!({"type": "content_block_stop", "index": 1}));
        assert!(tool_use_events(&[], 1).is_empty());
    }
}
