//! Errors the server sends to clients, and the two JSON shapes they take: OpenAI's
//! `{"error":{"message","type","param","code"}}` and Anthropic's
//! `{"type":"error","error":{"type","message"}}` (on `/v1/messages`).
//!
//! Owns: `ApiError` (status + kind + message) and its rendering; `ServeError` for what stops
//! the server from starting. Invariant: every client-facing failure is an `ApiError` with a
//! 4xx/5xx status, never a panic or a dropped connection.

use serde_json::{json, Value};

/// Which API's error shape to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
}

/// A failed request, as the client will see it.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// OpenAI's machine-readable code (`context_length_exceeded`, `model_not_found`, ...).
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (a 503 when every slot is busy and the queue full).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 about one field.
    pub fn param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            param: Some(param.to_string()),
            code: None,
            retry_after: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn with_retry_after(mut self, secs: u64) -> ApiError {
        self.retry_after = Some(secs);
        self
    }

    /// OpenAI's `type` for this status.
    fn openai_type(&self) -> &'static str {
        match self.status {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            500..=599 => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// Anthropic's `error.type` for this status.
    fn anthropic_type(&self) -> &'static str {
        match self.status {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            500..=599 => "api_error",
            _ => "invalid_request_error",
        }
    }

    pub fn to_json(&self, dialect: Dialect) -> Value {
        match dialect {
            Dialect::OpenAi => json!({
                "error": {
                    "message": self.message,
                    "type": self.openai_type(),
                    "param": self.param,
                    "code": self.code,
                }
            }),
            Dialect::Anthropic => json!({
                "type": "error",
                "error": { "type": self.anthropic_type(), "message": self.message }
            }),
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {err}")]
    Bind { addr: String, err: std::io::Error },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("--kv-dir {}: {msg}", path.display())]
    KvDir {
        path: std::path::PathBuf,
        msg: String,
    },
    #[error("--chat-template: {0}")]
    ChatTemplate(String),
    #[error("cannot install the signal handler: {0}")]
    Signal(std::io::Error),
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
}
