//! max-autotune for braze's own kernels ([Note: kernel configurations] in braze-codegen):
//! each kernel's candidate configurations are compiled (through the per-kernel cache, in
//! parallel), timed on the device over scratch buffers, and the fastest is kept and
//! remembered ([Note: remembered choices]), so a later process with a warm cache times
//! nothing.

use super::{compile_kernels, device_scope, time_candidates, CudaModule, LaunchSpec};
use crate::choices::Choices;
use crate::RuntimeError;
use braze_codegen::cuda::{Candidate, Config};
use std::sync::OnceLock;
use std::time::Instant;

/// One kernel to tune: its candidates (the heuristic's first) and its buffers as (buffer id,
/// bytes, fill byte), every buffer its launches name.
pub struct Tunable {
    pub candidates: Vec<Candidate>,
    pub buffers: Vec<(u32, usize, u8)>,
}

/// A candidate replaces the heuristic's configuration only when it is this much faster:
/// smaller differences are within the timing's noise.
const MIN_GAIN: f64 = 0.03;

/// A search that has run this long says how far it is, and again at this interval.
const PROGRESS_EVERY_S: f64 = 2.0;

fn tuned() -> &'static Choices {
    static T: OnceLock<Choices> = OnceLock::new();
    T.get_or_init(|| Choices::new("kernels"))
}

/// How many kernels this process has timed (a choice remembered in memory or on disk is not
/// timed again).
pub fn kernels_timed() -> usize {
    KERNELS_TIMED.load(std::sync::atomic::Ordering::Relaxed)
}

static KERNELS_TIMED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The configuration to emit each of `kernels` in: a remembered choice, or the fastest
/// candidate on device `ordinal`. A kernel whose timing fails keeps the heuristic's.
/// `BRAZE_KERNEL_CONFIG=i`, a test hook: every tuned kernel takes its candidate `i` (modulo
/// its count), untimed and not remembered, so a test can run each configuration of a graph's
/// kernels against eager.
pub fn choose(kernels: &[Tunable], arch: &str, version: &str, ordinal: i32) -> Result<Vec<Config>, RuntimeError> {
    if let Some(i) = std::env::var("BRAZE_KERNEL_CONFIG").ok().and_then(|v| v.parse::<usize>().ok()) {
        return Ok(kernels.iter().map(|t| t.candidates[i % t.candidates.len()].config).collect());
    }
    let scope = format!("braze {version} kernels on {}", device_scope(ordinal)?);
    let mut chosen: Vec<Option<Config>> = kernels.iter().map(|t| tuned().get(&scope, &t.candidates[0].kernel.key).and_then(|c| Config::from_text(&c))).collect();
    let misses: Vec<usize> = (0..kernels.len()).filter(|&i| chosen[i].is_none()).collect();
    if !misses.is_empty() {
        let mut all = Vec::new();
        let mut specs: Vec<LaunchSpec> = Vec::new();
        for &i in &misses {
            let t = &kernels[i];
            for c in &t.candidates {
                all.push(c.kernel.clone());
                let mut l = c.launch.clone();
                // Buffers by their place in `t.buffers`, which are the tuning's scratch buffers.
                l.bufs = l.bufs.iter().map(|b| t.buffers.iter().position(|x| x.0 == *b).expect("every launch buffer has a scratch buffer") as u32).collect();
                l.fallback = None;
                specs.push(l);
            }
        }
        // Tuning is an optimization: candidates that do not compile or load leave every
        // kernel in the heuristic's configuration (whose own compile then reports any error).
        let Ok(placed) = compile_kernels(&all, arch, version, 0) else {
            return Ok(or_heuristic(kernels, &chosen));
        };
        for (l, place) in specs.iter_mut().zip(&placed.places) {
            (l.unit, l.name) = place.clone();
        }
        let Ok(module) = CudaModule::load(&placed.cubins, ordinal, specs, Vec::new(), false, version) else {
            return Ok(or_heuristic(kernels, &chosen));
        };
        let start = Instant::now();
        let mut said = 0.0;
        let mut first = 0;
        for (n, &i) in misses.iter().enumerate() {
            let t = &kernels[i];
            let sizes: Vec<(usize, u8)> = t.buffers.iter().map(|&(_, bytes, fill)| (bytes, fill)).collect();
            let timed = time_candidates(ordinal, &sizes, t.candidates.len(), &mut |c, ptrs, stream| module.run(first + c, first + c + 1, ptrs, &[], stream));
            first += t.candidates.len();
            KERNELS_TIMED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Ok(times) = timed {
                if let Some(best) = fastest(&times) {
                    chosen[i] = Some(t.candidates[best].config);
                    tuned().put(&scope, &t.candidates[0].kernel.key, &t.candidates[best].config.to_text());
                }
            }
            let s = start.elapsed().as_secs_f64();
            if s - said >= PROGRESS_EVERY_S {
                said = s;
                eprintln!("braze max-autotune: timed the configurations of {}/{} kernels ({s:.1} s)", n + 1, misses.len());
            }
        }
    }
    Ok(or_heuristic(kernels, &chosen))
}

/// The chosen configurations, the heuristic's where none was chosen.
fn or_heuristic(kernels: &[Tunable], chosen: &[Option<Config>]) -> Vec<Config> {
    chosen.iter().zip(kernels).map(|(c, t)| c.unwrap_or(t.candidates[0].config)).collect()
}

/// The candidate to keep given each one's seconds (the heuristic's first): the fastest when
/// it beats the heuristic by [`MIN_GAIN`], else the heuristic; `None` when nothing ran.
fn fastest(times: &[f64]) -> Option<usize> {
    let (best, t) = times.iter().enumerate().fold((0, f64::INFINITY), |b, (i, &t)| if t < b.1 { (i, t) } else { b });
    if !t.is_finite() {
        return None;
    }
    Some(if times[0].is_finite() && t > times[0] * (1.0 - MIN_GAIN) { 0 } else { best })
}

#[cfg(test)]
mod tests {
    use super::fastest;

    #[test]
    fn keeps_the_heuristic_within_the_noise() {
        assert_eq!(fastest(&[10.0, 9.8, 11.0]), Some(0));
        assert_eq!(fastest(&[10.0, 9.0, 9.5]), Some(1));
        assert_eq!(fastest(&[f64::INFINITY, 9.0, 8.0]), Some(2));
        assert_eq!(fastest(&[f64::INFINITY, f64::INFINITY]), None);
    }
}
