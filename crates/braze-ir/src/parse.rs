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

/// Parses `op attrs operands` (no result, no type), as the Python builder sends ops.
pub fn parse_op(text: &str) -> Result<(Op, Vec<NodeId>), String> {
    let mut c = Cursor { s: text.chars().collect(), i: 0 };
    let name = c.word();
    let (attrs, operands, ty) = c.rest()?;
    if ty.is_some() {
        return Err("unexpected type".into());
    }
    Ok((build_op(&name, &attrs)?, operands))
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
        Op::Input { .. } | Op::ExternOut { .. } => {
            let ty = ty.ok_or("input and extern_out need a `: type`")?;
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

type Parts = (BTreeMap<String, String>, Vec<NodeId>, Option<String>);

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
                    attrs.insert(key, v);
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

fn build_op(name: &str, a: &BTreeMap<String, String>) -> Result<Op, String> {
    let get = |k: &str| a.get(k).map(|s| s.as_str()).ok_or_else(|| format!("{name} needs `{k}=`"));
    let int = |k: &str| -> Result<i64, String> { get(k)?.parse().map_err(|_| format!("`{k}` must be an integer")) };
    let usz = |k: &str| -> Result<usize, String> { get(k)?.parse().map_err(|_| format!("`{k}` must be a dim")) };
    let expr = |k: &str| -> Result<Expr, String> { parse_expr(get(k)?) };
    let exprs = |k: &str| -> Result<Vec<Expr>, String> { parse_expr_list(get(k)?) };
    let dims = |k: &str| -> Result<Vec<usize>, String> {
        exprs(k)?.iter().map(|e| e.as_const().filter(|v| *v >= 0).map(|v| v as usize).ok_or(format!("`{k}` must list dims"))).collect()
    };
    let dtype = |k: &str| -> Result<DType, String> { DType::from_name(get(k)?).ok_or_else(|| format!("unknown dtype in `{k}`")) };
    let boolean = |k: &str| -> Result<bool, String> { get(k)?.parse().map_err(|_| format!("`{k}` must be true or false")) };
    let op = match name {
        "input" => Op::Input { index: int("index")? as u32, strides: exprs("strides")? },
        "scalar" => Op::Scalar { value: parse_lit(get("value")?)?, dtype: dtype("dtype")? },
        "size" => Op::Size { value: expr("value")?, dtype: dtype("dtype")? },
        "iota" => Op::Iota { len: expr("len")?, start: int("start")?, step: int("step")?, dtype: dtype("dtype")? },
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
            Op::Pad { pads, value: parse_lit(get("value")?)? }
        }
        "matmul" => Op::Matmul {
            epilogue: crate::op::Epilogue::from_name(get("epilogue")?).ok_or("unknown epilogue")?,
            tf32: boolean("tf32")?,
            residual: if a.contains_key("residual") { boolean("residual")? } else { false },
        },
        "conv" => {
            let ints = |k: &str| -> Result<Vec<i64>, String> { Ok(dims(k)?.into_iter().map(|d| d as i64).collect()) };
            let dir = if a.contains_key("dir") { crate::op::ConvDir::from_name(get("dir")?).ok_or("unknown conv dir")? } else { crate::op::ConvDir::Forward };
            let spatial = if a.contains_key("spatial") { ints("spatial")? } else { Vec::new() };
            Op::Conv { dir, stride: ints("stride")?, padding: ints("padding")?, dilation: ints("dilation")?, groups: int("groups")?, spatial, tf32: boolean("tf32")?, strides: exprs("strides")? }
        }
        "extern" => Op::Extern {
            target: get("target")?.to_string(),
            outputs: int("outputs")? as u32,
            effect: if a.contains_key("effect") { boolean("effect")? } else { false },
        },
        "extern_out" => Op::ExternOut { index: int("index")? as u32, strides: exprs("strides")? },
        "layout" => Op::Layout { strides: exprs("strides")? },
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
