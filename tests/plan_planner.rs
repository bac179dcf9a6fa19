//! The planner on synthetic machine profiles (fast NVMe + small RAM, slow disk + large RAM,
//! RAM >= model): the decisions flip where they should, each with its reason, and impossible
//! plans are refused with the numbers. The profiles are written as the JSON `sluice doctor`
//! saves, so they go through the same schema.

use serde_json::json;
use sluice::experts::IoMode;
use sluice::plan::planner::{
    expected_hit, expert_union, mtp_cost, plan, ExpertMode, ModelSummary, Plan, PlanError,
    PlanRequest,
};
use sluice::plan::MachineProfile;

const GB: u64 = 1_000_000_000;

/// A machine whose O_DIRECT reads peak at `disk_gbps` with `best_threads` readers.
fn profile(
    disk_gbps: f64,
    best_threads: usize,
    mem_gbps: f64,
    avail: u64,
    o_direct: bool,
) -> MachineProfile {
    let points: Vec<_> = [1usize, 2, 4, 8, 16]
        .iter()
        .map(|&t| {
            let g = if t == best_threads { disk_gbps } else { disk_gbps * 0.5 };
            json!({"threads": t, "gbps": g, "iops": 1000.0, "reads": 100, "seconds": 0.4, "device_read_bytes": null})
        })
        .collect();
    let series = if o_direct {
        vec![
            json!({"mode": "direct", "block_bytes": 2_359_296u64, "advice": null, "points": points}),
        ]
    } else {
        vec![]
    };
    serde_json::from_value(json!({
        "version": 1, "sluice_version": "test", "key": "synthetic", "probed_unix": 0, "probe_seconds": 1.0, "quick": false,
        "cpu": {"model": "synthetic", "logical_cores": 16, "physical_cores": 8, "avx2": true, "avx512": false, "avx512_vnni": false, "kernel_isa": "avx2", "llc_bytes": null},
        "memory": {"total_bytes": avail, "available_bytes": avail, "memlock_limit_bytes": null, "cgroup_limit_bytes": null, "cgroup_source": null,
                   "read_gbps": mem_gbps, "read_threads": 8, "read_buffer_bytes": 1u64 << 30, "read_reps": 5},
        "storage": {"dir": "/synthetic", "fs_type": "ext4", "mount_point": "/", "source": "/dev/nvme0n1", "dev": "259:0", "block_device": "nvme0n1",
                    "read_ahead_kb": 128, "free_bytes": null, "o_direct": o_direct, "data": null, "data_bytes": 0, "series": series, "note": null},
        "gpu": {"driver": null, "driver_version": null, "devices": [], "h2d": null, "note": null}
    }))
    .unwrap()
}

/// Qwen3-30B-A3B-like: 48 MoE layers of 128 experts, top-8, ~2.36 MB a slot, an MTP head.
fn model() -> ModelSummary {
    ModelSummary {
        resident_bytes: 1_500_000_000,
        routed_bytes: 48 * 128 * 2_359_296,
        kv_bytes: 400_000_000,
        process_bytes: 0,
        moe_layers: 48,
        experts_per_layer: 128,
        top_k: 8,
        slot_bytes: 2_359_296,
        mtp_layers: 1,
        embedding_bytes: 0,
        mtp_layer_bytes: 0,
        mtp_draft_bytes: 0,
    }
}

fn req(ram: u64) -> PlanRequest {
    PlanRequest {
        ram: Some(ram),
        ..PlanRequest::default()
    }
}

fn decision<'a>(p: &'a Plan, what: &str) -> (&'a str, &'a str) {
    let d = p
        .decisions
        .iter()
        .find(|d| d.what == what)
        .unwrap_or_else(|| panic!("no {what} decision in {:?}", p.decisions));
    (d.value.as_str(), d.reason.as_str())
}

#[test]
fn fast_nvme_small_ram_streams_direct_with_many_readers() {
    let m = model();
    let p = plan(
        &m,
        Some(&profile(7.0, 16, 50.0, 64 * GB, true)),
        &req(8 * GB),
    )
    .unwrap();
    assert!(p.stream);
    let (v, why) = decision(&p, "experts");
    assert!(v.starts_with("streamed"), "{v}");
    assert!(why.contains("exceed the budget"), "{why}");
    // Budget 8 GB - 1.5 GB resident - 0.4 GB KV = 6.1 GB of 2.36 MB slots over 48 layers.
    assert_eq!(p.slots_per_layer, (6_100_000_000 / 2_359_296) / 48);
    assert!(p.expert_cache_bytes <= 8 * GB - m.resident_bytes - m.kv_bytes);
    assert_eq!(p.io, IoMode::Direct);
    assert_eq!(p.io_threads, 16, "the thread count of the probed peak");
    assert!(decision(&p, "io").1.contains("16 threads"));
    assert!(p.disk_bound);
    let (mtp, why) = decision(&p, "mtp");
    assert_eq!(mtp, "off");
    assert!(why.contains("disk-bound"), "{why}");
    assert_eq!(decision(&p, "prefetch").0, "off");
    assert!(decision(&p, "prefetch").1.contains("measured slower"));
    let (lo, hi) = p.predicted_tok_s.unwrap();
    assert!(lo > 0.0 && lo <= hi, "{lo} {hi}");
    // The cost model by hand at the uniform bound.
    let hit = p.slots_per_layer as f64 / 128.0;
    let routed = (8 * 48 * 2_359_296) as f64;
    let t = (1.0 - hit) * routed / 7e9 + (1.5e9 + routed) / 50e9;
    assert!(
        (lo - 1.0 / t).abs() < 1e-9 * lo.max(1.0),
        "{lo} vs {}",
        1.0 / t
    );
}

#[test]
fn slow_disk_large_ram_takes_one_reader_and_caches_more() {
    let m = model();
    let fast = plan(
        &m,
        Some(&profile(7.0, 16, 50.0, 64 * GB, true)),
        &req(8 * GB),
    )
    .unwrap();
    let slow = plan(
        &m,
        Some(&profile(0.2, 1, 50.0, 64 * GB, true)),
        &req(14 * GB),
    )
    .unwrap();
    assert!(slow.stream);
    assert_eq!(slow.io_threads, 1);
    assert!(slow.slots_per_layer > fast.slots_per_layer);
    assert!(slow.hit_rate.0 > fast.hit_rate.0);
    // A filesystem refusing O_DIRECT flips the IO mode, with the reason.
    let no_direct = plan(
        &m,
        Some(&profile(0.2, 1, 50.0, 64 * GB, false)),
        &req(14 * GB),
    )
    .unwrap();
    assert_eq!(no_direct.io, IoMode::Buffered);
    assert!(decision(&no_direct, "io").1.contains("O_DIRECT refused"));
    assert!(
        no_direct.predicted_tok_s.is_none(),
        "no O_DIRECT ceiling: no prediction"
    );
    assert_eq!(decision(&no_direct, "predicted decode").0, "unknown");
}

#[test]
fn ram_at_least_model_keeps_experts_resident_and_memory_bound() {
    let m = model();
    let p = plan(
        &m,
        Some(&profile(0.2, 1, 50.0, 64 * GB, true)),
        &req(32 * GB),
    )
    .unwrap();
    assert!(!p.stream);
    let (v, why) = decision(&p, "experts");
    assert!(v.starts_with("resident"), "{v}");
    assert!(why.contains("fit the budget"), "{why}");
    assert_eq!(p.hit_rate, (1.0, 1.0));
    assert!(!p.disk_bound);
    let (lo, hi) = p.predicted_tok_s.unwrap();
    let active = 1.5e9 + (8 * 48 * 2_359_296) as f64;
    assert!((lo - 50e9 / active).abs() < 1e-6 && (hi - lo).abs() < 1e-9);
    assert!(decision(&p, "mtp").1.contains("not asked"));
    // Asked for, MTP is on; on a disk-bound plan it stays on (the flag wins) with a warning.
    let on = plan(
        &m,
        Some(&profile(0.2, 1, 50.0, 64 * GB, true)),
        &PlanRequest {
            mtp: 2,
            ..req(32 * GB)
        },
    )
    .unwrap();
    assert_eq!(decision(&on, "mtp").0, "on, 2 drafts");
    let warn = plan(
        &m,
        Some(&profile(0.2, 1, 50.0, 64 * GB, true)),
        &PlanRequest {
            mtp: 2,
            ..req(8 * GB)
        },
    )
    .unwrap();
    assert!(decision(&warn, "mtp")
        .1
        .contains("warning: decode is disk-bound"));
    // Default budget: 85% of MemAvailable.
    let auto = plan(
        &m,
        Some(&profile(0.2, 1, 50.0, 64 * GB, true)),
        &PlanRequest::default(),
    )
    .unwrap();
    assert_eq!(auto.budget_bytes, 64 * GB / 100 * 85);
    assert!(!auto.stream);
}

#[test]
fn overrides_win_and_say_so() {
    let m = model();
    let r = PlanRequest {
        mode: ExpertMode::Stream,
        cap: Some(3),
        io: Some(IoMode::Buffered),
        io_threads: Some(2),
        ..req(32 * GB)
    };
    let p = plan(&m, Some(&profile(7.0, 16, 50.0, 64 * GB, true)), &r).unwrap();
    assert!(p.stream && p.slots_per_layer == 3 && p.io == IoMode::Buffered && p.io_threads == 2);
    assert!(decision(&p, "experts").1.contains("--experts stream"));
    assert!(decision(&p, "expert cache").1.contains("--cap"));
    assert!(decision(&p, "io").1.contains("--io") && decision(&p, "io").1.contains("--io-threads"));
    // Autopin: half the expert budget by default, bounded by the experts with statistics.
    let pin = plan(
        &m,
        Some(&profile(7.0, 16, 50.0, 64 * GB, true)),
        &PlanRequest {
            autopin: Some(100),
            ..req(8 * GB)
        },
    )
    .unwrap();
    assert_eq!(pin.pinned, 100);
    let pin = plan(
        &m,
        Some(&profile(7.0, 16, 50.0, 64 * GB, true)),
        &PlanRequest {
            autopin: Some(usize::MAX),
            ..req(8 * GB)
        },
    )
    .unwrap();
    assert_eq!(pin.pinned as u64, (6_100_000_000 / 2) / 2_359_296);
    // No profile: defaults, said so, no prediction.
    let none = plan(&m, None, &req(8 * GB)).unwrap();
    assert_eq!(none.io_threads, 4);
    assert!(none.predicted_tok_s.is_none());
    assert!(decision(&none, "predicted decode")
        .1
        .contains("no machine profile"));
}

#[test]
fn impossible_plans_are_refused_with_numbers() {
    let m = model();
    let e = plan(&m, None, &req(GB)).unwrap_err();
    assert!(matches!(e, PlanError::Impossible(_)));
    let s = e.to_string();
    assert!(
        s.contains("1000.0 MB")
            && s.contains("1500.0 MB")
            && s.contains("400.0 MB")
            && s.contains("1900.0 MB"),
        "{s}"
    );
    // Room for the resident part but not one slot per layer.
    let e = plan(
        &m,
        None,
        &PlanRequest {
            mode: ExpertMode::Stream,
            ..req(1_950_000_000)
        },
    )
    .unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("less than one") && s.contains("48 layers"),
        "{s}"
    );
    assert!(plan(
        &m,
        None,
        &PlanRequest {
            io_threads: Some(0),
            ..req(8 * GB)
        }
    )
    .is_err());
}

#[test]
fn hit_rate_bounds() {
    assert_eq!(expected_hit(0.0, 128), (0.0, 0.0));
    assert_eq!(expected_hit(128.0, 128), (1.0, 1.0));
    let (u, s) = expected_hit(16.0, 128);
    assert!((u - 0.125).abs() < 1e-12);
    // Zipf(1): H(16) / H(128) = 3.3807 / 5.4331.
    assert!((s - 3.380_728_993 / 5.433_147_092).abs() < 1e-6, "{s}");
}

/// The GPU decision (what `--gpu auto` will do) follows the profile's GPU probe: none -> off
/// with the probe's note; a card that holds the resident part -> on with a pool of the rest;
/// a card too small for the resident part -> off with the numbers; --mtp -> off.
#[test]
fn gpu_decision_follows_the_probe() {
    let m = model();
    let with_gpu = |vram: u64| {
        let mut p = profile(3.0, 4, 20.0, 64 * GB, true);
        p.gpu = serde_json::from_value(json!({
            "driver": "libcuda.so.1", "driver_version": "13.0",
            "devices": [{"index": 0, "name": "Synthetic GPU", "vram_bytes": vram}],
            "h2d": {"device": 0, "bytes": 268435456u64, "copies": 4, "pinned_gbps": 50.0, "pageable_gbps": 10.0},
            "note": null
        }))
        .unwrap();
        p
    };
    let none = {
        let mut p = profile(3.0, 4, 20.0, 64 * GB, true);
        p.gpu.note = Some("libcuda.so.1 not found (no NVIDIA driver)".into());
        p
    };
    let pl = plan(&m, Some(&none), &req(32 * GB)).unwrap();
    let (v, why) = decision(&pl, "gpu");
    if !sluice::gpu::BUILT {
        assert_eq!(v, "off");
        assert!(why.contains("cuda"), "{why}");
        return;
    }
    assert_eq!(v, "off");
    assert!(why.contains("no NVIDIA driver"), "{why}");

    let pl = plan(&m, Some(&with_gpu(80 * GB)), &req(32 * GB)).unwrap();
    let (v, why) = decision(&pl, "gpu");
    assert_eq!(v, "on, Synthetic GPU");
    // Pool: every expert (14.5 GB routed) fits in 80 GB after 1.9 GB resident + 1 GiB.
    assert!(
        why.contains("100% of the experts") && why.contains("50.0 GB/s"),
        "{why}"
    );

    let pl = plan(&m, Some(&with_gpu(8 * GB)), &req(32 * GB)).unwrap();
    let (v, why) = decision(&pl, "gpu");
    assert!(v.starts_with("on"), "{v}");
    let share: f64 = why
        .split("= ")
        .nth(1)
        .and_then(|s| s.split('%').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no share in {why}"));
    assert!(
        share > 20.0 && share < 60.0,
        "8 GB card: pool share {share}% ({why})"
    );

    let pl = plan(&m, Some(&with_gpu(2 * GB)), &req(32 * GB)).unwrap();
    let (v, why) = decision(&pl, "gpu");
    assert_eq!(v, "off");
    assert!(why.contains("cannot hold"), "{why}");

    let mut r = req(32 * GB);
    r.mtp = 1;
    let pl = plan(&m, Some(&with_gpu(80 * GB)), &r).unwrap();
    assert_eq!(decision(&pl, "gpu").0, "off");
}

/// `--mtp K` as a widened expert union: the union of K+1 tokens' experts against the formula
/// by hand; on a resident-experts plan a step costs less than K+1 plain tokens and pays above a
/// stated acceptance rate; on a disk-bound streaming plan it never pays. DeepSeek-V3-shaped
/// figures (58 MoE layers of 256 experts, top-8).
#[test]
fn mtp_widens_the_expert_union_and_pays_only_with_resident_experts() {
    assert_eq!(expert_union(256, 8, 1), 8.0);
    let want = 256.0 * (1.0 - (248.0f64 / 256.0).powi(3));
    assert!((expert_union(256, 8, 3) - want).abs() < 1e-9);
    assert!(expert_union(256, 8, 3) < 24.0 && expert_union(256, 8, 3) > 23.0);
    assert!((expert_union(8, 8, 4) - 8.0).abs() < 1e-12, "capped at E");

    let slot = 3 * 2048 * 7168 * 9 / 16; // one Q4_K expert (4.5 bits/weight)
    let ds = ModelSummary {
        resident_bytes: 17 * GB,
        routed_bytes: 58 * 256 * slot,
        kv_bytes: GB,
        process_bytes: 0,
        moe_layers: 58,
        experts_per_layer: 256,
        top_k: 8,
        slot_bytes: slot,
        mtp_layers: 1,
        embedding_bytes: GB / 2,
        mtp_layer_bytes: 256 * slot + GB / 4,
        mtp_draft_bytes: 8 * slot + GB / 4 + GB / 2,
    };
    // Resident experts (hit 1): the resident reads are shared by the K+1 verified tokens.
    for k in 1..=3 {
        let c = mtp_cost(&ds, k, 1.0, 5.0, 50.0);
        let u = expert_union(256, 8, k + 1);
        assert_eq!(c.union_per_layer, u);
        assert_eq!(c.experts_per_step, 58.0 * u + (8 * k) as f64);
        assert_eq!(c.experts_per_plain_token, 8.0 * 58.0);
        // Resident reads: all but the embedding table and the MTP layer.
        let base = 17e9 - 0.5e9 - (256 * slot) as f64 - 0.25e9;
        let plain = (base + 464.0 * slot as f64) / 50e9;
        let draft = (8 * slot) as f64 + 0.75e9;
        let step = (base + 58.0 * u * slot as f64 + k as f64 * draft) / 50e9;
        assert!((c.step_cost - step / plain).abs() < 1e-9, "k {k}");
        let a = c.break_even_acceptance.expect("pays with resident experts");
        assert!(a > 0.0 && a < 1.0, "k {k}: {a}");
        let tokens: f64 = (0..=k).map(|i| a.powi(i as i32)).sum();
        assert!((tokens - c.step_cost).abs() < 1e-9);
    }
    // Streaming at a 10% hit rate from a 5 GB/s disk: disk-bound, a step costs nearly K+1
    // plain tokens, so it pays only with near-perfect acceptance (or never).
    for k in 1..=3 {
        let res = mtp_cost(&ds, k, 1.0, 5.0, 50.0);
        let c = mtp_cost(&ds, k, 0.1, 5.0, 50.0);
        assert!(c.step_cost > 0.9 * (k + 1) as f64, "k {k}: {}", c.step_cost);
        assert!(c.step_cost > res.step_cost);
        let a = c.break_even_acceptance.unwrap_or(1.0);
        assert!(
            a > 0.85 && a > res.break_even_acceptance.unwrap(),
            "k {k}: {a}"
        );
    }
    // The plan carries it and says it in the mtp line.
    let resident = plan(
        &ds,
        Some(&profile(5.0, 8, 50.0, 512 * GB, true)),
        &PlanRequest {
            mtp: 2,
            ..req(400 * GB)
        },
    )
    .unwrap();
    assert!(!resident.stream);
    let c = resident.mtp_cost.clone().unwrap();
    assert_eq!(c.drafts, 2);
    let (v, why) = decision(&resident, "mtp");
    assert_eq!(v, "on, 2 drafts");
    assert!(why.contains("pays above"), "{why}");
    let streamed = plan(
        &ds,
        Some(&profile(5.0, 8, 50.0, 512 * GB, true)),
        &PlanRequest {
            mtp: 2,
            ..req(64 * GB)
        },
    )
    .unwrap();
    assert!(streamed.stream && streamed.disk_bound);
    let (_, why) = decision(&streamed, "mtp");
    let a = streamed
        .mtp_cost
        .as_ref()
        .unwrap()
        .break_even_acceptance
        .unwrap_or(1.0);
    assert!(a > c.break_even_acceptance.unwrap(), "{why}");
    assert!(why.contains("warning: decode is disk-bound"), "{why}");
}

/// A run that reads experts faster than the profile's ceiling raises it (a probe taken on a
/// busy machine), one that reads much slower says so and keeps it; profiles saved before the
/// busy figure existed still load.
#[test]
fn run_reads_check_the_profile() {
    let mut p = profile(1.0, 4, 50.0, 64 * GB, true);
    assert_eq!(
        p.storage.busy_at_probe, None,
        "old profiles load without the field"
    );
    assert_eq!(
        p.check_run_reads(2_359_296, 1 << 20, 0.001),
        None,
        "too little read"
    );
    assert_eq!(
        p.check_run_reads(2_359_296, GB, 1.0),
        None,
        "1.0 GB/s: as profiled"
    );
    p.storage.busy_at_probe = Some(0.9);
    let msg = p.check_run_reads(2_359_296, 2 * GB, 1.0).unwrap();
    assert!(
        msg.contains("2.00 GB/s") && msg.contains("90% busy") && msg.contains("raised"),
        "{msg}"
    );
    assert_eq!(p.disk_ceiling(2_359_296).unwrap().1.gbps, 2.0);
    assert!(p.storage.raised_by_run.is_some());
    let msg = p.check_run_reads(2_359_296, GB / 2, 1.0).unwrap();
    assert!(msg.contains("under half") && msg.contains("kept"), "{msg}");
    assert_eq!(p.disk_ceiling(2_359_296).unwrap().1.gbps, 2.0);
    // The raised profile round-trips through its JSON.
    let back: MachineProfile = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back, p);
}

/// Without `--ram`, a memory cgroup's limit below MemAvailable sets the budget (85% of it):
/// the cgroup counts the process whatever the machine has free.
#[test]
fn memory_cgroup_limit_below_available_sets_the_budget() {
    let m = model();
    let mut pr = profile(7.0, 16, 50.0, 64 * GB, true);
    pr.memory.cgroup_limit_bytes = Some(8 * GB);
    pr.memory.cgroup_source = Some("/sys/fs/cgroup/memory/x/memory.limit_in_bytes".into());
    let p = plan(&m, Some(&pr), &PlanRequest::default()).unwrap();
    assert_eq!(p.budget_bytes, 8 * GB / 100 * 85);
    let (_, why) = decision(&p, "budget");
    assert!(why.contains("memory cgroup's limit"), "{why}");
    assert!(p.stream);
    // A limit above MemAvailable changes nothing; --ram still wins over both.
    pr.memory.cgroup_limit_bytes = Some(128 * GB);
    let p = plan(&m, Some(&pr), &PlanRequest::default()).unwrap();
    assert_eq!(p.budget_bytes, 64 * GB / 100 * 85);
    pr.memory.cgroup_limit_bytes = Some(8 * GB);
    assert_eq!(
        plan(&m, Some(&pr), &req(6 * GB)).unwrap().budget_bytes,
        6 * GB
    );
}

#[test]
fn one_reader_tied_with_two_takes_two() {
    // The probe's peak is one reader, two measured within 15% of it (a noisy disk): the plan
    // reads with two (one reader leaves the disk idle between reads).
    let m = model();
    let mut p = profile(1.74, 1, 50.0, 64 * GB, true);
    p.storage.series[0].points[1].gbps = 1.66;
    let tie = plan(&m, Some(&p), &req(14 * GB)).unwrap();
    assert_eq!(tie.io_threads, 2);
    assert!(decision(&tie, "io").1.contains("2 threads 1.66"));
    // Two clearly slower: one reader.
    p.storage.series[0].points[1].gbps = 1.2;
    assert_eq!(plan(&m, Some(&p), &req(14 * GB)).unwrap().io_threads, 1);
}

#[test]
fn streamed_cpu_runs_leave_the_embedding_table_in_the_file() {
    // An untied 600 MB embedding table: with `embedding_in_file` (CPU runs) its bytes, but
    // EMBEDDING_TOUCHED, go to expert slots, and a budget that could not hold it is possible.
    let mut m = model();
    m.embedding_bytes = 600_000_000;
    let p = profile(2.0, 4, 50.0, 64 * GB, true);
    let held = plan(&m, Some(&p), &req(4 * GB)).unwrap();
    let in_file = plan(
        &m,
        Some(&p),
        &PlanRequest {
            embedding_in_file: true,
            ..req(4 * GB)
        },
    )
    .unwrap();
    assert!(!held.embedding_in_file && in_file.embedding_in_file);
    let freed = (600_000_000 - sluice::plan::planner::EMBEDDING_TOUCHED) / m.slot_bytes / 48;
    let more = (in_file.slots_per_layer - held.slots_per_layer) as u64;
    assert!(
        more.abs_diff(freed) <= 1,
        "the table's bytes become slots: {more} more a layer, {freed} expected"
    );
    assert!(decision(&in_file, "embedding").0.contains("600.0 MB"));
    // Resident experts: the request changes nothing.
    let resident = plan(
        &m,
        Some(&p),
        &PlanRequest {
            embedding_in_file: true,
            ..req(64 * GB)
        },
    )
    .unwrap();
    assert!(!resident.stream && !resident.embedding_in_file);
    // 1.5 GB cannot hold 1.5 GB of weights + 0.4 GB of KV cache; with the table in the file
    // it holds the other 1.3 GB and a slot per layer.
    assert!(plan(&m, Some(&p), &req(1_500_000_000)).is_err());
    assert!(plan(
        &m,
        Some(&p),
        &PlanRequest {
            embedding_in_file: true,
            ..req(1_500_000_000)
        }
    )
    .is_ok());
}
