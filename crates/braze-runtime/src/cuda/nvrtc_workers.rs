//! [Note: NVRTC worker processes] NVRTC does not scale over threads of one process: on a
//! 16-core H200 machine, 81 kernels of ResNet-50's training step took 1.09 s on 4 threads,
//! 1.24 s on 8 and 1.26 s on 16 (each compile 53, 118, 228 ms: the threads wait on each
//! other inside NVRTC), while 4, 8 and 16 processes of one thread each took 0.46, 0.24 and
//! 0.14 s (`scratch/nvrtc_scaling.py`, `scratch/nvrtc_procs.py`). So a process that compiles
//! CUDA kernels starts worker processes, each with NVRTC loaded, and the compile threads
//! hand their units to them: one request (options and source) in, one reply (the cubin, or
//! NVRTC's log) out, over the worker's stdin and stdout.
//!
//! A worker is the same Python interpreter running braze's extension module alone (not the
//! `braze` package, which would import PyTorch): `nvrtc_worker` in braze-py reads requests
//! until its stdin closes, so workers end with the process that started them. They are
//! started on the first CUDA graph's warm-up, beside Dynamo's tracing, and pay NVRTC's
//! first-use cost there. Nothing depends on them: with none started (`BRAZE_NVRTC_WORKERS=0`,
//! a process forked after they started, a worker that died) the unit compiles in-process as
//! before.

use std::io::{BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Condvar, Mutex, OnceLock};

struct Worker {
    _child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

struct Pool {
    /// The process that started the workers: a forked child must not share their pipes.
    pid: u32,
    idle: Mutex<(Vec<Worker>, usize)>, // idle workers, workers alive
    freed: Condvar,
}

static POOL: OnceLock<Pool> = OnceLock::new();

/// Units compiled on workers in this process.
static COMPILED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many compiles workers have answered for this process.
pub fn compiled() -> usize {
    COMPILED.load(std::sync::atomic::Ordering::Relaxed)
}

/// How many workers to start: `BRAZE_NVRTC_WORKERS`, else the cores, at most 16 (the gain
/// flattens there: 0.24 s on 8, 0.14 s on 16). A worker that has compiled holds about 92 MB
/// resident, 25 MB of it its own (the rest is NVRTC's library, shared between them).
pub fn worker_count() -> usize {
    if let Some(n) = std::env::var("BRAZE_NVRTC_WORKERS").ok().and_then(|v| v.parse().ok()) {
        return n;
    }
    std::thread::available_parallelism().map(|p| p.get()).unwrap_or(1).min(16)
}

/// Starts the workers (once per process): `python` runs `code` with `args` appended, which
/// must serve requests as `serve` does. Returns how many started.
pub fn start(python: &str, code: &str, args: &[String]) -> usize {
    let n = worker_count();
    let pool = POOL.get_or_init(|| {
        let mut workers = Vec::new();
        for _ in 0..n {
            let child = Command::new(python)
                .arg("-S")
                .arg("-c")
                .arg(code)
                .args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn();
            let Ok(mut child) = child else { break };
            let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else { break };
            workers.push(Worker { _child: child, stdin, stdout: BufReader::new(stdout) });
        }
        let alive = workers.len();
        Pool { pid: std::process::id(), idle: Mutex::new((workers, alive)), freed: Condvar::new() }
    });
    pool.idle.lock().map(|g| g.1).unwrap_or(0)
}

/// Compiles `source` with `opts` on a worker: `None` when there is none to use (then the
/// caller compiles in-process), else the cubin or NVRTC's log.
pub fn compile(source: &str, opts: &[String]) -> Option<Result<Vec<u8>, String>> {
    let pool = POOL.get()?;
    if pool.pid != std::process::id() {
        return None;
    }
    let mut w = {
        let mut g = pool.idle.lock().ok()?;
        loop {
            if let Some(w) = g.0.pop() {
                break w;
            }
            if g.1 == 0 {
                return None;
            }
            g = pool.freed.wait(g).ok()?;
        }
    };
    let reply = request(&mut w, source, opts);
    let mut g = pool.idle.lock().ok()?;
    match reply {
        Ok(r) => {
            COMPILED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            g.0.push(w);
            pool.freed.notify_one();
            Some(r)
        }
        Err(_) => {
            // The worker died or broke the protocol: drop it and compile here.
            g.1 -= 1;
            pool.freed.notify_all();
            None
        }
    }
}

fn request(w: &mut Worker, source: &str, opts: &[String]) -> std::io::Result<Result<Vec<u8>, String>> {
    let mut msg = Vec::with_capacity(source.len() + 64);
    msg.extend_from_slice(&(opts.len() as u64).to_le_bytes());
    for o in opts {
        put(&mut msg, o.as_bytes());
    }
    put(&mut msg, source.as_bytes());
    w.stdin.write_all(&msg)?;
    w.stdin.flush()?;
    let mut ok = [0u8; 1];
    w.stdout.read_exact(&mut ok)?;
    let body = get(&mut w.stdout)?;
    Ok(if ok[0] == 1 { Ok(body) } else { Err(String::from_utf8_lossy(&body).into_owned()) })
}

fn put(msg: &mut Vec<u8>, bytes: &[u8]) {
    msg.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    msg.extend_from_slice(bytes);
}

fn get(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut n = [0u8; 8];
    r.read_exact(&mut n)?;
    let n = u64::from_le_bytes(n) as usize;
    let mut b = vec![0u8; n];
    r.read_exact(&mut b)?;
    Ok(b)
}

/// A worker's loop: reads requests from `input` and answers each with `build(source, opts)`
/// on `output`, until `input` ends.
pub fn serve(input: &mut impl Read, output: &mut impl Write, build: impl Fn(&str, &[String]) -> Result<Vec<u8>, String>) -> std::io::Result<()> {
    loop {
        let mut n = [0u8; 8];
        match input.read_exact(&mut n) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let mut opts = Vec::new();
        for _ in 0..u64::from_le_bytes(n) {
            opts.push(String::from_utf8_lossy(&get(input)?).into_owned());
        }
        let source = String::from_utf8_lossy(&get(input)?).into_owned();
        let (ok, body) = match build(&source, &opts) {
            Ok(c) => (1u8, c),
            Err(log) => (0u8, log.into_bytes()),
        };
        let mut msg = vec![ok];
        put(&mut msg, &body);
        output.write_all(&msg)?;
        output.flush()?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_answers_each_request_and_ends_with_its_input() {
        let mut input = Vec::new();
        for (src, opts) in [("ok", vec!["-a".to_string()]), ("bad", vec![])] {
            input.extend_from_slice(&(opts.len() as u64).to_le_bytes());
            for o in &opts {
                put(&mut input, o.as_bytes());
            }
            put(&mut input, src.as_bytes());
        }
        let mut out = Vec::new();
        serve(&mut input.as_slice(), &mut out, |s, o| if s == "ok" { Ok(format!("{s}{}", o.join("")).into_bytes()) } else { Err("log".into()) }).unwrap();
        let mut r = out.as_slice();
        let mut ok = [0u8; 1];
        r.read_exact(&mut ok).unwrap();
        assert_eq!((ok[0], get(&mut r).unwrap()), (1, b"ok-a".to_vec()));
        r.read_exact(&mut ok).unwrap();
        assert_eq!((ok[0], get(&mut r).unwrap()), (0, b"log".to_vec()));
        assert!(r.is_empty());
    }
}
