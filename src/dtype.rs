//! Tensor element types, as GGUF numbers them (ggml type ids) plus the safetensors-only FP8.
//!
//! Owns: the id <-> type mapping, block geometry (elements and bytes per block) and names.
//! Does not own: kernels (see `kernels/`), file parsing (see `format/`).
//! Invariant: a type whose block geometry we do not know is `Unknown(id)`; it is carried through
//! parsing untouched and fails only when someone asks for its bytes or its kernels.

use std::fmt;

/// One tensor element type. Quantized types are stored as blocks of `block_elems()` elements
/// occupying `block_bytes()` bytes; plain types have a block of one element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    I8,
    I16,
    I32,
    I64,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    IQ1_M,
    TQ1_0,
    TQ2_0,
    MXFP4,
    /// FP8 E4M3 (safetensors `F8_E4M3`); DeepSeek checkpoints pair it with a
    /// `weight_scale_inv` tensor of 128x128 block scales.
    F8E4M3,
    /// A ggml type id this build does not know.
    Unknown(u32),
}

/// Super-block size of the k-quants and i-quants.
pub const QK_K: usize = 256;

impl DType {
    /// Map a ggml type id (as stored in GGUF tensor infos) to a type.
    pub fn from_ggml_id(id: u32) -> DType {
        use DType::*;
        match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            other => Unknown(other),
        }
    }

    /// The ggml type id, if this type has one (FP8 has none).
    pub fn ggml_id(self) -> Option<u32> {
        use DType::*;
        Some(match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
            F8E4M3 => return None,
            Unknown(id) => id,
        })
    }

    /// (elements per block, bytes per block); `None` for unknown types.
    pub fn block_geometry(self) -> Option<(usize, usize)> {
        use DType::*;
        Some(match self {
            F32 => (1, 4),
            F16 | BF16 => (1, 2),
            F64 => (1, 8),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 => (1, 8),
            F8E4M3 => (1, 1),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2_K => (QK_K, 84),
            Q3_K => (QK_K, 110),
            Q4_K => (QK_K, 144),
            Q5_K => (QK_K, 176),
            Q6_K => (QK_K, 210),
            Q8_K => (QK_K, 292),
            IQ2_XXS => (QK_K, 66),
            IQ2_XS => (QK_K, 74),
            IQ3_XXS => (QK_K, 98),
            IQ1_S => (QK_K, 50),
            IQ4_NL => (32, 18),
            IQ3_S => (QK_K, 110),
            IQ2_S => (QK_K, 82),
            IQ4_XS => (QK_K, 136),
            IQ1_M => (QK_K, 56),
            TQ1_0 => (QK_K, 54),
            TQ2_0 => (QK_K, 66),
            MXFP4 => (32, 17),
            Unknown(_) => return None,
        })
    }

    pub fn block_elems(self) -> Option<usize> {
        self.block_geometry().map(|g| g.0)
    }

    /// Bytes needed for `n_elems` elements, or `None` if the type is unknown or `n_elems` is not
    /// a whole number of blocks.
    pub fn bytes_for(self, n_elems: u64) -> Option<u64> {
        let (be, bb) = self.block_geometry()?;
        if !n_elems.is_multiple_of(be as u64) {
            return None;
        }
        (n_elems / be as u64).checked_mul(bb as u64)
    }

    pub fn is_quantized(self) -> bool {
        matches!(self.block_elems(), Some(n) if n > 1)
    }

    /// Name as ggml/llama.cpp prints it (`Q4_K`, `IQ2_XXS`, `BF16`, ...).
    pub fn name(self) -> String {
        match self {
            DType::Unknown(id) => format!("type#{id}"),
            DType::F8E4M3 => "F8_E4M3".to_string(),
            other => format!("{other:?}"),
        }
    }

    /// Parse a name as printed by [`DType::name`] (case-insensitive).
    pub fn from_name(s: &str) -> Option<DType> {
        let up = s.to_ascii_uppercase();
        if up == "F8_E4M3" || up == "F8E4M3" {
            return Some(DType::F8E4M3);
        }
        (0..64u32)
            .map(DType::from_ggml_id)
            .find(|t| !matches!(t, DType::Unknown(_)) && t.name() == up)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for id in 0..64u32 {
            let t = DType::from_ggml_id(id);
            assert_eq!(t.ggml_id(), Some(id));
        }
    }

    #[test]
    fn names_round_trip() {
        for t in [
            DType::Q4_K,
            DType::IQ2_XXS,
            DType::BF16,
            DType::F8E4M3,
            DType::MXFP4,
        ] {
            assert_eq!(DType::from_name(&t.name()), Some(t));
        }
    }

    #[test]
    fn bytes_for_blocks() {
        assert_eq!(DType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(DType::Q4_K.bytes_for(100), None);
        assert_eq!(DType::Unknown(99).bytes_for(256), None);
    }
}
