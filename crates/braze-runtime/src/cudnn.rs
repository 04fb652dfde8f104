//! 2-d convolutions through cuDNN, loaded at run time from the path the caller gives (the copy
//! PyTorch's NVIDIA wheels ship, which the process already holds). Descriptors and the
//! algorithm are made once per convolution when the module loads; a call is one
//! `cudnnConvolutionForward` on PyTorch's stream, inside a run of kernels and matmuls (so a
//! run's CUDA-graph replay, [Note: replay], covers it too).
//!
//! [Note: library convolutions] An ATen convolution called from the plan costs ~30 µs of host
//! time (dispatch, argument checks, cuDNN's plan cache lookup, output and workspace
//! allocation); ResNet-50 inference makes 53 of them per call and was bound by its host
//! side. Here the output is a buffer of the plan (in the arena), the workspace is the one
//! the matmuls use (runs are serial on one stream), and the algorithm is chosen at compile
//! time: cuDNN's heuristic, or the fastest of its candidates timed on the device when tuning
//! is on (as for matmuls).

use crate::RuntimeError;
use braze_ir::DType;
use libloading::Library;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Mutex, OnceLock};

type Status = c_int;
type Handle = *mut c_void;
type Desc = *mut c_void;

struct Dnn {
    _lib: Library,
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    set_stream: unsafe extern "C" fn(Handle, *mut c_void) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    tensor_create: unsafe extern "C" fn(*mut Desc) -> Status,
    tensor_set: unsafe extern "C" fn(Desc, c_int, c_int, *const c_int, *const c_int) -> Status,
    tensor_destroy: unsafe extern "C" fn(Desc) -> Status,
    filter_create: unsafe extern "C" fn(*mut Desc) -> Status,
    filter_set: unsafe extern "C" fn(Desc, c_int, c_int, c_int, *const c_int) -> Status,
    filter_destroy: unsafe extern "C" fn(Desc) -> Status,
    conv_create: unsafe extern "C" fn(*mut Desc) -> Status,
    #[allow(clippy::type_complexity)]
    conv_set: unsafe extern "C" fn(Desc, c_int, *const c_int, *const c_int, *const c_int, c_int, c_int) -> Status,
    conv_groups: unsafe extern "C" fn(Desc, c_int) -> Status,
    conv_math: unsafe extern "C" fn(Desc, c_int) -> Status,
    conv_destroy: unsafe extern "C" fn(Desc) -> Status,
    fwd_algos: unsafe extern "C" fn(Handle, Desc, Desc, Desc, Desc, c_int, *mut c_int, *mut FwdAlgoPerf) -> Status,
    fwd_workspace: unsafe extern "C" fn(Handle, Desc, Desc, Desc, Desc, c_int, *mut usize) -> Status,
    #[allow(clippy::type_complexity)]
    forward: unsafe extern "C" fn(Handle, *const c_void, Desc, *const c_void, Desc, *const c_void, Desc, c_int, *mut c_void, usize, *const c_void, Desc, *mut c_void) -> Status,
}

/// `cudnnConvolutionFwdAlgoPerf_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FwdAlgoPerf {
    algo: c_int,
    status: Status,
    time: f32,
    memory: usize,
    determinism: c_int,
    math_type: c_int,
    reserved: [c_int; 3],
}

// cudnn_graph.h / cudnn_cnn.h values.
const DATA_FLOAT: c_int = 0;
const DATA_HALF: c_int = 2;
const DATA_BFLOAT16: c_int = 9;
const FORMAT_NHWC: c_int = 1;
const CROSS_CORRELATION: c_int = 1;
const DEFAULT_MATH: c_int = 0;
const TENSOR_OP_MATH: c_int = 1;
const FMA_MATH: c_int = 3;
/// `CUDNN_CONVOLUTION_FWD_ALGO_COUNT`.
const FWD_ALGO_COUNT: usize = 8;

static DNN: OnceLock<Result<Dnn, String>> = OnceLock::new();
static HANDLE: OnceLock<Result<usize, String>> = OnceLock::new();

/// Loads cuDNN from `path`.
pub fn init(path: &str) -> Result<(), RuntimeError> {
    let r = DNN.get_or_init(|| {
        let lib = crate::open_library(path)?;
        Ok(Dnn {
            create: sym!(lib, b"cudnnCreate"),
            set_stream: sym!(lib, b"cudnnSetStream"),
            error_string: sym!(lib, b"cudnnGetErrorString"),
            tensor_create: sym!(lib, b"cudnnCreateTensorDescriptor"),
            tensor_set: sym!(lib, b"cudnnSetTensorNdDescriptor"),
            tensor_destroy: sym!(lib, b"cudnnDestroyTensorDescriptor"),
            filter_create: sym!(lib, b"cudnnCreateFilterDescriptor"),
            filter_set: sym!(lib, b"cudnnSetFilterNdDescriptor"),
            filter_destroy: sym!(lib, b"cudnnDestroyFilterDescriptor"),
            conv_create: sym!(lib, b"cudnnCreateConvolutionDescriptor"),
            conv_set: sym!(lib, b"cudnnSetConvolutionNdDescriptor"),
            conv_groups: sym!(lib, b"cudnnSetConvolutionGroupCount"),
            conv_math: sym!(lib, b"cudnnSetConvolutionMathType"),
            conv_destroy: sym!(lib, b"cudnnDestroyConvolutionDescriptor"),
            fwd_algos: sym!(lib, b"cudnnGetConvolutionForwardAlgorithm_v7"),
            fwd_workspace: sym!(lib, b"cudnnGetConvolutionForwardWorkspaceSize"),
            forward: sym!(lib, b"cudnnConvolutionForward"),
            _lib: lib,
        })
    });
    r.as_ref().map(|_| ()).map_err(|e| RuntimeError::Environment(e.clone()))
}

fn dnn() -> Result<&'static Dnn, RuntimeError> {
    match DNN.get() {
        Some(Ok(l)) => Ok(l),
        Some(Err(e)) => Err(RuntimeError::Environment(e.clone())),
        None => Err(RuntimeError::Environment("cuDNN not loaded".into())),
    }
}

/// The process's cuDNN handle (made in the current context: the primary one, as PyTorch's),
/// with the lock that a call holds from setting its stream until the call is issued.
fn handle() -> Result<(Handle, &'static Mutex<()>), RuntimeError> {
    static CALL: Mutex<()> = Mutex::new(());
    let l = dnn()?;
    let h = HANDLE.get_or_init(|| {
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: creates a library handle.
        let st = unsafe { (l.create)(&mut h) };
        if st != 0 { Err(format!("cudnnCreate failed ({})", message(l, st))) } else { Ok(h as usize) }
    });
    h.as_ref().map(|h| (*h as Handle, &CALL)).map_err(|e| RuntimeError::Environment(e.clone()))
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

/// One convolution with static sizes, as cuDNN takes it: `out = conv(x, w)`, each operand a
/// whole buffer of the plan. `w` is packed channels_last (cuDNN's NHWC filter format).
#[derive(Clone, Debug, PartialEq)]
pub struct ConvSpec {
    pub name: String,
    pub dtype: DType,
    /// TF32 allowed for f32 operands (`torch.backends.cudnn.allow_tf32`).
    pub tf32: bool,
    pub x: u32,
    pub x_shape: [i64; 4],
    pub x_strides: [i64; 4],
    pub w: u32,
    pub w_shape: [i64; 4],
    pub out: u32,
    pub out_shape: [i64; 4],
    pub out_strides: [i64; 4],
    pub stride: [i64; 2],
    pub padding: [i64; 2],
    pub dilation: [i64; 2],
    pub groups: i64,
}

pub struct Prepared {
    pub spec: ConvSpec,
    x: Desc,
    w: Desc,
    y: Desc,
    conv: Desc,
    /// The chosen algorithm with its workspace bytes and math type.
    algo: Algo,
}

/// An algorithm as the heuristic offers it: (algorithm, workspace bytes, math type). PyTorch
/// sets the math type that came with the algorithm before running it (cuDNN may otherwise
/// pick a slower kernel).
type Algo = (c_int, usize, c_int);

// SAFETY: descriptors are immutable once prepared; cuDNN descriptors may be used from any
// thread, and calls on the shared handle are serialized by `handle()`'s lock.
unsafe impl Send for Prepared {}
unsafe impl Sync for Prepared {}

impl Drop for Prepared {
    fn drop(&mut self) {
        if let Ok(l) = dnn() {
            // SAFETY: the descriptors were created by prepare() and nothing uses them now.
            unsafe {
                (l.tensor_destroy)(self.x);
                (l.tensor_destroy)(self.y);
                (l.filter_destroy)(self.w);
                (l.conv_destroy)(self.conv);
            }
        }
    }
}

fn data_type(d: DType) -> Result<c_int, RuntimeError> {
    match d {
        DType::F32 => Ok(DATA_FLOAT),
        DType::F16 => Ok(DATA_HALF),
        DType::BF16 => Ok(DATA_BFLOAT16),
        _ => Err(RuntimeError::Environment(format!("cuDNN convolution on {d}"))),
    }
}

fn ints(v: &[i64]) -> Result<Vec<c_int>, RuntimeError> {
    v.iter().map(|&x| c_int::try_from(x).map_err(|_| RuntimeError::Environment(format!("convolution size {x} exceeds cuDNN's int")))).collect()
}

/// Algorithms chosen by timing, by `ConvSpec` contents (a model's repeated layers are timed
/// once per process).
fn tuned() -> &'static Mutex<HashMap<String, c_int>> {
    static T: OnceLock<Mutex<HashMap<String, c_int>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Creates descriptors and picks an algorithm for one convolution: the first of cuDNN's
/// heuristic candidates that fits the workspace, or with `tune_on` (a device ordinal) the
/// fastest of those candidates timed there.
pub fn prepare(spec: ConvSpec, tune_on: Option<i32>) -> Result<Prepared, RuntimeError> {
    let l = dnn()?;
    let (h, _) = handle()?;
    let ty = data_type(spec.dtype)?;
    // The legacy API's sizes are ints: PyTorch splits larger batches; braze leaves them to ATen.
    let numel = |shape: &[i64; 4]| shape.iter().product::<i64>();
    if [numel(&spec.x_shape), numel(&spec.w_shape), numel(&spec.out_shape)].iter().any(|&n| n > i32::MAX as i64) {
        return Err(RuntimeError::Environment(format!("{}: more than 2^31 elements for cuDNN's legacy API", spec.name)));
    }
    let (mut x, mut w, mut y, mut conv): (Desc, Desc, Desc, Desc) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: descriptor set-up with arrays of the documented lengths; every descriptor made
    // is owned by the Prepared (destroyed on drop) or destroyed here on error.
    unsafe {
        ok((l.tensor_create)(&mut x), "tensor descriptor")?;
        ok((l.tensor_create)(&mut y), "tensor descriptor")?;
        ok((l.filter_create)(&mut w), "filter descriptor")?;
        ok((l.conv_create)(&mut conv), "convolution descriptor")?;
    }
    let mut p = Prepared { spec, x, w, y, conv, algo: (0, 0, 0) };
    let s = &p.spec;
    // PyTorch's choices: f32 arithmetic for f16/bf16 data on tensor cores; f32 data on tensor
    // cores (TF32) only where allowed.
    let (compute, math) = match s.dtype {
        DType::F32 => (DATA_FLOAT, if s.tf32 { DEFAULT_MATH } else { FMA_MATH }),
        _ => (DATA_FLOAT, TENSOR_OP_MATH),
    };
    // SAFETY: as above.
    unsafe {
        ok((l.tensor_set)(p.x, ty, 4, ints(&s.x_shape)?.as_ptr(), ints(&s.x_strides)?.as_ptr()), "input descriptor")?;
        ok((l.tensor_set)(p.y, ty, 4, ints(&s.out_shape)?.as_ptr(), ints(&s.out_strides)?.as_ptr()), "output descriptor")?;
        ok((l.filter_set)(p.w, ty, FORMAT_NHWC, 4, ints(&s.w_shape)?.as_ptr()), "filter descriptor")?;
        ok((l.conv_set)(p.conv, 2, ints(&s.padding)?.as_ptr(), ints(&s.stride)?.as_ptr(), ints(&s.dilation)?.as_ptr(), CROSS_CORRELATION, compute), "convolution descriptor")?;
        ok((l.conv_groups)(p.conv, c_int::try_from(s.groups).unwrap_or(1)), "group count")?;
        ok((l.conv_math)(p.conv, math), "math type")?;
    }
    let cands = p.candidates(h)?;
    if cands.is_empty() {
        return Err(RuntimeError::Environment(format!("cuDNN has no algorithm for {} within the workspace", p.spec.name)));
    }
    let algo = match tune_on {
        Some(ordinal) if cands.len() > 1 && crate::cublaslt::tuning_enabled() => p.fastest(ordinal, &cands),
        _ => cands[0],
    };
    p.set_math(algo.2)?;
    p.algo = algo;
    Ok(p)
}

impl Prepared {
    /// cuDNN's heuristic candidates, best first, as (algorithm, workspace bytes): those that
    /// are supported here and fit the workspace the matmuls share.
    fn candidates(&self, h: Handle) -> Result<Vec<Algo>, RuntimeError> {
        let l = dnn()?;
        let mut perf = [FwdAlgoPerf::default(); FWD_ALGO_COUNT];
        let mut n: c_int = 0;
        // SAFETY: the heuristic writes at most FWD_ALGO_COUNT results.
        unsafe {
            ok((l.fwd_algos)(h, self.x, self.w, self.conv, self.y, FWD_ALGO_COUNT as c_int, &mut n, perf.as_mut_ptr()), "algorithm heuristic")?;
        }
        let mut out = Vec::new();
        for r in &perf[..(n.max(0) as usize).min(FWD_ALGO_COUNT)] {
            if r.status != 0 {
                continue;
            }
            let mut ws: usize = 0;
            // SAFETY: a workspace query over this convolution's descriptors.
            let st = unsafe { (l.fwd_workspace)(h, self.x, self.w, self.conv, self.y, r.algo, &mut ws) };
            if st == 0 && ws <= crate::cublaslt::WORKSPACE && !out.iter().any(|&(a, _, m)| (a, m) == (r.algo, r.math_type)) {
                out.push((r.algo, ws, r.math_type));
            }
        }
        Ok(out)
    }

    /// The fastest of `cands` on device `ordinal` (remembered per spec); the heuristic's
    /// favourite when timing is not possible.
    fn fastest(&self, ordinal: i32, cands: &[Algo]) -> Algo {
        let s = &self.spec;
        let key = format!("{:?} {} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {}", s.dtype, s.tf32, s.x_shape, s.x_strides, s.w_shape, s.out_strides, s.stride, s.padding, s.dilation, s.groups);
        if let Some(&a) = tuned().lock().unwrap().get(&key) {
            if let Some(c) = cands.iter().find(|c| c.0 == a) {
                return *c;
            }
        }
        let es = s.dtype.size();
        let bytes = |shape: &[i64; 4], strides: &[i64; 4]| (shape.iter().zip(strides).map(|(&n, &st)| (n - 1) * st).sum::<i64>() + 1) as usize * es;
        let w_bytes = s.w_shape.iter().product::<i64>() as usize * es;
        let sizes = [bytes(&s.x_shape, &s.x_strides), w_bytes, bytes(&s.out_shape, &s.out_strides), crate::cublaslt::WORKSPACE];
        let timed = crate::cuda::time_candidates(ordinal, &sizes, cands.len(), &mut |i, ptrs, stream| {
            self.set_math(cands[i].2)?;
            self.launch(ptrs[0], ptrs[1], ptrs[2], stream, ptrs[3], cands[i])
        });
        let Ok(times) = timed else { return cands[0] };
        let (i, t) = times.iter().enumerate().fold((0, f64::INFINITY), |b, (i, &t)| if t < b.1 { (i, t) } else { b });
        if t.is_finite() {
            tuned().lock().unwrap().insert(key, cands[i].0);
        }
        cands[i]
    }

    /// Runs the convolution on `stream` with buffer pointers by id.
    pub fn run(&self, ptrs: &[usize], stream: usize, workspace: usize) -> Result<(), RuntimeError> {
        let s = &self.spec;
        self.launch(ptrs[s.x as usize], ptrs[s.w as usize], ptrs[s.out as usize], stream, workspace, self.algo)
    }

    /// Sets the convolution's math type (while it is prepared, before any call).
    fn set_math(&self, math: c_int) -> Result<(), RuntimeError> {
        let l = dnn()?;
        // SAFETY: a descriptor this Prepared owns, not in use by any call yet.
        unsafe { ok((l.conv_math)(self.conv, math), "math type") }
    }

    /// One `cudnnConvolutionForward` with algorithm `algo` (and its workspace bytes).
    fn launch(&self, x: usize, w: usize, y: usize, stream: usize, workspace: usize, algo: Algo) -> Result<(), RuntimeError> {
        let l = dnn()?;
        let (h, call) = handle()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let _call = call.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: pointers come from live device buffers laid out as the spec says; the
        // workspace holds at least `algo.1` bytes.
        unsafe {
            ok((l.set_stream)(h, stream as *mut c_void), "set stream")?;
            let st = (l.forward)(
                h,
                &alpha as *const f32 as *const c_void,
                self.x,
                x as *const c_void,
                self.w,
                w as *const c_void,
                self.conv,
                algo.0,
                workspace as *mut c_void,
                algo.1,
                &beta as *const f32 as *const c_void,
                self.y,
                y as *mut c_void,
            );
            ok(st, &format!("convolution {}", self.spec.name))
        }
    }
}
