//! Tool calls in generated text, in the format each model family was trained to write them.
//!
//! Formats parsed (the chat template says which, see `ToolFormat::detect`):
//! - `Hermes`: Qwen3, Qwen2.5, QwQ, Hermes 2 Pro/3:
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call.
//! - `Glm45`: GLM-4.5/4.6/4.7: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>
//!   ...</tool_call>`; a value is JSON unless the tool's schema says the parameter is a string
//!   (the template writes strings raw and everything else as JSON).
//! - `DeepSeek`: DeepSeek-V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>
//!   {json}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; the V3/R1 variant
//!   (`function<｜tool▁sep｜>NAME\n```json\n{json}\n````) inside the same markers is read too.
//!
//! Owns: `ToolFormat` (choice and parsing) and `ToolSplitter` (streams the text before the first
//! call marker and keeps the rest). Does not own: how calls are shaped for each API (openai.rs,
//! anthropic.rs).
//! Invariant: text that does not parse as tool calls is never lost: it comes back as content.

use crate::model::Family;
use serde_json::{Map, Value};

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const ARG_KEY: (&str, &str) = ("<arg_key>", "</arg_key>");
const ARG_VALUE: (&str, &str) = ("<arg_value>", "</arg_value>");
const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";

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

/// How a model writes its tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Glm45,
    DeepSeek,
}

impl ToolFormat {
    /// The format the chat template teaches (its markers), else the architecture's usual one,
    /// else Hermes' (the most widely copied).
    pub fn detect(template: Option<&str>, family: Family) -> ToolFormat {
        let t = template.unwrap_or("");
        if t.contains(ARG_KEY.0) {
            ToolFormat::Glm45
        } else if t.contains(DS_SEP) {
            ToolFormat::DeepSeek
        } else if t.contains(HERMES_OPEN) {
            ToolFormat::Hermes
        } else {
            match family {
                Family::Glm4Moe | Family::GlmDsa => ToolFormat::Glm45,
                Family::DeepseekV3 => ToolFormat::DeepSeek,
                _ => ToolFormat::Hermes,
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes (<tool_call>{json}</tool_call>)",
            ToolFormat::Glm45 => "glm-4.5 (<tool_call>NAME<arg_key>..)",
            ToolFormat::DeepSeek => "deepseek-v3.1 (<｜tool▁calls▁begin｜>..)",
        }
    }

    /// The text that starts the tool-call part of a reply.
    fn open(self) -> &'static str {
        match self {
            ToolFormat::Hermes | ToolFormat::Glm45 => HERMES_OPEN,
            ToolFormat::DeepSeek => DS_CALLS_BEGIN,
        }
    }

    /// Split `text` into content and tool calls. None when it holds no call marker or a call is
    /// malformed (the caller then keeps the whole text as content). `tools`: the request's
    /// tools in OpenAI's shape (GLM's string parameters are read through their schema).
    pub fn parse(
        self,
        text: &str,
        tools: &[Value],
        new_id: &mut dyn FnMut() -> String,
    ) -> Option<(String, Vec<ToolCall>)> {
        let first = text.find(self.open())?;
        let mut content = text[..first].to_string();
        let (calls, after) = match self {
            ToolFormat::Hermes => blocks(&text[first..], &mut content, hermes_call)?,
            ToolFormat::Glm45 => blocks(&text[first..], &mut content, |b| glm_call(b, tools))?,
            ToolFormat::DeepSeek => deepseek_calls(&text[first + DS_CALLS_BEGIN.len()..])?,
        };
        if !after.trim().is_empty() {
            content.push_str(after);
        }
        let calls = calls
            .into_iter()
            .map(|(name, arguments)| ToolCall {
                id: new_id(),
                name,
                arguments,
            })
            .collect();
        Some((content, calls))
    }
}

/// `<tool_call>BODY</tool_call>` blocks (Hermes, GLM): each body through `call`; text between
/// blocks goes to `content`. Returns the calls and the text after the last block.
fn blocks<'a>(
    mut rest: &'a str,
    content: &mut String,
    call: impl Fn(&str) -> Option<(String, Value)>,
) -> Option<(Vec<(String, Value)>, &'a str)> {
    let mut calls = Vec::new();
    while let Some(at) = rest.find(HERMES_OPEN) {
        let between = &rest[..at];
        if !between.trim().is_empty() {
            content.push_str(between);
        }
        let body_start = &rest[at + HERMES_OPEN.len()..];
        let (body, after) = match body_start.find(HERMES_CLOSE) {
            Some(end) => (&body_start[..end], &body_start[end + HERMES_CLOSE.len()..]),
            None => (body_start, ""),
        };
        calls.push(call(body)?);
        rest = after;
    }
    Some((calls, rest))
}

/// `{"name": ..., "arguments": {...}}` (or `parameters`).
fn hermes_call(body: &str) -> Option<(String, Value)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = arguments(v.get("arguments").or_else(|| v.get("parameters")))?;
    Some((name, args))
}

/// `NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>...` (the text inside `<tool_call>`).
fn glm_call(body: &str, tools: &[Value]) -> Option<(String, Value)> {
    let name_end = body.find(ARG_KEY.0).unwrap_or(body.len());
    let name = body[..name_end].trim();
    if name.is_empty() || name.contains(char::is_whitespace) || name.contains('<') {
        return None;
    }
    let props = tools
        .iter()
        .filter_map(|t| t.get("function"))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(name))
        .and_then(|f| f.get("parameters"))
        .and_then(|p| p.get("properties"));
    let mut args = Map::new();
    let mut rest = &body[name_end..];
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let (key, after) = tagged(rest, ARG_KEY)?;
        let (raw, after) = tagged(after.trim_start(), ARG_VALUE)?;
        let is_string = props
            .and_then(|p| p.get(key.trim()))
            .and_then(|s| s.get("type"))
            .and_then(Value::as_str)
            == Some("string");
        let value = match serde_json::from_str::<Value>(raw) {
            Ok(v) if !is_string => v,
            _ => Value::String(raw.to_string()),
        };
        args.insert(key.trim().to_string(), value);
        rest = after;
    }
    Some((name.to_string(), Value::Object(args)))
}

/// `OPEN inner CLOSE` at the start of `s`: (inner, what follows).
fn tagged<'a>(s: &'a str, (open, close): (&str, &str)) -> Option<(&'a str, &'a str)> {
    let s = s.strip_prefix(open)?;
    let end = s.find(close)?;
    Some((&s[..end], &s[end + close.len()..]))
}

/// The calls after `<｜tool▁calls▁begin｜>`, and the text after `<｜tool▁calls▁end｜>`.
fn deepseek_calls(region: &str) -> Option<(Vec<(String, Value)>, &str)> {
    let (mut rest, after) = match region.find(DS_CALLS_END) {
        Some(end) => (&region[..end], &region[end + DS_CALLS_END.len()..]),
        None => (region, ""),
    };
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let (inner, next) = tagged(rest, (DS_CALL_BEGIN, DS_CALL_END))?;
        let (head, body) = inner.split_once(DS_SEP)?;
        let (name, args) = match serde_json::from_str::<Value>(body.trim()) {
            // V3.1: NAME<sep>{json}
            Ok(v) => (head.trim(), arguments(Some(&v))?),
            // V3/R1: function<sep>NAME\n```json\n{json}\n```
            Err(_) if head.trim() == "function" => {
                let (name, fenced) = body.split_once('\n')?;
                let json = fenced.trim().strip_prefix("```json")?.strip_suffix("```")?;
                let v: Value = serde_json::from_str(json.trim()).ok()?;
                (name.trim(), arguments(Some(&v))?)
            }
            Err(_) => return None,
        };
        if name.is_empty() || name.contains(char::is_whitespace) {
            return None;
        }
        calls.push((name.to_string(), args));
        rest = next;
    }
    if calls.is_empty() {
        return None;
    }
    Some((calls, after))
}

/// Arguments as an object: absent or null is `{}`, a JSON string holding an object is decoded;
/// anything else is malformed.
fn arguments(v: Option<&Value>) -> Option<Value> {
    match v {
        None | Some(Value::Null) => Some(Value::Object(Map::new())),
        Some(Value::Object(_)) => v.cloned(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(o @ Value::Object(_)) => Some(o),
            _ => None,
        },
        Some(_) => None,
    }
}

/// Streams content up to the first call marker and holds everything from there on.
pub struct ToolSplitter {
    format: ToolFormat,
    tools: Vec<Value>,
    pending: String,
    held: Option<String>,
}

impl ToolSplitter {
    pub fn new(format: ToolFormat, tools: Vec<Value>) -> ToolSplitter {
        ToolSplitter {
            format,
            tools,
            pending: String::new(),
            held: None,
        }
    }

    /// Add generated text; returns the content that can go out now.
    pub fn push(&mut self, text: &str) -> String {
        if let Some(h) = &mut self.held {
            h.push_str(text);
            return String::new();
        }
        let open = self.format.open();
        self.pending.push_str(text);
        if let Some(at) = self.pending.find(open) {
            self.held = Some(self.pending[at..].to_string());
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return out;
        }
        // Keep a tail that could be the start of the marker.
        let cut = safe_cut(&self.pending, &[open]);
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        out
    }

    /// The end of the text: remaining content (text that did not parse as tool calls comes
    /// back here) and the calls.
    pub fn finish(self, new_id: &mut dyn FnMut() -> String) -> (String, Vec<ToolCall>) {
        match self.held {
            None => (self.pending, Vec::new()),
            Some(h) => match self.format.parse(&h, &self.tools, new_id) {
                Some((content, calls)) => (content, calls),
                None => (h, Vec::new()),
            },
        }
    }
}

/// How much of `s` can go out now: all but the longest tail that could be the start of one of
/// `markers`.
pub(super) fn safe_cut(s: &str, markers: &[&str]) -> usize {
    let keep = markers
        .iter()
        .map(|m| {
            (1..m.len())
                .rev()
                .find(|&k| {
                    k <= s.len()
                        && m.is_char_boundary(k)
                        && s.is_char_boundary(s.len() - k)
                        && s.ends_with(&m[..k])
                })
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0);
    s.len() - keep
}

/// Content and calls of a whole reply: the calls parsed in `format`, or the text as it is.
/// (Replies go through `reasoning::ReplyStream`; this is the tests' shorthand.)
#[cfg(test)]
fn split_reply(
    format: ToolFormat,
    text: String,
    tools: &[Value],
    new_id: &mut dyn FnMut() -> String,
) -> (String, Vec<ToolCall>) {
    match format.parse(&text, tools, new_id) {
        Some(x) => x,
        None => (text, Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ids() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("call_{n}")
        }
    }

    fn parse(f: ToolFormat, text: &str, tools: &[Value]) -> Option<(String, Vec<ToolCall>)> {
        f.parse(text, tools, &mut ids())
    }

    fn weather_tool() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "code": {"type": "string"}}
            }}}),
        ]
    }

    #[test]
    fn detection_follows_the_template_then_the_family() {
        let t = |s: &str| ToolFormat::detect(Some(s), Family::Qwen3Moe);
        assert_eq!(
            t("x<tool_call>{{ tool_call | tojson }}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            t("<tool_call>{name}\n<arg_key>k</arg_key>"),
            ToolFormat::Glm45
        );
        assert_eq!(
            t("<｜tool▁call▁begin｜>'+ name + '<｜tool▁sep｜>'"),
            ToolFormat::DeepSeek
        );
        assert_eq!(
            ToolFormat::detect(Some("plain"), Family::Glm4Moe),
            ToolFormat::Glm45
        );
        assert_eq!(
            ToolFormat::detect(None, Family::DeepseekV3),
            ToolFormat::DeepSeek
        );
        assert_eq!(
            ToolFormat::detect(None, Family::Mixtral),
            ToolFormat::Hermes
        );
    }

    #[test]
    fn qwen3_tool_calls() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse(ToolFormat::Hermes, text, &[]).unwrap();
        assert_eq!(content, "Let me check.\n");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments_text(), r#"{"city":"Paris"}"#);
        assert_eq!(calls[1].id, "call_2");
        assert_eq!(calls[1].arguments, json!({}));
    }

    #[test]
    fn glm_tool_calls() {
        // As GLM-4.6's template writes an assistant turn with two calls.
        let text = "I will look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>code</arg_key>\n<arg_value>75</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>zones</arg_key>\n<arg_value>[\"UTC\", \"CET\"]</arg_value>\n</tool_call>";
        let (content, calls) = parse(ToolFormat::Glm45, text, &weather_tool()).unwrap();
        assert_eq!(content, "I will look.\n");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        // `code` is a string in the schema: "75" stays text; `days` is JSON.
        assert_eq!(
            calls[0].arguments,
            json!({"city": "Paris", "days": 3, "code": "75"})
        );
        assert_eq!(calls[1].name, "get_time");
        assert_eq!(calls[1].arguments, json!({"zones": ["UTC", "CET"]}));
        // No arguments at all.
        let (c, calls) = parse(ToolFormat::Glm45, "<tool_call>now\n</tool_call>", &[]).unwrap();
        assert_eq!((c.as_str(), calls[0].arguments.clone()), ("", json!({})));
    }

    #[test]
    fn deepseek_tool_calls() {
        let text = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (content, calls) = parse(ToolFormat::DeepSeek, text, &[]).unwrap();
        assert_eq!(content, "Checking.");
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.clone()),
            ("get_weather", json!({"city": "Paris"}))
        );
        assert_eq!(calls[1].name, "now");
        // The V3/R1 form inside the same markers.
        let r1 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Oslo\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (content, calls) = parse(ToolFormat::DeepSeek, r1, &[]).unwrap();
        assert_eq!(content, "");
        assert_eq!(calls[0].arguments, json!({"city": "Oslo"}));
    }

    #[test]
    fn malformed_calls_stay_text() {
        let cases = [
            (ToolFormat::Hermes, "hi <tool_call>{not json</tool_call>"),
            (
                ToolFormat::Hermes,
                "<tool_call>{\"name\": \"f\", \"arguments\": 5}</tool_call>",
            ),
            (ToolFormat::Glm45, "<tool_call>f\n<arg_key>a</arg_key>"),
            (
                ToolFormat::Glm45,
                "<tool_call>f\n<arg_value>1</arg_value></tool_call>",
            ),
            (ToolFormat::Glm45, "<tool_call>\n</tool_call>"),
            (
                ToolFormat::DeepSeek,
                "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜>",
            ),
            (
                ToolFormat::DeepSeek,
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f{}<｜tool▁call▁end｜>",
            ),
            (ToolFormat::DeepSeek, "<｜tool▁calls▁begin｜>"),
        ];
        for (f, text) in cases {
            assert_eq!(parse(f, text, &[]), None, "{f:?} {text}");
            let (content, calls) = split_reply(f, text.to_string(), &[], &mut ids());
            assert_eq!((content.as_str(), calls.len()), (text, 0));
            // Streamed: all of it comes back, part early, the rest at the end.
            let mut s = ToolSplitter::new(f, Vec::new());
            let mut out = String::new();
            for ch in text.chars() {
                out += &s.push(&ch.to_string());
            }
            let (rest, calls) = s.finish(&mut ids());
            assert!(calls.is_empty());
            assert_eq!(out + &rest, text, "{f:?}");
        }
        // No marker at all: not a tool reply.
        assert_eq!(parse(ToolFormat::DeepSeek, "plain <tool_call>", &[]), None);
    }

    #[test]
    fn splitter_streams_content_and_holds_calls() {
        let mut s = ToolSplitter::new(ToolFormat::Hermes, Vec::new());
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
        assert_eq!(calls[0].arguments, json!({"x": 1}));
        let mut plain = ToolSplitter::new(ToolFormat::Hermes, Vec::new());
        assert_eq!(plain.push("a <b"), "a <b");
        // A multi-byte marker split inside a character.
        let mut ds = ToolSplitter::new(ToolFormat::DeepSeek, Vec::new());
        let text = "ok <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜> after";
        let mut out = String::new();
        for ch in text.chars() {
            out += &ds.push(&ch.to_string());
        }
        assert_eq!(out, "ok ");
        let (rest, calls) = ds.finish(&mut ids());
        assert_eq!((rest.as_str(), calls.len()), (" after", 1));
    }
}
