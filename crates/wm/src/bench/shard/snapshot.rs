//! `wm bench shard`, section snapshot: 4 engine ranks, each a separate
//! process (`wm bench shard-snapshot-rank`), slicing one whole-tensor checkpoint
//! (bf16 [8192, 4096] layers, 64 MiB each) by rows (outer dimension) or by
//! columns (inner: a 2 KiB segment of every 8 KiB row), unverified and
//! verified with block sums. Every figure beside its floor or target:
//!
//! - bytes read by all ranks together (each rank's `rchar` from
//!   `/proc/<pid>/io` around its update, plus the bytes it read out of
//!   mapped windows) / checkpoint bytes: target at
//!   most 1.05 for outer splits; inner splits verified read every block;
//! - bytes moved by each rank / bytes of its params: 1.00;
//! - each rank's update GB/s beside the faster of a plain `pread` of the
//!   same byte ranges into the same buffers and copies of them out of one
//!   mapping of the file, on as many threads as the library's copier, in
//!   the same process (target at least 0.8 unverified; the floor was
//!   `pread` alone until 2026-11-28);
//!   verified, the floor also hashes those bytes once (xxh3-128), the
//!   least verification costs. The library does more for a verified
//!   slice: each block read is hashed against its sum, the wanted bytes
//!   are hashed for the applier, which hashes them again as they land,
//!   and they are copied out of the read buffer; so no target is set.
//!
//! The ranks run at once, so on a small machine they share its cores: the
//! floor is measured under the same load, alternating with the updates.
//! Verified and unverified runs read the same directory (block sums are
//! read only when verifying).

use super::{Args, Row};
use crate::bench::harness::process::Proc;
use crate::bench::harness::{best, buffer, Scratch};
use crate::bench::model::warm;
use crate::fixtures;
use crate::fmt::{self, gbps};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use weight_manager_core::checkpoint::{checksums, safetensors_file};
use weight_manager_core::internals::memory::copy::default_threads;
use weight_manager_core::DType;
use weight_manager_core::Mode;
use weight_manager_core::ParamSpec;
use weight_manager_core::Piece;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};

const RANKS: u64 = 4;
const FILE: &str = "model.safetensors";
const SHAPE: [u64; 2] = [8192, 4096];
const LAYER: u64 = SHAPE[0] * SHAPE[1] * 2;

/// What one rank measured (`rank ...` line of its output).
struct RankResult {
    read: u64,
    moved: u64,
    param_bytes: u64,
    update: Duration,
    floor: Duration,
}

/// `wm bench shard-snapshot-rank` options (one rank, a child process).
#[derive(clap::Args, Debug)]
pub struct RankArgs {
    /// The checkpoint's folder
    #[arg(long)]
    dir: PathBuf,
    #[arg(long, default_value_t = 0)]
    rank: u64,
    /// The dimension split
    #[arg(long, default_value_t = 0)]
    split: usize,
    /// Verify with block sums
    #[arg(long, value_name = "true|false", default_value = "false", action = clap::ArgAction::Set, value_parser = crate::truth)]
    verify: bool,
}

pub fn run(a: &Args) -> Result<Vec<Row>, String> {
    let gib = a.gib(2.0);
    let layers = ((gib * (1u64 << 30) as f64) / LAYER as f64).ceil().max(1.0) as u64;
    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let scratch = Scratch::new(&base, "wm-bench-shard-snapshot")?;
    let dir = &scratch.0;
    write_checkpoint(&dir.join(FILE), layers)?;
    checksums::write(dir, default_threads()).map_err(|e| e.to_string())?;
    let total = layers * LAYER;
    println!(
        "    checkpoint: {layers} bf16 layers of {SHAPE:?} ({}), {RANKS} rank processes at once, \
         {} copier thread(s) each",
        fmt::bytes(total),
        default_threads()
    );
    let mut rows = Vec::new();
    for (split, dim) in [("outer split", 0), ("inner split", 1)] {
        for verify in [false, true] {
            let results = run_ranks(dir, dim, verify)?;
            report(&mut rows, (split, dim, verify), total, &results);
        }
    }
    Ok(rows)
}

/// `layers` layers of random bf16 in `path`, read once (page cache warm).
fn write_checkpoint(path: &Path, layers: u64) -> Result<(), String> {
    let ts: Vec<_> = (0..layers)
        .map(|i| fixtures::tensor(format!("layers.{i}.w"), DType::Bf16, &SHAPE, 7))
        .collect();
    fixtures::write(path, &ts)?;
    drop(ts);
    warm(path)
}

/// Start every rank at once; wait for their results.
fn run_ranks(dir: &Path, dim: usize, verify: bool) -> Result<Vec<RankResult>, String> {
    let (split, verify) = (dim.to_string(), verify.to_string());
    let children: Vec<Proc> = (0..RANKS)
        .map(|r| {
            let rank = r.to_string();
            let mut args = vec!["bench", "shard-snapshot-rank", "--rank", &rank];
            args.extend(["--split", &split, "--verify", &verify, "--dir"]);
            args.push(dir.to_str().ok_or("the folder is not UTF-8")?);
            Proc::wm(&args)
        })
        .collect::<Result<_, _>>()?;
    children
        .into_iter()
        .enumerate()
        .map(|(r, mut child)| {
            let n = child.numbers_after("rank ");
            child.finish().map_err(|e| format!("rank {r}: {e}"))?;
            let n = n.map_err(|e| format!("rank {r}: {e}"))?;
            Ok(RankResult {
                read: n[0],
                moved: n[1],
                param_bytes: n[2],
                update: Duration::from_nanos(n[3]),
                floor: Duration::from_nanos(n[4]),
            })
        })
        .collect()
}

/// One configuration's figures: bytes read by all ranks / checkpoint
/// (target at most 1.05 for outer splits), and per rank bytes moved /
/// params (1.00) and GB/s beside its read floor (target 0.8 unverified).
fn report(
    rows: &mut Vec<Row>,
    (split, dim, verify): (&str, usize, bool),
    total: u64,
    rs: &[RankResult],
) {
    let how = if verify { "verified" } else { "unverified" };
    let read: u64 = rs.iter().map(|r| r.read).sum();
    let ratio = read as f64 / total as f64;
    rows.push(Row {
        what: format!("{split}, {how}: read by all ranks / checkpoint"),
        value: fmt::bytes(read),
        beside: format!("checkpoint {}", fmt::bytes(total)),
        ratio,
        ok: (dim == 0).then_some(ratio <= 1.05),
    });
    for (i, r) in rs.iter().enumerate() {
        rows.push(Row {
            what: format!("{split}, {how}: rank {i} moved / its params"),
            value: fmt::bytes(r.moved),
            beside: format!("params {}", fmt::bytes(r.param_bytes)),
            ratio: r.moved as f64 / r.param_bytes as f64,
            ok: Some(r.moved == r.param_bytes),
        });
        let (got, floor) = (gbps(r.moved, r.update), gbps(r.moved, r.floor));
        let kind = if verify { "read+xxh3" } else { "read" };
        rows.push(Row {
            what: format!("{split}, {how}: rank {i} GB/s"),
            value: format!("{got:.2} GB/s"),
            beside: format!("{kind} {floor:.2} GB/s"),
            ratio: got / floor,
            ok: (!verify).then_some(got / floor >= 0.8),
        });
    }
}

/// `wm bench shard-snapshot-rank`: one engine rank; prints `rank <bytes
/// read> <bytes moved> <param bytes> <update ns> <floor ns>`.
pub fn rank(a: &RankArgs) -> Result<(), String> {
    let (dir, r, dim, verify) = (a.dir.as_path(), a.rank, a.split, a.verify);
    let (_, header) =
        safetensors_file::open(&dir.join(FILE), Instant::now() + Duration::from_secs(60))
            .map_err(|e| e.to_string())?;
    // Declared before the manager: the params outlive it.
    let mut bufs: Vec<Vec<u8>> = Vec::new();
    let m = Manager::new(ManagerConfig {
        rank: r as u32,
        world_size: RANKS as u32,
        fallback_dir: None,
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let mut ranges = Vec::new();
    for t in &header.tensors {
        let len = t.shape[dim] / RANKS;
        let piece = Piece::narrow(&t.name, &t.shape, dim, r * len, len);
        let mut shape = t.shape.clone();
        shape[dim] = len;
        let mut spec = ParamSpec::host(&format!("{}.tp", t.name), t.dtype, &shape);
        spec.pieces = vec![piece];
        let mut b = buffer((shape[0] * shape[1] * 2) as usize);
        // SAFETY: the buffers live until the manager is dropped (end of fn).
        unsafe { m.register(&spec, b.as_mut_ptr(), b.len()) }.map_err(|e| e.to_string())?;
        ranges.extend(slice_ranges(
            t.offset,
            &t.shape,
            dim,
            r,
            b.as_mut_ptr() as usize,
        ));
        bufs.push(b);
    }
    let param_bytes: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    let mut run = 0;
    let mut update = || -> Result<(Duration, u64, u64), String> {
        run += 1;
        let mut req = UpdateRequest::snapshot(dir);
        (req.mode, req.verify, req.version) = (Mode::InPlace, verify, Some(format!("v{run}")));
        let (before, t) = (rchar()?, Instant::now());
        let stats = m.update(req).map_err(|e| e.to_string())?;
        Ok((t.elapsed(), rchar()? - before, stats.bytes))
    };
    update()?;
    let file = File::open(dir.join(FILE)).map_err(|e| e.to_string())?;
    let (mut read, mut moved, mut took) = (0, 0, Duration::MAX);
    let floor = best(|| {
        let (t, rd, mv) = update()?;
        (read, moved, took) = (rd, mv, took.min(t));
        read_floor(&file, &ranges, verify)
    })?;
    println!(
        "rank {read} {moved} {param_bytes} {} {}",
        took.as_nanos(),
        floor.as_nanos()
    );
    Ok(())
}

/// The file ranges rank `r` needs of a [rows, cols] bf16 tensor at `offset`,
/// each with where it goes in the param at `dst`: (file offset, length,
/// destination address).
fn slice_ranges(
    offset: u64,
    shape: &[u64],
    dim: usize,
    r: u64,
    dst: usize,
) -> Vec<(u64, u64, usize)> {
    let row = shape[1] * 2;
    if dim == 0 {
        let n = shape[0] / RANKS * row;
        return vec![(offset + r * n, n, dst)];
    }
    let seg = row / RANKS;
    (0..shape[0])
        .map(|i| (offset + i * row + r * seg, seg, dst + (i * seg) as usize))
        .collect()
}

/// The faster of two plain ways to bring `ranges` into their
/// destinations: `pread`s, and copies out of one mapping of the file (the
/// library reads short segments close together through mapped covering
/// reads, so `pread` alone could be the slower floor).
fn read_floor(file: &File, ranges: &[(u64, u64, usize)], hash: bool) -> Result<Duration, String> {
    let pread = pieces_floor(ranges, hash, |off, buf| file.read_exact_at(buf, off))?;
    let mapped = mapped_floor(file, ranges, hash)?;
    Ok(pread.min(mapped))
}

/// Copies of `ranges` out of one read-only mapping of `file`, mapping and
/// unmapping timed.
fn mapped_floor(file: &File, ranges: &[(u64, u64, usize)], hash: bool) -> Result<Duration, String> {
    use std::os::fd::AsRawFd;
    let len = file.metadata().map_err(|e| e.to_string())?.len() as usize;
    let t = Instant::now();
    // SAFETY: a fresh read-only mapping of the bench's own file, which
    // nobody truncates while it is mapped; unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("floor: mmap: {}", std::io::Error::last_os_error()));
    }
    let at = p as usize;
    let copied = pieces_floor(ranges, hash, |off, buf| {
        // SAFETY: every range lies in the file (its tensors' offsets), so
        // in the mapping; `buf` is the range's destination.
        unsafe {
            weight_manager_core::internals::memory::copy::copy_bytes(
                buf.as_mut_ptr(),
                (at + off as usize) as *const u8,
                buf.len(),
            )
        };
        Ok(())
    });
    // SAFETY: the mapping made above, no longer read.
    unsafe { libc::munmap(p, len) };
    copied?;
    Ok(t.elapsed())
}

/// `read` of `ranges` into their destinations, at most 8 MiB each, taken
/// from a shared counter by as many threads as the copier; with `hash`,
/// each piece is hashed once read. The time of all of it.
fn pieces_floor(
    ranges: &[(u64, u64, usize)],
    hash: bool,
    read: impl Fn(u64, &mut [u8]) -> std::io::Result<()> + Sync,
) -> Result<Duration, String> {
    const PIECE: u64 = 8 << 20;
    let pieces: Vec<(u64, u64, usize)> = ranges
        .iter()
        .flat_map(|&(off, len, dst)| {
            (0..len.div_ceil(PIECE)).map(move |i| {
                let at = i * PIECE;
                (off + at, PIECE.min(len - at), dst + at as usize)
            })
        })
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..default_threads())
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(off, len, dst)) = pieces.get(i) else {
                            return Ok(());
                        };
                        // SAFETY: the pieces are disjoint ranges of the rank's
                        // param buffers, which outlive the scope; no update runs.
                        let buf =
                            unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len as usize) };
                        read(off, buf)?;
                        if hash {
                            std::hint::black_box(weight_manager_core::checksum::of(buf));
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("floor thread"))
    })
    .map_err(|e| format!("floor: {e}"))?;
    Ok(t.elapsed())
}

/// Bytes this process has read so far: with `pread` (`rchar` of
/// `/proc/<pid>/io`) and out of mapped windows (`mapped_read_bytes`).
fn rchar() -> Result<u64, String> {
    let io = std::fs::read_to_string("/proc/self/io").map_err(|e| e.to_string())?;
    let rchar = io
        .lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| "no rchar in /proc/self/io".to_string())?;
    Ok(rchar + weight_manager_core::internals::memory::mapped_file::mapped_read_bytes())
}
