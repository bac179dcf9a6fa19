//! No input panics the readers: every truncation of a GGUF header, and random byte corruption
//! of GGUF and safetensors files, either opens (and then every tensor can be asked for its
//! bytes, experts and values without a panic) or fails with an error naming the file.

mod format_util;

use format_util::*;
use sluice::format::ModelFiles;

/// Open `bytes` written to `path`; on success exercise every accessor.
fn try_open(path: &std::path::Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
    match ModelFiles::open(path) {
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains(path.file_name().unwrap().to_str().unwrap()),
                "{msg}"
            );
            assert!(!msg.contains('\n'), "{msg}");
        }
        Ok(m) => {
            for t in m.tensors() {
                let _ = m.bytes(t);
                let _ = m.expert_range(t, 0);
                if t.n_elems() <= 1 << 20 {
                    let _ = m.dequantize(t);
                }
            }
            for k in m.meta_keys() {
                assert!(m.meta(k).is_some());
            }
        }
    }
}

/// A small deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn every_truncation_of_a_gguf_header_is_an_error() {
    let g = std::fs::read(fixture("tiny-moe.gguf")).unwrap();
    let m = ModelFiles::open(&fixture("tiny-moe.gguf")).unwrap();
    let header = m.data_offset(0).unwrap() as usize;
    let d = scratch("trunc");
    let p = d.join("t.gguf");
    for cut in (0..header).step_by(7) {
        std::fs::write(&p, &g[..cut]).unwrap();
        assert!(ModelFiles::open(&p).is_err(), "cut at {cut} opened");
    }
}

#[test]
fn corrupted_gguf_headers_never_panic() {
    let g = std::fs::read(fixture("format/all-types.gguf")).unwrap();
    let header = ModelFiles::open(&fixture("format/all-types.gguf"))
        .unwrap()
        .data_offset(0)
        .unwrap() as usize;
    let d = scratch("flip-gguf");
    let p = d.join("f.gguf");
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    for _ in 0..300 {
        let mut b = g.clone();
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(header);
            b[i] = match rng.below(3) {
                0 => rng.next() as u8,
                1 => 0xFF,
                _ => b[i] ^ (1 << rng.below(8)),
            };
        }
        try_open(&p, &b);
    }
}

#[test]
fn corrupted_safetensors_headers_never_panic() {
    let h = r#"{"a.weight":{"dtype":"F8_E4M3","shape":[4,8],"data_offsets":[0,32]},"a.weight_scale_inv":{"dtype":"F32","shape":[1,1],"data_offsets":[32,36]},"b":{"dtype":"BF16","shape":[2,2,2],"data_offsets":[36,52]}}"#;
    let mut good = (h.len() as u64).to_le_bytes().to_vec();
    good.extend(h.as_bytes());
    good.extend((0..52u8).map(|i| i.wrapping_mul(37) & 0x7E));
    let d = scratch("flip-st");
    let p = d.join("m.safetensors");
    try_open(&p, &good);
    assert!(ModelFiles::open(&p).is_ok());
    let mut rng = Rng(0x5EED_1234_ABCD_0002);
    for _ in 0..300 {
        let mut b = good.clone();
        for _ in 0..1 + rng.below(3) {
            let i = rng.below(8 + h.len());
            b[i] = if rng.below(2) == 0 {
                b"0123456789[]{},:\"-"[rng.below(18)]
            } else {
                rng.next() as u8
            };
        }
        try_open(&p, &b);
    }
}
