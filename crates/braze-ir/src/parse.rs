//! Reads the text form written by `print.rs`. Node ids must be numbered in order from %0.
//! Lines starting with `//` are comments. A `: type` on a node is checked against the
//! inferred type; it is required only on `input` and `extern_out`.

use crate::dtype::DType;
use crate::graph::{Graph, NodeId, TensorTy};
use crate::op::{BinaryOp, Lit, Op, ReduceKind, UnaryOp};
use crate::sym::{parse_expr, Expr};
use crate::Error;
use std::collections::BTreeMap;

fn err(line: usize, msg: impl Into<String>) -> Error {
    Error::Parse { line, msg: msg.into() }
}

/// Parses one graph.
pub fn parse_graph(text: &str) -> Result<Graph, Error> {
    let mut g: Option<Graph> = None;
    let mut done = false;
    for (ln, raw) in text.lines().enumerate() {
        let line_no = ln + 1;
        let line = raw.trim();
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        if done {
            return Err(err(line_no, "text after the end of the graph"));
        }
        let Some(graph) = g.as_mut() else {
            let name = line
                .strip_prefix("graph ")
                .and_then(|r| r.strip_suffix('{'))
                .ok_or_else(|| err(line_no, "expected `graph NAME {`"))?;
            g = Some(Graph::new(name.trim()));
            continue;
        };
        if line == "}" {
            done = true;
        } else if let Some(rest) = line.strip_prefix("return") {
            let refs = |part: &str| {
                part.split(',')
                    .map(|s| s.trim())
                    .filter(|s| !s.is_empty())
                    .map(|s| node_ref(s).ok_or_else(|| err(line_no, format!("bad output `{s}`"))))
                    .collect::<Result<Vec<_>, _>>()
            };
            let (fixed, free) = match rest.split_once('|') {
                Some((a, b)) => {
                    let b = b.trim().strip_prefix("free layout").ok_or_else(|| err(line_no, "expected `| free layout` after the outputs"))?;
                    (a, Some(b))
                }
                None => (rest, None),
            };
            graph.outputs = refs(fixed)?;
            if let Some(free) = free {
                graph.free_layout_from = Some(graph.outputs.len());
                graph.outputs.extend(refs(free)?);
            }
        } else {
            parse_node(graph, line).map_err(|m| err(line_no, m))?;
        }
    }
    let g = g.ok_or_else(|| err(0, "no graph"))?;
    if !done {
        return Err(err(text.lines().count(), "missing `}`"));
    }
    Ok(g)
}

fn node_ref(s: &str) -> Option<NodeId> {
    s.strip_prefix('%')?.parse().ok().map(NodeId)
}

fn parse_node(g: &mut Graph, line: &str) -> Result<(), String> {
    let mut c = Cursor { s: line.chars().collect(), i: 0 };
    let id = node_ref(&c.word()).ok_or("expected `%N =`")?;
    if id.index() != g.nodes.len() {
        return Err(format!("expected node %{} next, found {id}", g.nodes.len()));
    }
    c.ws();
    if !c.eat('=') {
        return Err("expected `=`".into());
    }
    let name = c.word();
    let (attrs, operands, ty) = c.rest()?;
    let op = build_op(&name, &attrs)?;
    let ty = ty.map(|t| parse_type(&t)).transpose()?;
    match op {
        Op::Input { .. } | Op::ExternOut { .. } | Op::BiasGrad => {
            let ty = ty.ok_or("input, extern_out and bias_grad need a `: type`")?;
            g.add_typed(op, operands, Some(ty));
        }
        Op::Extern { .. } => {
            g.add_typed(op, operands, None);
        }
        _ => {
            let id = g.add(op, operands).map_err(|e| e.to_string())?;
            if let (Some(t), Some(got)) = (ty, &g.node(id).ty) {
                if &t != got {
                    return Err(format!("written type {t} differs from inferred {got}"));
                }
            }
        }
    }
    Ok(())
}

/// Parses `f32[1024, s0]`.
pub fn parse_type(s: &str) -> Result<TensorTy, String> {
    let s = s.trim();
    let open = s.find('[').ok_or("type needs `[sizes]`")?;
    let dtype = DType::from_name(&s[..open]).ok_or_else(|| format!("unknown dtype `{}`", &s[..open]))?;
    Ok(TensorTy::new(dtype, parse_expr_list(&s[open..])?))
}

/// Parses `[a, b, ...]` of size expressions.
pub fn parse_expr_list(s: &str) -> Result<Vec<Expr>, String> {
    let inner = s.trim().strip_prefix('[').and_then(|r| r.strip_suffix(']')).ok_or_else(|| format!("expected a list, got `{s}`"))?;
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for ch in inner.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ => {}
        }
        if ch == ',' && depth == 0 {
            out.push(parse_expr(&cur)?);
            cur.clear();
        } else {
            cur.push(ch);
        }
    }
    if !cur.trim().is_empty() {
        out.push(parse_expr(&cur)?);
    }
    Ok(out)
}

struct Cursor {
    s: Vec<char>,
    i: usize,
}

type Parts = (Attrs, Vec<NodeId>, Option<String>);

impl Cursor {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_whitespace() {
            self.i += 1;
        }
    }
    fn eat(&mut self, ch: char) -> bool {
        if self.s.get(self.i) == Some(&ch) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    /// A run of non-space characters that stops at `=` and `,`.
    fn word(&mut self) -> String {
        self.ws();
        let st = self.i;
        while self.i < self.s.len() && !self.s[self.i].is_whitespace() && !"=,".contains(self.s[self.i]) {
            self.i += 1;
        }
        self.s[st..self.i].iter().collect()
    }
    fn value(&mut self) -> Result<String, String> {
        let st = self.i;
        match self.s.get(self.i) {
            Some('[') => {
                let mut depth = 0;
                while self.i < self.s.len() {
                    match self.s[self.i] {
                        '[' => depth += 1,
                        ']' => depth -= 1,
                        _ => {}
                    }
                    self.i += 1;
                    if depth == 0 {
                        break;
                    }
                }
                if depth != 0 {
                    return Err("unclosed `[`".into());
                }
            }
            Some('"') => {
                self.i += 1;
                while self.i < self.s.len() && self.s[self.i] != '"' {
                    self.i += 1;
                }
                if !self.eat('"') {
                    return Err("unclosed string".into());
                }
                return Ok(self.s[st + 1..self.i - 1].iter().collect());
            }
            _ => {
                while self.i < self.s.len() && !self.s[self.i].is_whitespace() {
                    self.i += 1;
                }
            }
        }
        Ok(self.s[st..self.i].iter().collect())
    }
    fn rest(&mut self) -> Result<Parts, String> {
        let mut attrs = BTreeMap::new();
        let mut operands = Vec::new();
        loop {
            self.ws();
            match self.s.get(self.i) {
                None => return Ok((attrs, operands, None)),
                Some(':') => {
                    self.i += 1;
                    let t: String = self.s[self.i..].iter().collect();
                    return Ok((attrs, operands, Some(t)));
                }
                Some('%') => {
                    let w = self.word();
                    operands.push(node_ref(&w).ok_or_else(|| format!("bad operand `{w}`"))?);
                    self.ws();
                    self.eat(',');
                }
                _ => {
                    let key = self.word();
                    if key.is_empty() || !self.eat('=') {
                        return Err(format!("expected `key=value`, found `{key}`"));
                    }
                    let v = self.value()?;
                    attrs.insert(key, Attr::Text(v));
                }
            }
        }
    }
}

pub fn parse_lit(s: &str) -> Result<Lit, String> {
    Ok(match s {
        "true" => Lit::B(true),
        "false" => Lit::B(false),
        "inf" => Lit::F(f64::INFINITY),
        "-inf" => Lit::F(f64::NEG_INFINITY),
        "nan" => Lit::F(f64::NAN),
        _ if s.contains(['.', 'e', 'E']) => Lit::F(s.parse().map_err(|_| format!("bad number `{s}`"))?),
        _ => Lit::I(s.parse().map_err(|_| format!("bad number `{s}`"))?),
    })
}

/// An op attribute as a builder hands it over: a typed value, or text in the IR's syntax (the
/// text parser's attributes; symbolic sizes).
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Text(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    /// Sizes, strides or dims: constants and symbolic expressions.
    Exprs(Vec<Expr>),
}

/// An op's attributes by name.
pub type Attrs = BTreeMap<String, Attr>;

impl Attr {
    fn int(&self) -> Option<i64> {
        match self {
            Attr::Int(v) => Some(*v),
            Attr::Text(s) => s.parse().ok(),
            _ => None,
        }
    }

    fn expr(&self) -> Result<Expr, String> {
        match self {
            Attr::Int(v) => Ok(Expr::constant(*v)),
            Attr::Text(s) => parse_expr(s),
            other => Err(format!("expected a size, got {other:?}")),
        }
    }

    fn exprs(&self) -> Result<Vec<Expr>, String> {
        match self {
            Attr::Exprs(v) => Ok(v.clone()),
            Attr::Text(s) => parse_expr_list(s),
            other => Err(format!("expected a list of sizes, got {other:?}")),
        }
    }

    fn boolean(&self) -> Option<bool> {
        match self {
            Attr::Bool(b) => Some(*b),
            Attr::Text(s) => s.parse().ok(),
            _ => None,
        }
    }

    fn lit(&self) -> Result<Lit, String> {
        match self {
            Attr::Int(v) => Ok(Lit::I(*v)),
            Attr::Float(v) => Ok(Lit::F(*v)),
            Attr::Bool(b) => Ok(Lit::B(*b)),
            Attr::Text(s) => parse_lit(s),
            Attr::Exprs(_) => Err("expected a number".into()),
        }
    }
}

/// The op `name` with attributes `a`, as the text parser and the typed builder both make it.
pub fn build_op(name: &str, a: &Attrs) -> Result<Op, String> {
    let get = |k: &str| a.get(k).ok_or_else(|| format!("{name} needs `{k}=`"));
    let text = |k: &str| -> Result<&str, String> {
        match get(k)? {
            Attr::Text(s) => Ok(s.as_str()),
            other => Err(format!("`{k}` must be a name, got {other:?}")),
        }
    };
    let int = |k: &str| -> Result<i64, String> { get(k)?.int().ok_or_else(|| format!("`{k}` must be an integer")) };
    let usz = |k: &str| -> Result<usize, String> { get(k)?.int().filter(|v| *v >= 0).map(|v| v as usize).ok_or_else(|| format!("`{k}` must be a dim")) };
    let expr = |k: &str| -> Result<Expr, String> { get(k)?.expr() };
    let exprs = |k: &str| -> Result<Vec<Expr>, String> { get(k)?.exprs() };
    let dims = |k: &str| -> Result<Vec<usize>, String> {
        exprs(k)?.iter().map(|e| e.as_const().filter(|v| *v >= 0).map(|v| v as usize).ok_or(format!("`{k}` must list dims"))).collect()
    };
    let dtype = |k: &str| -> Result<DType, String> { DType::from_name(text(k)?).ok_or_else(|| format!("unknown dtype in `{k}`")) };
    let boolean = |k: &str| -> Result<bool, String> { get(k)?.boolean().ok_or_else(|| format!("`{k}` must be true or false")) };
    let op = match name {
        "input" => Op::Input { index: int("index")? as u32, strides: exprs("strides")? },
        "scalar" => Op::Scalar { value: get("value")?.lit()?, dtype: dtype("dtype")? },
        "size" => Op::Size { value: expr("value")?, dtype: dtype("dtype")? },
        "iota" => Op::Iota { len: expr("len")?, start: int("start")?, step: int("step")?, dtype: dtype("dtype")? },
        "rand" => Op::Random {
            dist: crate::op::RandomDist::from_name(text("dist")?).ok_or("unknown distribution")?,
            shape: exprs("shape")?,
            stream: int("stream")?,
            dtype: dtype("dtype")?,
        },
        "where" => Op::Where,
        "cast" => Op::Cast(dtype("dtype")?),
        "permute" => Op::Permute(dims("dims")?),
        "expand" => Op::Expand(exprs("shape")?),
        "reshape" => Op::Reshape(exprs("shape")?),
        "slice" => Op::Slice { dim: usz("dim")?, start: expr("start")?, len: expr("len")?, step: int("step")? },
        "select" => Op::Select { dim: usz("dim")?, index: expr("index")? },
        "index_select" => Op::IndexSelect { dim: usz("dim")? },
        "gather" => Op::Gather { dim: usz("dim")? },
        "cat" => Op::Cat { dim: usz("dim")? },
        "pad" => {
            let flat = dims("pads")?;
            if flat.len() % 2 != 0 {
                return Err("pads needs (before, after) pairs".into());
            }
            let pads = flat.chunks(2).map(|c| (c[0] as i64, c[1] as i64)).collect();
            Op::Pad { pads, value: get("value")?.lit()? }
        }
        "matmul" => Op::Matmul {
            epilogue: crate::op::Epilogue::from_name(text("epilogue")?).ok_or("unknown epilogue")?,
            tf32: boolean("tf32")?,
            residual: if a.contains_key("residual") { boolean("residual")? } else { false },
        },
        "conv" => {
            let ints = |k: &str| -> Result<Vec<i64>, String> { Ok(dims(k)?.into_iter().map(|d| d as i64).collect()) };
            let dir = if a.contains_key("dir") { crate::op::ConvDir::from_name(text("dir")?).ok_or("unknown conv dir")? } else { crate::op::ConvDir::Forward };
            let spatial = if a.contains_key("spatial") { ints("spatial")? } else { Vec::new() };
            Op::Conv { dir, stride: ints("stride")?, padding: ints("padding")?, dilation: ints("dilation")?, groups: int("groups")?, spatial, tf32: boolean("tf32")?, strides: exprs("strides")? }
        }
        "extern" => Op::Extern {
            target: text("target")?.to_string(),
            outputs: int("outputs")? as u32,
            effect: if a.contains_key("effect") { boolean("effect")? } else { false },
        },
        "extern_out" => Op::ExternOut { index: int("index")? as u32, strides: exprs("strides")? },
        "layout" => Op::Layout { strides: exprs("strides")? },
        "bias_grad" => Op::BiasGrad,
        _ => {
            if let Some(u) = UnaryOp::from_name(name) {
                Op::Unary(u)
            } else if let Some(b) = BinaryOp::from_name(name) {
                Op::Binary(b)
            } else if let Some(kind) = ReduceKind::from_name(name) {
                let correction = if kind == ReduceKind::Var { int("correction")? } else { 0 };
                Op::Reduce { kind, dims: dims("dims")?, keepdim: boolean("keepdim")?, correction }
            } else {
                return Err(format!("unknown op `{name}`"));
            }
        }
    };
    Ok(op)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_op(text: &str) -> Op {
        let mut c = Cursor { s: text.chars().collect(), i: 0 };
        let name = c.word();
        let (attrs, _, _) = c.rest().unwrap();
        build_op(&name, &attrs).unwrap()
    }

    fn typed(name: &str, attrs: Vec<(&str, Attr)>) -> Op {
        build_op(name, &attrs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()).unwrap()
    }

    #[test]
    fn typed_attributes_make_the_ops_their_text_makes() {
        let c = |v: &[i64]| Attr::Exprs(v.iter().map(|&x| Expr::constant(x)).collect());
        let cases: Vec<(&str, Op)> = vec![
            ("sum dims=[0, 2] keepdim=false", typed("sum", vec![("dims", c(&[0, 2])), ("keepdim", Attr::Bool(false))])),
            ("var dims=[1] keepdim=true correction=1", typed("var", vec![("dims", c(&[1])), ("keepdim", Attr::Bool(true)), ("correction", Attr::Int(1))])),
            ("scalar value=0.5 dtype=f32", typed("scalar", vec![("value", Attr::Float(0.5)), ("dtype", Attr::Text("f32".into()))])),
            ("scalar value=-inf dtype=bf16", typed("scalar", vec![("value", Attr::Float(f64::NEG_INFINITY)), ("dtype", Attr::Text("bf16".into()))])),
            ("scalar value=3 dtype=i64", typed("scalar", vec![("value", Attr::Int(3)), ("dtype", Attr::Text("i64".into()))])),
            ("scalar value=true dtype=bool", typed("scalar", vec![("value", Attr::Bool(true)), ("dtype", Attr::Text("bool".into()))])),
            (
                "reshape shape=[s0*4, 3]",
                typed("reshape", vec![("shape", Attr::Exprs(vec![parse_expr("s0*4").unwrap(), Expr::constant(3)]))]),
            ),
            (
                "slice dim=1 start=s1 len=8 step=2",
                typed("slice", vec![("dim", Attr::Int(1)), ("start", Attr::Text("s1".into())), ("len", Attr::Int(8)), ("step", Attr::Int(2))]),
            ),
            ("pad pads=[0, 1, 2, 0] value=0.0", typed("pad", vec![("pads", c(&[0, 1, 2, 0])), ("value", Attr::Float(0.0))])),
            ("matmul epilogue=gelu tf32=true", typed("matmul", vec![("epilogue", Attr::Text("gelu".into())), ("tf32", Attr::Bool(true))])),
            (
                "conv dir=filter spatial=[3, 3] stride=[1, 1] padding=[1, 1] dilation=[1, 1] groups=1 tf32=false strides=[576, 1, 192, 64]",
                typed(
                    "conv",
                    vec![
                        ("dir", Attr::Text("filter".into())),
                        ("spatial", c(&[3, 3])),
                        ("stride", c(&[1, 1])),
                        ("padding", c(&[1, 1])),
                        ("dilation", c(&[1, 1])),
                        ("groups", Attr::Int(1)),
                        ("tf32", Attr::Bool(false)),
                        ("strides", c(&[576, 1, 192, 64])),
                    ],
                ),
            ),
            ("iota len=s0 start=0 step=1 dtype=i64", typed("iota", vec![("len", Attr::Text("s0".into())), ("start", Attr::Int(0)), ("step", Attr::Int(1)), ("dtype", Attr::Text("i64".into()))])),
        ];
        for (text, op) in cases {
            assert_eq!(text_op(text), op, "{text}");
        }
    }

    #[test]
    fn wrong_attribute_types_are_errors() {
        assert!(build_op("sum", &[("dims".to_string(), Attr::Bool(true)), ("keepdim".to_string(), Attr::Bool(true))].into_iter().collect()).is_err());
        assert!(build_op("cast", &[("dtype".to_string(), Attr::Int(3))].into_iter().collect()).is_err());
        assert!(build_op("slice", &[("dim".to_string(), Attr::Int(-1))].into_iter().collect()).is_err());
    }
}
