//! The engine's session state for the hybrid families (Qwen3-Next, Qwen3.5-MoE): a Gated
//! DeltaNet layer holds its conv + delta-rule state after the last token only, so a prefix
//! is reused (in memory, or restored from `--kv-dir`) only where that state was taken.
//!
//! On the tests/fixtures/models/qwen3_next and qwen3_5_moe fixtures (with qwen3_moe's
//! tokenizer.json beside them, so the engine opens them), at temperature 0:
//! - a turn that extends the previous conversation keeps it in memory, and a turn restored
//!   from a `--kv-dir` session file gives the tokens of a fresh run, with a state (every KV row
//!   and every recurrent block) bit-identical to the fresh run's, so the logits are too;
//! - a prompt that shares only part of the held or saved conversation reuses nothing (0
//!   reused tokens, nothing restored: counted, not timed) and still answers as a fresh run;
//!   where memory holds only a partial prefix, a saved session the prompt extends is restored;
//! - a damaged hybrid session file is refused and the turn computed from 0.

mod model_util;

use model_util::{dir, ids, json};
use sluice::engine::{Engine, EngineOptions, GenParams, GpuWant, Outcome};
use std::path::{Path, PathBuf};

/// `fixture` in a directory of its own, with a tokenizer the engine can open.
fn model_dir(fixture: &str) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("engine-hybrid-{fixture}"));
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(dir(fixture).join(f), out.join(f)).unwrap();
    }
    // 320 ids, as the fixture's vocabulary (the Qwen3 family's byte-level BPE).
    std::fs::copy(
        dir("qwen3_moe").join("tokenizer.json"),
        out.join("tokenizer.json"),
    )
    .unwrap();
    out
}

fn open(model: &Path, kv_dir: Option<&Path>) -> Engine {
    let mut o = EngineOptions::new(model);
    o.threads = 2;
    o.ctx = Some(128);
    o.batch = 5;
    o.quiet = true;
    o.gpu.want = GpuWant::Off;
    o.kv_dir = kv_dir.map(Path::to_path_buf);
    Engine::open(o).unwrap()
}

fn gen(e: &mut Engine, prompt: &[u32]) -> Outcome {
    let mut s = e.sampler();
    let mut p = GenParams::new(10);
    p.ignore_eos = true;
    e.generate(prompt, &mut s, &p, &mut |_| true).unwrap()
}

/// Every part of `a`'s state (KV rows of the held positions, recurrent blocks) equals `b`'s
/// bit for bit, and both hold the same tokens.
fn same_state(name: &str, a: &Engine, b: &Engine) {
    assert_eq!(
        a.session.tokens(),
        b.session.tokens(),
        "{name}: tokens held"
    );
    let (sa, sb) = (&a.session.st, &b.session.st);
    assert_eq!(sa.pos, sb.pos, "{name}");
    assert!(sa.block_floats() > 0, "{name}: a recurrent state");
    for part in sa.parts() {
        let x = sa.part_rows(part, sa.pos).unwrap();
        let y = sb.part_rows(part, sb.pos).unwrap();
        assert!(x == y, "{name}: {part:?} differs from a fresh run");
    }
}

fn check(fixture: &str) {
    std::env::set_var(
        "SLUICE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("engine-hybrid-cache"),
    );
    let model = model_dir(fixture);
    let kv = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("engine-hybrid-kv-{fixture}"));
    let _ = std::fs::remove_dir_all(&kv);
    let p1 = ids(&json(&dir(fixture).join("cases.json"))["cases"][2]["ids"]);
    let fresh = |prompt: &[u32]| {
        let mut e = open(&model, None);
        let out = gen(&mut e, prompt);
        assert_eq!(out.generation.stats.reused, 0);
        (e, out.generation.tokens)
    };

    // Turn 1, then turn 2 extending all of it: the recurrent state is kept.
    let mut chat = open(&model, None);
    let first = gen(&mut chat, &p1).generation.tokens;
    let held = chat.session.tokens().len();
    assert_eq!(held, p1.len() + first.len() - 1);
    let mut p2 = p1.clone();
    p2.extend_from_slice(&first);
    p2.extend_from_slice(&p1[1..6]);
    let second = gen(&mut chat, &p2);
    assert_eq!(
        second.generation.stats.reused, held,
        "{fixture}: turn 2 kept turn 1"
    );
    let (fresh2, want2) = fresh(&p2);
    assert_eq!(second.generation.tokens, want2, "{fixture}: kept prefix");
    same_state(&format!("{fixture} in-memory reuse"), &chat, &fresh2);

    // A prompt sharing only a part of what is held: nothing can be kept.
    let mut p3 = p1[..p1.len() - 3].to_vec();
    p3.extend_from_slice(&[7, 11, 13]);
    let third = gen(&mut chat, &p3);
    assert_eq!(
        third.generation.stats.reused, 0,
        "{fixture}: partial prefix recomputed"
    );
    let (fresh3, want3) = fresh(&p3);
    assert_eq!(third.generation.tokens, want3, "{fixture}: after a restart");
    same_state(&format!("{fixture} restart"), &chat, &fresh3);

    // --kv-dir: turn 1 saved by one engine, turn 2 restored by another.
    let mut saver = open(&model, Some(&kv));
    gen(&mut saver, &p1);
    saver.save_session().unwrap().expect("session written");
    let mut restored = open(&model, Some(&kv));
    assert_eq!(restored.saved_sessions(), Some(1));
    let out = gen(&mut restored, &p2);
    assert!(
        out.restored_bytes.is_some(),
        "{fixture}: restored from --kv-dir"
    );
    assert_eq!(out.generation.stats.reused, held);
    assert_eq!(out.generation.tokens, want2, "{fixture}: restored session");
    same_state(&format!("{fixture} --kv-dir restore"), &restored, &fresh2);

    // The conversation in memory shares more with the next prompt than the saved session,
    // but only a part of it: the saved session (all of which the prompt extends) is restored.
    let mut p4 = p1.clone();
    p4.extend_from_slice(&first);
    p4.extend_from_slice(&[p1[1], 3, 5, 9]);
    assert!(p4[p1.len() + first.len()] == p2[p1.len() + first.len()]);
    let out = gen(&mut restored, &p4);
    assert!(
        out.restored_bytes.is_some(),
        "{fixture}: the session, not memory"
    );
    assert_eq!(out.generation.stats.reused, held);
    let (fresh4, want4) = fresh(&p4);
    assert_eq!(out.generation.tokens, want4);
    same_state(
        &format!("{fixture} session over memory"),
        &restored,
        &fresh4,
    );

    // A saved session whose end the prompt does not extend: computed from 0.
    let mut partial = open(&model, Some(&kv));
    let out = gen(&mut partial, &p3);
    assert_eq!(out.restored_bytes, None, "{fixture}: nothing restored");
    assert_eq!(out.generation.stats.reused, 0);
    assert_eq!(out.generation.tokens, want3);
    same_state(&format!("{fixture} --kv-dir partial"), &partial, &fresh3);

    // The very prompt saved (no token left to feed after it): computed from 0 too.
    let mut again = open(&model, Some(&kv));
    let saved: Vec<u32> = [&p1[..], &first[..first.len() - 1]].concat();
    let out = gen(&mut again, &saved);
    assert_eq!(out.restored_bytes, None);
    assert_eq!(out.generation.stats.reused, 0);

    // A damaged session file (one flipped bit in the recurrent blocks at its end) is refused.
    let file = std::fs::read_dir(&kv)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "slkv"))
        .expect("a session file");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 8 - 5;
    bytes[at] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let mut damaged = open(&model, Some(&kv));
    let out = gen(&mut damaged, &p2);
    assert_eq!(
        out.restored_bytes, None,
        "{fixture}: damaged file not restored"
    );
    assert_eq!(out.generation.stats.reused, 0);
    assert_eq!(out.generation.tokens, want2);
    let _ = std::fs::remove_dir_all(&kv);
}

#[test]
fn qwen3_next_sessions_reuse_the_recurrent_state_only_where_it_was_taken() {
    check("qwen3_next");
}

#[test]
fn qwen3_5_moe_sessions_reuse_the_recurrent_state_only_where_it_was_taken() {
    check("qwen3_5_moe");
}
