//! Helpers shared by the expert-cache tests: a seeded generator, scratch files of random bytes,
//! expert layouts with deliberately unaligned ranges, Zipf-distributed routing.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use sluice::experts::ExpertLoc;
use sluice::format::ByteRange;

/// xorshift64*: small, seeded, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }

    /// `k` distinct indices below `n`, drawn by weight (weights need not be normalised).
    pub fn distinct_weighted(&mut self, weights: &[f64], k: usize) -> Vec<usize> {
        let total: f64 = weights.iter().sum();
        let mut out = Vec::with_capacity(k);
        while out.len() < k.min(weights.len()) {
            let mut x = self.f64() * total;
            let mut pick = weights.len() - 1;
            for (i, w) in weights.iter().enumerate() {
                if x < *w {
                    pick = i;
                    break;
                }
                x -= w;
            }
            if !out.contains(&pick) {
                out.push(pick);
            }
        }
        out
    }
}

/// A fresh scratch directory under CARGO_TARGET_TMPDIR.
pub fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create scratch dir");
    d
}

/// Writes `len` seeded random bytes to `path` and returns them.
pub fn random_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    Rng::new(seed).fill(&mut data);
    std::fs::write(path, &data).expect("write random file");
    data
}

pub fn r(file: usize, offset: u64, len: u64) -> ByteRange {
    ByteRange { file, offset, len }
}

/// Two files and three layers (the middle one dense) of experts with unaligned offsets and
/// lengths: parts spread over both files, neighbours that share a page, a 17-byte part, a
/// part at offset 0 and a part ending exactly at the (unaligned) end of each file.
pub struct Layout {
    pub paths: Vec<PathBuf>,
    pub data: Vec<Vec<u8>>,
    pub experts: Vec<Vec<ExpertLoc>>,
}

pub const F0_LEN: usize = 3 * 1024 * 1024 + 1234;
pub const F1_LEN: usize = 1024 * 1024 + 77;

pub fn layout(dir: &Path) -> Layout {
    let paths = vec![dir.join("model-0.bin"), dir.join("model-1.bin")];
    let data = vec![
        random_file(&paths[0], F0_LEN, 11),
        random_file(&paths[1], F1_LEN, 22),
    ];
    let (f0, f1) = (F0_LEN as u64, F1_LEN as u64);
    let mut l0 = Vec::new();
    // Like GGUF: gate, up, down in three "tensors" of file 0, per-expert stride unaligned.
    let (g_base, u_base, d_base, stride, part) =
        (1000u64, 400_000u64, 800_001u64, 70_013u64, 70_013u64);
    for e in 0..5 {
        l0.push(ExpertLoc {
            parts: [
                r(0, g_base + e * stride, part),
                r(0, u_base + e * stride, part),
                r(0, d_base + e * stride, part),
            ],
        });
    }
    // Parts across both files; down ends exactly at the end of file 0.
    l0.push(ExpertLoc {
        parts: [r(1, 0, 5000), r(1, 5000, 17), r(0, f0 - 300_007, 300_007)],
    });
    let mut l2 = Vec::new();
    // HF-like: w1, w2, w3 back to back (gate, down, up order in the file) in file 1.
    for e in 0..4u64 {
        let base = 20_011 + e * 3 * 33_333;
        l2.push(ExpertLoc {
            parts: [
                r(1, base, 33_333),
                r(1, base + 2 * 33_333, 33_333),
                r(1, base + 33_333, 33_333),
            ],
        });
    }
    // Ends exactly at the end of file 1, gate and up in file 0 out of order.
    l2.push(ExpertLoc {
        parts: [
            r(0, 2_000_003, 123_457),
            r(0, 1_500_001, 4096),
            r(1, f1 - 65_537, 65_537),
        ],
    });
    Layout {
        paths,
        data,
        experts: vec![l0, Vec::new(), l2],
    }
}

impl Layout {
    pub fn expected(&self, layer: usize, expert: usize, part: usize) -> &[u8] {
        let p = self.experts[layer][expert].parts[part];
        &self.data[p.file][p.offset as usize..(p.offset + p.len) as usize]
    }
}

/// Zipf(s) weights over `n` items, shuffled by a seeded permutation.
pub fn zipf_weights(n: usize, s: f64, rng: &mut Rng) -> Vec<f64> {
    let mut w: Vec<f64> = (1..=n).map(|i| 1.0 / (i as f64).powf(s)).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        w.swap(i, j);
    }
    w
}
