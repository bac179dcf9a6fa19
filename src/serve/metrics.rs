//! Server counters and their Prometheus text rendering for `GET /metrics`.
//!
//! Owns: request counts by route and status, token counts, timing sums, the last decode speed,
//! cancellations, KV-session disk traffic, and the expert cache's figures when experts are
//! streamed. Does not own: the queue (its length is passed in when rendering).
//! Invariant: only figures the server really measures are exported: without a streaming
//! expert cache there are no hit-rate or bytes-read lines at all.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub reused_tokens: AtomicU64,
    pub prefilled_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub experts_computed: AtomicU64,
    /// Microseconds.
    pub prefill_us: AtomicU64,
    pub decode_us: AtomicU64,
    pub decode_steps: AtomicU64,
    /// f64 bits.
    last_decode_tps: AtomicU64,
    last_prefill_tps: AtomicU64,
    pub generations: AtomicU64,
    pub cancelled: AtomicU64,
    pub in_flight: AtomicU64,
    /// `--parallel` sequence slots (0 or 1: one generation at a time, no batch figures).
    pub slots: AtomicU64,
    /// Batched steps and the rows they ran (one generated token per decode row).
    pub batch_steps: AtomicU64,
    pub batch_decode_rows: AtomicU64,
    pub batch_prefill_rows: AtomicU64,
    /// Prompt positions copied from another slot's KV cache instead of computed.
    pub batch_shared_tokens: AtomicU64,
    /// Per slot: its state ("free", "prefilling", "decoding") and the KV positions it holds.
    slot_figures: Mutex<Vec<(&'static str, u64)>>,
    pub kv_saves: AtomicU64,
    pub kv_loads: AtomicU64,
    pub kv_bytes_written: AtomicU64,
    pub kv_bytes_read: AtomicU64,
    /// The expert cache's running totals (None: experts are not streamed).
    experts: Mutex<Option<crate::experts::CacheStats>>,
}

impl Metrics {
    pub fn count_request(&self, route: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((route.to_string(), status)).or_insert(0) += 1;
    }

    pub fn set_expert_stats(&self, s: Option<crate::experts::CacheStats>) {
        *self.experts.lock().unwrap_or_else(|p| p.into_inner()) = s;
    }

    pub fn set_slot_figures(&self, it: impl Iterator<Item = (&'static str, usize)>) {
        let mut v = self.slot_figures.lock().unwrap_or_else(|p| p.into_inner());
        v.clear();
        v.extend(it.map(|(st, n)| (st, n as u64)));
    }

    pub fn set_speeds(&self, prefill_tps: Option<f64>, decode_tps: Option<f64>) {
        if let Some(t) = prefill_tps {
            self.last_prefill_tps.store(t.to_bits(), Ordering::Relaxed);
        }
        if let Some(t) = decode_tps {
            self.last_decode_tps.store(t.to_bits(), Ordering::Relaxed);
        }
    }

    /// Prometheus text exposition format, version 0.0.4.
    /// `conns`: HTTP connections open and active (inside a request).
    pub fn render(&self, queue_len: usize, conns: (usize, usize), model_id: &str) -> String {
        let mut s = String::new();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let model = escape(model_id);
        let counter = |s: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(
                s,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{model=\"{model}\"}} {v}"
            );
        };
        counter(
            &mut s,
            "sluice_prompt_tokens_total",
            "Prompt tokens of served generations.",
            ld(&self.prompt_tokens) as f64,
        );
        counter(
            &mut s,
            "sluice_prompt_tokens_reused_total",
            "Prompt tokens taken from the KV cache (prefix reuse).",
            ld(&self.reused_tokens) as f64,
        );
        counter(
            &mut s,
            "sluice_prompt_tokens_prefilled_total",
            "Prompt tokens run through the model.",
            ld(&self.prefilled_tokens) as f64,
        );
        counter(
            &mut s,
            "sluice_generated_tokens_total",
            "Tokens generated.",
            ld(&self.generated_tokens) as f64,
        );
        counter(
            &mut s,
            "sluice_experts_computed_total",
            "Routed expert evaluations during decode, summed over layers (with --parallel: of batched steps that decoded, each expert once per layer for all its rows).",
            ld(&self.experts_computed) as f64,
        );
        counter(
            &mut s,
            "sluice_prefill_seconds_total",
            "Time spent in prefill.",
            ld(&self.prefill_us) as f64 / 1e6,
        );
        counter(
            &mut s,
            "sluice_decode_seconds_total",
            "Time spent decoding.",
            ld(&self.decode_us) as f64 / 1e6,
        );
        counter(
            &mut s,
            "sluice_decode_steps_total",
            "Single-token forward passes.",
            ld(&self.decode_steps) as f64,
        );
        counter(
            &mut s,
            "sluice_generations_total",
            "Generations run.",
            ld(&self.generations) as f64,
        );
        counter(
            &mut s,
            "sluice_generations_cancelled_total",
            "Generations cancelled by a client disconnect or shutdown.",
            ld(&self.cancelled) as f64,
        );
        counter(
            &mut s,
            "sluice_kv_sessions_saved_total",
            "KV sessions written to --kv-dir.",
            ld(&self.kv_saves) as f64,
        );
        counter(
            &mut s,
            "sluice_kv_sessions_loaded_total",
            "KV sessions restored from --kv-dir.",
            ld(&self.kv_loads) as f64,
        );
        counter(
            &mut s,
            "sluice_kv_bytes_written_total",
            "Bytes of KV sessions written to --kv-dir.",
            ld(&self.kv_bytes_written) as f64,
        );
        counter(
            &mut s,
            "sluice_kv_bytes_read_total",
            "Bytes of KV sessions read from --kv-dir.",
            ld(&self.kv_bytes_read) as f64,
        );

        let gauge = |s: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(
                s,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{model=\"{model}\"}} {v}"
            );
        };
        gauge(
            &mut s,
            "sluice_queue_length",
            "Requests waiting for the generator.",
            queue_len as f64,
        );
        gauge(
            &mut s,
            "sluice_http_connections_open",
            "HTTP connections open, idle ones included.",
            conns.0 as f64,
        );
        gauge(
            &mut s,
            "sluice_http_connections_active",
            "HTTP connections inside a request (counted against --max-connections).",
            conns.1 as f64,
        );
        gauge(
            &mut s,
            "sluice_requests_in_flight",
            "Generations running now (at most --parallel).",
            ld(&self.in_flight) as f64,
        );
        if ld(&self.slots) > 1 {
            gauge(
                &mut s,
                "sluice_parallel_slots",
                "Sequence slots decoded together (--parallel).",
                ld(&self.slots) as f64,
            );
            counter(
                &mut s,
                "sluice_batch_steps_total",
                "Batched forwards over the running sequences.",
                ld(&self.batch_steps) as f64,
            );
            counter(
                &mut s,
                "sluice_batch_decode_rows_total",
                "Decode rows of batched forwards (mean decode batch = rows / steps that decoded).",
                ld(&self.batch_decode_rows) as f64,
            );
            counter(
                &mut s,
                "sluice_batch_prefill_rows_total",
                "Prompt rows of batched forwards.",
                ld(&self.batch_prefill_rows) as f64,
            );
            counter(
                &mut s,
                "sluice_batch_shared_prefix_tokens_total",
                "Prompt positions a slot copied from another slot's KV cache (a shared prefix computed once) instead of computing them.",
                ld(&self.batch_shared_tokens) as f64,
            );
            let slots = self
                .slot_figures
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            if !slots.is_empty() {
                let _ = writeln!(s, "# HELP sluice_slot_state Each sequence slot's state (1 on the line of the state it is in).\n# TYPE sluice_slot_state gauge");
                for (i, (st, _)) in slots.iter().enumerate() {
                    let _ = writeln!(
                        s,
                        "sluice_slot_state{{model=\"{model}\",slot=\"{i}\",state=\"{st}\"}} 1"
                    );
                }
                let _ = writeln!(s, "# HELP sluice_slot_positions Positions each slot's KV cache holds (a free slot keeps its last conversation for prefix reuse).\n# TYPE sluice_slot_positions gauge");
                for (i, (_, n)) in slots.iter().enumerate() {
                    let _ = writeln!(
                        s,
                        "sluice_slot_positions{{model=\"{model}\",slot=\"{i}\"}} {n}"
                    );
                }
            }
        }
        let decode_s = ld(&self.decode_us) as f64 / 1e6;
        let avg = if decode_s > 0.0 {
            ld(&self.decode_steps) as f64 / decode_s
        } else {
            0.0
        };
        gauge(
            &mut s,
            "sluice_decode_tokens_per_second",
            "Decode speed over all generations.",
            avg,
        );
        gauge(
            &mut s,
            "sluice_last_decode_tokens_per_second",
            "Decode speed of the last generation.",
            f64::from_bits(ld(&self.last_decode_tps)),
        );
        gauge(
            &mut s,
            "sluice_last_prefill_tokens_per_second",
            "Prefill speed of the last generation that prefilled.",
            f64::from_bits(ld(&self.last_prefill_tps)),
        );

        let experts = *self.experts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = experts {
            counter(
                &mut s,
                "sluice_expert_hits_pinned_total",
                "Expert requests served by the pinned tier.",
                e.hits_pin as f64,
            );
            counter(
                &mut s,
                "sluice_expert_hits_lru_total",
                "Expert requests served by the evictable tier.",
                e.hits_lru as f64,
            );
            counter(
                &mut s,
                "sluice_expert_misses_total",
                "Expert requests that had to be read from disk.",
                e.misses as f64,
            );
            counter(
                &mut s,
                "sluice_expert_bytes_read_total",
                "Bytes of experts read from disk.",
                e.bytes_read as f64,
            );
            counter(
                &mut s,
                "sluice_expert_read_seconds_total",
                "Wall time with an expert read outstanding.",
                e.read_secs,
            );
            counter(
                &mut s,
                "sluice_expert_wait_seconds_total",
                "Time compute waited for experts.",
                e.wait_secs,
            );
            gauge(
                &mut s,
                "sluice_expert_hit_rate",
                "Share of expert requests found in memory, since start.",
                e.hit_rate(),
            );
        }

        let _ = writeln!(s, "# HELP sluice_requests_total HTTP requests by route and status.\n# TYPE sluice_requests_total counter");
        let m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        for ((route, status), n) in m.iter() {
            let _ = writeln!(
                s,
                "sluice_requests_total{{route=\"{}\",status=\"{status}\"}} {n}",
                escape(route)
            );
        }
        s
    }
}

/// Label value escaping (backslash, quote, newline).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_queue() {
        let m = Metrics::default();
        m.generated_tokens.fetch_add(7, Ordering::Relaxed);
        m.count_request("/v1/chat/completions", 200);
        let t = m.render(3, (0, 0), "x\"y");
        assert!(
            t.contains("sluice_generated_tokens_total{model=\"x\\\"y\"} 7"),
            "{t}"
        );
        assert!(t.contains("sluice_queue_length{model=\"x\\\"y\"} 3"));
        assert!(
            t.contains("sluice_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 1")
        );
        assert!(
            !t.contains("expert_hit"),
            "no cache figures without a streaming cache"
        );
        m.set_expert_stats(Some(crate::experts::CacheStats {
            hits_lru: 3,
            misses: 1,
            bytes_read: 4096,
            ..Default::default()
        }));
        let t = m.render(0, (0, 0), "m");
        assert!(
            t.contains("sluice_expert_hit_rate{model=\"m\"} 0.75"),
            "{t}"
        );
        assert!(
            t.contains("sluice_expert_bytes_read_total{model=\"m\"} 4096"),
            "{t}"
        );
    }
}
