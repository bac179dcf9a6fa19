//! Tools reach the chat template exactly as transformers passes them: `sluice serve
//! --chat-template` with real templates that render tools (Qwen3's, GLM-4.6's), a chat request
//! carrying tools must count as many prompt tokens as transformers' rendering of the same
//! conversation (tests/fixtures/chat/expected.json) tokenized by the same server
//! (tests/serve/test_tool_prompt.py, through the official `openai` and `anthropic` clients).
//! Needs vendor-data/templates (scripts/fetch-test-data.sh) and python3 with `openai` and
//! `anthropic` (.ci/run installs them): without them this test fails rather than passing.

mod serve_util;

use serve_util::Server;
use std::path::Path;
use std::process::Command;

#[test]
fn tools_change_the_prompt_as_transformers_renders_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fixtures = root.join("tests/fixtures/chat/expected.json");
    let script = root.join("tests/serve/test_tool_prompt.py");
    // The random test model: its tokenizer adds no BOS, so a rendered prompt sent to
    // /v1/completions counts the same tokens as the chat route (the trained default model's
    // tokenizer adds BOS to a completion prompt, and the Qwen/GLM templates render none).
    let model = sluice::default_model::ensure_random().unwrap();
    let model = model.to_str().unwrap();
    for name in ["Qwen-Qwen3-0.6B.jinja", "GLM-4.6.jinja"] {
        let template = root.join("vendor-data/templates").join(name);
        assert!(
            template.is_file(),
            "{} is missing: run scripts/fetch-test-data.sh",
            template.display()
        );
        let server = Server::start(&[
            model,
            "-c",
            "4096",
            "--chat-template",
            template.to_str().unwrap(),
        ]);
        let out = Command::new("python3")
            .arg(&script)
            .args([
                "--base",
                &server.base(),
                "--model",
                &sluice::default_model::random_model_id(),
            ])
            .args(["--template", name, "--fixtures", fixtures.to_str().unwrap()])
            .output()
            .expect("run python3");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("{stdout}{stderr}");
        assert!(
            out.status.success() && stdout.contains("passed"),
            "{name}:\n{stdout}\n{stderr}\nserver log:\n{}",
            server.log_text()
        );
        let log = server.log_text();
        let want = if name.starts_with("GLM") {
            "glm-4.5"
        } else {
            "hermes"
        };
        assert!(
            log.contains(&format!("tool calls parsed as {want}")),
            "{name}: format not chosen from the template:\n{log}"
        );
        assert_eq!(server.stop(), 0);
    }
}

#[test]
fn bad_chat_template_is_refused_at_start() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-tools");
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.jinja");
    std::fs::write(&bad, "{% for m in messages %}{{ m.content }").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "serve",
            "--port",
            "0",
            "--chat-template",
            bad.to_str().unwrap(),
        ])
        .env("SLUICE_CACHE_DIR", serve_util::cache_dir())
        .output()
        .expect("run sluice");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--chat-template"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let missing = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "serve",
            "--port",
            "0",
            "--chat-template",
            "/nonexistent.jinja",
        ])
        .env("SLUICE_CACHE_DIR", serve_util::cache_dir())
        .output()
        .expect("run sluice");
    let err = String::from_utf8_lossy(&missing.stderr);
    assert_eq!(missing.status.code(), Some(1), "{err}");
    assert!(err.contains("/nonexistent.jinja"), "{err}");
}
