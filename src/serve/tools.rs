//! Tool calls in generated text. Parsed format: Qwen3's (also Qwen2.5 and Hermes 2 Pro's),
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call.
//! Other families' formats are returned as plain text.
//!
//! Owns: `ToolSplitter` (streams the text before the first `<tool_call>` and keeps the rest)
//! and `parse_tool_calls`. Does not own: how calls are shaped for each API (openai.rs,
//! anthropic.rs). Invariant: text that does not parse as tool calls is never lost: it comes
//! back as content.

use serde_json::Value;

pub const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON object (`{}` when the model gave none).
    pub arguments: Value,
}

impl ToolCall {
    /// Arguments as JSON text (OpenAI's `function.arguments`).
    pub fn arguments_text(&self) -> String {
        self.arguments.to_string()
    }
}

/// Split `text` into content and tool calls. None when it holds no `<tool_call>` block or a
/// block is not a JSON object with a string `name`.
pub fn parse_tool_calls(
    text: &str,
    new_id: &mut dyn FnMut() -> String,
) -> Option<(String, Vec<ToolCall>)> {
    let first = text.find(OPEN)?;
    let mut content = text[..first].to_string();
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(at) = rest.find(OPEN) {
        let between = &rest[..at];
        if !between.trim().is_empty() {
            content.push_str(between);
        }
        let body_start = &rest[at + OPEN.len()..];
        let (body, after) = match body_start.find(CLOSE) {
            Some(end) => (&body_start[..end], &body_start[end + CLOSE.len()..]),
            None => (body_start, ""),
        };
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(Value::String(s)) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
            Some(a) => a.clone(),
        };
        calls.push(ToolCall {
            id: new_id(),
            name,
            arguments,
        });
        rest = after;
    }
    if !rest.trim().is_empty() {
        content.push_str(rest);
    }
    Some((content, calls))
}

/// Streams content up to the first `<tool_call>` and holds everything from there on.
#[derive(Default)]
pub struct ToolSplitter {
    pending: String,
    held: Option<String>,
}

impl ToolSplitter {
    /// Add generated text; returns the content that can go out now.
    pub fn push(&mut self, text: &str) -> String {
        if let Some(h) = &mut self.held {
            h.push_str(text);
            return String::new();
        }
        self.pending.push_str(text);
        if let Some(at) = self.pending.find(OPEN) {
            self.held = Some(self.pending[at..].to_string());
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return out;
        }
        // Keep a tail that could be the start of `<tool_call>`.
        let keep = (1..OPEN.len())
            .rev()
            .find(|&k| {
                k <= self.pending.len()
                    && self.pending.is_char_boundary(self.pending.len() - k)
                    && self.pending.ends_with(&OPEN[..k])
            })
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        out
    }

    /// The end of the text: remaining content (text that did not parse as tool calls comes
    /// back here) and the calls.
    pub fn finish(self, new_id: &mut dyn FnMut() -> String) -> (String, Vec<ToolCall>) {
        match self.held {
            None => (self.pending, Vec::new()),
            Some(h) => match parse_tool_calls(&h, new_id) {
                Some((content, calls)) => (content, calls),
                None => (h, Vec::new()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("call_{n}")
        }
    }

    #[test]
    fn qwen3_tool_calls() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse_tool_calls(text, &mut ids()).unwrap();
        assert_eq!(content, "Let me check.\n");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments_text(), r#"{"city":"Paris"}"#);
        assert_eq!(calls[1].id, "call_2");
    }

    #[test]
    fn bad_json_stays_text() {
        let mut s = ToolSplitter::default();
        let mut out = s.push("hi <tool_");
        out += &s.push("call>{not json</tool_call>");
        assert_eq!(out, "hi ");
        let (rest, calls) = s.finish(&mut ids());
        assert!(calls.is_empty());
        assert_eq!(rest, "<tool_call>{not json</tool_call>");
    }

    #[test]
    fn splitter_streams_content_and_holds_calls() {
        let mut s = ToolSplitter::default();
        let mut out = String::new();
        for p in [
            "Sure",
            " <",
            "tool_call>\n{\"name\":",
            " \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call>",
        ] {
            out += &s.push(p);
        }
        assert_eq!(out, "Sure ");
        let (rest, calls) = s.finish(&mut ids());
        assert_eq!(rest, "");
        assert_eq!(calls[0].name, "f");
        assert_eq!(calls[0].arguments, serde_json::json!({"x": 1}));
        let mut plain = ToolSplitter::default();
        assert_eq!(plain.push("a <b"), "a <b");
    }
}
