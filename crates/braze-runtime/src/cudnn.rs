//! 2-d convolutions through cuDNN's graph (backend) API, loaded at run time from the path the
//! caller gives (the copy PyTorch's NVIDIA wheels ship, which the process already holds). The
//! operation graph, the engine and its execution plan are made once per convolution when the
//! module loads; a call binds the buffers in a variant pack and executes the plan on
//! PyTorch's stream, inside a run of kernels and matmuls (so a run's CUDA-graph replay,
//! [Note: replay], covers it too).
//!
//! [Note: library convolutions] An ATen convolution called from the plan costs ~30 µs of host
//! time (dispatch, argument checks, cuDNN's plan cache lookup, output and workspace
//! allocation); ResNet-50 inference makes 53 of them per call and was bound by its host
//! side. Here the output is a buffer of the plan (in the arena), the workspace is the one
//! the matmuls use (runs are serial on one stream), and the engine is chosen at compile time:
//! the first of cuDNN's heuristic configurations (mode INSTANT, as PyTorch's) that builds,
//! or the fastest of the first few timed on the device when tuning is on (as for matmuls);
//! cuDNN's fallback engines where none is usable. A graph of convolutions and braze kernels
//! is then one run: MobileNet-v3-small fp32 b32 inference on the H100 took 2.29 ms per call
//! against 4.6 in eager and Inductor (host 0.46 ms), its training step 10.5 ms against 18.3
//! and 21.8 (first measured through the legacy API). Plans are built in the heuristic's
//! order only until enough are built (one, or the few timed when tuning), precompiled
//! engines first: an engine compiled at run time builds its kernels with NVRTC when its plan
//! is built, and allowing them first changed no convolution's time on the H100 (ResNet-50's
//! bf16 convolutions, MobileNet-v3 and ResNet-18 training) but cost MobileNet-v3-small's
//! training step 7.8 s of first call. They are used where no precompiled engine builds.
//! Measured per convolution, ResNet-50's engines are ATen's but for its 7x7 stem over 3
//! channels, where the heuristic's first engine is a generic one (0.77 ms at b64 bf16
//! against 0.44): the lowering pads such 16-bit inputs to 8 channels (`_padded_channels`
//! in lowering.py), which takes a tensor-core engine (0.46 ms).
//!
//! [Note: depthwise engines] Depthwise convolutions (one input channel per group) take the
//! heuristic's order as it is, engines compiled at run time among them, as ATen does (it
//! filters no engine for run-time compilation). Their best precompiled engine is a generic
//! grouped one: in a profile of MobileNet-v3-small fp32 b32 inference on an H200, braze's 11
//! depthwise convolutions took 0.853 ms of GPU time (`conv2d_grouped_direct_kernel`) and
//! Inductor's, through ATen, 0.108 ms (the heuristic's first engine, `conv2d_c1_k1_nhwc`,
//! compiled at run time): most of the step's 1.40 against 0.64 ms.

use crate::choices::Choices;
use crate::RuntimeError;
use braze_ir::{ConvDir, DType};
use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Mutex, OnceLock};

type Status = c_int;
type Handle = *mut c_void;
type Desc = *mut c_void;

struct Dnn {
    _lib: Library,
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    version: unsafe extern "C" fn() -> usize,
    set_stream: unsafe extern "C" fn(Handle, *mut c_void) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    create_desc: unsafe extern "C" fn(c_int, *mut Desc) -> Status,
    destroy_desc: unsafe extern "C" fn(Desc) -> Status,
    finalize: unsafe extern "C" fn(Desc) -> Status,
    set_attr: unsafe extern "C" fn(Desc, c_int, c_int, i64, *const c_void) -> Status,
    get_attr: unsafe extern "C" fn(Desc, c_int, c_int, i64, *mut i64, *mut c_void) -> Status,
    execute: unsafe extern "C" fn(Handle, Desc, Desc) -> Status,
}

// cudnn_graph.h values (all since cuDNN 9.0).
const DATA_FLOAT: i32 = 0;
const DATA_HALF: i32 = 2;
const DATA_BFLOAT16: i32 = 9;
const CROSS_CORRELATION: i32 = 1;
const HEUR_MODE_INSTANT: i32 = 0;
const HEUR_MODE_FALLBACK: i32 = 2;
// Descriptor types.
const D_CONVOLUTION: c_int = 1;
const D_ENGINE: c_int = 2;
const D_ENGINECFG: c_int = 3;
const D_ENGINEHEUR: c_int = 4;
const D_EXECUTION_PLAN: c_int = 5;
const D_OP_CONV_FORWARD: c_int = 10;
const D_OP_CONV_BWD_FILTER: c_int = 11;
const D_OP_CONV_BWD_DATA: c_int = 12;
const D_OPERATIONGRAPH: c_int = 15;
const D_VARIANT_PACK: c_int = 16;
const D_TENSOR: c_int = 17;
// Attribute types.
const T_HANDLE: c_int = 0;
const T_DATA_TYPE: c_int = 1;
const T_INT64: c_int = 3;
const T_FLOAT: c_int = 4;
const T_VOID_PTR: c_int = 6;
const T_CONVOLUTION_MODE: c_int = 7;
const T_HEUR_MODE: c_int = 8;
const T_NUMERICAL_NOTE: c_int = 11;
const T_BACKEND_DESCRIPTOR: c_int = 15;
const T_BEHAVIOR_NOTE: c_int = 19;
// Attribute names.
const A_CONV_COMP_TYPE: c_int = 100;
const A_CONV_MODE: c_int = 101;
const A_CONV_DILATIONS: c_int = 102;
const A_CONV_FILTER_STRIDES: c_int = 103;
const A_CONV_POST_PADDINGS: c_int = 104;
const A_CONV_PRE_PADDINGS: c_int = 105;
const A_CONV_SPATIAL_DIMS: c_int = 106;
const A_HEUR_MODE: c_int = 200;
const A_HEUR_OPERATION_GRAPH: c_int = 201;
const A_HEUR_RESULTS: c_int = 202;
const A_CFG_ENGINE: c_int = 300;
const A_PLAN_HANDLE: c_int = 400;
const A_PLAN_ENGINE_CONFIG: c_int = 401;
const A_PLAN_WORKSPACE_SIZE: c_int = 402;
const A_FWD_ALPHA: c_int = 700;
const A_FWD_BETA: c_int = 701;
const A_FWD_CONV_DESC: c_int = 702;
const A_FWD_W: c_int = 703;
const A_FWD_X: c_int = 704;
const A_FWD_Y: c_int = 705;
const A_BWD_DATA_ALPHA: c_int = 706;
const A_BWD_DATA_BETA: c_int = 707;
const A_BWD_DATA_CONV_DESC: c_int = 708;
const A_BWD_DATA_W: c_int = 709;
const A_BWD_DATA_DX: c_int = 710;
const A_BWD_DATA_DY: c_int = 711;
const A_BWD_FILTER_ALPHA: c_int = 712;
const A_BWD_FILTER_BETA: c_int = 713;
const A_BWD_FILTER_CONV_DESC: c_int = 714;
const A_BWD_FILTER_DW: c_int = 715;
const A_BWD_FILTER_X: c_int = 716;
const A_BWD_FILTER_DY: c_int = 717;
const A_GRAPH_HANDLE: c_int = 800;
const A_GRAPH_OPS: c_int = 801;
const A_TENSOR_BYTE_ALIGNMENT: c_int = 900;
const A_TENSOR_DATA_TYPE: c_int = 901;
const A_TENSOR_DIMENSIONS: c_int = 902;
const A_TENSOR_STRIDES: c_int = 903;
const A_TENSOR_UNIQUE_ID: c_int = 906;
const A_PACK_UNIQUE_IDS: c_int = 1000;
const A_PACK_DATA_POINTERS: c_int = 1001;
const A_PACK_WORKSPACE: c_int = 1003;
const A_ENGINE_GLOBAL_INDEX: c_int = 1301;
const A_ENGINE_NUMERICAL_NOTE: c_int = 1303;
const A_ENGINE_BEHAVIOR_NOTE: c_int = 1305;
// Notes.
const NOTE_TENSOR_CORE: i32 = 0;
const NOTE_DOWN_CONVERT_INPUTS: i32 = 1;
const BEHAVIOR_RUNTIME_COMPILATION: i32 = 0;

/// Heuristic configurations asked for; how many plans are built (and timed) when tuning:
/// building one may compile its kernels (engines compiled at run time, with NVRTC), so only as
/// many are built as are used.
const HEUR_CONFIGS: usize = 8;
const TUNE_PLANS: usize = 4;
/// Operand ids in the graph and the variant pack.
const UID_X: i64 = 1;
const UID_W: i64 = 2;
const UID_Y: i64 = 3;

static DNN: OnceLock<Result<Dnn, String>> = OnceLock::new();
/// The handle and the device it belongs to.
static HANDLE: OnceLock<Result<(usize, i32), String>> = OnceLock::new();

/// Loads cuDNN from `path`.
pub fn init(path: &str) -> Result<(), RuntimeError> {
    let r = DNN.get_or_init(|| {
        let lib = crate::open_library(path)?;
        Ok(Dnn {
            create: sym!(lib, b"cudnnCreate"),
            version: sym!(lib, b"cudnnGetVersion"),
            set_stream: sym!(lib, b"cudnnSetStream"),
            error_string: sym!(lib, b"cudnnGetErrorString"),
            create_desc: sym!(lib, b"cudnnBackendCreateDescriptor"),
            destroy_desc: sym!(lib, b"cudnnBackendDestroyDescriptor"),
            finalize: sym!(lib, b"cudnnBackendFinalize"),
            set_attr: sym!(lib, b"cudnnBackendSetAttribute"),
            get_attr: sym!(lib, b"cudnnBackendGetAttribute"),
            execute: sym!(lib, b"cudnnBackendExecute"),
            _lib: lib,
        })
    });
    r.as_ref().map(|_| ()).map_err(|e| RuntimeError::Environment(e.clone()))
}

fn dnn() -> Result<&'static Dnn, RuntimeError> {
    crate::loaded(&DNN, "cuDNN")
}

/// The process's cuDNN handle, with the lock that a call holds from setting its stream until
/// the call is issued. A cuDNN handle belongs to the device it was made on: the handle is
/// made by the first convolution prepared (`handle_on`), in that device's primary context
/// (PyTorch's), and convolutions prepared for another device are refused (they run through
/// ATen): one device per process, as under DDP and FSDP.
fn handle() -> Result<(Handle, &'static Mutex<()>), RuntimeError> {
    static CALL: Mutex<()> = Mutex::new(());
    match HANDLE.get() {
        Some(Ok((h, _))) => Ok((*h as Handle, &CALL)),
        Some(Err(e)) => Err(RuntimeError::Environment(e.clone())),
        None => Err(RuntimeError::Environment("no cuDNN handle yet".into())),
    }
}

/// The handle for convolutions on device `ordinal` (made there on first use).
fn handle_on(ordinal: i32) -> Result<Handle, RuntimeError> {
    let l = dnn()?;
    let made = HANDLE.get_or_init(|| {
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: creates a library handle in the device's primary context.
        let st = crate::cuda::on_device(ordinal, || unsafe { (l.create)(&mut h) }).map_err(|e| e.to_string())?;
        if st != 0 { Err(format!("cudnnCreate failed ({})", message(l, st))) } else { Ok((h as usize, ordinal)) }
    });
    match made {
        Ok((h, dev)) if *dev == ordinal => Ok(*h as Handle),
        Ok((_, dev)) => Err(RuntimeError::Environment(format!("cuDNN's handle is on device {dev}, not {ordinal}"))),
        Err(e) => Err(RuntimeError::Environment(e.clone())),
    }
}

fn message(l: &Dnn, st: Status) -> String {
    // SAFETY: cuDNN returns a static NUL-terminated string for any status.
    let p = unsafe { (l.error_string)(st) };
    if p.is_null() { format!("status {st}") } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() }
}

fn ok(st: Status, what: &str) -> Result<(), RuntimeError> {
    if st == 0 {
        return Ok(());
    }
    let m = dnn().map(|l| message(l, st)).unwrap_or_else(|_| format!("status {st}"));
    Err(RuntimeError::Launch(format!("cuDNN {what} failed: {m}")))
}

/// A backend descriptor, destroyed when dropped.
struct Descriptor(Desc);

impl Descriptor {
    fn new(kind: c_int) -> Result<Descriptor, RuntimeError> {
        let l = dnn()?;
        let mut d: Desc = std::ptr::null_mut();
        // SAFETY: creates a descriptor of a documented type.
        ok(unsafe { (l.create_desc)(kind, &mut d) }, "descriptor creation")?;
        Ok(Descriptor(d))
    }

    /// Sets attribute `name` to `vals`, of cuDNN attribute type `ty`.
    fn set<T>(&self, name: c_int, ty: c_int, vals: &[T]) -> Result<(), RuntimeError> {
        let l = dnn()?;
        // SAFETY: `vals` holds `vals.len()` elements of the type `ty` names.
        ok(unsafe { (l.set_attr)(self.0, name, ty, vals.len() as i64, vals.as_ptr() as *const c_void) }, &format!("attribute {name}"))
    }

    fn finalize(&self, what: &str) -> Result<(), RuntimeError> {
        let l = dnn()?;
        // SAFETY: finalizes a descriptor whose required attributes are set.
        ok(unsafe { (l.finalize)(self.0) }, what)
    }

    /// Up to `n` 4-byte enum values of attribute `name` (of type `ty`).
    fn get_enums(&self, name: c_int, ty: c_int, n: usize) -> Result<Vec<i32>, RuntimeError> {
        let l = dnn()?;
        let mut out = vec![0i32; n];
        let mut count: i64 = 0;
        // SAFETY: the buffer holds `n` elements.
        ok(unsafe { (l.get_attr)(self.0, name, ty, n as i64, &mut count, out.as_mut_ptr() as *mut c_void) }, &format!("attribute {name}"))?;
        out.truncate(count.clamp(0, n as i64) as usize);
        Ok(out)
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        if let Ok(l) = dnn() {
            // SAFETY: the descriptor was created by Descriptor::new and is used by nothing now
            // (a plan keeps what it needs once finalized).
            unsafe { (l.destroy_desc)(self.0) };
        }
    }
}

/// One convolution or gradient with static sizes, as cuDNN takes it: its x, w and y by role
/// (forward: y from x and w; data: x from y and w; filter: w from x and y), each a whole
/// buffer of the plan. `w` is packed channels_last.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvSpec {
    pub name: String,
    pub dir: ConvDir,
    pub dtype: DType,
    /// TF32 allowed for f32 operands (`torch.backends.cudnn.allow_tf32`).
    pub tf32: bool,
    pub x: u32,
    pub x_shape: [i64; 4],
    pub x_strides: [i64; 4],
    pub w: u32,
    pub w_shape: [i64; 4],
    pub y: u32,
    pub y_shape: [i64; 4],
    pub y_strides: [i64; 4],
    pub stride: [i64; 2],
    pub padding: [i64; 2],
    pub dilation: [i64; 2],
    pub groups: i64,
}

impl ConvSpec {
    /// The filter's strides: packed channels_last (O, kH, kW, C / groups in memory).
    pub fn w_strides(&self) -> [i64; 4] {
        let [_, c, kh, kw] = self.w_shape;
        [kh * kw * c, 1, kw * c, c]
    }

    /// Bytes spanned by x, w and y.
    fn operand_bytes(&self) -> [usize; 3] {
        let es = self.dtype.size();
        let bytes = |shape: &[i64; 4], strides: &[i64; 4]| (shape.iter().zip(strides).map(|(&n, &st)| (n - 1) * st).sum::<i64>() + 1) as usize * es;
        [bytes(&self.x_shape, &self.x_strides), bytes(&self.w_shape, &self.w_strides()), bytes(&self.y_shape, &self.y_strides)]
    }

    /// Depthwise: several groups of one input channel each ([Note: depthwise engines]).
    pub fn depthwise(&self) -> bool {
        self.groups > 1 && self.w_shape[1] == 1
    }

    /// The passes over the heuristic's configurations: whether each takes only precompiled
    /// engines (`Some(false)`), only those compiled at run time (`Some(true)`) or either
    /// (`None`, in the heuristic's order).
    fn engine_passes(&self) -> &'static [Option<bool>] {
        if self.depthwise() {
            &[None]
        } else {
            &[Some(false), Some(true)]
        }
    }
}

pub struct Prepared {
    pub spec: ConvSpec,
    /// Workspace bytes of the plan.
    pub workspace: usize,
    /// The buffer holding the workspace where it is over the shared one ([Note: convolution
    /// workspaces] in braze-sched), set by the driver once memory planning has it.
    pub own_workspace: Option<u32>,
    plan: Descriptor,
    /// The descriptors the plan was built from, kept for its lifetime.
    _built_from: Vec<Descriptor>,
}

// SAFETY: a finalized plan is immutable; calls on the shared handle are serialized by
// `handle()`'s lock.
unsafe impl Send for Prepared {}
unsafe impl Sync for Prepared {}

fn data_type(d: DType) -> Result<i32, RuntimeError> {
    match d {
        DType::F32 => Ok(DATA_FLOAT),
        DType::F16 => Ok(DATA_HALF),
        DType::BF16 => Ok(DATA_BFLOAT16),
        _ => Err(RuntimeError::Environment(format!("cuDNN convolution on {d}"))),
    }
}

fn tensor(uid: i64, ty: i32, dims: &[i64; 4], strides: &[i64; 4]) -> Result<Descriptor, RuntimeError> {
    let t = Descriptor::new(D_TENSOR)?;
    t.set(A_TENSOR_DATA_TYPE, T_DATA_TYPE, &[ty])?;
    t.set(A_TENSOR_DIMENSIONS, T_INT64, dims)?;
    t.set(A_TENSOR_STRIDES, T_INT64, strides)?;
    t.set(A_TENSOR_UNIQUE_ID, T_INT64, &[uid])?;
    // Buffers are 256-byte aligned (PyTorch's allocations and arena offsets).
    t.set(A_TENSOR_BYTE_ALIGNMENT, T_INT64, &[16i64])?;
    t.finalize("tensor descriptor")?;
    Ok(t)
}

/// Plans chosen by timing, by `tune_key` within `scope` ([Note: remembered choices]): the
/// index among the buildable heuristic configurations, which cuDNN's heuristic ranks the same
/// way for the same version, device and convolution. A model's repeated layers are timed once,
/// and a later process reuses the choice.
fn tuned() -> &'static Choices {
    static T: OnceLock<Choices> = OnceLock::new();
    T.get_or_init(|| Choices::new("cudnn"))
}

/// What a plan chosen on device `ordinal` is valid for: cuDNN's version and the device.
fn scope(ordinal: i32) -> Result<String, RuntimeError> {
    // SAFETY: a version query without arguments.
    crate::choices::scope("cuDNN", unsafe { (dnn()?.version)() }, ordinal)
}

/// What decides the best plan: the convolution's contents.
fn tune_key(s: &ConvSpec) -> String {
    format!("{:?} {:?} {} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {}", s.dir, s.dtype, s.tf32, s.x_shape, s.x_strides, s.w_shape, s.y_strides, s.stride, s.padding, s.dilation, s.groups)
}

/// Builds the operation graph of one convolution on device `ordinal` and its execution plan:
/// the first of cuDNN's heuristic engine configurations that builds and fits the workspace,
/// or with `tune` the fastest of the first few timed there.
pub fn prepare(spec: ConvSpec, ordinal: i32, tune: bool) -> Result<Prepared, RuntimeError> {
    let h = handle_on(ordinal)?;
    let ty = data_type(spec.dtype)?;
    let x = tensor(UID_X, ty, &spec.x_shape, &spec.x_strides)?;
    let w = tensor(UID_W, ty, &spec.w_shape, &spec.w_strides())?;
    let y = tensor(UID_Y, ty, &spec.y_shape, &spec.y_strides)?;
    let conv = Descriptor::new(D_CONVOLUTION)?;
    // f32 arithmetic whatever the data type, as PyTorch's.
    conv.set(A_CONV_COMP_TYPE, T_DATA_TYPE, &[DATA_FLOAT])?;
    conv.set(A_CONV_MODE, T_CONVOLUTION_MODE, &[CROSS_CORRELATION])?;
    conv.set(A_CONV_SPATIAL_DIMS, T_INT64, &[2i64])?;
    conv.set(A_CONV_DILATIONS, T_INT64, &spec.dilation)?;
    conv.set(A_CONV_FILTER_STRIDES, T_INT64, &spec.stride)?;
    conv.set(A_CONV_PRE_PADDINGS, T_INT64, &spec.padding)?;
    conv.set(A_CONV_POST_PADDINGS, T_INT64, &spec.padding)?;
    conv.finalize("convolution descriptor")?;
    // (operation type, attributes for x, w, y, the convolution, alpha, beta).
    let (kind, [ax, aw, ay, aconv, aalpha, abeta]) = match spec.dir {
        ConvDir::Forward => (D_OP_CONV_FORWARD, [A_FWD_X, A_FWD_W, A_FWD_Y, A_FWD_CONV_DESC, A_FWD_ALPHA, A_FWD_BETA]),
        ConvDir::Data => (D_OP_CONV_BWD_DATA, [A_BWD_DATA_DX, A_BWD_DATA_W, A_BWD_DATA_DY, A_BWD_DATA_CONV_DESC, A_BWD_DATA_ALPHA, A_BWD_DATA_BETA]),
        ConvDir::Filter => (D_OP_CONV_BWD_FILTER, [A_BWD_FILTER_X, A_BWD_FILTER_DW, A_BWD_FILTER_DY, A_BWD_FILTER_CONV_DESC, A_BWD_FILTER_ALPHA, A_BWD_FILTER_BETA]),
    };
    let op = Descriptor::new(kind)?;
    op.set(ax, T_BACKEND_DESCRIPTOR, &[x.0])?;
    op.set(aw, T_BACKEND_DESCRIPTOR, &[w.0])?;
    op.set(ay, T_BACKEND_DESCRIPTOR, &[y.0])?;
    op.set(aconv, T_BACKEND_DESCRIPTOR, &[conv.0])?;
    op.set(aalpha, T_FLOAT, &[1.0f32])?;
    op.set(abeta, T_FLOAT, &[0.0f32])?;
    op.finalize("convolution operation")?;
    let graph = Descriptor::new(D_OPERATIONGRAPH)?;
    graph.set(A_GRAPH_HANDLE, T_HANDLE, &[h])?;
    graph.set(A_GRAPH_OPS, T_BACKEND_DESCRIPTOR, &[op.0])?;
    graph.finalize("operation graph")?;
    // The heuristic's ranked configurations; where none of them is usable (f32 without TF32:
    // the fast engines all use tensor cores), cuDNN's fallback engines.
    let tune = tune && crate::cublaslt::tuning_enabled();
    // A choice remembered from an earlier timing needs only the plans up to it built.
    let scope = if tune { scope(ordinal).ok() } else { None };
    let chosen = scope.as_ref().and_then(|sc| tuned().get(sc, &tune_key(&spec))).and_then(|t| t.parse::<usize>().ok()).filter(|&i| i < TUNE_PLANS);
    let wanted = match (tune, chosen) {
        (true, Some(i)) => i + 1,
        (true, None) => TUNE_PLANS,
        (false, _) => 1,
    };
    let mut plans: Vec<(Descriptor, usize)> = Vec::new();
    let mut built_from = vec![];
    let mut why = String::new();
    for mode in [HEUR_MODE_INSTANT, HEUR_MODE_FALLBACK] {
        let heur = Descriptor::new(D_ENGINEHEUR)?;
        heur.set(A_HEUR_OPERATION_GRAPH, T_BACKEND_DESCRIPTOR, &[graph.0])?;
        heur.set(A_HEUR_MODE, T_HEUR_MODE, &[mode])?;
        heur.finalize("engine heuristic")?;
        let cfgs: Vec<Descriptor> = (0..HEUR_CONFIGS).map(|_| Descriptor::new(D_ENGINECFG)).collect::<Result<_, _>>()?;
        let mut raw: Vec<Desc> = cfgs.iter().map(|c| c.0).collect();
        let mut n: i64 = 0;
        let l = dnn()?;
        // SAFETY: `raw` holds HEUR_CONFIGS engine-config descriptors for cuDNN to fill.
        ok(unsafe { (l.get_attr)(heur.0, A_HEUR_RESULTS, T_BACKEND_DESCRIPTOR, raw.len() as i64, &mut n, raw.as_mut_ptr() as *mut c_void) }, "heuristic results")?;
        // Engines whose kernels are built in (precompiled) first; those that compile their
        // kernels with NVRTC when their plan is built only where none of those builds
        // (depthwise convolutions: the heuristic's order, [Note: depthwise engines]).
        let ranked = &cfgs[..n.clamp(0, HEUR_CONFIGS as i64) as usize];
        for &rtc in spec.engine_passes() {
            for (rank, cfg) in ranked.iter().enumerate() {
                if plans.len() == wanted {
                    break;
                }
                let got = plan_of(h, cfg, &spec, rtc);
                if trace_enabled() {
                    let what = match &got {
                        Ok(Ok((_, ws))) => format!("built, workspace {ws} bytes"),
                        Ok(Err(skip)) => format!("skipped: {skip}"),
                        Err(e) => format!("error: {e}"),
                    };
                    eprintln!("[braze:cudnn] {} mode {mode} pass {rtc:?} rank {rank}: {what}", spec.name);
                }
                match got {
                    Ok(Ok(p)) => plans.push(p),
                    Ok(Err(_)) => {}
                    Err(e) => why = e.to_string(),
                }
            }
            if !plans.is_empty() {
                break;
            }
        }
        built_from.push(heur);
        built_from.extend(cfgs);
        if !plans.is_empty() {
            break;
        }
    }
    if plans.is_empty() {
        return Err(RuntimeError::Environment(format!("cuDNN has no engine for {} ({why})", spec.name)));
    }
    let i = match (chosen, &scope) {
        (Some(i), _) if i < plans.len() => i,
        (_, Some(sc)) if plans.len() > 1 => fastest(ordinal, sc, &spec, &plans),
        _ => 0,
    };
    let (plan, workspace) = plans.swap_remove(i);
    built_from.extend([x, w, y, conv, op, graph]);
    Ok(Prepared { spec, workspace, own_workspace: None, plan, _built_from: built_from })
}

/// `BRAZE_CUDNN_TRACE=1`, a diagnostic: each convolution's engine configurations as they are
/// tried, with why each was skipped or the workspace of each plan built, to stderr.
fn trace_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("BRAZE_CUDNN_TRACE").is_ok_and(|v| v == "1"))
}

/// The execution plan of engine configuration `cfg` with its workspace bytes; `Err` with the
/// reason where the engine is not wanted (narrowed inputs, TF32 where not allowed, compiled
/// at run time or not as `rtc` asks where it asks), does not build, or needs a larger
/// workspace than the one the libraries share.
fn plan_of(h: Handle, cfg: &Descriptor, spec: &ConvSpec, rtc: Option<bool>) -> Result<Result<(Descriptor, usize), String>, RuntimeError> {
    let engine = Descriptor::new(D_ENGINE)?;
    let l = dnn()?;
    let mut n: i64 = 0;
    let mut e = engine.0;
    // SAFETY: `e` is an engine descriptor for cuDNN to fill.
    ok(unsafe { (l.get_attr)(cfg.0, A_CFG_ENGINE, T_BACKEND_DESCRIPTOR, 1, &mut n, &mut e as *mut Desc as *mut c_void) }, "engine of a configuration")?;
    let notes = engine.get_enums(A_ENGINE_NUMERICAL_NOTE, T_NUMERICAL_NOTE, 16)?;
    // As PyTorch: never engines that convert the inputs to a narrower type; for f32 tensor-core
    // (TF32) engines only where TF32 is allowed.
    let tf32 = spec.dtype == DType::F32 && notes.contains(&NOTE_TENSOR_CORE);
    let behavior = engine.get_enums(A_ENGINE_BEHAVIOR_NOTE, T_BEHAVIOR_NOTE, 16)?;
    let rt = behavior.contains(&BEHAVIOR_RUNTIME_COMPILATION);
    let id = || {
        let (mut g, mut k): (i64, i64) = (-1, 0);
        // SAFETY: reads one int64 from a filled engine descriptor (a diagnostic only).
        unsafe { (l.get_attr)(engine.0, A_ENGINE_GLOBAL_INDEX, T_INT64, 1, &mut k, &mut g as *mut i64 as *mut c_void) };
        format!("engine {g}{}", if rt { " (compiled at run time)" } else { "" })
    };
    if notes.contains(&NOTE_DOWN_CONVERT_INPUTS) {
        return Ok(Err(format!("{}: converts the inputs to a narrower type", id())));
    }
    if tf32 && !spec.tf32 {
        return Ok(Err(format!("{}: TF32 not allowed", id())));
    }
    if rtc.is_some_and(|r| rt != r) {
        return Ok(Err(format!("{}: not in this pass", id())));
    }
    let plan = Descriptor::new(D_EXECUTION_PLAN)?;
    plan.set(A_PLAN_HANDLE, T_HANDLE, &[h])?;
    plan.set(A_PLAN_ENGINE_CONFIG, T_BACKEND_DESCRIPTOR, &[cfg.0])?;
    if plan.finalize("execution plan").is_err() {
        return Ok(Err(format!("{}: does not build", id())));
    }
    let mut ws: i64 = 0;
    // SAFETY: reads one int64 from a finalized plan.
    ok(unsafe { (l.get_attr)(plan.0, A_PLAN_WORKSPACE_SIZE, T_INT64, 1, &mut n, &mut ws as *mut i64 as *mut c_void) }, "workspace size")?;
    let cap = workspace_cap(spec);
    if ws < 0 || ws as usize > cap {
        return Ok(Err(format!("{}: workspace {ws} bytes over the {cap} allowed", id())));
    }
    if trace_enabled() {
        eprintln!("[braze:cudnn] {}: {} builds", spec.name, id());
    }
    Ok(Ok((plan, ws as usize)))
}

/// The most workspace a plan for `s` may take: the shared library workspace, or where more,
/// twice the bytes of the convolution's operands (a workspace of its own, [Note: convolution
/// workspaces] in braze-sched). ResNet's 7×7 stem weight gradient over 3 channels at b32 in
/// fp32: cuDNN's first six engines need 123–135 MB for 122 MB of operands; the first that
/// fit in 32 MiB took 0.44 ms against the first's 0.13 (H200). ATen gives a plan whatever it
/// asks of the caching allocator; the bound keeps what one step may add to the peak to the
/// order of its operands.
fn workspace_cap(s: &ConvSpec) -> usize {
    (2 * s.operand_bytes().iter().sum::<usize>()).max(crate::cublaslt::WORKSPACE)
}

/// The index of the fastest of the first `TUNE_PLANS` plans on device `ordinal`, remembered
/// in `scope`; 0 when timing is not possible.
fn fastest(ordinal: i32, scope: &str, s: &ConvSpec, plans: &[(Descriptor, usize)]) -> usize {
    let f = crate::cuda::FILL_FLOAT;
    let n = plans.len().min(TUNE_PLANS);
    let ws = plans[..n].iter().map(|p| p.1).max().unwrap_or(0).max(crate::cublaslt::WORKSPACE);
    let [x, w, y] = s.operand_bytes();
    let sizes = [(x, f), (w, f), (y, f), (ws, f)];
    let timed = crate::cuda::time_candidates(ordinal, &sizes, n, &mut |i, ptrs, stream| execute(&plans[i].0, [ptrs[0], ptrs[1], ptrs[2]], stream, ptrs[3]));
    let Ok(times) = timed else { return 0 };
    let (i, t) = times.iter().enumerate().fold((0, f64::INFINITY), |b, (i, &t)| if t < b.1 { (i, t) } else { b });
    if t.is_finite() {
        tuned().put(scope, &tune_key(s), &i.to_string());
    }
    i
}

/// Executes `plan` on `stream` with device pointers for x, w and y and the workspace.
fn execute(plan: &Descriptor, xwy: [usize; 3], stream: usize, workspace: usize) -> Result<(), RuntimeError> {
    let l = dnn()?;
    let (h, call) = handle()?;
    let pack = Descriptor::new(D_VARIANT_PACK)?;
    let ptrs: [*mut c_void; 3] = xwy.map(|p| p as *mut c_void);
    pack.set(A_PACK_UNIQUE_IDS, T_INT64, &[UID_X, UID_W, UID_Y])?;
    pack.set(A_PACK_DATA_POINTERS, T_VOID_PTR, &ptrs)?;
    pack.set(A_PACK_WORKSPACE, T_VOID_PTR, &[workspace as *mut c_void])?;
    pack.finalize("variant pack")?;
    let _call = call.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: the pointers are live device buffers laid out as the plan's tensors say, and the
    // workspace holds at least the plan's workspace bytes.
    unsafe {
        ok((l.set_stream)(h, stream as *mut c_void), "set stream")?;
        ok((l.execute)(h, plan.0, pack.0), "execute")
    }
}

impl Prepared {
    /// Runs the convolution on `stream` with buffer pointers by id, in its own workspace
    /// where it has one, else in the `shared` one.
    pub fn run(&self, ptrs: &[usize], stream: usize, shared: usize) -> Result<(), RuntimeError> {
        let s = &self.spec;
        let workspace = self.own_workspace.map_or(shared, |b| ptrs[b as usize]);
        execute(&self.plan, [ptrs[s.x as usize], ptrs[s.w as usize], ptrs[s.y as usize]], stream, workspace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(groups: i64, w_shape: [i64; 4]) -> ConvSpec {
        let c = w_shape[1] * groups;
        ConvSpec {
            name: "conv".into(),
            dir: ConvDir::Forward,
            dtype: DType::F32,
            tf32: true,
            x: 0,
            x_shape: [8, c, 14, 14],
            x_strides: [14 * 14 * c, 1, 14 * c, c],
            w: 1,
            w_shape,
            y: 2,
            y_shape: [8, w_shape[0], 14, 14],
            y_strides: [14 * 14 * w_shape[0], 1, 14 * w_shape[0], w_shape[0]],
            stride: [1, 1],
            padding: [1, 1],
            dilation: [1, 1],
            groups,
        }
    }

    #[test]
    fn depthwise_convolutions_take_the_heuristics_order() {
        // MobileNet's 3x3 depthwise convolution over 72 channels.
        assert_eq!(spec(72, [72, 1, 3, 3]).engine_passes(), &[None]);
        // A dense convolution and one grouped over 4 channels per group: precompiled first.
        assert_eq!(spec(1, [64, 64, 3, 3]).engine_passes(), &[Some(false), Some(true)]);
        assert_eq!(spec(8, [64, 4, 3, 3]).engine_passes(), &[Some(false), Some(true)]);
        // One group of one channel is not depthwise (a plain convolution of one channel).
        assert_eq!(spec(1, [16, 1, 3, 3]).engine_passes(), &[Some(false), Some(true)]);
    }
}
