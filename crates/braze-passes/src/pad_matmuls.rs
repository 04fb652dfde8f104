//! Padded matmuls. cuBLASLt's fast kernels need aligned matrices: a dim whose byte count is
//! not a multiple of 16 (GPT-2's vocabulary of 50 257 in bf16) sends it to kernels that load
//! one element at a time. The logits matmul of a GPT-2 b8 s512 step took 3.1 ms so on the
//! H100; the same product with 50 264 columns takes 0.45 ms.
//!
//! So each of M, K and N that is misaligned (and long: at least [`MIN_DIM`], so the extra
//! work stays under 3%) is rounded up to 16 bytes: the operands are zero-padded
//! (`pad` nodes, which fuse into the kernels computing them, e.g. the cast of an f32 weight
//! or the logits gradient), the product is computed at the padded size, and its result is
//! sliced back (a view: its readers take it with the padded row stride). Zero rows and
//! columns of K add nothing; padded rows and columns of the result are never read. A pad
//! under a permute is moved through it, so a transposed operand stays a view of one padded
//! buffer (the logits gradient is padded once for both backward matmuls).
//!
//! A graph output that is such a result is returned as that view, with the padded row stride,
//! as Inductor's padded matmuls are: a row-major copy (eager's strides) cost GPT-2's
//! inference 0.33 ms and doubled its peak memory (the padded and the copied logits, 411 MB
//! each, alive at once). A matmul with a residual (cuBLASLt's C operand) or a bias-gradient
//! epilogue is left alone.

use crate::cse::cse;
use crate::dce::dce;
use braze_ir::{Epilogue, Expr, Graph, Lit, NodeId, Op};

/// Dims shorter than this are not padded.
pub const MIN_DIM: i64 = 256;

/// `x` zero-padded at the end of each dim by `pads[d]`, built in `out`; a permute is
/// passed through (the pad goes on its operand), so no transposed copy is made.
fn pad_operand(g: &Graph, out: &mut Graph, map: &[NodeId], x: NodeId, pads: &[i64]) -> Option<NodeId> {
    if pads.iter().all(|&p| p == 0) {
        return Some(map[x.index()]);
    }
    if let Op::Permute(p) = &g.node(x).op {
        let mut inner = vec![0; pads.len()];
        for (d, &s) in p.iter().enumerate() {
            inner[s] = pads[d];
        }
        let y = pad_operand(g, out, map, g.node(x).inputs[0], &inner)?;
        return out.add(Op::Permute(p.clone()), vec![y]).ok();
    }
    let pads = pads.iter().map(|&p| (0, p)).collect();
    out.add(Op::Pad { pads, value: Lit::F(0.0) }, vec![map[x.index()]]).ok()
}

/// The padded form of matmul `id` in `out`, or `None` when it needs none.
fn pad_one(g: &Graph, out: &mut Graph, map: &[NodeId], id: NodeId) -> Option<NodeId> {
    let Op::Matmul { epilogue, tf32, residual: false } = g.node(id).op else { return None };
    if matches!(epilogue, Epilogue::BiasGradA | Epilogue::BiasGradB) {
        return None; // a padded M or N would pad the sums ([Note: bias-gradient epilogues])
    }
    let ins = &g.node(id).inputs;
    let ty = g.ty(id);
    let r = ty.rank();
    let (m, n, k) = (ty.shape[r - 2].as_const()?, ty.shape[r - 1].as_const()?, g.ty(ins[0]).shape[r - 1].as_const()?);
    let align = 16 / ty.dtype.size() as i64;
    let up = |x: i64| if x >= MIN_DIM && x % align != 0 { (x + align - 1) / align * align - x } else { 0 };
    let (pm, pn, pk) = (up(m), up(n), up(k));
    if pm + pn + pk == 0 {
        return None;
    }
    let pads = |rows: i64, cols: i64| {
        let mut p = vec![0; r];
        p[r - 2] = rows;
        p[r - 1] = cols;
        p
    };
    let a = pad_operand(g, out, map, ins[0], &pads(pm, pk))?;
    let b = pad_operand(g, out, map, ins[1], &pads(pk, pn))?;
    let mut operands = vec![a, b];
    if let Some(&bias) = ins.get(2) {
        operands.push(pad_operand(g, out, map, bias, &[pn])?);
    }
    let mut v = out.add(Op::Matmul { epilogue, tf32, residual: false }, operands).ok()?;
    for (dim, pad, len) in [(r - 2, pm, m), (r - 1, pn, n)] {
        if pad > 0 {
            v = out.add(Op::Slice { dim, start: Expr::zero(), len: Expr::from(len), step: 1 }, vec![v]).ok()?;
        }
    }
    Some(v)
}

pub fn pad_matmuls(g: &Graph) -> Graph {
    match crate::rewrite::rebuild(g, pad_one) {
        Some(out) => dce(&cse(&out)),
        None => g.clone(),
    }
}
