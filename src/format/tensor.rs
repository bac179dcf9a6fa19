//! The common currency of format/: tensor descriptors, byte ranges and metadata values.

use crate::dtype::DType;

/// A span of bytes in one of a model's files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ByteRange {
    /// Index into the model's file list.
    pub file: usize,
    /// Absolute offset from the start of the file.
    pub offset: u64,
    pub len: u64,
}

/// One tensor of a model file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    /// Row-major, outermost first (numpy/PyTorch order). GGUF stores dimensions innermost
    /// first; readers reverse them. A GGUF expert tensor is [n_expert, rows, cols].
    pub shape: Vec<u64>,
    /// Where the tensor's bytes are. `range.len` is computed from dtype and shape when the
    /// type is known, else inferred from the next tensor's offset.
    pub range: ByteRange,
}

impl TensorInfo {
    pub fn n_elems(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A GGUF metadata value (config.json values are kept as serde_json values instead).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// Any integer type as u64 (negative values and non-integers give None).
    pub fn as_u64(&self) -> Option<u64> {
        use MetaValue::*;
        match *self {
            U8(v) => Some(v as u64),
            U16(v) => Some(v as u64),
            U32(v) => Some(v as u64),
            U64(v) => Some(v),
            I8(v) => u64::try_from(v).ok(),
            I16(v) => u64::try_from(v).ok(),
            I32(v) => u64::try_from(v).ok(),
            I64(v) => u64::try_from(v).ok(),
            Bool(b) => Some(b as u64),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        use MetaValue::*;
        match *self {
            U8(v) => Some(v as i64),
            U16(v) => Some(v as i64),
            U32(v) => Some(v as i64),
            U64(v) => i64::try_from(v).ok(),
            I8(v) => Some(v as i64),
            I16(v) => Some(v as i64),
            I32(v) => Some(v as i64),
            I64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}
