//! The loop IR: what one kernel computes, as straight-line statements over temporaries
//! inside a fixed loop structure.
//!
//! A kernel loops over `outer` (loop variables `i0..`) and, for reductions, runs one or
//! more passes over `inner` (variables numbered after the outer ones) per outer point:
//!
//! ```text
//! for outer index:            (parallel)
//!     prelude                 (values of the outer point)
//!     for each pass:
//!         for inner index:    (vectorized)
//!             body            (loads, math, stores, reduction inputs)
//!         finish reductions   (their results are temporaries from here on)
//!         after               (math and stores of the outer point)
//! ```
//! A pointwise kernel has no inner dims and one pass whose body runs per outer point.
//! Temporaries `tN` are assigned once; their dtypes are in `Kernel::tmp_dtypes`.

use braze_ir::print::fmt_lit;
use braze_ir::{BinaryOp, DType, Expr, Lit, ReduceKind, UnaryOp};
use std::fmt;

pub type BufId = u32;
pub type Tmp = u32;

/// One statement. `dst` temporaries hold values of `Kernel::tmp_dtypes[dst]`.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// `dst = buf[index]`, or `mask ? buf[index] : 0` when masked.
    Load { dst: Tmp, buf: BufId, index: Expr, mask: Option<Tmp> },
    /// `dst = value`
    Const { dst: Tmp, value: Lit },
    /// `dst = index` converted to dst's dtype (iota; gathered indices).
    Index { dst: Tmp, index: Expr },
    /// `dst = (lo <= index) && (index < hi)`: an in-bounds mask.
    InRange { dst: Tmp, index: Expr, lo: Expr, hi: Expr },
    Unary { dst: Tmp, op: UnaryOp, a: Tmp },
    Binary { dst: Tmp, op: BinaryOp, a: Tmp, b: Tmp },
    Where { dst: Tmp, c: Tmp, a: Tmp, b: Tmp },
    /// `dst = a` converted to dst's dtype.
    Cast { dst: Tmp, a: Tmp },
    /// `dst = a`, an index read from memory into a dim of size `hi` (gather, index_select,
    /// embedding). Out of range it is an error, as in eager: the CPU flags it (the runtime
    /// raises after the kernels) and reads index 0; the GPU traps. Never a wild access.
    Bounded { dst: Tmp, a: Tmp, hi: Expr },
    /// `buf[index] = value` (converted to the buffer's dtype).
    Store { buf: BufId, index: Expr, value: Tmp },
}

/// A reduction accumulated in a pass's inner loop.
#[derive(Clone, Debug, PartialEq)]
pub struct Reduction {
    /// Temporary holding the result after the pass.
    pub dst: Tmp,
    pub kind: ReduceKind,
    /// Temporary, computed in the pass body, that is reduced.
    pub src: Tmp,
    /// For `var`: the divisor is `count - correction`.
    pub correction: i64,
    /// Flattened inner index of argmax/argmin (0 for other kinds, which do not use it).
    pub inner_index: Expr,
    /// Number of reduced elements.
    pub count: Expr,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pass {
    pub body: Vec<Stmt>,
    pub reductions: Vec<Reduction>,
    pub after: Vec<Stmt>,
}

/// A buffer a kernel touches, with its dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct BufRef {
    pub id: BufId,
    pub dtype: DType,
    pub written: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// `braze_poi_fused_add_cos_sin_0`: kind, the ops fused, index in the graph.
    pub name: String,
    /// The IR nodes the kernel stores (its roots), for the source comment.
    pub roots: Vec<String>,
    pub outer: Vec<Expr>,
    pub inner: Vec<Expr>,
    pub prelude: Vec<Stmt>,
    pub passes: Vec<Pass>,
    pub tmp_dtypes: Vec<DType>,
    pub bufs: Vec<BufRef>,
    /// The fastest-varying dim of the domain is an outer dim (a reduction over leading dims,
    /// like a bias gradient): neighbouring outer points, not neighbouring reduced elements,
    /// are adjacent in memory, so targets vectorize across outer points.
    pub column: bool,
}

impl Kernel {
    pub fn is_reduction(&self) -> bool {
        self.passes.iter().any(|p| !p.reductions.is_empty())
    }
    /// Every size symbol the kernel's loops and indices mention.
    pub fn syms(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for e in self.outer.iter().chain(&self.inner) {
            e.syms(&mut out);
        }
        let all = self.prelude.iter().chain(self.passes.iter().flat_map(|p| p.body.iter().chain(&p.after)));
        for s in all {
            match s {
                Stmt::Load { index, .. } | Stmt::Store { index, .. } | Stmt::Index { index, .. } | Stmt::Bounded { hi: index, .. } => index.syms(&mut out),
                Stmt::InRange { index, lo, hi, .. } => {
                    index.syms(&mut out);
                    lo.syms(&mut out);
                    hi.syms(&mut out);
                }
                _ => {}
            }
        }
        for p in &self.passes {
            for r in &p.reductions {
                r.count.syms(&mut out);
                r.inner_index.syms(&mut out);
            }
        }
        out.sort();
        out
    }

    /// [Note: in-place kernels] Pairs (written buffer, read buffer) where the written one may
    /// take the read one's memory when the read one dies at this kernel: a pointwise kernel
    /// that reads the buffer only at the very index it stores the other at, with elements of
    /// the same size, before any store to it. Each element is then read by the thread that
    /// overwrites it, before it does (the stored value depends on the load, so neither the
    /// compiler nor vector grouping can reorder the two), and no other point reads it.
    /// Whether the buffers' lifetimes and sizes allow it is the memory planner's question.
    pub fn in_place_pairs(&self) -> Vec<(BufId, BufId)> {
        if self.column || !self.inner.is_empty() || self.passes.len() != 1 || self.is_reduction() {
            return Vec::new();
        }
        let stmts: Vec<&Stmt> = self.prelude.iter().chain(&self.passes[0].body).chain(&self.passes[0].after).collect();
        let mut pairs = Vec::new();
        let mut taken = Vec::new();
        for out in self.bufs.iter().filter(|r| r.written) {
            // The one index every store to `out` uses, and where the first store is.
            let mut index = None;
            let mut first_store = usize::MAX;
            let mut one_index = true;
            for (pos, s) in stmts.iter().enumerate() {
                if let Stmt::Store { buf, index: i, .. } = s {
                    if *buf == out.id {
                        first_store = first_store.min(pos);
                        one_index &= index.is_none_or(|x| x == i);
                        index = Some(i);
                    }
                }
            }
            let (Some(index), true) = (index, one_index) else { continue };
            let candidate = self.bufs.iter().filter(|r| !r.written && r.id != out.id && !taken.contains(&r.id) && r.dtype.size() == out.dtype.size()).find(|r| {
                let loads: Vec<(usize, &Expr)> = stmts
                    .iter()
                    .enumerate()
                    .filter_map(|(pos, s)| match s {
                        Stmt::Load { buf, index: i, .. } if *buf == r.id => Some((pos, i)),
                        _ => None,
                    })
                    .collect();
                !loads.is_empty() && loads.iter().all(|&(pos, i)| pos < first_store && i == index)
            });
            if let Some(r) = candidate {
                taken.push(r.id);
                pairs.push((out.id, r.id));
            }
        }
        pairs
    }
}

impl Stmt {
    /// The temporary the statement assigns (none for a store).
    pub fn dst(&self) -> Option<Tmp> {
        match self {
            Stmt::Store { .. } => None,
            Stmt::Load { dst, .. }
            | Stmt::Const { dst, .. }
            | Stmt::Index { dst, .. }
            | Stmt::InRange { dst, .. }
            | Stmt::Unary { dst, .. }
            | Stmt::Binary { dst, .. }
            | Stmt::Where { dst, .. }
            | Stmt::Cast { dst, .. }
            | Stmt::Bounded { dst, .. } => Some(*dst),
        }
    }
}

impl fmt::Display for Stmt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stmt::Load { dst, buf, index, mask: None } => write!(f, "t{dst} = load buf{buf}[{index}]"),
            Stmt::Load { dst, buf, index, mask: Some(m) } => write!(f, "t{dst} = load buf{buf}[{index}] if t{m}"),
            Stmt::Const { dst, value } => write!(f, "t{dst} = {}", fmt_lit(*value)),
            Stmt::Index { dst, index } => write!(f, "t{dst} = index {index}"),
            Stmt::InRange { dst, index, lo, hi } => write!(f, "t{dst} = {lo} <= {index} < {hi}"),
            Stmt::Unary { dst, op, a } => write!(f, "t{dst} = {} t{a}", op.name()),
            Stmt::Binary { dst, op, a, b } => write!(f, "t{dst} = {} t{a}, t{b}", op.name()),
            Stmt::Where { dst, c, a, b } => write!(f, "t{dst} = where t{c}, t{a}, t{b}"),
            Stmt::Cast { dst, a } => write!(f, "t{dst} = cast t{a}"),
            Stmt::Bounded { dst, a, hi } => write!(f, "t{dst} = bounded t{a} < {hi}"),
            Stmt::Store { buf, index, value } => write!(f, "store buf{buf}[{index}] = t{value}"),
        }
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |v: &[Expr]| v.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(", ");
        let column = if self.column { " column" } else { "" };
        writeln!(f, "kernel {} outer=[{}] inner=[{}]{column}  // {}", self.name, list(&self.outer), list(&self.inner), self.roots.join(", "))?;
        for s in &self.prelude {
            writeln!(f, "  {s}")?;
        }
        for (i, p) in self.passes.iter().enumerate() {
            writeln!(f, "  pass {i}:")?;
            for s in &p.body {
                writeln!(f, "    {s}")?;
            }
            for r in &p.reductions {
                writeln!(f, "    t{} = {} t{}", r.dst, r.kind.name(), r.src)?;
            }
            for s in &p.after {
                writeln!(f, "  {s}")?;
            }
        }
        Ok(())
    }
}
