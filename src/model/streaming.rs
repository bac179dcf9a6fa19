//! Attaching the streaming expert cache (`experts/`) to a model: which bytes are routed
//! experts, how big the resident part is, and the per-state cache handle.
//!
//! Invariant: attaching a cache changes where expert bytes come from, never which bytes: the
//! cache hands out exactly the ranges the mapped views cover (tests/stream_invariance.rs).

use super::{Model, ModelError, State};
use crate::experts::{CacheConfig, CacheStats, ExpertCache, ExpertLoc, ExpertStore};
use crate::format::ModelFiles;

impl<'a> Model<'a> {
    /// Byte ranges of every routed expert, `[layer][expert]` (dense layers: empty).
    pub fn expert_locs(&self) -> Vec<Vec<ExpertLoc>> {
        if let Some(v4) = &self.weights.v4 {
            return v4.expert_locs();
        }
        self.weights
            .layers
            .iter()
            .map(|l| {
                l.moe()
                    .map(|m| {
                        m.experts
                            .iter()
                            .map(|e| ExpertLoc { parts: e.ranges })
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Bytes of routed experts in the files, and of everything else (the resident part).
    pub fn routed_and_resident_bytes(&self, files: &ModelFiles) -> (u64, u64) {
        let routed: u64 = self
            .expert_locs()
            .iter()
            .flatten()
            .map(|l| l.parts.iter().map(|p| p.len).sum::<u64>())
            .sum();
        let total: u64 = files.tensors().iter().map(|t| t.range.len).sum();
        (routed, total.saturating_sub(routed))
    }

    /// The expert store of this model (addressing only; no memory is taken).
    pub fn expert_store(&self, files: &ModelFiles) -> Result<ExpertStore, ModelError> {
        Ok(ExpertStore::new(
            files.paths().to_vec(),
            self.expert_locs(),
        )?)
    }

    /// Build a streaming cache over this model's files.
    pub fn expert_cache(
        &self,
        files: &ModelFiles,
        cfg: CacheConfig,
    ) -> Result<ExpertCache, ModelError> {
        Ok(ExpertCache::new(self.expert_store(files)?, cfg)?)
    }
}

impl State {
    /// Route this state's expert reads through `cache` from now on.
    pub fn attach_experts(&mut self, cache: ExpertCache) {
        self.expert_cache = Some(cache);
    }

    /// Stop streaming; returns the cache (experts are read through the mapped files again).
    /// A device that stages from the cache (and registered its memory) must be dropped first:
    /// the engine holds it and does.
    pub fn detach_experts(&mut self) -> Option<ExpertCache> {
        self.expert_cache.take()
    }

    pub fn experts(&self) -> Option<&ExpertCache> {
        self.expert_cache.as_ref()
    }

    pub fn expert_stats(&self) -> Option<CacheStats> {
        self.expert_cache.as_ref().map(ExpertCache::stats)
    }

    /// One decoded token passed (hotness decay clock and route trace).
    pub fn tick_token(&self) {
        if let Some(c) = &self.expert_cache {
            c.tick_token();
        }
    }
}
