//! [Note: patched inputs] A whole-graph CUDA graph (`reduce-overhead`, python/braze/cudagraphs.py)
//! was captured reading each graph input that is neither a parameter nor another graph's
//! output from a buffer of its own, into which every replay copied the call's input: a
//! device-to-device copy of the whole input per call (MobileNet-v3-small's b32 input: 13.4 µs
//! of GPU time, ~2% of its replay; several µs of host time for the copy's launch). When only
//! braze's own kernels read that buffer (the graph's kernels, or the relayout that lays the
//! input out for them), the instantiated graph can read the call's input where it is instead:
//! those kernel nodes' parameters are plain values braze chose (device pointers and sizes),
//! so the pointer words inside the buffer are found once, after the capture, and rewritten
//! per call through `cuGraphExecKernelNodeSetParams` — only when the input's address
//! changed, which a training loop feeding one tensor never does.
//!
//! `find` walks every node of the captured graph. A kernel node whose parameters hold an
//! address inside the buffer is a site if its function is braze's; any other kernel (a
//! library's: cuDNN, cuBLASLt, ATen), copy or memset that holds one, or a node whose
//! parameters cannot be read, means the buffer cannot be bypassed, and the caller keeps the
//! copy. (The caller also checks the plan: no extern call or library item reads the input,
//! since a library could reach it through memory rather than a parameter.)

use super::{check, driver, ensure_current, is_braze_function, CuContext, CuFunction, CuGraph, CuGraphExec, CuResult};
use crate::RuntimeError;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

type CuGraphNode = *mut c_void;

/// `CUDA_KERNEL_NODE_PARAMS_v2`.
#[repr(C)]
#[derive(Clone, Copy)]
struct KernelNodeParams {
    func: CuFunction,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_bytes: c_uint,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    kern: *mut c_void,
    ctx: CuContext,
}

/// `CUgraphNodeType` values this module tells apart.
const NODE_KERNEL: c_int = 0;
const NODE_MEMCPY: c_int = 1;
const NODE_MEMSET: c_int = 2;
const NODE_GRAPH: c_int = 4;
const NODE_CONDITIONAL: c_int = 13;

/// The graph entry points, resolved on first use (`cuFuncGetParamInfo` needs a CUDA 12.4
/// driver; without them inputs are copied as before).
struct Api {
    get_nodes: unsafe extern "C" fn(CuGraph, *mut CuGraphNode, *mut usize) -> CuResult,
    node_type: unsafe extern "C" fn(CuGraphNode, *mut c_int) -> CuResult,
    kernel_params: unsafe extern "C" fn(CuGraphNode, *mut KernelNodeParams) -> CuResult,
    memcpy_params: unsafe extern "C" fn(CuGraphNode, *mut u64) -> CuResult,
    memset_params: unsafe extern "C" fn(CuGraphNode, *mut u64) -> CuResult,
    param_info: unsafe extern "C" fn(CuFunction, usize, *mut usize, *mut usize) -> CuResult,
    exec_set: unsafe extern "C" fn(CuGraphExec, CuGraphNode, *const KernelNodeParams) -> CuResult,
}

// SAFETY: function pointers into the driver, callable from any thread.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

fn api() -> Result<&'static Api, RuntimeError> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    let d = driver()?;
    API.get_or_init(|| {
        let lib = &d._lib;
        Ok(Api {
            get_nodes: sym!(lib, b"cuGraphGetNodes"),
            node_type: sym!(lib, b"cuGraphNodeGetType"),
            kernel_params: sym!(lib, b"cuGraphKernelNodeGetParams_v2"),
            memcpy_params: sym!(lib, b"cuGraphMemcpyNodeGetParams"),
            memset_params: sym!(lib, b"cuGraphMemsetNodeGetParams"),
            param_info: sym!(lib, b"cuFuncGetParamInfo"),
            exec_set: sym!(lib, b"cuGraphExecKernelNodeSetParams_v2"),
        })
    })
    .as_ref()
    .map_err(|e| RuntimeError::Environment(e.clone()))
}

/// One kernel node reading the input: its parameters as captured (values copied out, laid
/// out at the offsets the function declares) and the 8-byte words holding addresses in the
/// input, with their offsets from its start.
struct Site {
    node: CuGraphNode,
    base: KernelNodeParams,
    words: Vec<u64>,
    offsets: Vec<usize>,
    patches: Vec<(usize, u64)>,
}

/// The kernel nodes of one instantiated graph that read one input, and the address they
/// read it at now.
pub struct InputSites {
    exec: CuGraphExec,
    ctx: CuContext,
    sites: Vec<Site>,
    current: u64,
}

// SAFETY: driver handles, used under the caller's lock with the context made current.
unsafe impl Send for InputSites {}

/// Words of `words` (8-byte aligned, whole) in `[lo, hi)`: (word index, offset from lo).
fn hits(words: &[u64], lo: u64, hi: u64) -> Vec<(usize, u64)> {
    words.iter().enumerate().filter(|(_, &w)| w >= lo && w < hi).map(|(i, &w)| (i, w - lo)).collect()
}

/// A kernel node's parameters as (words, byte offset of each parameter), or why not.
///
/// # Safety
/// `p` as `cuGraphKernelNodeGetParams` filled it.
unsafe fn read_params(a: &Api, p: &KernelNodeParams) -> Result<(Vec<u64>, Vec<usize>), String> {
    if p.func.is_null() {
        return Err("a kernel node without a function".into());
    }
    let mut layout = Vec::new();
    for i in 0.. {
        let (mut off, mut size) = (0usize, 0usize);
        // SAFETY: a query of a loaded function; an index past the last parameter fails.
        if unsafe { (a.param_info)(p.func, i, &mut off, &mut size) } != 0 {
            break;
        }
        layout.push((off, size));
    }
    if layout.is_empty() {
        return Ok((Vec::new(), Vec::new())); // no parameters: it cannot be handed the input
    }
    if p.params.is_null() || !p.extra.is_null() {
        return Err("a kernel node with packed parameters".into());
    }
    let end = layout.iter().map(|&(o, s)| o + s).max().unwrap_or(0);
    let mut words = vec![0u64; end.div_ceil(8)];
    let bytes = words.as_mut_ptr() as *mut u8;
    for (i, &(off, size)) in layout.iter().enumerate() {
        // SAFETY: the node owns `params[i]`, a value of `size` bytes; `words` holds `end` bytes.
        unsafe { std::ptr::copy_nonoverlapping(*p.params.add(i) as *const u8, bytes.add(off), size) };
    }
    Ok((words, layout.into_iter().map(|(o, _)| o).collect()))
}

/// The kernel nodes of `graph` (instantiated as `exec`) that read `[lo, lo + bytes)`, or why
/// they cannot be patched (a node other than braze's kernels reads it, or none does).
pub fn find(graph: usize, exec: usize, lo: u64, bytes: u64) -> Result<Result<InputSites, String>, RuntimeError> {
    let a = match api() {
        Ok(a) => a,
        Err(e) => return Ok(Err(format!("the driver lacks the graph calls ({e})"))),
    };
    let d = driver()?;
    let hi = lo + bytes;
    let graph = graph as CuGraph;
    let mut n = 0usize;
    let mut ctx: CuContext = std::ptr::null_mut();
    // SAFETY: queries of a live graph the caller captured; out-pointers to locals.
    unsafe {
        check(d, (a.get_nodes)(graph, std::ptr::null_mut(), &mut n), "cuGraphGetNodes")?;
        let mut nodes: Vec<CuGraphNode> = vec![std::ptr::null_mut(); n];
        check(d, (a.get_nodes)(graph, nodes.as_mut_ptr(), &mut n), "cuGraphGetNodes")?;
        let mut sites = Vec::new();
        for &node in &nodes[..n] {
            let mut ty: c_int = -1;
            check(d, (a.node_type)(node, &mut ty), "cuGraphNodeGetType")?;
            match ty {
                NODE_KERNEL => {
                    let mut p: KernelNodeParams = std::mem::zeroed();
                    check(d, (a.kernel_params)(node, &mut p), "cuGraphKernelNodeGetParams")?;
                    let ours = is_braze_function(p.func);
                    let (words, offsets) = match read_params(a, &p) {
                        Ok(x) => x,
                        Err(why) => return Ok(Err(why)),
                    };
                    let patches = hits(&words, lo, hi);
                    if patches.is_empty() {
                        continue;
                    }
                    if !ours {
                        return Ok(Err("a library kernel reads it".into()));
                    }
                    ctx = p.ctx;
                    sites.push(Site { node, base: p, words, offsets, patches });
                }
                NODE_MEMCPY | NODE_MEMSET => {
                    // `CUDA_MEMCPY3D` (25 words) or `CUDA_MEMSET_NODE_PARAMS` (5): any word
                    // inside the input counts as reading it.
                    let mut w = [0u64; 32];
                    let f = if ty == NODE_MEMCPY { a.memcpy_params } else { a.memset_params };
                    check(d, f(node, w.as_mut_ptr()), "cuGraphMemcpyNodeGetParams")?;
                    if !hits(&w, lo, hi).is_empty() {
                        return Ok(Err("a copy or memset node touches it".into()));
                    }
                }
                NODE_GRAPH | NODE_CONDITIONAL => return Ok(Err("the graph has child graphs".into())),
                _ => {}
            }
        }
        if sites.is_empty() {
            return Ok(Err("no kernel reads it".into()));
        }
        Ok(Ok(InputSites { exec: exec as CuGraphExec, ctx, sites, current: lo }))
    }
}

impl InputSites {
    /// Makes every site read the input at `addr` from the next launch on (nothing to do when
    /// it already does).
    pub fn point_at(&mut self, addr: u64) -> Result<(), RuntimeError> {
        if addr == self.current {
            return Ok(());
        }
        let (a, d) = (api()?, driver()?);
        // SAFETY: each site's parameter values are rewritten in its own copy and handed to
        // the driver, which copies them; the exec graph and its nodes outlive this object
        // (the caller drops it with the graph).
        unsafe {
            if !self.ctx.is_null() {
                ensure_current(d, self.ctx)?;
            }
            for s in &mut self.sites {
                for &(w, delta) in &s.patches {
                    s.words[w] = addr + delta;
                }
                let bytes = s.words.as_mut_ptr() as *mut u8;
                let mut ptrs: Vec<*mut c_void> = s.offsets.iter().map(|&o| bytes.add(o) as *mut c_void).collect();
                let mut p = s.base;
                p.params = ptrs.as_mut_ptr();
                p.extra = std::ptr::null_mut();
                check(d, (a.exec_set)(self.exec, s.node, &p), "cuGraphExecKernelNodeSetParams")?;
            }
        }
        self.current = addr;
        Ok(())
    }

    /// How many kernel nodes read the input.
    pub fn len(&self) -> usize {
        self.sites.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sites.is_empty()
    }
}
