//! The canonical text form of a graph. `parse.rs` reads exactly what this writes.
//!
//! ```text
//! graph fw {
//!   %0 = input index=0 strides=[4096, 1] : f32[1024, 4096]
//!   %1 = sin %0 : f32[1024, 4096]
//!   return %1
//! }
//! ```

use crate::graph::{Graph, Node};
use crate::op::{Lit, Op};
use crate::sym::Expr;
use std::fmt::{self, Write};

pub fn fmt_lit(l: Lit) -> String {
    match l {
        Lit::F(v) if v.is_nan() => "nan".into(),
        Lit::F(v) if v.is_infinite() => (if v > 0.0 { "inf" } else { "-inf" }).into(),
        Lit::F(v) => {
            let s = format!("{v:?}");
            if s.contains('.') || s.contains('e') {
                s
            } else {
                format!("{s}.0")
            }
        }
        Lit::I(v) => v.to_string(),
        Lit::B(b) => b.to_string(),
    }
}

fn list<T: fmt::Display>(xs: &[T]) -> String {
    let parts: Vec<String> = xs.iter().map(|x| x.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// The attributes of an op in text form (`dims=[1] keepdim=true`).
pub fn op_attrs(op: &Op) -> String {
    let e = |x: &Expr| x.to_string();
    match op {
        Op::Input { index, strides } => format!("index={index} strides={}", list(strides)),
        Op::Scalar { value, dtype } => format!("value={} dtype={dtype}", fmt_lit(*value)),
        Op::Size { value, dtype } => format!("value={} dtype={dtype}", e(value)),
        Op::Iota { len, start, step, dtype } => format!("len={} start={start} step={step} dtype={dtype}", e(len)),
        Op::Random { dist, shape, stream, dtype } => format!("dist={} shape={} stream={stream} dtype={dtype}", dist.name(), list(shape)),
        Op::Unary(_) | Op::Binary(_) | Op::Where => String::new(),
        Op::Cast(d) => format!("dtype={d}"),
        Op::Reduce { kind, dims, keepdim, correction } => {
            let mut s = format!("dims={} keepdim={keepdim}", list(dims));
            if *kind == crate::op::ReduceKind::Var {
                write!(s, " correction={correction}").unwrap();
            }
            s
        }
        Op::Permute(p) => format!("dims={}", list(p)),
        Op::Expand(s) | Op::Reshape(s) => format!("shape={}", list(s)),
        Op::Slice { dim, start, len, step } => format!("dim={dim} start={} len={} step={step}", e(start), e(len)),
        Op::Select { dim, index } => format!("dim={dim} index={}", e(index)),
        Op::IndexSelect { dim } | Op::Gather { dim } | Op::Cat { dim } => format!("dim={dim}"),
        Op::Pad { pads, value } => {
            let flat: Vec<i64> = pads.iter().flat_map(|&(a, b)| [a, b]).collect();
            format!("pads={} value={}", list(&flat), fmt_lit(*value))
        }
        Op::Matmul { epilogue, tf32, residual } => {
            format!("epilogue={} tf32={tf32}{}", epilogue.name(), if *residual { " residual=true" } else { "" })
        }
        Op::Conv { dir, stride, padding, dilation, groups, spatial, tf32, strides } => {
            let d = if *dir == crate::op::ConvDir::Forward { String::new() } else { format!("dir={} spatial={} ", dir.name(), list(spatial)) };
            format!("{d}stride={} padding={} dilation={} groups={groups} tf32={tf32} strides={}", list(stride), list(padding), list(dilation), list(strides))
        }
        Op::Extern { target, outputs, effect } => format!("target=\"{target}\" outputs={outputs}{}", if *effect { " effect=true" } else { "" }),
        Op::ExternOut { index, strides } => format!("index={index} strides={}", list(strides)),
        Op::Layout { strides } => format!("strides={}", list(strides)),
        Op::BiasGrad => String::new(),
    }
}

/// One node as a line of text, without indentation.
pub fn node_line(id: crate::graph::NodeId, n: &Node) -> String {
    let mut s = format!("{id} = {}", n.op.name());
    let attrs = op_attrs(&n.op);
    if !attrs.is_empty() {
        s.push(' ');
        s.push_str(&attrs);
    }
    if !n.inputs.is_empty() {
        let ops: Vec<String> = n.inputs.iter().map(|i| i.to_string()).collect();
        s.push(' ');
        s.push_str(&ops.join(", "));
    }
    if let Some(ty) = &n.ty {
        write!(s, " : {ty}").unwrap();
    }
    s
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "graph {} {{", self.name)?;
        for id in self.ids() {
            writeln!(f, "  {}", node_line(id, self.node(id)))?;
        }
        let outs: Vec<String> = self.outputs.iter().map(|o| o.to_string()).collect();
        match self.free_layout_from {
            // `return %1 | free layout %2, %3`: the outputs after the bar come back in the
            // strides braze stores them with.
            Some(k) if k <= outs.len() => writeln!(f, "  return {} | free layout {}", outs[..k].join(", "), outs[k..].join(", "))?,
            _ => writeln!(f, "  return {}", outs.join(", "))?,
        }
        writeln!(f, "}}")
    }
}
