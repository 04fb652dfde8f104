//! # braze-sched: from graph to kernels
//!
//! `schedule` decides which values are stored (realization), groups roots into kernels
//! (fusion, see the notes in `schedule.rs`), lowers each group to the loop IR
//! (`loop_ir.rs`, `lower.rs`), merges the loop dims its indices walk as one
//! (`merge_dims.rs`), and orders kernels and extern calls into steps.

pub mod layout;
pub mod loop_ir;
pub mod lower;
pub mod merge_dims;
pub mod schedule;

pub use loop_ir::{BufId, Kernel, Stmt};
pub use schedule::{schedule, Access, BufKind, Buffer, SchedError, Schedule, Step};

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, b) in self.buffers.iter().enumerate() {
            let sh: Vec<String> = b.shape.iter().map(|e| e.to_string()).collect();
            writeln!(f, "buf{i} = {:?} {} [{}]  // {}", b.kind, b.dtype, sh.join(", "), b.node)?;
        }
        for s in &self.steps {
            match s {
                Step::Kernel(k) => write!(f, "{}", self.kernels[*k])?,
                Step::Matmul { a, b, bias, residual, out, node, bias_grad } => {
                    let v = |a: &Access| format!("buf{}{}", a.buf, if a.view.is_some() { "(view)" } else { "" });
                    let bias = bias.as_ref().map(|x| format!(" + {}", v(x))).unwrap_or_default();
                    let res = residual.as_ref().map(|x| format!(" + {}", v(x))).unwrap_or_default();
                    let grad = bias_grad.map(|g| format!(", bias gradient buf{g}")).unwrap_or_default();
                    writeln!(f, "matmul {node}: buf{out} = {} @ {}{bias}{res}{grad}", v(a), v(b))?
                }
                Step::Conv { node, a, b, out, workspace } => {
                    let ws = workspace.map(|w| format!(", workspace buf{w}")).unwrap_or_default();
                    writeln!(f, "conv {node}: buf{out} = conv(buf{}, buf{}{ws})", a.buf, b.buf)?
                }
                Step::Extern { target, args, outs, .. } => {
                    let a: Vec<String> = args.iter().map(|a| format!("buf{}{}", a.buf, if a.view.is_some() { "(view)" } else { "" })).collect();
                    writeln!(f, "extern {target}({}) -> {:?}", a.join(", "), outs)?
                }
            }
        }
        let o: Vec<String> = self.outputs.iter().map(|a| format!("buf{}{}", a.buf, if a.view.is_some() { "(view)" } else { "" })).collect();
        writeln!(f, "return {}", o.join(", "))
    }
}
