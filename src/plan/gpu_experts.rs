//! Where a routed expert that is not in the VRAM pool is computed (`--gpu-experts`): on the
//! GPU after its bytes are copied into a pool slot (`stage`), or on the CPU threads from the
//! RAM expert cache while the GPU computes the pool's experts (`hybrid`); `vram` asks for a
//! pool that holds every expert (then there are no misses).
//!
//! Owns: the choice and its reason (one `[plan] gpu-experts:` line) from two measured costs:
//! copying an expert over PCIe (doctor's pinned host->device GB/s, else timed at attach) and
//! the CPU's expert product (timed at attach on the model's own experts, one token and many).
//! Does not own: the measurements (gpu/split.rs) or the computing (gpu/split.rs, gpu/model.rs).
//! Invariant: the choice moves work, never changes it: both paths compute the same products
//! (the CPU's kernels and the GPU's differ in f32 summation order only; tests/gpu.rs holds
//! the tolerance).

use std::fmt;

/// Where pool misses run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuExperts {
    /// Every routed expert has a VRAM slot.
    Vram,
    /// Misses of few tokens run on the CPU, from the RAM cache; larger ones are staged.
    Hybrid,
    /// Every miss is copied into a pool slot and computed on the GPU.
    Stage,
}

impl GpuExperts {
    pub fn name(self) -> &'static str {
        match self {
            GpuExperts::Vram => "vram",
            GpuExperts::Hybrid => "hybrid",
            GpuExperts::Stage => "stage",
        }
    }
}

impl fmt::Display for GpuExperts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `--gpu-experts auto|vram|hybrid|stage`: `None` is auto.
pub fn parse(s: &str) -> Result<Option<GpuExperts>, String> {
    match s {
        "auto" => Ok(None),
        "vram" => Ok(Some(GpuExperts::Vram)),
        "hybrid" => Ok(Some(GpuExperts::Hybrid)),
        "stage" => Ok(Some(GpuExperts::Stage)),
        _ => Err(format!("{s:?}: expected auto, vram, hybrid or stage")),
    }
}

/// The CPU's cost of one routed expert's three products: `one_token_us` for one token,
/// `per_token_us` for each further token (the products turn compute-bound).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuExpertCost {
    pub one_token_us: f64,
    pub per_token_us: f64,
}

impl CpuExpertCost {
    pub fn us(&self, tokens: usize) -> f64 {
        self.one_token_us + self.per_token_us * tokens.saturating_sub(1) as f64
    }
}

/// What `decide` needs.
#[derive(Clone, Debug)]
pub struct ExpertsInputs {
    /// `--gpu-experts` (None: auto).
    pub want: Option<GpuExperts>,
    /// Whether the pool has a slot for every routed expert.
    pub pool_holds_all: bool,
    /// Bytes one staged expert copies (a pool slot's span).
    pub expert_bytes: u64,
    /// Pinned host->device GB/s and where the figure comes from.
    pub h2d: Option<(f64, String)>,
    pub cpu: Option<CpuExpertCost>,
    /// Why the CPU cannot take misses here (e.g. gpt-oss's biased experts), if it cannot.
    pub cpu_refusal: Option<String>,
}

/// The choice.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertsChoice {
    pub mode: GpuExperts,
    /// Hybrid: a miss with at most this many tokens runs on the CPU, a larger one is staged.
    pub cpu_max_tokens: usize,
    pub reason: String,
}

impl ExpertsChoice {
    /// The `[plan]` line.
    pub fn line(&self) -> String {
        format!("[plan] gpu-experts: {} ({})", self.mode, self.reason)
    }
}

/// Most tokens a miss may have and still be computed on the CPU (a cap on the scratch too).
pub const CPU_MAX_TOKENS: usize = 64;

/// Decides where misses run. An error is a refused `--gpu-experts` (one line).
pub fn decide(i: &ExpertsInputs) -> Result<ExpertsChoice, String> {
    let choice = |mode, cpu_max_tokens, reason: String| {
        Ok(ExpertsChoice {
            mode,
            cpu_max_tokens,
            reason,
        })
    };
    if i.pool_holds_all {
        let why = match i.want {
            Some(GpuExperts::Hybrid) | Some(GpuExperts::Stage) => {
                "the VRAM pool has a slot for every routed expert, so there are no misses to place"
            }
            _ => "the VRAM pool has a slot for every routed expert",
        };
        return choice(GpuExperts::Vram, 0, why.into());
    }
    if i.want == Some(GpuExperts::Vram) {
        return Err(
            "--gpu-experts vram: the VRAM pool holds only part of the routed experts; raise --vram or use hybrid or stage"
                .into(),
        );
    }
    if i.want == Some(GpuExperts::Stage) {
        return choice(GpuExperts::Stage, 0, "--gpu-experts stage".into());
    }
    if let Some(why) = &i.cpu_refusal {
        if i.want == Some(GpuExperts::Hybrid) {
            return Err(format!("--gpu-experts hybrid: {why}"));
        }
        return choice(GpuExperts::Stage, 0, format!("{why}: misses are staged"));
    }
    let mb = i.expert_bytes as f64 / 1e6;
    let (Some((gbps, src)), Some(cpu)) = (&i.h2d, i.cpu) else {
        // Nothing measured: misses of one or two tokens (decode) on the CPU, the rest staged.
        let m = 2;
        let why = match i.want {
            Some(_) => format!("--gpu-experts hybrid; no measured rates: misses of at most {m} tokens on the CPU"),
            None => format!("no measured copy or CPU rate: misses of at most {m} tokens on the CPU, larger ones staged"),
        };
        return choice(GpuExperts::Hybrid, m, why);
    };
    let stage_us = i.expert_bytes as f64 / (gbps * 1e9) * 1e6;
    // The largest token count whose CPU products take no longer than the copy alone.
    let mut fit = 0;
    while fit < CPU_MAX_TOKENS && cpu.us(fit + 1) <= stage_us {
        fit += 1;
    }
    let figures = format!(
        "copying a {mb:.1} MB expert at {gbps:.1} GB/s ({src}) takes {stage_us:.0} us; the CPU's products take {:.0} us for one token, +{:.1} us a token",
        cpu.one_token_us, cpu.per_token_us
    );
    match (i.want, fit) {
        (Some(GpuExperts::Hybrid), 0) => choice(
            GpuExperts::Hybrid,
            1,
            format!("--gpu-experts hybrid: {figures}: misses of one token on the CPU anyway"),
        ),
        (_, 0) => choice(
            GpuExperts::Stage,
            0,
            format!("{figures}: staging is faster even for one token (--gpu-experts hybrid overrides)"),
        ),
        (want, m) => choice(
            GpuExperts::Hybrid,
            m,
            format!(
                "{}{figures}: misses of at most {m} token{} run on the CPU from the RAM cache while the GPU computes the pool's, larger ones are staged{}",
                if want.is_some() { "--gpu-experts hybrid: " } else { "" },
                if m == 1 { "" } else { "s" },
                if want.is_some() { "" } else { " (--gpu-experts stage overrides)" }
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(want: Option<GpuExperts>, all: bool) -> ExpertsInputs {
        ExpertsInputs {
            want,
            pool_holds_all: all,
            expert_bytes: 2_650_000,
            h2d: Some((53.0, "doctor".into())),
            cpu: Some(CpuExpertCost {
                one_token_us: 30.0,
                per_token_us: 8.0,
            }),
            cpu_refusal: None,
        }
    }

    #[test]
    fn every_expert_in_vram_needs_no_choice() {
        for w in [None, Some(GpuExperts::Hybrid), Some(GpuExperts::Stage)] {
            assert_eq!(decide(&inputs(w, true)).unwrap().mode, GpuExperts::Vram);
        }
        assert!(decide(&inputs(Some(GpuExperts::Vram), false)).is_err());
    }

    #[test]
    fn the_cpu_takes_misses_it_finishes_before_their_copy() {
        // 2.65 MB at 53 GB/s = 50 us; the CPU: 30 + 8 (t - 1) us -> up to 3 tokens.
        let c = decide(&inputs(None, false)).unwrap();
        assert_eq!((c.mode, c.cpu_max_tokens), (GpuExperts::Hybrid, 3));
        assert!(c.line().starts_with("[plan] gpu-experts: hybrid ("));
        // A slow CPU: staging wins, unless the flag says hybrid.
        let mut i = inputs(None, false);
        i.cpu = Some(CpuExpertCost {
            one_token_us: 80.0,
            per_token_us: 8.0,
        });
        assert_eq!(decide(&i).unwrap().mode, GpuExperts::Stage);
        i.want = Some(GpuExperts::Hybrid);
        let c = decide(&i).unwrap();
        assert_eq!((c.mode, c.cpu_max_tokens), (GpuExperts::Hybrid, 1));
        i.want = Some(GpuExperts::Stage);
        assert_eq!(
            decide(&inputs(i.want, false)).unwrap().mode,
            GpuExperts::Stage
        );
    }

    #[test]
    fn experts_the_cpu_cannot_run_are_staged() {
        let mut i = inputs(None, false);
        i.cpu_refusal = Some("gpt-oss's biased experts".into());
        assert_eq!(decide(&i).unwrap().mode, GpuExperts::Stage);
        i.want = Some(GpuExperts::Hybrid);
        assert!(decide(&i).is_err());
    }
}
