//! The cost of MTP verification (a benchmark, not a test): time of one main-model forward of
//! n = 1..=4 tokens at the same position (a plain decode step is n = 1; `--mtp K` verifies
//! n = K + 1 tokens), and of one MTP head draft, with the routed experts each computes.
//!
//! `cargo run --release --example mtp_verify_cost -- MODEL [REPS] [THREADS]`
//! Every repetition runs n = 1, 2, 3, 4 (reversed on odd repetitions) after truncating the KV
//! cache back to the prompt, so all arms attend over the same context; medians are printed.

use sluice::format::ModelFiles;
use sluice::model::{LoadOptions, Model};
use std::time::Instant;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .ok_or_else(|| anyhow::anyhow!("usage: mtp_verify_cost MODEL [REPS] [THREADS]"))?;
    let reps: usize = args.get(2).map_or(Ok(7), |s| s.parse())?;
    let threads: usize = args.get(3).map_or(Ok(0), |s| s.parse())?;
    let files = ModelFiles::open(std::path::Path::new(path))?;
    let model = Model::load(
        &files,
        &LoadOptions {
            threads,
            ctx: 256,
            kv: sluice::model::KvTypes::default(),
        },
    )?;
    let mut st = model.new_state_mtp(256, 16, 4)?;
    let v = model.cfg.vocab as u32;
    let prompt: Vec<u32> = (0..16u32).map(|i| (i * 7919 + 13) % v).collect();
    let p = prompt.len();
    model.forward_chunk(&mut st, &prompt, p)?;
    model.mtp_take_hidden(&mut st, 0, p - 1, 0);
    model.mtp_forward(&mut st, &prompt[1..], p - 1)?;
    let mtp_pos = st.mtp_pos;
    let drafts = [101u32 % v, 202 % v, 303 % v, 404 % v];
    let mut times = vec![Vec::new(); 5];
    let mut experts = [0usize; 5];
    // Warm-up: one of each.
    for n in 1..=4 {
        st.truncate(p);
        model.forward_chunk(&mut st, &drafts[..n], 0)?;
    }
    for r in 0..reps {
        let order: Vec<usize> = if r % 2 == 0 {
            (1..=4).collect()
        } else {
            (1..=4).rev().collect()
        };
        for n in order {
            st.truncate(p);
            let t = Instant::now();
            model.forward_chunk(&mut st, &drafts[..n], 0)?;
            times[n].push(t.elapsed().as_secs_f64());
            experts[n] = st.experts_run;
        }
        // One MTP head draft (slot p-1: the last prompt hidden state with a draft token).
        st.truncate(p);
        st.mtp_pos = mtp_pos;
        let t = Instant::now();
        model.mtp_forward(&mut st, &drafts[..1], 0)?;
        times[0].push(t.elapsed().as_secs_f64());
        experts[0] = st.experts_run;
    }
    let one = median(&mut times[1].clone());
    println!("forward        median ms   x one-token   routed experts");
    for n in 1..=4 {
        let m = median(&mut times[n]);
        println!(
            "main, {n} token{} {:>9.1}   {:>10.2}x   {:>5}",
            if n == 1 { " " } else { "s" },
            1e3 * m,
            m / one,
            experts[n]
        );
    }
    let m = median(&mut times[0]);
    println!(
        "MTP head draft {:>9.1}   {:>10.2}x   {:>5}",
        1e3 * m,
        m / one,
        experts[0]
    );
    Ok(())
}
