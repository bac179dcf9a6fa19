//! Export and import of a `State`'s KV cache, so a session can be saved to disk and resumed.
//!
//! Owns: read and write access to the cached key/value rows of positions `0..n`, layer by
//! layer. Does not own: the file format (serve/kv_store.rs), the forward pass (forward.rs).
//! Invariant: rows written back with `kv_rows_mut` and then `pos` set to `n` leave the state
//! exactly as it was when they were read, so a resumed generation is bit-identical.

use super::{ModelError, State};

impl State {
    /// Layers of the KV cache, given the width of one cached row (`ModelConfig::kv_dim`).
    pub fn kv_layers(&self, kv_dim: usize) -> usize {
        self.kcache.len().checked_div(self.ctx() * kv_dim).unwrap_or(0)
    }

    /// The cached keys and values of positions `0..n` of `layer` (each `n * kv_dim` floats).
    pub fn kv_rows(&self, layer: usize, kv_dim: usize, n: usize) -> Result<(&[f32], &[f32]), ModelError> {
        let range = self.kv_range(layer, kv_dim, n)?;
        Ok((&self.kcache[range.clone()], &self.vcache[range]))
    }

    /// Writable keys and values of positions `0..n` of `layer`; set `pos` afterwards.
    pub fn kv_rows_mut(&mut self, layer: usize, kv_dim: usize, n: usize) -> Result<(&mut [f32], &mut [f32]), ModelError> {
        let range = self.kv_range(layer, kv_dim, n)?;
        Ok((&mut self.kcache[range.clone()], &mut self.vcache[range]))
    }

    fn kv_range(&self, layer: usize, kv_dim: usize, n: usize) -> Result<std::ops::Range<usize>, ModelError> {
        let layers = self.kv_layers(kv_dim);
        if layer >= layers || n > self.ctx() || kv_dim == 0 {
            return Err(ModelError::Input(format!(
                "KV rows 0..{n} of layer {layer} (row width {kv_dim}): the cache holds {layers} layers of {} positions",
                self.ctx()
            )));
        }
        let start = layer * self.ctx() * kv_dim;
        Ok(start..start + n * kv_dim)
    }
}
