//! Which kernels max-autotune times, and over what buffers ([Note: kernel configurations] in
//! braze-codegen; the timing is braze-runtime's `cuda::kernel_tune`).

use braze_codegen::cuda::{emit_candidates, Config};
use braze_runtime::cuda::kernel_tune::Tunable;
use braze_sched::{Buffer, Schedule};
use std::collections::HashMap;

/// Bytes a buffer's elements span (its strides may leave gaps or overlap), or `None` when a
/// size or stride is symbolic.
fn span_bytes(b: &Buffer) -> Option<usize> {
    let mut last: i64 = 0;
    for (n, s) in b.shape.iter().zip(&b.strides) {
        let (n, s) = (n.as_const()?, s.as_const()?);
        if n == 0 {
            return Some(0);
        }
        last += (n - 1) * s.abs();
    }
    Some((last + 1) as usize * b.dtype.size())
}

/// The kernels of `sched` worth timing, each once (kernels with the same code share one
/// entry), and for every kernel the index of its entry. A kernel is timed when its sizes are
/// constants (a dynamic graph's kernels keep the heuristic's configuration) and it has more
/// than one distinct candidate. Kernels that bound-check indices read from memory are left
/// alone: an index computed from the scratch buffers' values could be out of range, and the
/// trap would end the CUDA context.
pub fn tunables(sched: &Schedule, gpu: braze_codegen::cuda::Gpu) -> (Vec<Tunable>, Vec<Option<usize>>) {
    let mut out: Vec<Tunable> = Vec::new();
    let mut by_key: HashMap<String, usize> = HashMap::new();
    let mut of = Vec::with_capacity(sched.kernels.len());
    for k in &sched.kernels {
        if !k.syms().is_empty() {
            of.push(None);
            continue;
        }
        let Ok(candidates) = emit_candidates(k, gpu) else {
            of.push(None);
            continue;
        };
        if candidates.len() < 2 || candidates[0].kernel.text.contains("bz_bounded(") {
            of.push(None);
            continue;
        }
        if let Some(&i) = by_key.get(&candidates[0].kernel.key) {
            of.push(Some(i));
            continue;
        }
        let buffers: Option<Vec<(u32, usize, u8)>> = k
            .bufs
            .iter()
            .map(|r| {
                let b = &sched.buffers[r.id as usize];
                let fill = if b.dtype.is_float() { braze_runtime::cuda::FILL_FLOAT } else { 0 };
                span_bytes(b).map(|n| (r.id, n, fill))
            })
            .collect();
        let Some(buffers) = buffers else {
            of.push(None);
            continue;
        };
        by_key.insert(candidates[0].kernel.key.clone(), out.len());
        of.push(Some(out.len()));
        out.push(Tunable { candidates, buffers });
    }
    (out, of)
}

/// Each kernel's configuration given the chosen ones of its entries (`None`: the heuristic's).
pub fn per_kernel(of: &[Option<usize>], chosen: &[Config]) -> Vec<Option<Config>> {
    of.iter().map(|i| i.map(|i| chosen[i])).collect()
}
