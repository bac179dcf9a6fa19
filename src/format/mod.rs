//! Model files: GGUF (single or split) and safetensors (single or sharded, with config.json).
//!
//! Owns: parsing headers and metadata, and handing out each tensor as a byte range in its file
//! (`TensorInfo`), plus memory-mapped views of resident tensors.
//! Does not own: reading routed experts on demand (experts/), dequantization (kernels/).
//! Invariant: nothing here copies a whole model; every tensor is (file, offset, length, dtype,
//! shape) and routed-expert tensors are only ever ranges.

mod tensor;

pub use tensor::{ByteRange, MetaValue, TensorInfo};
