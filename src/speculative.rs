//! Speculative sampling's acceptance rule as pure functions (Leviathan et al. 2023, "Fast
//! Inference from Transformers via Speculative Decoding"; Chen et al. 2023): a draft token x
//! drawn from the draft distribution q is kept with probability min(1, p(x)/q(x)), where p is
//! the main model's distribution at the same position; on rejection the token is drawn from the
//! residual norm(max(0, p − q)); when every draft of a step is kept, one more token is drawn from
//! the main model's next distribution. Each emitted token is then distributed exactly as p.
//!
//! Owns: the rule and drawing from a given uniform. Does not own: the random numbers, the
//! distributions (the sampler makes them) or the loop (`engine::decode`).
//! Invariant: every function is deterministic in its inputs, so tests can enumerate outcomes
//! exactly instead of sampling them.
//!
//! Distributions are `(id, probability)` pairs with distinct ids (absent ids have probability 0);
//! the draft distribution is kept sorted by id (`sort_by_id`) so a look-up is a binary search
//! even when no top-k bounds it.

/// What `verify_draft` decided for one draft token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The draft token is emitted; verification moves on to the next draft.
    Accept,
    /// The draft token is dropped and this token (from the residual) is emitted instead; the
    /// step ends here.
    Reject(u32),
}

/// Sort a distribution by id, for the look-ups of `accept_prob` and `residual`.
pub fn sort_by_id(d: &mut [(u32, f32)]) {
    d.sort_unstable_by_key(|x| x.0);
}

/// Probability of `id` in a distribution sorted by id (0 when absent).
pub fn prob_sorted(d: &[(u32, f32)], id: u32) -> f32 {
    d.binary_search_by_key(&id, |x| x.0)
        .map(|i| d[i].1)
        .unwrap_or(0.0)
}

/// Probability of `id` in a distribution in any order (0 when absent).
pub fn prob_any(d: &[(u32, f32)], id: u32) -> f32 {
    d.iter().find(|x| x.0 == id).map(|x| x.1).unwrap_or(0.0)
}

/// min(1, p(x)/q(x)): the probability of keeping draft token `x`. A token the draft could not
/// have drawn (q(x) = 0) is never kept. `q_by_id` sorted by id.
pub fn accept_prob(p: &[(u32, f32)], q_by_id: &[(u32, f32)], x: u32) -> f64 {
    let (px, qx) = (prob_any(p, x) as f64, prob_sorted(q_by_id, x) as f64);
    if qx <= 0.0 {
        return 0.0;
    }
    (px / qx).min(1.0)
}

/// The residual distribution norm(max(0, p − q)) into `out` (in p's order). When p ≤ q
/// everywhere (then p = q, and a rejection has probability 0) it is p itself, so a caller that
/// rejects on rounding still draws from the right distribution. `q_by_id` sorted by id.
pub fn residual(p: &[(u32, f32)], q_by_id: &[(u32, f32)], out: &mut Vec<(u32, f32)>) {
    out.clear();
    let mut sum = 0.0f64;
    for &(id, pp) in p {
        let r = pp - prob_sorted(q_by_id, id);
        if r > 0.0 {
            out.push((id, r));
            sum += r as f64;
        }
    }
    if out.is_empty() || sum <= 0.0 {
        out.clear();
        out.extend_from_slice(p);
        sum = p.iter().map(|x| x.1 as f64).sum();
    }
    if sum > 0.0 {
        for x in out.iter_mut() {
            x.1 = (x.1 as f64 / sum) as f32;
        }
    }
}

/// The token a uniform `u` in [0, 1) selects from `dist` by inverse CDF over its weights in
/// their order (weights need not sum to one): id i owns [W(i−1), W(i)) / W. An empty or
/// all-zero distribution gives its first id (or 0).
pub fn draw(dist: &[(u32, f32)], u: f64) -> u32 {
    let total: f64 = dist.iter().map(|x| x.1.max(0.0) as f64).sum();
    let target = u * total;
    let mut acc = 0.0;
    for &(id, p) in dist {
        acc += p.max(0.0) as f64;
        if acc > target {
            return id;
        }
    }
    // u * total rounded up to total: the last token with weight.
    dist.iter()
        .rev()
        .find(|x| x.1 > 0.0)
        .or(dist.first())
        .map(|x| x.0)
        .unwrap_or(0)
}

/// One draft token's verification: keep `x` when `u_accept < accept_prob`, else draw its
/// replacement from the residual with `u_residual`. Both uniforms in [0, 1); `scratch` holds
/// the residual. `q_by_id` sorted by id.
pub fn verify_draft(
    p: &[(u32, f32)],
    q_by_id: &[(u32, f32)],
    x: u32,
    u_accept: f64,
    u_residual: f64,
    scratch: &mut Vec<(u32, f32)>,
) -> Verdict {
    if u_accept < accept_prob(p, q_by_id, x) {
        return Verdict::Accept;
    }
    residual(p, q_by_id, scratch);
    Verdict::Reject(draw(scratch, u_residual))
}

#[cfg(test)]
mod tests {
    //! Exact enumerations: the probability of every outcome is computed as a sum over the draft
    //! tokens and the acceptance events (whose probabilities are the measures of the uniform's
    //! intervals `verify_draft` and `draw` map to each outcome), never by sampling.
    use super::*;
    use std::collections::BTreeMap;

    const TOL: f64 = 1e-6;

    fn dist(ps: &[f32]) -> Vec<(u32, f32)> {
        ps.iter()
            .enumerate()
            .filter(|x| *x.1 > 0.0)
            .map(|(i, &p)| (i as u32, p))
            .collect()
    }

    fn sorted(mut d: Vec<(u32, f32)>) -> Vec<(u32, f32)> {
        sort_by_id(&mut d);
        d
    }

    /// The exact law of `draw(d, U)` for U uniform on [0, 1): the length of the interval of
    /// u each id owns, found from the breakpoints and checked by calling `draw` just inside
    /// both ends of each interval.
    fn draw_law(d: &[(u32, f32)]) -> BTreeMap<u32, f64> {
        let total: f64 = d.iter().map(|x| x.1 as f64).sum();
        let mut law = BTreeMap::new();
        let mut lo = 0.0;
        for &(id, w) in d {
            let hi = lo + w as f64 / total;
            if w > 0.0 {
                let eps = 1e-9 * (hi - lo);
                assert_eq!(draw(d, lo + eps), id, "draw at start of {id}'s interval");
                assert_eq!(draw(d, hi - eps), id, "draw at end of {id}'s interval");
                *law.entry(id).or_insert(0.0) += hi - lo;
            }
            lo = hi;
        }
        law
    }

    /// The exact law of the token one verification emits for draft `x`: `verify_draft` keeps x
    /// for u_accept in [0, a) and rejects on [a, 1) (checked at both sides of a), then draws the
    /// replacement by `draw_law` of the residual. Returns (P(accept), law of the replacement).
    fn verify_law(p: &[(u32, f32)], q: &[(u32, f32)], x: u32) -> (f64, BTreeMap<u32, f64>) {
        let a = accept_prob(p, q, x);
        let mut s = Vec::new();
        if a > 0.0 {
            assert_eq!(
                verify_draft(p, q, x, a * 0.999_999, 0.5, &mut s),
                Verdict::Accept
            );
        }
        let mut law = BTreeMap::new();
        if a < 1.0 {
            let mut r = Vec::new();
            residual(p, q, &mut r);
            for (id, pr) in draw_law(&r) {
                // The replacement `verify_draft` returns is the residual's draw.
                let lo_u = r
                    .iter()
                    .take_while(|e| e.0 != id)
                    .map(|e| e.1 as f64)
                    .sum::<f64>()
                    / r.iter().map(|e| e.1 as f64).sum::<f64>();
                let u = lo_u + pr * 0.5;
                assert_eq!(
                    verify_draft(p, q, x, a + (1.0 - a) * 0.5, u, &mut s),
                    Verdict::Reject(id)
                );
                law.insert(id, pr);
            }
        }
        (a, law)
    }

    /// Law of the token one speculative position emits: Σ_x q(x)·[a(x)·δ_x + (1 − a(x))·r].
    fn one_step_law(p: &[(u32, f32)], q: &[(u32, f32)]) -> BTreeMap<u32, f64> {
        let mut out = BTreeMap::new();
        for (x, qx) in draw_law(q) {
            let (a, rep) = verify_law(p, q, x);
            *out.entry(x).or_insert(0.0) += qx * a;
            for (y, r) in rep {
                *out.entry(y).or_insert(0.0) += qx * (1.0 - a) * r;
            }
        }
        out
    }

    fn assert_law_eq(got: &BTreeMap<u32, f64>, want: &[(u32, f32)], what: &str) {
        let total: f64 = want.iter().map(|x| x.1 as f64).sum();
        for &(id, w) in want {
            let g = got.get(&id).copied().unwrap_or(0.0);
            assert!(
                (g - w as f64 / total).abs() < TOL,
                "{what}: P({id}) = {g}, want {}",
                w as f64 / total
            );
        }
        for (id, g) in got {
            if prob_any(want, *id) == 0.0 {
                assert!(*g < TOL, "{what}: P({id}) = {g} outside p's support");
            }
        }
    }

    #[test]
    fn draw_is_the_inverse_cdf() {
        let d = vec![(7, 0.25), (2, 0.0), (3, 0.5), (9, 0.25)];
        let law = draw_law(&d);
        assert_eq!(law.len(), 3);
        assert!((law[&3] - 0.5).abs() < 1e-12);
        assert_eq!(draw(&d, 0.0), 7);
        assert_eq!(draw(&d, 0.25), 3);
        assert_eq!(draw(&d, 0.75), 9);
        assert_eq!(draw(&d, 1.0 - 1e-17), 9);
        // Unnormalised weights draw the same law.
        let law2 = draw_law(&[(7, 1.0), (3, 2.0), (9, 1.0)]);
        assert_eq!(law, law2);
    }

    #[test]
    fn residual_is_normalised_positive_part() {
        let p = dist(&[0.5, 0.3, 0.2, 0.0]);
        let q = sorted(dist(&[0.2, 0.5, 0.0, 0.3]));
        let mut r = Vec::new();
        residual(&p, &q, &mut r);
        // max(0, p - q) = [0.3, 0, 0.2, 0] -> [0.6, 0, 0.4, 0].
        assert_eq!(r.len(), 2);
        assert!((prob_any(&r, 0) - 0.6).abs() < 1e-6);
        assert!((prob_any(&r, 2) - 0.4).abs() < 1e-6);
        // p = q: the residual falls back to p.
        residual(&p, &sorted(p.clone()), &mut r);
        assert_eq!(r, p);
    }

    /// The one-position law equals p for every pair below: overlapping supports, q wider than
    /// p, p wider than q, disjoint supports, q = p, point masses.
    #[test]
    fn one_speculative_position_emits_p_exactly() {
        let cases: &[(&[f32], &[f32])] = &[
            (&[0.5, 0.3, 0.2], &[0.2, 0.3, 0.5]),
            (&[0.1, 0.2, 0.3, 0.4], &[0.25, 0.25, 0.25, 0.25]),
            (&[0.7, 0.0, 0.3, 0.0], &[0.1, 0.4, 0.1, 0.4]),
            (&[0.2, 0.2, 0.2, 0.4], &[0.0, 0.5, 0.5, 0.0]),
            (&[0.6, 0.4, 0.0, 0.0], &[0.0, 0.0, 0.3, 0.7]),
            (&[0.3, 0.3, 0.4], &[0.3, 0.3, 0.4]),
            (&[0.0, 1.0, 0.0], &[0.5, 0.25, 0.25]),
            (&[0.25, 0.25, 0.5], &[0.0, 0.0, 1.0]),
            (&[1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0], &[0.9, 0.05, 0.05]),
        ];
        for (i, (pp, qq)) in cases.iter().enumerate() {
            let p = dist(pp);
            let q = sorted(dist(qq));
            assert_law_eq(&one_step_law(&p, &q), &p, &format!("case {i}"));
            // The order the sampler lists p in (most likely first) does not matter.
            let mut p_rev = p.clone();
            p_rev.reverse();
            assert_law_eq(&one_step_law(&p_rev, &q), &p, &format!("case {i} reversed"));
        }
    }

    /// Temperature 0: p and q are point masses (the sampler's greedy distributions), so a
    /// draft is kept iff it is p's arg-max and a rejection emits the arg-max: the output is the
    /// greedy token whatever the draft.
    #[test]
    fn greedy_point_masses_emit_the_argmax() {
        for best in 0..3u32 {
            let p = vec![(best, 1.0)];
            for d in 0..3u32 {
                let q = vec![(d, 1.0)];
                let mut s = Vec::new();
                for u in [0.0, 0.3, 0.999_999] {
                    let v = verify_draft(&p, &q, d, u, u, &mut s);
                    let want = if d == best {
                        Verdict::Accept
                    } else {
                        Verdict::Reject(best)
                    };
                    assert_eq!(v, want, "argmax {best}, draft {d}, u {u}");
                }
                assert_law_eq(&one_step_law(&p, &q), &p, "greedy");
            }
        }
    }

    /// A toy pair of "models" over a 3-token vocabulary whose distributions depend on the
    /// context, with zeros: `p` is the main model, `q` the draft.
    fn toy(ctx: &[u32], main: bool, greedy: bool) -> Vec<(u32, f32)> {
        let h = ctx.iter().fold(if main { 17u32 } else { 5 }, |a, &t| {
            a.wrapping_mul(31).wrapping_add(t + 1)
        });
        let table: [[f32; 3]; 6] = [
            [0.5, 0.3, 0.2],
            [0.0, 0.6, 0.4],
            [0.1, 0.0, 0.9],
            [0.25, 0.5, 0.25],
            [0.0, 0.0, 1.0],
            [0.7, 0.3, 0.0],
        ];
        let row = table[(h % 6) as usize];
        if greedy {
            let best = (0..3).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            return vec![(best as u32, 1.0)];
        }
        dist(&row)
    }

    /// The law of the first `n` emitted tokens when generation proceeds by speculative steps of
    /// `k` drafts from `ctx` (tokens past `n` are cut off, as `max_tokens` does). One step:
    /// position j drafts x ~ q(ctx + kept drafts), keeps it with a(x) or emits the residual's
    /// token and ends; when all k are kept the bonus token comes from p.
    fn spec_law(ctx: &[u32], n: usize, k: usize, greedy: bool) -> BTreeMap<Vec<u32>, f64> {
        #[allow(clippy::too_many_arguments)]
        fn step(
            ctx: &mut Vec<u32>,
            emitted: &mut Vec<u32>,
            n: usize,
            k: usize,
            left: usize,
            greedy: bool,
            prob: f64,
            out: &mut BTreeMap<Vec<u32>, f64>,
        ) {
            if emitted.len() >= n || prob == 0.0 {
                if prob > 0.0 {
                    *out.entry(emitted[..n].to_vec()).or_insert(0.0) += prob;
                }
                return;
            }
            let p = toy(ctx, true, greedy);
            let mut emit_then = |y: u32, pr: f64, left: usize, ctx: &mut Vec<u32>| {
                ctx.push(y);
                emitted.push(y);
                step(ctx, emitted, n, k, left, greedy, prob * pr, out);
                ctx.pop();
                emitted.pop();
            };
            if left == 0 {
                // Bonus token from p; a new step starts after it.
                for (y, py) in draw_law(&p) {
                    emit_then(y, py, k, ctx);
                }
                return;
            }
            let q = sorted(toy(ctx, false, greedy));
            for (x, qx) in draw_law(&q) {
                let (a, rep) = verify_law(&p, &q, x);
                emit_then(x, qx * a, left - 1, ctx);
                for (y, r) in rep {
                    emit_then(y, qx * (1.0 - a) * r, k, ctx);
                }
            }
        }
        let mut out = BTreeMap::new();
        step(
            &mut ctx.to_vec(),
            &mut Vec::new(),
            n,
            k,
            k,
            greedy,
            1.0,
            &mut out,
        );
        out
    }

    /// Plain sampling's law of the next `n` tokens: the product of p along each sequence.
    fn plain_law(ctx: &[u32], n: usize, greedy: bool) -> BTreeMap<Vec<u32>, f64> {
        let mut out = BTreeMap::new();
        out.insert(Vec::new(), 1.0);
        for _ in 0..n {
            let mut next = BTreeMap::new();
            for (seq, pr) in out {
                let mut c = ctx.to_vec();
                c.extend_from_slice(&seq);
                for (y, py) in draw_law(&toy(&c, true, greedy)) {
                    let mut s = seq.clone();
                    s.push(y);
                    *next.entry(s).or_insert(0.0) += pr * py;
                }
            }
            out = next;
        }
        out
    }

    /// Whole speculative steps of k = 1..3 drafts, chained over 4 tokens, give exactly plain
    /// sampling's joint law of the sequence, at temperature > 0 and at 0 (point masses).
    #[test]
    fn speculative_steps_keep_the_joint_law_of_sequences() {
        for greedy in [false, true] {
            for ctx in [vec![0u32], vec![2, 1], vec![1, 1, 0]] {
                let n = 4;
                let want = plain_law(&ctx, n, greedy);
                for k in 1..=3 {
                    let got = spec_law(&ctx, n, k, greedy);
                    let total: f64 = got.values().sum();
                    assert!((total - 1.0).abs() < TOL, "k {k}: total {total}");
                    for (seq, w) in &want {
                        let g = got.get(seq).copied().unwrap_or(0.0);
                        assert!(
                            (g - w).abs() < TOL,
                            "greedy {greedy} ctx {ctx:?} k {k} {seq:?}: {g} vs {w}"
                        );
                    }
                    for (seq, g) in &got {
                        assert!(
                            want.contains_key(seq) || *g < TOL,
                            "k {k}: {seq:?} has {g} but plain sampling never emits it"
                        );
                    }
                }
            }
        }
    }
}
