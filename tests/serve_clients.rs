//! `sluice serve` through the official `openai` and `anthropic` Python clients
//! (tests/serve/test_clients.py): chat, completions, models, messages, streaming, a client
//! disconnect mid-stream and mid-way through a whole-response request (a client timeout, a
//! half-closed socket), every kind of bad input; then a clean exit on SIGTERM.
//! Needs python3 with the `openai` and `anthropic` packages (.ci/run installs them): without
//! them this test fails rather than passing silently.

mod serve_util;

use serve_util::Server;
use std::process::Command;

/// Long enough that a whole-context generation outlasts a 1 s client timeout many times over
/// (the disconnect checks).
const CTX: &str = "16384";
const MAX_BODY: &str = "262144";

#[test]
fn official_clients_against_the_server() {
    let probe = Command::new("python3")
        .args(["-c", "import openai, anthropic"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "python3 cannot import the openai/anthropic packages ({}): run .ci/run, or `python3 -m pip install openai anthropic`",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!("python3 is needed for the client tests ({e}): run .ci/run"),
    }
    let server = Server::start(&["-c", CTX, "--api-key", "test-key", "--max-body", MAX_BODY]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/serve/test_clients.py");
    let out = Command::new("python3")
        .arg(script)
        .args([
            "--base",
            &server.base(),
            "--key",
            "test-key",
            "--model",
            &sluice::default_model::model_id(),
            "--ctx",
            CTX,
            "--max-body",
            MAX_BODY,
        ])
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}\n{stderr}");
    assert!(
        out.status.success(),
        "client checks failed:\n{stdout}\n{stderr}\nserver log:\n{}",
        server.log_text()
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
    let log = server.log_text();
    let code = server.stop();
    assert_eq!(code, 0, "exit code after SIGTERM; log:\n{log}");
    assert!(!log.contains("panicked"), "{log}");
    // The three disconnect checks (mid-stream, non-stream timeout, half-close) each cancelled
    // their generation, as the server's own log says.
    let gone = log
        .matches("client disconnected, generation cancelled")
        .count();
    assert!(gone >= 3, "{gone} disconnects logged:\n{log}");
}
