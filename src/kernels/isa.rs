//! Run-time choice of instruction set. `SLUICE_ISA=scalar|avx2|avx512` caps the choice (for
//! tests and A/B benchmarks); it can never raise it above what the CPU has.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/DQ + VNNI, on top of AVX2.
    Avx512,
}

impl Isa {
    /// What this CPU supports (ignores `SLUICE_ISA`).
    pub fn hardware() -> Isa {
        static HW: OnceLock<Isa> = OnceLock::new();
        *HW.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c");
                let avx512 = avx2
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512dq")
                    && is_x86_feature_detected!("avx512vnni");
                if avx512 {
                    return Isa::Avx512;
                }
                if avx2 {
                    return Isa::Avx2;
                }
            }
            Isa::Scalar
        })
    }

    /// The ISA kernels use: the hardware's, capped by `SLUICE_ISA` when set.
    pub fn detect() -> Isa {
        static CHOSEN: OnceLock<Isa> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let hw = Isa::hardware();
            match std::env::var("SLUICE_ISA")
                .ok()
                .as_deref()
                .and_then(Isa::parse)
            {
                Some(cap) => cap.min(hw),
                None => hw,
            }
        })
    }

    pub fn parse(s: &str) -> Option<Isa> {
        match s.to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" | "avx-512" => Some(Isa::Avx512),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Whether this CPU can run kernels built for `self` (SIMD wrappers check this before
    /// entering `#[target_feature]` code, so calling them directly is never unsound).
    #[inline]
    pub fn supported(self) -> bool {
        self <= Isa::hardware()
    }

    /// Every ISA this machine can run, lowest first (tests iterate these).
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| *i <= Isa::hardware())
            .collect()
    }
}
