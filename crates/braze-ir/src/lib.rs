//! # braze-ir: the graph IR
//!
//! A braze [`Graph`] is one FX graph after import: a list of [`Node`]s in topological order,
//! each an [`Op`] from the single op table (`op.rs`) applied to earlier nodes, with a
//! [`TensorTy`] (element [`DType`] and symbolic shape). Sizes are [`Expr`]s over size
//! symbols `s0, s1, ...`, so dynamic shapes need no redesign. Views (permute, expand,
//! reshape, slice, select) are ordinary nodes; later stages turn them into index maps.
//! Anything braze does not lower is an `Extern` node: a call of the ATen op by name.
//!
//! The text form (`print.rs`, `parse.rs`) round-trips and is used by golden tests; the
//! verifier (`verify.rs`) lists and checks every invariant.

pub mod dtype;
pub mod graph;
pub mod infer;
pub mod memory_order;
pub mod op;
pub mod parse;
pub mod print;
pub mod scalar_expr;
pub mod sym;
pub mod verify;

pub use dtype::DType;
pub use graph::{contiguous_strides, Graph, Node, NodeId, TensorTy};
pub use op::{BinaryOp, ConvDir, Epilogue, Lit, Op, RandomDist, ReduceKind, UnaryOp};
pub use sym::{Atom, Expr};

/// Errors of graph construction and parsing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An op applied to operands it does not accept (a lowering bug or unsupported use).
    #[error("invalid op: {0}")]
    Invalid(String),
    /// Text that is not a graph.
    #[error("parse error at line {line}: {msg}")]
    Parse { line: usize, msg: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: &str = "graph t {
  %0 = input index=0 strides=[s0, 1] : f32[4, s0]
  %1 = scalar value=1.5 dtype=f32 : f32[]
  %2 = mul %0, %1 : f32[4, s0]
  %3 = sum dims=[1] keepdim=true %2 : f32[4, 1]
  %4 = extern target=\"aten.mm.default\" outputs=1 %2, %2
  %5 = extern_out index=0 strides=[4, 1] %4 : f32[4, 4]
  %6 = pad pads=[1, 0, 0, 2] value=-inf %5 : f32[5, 6]
  return %3, %6
}
";

    #[test]
    fn text_roundtrip_and_verify() {
        let g = parse::parse_graph(G).unwrap();
        assert!(verify::verify(&g).is_empty(), "{:?}", verify::verify(&g));
        assert_eq!(g.to_string(), G);
    }

    #[test]
    fn verifier_catches_bad_types() {
        let mut g = parse::parse_graph(G).unwrap();
        g.nodes[2].ty.as_mut().unwrap().dtype = DType::F16;
        let errs = verify::verify(&g);
        assert!(errs.iter().any(|e| e.to_string().starts_with("%2:")), "{errs:?}");
    }

    #[test]
    fn parse_rejects_mismatched_type() {
        let bad = G.replace("%2 = mul %0, %1 : f32[4, s0]", "%2 = mul %0, %1 : f16[4, s0]");
        assert!(parse::parse_graph(&bad).is_err());
    }
}
