//! Redundant layouts. A `layout` node copies its operand into given strides. When the operand
//! is stored in that memory order anyway (an input or extern result with those strides, or an
//! elementwise value that inherits that order from its operands, see
//! `braze_ir::memory_order::inherited_order`), the copy is dropped and the operand is used.
//! A CPU convolution of an inference graph asks for a channels_last input; the BatchNorm,
//! ReLU and max pool after the previous convolution (channels_last) already produce one. A
//! layout that is a graph output stays (it gives the caller eager's strides). Run for CPU
//! targets only until it is measured on the GPU (on a channels_last ResNet-50 training graph
//! it changes which values are stored).
use braze_ir::memory_order::{from_strides, inherited_order};
use braze_ir::{Graph, NodeId, Op};

pub fn elide_layouts(g: &Graph) -> Graph {
    let elided = |g: &Graph, _: &mut Graph, map: &[NodeId], id: NodeId| {
        let Op::Layout { strides } = &g.node(id).op else { return None };
        let x = g.node(id).inputs[0];
        let same = !g.fixed_layout_output(id)
            && match &g.node(x).op {
                Op::Input { strides: s, .. } | Op::ExternOut { strides: s, .. } | Op::Layout { strides: s } | Op::Conv { strides: s, .. } => s == strides,
                _ => inherited_order(g, x).is_some_and(|o| Some(o) == from_strides(&g.ty(x).shape, strides)),
            };
        same.then(|| map[x.index()])
    };
    match crate::rewrite::rebuild(g, elided) {
        Some(out) => crate::dce::dce(&out),
        None => g.clone(),
    }
}
