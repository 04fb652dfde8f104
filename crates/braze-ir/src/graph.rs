//! The graph: nodes in topological order (every operand precedes its user).

use crate::dtype::DType;
use crate::infer::infer;
use crate::op::Op;
use crate::sym::Expr;
use crate::Error;
use std::fmt;

/// A node's id; its Display is its text name `%N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// The type of a tensor value: element type and (symbolic) sizes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorTy {
    pub dtype: DType,
    pub shape: Vec<Expr>,
}

impl TensorTy {
    pub fn new(dtype: DType, shape: Vec<Expr>) -> Self {
        TensorTy { dtype, shape }
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    /// Number of elements.
    pub fn numel(&self) -> Expr {
        self.shape.iter().fold(Expr::one(), |a, b| a.mul(b))
    }
}

impl fmt::Display for TensorTy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, s) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{s}")?;
        }
        f.write_str("]")
    }
}

/// Row-major strides of `shape`.
pub fn contiguous_strides(shape: &[Expr]) -> Vec<Expr> {
    let mut st = vec![Expr::one(); shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        st[d] = st[d + 1].mul(&shape[d + 1]);
    }
    st
}

/// One operation and its result type (`None` only for `Extern`, whose results are
/// taken by `ExternOut` nodes).
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub ty: Option<TensorTy>,
}

/// A braze graph: one FX graph after import.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    pub name: String,
    pub nodes: Vec<Node>,
    pub outputs: Vec<NodeId>,
    /// Outputs from this position on are returned in whatever strides the compiler stores
    /// them with (a forward's tensors saved for its backward, which is compiled for the
    /// strides they come back with); the ones before keep eager's (`layout` nodes give them).
    /// `None`: every output keeps eager's strides.
    pub free_layout_from: Option<usize>,
    /// Sizes PyTorch guarantees equal though written differently (monomial -> size:
    /// `s20*s52` -> `s97*s98`), from Dynamo's guards ([Note: equal sizes] in braze-py);
    /// typing compares sizes through them.
    pub size_rules: Vec<(Expr, Expr)>,
}

impl Graph {
    pub fn new(name: &str) -> Self {
        Graph { name: name.to_string(), ..Default::default() }
    }

    /// An empty graph with `g`'s name and size rules (a pass's rebuilt graph).
    pub fn like(g: &Graph) -> Self {
        Graph { name: g.name.clone(), size_rules: g.size_rules.clone(), ..Default::default() }
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    /// Whether `id` is an output whose strides are eager's (an output before
    /// `free_layout_from`): such a value is stored row-major unless it is a `layout`.
    pub fn fixed_layout_output(&self, id: NodeId) -> bool {
        let fixed = self.free_layout_from.unwrap_or(usize::MAX).min(self.outputs.len());
        self.outputs[..fixed].contains(&id)
    }

    /// Takes `from`'s outputs (and which of them have free layouts), its node ids renumbered
    /// by `map` (a pass's rebuilt graph).
    pub fn outputs_from(&mut self, from: &Graph, map: &[NodeId]) {
        self.outputs = from.outputs.iter().map(|o| map[o.index()]).collect();
        self.free_layout_from = from.free_layout_from;
    }

    /// The tensor type of a node; panics on an `Extern` (a verifier-guarded invariant).
    pub fn ty(&self, id: NodeId) -> &TensorTy {
        self.nodes[id.index()].ty.as_ref().expect("extern node has no tensor type")
    }

    pub fn ids(&self) -> impl DoubleEndedIterator<Item = NodeId> {
        (0..self.nodes.len() as u32).map(NodeId)
    }

    /// Adds a node whose type is inferred from its op and operands.
    pub fn add(&mut self, op: Op, inputs: Vec<NodeId>) -> Result<NodeId, Error> {
        for &i in &inputs {
            if i.index() >= self.nodes.len() {
                return Err(Error::Invalid(format!("operand {i} does not exist yet")));
            }
        }
        let tys: Vec<&TensorTy> = inputs
            .iter()
            .map(|&i| self.nodes[i.index()].ty.as_ref().ok_or_else(|| Error::Invalid(format!("{i} is an extern call, not a tensor"))))
            .collect::<Result<_, _>>()
            .or_else(|e| if matches!(op, Op::ExternOut { .. }) { Ok(vec![]) } else { Err(e) })?;
        let ty = crate::infer::with_size_rules(&self.size_rules, || infer(&op, &tys))?;
        Ok(self.push(Node { op, inputs, ty }))
    }

    /// Adds a node with a given type (inputs, extern results), or no type (extern calls).
    pub fn add_typed(&mut self, op: Op, inputs: Vec<NodeId>, ty: Option<TensorTy>) -> NodeId {
        self.push(Node { op, inputs, ty })
    }

    fn push(&mut self, n: Node) -> NodeId {
        self.nodes.push(n);
        NodeId(self.nodes.len() as u32 - 1)
    }

    /// Users of every node, in node order.
    pub fn users(&self) -> Vec<Vec<NodeId>> {
        let mut u = vec![Vec::new(); self.nodes.len()];
        for id in self.ids() {
            for &i in &self.node(id).inputs {
                if !u[i.index()].contains(&id) {
                    u[i.index()].push(id);
                }
            }
        }
        u
    }

    /// Graph inputs in index order.
    pub fn inputs(&self) -> Vec<NodeId> {
        let mut v: Vec<(u32, NodeId)> = self
            .ids()
            .filter_map(|id| match self.node(id).op {
                Op::Input { index, .. } => Some((index, id)),
                _ => None,
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, id)| id).collect()
    }
}
