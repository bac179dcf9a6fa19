//! `sluice synth` output is a GGUF that the `gguf` Python package (llama.cpp's own reader)
//! reads: same architecture, tensor names, types and shapes as sluice's reader reports, and
//! the `--skew` router bias is deterministic.

use sluice::format::ModelFiles;
use std::path::Path;
use std::process::Command;

#[test]
fn synth_gguf_reads_in_the_gguf_package() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("synth");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("s.gguf");
    let mut spec = sluice::synth::MoeSpec::preset("qwen3-30b-a3b").unwrap();
    // Real head/expert geometry, cut to 1 layer, small vocab and hidden so the test is quick.
    (
        spec.layers,
        spec.hidden,
        spec.experts,
        spec.expert_ffn,
        spec.vocab,
        spec.skew,
    ) = (1, 256, 16, 256, 0, 1.0);
    spec.dtype = sluice::dtype::DType::Q4_K;
    sluice::synth::write_random_qwen3moe(&path, &spec, &mut |_, _| {}).unwrap();
    let ours = ModelFiles::open(&path).unwrap();
    let script = r#"
import sys, gguf
r = gguf.GGUFReader(sys.argv[1])
arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
print(arch)
for t in r.tensors:
    print(t.name, t.tensor_type.name, ",".join(str(int(d)) for d in reversed(t.shape.tolist())), int(t.data_offset))
"#;
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&path)
        .output()
        .expect("python3 (run .ci/run to install the gguf package)");
    assert!(
        out.status.success(),
        "gguf package could not read the file (run .ci/run): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("qwen3moe"));
    let theirs: Vec<&str> = lines.collect();
    assert_eq!(theirs.len(), ours.tensors().len());
    for (line, t) in theirs.iter().zip(ours.tensors()) {
        let shape = t
            .shape
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(
            *line,
            format!("{} {} {} {}", t.name, t.dtype.name(), shape, t.range.offset),
            "tensor {}",
            t.name
        );
    }
    // Deterministic: the same spec writes the same bytes.
    let again = dir.join("s2.gguf");
    sluice::synth::write_random_qwen3moe(&again, &spec, &mut |_, _| {}).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        std::fs::read(&again).unwrap()
    );
}
