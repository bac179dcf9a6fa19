//! Reading request JSON: typed field access whose errors name the field, and the generation
//! parameters both APIs share (temperature, top_p, top_k, min_p, max_tokens, stop, seed).
//!
//! Owns: validation of field types and ranges. Does not own: the meaning of API-specific
//! fields (openai.rs, anthropic.rs). Invariant: every value that reaches the engine has been
//! checked here; a wrong type or range is a 400 naming the field, never a default in its place.

use super::error::ApiError;
use crate::sample::SamplingParams;
use serde_json::{Map, Value};

pub type Obj = Map<String, Value>;

/// The body as a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Obj, ApiError> {
    if body.is_empty() {
        return Err(ApiError::new(
            400,
            "request body is empty: expected a JSON object",
        ));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(other) => Err(ApiError::new(
            400,
            format!("request body must be a JSON object, got {}", kind(&other)),
        )),
        Err(e) => Err(ApiError::new(
            400,
            format!("malformed JSON in request body: {e}"),
        )),
    }
}

/// JSON type name for messages.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A field that is present and not null.
fn present<'a>(o: &'a Obj, name: &str) -> Option<&'a Value> {
    o.get(name).filter(|v| !v.is_null())
}

pub fn opt_f64(o: &Obj, name: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    let Some(v) = present(o, name) else {
        return Ok(None);
    };
    match v.as_f64() {
        Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(Some(x)),
        Some(x) => Err(ApiError::param(
            name,
            format!("`{name}` must be between {lo} and {hi}, got {x}"),
        )),
        None => Err(ApiError::param(
            name,
            format!("`{name}` must be a number, got {}", kind(v)),
        )),
    }
}

pub fn opt_u64(o: &Obj, name: &str) -> Result<Option<u64>, ApiError> {
    let Some(v) = present(o, name) else {
        return Ok(None);
    };
    match v.as_u64() {
        Some(x) => Ok(Some(x)),
        None => Err(ApiError::param(
            name,
            format!("`{name}` must be a non-negative integer, got {v}"),
        )),
    }
}

/// A seed: any integer (negative ones are taken as their two's-complement bits).
pub fn opt_seed(o: &Obj, name: &str) -> Result<Option<u64>, ApiError> {
    let Some(v) = present(o, name) else {
        return Ok(None);
    };
    if let Some(x) = v.as_u64() {
        return Ok(Some(x));
    }
    match v.as_i64() {
        Some(x) => Ok(Some(x as u64)),
        None => Err(ApiError::param(
            name,
            format!("`{name}` must be an integer, got {v}"),
        )),
    }
}

pub fn opt_bool(o: &Obj, name: &str) -> Result<Option<bool>, ApiError> {
    let Some(v) = present(o, name) else {
        return Ok(None);
    };
    v.as_bool().map(Some).ok_or_else(|| {
        ApiError::param(name, format!("`{name}` must be a boolean, got {}", kind(v)))
    })
}

pub fn opt_str<'a>(o: &'a Obj, name: &str) -> Result<Option<&'a str>, ApiError> {
    let Some(v) = present(o, name) else {
        return Ok(None);
    };
    v.as_str()
        .map(Some)
        .ok_or_else(|| ApiError::param(name, format!("`{name}` must be a string, got {}", kind(v))))
}

pub fn req_str<'a>(o: &'a Obj, name: &str) -> Result<&'a str, ApiError> {
    opt_str(o, name)?
        .ok_or_else(|| ApiError::param(name, format!("missing required field `{name}`")))
}

pub fn req<'a>(o: &'a Obj, name: &str) -> Result<&'a Value, ApiError> {
    present(o, name)
        .ok_or_else(|| ApiError::param(name, format!("missing required field `{name}`")))
}

/// `stop`: a string or a list of strings (empty strings are refused: they would stop at once).
pub fn stop_list(o: &Obj, name: &str) -> Result<Vec<String>, ApiError> {
    let list = match present(o, name) {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let mut out = Vec::with_capacity(a.len());
            for (i, x) in a.iter().enumerate() {
                match x.as_str() {
                    Some(s) => out.push(s.to_string()),
                    None => {
                        return Err(ApiError::param(
                            name,
                            format!("`{name}[{i}]` must be a string, got {}", kind(x)),
                        ))
                    }
                }
            }
            out
        }
        Some(v) => {
            return Err(ApiError::param(
                name,
                format!(
                    "`{name}` must be a string or a list of strings, got {}",
                    kind(v)
                ),
            ))
        }
    };
    if list.len() > 16 {
        return Err(ApiError::param(
            name,
            format!(
                "`{name}` holds {} sequences; at most 16 are accepted",
                list.len()
            ),
        ));
    }
    if list.iter().any(|s| s.is_empty()) {
        return Err(ApiError::param(
            name,
            format!("`{name}` holds an empty string"),
        ));
    }
    Ok(list)
}

/// Sampling fields over the server's defaults: `temperature`, `top_p`, `top_k`, `min_p`,
/// `seed`, and the `repetition_penalty` extension.
pub fn sampling(o: &Obj, defaults: &SamplingParams) -> Result<SamplingParams, ApiError> {
    let mut p = defaults.clone();
    if let Some(t) = opt_f64(o, "temperature", 0.0, 2.0)? {
        p.temperature = t as f32;
    }
    if let Some(t) = present(o, "top_p") {
        match t.as_f64() {
            Some(x) if x > 0.0 && x <= 1.0 => p.top_p = x as f32,
            _ => {
                return Err(ApiError::param(
                    "top_p",
                    format!("`top_p` must be a number in (0, 1], got {t}"),
                ))
            }
        }
    }
    if let Some(k) = present(o, "top_k") {
        // Anthropic and several OpenAI-compatible servers take top_k; -1 is a common "off".
        match k.as_i64() {
            Some(-1) | Some(0) => p.top_k = 0,
            Some(x) if x > 0 => p.top_k = x as usize,
            _ => {
                return Err(ApiError::param(
                    "top_k",
                    format!("`top_k` must be a positive integer (or 0/-1 for off), got {k}"),
                ))
            }
        }
    }
    if let Some(m) = opt_f64(o, "min_p", 0.0, 1.0)? {
        p.min_p = m as f32;
    }
    if let Some(r) = opt_f64(o, "repetition_penalty", 0.01, 10.0)? {
        p.repeat_penalty = r as f32;
    }
    if let Some(s) = opt_seed(o, "seed")? {
        p.seed = s;
    }
    Ok(p)
}

/// Fields this server does not implement: refused when set to anything but their neutral
/// value, so a client never gets silently different behaviour.
pub fn refuse_unsupported(o: &Obj, fields: &[(&str, Value)]) -> Result<(), ApiError> {
    for (name, neutral) in fields {
        if let Some(v) = present(o, name) {
            let same = match (v.as_f64(), neutral.as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => v == neutral,
            };
            if !same {
                return Err(ApiError::param(
                    name,
                    format!("`{name}` = {v} is not supported by this server"),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(s: &str) -> Obj {
        parse_object(s.as_bytes()).unwrap()
    }

    #[test]
    fn wrong_types_name_the_field() {
        let e = sampling(&obj(r#"{"temperature":"hot"}"#), &SamplingParams::default()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = stop_list(&obj(r#"{"stop":[1]}"#), "stop").unwrap_err();
        assert!(e.message.contains("stop[0]"), "{}", e.message);
        assert!(parse_object(b"{").is_err());
        assert!(parse_object(b"[]")
            .unwrap_err()
            .message
            .contains("an array"));
    }

    #[test]
    fn stop_string_or_list() {
        assert_eq!(
            stop_list(&obj(r#"{"stop":"x"}"#), "stop").unwrap(),
            vec!["x"]
        );
        assert_eq!(
            stop_list(&obj(r#"{"stop":["a","b"]}"#), "stop").unwrap(),
            vec!["a", "b"]
        );
        assert!(stop_list(&obj(r#"{}"#), "stop").unwrap().is_empty());
    }

    #[test]
    fn unsupported_only_when_not_neutral() {
        let f = [("n", Value::from(1))];
        assert!(refuse_unsupported(&obj(r#"{"n":1}"#), &f).is_ok());
        assert!(refuse_unsupported(&obj(r#"{"n":2}"#), &f).is_err());
    }
}
