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
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kv")
        .join(name);
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
        assert!(
            bad.is_empty(),
            "{ty}: {} bytes differ, first at {:?}",
            bad.len(),
            bad.first()
        );
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

/// A small DeepSeek-V3-shaped file (MLA: 64-wide latent, 32-wide rope key: q8_0 fits).
fn synth_deepseek() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kv-precision");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("deepseek-small.gguf");
        let mut s = MoeSpec::preset("deepseek-v3").unwrap();
        (s.hidden, s.experts, s.experts_used, s.expert_ffn, s.vocab) = (256, 16, 4, 256, 0);
        let SynthArch::Deepseek2 { mla, moe, .. } = &mut s.arch else {
            panic!("deepseek-v3 preset is not deepseek2")
        };
        s.heads = 4;
        (mla.q_lora, mla.kv_lora, mla.nope, mla.rope, mla.v_dim) = (64, 64, 32, 32, 32);
        (moe.dense_ffn, moe.n_group, moe.topk_group) = (128, 4, 2);
        s.cut_layers(2).unwrap();
        sluice::synth::write_random(&path, &s, &mut |_, _| {}).unwrap();
        path
    })
}

fn model_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn qwen_fixture() -> PathBuf {
    model_fixture("qwen3_moe/model-q8_0.gguf")
}

fn load(files: &ModelFiles, kv: KvTypes, threads: usize) -> Model<'_> {
    Model::load(
        files,
        &LoadOptions {
            threads,
            ctx: 128,
            kv,
        },
    )
    .unwrap()
}

fn tokens(model: &Model<'_>, n: usize) -> Vec<u32> {
    let v = model.cfg.vocab as u32;
    (0..n as u32).map(|i| (i * 131 + 7) % v).collect()
}

fn logits(
    model: &Model<'_>,
    files: &ModelFiles,
    toks: &[u32],
    batch: usize,
    cache: Option<CacheConfig>,
) -> Vec<f32> {
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
        kl += p
            .iter()
            .zip(&q)
            .map(|(p, q)| if *p > 0.0 { p * (p / q).ln() } else { 0.0 })
            .sum::<f64>();
        same += usize::from(argmax(a) == argmax(b));
        n += 1;
    }
    (kl / n as f64, same as f64 / n as f64)
}

#[test]
fn reduced_precision_logits_stay_close_to_the_f32_caches() {
    use KvType::{BF16, F16, F32, Q8_0};
    let kv = |k, v| KvTypes { k, v };
    let gqa = |ts: &[KvType]| -> Vec<KvTypes> {
        ts.iter()
            .flat_map(|&t| [KvTypes::both(t), kv(t, F32), kv(F32, t)])
            .collect()
    };
    // MLA: the latent follows -ctk; there is no value side (V3.2: f32 indexer keys).
    let mla = |ts: &[KvType]| -> Vec<KvTypes> { ts.iter().map(|&t| kv(t, F32)).collect() };
    // Bounds: 1e-3 on the fixtures (checkpoints of real configs); 5e-3 on the random synth
    // files, whose routers have near-ties, so any rounding flips a few expert choices (f16,
    // bf16 and q8_0 all measure 0.5-1.7e-3 there: the flips, not the rounding, dominate).
    let cases: Vec<(PathBuf, Vec<KvTypes>, f64)> = vec![
        (synth_qwen().to_path_buf(), gqa(&[F16, BF16, Q8_0]), 5e-3),
        // 16-wide heads: q8_0 does not fit (refused, see below).
        (qwen_fixture(), gqa(&[F16, BF16]), 1e-3),
        // A sliding window.
        (model_fixture("mixtral_swa"), gqa(&[F16, BF16]), 1e-3),
        (
            synth_deepseek().to_path_buf(),
            mla(&[F16, BF16, Q8_0]),
            5e-3,
        ),
        (
            model_fixture("deepseek_v3/model-q8_0.gguf"),
            mla(&[F16, BF16]),
            1e-3,
        ),
        // Sparse attention over the indexer's picks (index_topk below the sequence).
        (model_fixture("deepseek_v32_sparse"), mla(&[F16]), 1e-3),
    ];
    for (path, kvs, bound) in cases {
        let files = ModelFiles::open(&path).unwrap();
        let f32m = load(&files, KvTypes::F32, 2);
        let toks = tokens(&f32m, 48);
        let vocab = f32m.cfg.vocab;
        let reference = logits(&f32m, &files, &toks, 16, None);
        for kv in kvs {
            let m = load(&files, kv, 2);
            assert_eq!(m.kv, kv, "{}", path.display());
            let got = logits(&m, &files, &toks, 16, None);
            assert_ne!(
                bits(&got),
                bits(&reference),
                "{}: {kv:?} rounds something",
                path.display()
            );
            let (kl, top1) = kl_and_top1(&reference, &got, vocab);
            eprintln!(
                "{}: {kv:?}: mean KL {kl:.2e}, argmax agrees at {:.1}%",
                path.display(),
                100.0 * top1
            );
            assert!(kl < bound, "{}: {kv:?}: mean KL {kl}", path.display());
            assert!(
                top1 >= 0.9,
                "{}: {kv:?}: argmax agrees at {top1}",
                path.display()
            );
        }
    }
}

#[test]
fn f16_logits_are_bit_identical_across_threads_batches_and_placement() {
    for path in [synth_qwen(), qwen_fixture().as_path(), synth_deepseek()] {
        let files = ModelFiles::open(path).unwrap();
        let base = load(&files, KvTypes::default(), 1);
        assert_eq!(base.kv.k, KvType::F16, "the default cache is f16");
        let toks = tokens(&base, 40);
        let reference = logits(&base, &files, &toks, 16, None);
        for threads in [1, 2, 4] {
            let m = load(&files, KvTypes::default(), threads);
            for batch in [1, 7, 16] {
                let got = logits(&m, &files, &toks, batch, None);
                assert_eq!(
                    bits(&got),
                    bits(&reference),
                    "{}: threads {threads} batch {batch}",
                    path.display()
                );
            }
        }
        let m = load(&files, KvTypes::default(), 2);
        let n_exp = m.cfg.n_experts;
        for io in [IoMode::Direct, IoMode::Buffered, IoMode::Mmap] {
            for slots in [1, n_exp] {
                let mut c = CacheConfig::new(slots);
                c.io = io;
                let got = logits(&m, &files, &toks, 16, Some(c));
                assert_eq!(
                    bits(&got),
                    bits(&reference),
                    "{}: io {io:?} slots {slots}",
                    path.display()
                );
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
    assert_eq!(
        bytes(KvTypes {
            k: KvType::Q8_0,
            v: KvType::F16
        }),
        f32b / 256 * 34 + f32b / 4
    );
}

/// `sluice ARGS`: (exit code, stderr).
fn sluice(args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn cache_type_flags_parse_and_refuse_in_one_line() {
    let model = qwen_fixture();
    let m = model.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec![
            "run", m, "-p", "hello", "-n", "2", "--temp", "0", "-t", "1", "--gpu", "off",
        ];
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
        assert!(
            errors[0].contains(flag) && errors[0].contains("f32, f16, bf16 or q8_0"),
            "{extra:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    // Every command that runs a model takes the flags (one parser: `ComputeArgs`).
    for cmd in [
        &["logits", m, "--tokens", "1,2,3", "--out", "/dev/null"][..],
        &["chat", m][..],
        &["serve", m, "--port", "0"][..],
        &["plan", m][..],
    ] {
        let mut a = cmd.to_vec();
        a.extend_from_slice(&["-ctv", "q4"]);
        let (code, err) = sluice(&a);
        assert_ne!(code, 0, "{cmd:?}: {err}");
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{cmd:?}: {err}");
        assert!(errors[0].contains("-ctv \"q4\""), "{cmd:?}: {err}");
    }
    // q8_0 on 16-wide heads: refused naming the width.
    let (code, err) = run(&["-ctk", "q8_0"]);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("-ctk q8_0") && err.contains("head_dim is 16"),
        "{err}"
    );
    // A bf16 or q8_0 cache with the GPU: refused (whatever this build has); the GPU's cache
    // holds f32 or f16 values.
    let (code, err) = sluice(&[
        "run", m, "-p", "hi", "-n", "1", "--gpu", "on", "-ctv", "bf16",
    ]);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("-ctv bf16 with --gpu on") && err.contains("f32 or f16 values"),
        "{err}"
    );
    // Accepted spellings run, and the run says which types it caches in and why.
    for (extra, line) in [
        (
            &[][..],
            "[plan] kv cache types: keys f16, values f16 (f16 by default, as llama.cpp)",
        ),
        (
            &["-ctk", "bf16", "-ctv=f32"][..],
            "[plan] kv cache types: keys bf16, values f32 (-ctk/-ctv)",
        ),
        (
            &["--cache-type-k", "f32"][..],
            "[plan] kv cache types: keys f32, values f16",
        ),
    ] {
        let (code, err) = run(extra);
        assert_eq!(code, 0, "{extra:?}: {err}");
        assert!(err.contains(line), "{extra:?}: {err}");
    }
    // MLA: the latent follows -ctk (q8_0 needs whole blocks: the fixture's rope key is 16
    // wide), and -ctv has nothing to set, which the run says.
    let ds = model_fixture("deepseek_v3/model-q8_0.gguf");
    let ds = ds.to_str().unwrap();
    let (code, err) = sluice(&[
        "run", ds, "-p", "hi", "-n", "1", "--gpu", "off", "-ctk", "q8_0",
    ]);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("-ctk q8_0") && err.contains("qk_rope_head_dim is 16"),
        "{err}"
    );
    let (code, err) = sluice(&[
        "run", ds, "-p", "hi", "-n", "1", "--gpu", "off", "-ctk", "bf16",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("[plan] kv cache types: keys bf16, values none (")
            && err.contains("-ctv f16: MLA caches no value rows"),
        "{err}"
    );
    // DeepSeek-V4's caches stay f32, and the run says why.
    let v4 = model_fixture("deepseek_v4");
    let (code, err) = sluice(&[
        "run",
        v4.to_str().unwrap(),
        "-p",
        "hi",
        "-n",
        "1",
        "--gpu",
        "off",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("[plan] kv cache types: keys f32, values f32 (")
            && err.contains("DeepSeek-V4's compressed and window caches stay f32"),
        "{err}"
    );
}
