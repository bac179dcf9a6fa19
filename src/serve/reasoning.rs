//! Reasoning and channels in generated text, split the way llama-server's `--reasoning-format
//! auto` does: thoughts go to `reasoning_content` (Anthropic: a `thinking` block), the answer
//! to `content`.
//!
//! Formats (the chat template says which, see `ReasoningFormat::detect`):
//! - `Think`: `<think>…</think>` (Qwen3, Qwen3.5, DeepSeek-R1/V3.1/V3.2, GLM-4.5+, Kimi-K2
//!   Thinking). The template may open the block itself (the generation prompt ends with
//!   `<think>`), then the reply starts inside it; a reply cut off inside the block is all
//!   reasoning.
//! - `Harmony`: OpenAI's gpt-oss format. Each message is `<|channel|>CHANNEL[ to=RECIPIENT]
//!   [<|constrain|>TYPE]<|message|>BODY` ended by `<|end|>` (then `<|start|>assistant` and the
//!   next header), `<|call|>` or `<|return|>`. `analysis` is reasoning, `final` is content,
//!   a `commentary` message to `functions.NAME` is a tool call (its body the JSON arguments),
//!   other commentary (a preamble) is content.
//!
//! Owns: `ReasoningFormat` and `ReplySplitter` (streams reasoning and content pieces as the text
//! arrives, holding back only what could be the start of a marker). Does not own: `<tool_call>`
//! style calls inside the content (tools.rs), the APIs' shapes (openai.rs, anthropic.rs).
//! Invariant: no generated text is lost: what does not parse as the format comes back as
//! content.

use super::tools::{safe_cut, ToolCall, ToolFormat, ToolSplitter};
use serde_json::Value;

/// How a model separates its thoughts from its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningFormat {
    Think,
    Harmony,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const START: &str = "<|start|>";
/// What ends a harmony message's body.
const BODY_ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", START];
/// A harmony header longer than this without `<|message|>` is not a header.
const MAX_HEADER: usize = 512;

impl ReasoningFormat {
    /// The format the chat template teaches (its markers), if any.
    pub fn detect(template: Option<&str>) -> Option<ReasoningFormat> {
        let t = template?;
        if t.contains(CHANNEL) && t.contains(MESSAGE) {
            Some(ReasoningFormat::Harmony)
        } else if t.contains(THINK_CLOSE) {
            Some(ReasoningFormat::Think)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ReasoningFormat::Think => "<think>…</think>",
            ReasoningFormat::Harmony => "harmony (analysis / commentary / final channels)",
        }
    }

    /// Whether a reply to this rendered prompt starts inside the reasoning block (the
    /// template opened it).
    pub fn opens_in_prompt(self, prompt: &str) -> bool {
        self == ReasoningFormat::Think && prompt.trim_end().ends_with(THINK_OPEN)
    }
}

/// A piece of a reply.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

/// A harmony message addressed to a tool: the recipient (`functions.` dropped) and its body.
#[derive(Clone, Debug, PartialEq)]
pub struct ChannelCall {
    pub name: String,
    pub arguments: String,
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    /// Think: before the first non-blank text, which says whether a `<think>` block opens.
    ThinkStart,
    /// Think: inside the block; `lead`: at its start (blanks there are dropped).
    ThinkInside { lead: bool },
    /// Think: after `</think>` (blank text right after it is dropped) or without a block.
    ThinkAfter { trim: bool },
    /// Harmony: a header up to `<|message|>`.
    Header,
    /// Harmony: a message's body of this kind.
    Body(Kind),
    /// Text that is not in the format: content to the end.
    Plain,
}

#[derive(Clone, Debug, PartialEq)]
enum Kind {
    Reasoning,
    Content,
    Call(String),
}

/// Splits a reply, streamed or whole, into reasoning and content (and harmony tool calls).
pub struct ReplySplitter {
    state: State,
    /// Text not yet given out: a possible marker's start, a header, a tool call's body.
    buf: String,
    calls: Vec<ChannelCall>,
}

impl ReplySplitter {
    /// `in_reasoning`: the prompt opened the reasoning block (`opens_in_prompt`).
    pub fn new(format: ReasoningFormat, in_reasoning: bool) -> ReplySplitter {
        let state = match (format, in_reasoning) {
            (ReasoningFormat::Think, true) => State::ThinkInside { lead: true },
            (ReasoningFormat::Think, false) => State::ThinkStart,
            (ReasoningFormat::Harmony, _) => State::Header,
        };
        ReplySplitter {
            state,
            buf: String::new(),
            calls: Vec::new(),
        }
    }

    /// Add generated text; returns the pieces that can go out now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out, false) {}
        merge(out)
    }

    /// The end of the reply: the pieces still held and the tool calls.
    pub fn finish(mut self) -> (Vec<Piece>, Vec<ChannelCall>) {
        let mut out = Vec::new();
        while self.step(&mut out, true) {}
        (merge(out), self.calls)
    }

    /// Split a whole reply: reasoning, content, tool calls.
    #[cfg(test)]
    fn split(
        format: ReasoningFormat,
        in_reasoning: bool,
        text: &str,
    ) -> (String, String, Vec<ChannelCall>) {
        let mut s = ReplySplitter::new(format, in_reasoning);
        let mut pieces = s.push(text);
        let (rest, calls) = s.finish();
        pieces.extend(rest);
        let (r, c) = join(pieces);
        (r, c, calls)
    }

    /// One move of the state machine over `buf`; false when it needs more text (or, at the
    /// end, when everything is out).
    fn step(&mut self, out: &mut Vec<Piece>, end: bool) -> bool {
        match self.state.clone() {
            State::ThinkStart => {
                let t = self.buf.trim_start();
                if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                    self.buf = rest.to_string();
                    self.state = State::ThinkInside { lead: true };
                    true
                } else if !end && (t.is_empty() || THINK_OPEN.starts_with(t)) {
                    false
                } else {
                    self.state = State::ThinkAfter { trim: false };
                    true
                }
            }
            State::ThinkInside { lead } => {
                // Blanks at the block's two ends are not part of the thoughts (the templates
                // write `<think>\n…\n</think>`): leading ones are dropped, trailing ones held
                // until text follows them.
                if lead {
                    let t = self.buf.trim_start();
                    if t.is_empty() && !end {
                        self.buf.clear();
                        return false;
                    }
                    self.buf = t.to_string();
                    self.state = State::ThinkInside { lead: false };
                }
                match self.buf.find(THINK_CLOSE) {
                    Some(at) => {
                        out.push(Piece::Reasoning(self.buf[..at].trim_end().to_string()));
                        self.buf.drain(..at + THINK_CLOSE.len());
                        self.state = State::ThinkAfter { trim: true };
                        true
                    }
                    None if end => {
                        out.push(Piece::Reasoning(self.buf.trim_end().to_string()));
                        self.buf.clear();
                        false
                    }
                    None => {
                        let safe = safe_cut(&self.buf, &[THINK_CLOSE]);
                        let cut = self.buf[..safe].trim_end().len();
                        out.push(Piece::Reasoning(self.buf.drain(..cut).collect()));
                        false
                    }
                }
            }
            State::ThinkAfter { trim } => {
                if trim {
                    let t = self.buf.trim_start().to_string();
                    if t.is_empty() && !end {
                        self.buf.clear();
                        return false;
                    }
                    self.buf = t;
                    self.state = State::ThinkAfter { trim: false };
                }
                out.push(Piece::Content(std::mem::take(&mut self.buf)));
                false
            }
            State::Plain => {
                out.push(Piece::Content(std::mem::take(&mut self.buf)));
                false
            }
            State::Header => match self.buf.find(MESSAGE) {
                Some(at) => {
                    let kind = header_kind(&self.buf[..at]);
                    self.buf.drain(..at + MESSAGE.len());
                    self.state = State::Body(kind);
                    true
                }
                None => {
                    let looks = harmony_prefix(&self.buf);
                    if end || !looks || self.buf.len() > MAX_HEADER {
                        // Not a header: the text is content. A bare `<|start|>assistant` left
                        // at the end (no message followed) says nothing.
                        let t = std::mem::take(&mut self.buf);
                        let bare = t.trim().trim_start_matches(START).trim();
                        if !(looks && (bare.is_empty() || bare == "assistant")) {
                            out.push(Piece::Content(t));
                        }
                        self.state = if end { State::Header } else { State::Plain };
                        return !end;
                    }
                    false
                }
            },
            State::Body(kind) => {
                let hit = BODY_ENDS
                    .iter()
                    .filter_map(|m| self.buf.find(m).map(|at| (at, *m)))
                    .min_by_key(|&(at, _)| at);
                let (take, done) = match hit {
                    Some((at, m)) => {
                        let body: String = self.buf[..at].to_string();
                        // `<|start|>` begins the next message's header; the others end this one.
                        let skip = if m == START { at } else { at + m.len() };
                        self.buf.drain(..skip);
                        (body, true)
                    }
                    None if end => (std::mem::take(&mut self.buf), true),
                    None => match kind {
                        Kind::Call(_) => return false,
                        _ => {
                            let cut = safe_cut(&self.buf, &BODY_ENDS);
                            (self.buf.drain(..cut).collect(), false)
                        }
                    },
                };
                match &kind {
                    Kind::Reasoning => out.push(Piece::Reasoning(take)),
                    Kind::Content => out.push(Piece::Content(take)),
                    Kind::Call(name) if done => self.calls.push(ChannelCall {
                        name: name.clone(),
                        arguments: take,
                    }),
                    Kind::Call(_) => unreachable!("a call's body is held until it ends"),
                }
                if done {
                    self.state = State::Header;
                }
                done && !(end && self.buf.is_empty())
            }
        }
    }
}

/// A reply on its way to a client: reasoning split off (`ReplySplitter`), tool calls parsed
/// from the content (`ToolSplitter`) or, for harmony, from the channels. Both APIs stream
/// through it and whole replies go through it in one push.
pub struct ReplyStream {
    reasoning: Option<ReplySplitter>,
    tools: Option<ToolSplitter>,
    /// Harmony calls become tool calls only when the request offered tools.
    channel_calls: bool,
}

impl ReplyStream {
    /// `reasoning`: the format and whether the prompt opened the block (None: reasoning stays
    /// in the content); `tools`: the request's tools, when calls are to be parsed.
    pub fn new(
        reasoning: Option<(ReasoningFormat, bool)>,
        tool_format: ToolFormat,
        tools: Option<Vec<Value>>,
    ) -> ReplyStream {
        let harmony = matches!(reasoning, Some((ReasoningFormat::Harmony, _)));
        ReplyStream {
            reasoning: reasoning.map(|(f, open)| ReplySplitter::new(f, open)),
            channel_calls: harmony && tools.is_some(),
            tools: tools
                .filter(|_| !harmony)
                .map(|t| ToolSplitter::new(tool_format, t)),
        }
    }

    /// Add generated text; returns the pieces that can go out now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let pieces = match &mut self.reasoning {
            Some(r) => r.push(text),
            None => vec![Piece::Content(text.to_string())],
        };
        self.through_tools(pieces)
    }

    /// The end of the reply: the pieces still held and the tool calls.
    pub fn finish(mut self, new_id: &mut dyn FnMut() -> String) -> (Vec<Piece>, Vec<ToolCall>) {
        let (pieces, channel) = match self.reasoning.take() {
            Some(r) => r.finish(),
            None => (Vec::new(), Vec::new()),
        };
        let mut out = self.through_tools(pieces);
        let mut calls = Vec::new();
        if let Some(t) = self.tools.take() {
            let (rest, c) = t.finish(new_id);
            out.push(Piece::Content(rest));
            calls = c;
        }
        for c in channel {
            // A call that is not valid JSON, or made without tools offered, stays text.
            let args = serde_json::from_str::<Value>(c.arguments.trim()).ok();
            match args {
                Some(a @ Value::Object(_)) if self.channel_calls => calls.push(ToolCall {
                    id: new_id(),
                    name: c.name,
                    arguments: a,
                }),
                _ => out.push(Piece::Content(c.arguments)),
            }
        }
        (merge(out), calls)
    }

    /// A whole reply: reasoning, content and calls.
    pub fn whole(
        mut self,
        text: &str,
        new_id: &mut dyn FnMut() -> String,
    ) -> (String, String, Vec<ToolCall>) {
        let mut pieces = self.push(text);
        let (rest, calls) = self.finish(new_id);
        pieces.extend(rest);
        let (r, c) = join(pieces);
        (r, c, calls)
    }

    fn through_tools(&mut self, pieces: Vec<Piece>) -> Vec<Piece> {
        let Some(t) = &mut self.tools else {
            return merge(pieces);
        };
        let out = pieces
            .into_iter()
            .map(|p| match p {
                Piece::Content(c) => Piece::Content(t.push(&c)),
                r => r,
            })
            .collect();
        merge(out)
    }
}

/// Reasoning and content of a list of pieces.
fn join(pieces: Vec<Piece>) -> (String, String) {
    let (mut r, mut c) = (String::new(), String::new());
    for p in pieces {
        match p {
            Piece::Reasoning(t) => r.push_str(&t),
            Piece::Content(t) => c.push_str(&t),
        }
    }
    (r, c)
}

/// The kind of a harmony message from its header (`<|start|>assistant<|channel|>commentary
/// to=functions.get_weather <|constrain|>json`; the recipient may also precede the channel).
fn header_kind(h: &str) -> Kind {
    let channel = h
        .find(CHANNEL)
        .map(|at| &h[at + CHANNEL.len()..])
        .and_then(|rest| rest.split(|c: char| c.is_whitespace() || c == '<').next())
        .unwrap_or("");
    let recipient = h.find("to=").map(|at| {
        h[at + 3..]
            .split(|c: char| c.is_whitespace() || c == '<')
            .next()
            .unwrap_or("")
    });
    match (channel, recipient) {
        (_, Some(r)) if !r.is_empty() => {
            Kind::Call(r.strip_prefix("functions.").unwrap_or(r).to_string())
        }
        ("analysis", _) => Kind::Reasoning,
        _ => Kind::Content,
    }
}

/// Whether `s` can still be (the start of) a harmony header: it starts with `<|channel|>`,
/// `<|start|>` or a prefix of one of them, after optional blanks.
fn harmony_prefix(s: &str) -> bool {
    let t = s.trim_start();
    [CHANNEL, START]
        .iter()
        .any(|m| t.starts_with(m) || m.starts_with(t))
}

/// Drop empty pieces and join neighbours of the same kind.
fn merge(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::new();
    for p in pieces {
        match (out.last_mut(), p) {
            (_, Piece::Reasoning(t) | Piece::Content(t)) if t.is_empty() => {}
            (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
            (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every split of `text` into streamed chunks gives the same pieces as the whole.
    fn streamed(f: ReasoningFormat, open: bool, text: &str) -> (String, String, Vec<ChannelCall>) {
        let whole = ReplySplitter::split(f, open, text);
        let cuts: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &a in &cuts {
            let mut s = ReplySplitter::new(f, open);
            let mut pieces = s.push(&text[..a]);
            pieces.extend(s.push(&text[a..]));
            let (rest, calls) = s.finish();
            pieces.extend(rest);
            let (r, c) = join(pieces);
            assert_eq!((r, c, calls), whole, "cut at {a} of {text:?}");
        }
        whole
    }

    #[test]
    fn detection_follows_the_template() {
        let t = |s: &str| ReasoningFormat::detect(Some(s));
        assert_eq!(
            t("{{'<|channel|>final<|message|>'}}"),
            Some(ReasoningFormat::Harmony)
        );
        assert_eq!(
            t("{% if '</think>' in content %}"),
            Some(ReasoningFormat::Think)
        );
        assert_eq!(t("<|im_start|>assistant"), None);
        assert_eq!(ReasoningFormat::detect(None), None);
        let th = ReasoningFormat::Think;
        assert!(th.opens_in_prompt("<｜Assistant｜><think>"));
        assert!(th.opens_in_prompt("<|im_start|>assistant\n<think>\n"));
        assert!(!th.opens_in_prompt("<｜Assistant｜><think></think>"));
    }

    #[test]
    fn think_blocks() {
        let th = ReasoningFormat::Think;
        let s = |open, t| streamed(th, open, t);
        let e = Vec::new();
        assert_eq!(
            s(false, "<think>\nLet me see.\n</think>\n\nIt is 4."),
            ("Let me see.".into(), "It is 4.".into(), e.clone())
        );
        // The template opened the block.
        assert_eq!(
            s(true, "Hmm.</think>Four."),
            ("Hmm.".into(), "Four.".into(), e.clone())
        );
        // No block: all content, blanks kept.
        assert_eq!(
            s(false, "  Plain < answer"),
            ("".into(), "  Plain < answer".into(), e.clone())
        );
        // Cut off while thinking: all reasoning.
        assert_eq!(
            s(false, "<think>still going"),
            ("still going".into(), "".into(), e.clone())
        );
        // An empty block (thinking off) leaves the answer.
        assert_eq!(
            s(false, "<think>\n\n</think>\n\nHi"),
            ("".into(), "Hi".into(), e.clone())
        );
        // Blanks inside the thoughts stay.
        assert_eq!(
            s(true, " a \n b </think>c"),
            ("a \n b".into(), "c".into(), e)
        );
    }

    #[test]
    fn harmony_channels() {
        let h = ReasoningFormat::Harmony;
        let reply = "<|channel|>analysis<|message|>User greets. Reply.<|end|>\
                     <|start|>assistant<|channel|>final<|message|>Hello! <b>Hi</b><|return|>";
        let (r, c, calls) = streamed(h, false, reply);
        assert_eq!(
            (r.as_str(), c.as_str()),
            ("User greets. Reply.", "Hello! <b>Hi</b>")
        );
        assert!(calls.is_empty());
        // The end token is not in the text when generation stops on it.
        let (_, c, _) = streamed(h, false, "<|channel|>final<|message|>Done.");
        assert_eq!(c, "Done.");
    }

    #[test]
    fn harmony_tool_calls() {
        let h = ReasoningFormat::Harmony;
        let reply = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant\
                     <|channel|>commentary to=functions.get_weather <|constrain|>json\
                     <|message|>{\"location\":\"Tokyo\"}<|call|>";
        let (r, c, calls) = streamed(h, false, reply);
        assert_eq!((r.as_str(), c.as_str()), ("Need weather.", ""));
        assert_eq!(
            calls,
            vec![ChannelCall {
                name: "get_weather".into(),
                arguments: "{\"location\":\"Tokyo\"}".into()
            }]
        );
        // The recipient before the channel; a preamble in commentary is content.
        let reply = "<|channel|>commentary<|message|>Checking.<|end|>\
                     <|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}";
        let (r, c, calls) = streamed(h, false, reply);
        assert_eq!((r.as_str(), c.as_str()), ("", "Checking."));
        assert_eq!(calls[0].name, "lookup");
    }

    #[test]
    fn text_outside_the_format_is_content() {
        let h = ReasoningFormat::Harmony;
        let (r, c, calls) = streamed(h, false, "Just text, no channels <|end|>");
        assert_eq!(
            (r.as_str(), c.as_str()),
            ("", "Just text, no channels <|end|>")
        );
        assert!(calls.is_empty());
        // A header that never reaches <|message|> comes back as content.
        let (_, c, _) = streamed(h, false, "<|channel|>final oops");
        assert_eq!(c, "<|channel|>final oops");
    }

    /// A real template (vendor-data/templates, fetched by scripts/fetch-test-data.sh).
    fn template(name: &str) -> String {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("vendor-data/templates")
            .join(name);
        std::fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-test-data.sh)", p.display()))
    }

    fn render(t: &str, msgs: serde_json::Value, gen: bool, extra: serde_json::Value) -> String {
        let msgs = msgs.as_array().unwrap().clone();
        crate::chat::render_chat_json(t, &msgs, gen, "", "", Some(&extra)).unwrap()
    }

    /// What the reference templates write for an assistant turn (OpenAI's gpt-oss template,
    /// Qwen3's) comes back apart: thoughts, answer and calls as they went in.
    #[test]
    fn replies_rendered_by_real_templates_split_back() {
        use serde_json::json;
        let ids = &mut {
            let mut n = 0;
            move || {
                n += 1;
                format!("call_{n}")
            }
        };
        let user = json!({"role": "user", "content": "Weather in Tokyo?"});
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "description": "Weather", "parameters": {"type": "object",
            "properties": {"location": {"type": "string"}}}}}]);
        // gpt-oss: the reply is what follows the last user message's `<|start|>assistant`.
        let oss = template("openai-gpt-oss-120b.jinja");
        let after_user = |text: &str| -> String {
            let at = text.rfind("<|start|>user").unwrap();
            let rest = &text[at..];
            let a = rest.find("<|start|>assistant").unwrap() + "<|start|>assistant".len();
            rest[a..].to_string()
        };
        assert!(render(&oss, json!([user]), true, json!({})).ends_with("<|start|>assistant"));
        let call = json!({"role": "assistant", "thinking": "Need the weather tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather",
            "arguments": {"location": "Tokyo"}}}]});
        let text = render(&oss, json!([user, call]), false, json!({"tools": tools}));
        let reply = after_user(&text);
        let harmony = Some((ReasoningFormat::detect(Some(&oss)).unwrap(), false));
        assert_eq!(harmony.map(|h| h.0), Some(ReasoningFormat::Harmony));
        let tool_list = tools.as_array().unwrap().clone();
        let (r, c, calls) =
            ReplyStream::new(harmony, ToolFormat::Hermes, Some(tool_list)).whole(&reply, ids);
        assert_eq!(
            (r.as_str(), c.as_str()),
            ("Need the weather tool.", ""),
            "{reply}"
        );
        assert_eq!(calls.len(), 1, "{reply}");
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, json!({"location": "Tokyo"}));
        // Without tools offered the call stays text.
        let (_, c, calls) = ReplyStream::new(harmony, ToolFormat::Hermes, None).whole(&reply, ids);
        assert!(calls.is_empty() && c.contains("Tokyo"), "{c}");
        let answer = json!({"role": "assistant", "thinking": "Easy.", "content": "Sunny, 21 C."});
        let reply = after_user(&render(&oss, json!([user, answer]), false, json!({})));
        let (r, c, _) = ReplyStream::new(harmony, ToolFormat::Hermes, None).whole(&reply, ids);
        assert_eq!(
            (r.as_str(), c.as_str()),
            ("Easy.", "Sunny, 21 C."),
            "{reply}"
        );

        // Qwen3: `<think>\nR\n</think>\n\nC` after `<|im_start|>assistant\n`.
        let qwen = template("Qwen-Qwen3-0.6B.jinja");
        let think = ReasoningFormat::detect(Some(&qwen)).unwrap();
        assert_eq!(think, ReasoningFormat::Think);
        let answer = json!({"role": "assistant", "reasoning_content": "Tokyo is in Japan.\nCheck.",
            "content": "Sunny."});
        let text = render(&qwen, json!([user, answer]), false, json!({}));
        let a = text.rfind("<|im_start|>assistant\n").unwrap() + "<|im_start|>assistant\n".len();
        let reply = text[a..].trim_end().trim_end_matches("<|im_end|>");
        let (r, c, _) =
            ReplyStream::new(Some((think, false)), ToolFormat::Hermes, None).whole(reply, ids);
        assert_eq!(
            (r.as_str(), c.as_str()),
            ("Tokyo is in Japan.\nCheck.", "Sunny."),
            "{reply}"
        );
        // Its generation prompt leaves the block to the model; with thinking off it is closed.
        let p = render(&qwen, json!([user]), true, json!({}));
        assert!(!think.opens_in_prompt(&p));
        let p = render(
            &qwen,
            json!([user]),
            true,
            json!({"enable_thinking": false}),
        );
        assert!(!think.opens_in_prompt(&p) && p.trim_end().ends_with("</think>"));
        // DeepSeek-V3.1 opens the block itself when thinking.
        let ds = template("deepseek-ai-DeepSeek-V3.1.jinja");
        assert_eq!(
            ReasoningFormat::detect(Some(&ds)),
            Some(ReasoningFormat::Think)
        );
        assert!(think.opens_in_prompt(&render(
            &ds,
            json!([user]),
            true,
            json!({"thinking": true})
        )));
        assert!(!think.opens_in_prompt(&render(&ds, json!([user]), true, json!({}))));
    }
}
