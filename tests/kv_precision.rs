//! KV cache precision (`-ctk` / `-ctv`, issue 16 item 3): the stored rows against references
//! nobody here wrote (numpy's f16 cast, the `gguf` package's BF16 and Q8_0 quantizers; fixtures
//! from scripts/make_kv_fixtures.py), f16 / bf16 / q8_0 logits against the f32 cache's (KL and
//! argmax), the default f16 cache's invariants (bit-identical logits across threads, prefill
//! batch sizes and expert placement: IO modes and cache sizes), the bytes counted, and the
//! flags' one-line refusals.

use sluice::experts::{CacheConfig, IoMode};
use sluice::format::ModelFiles;
use sluice::kernels::kv::{load_row, store_row, KvType};
use sluice::model::{KvTypes, LoadOptions, Model};
use sluice::synth::{MoeSpec, SynthArch};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn fixture(name: &str) -> Vec<u8> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv").join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn rows_are_written_as_numpy_and_gguf_write_them() {
    let x: Vec<f32> = fixture("in.f32")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    for (ty, file) in [
        (KvType::F16, "f16.bin"),
        (KvType::BF16, "bf16.bin"),
        (KvType::Q8_0, "q8_0.bin"),
    ] {
        let want = fixture(file);
        let mut got = vec![0u8; ty.row_bytes(x.len())];
        store_row(ty, &x, &mut got);
        assert_eq!(got.len(), want.len(), "{ty}");
        let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
        assert!(bad.is_empty(), "{ty}: {} bytes differ, first at {:?}", bad.len(), bad.first());
        // Reading back is exact: the same values gguf's dequantizer gives (f16 / bf16 widen).
        let mut back = vec![0.0f32; x.len()];
        load_row(ty, &got, &mut back);
        let mut deq = vec![0.0f32; x.len()];
        sluice::kernels::dequantize(ty.dtype(), &want, &mut deq).unwrap();
        assert_eq!(
            back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            deq.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{ty}: load_row"
        );
    }
}

/// A small Qwen3-MoE-shaped file (two layers, 64-wide heads: q8_0 fits), written once.
fn synth_qwen() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kv-precision");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qwen3-small.gguf");
        let mut s = MoeSpec::preset("qwen3-30b-a3b").unwrap();
        (s.hidden, s.experts, s.experts_used, s.expert_ffn, s.vocab) = (256, 16, 4, 256, 0);
        assert!(matches!(s.arch, SynthArch::Qwen3Moe));
        (s.heads, s.kv_heads, s.head_dim) = (4, 2, 64);
        s.cut_layers(2).unwrap();
        sluice::synth::write_random(&path, &s, &mut |_, _| {}).unwrap();
        path
    })
}

fn qwen_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3_moe/model-q8_0.gguf")
}

fn load(files: &ModelFiles, kv: KvTypes, threads: usize) -> Model<'_> {
    Model::load(files, &LoadOptions { threads, ctx: 128, kv }).unwrap()
}

fn tokens(model: &Model<'_>, n: usize) -> Vec<u32> {
    let v = model.cfg.vocab as u32;
    (0..n as u32).map(|i| (i * 131 + 7) % v).collect()
}

fn logits(model: &Model<'_>, files: &ModelFiles, toks: &[u32], batch: usize, cache: Option<CacheConfig>) -> Vec<f32> {
    let mut st = model.new_state(128, batch, batch).unwrap();
    if let Some(c) = cache {
        st.attach_experts(model.expert_cache(files, c).unwrap());
    }
    let mut out = Vec::new();
    model.logits_all(&mut st, toks, &mut out).unwrap();
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Mean KL(p_ref || p) over positions and the share of positions with the same argmax.
fn kl_and_top1(reference: &[f32], got: &[f32], vocab: usize) -> (f64, f64) {
    let soft = |r: &[f32]| {
        let m = r.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)) as f64;
        let e: Vec<f64> = r.iter().map(|v| (*v as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|v| v / s).collect::<Vec<f64>>()
    };
    let argmax = |r: &[f32]| (0..r.len()).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap();
    let (mut kl, mut same, mut n) = (0.0, 0usize, 0usize);
    for (a, b) in reference.chunks(vocab).zip(got.chunks(vocab)) {
        let (p, q) = (soft(a), soft(b));
        kl += p.iter().zip(&q).map(|(p, q)| if *p > 0.0 { p * (p / q).ln() } else { 0.0 }).sum::<f64>();
        same += usize::from(argmax(a) == argmax(b));
        n += 1;
    }
    (kl / n as f64, same as f64 / n as f64)
}

#[test]
fn reduced_precision_logits_stay_close_to_the_f32_caches() {
    let cases: [(&Path, &[KvType]); 2] = [
        (synth_qwen(), &[KvType::F16, KvType::BF16, KvType::Q8_0]),
        // 16-wide heads: q8_0 does not fit (refused, see below).
        (&qwen_fixture(), &[KvType::F16, KvType::BF16]),
    ];
    for (path, types) in cases {
        let files = ModelFiles::open(path).unwrap();
        let f32m = load(&files, KvTypes::F32, 2);
        let toks = tokens(&f32m, 48);
        let vocab = f32m.cfg.vocab;
        let reference = logits(&f32m, &files, &toks, 16, None);
        for &t in types {
            for kv in [KvTypes::both(t), KvTypes { k: t, v: KvType::F32 }, KvTypes { k: KvType::F32, v: t }] {
                let m = load(&files, kv, 2);
                assert_eq!(m.kv, kv);
                let got = logits(&m, &files, &toks, 16, None);
                assert_ne!(bits(&got), bits(&reference), "{}: {kv:?} rounds something", path.display());
                let (kl, top1) = kl_and_top1(&reference, &got, vocab);
                eprintln!("{}: {kv:?}: mean KL {kl:.2e}, argmax agrees at {:.1}%", path.display(), 100.0 * top1);
                assert!(kl < 1e-3, "{}: {kv:?}: mean KL {kl}", path.display());
                assert!(top1 >= 0.9, "{}: {kv:?}: argmax agrees at {top1}", path.display());
            }
        }
    }
}

#[test]
fn f16_logits_are_bit_identical_across_threads_batches_and_placement() {
    for path in [synth_qwen(), qwen_fixture().as_path()] {
        let files = ModelFiles::open(path).unwrap();
        let base = load(&files, KvTypes::default(), 1);
        assert_eq!(base.kv, KvTypes::F16, "the default cache is f16");
        let toks = tokens(&base, 40);
        let reference = logits(&base, &files, &toks, 16, None);
        for threads in [1, 2, 4] {
            let m = load(&files, KvTypes::default(), threads);
            for batch in [1, 7, 16] {
                let got = logits(&m, &files, &toks, batch, None);
                assert_eq!(bits(&got), bits(&reference), "{}: threads {threads} batch {batch}", path.display());
            }
        }
        let m = load(&files, KvTypes::default(), 2);
        let n_exp = m.cfg.n_experts;
        for io in [IoMode::Direct, IoMode::Buffered, IoMode::Mmap] {
            for slots in [1, n_exp] {
                let mut c = CacheConfig::new(slots);
                c.io = io;
                let got = logits(&m, &files, &toks, 16, Some(c));
                assert_eq!(bits(&got), bits(&reference), "{}: io {io:?} slots {slots}", path.display());
            }
        }
    }
}

#[test]
fn kv_bytes_count_the_element_types() {
    let files = ModelFiles::open(synth_qwen()).unwrap();
    let bytes = |kv: KvTypes| {
        let m = load(&files, kv, 1);
        let st = m.new_state(128, 1, 1).unwrap();
        assert_eq!(st.kv_types(), kv);
        assert_eq!(st.kv_bytes(), 128 * m.cfg.kv_bytes_per_token(false, kv));
        st.kv_bytes()
    };
    let f32b = bytes(KvTypes::F32);
    assert_eq!(bytes(KvTypes::F16), f32b / 2);
    assert_eq!(bytes(KvTypes::both(KvType::BF16)), f32b / 2);
    assert_eq!(bytes(KvTypes::both(KvType::Q8_0)), f32b / 128 * 34);
    assert_eq!(bytes(KvTypes { k: KvType::Q8_0, v: KvType::F16 }), f32b / 256 * 34 + f32b / 4);
}

/// `sluice ARGS`: (exit code, stderr).
fn sluice(args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).output().unwrap();
    (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn cache_type_flags_parse_and_refuse_in_one_line() {
    let model = qwen_fixture();
    let m = model.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec!["run", m, "-p", "hello", "-n", "2", "--temp", "0", "-t", "1", "--gpu", "off"];
        a.extend_from_slice(extra);
        sluice(&a)
    };
    for (extra, flag) in [
        (&["-ctk", "q4_0"][..], "-ctk \"q4_0\""),
        (&["-ctv", "F16"][..], "-ctv \"F16\""),
        (&["--cache-type-k", "fp16"][..], "-ctk \"fp16\""),
        (&["-ctk=int8"][..], "-ctk \"int8\""),
    ] {
        let (code, err) = run(extra);
        assert_ne!(code, 0, "{extra:?}: {err}");
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{extra:?}: {err}");
        assert!(errors[0].contains(flag) && errors[0].contains("f32, f16, bf16 or q8_0"), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // q8_0 on 16-wide heads: refused naming the width.
    let (code, err) = run(&["-ctk", "q8_0"]);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("-ctk q8_0") && err.contains("head_dim is 16"), "{err}");
    // An explicit non-f32 cache with the GPU: refused (whatever this build has).
    let (code, err) = sluice(&["run", m, "-p", "hi", "-n", "1", "--gpu", "on", "-ctv", "f16"]);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("-ctv f16 with --gpu on") && err.contains("f32 only"), "{err}");
    // Accepted spellings run, and the run says which types it caches in and why.
    for (extra, line) in [
        (&[][..], "[plan] kv cache types: keys f16, values f16 (f16 by default, as llama.cpp)"),
        (&["-ctk", "bf16", "-ctv=f32"][..], "[plan] kv cache types: keys bf16, values f32 (-ctk/-ctv)"),
        (&["--cache-type-k", "f32"][..], "[plan] kv cache types: keys f32, values f16"),
    ] {
        let (code, err) = run(extra);
        assert_eq!(code, 0, "{extra:?}: {err}");
        assert!(err.contains(line), "{extra:?}: {err}");
    }
    // MLA keeps f32 and says why.
    let ds = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/deepseek_v3/model-q8_0.gguf");
    let (code, err) = sluice(&["run", ds.to_str().unwrap(), "-p", "hi", "-n", "1", "--gpu", "off", "-ctk", "q8_0"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("[plan] kv cache types: f32 (the MLA latent cache"), "{err}");
}
