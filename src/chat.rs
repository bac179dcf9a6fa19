//! Chat templates: render a model's Jinja template (from `tokenizer_config.json`,
//! `chat_template.jinja` or GGUF `tokenizer.chat_template`) over a list of messages, the way
//! transformers' `apply_chat_template` does.
//!
//! Owns: the template environment (minijinja set up like transformers' sandboxed Jinja2:
//! `trim_blocks`, `lstrip_blocks`, loop controls, Python string/dict methods,
//! `raise_exception`, `strftime_now`, a `tojson` that writes what Python's `json.dumps` writes
//! with key order kept) and the render context (`messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token`, `tools`/`documents` as none, plus caller-supplied extras).
//! Does not own: where the template comes from (tokenizer/), tokenizing the result.
//! Invariant: for the same template and messages the output equals transformers' output byte
//! for byte (tests/chat_template.rs checks real templates against recorded transformers output).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(...)` (e.g. roles that do not alternate).
    #[error("chat template refused the conversation: {0}")]
    Raised(String),
    #[error("chat template failed while rendering: {0}")]
    Render(String),
    #[error("chat template variables must be a JSON object, got {0}")]
    Extra(String),
}

/// Render `template` over `messages`. `extra`: more template variables as a JSON object (e.g.
/// `{"enable_thinking": false, "tools": [...]}`); they override the defaults.
pub fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
    extra: Option<&Json>,
) -> Result<String, ChatError> {
    let msgs: Vec<Json> = messages
        .iter()
        .map(|m| serde_json::json!({ "role": m.role, "content": m.content }))
        .collect();
    render_chat_json(
        template,
        &msgs,
        add_generation_prompt,
        bos_token,
        eos_token,
        extra,
    )
}

/// `render_chat` for messages given as arbitrary JSON objects (tool calls, tool results,
/// `reasoning_content`, list-of-parts content ...), key order kept.
pub fn render_chat_json(
    template: &str,
    messages: &[Json],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
    extra: Option<&Json>,
) -> Result<String, ChatError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    render_chat_json_at(
        template,
        messages,
        add_generation_prompt,
        bos_token,
        eos_token,
        extra,
        now,
    )
}

/// `render_chat_json` with the clock the template's `strftime_now` reads pinned to `now_unix`
/// (seconds since 1970, rendered in UTC).
pub fn render_chat_json_at(
    template: &str,
    messages: &[Json],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
    extra: Option<&Json>,
    now_unix: i64,
) -> Result<String, ChatError> {
    let mut ctx = serde_json::Map::new();
    ctx.insert(
        "messages".into(),
        Json::Array(messages.iter().map(template_message).collect()),
    );
    ctx.insert("tools".into(), Json::Null);
    ctx.insert("documents".into(), Json::Null);
    ctx.insert(
        "add_generation_prompt".into(),
        Json::Bool(add_generation_prompt),
    );
    ctx.insert("bos_token".into(), Json::String(bos_token.into()));
    ctx.insert("eos_token".into(), Json::String(eos_token.into()));
    match extra {
        None | Some(Json::Null) => {}
        Some(Json::Object(o)) => {
            for (k, v) in o {
                ctx.insert(k.clone(), v.clone());
            }
        }
        Some(other) => return Err(ChatError::Extra(other.to_string())),
    }

    let source = rewrite_generation_tags(template);
    let env = environment(now_unix);
    let tmpl = env
        .template_from_str(&source)
        .map_err(|e| ChatError::Syntax(describe(&e)))?;
    tmpl.render(Value::from(minijinja::value::Serde(Json::Object(ctx))))
        .map_err(|e| {
            if e.kind() == ErrorKind::InvalidOperation
                && e.detail().is_some_and(|d| d.starts_with(RAISED))
            {
                ChatError::Raised(
                    e.detail()
                        .unwrap_or_default()
                        .trim_start_matches(RAISED)
                        .to_string(),
                )
            } else {
                ChatError::Render(describe(&e))
            }
        })
}

/// A message as transformers hands it to the template: keys whose value is null dropped, and
/// reasoning under any of its names (`reasoning_content`, `thinking`, `reasoning`) also given
/// as `thinking` (first) and `reasoning_content`.
fn template_message(m: &Json) -> Json {
    let Json::Object(o) = m else { return m.clone() };
    let o: serde_json::Map<String, Json> = o
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| o.get(*k))
        .cloned();
    let Some(r) = reasoning else {
        return Json::Object(o);
    };
    let mut out = serde_json::Map::new();
    out.insert("thinking".into(), r.clone());
    for (k, v) in o {
        out.insert(k, v);
    }
    out.insert("reasoning_content".into(), r);
    Json::Object(out)
}

const RAISED: &str = "raise_exception: ";

/// One line: the error and where in the template it happened.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    if let Some(line) = e.line() {
        let _ = write!(s, " (template line {line})");
    }
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        let _ = write!(s, ": {inner}");
        src = inner.source();
    }
    s
}

/// transformers' `AssistantTracker` extension adds `{% generation %}...{% endgeneration %}`
/// blocks that render their body unchanged; spell them as `if true` blocks (same whitespace
/// control, same output).
fn rewrite_generation_tags(src: &str) -> std::borrow::Cow<'_, str> {
    if !src.contains("generation") {
        return std::borrow::Cow::Borrowed(src);
    }
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return std::borrow::Cow::Owned(out);
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => {
                let _ = write!(out, "{{%{lead} if true {trail}%}}");
            }
            "endgeneration" => {
                let _ = write!(out, "{{%{lead} endif {trail}%}}");
            }
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

fn environment(now_unix: i64) -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build();
    if let Ok(s) = syntax {
        env.set_syntax(s);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
        Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("{RAISED}{msg}"),
        ))
    });
    env.add_function(
        "strftime_now",
        move |fmt: String| -> Result<String, Error> { Ok(strftime_utc(now_unix, &fmt)) },
    );
    env.add_filter("tojson", tojson);
    // Jinja2's `iterable` and `sequence` tests: strings and dicts count, none does not.
    env.add_test("iterable", |v: Value| match v.kind() {
        ValueKind::Undefined
        | ValueKind::String
        | ValueKind::Bytes
        | ValueKind::Seq
        | ValueKind::Map
        | ValueKind::Iterable => true,
        ValueKind::Plain => v.try_iter().is_ok(),
        _ => false,
    });
    env.add_test("sequence", |v: Value| {
        matches!(
            v.kind(),
            ValueKind::Undefined
                | ValueKind::String
                | ValueKind::Bytes
                | ValueKind::Seq
                | ValueKind::Map
        )
    });
    env
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// i.e. Python's `json.dumps` with those arguments.
fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let mut ensure_ascii = args.first().map(|v| v.is_true()).unwrap_or(false);
    let mut indent: Option<String> = None;
    let mut sort_keys = false;
    let mut seps: Option<(String, String)> = None;
    if let Some(v) = args.get(1) {
        indent = indent_arg(v)?;
    }
    if let Some(v) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        ensure_ascii = v;
    }
    if kwargs.has("indent") {
        indent = indent_arg(&kwargs.get::<Value>("indent")?)?;
    }
    if let Some(v) = kwargs.get::<Option<bool>>("sort_keys")? {
        sort_keys = v;
    }
    if let Some(v) = kwargs.get::<Option<Vec<String>>>("separators")? {
        if let [a, b] = v.as_slice() {
            seps = Some((a.clone(), b.clone()));
        } else {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ));
        }
    }
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let (item_sep, key_sep) = seps.unwrap_or_else(|| {
        (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        )
    });
    let opts = DumpOpts {
        ensure_ascii,
        indent,
        sort_keys,
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    dump(&json, &opts, 0, &mut out);
    Ok(out)
}

fn indent_arg(v: &Value) -> Result<Option<String>, Error> {
    if v.is_none() || v.is_undefined() {
        return Ok(None);
    }
    if let Some(s) = v.as_str() {
        return Ok(Some(s.to_string()));
    }
    match i64::try_from(v.clone()) {
        Ok(n) => Ok(Some(" ".repeat(n.max(0) as usize))),
        Err(_) => Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: indent must be an integer or a string",
        )),
    }
}

struct DumpOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

/// Python's `json.dumps`.
fn dump(v: &Json, o: &DumpOpts, level: usize, out: &mut String) {
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                let _ = write!(out, "{i}");
            } else if let Some(u) = n.as_u64() {
                let _ = write!(out, "{u}");
            } else {
                out.push_str(&python_float_repr(n.as_f64().unwrap_or(f64::NAN)));
            }
        }
        Json::String(s) => dump_str(s, o.ensure_ascii, out),
        Json::Array(a) => {
            if a.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                dump(x, o, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Json::Object(m) => {
            if m.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Json)> = m.iter().collect();
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                dump_str(k, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                dump(x, o, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
    }
}

fn dump_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7E => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents -4..16,
/// otherwise `d.ddde+XX`.
fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if x == 0.0 {
        return if x.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{x:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mant) = match mant.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let es = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

/// `strftime_now(format)`, in UTC (sluice keeps no time-zone database): `%Y %m %d %H %M %S %y
/// %b %B %a %A %j %p %I %%` are understood, anything else is copied.
fn strftime_utc(secs: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86400);
    let tod = secs.rem_euclid(86400);
    let (h, mi, s) = (tod / 3600, tod % 3600 / 60, tod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7); // 1970-01-01 was a Thursday; 0 = Monday
    let month = MONTHS[(m - 1) as usize];
    let day = DAYS[wday as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{y}"),
            Some('y') => write!(out, "{:02}", y.rem_euclid(100)),
            Some('m') => write!(out, "{m:02}"),
            Some('d') => write!(out, "{d:02}"),
            Some('H') => write!(out, "{h:02}"),
            Some('I') => write!(out, "{:02}", if h % 12 == 0 { 12 } else { h % 12 }),
            Some('p') => write!(out, "{}", if h < 12 { "AM" } else { "PM" }),
            Some('M') => write!(out, "{mi:02}"),
            Some('S') => write!(out, "{s:02}"),
            Some('j') => write!(out, "{yday:03}"),
            Some('b') => write!(out, "{}", &month[..3]),
            Some('B') => write!(out, "{month}"),
            Some('a') => write!(out, "{}", &day[..3]),
            Some('A') => write!(out, "{day}"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (123456789012345.6, "123456789012345.6"),
            (-2.5, "-2.5"),
            (1.5e300, "1.5e+300"),
            (100.0, "100.0"),
        ] {
            assert_eq!(python_float_repr(x), want);
        }
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let t = r#"{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ "é\n" | tojson(ensure_ascii=true) }}"#;
        let x = serde_json::json!({"b": [1, 2.5, null], "a": "é", "c": {}});
        let out =
            render_chat_json(t, &[], false, "", "", Some(&serde_json::json!({ "x": x }))).unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, null], \"a\": \"é\", \"c\": {}}|{\n  \"b\": [\n    1,\n    2.5,\n    null\n  ],\n  \"a\": \"é\",\n  \"c\": {}\n}|\"\\u00e9\\n\""
        );
    }

    #[test]
    fn raise_exception_is_an_error() {
        let e = render_chat(
            "{{ raise_exception('no system role') }}",
            &[],
            false,
            "",
            "",
            None,
        )
        .unwrap_err();
        assert!(
            matches!(e, ChatError::Raised(ref m) if m == "no system role"),
            "{e}"
        );
    }

    #[test]
    fn generation_tags_render_their_body() {
        let t =
            "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}";
        let out = render_chat(t, &[ChatMessage::new("user", "hi")], false, "", "", None).unwrap();
        assert_eq!(out, "hi");
    }

    #[test]
    fn strftime() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        assert_eq!(
            strftime_utc(1_722_000_309, "%d %b %Y %H:%M:%S %A %j"),
            "26 Jul 2024 13:25:09 Friday 208"
        );
        assert_eq!(strftime_utc(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
    }
}
