//! Export and import of a `State`'s KV cache, so a session can be saved to disk and resumed.
//!
//! Owns: read and write access to the cached rows of positions `0..n`, cache layer by cache
//! layer. Row widths come from `ModelConfig::cache_dims()` (keys `k`, values `v`; MLA caches
//! a latent as its "key" and, for DeepSeek-V3.2, the indexer's key as its "value", else no
//! values, so `v` is 0). Does not own: the file format
//! (serve/kv_store.rs), the forward pass (forward.rs).
//! Invariant: rows written back with `kv_rows_mut` and then `pos` set to `n` leave the state
//! exactly as it was when they were read, so a resumed generation is bit-identical.

use super::{ModelError, State};

/// Widths of one cached position in one layer: (key floats, value floats).
pub type CacheDims = (usize, usize);

impl State {
    /// Layers in the KV cache (every layer that caches, including any extra prediction
    /// layers), given the row widths.
    pub fn kv_layers(&self, dims: CacheDims) -> usize {
        self.kcache
            .len()
            .checked_div(self.ctx() * dims.0)
            .unwrap_or(0)
    }

    /// The cached keys (`n * dims.0` floats) and values (`n * dims.1`) of positions `0..n` of
    /// cache layer `layer`.
    pub fn kv_rows(
        &self,
        layer: usize,
        dims: CacheDims,
        n: usize,
    ) -> Result<(&[f32], &[f32]), ModelError> {
        let (k, v) = self.kv_ranges(layer, dims, n)?;
        Ok((&self.kcache[k], &self.vcache[v]))
    }

    /// Writable keys and values of positions `0..n` of `layer`; set `pos` afterwards.
    pub fn kv_rows_mut(
        &mut self,
        layer: usize,
        dims: CacheDims,
        n: usize,
    ) -> Result<(&mut [f32], &mut [f32]), ModelError> {
        let (k, v) = self.kv_ranges(layer, dims, n)?;
        Ok((&mut self.kcache[k], &mut self.vcache[v]))
    }

    fn kv_ranges(
        &self,
        layer: usize,
        (kd, vd): CacheDims,
        n: usize,
    ) -> Result<(std::ops::Range<usize>, std::ops::Range<usize>), ModelError> {
        let layers = self.kv_layers((kd, vd));
        let ctx = self.ctx();
        let fits = layer < layers
            && n <= ctx
            && kd > 0
            && self.kcache.len() == layers * ctx * kd
            && self.vcache.len() == layers * ctx * vd;
        if !fits {
            return Err(ModelError::Input(format!(
                "KV rows 0..{n} of layer {layer} with row widths ({kd}, {vd}) do not match the cache ({} + {} floats, {ctx} positions)",
                self.kcache.len(),
                self.vcache.len()
            )));
        }
        let (k0, v0) = (layer * ctx * kd, layer * ctx * vd);
        Ok((k0..k0 + n * kd, v0..v0 + n * vd))
    }
}
