//! Ranks reading slices of a whole-tensor checkpoint: verified with block
//! sums (`wm_checksums.json` written by `checksums::write`, as `wm
//! manifest` does), and read by the covering-read rule. Real files; the
//! bytes each update reads are measured from `/proc/self/io` (`rchar`,
//! what `pread` read) plus the bytes read out of mapped windows
//! (`mapped_read_bytes`), so the tests of this file run one at a time.

mod common;

use common::write_version;
use parking_lot::Mutex;
use std::path::Path;
use weight_manager_core::checkpoint::block_sums::BLOCK_SIZE;
use weight_manager_core::checkpoint::checksums::{self, CHECKSUM_FILE};
use weight_manager_core::internals::memory::mapped_file::{mapped_bytes, mapped_read_bytes};
use weight_manager_core::internals::source::reads::{MAX_GAP, SHORT_SEGMENT};
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::ParamSpec;
use weight_manager_core::Piece;
use weight_manager_core::{Manager, ManagerConfig, UpdateRequest};

/// `rchar` and `mapped_read_bytes` are per process: one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const MIB: u64 = 1 << 20;

/// An f32 tensor whose every 4-byte word differs (a misplaced row or
/// column cannot go unnoticed).
fn tensor(name: &str, shape: &[u64], seed: u32) -> common::T {
    let n: u64 = shape.iter().product();
    let h = name
        .bytes()
        .fold(seed, |a, b| a.wrapping_mul(31) ^ b as u32);
    let data = (0..n as u32)
        .flat_map(|i| (i.wrapping_mul(2_654_435_761) ^ h).to_le_bytes())
        .collect();
    common::T {
        name: name.into(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        data,
    }
}

/// The bytes of `piece`'s box of `t` in row-major order.
fn box_bytes(t: &common::T, piece: &Piece) -> Vec<u8> {
    let shape = &t.shape;
    let (off, len) = (&piece.global.offset, &piece.global.len);
    let mut out = Vec::new();
    let mut idx = vec![0u64; shape.len()];
    loop {
        let at: u64 = (0..shape.len()).fold(0, |a, d| a * shape[d] + off[d] + idx[d]);
        out.extend_from_slice(&t.data[at as usize * 4..at as usize * 4 + 4]);
        let mut d = shape.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < len[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Pieces stacked along dimension 0 of one param: their bytes back to back.
fn stacked(ts: &[&common::T], pieces: &[Piece]) -> Vec<u8> {
    ts.iter()
        .zip(pieces)
        .flat_map(|(t, p)| box_bytes(t, p))
        .collect()
}

fn manager() -> Manager {
    Manager::new(ManagerConfig {
        fallback_dir: None,
        ..Default::default()
    })
    .unwrap()
}

/// A param `name` of `shape` made of `pieces` (stacked along dim 0).
fn param(m: &Manager, name: &str, shape: &[u64], pieces: Vec<Piece>) -> &'static [u8] {
    let mut spec = ParamSpec::host(name, DType::F32, shape);
    spec.pieces = pieces;
    let (p, n) = m.allocate(&spec).unwrap();
    // The manager outlives every read in the test that made it.
    unsafe { std::slice::from_raw_parts(p, n) }
}

fn narrow(t: &common::T, dim: usize, start: u64, len: u64) -> Piece {
    Piece::narrow(&t.name, &t.shape, dim, start, len)
}

/// Write `ts` as `model.safetensors` in `dir`, at version `step`.
fn checkpoint(dir: &Path, ts: &[common::T], step: &str) {
    common::write_safetensors(&dir.join("model.safetensors"), ts);
    write_version(dir, step);
}

fn manifest(dir: &Path) {
    checksums::write(dir, 2).unwrap();
}

/// Bytes this process read so far: with `pread`, or through a mapping.
fn bytes_read() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap();
    let rchar: u64 = io
        .lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .unwrap()
        .parse()
        .unwrap();
    rchar + mapped_read_bytes()
}

/// Update `m` from `dir` (verified when `verify`), with the bytes the
/// process read meanwhile.
fn update(m: &Manager, dir: &Path, verify: bool) -> (weight_manager_core::Result<()>, u64) {
    let mut req = UpdateRequest::snapshot(dir);
    req.verify = verify;
    let before = bytes_read();
    let r = m.update(req).map(|_| ());
    (r, bytes_read() - before)
}

/// Flip one bit of byte `at` of tensor data (`model.safetensors`'s data
/// starts after its header; the tensor `first` is stored first).
fn flip(dir: &Path, tensor: &str, at: u64) {
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let meta: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header]).unwrap();
    let start = meta[tensor]["data_offsets"][0].as_u64().unwrap();
    bytes[8 + header + (start + at) as usize] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
}

/// A verified update of `m` fails naming `tensor` and `block`, and keeps
/// `param`'s bytes `old` and the version.
fn fails_naming(m: &Manager, dir: &Path, (tensor, block): (&str, u64), param: &[u8], old: &[u8]) {
    let version = m.status().version;
    let (r, _) = update(m, dir, true);
    let e = r.unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_CHECKSUM, "{e}");
    assert!(e.message.contains(&format!("tensor '{tensor}'")), "{e}");
    assert!(e.message.contains(&format!("block {block} ")), "{e}");
    assert!(param == old, "atomic: old bytes kept");
    assert_eq!(m.status().version, version);
}

#[test]
fn column_split_verified_with_block_sums() {
    let _one = ONE_AT_A_TIME.lock();
    let d = tempfile::tempdir().unwrap();
    // [512, 2048] f32: 4 MiB, rows of 8 KiB; 4 ranks take 512 columns each.
    let w = tensor("w", &[512, 2048], 1);
    checkpoint(d.path(), std::slice::from_ref(&w), "1");
    manifest(d.path());
    let ranks: Vec<_> = (0..4).map(|_| manager()).collect();
    let params: Vec<_> = (0..4)
        .map(|r| {
            param(
                &ranks[r],
                "w.tp",
                &[512, 512],
                vec![narrow(&w, 1, 512 * r as u64, 512)],
            )
        })
        .collect();
    for r in 0..4 {
        let (res, read) = update(&ranks[r], d.path(), true);
        res.unwrap();
        assert!(params[r] == box_bytes(&w, &narrow(&w, 1, 512 * r as u64, 512)));
        // Every row has a segment: every block is read.
        assert!(read >= 4 * MIB, "rank {r} read {read}");
    }
    // Row 300, column 700 (rank 1's slice).
    let old = params[1].to_vec();
    let at = 300 * 8192 + 2800;
    flip(d.path(), "w", at);
    fails_naming(&ranks[1], d.path(), ("w", at / BLOCK_SIZE), params[1], &old);
}

#[test]
fn row_split_reads_its_blocks_only() {
    let _one = ONE_AT_A_TIME.lock();
    let d = tempfile::tempdir().unwrap();
    // [1024, 1024] f32: 4 MiB; 4 ranks take 256 rows (1 MiB, whole blocks) each.
    let w = tensor("w", &[1024, 1024], 2);
    checkpoint(d.path(), std::slice::from_ref(&w), "1");
    manifest(d.path());
    let ranks: Vec<_> = (0..4).map(|_| manager()).collect();
    let pieces: Vec<_> = (0..4).map(|r| narrow(&w, 0, 256 * r, 256)).collect();
    let params: Vec<_> = (0..4)
        .map(|r| param(&ranks[r], "w.tp", &[256, 1024], vec![pieces[r].clone()]))
        .collect();
    for r in 0..4 {
        let (res, read) = update(&ranks[r], d.path(), true);
        res.unwrap();
        assert!(params[r] == box_bytes(&w, &pieces[r]));
        // Its blocks, plus headers and the checksum file: far from 4 MiB.
        assert!((MIB..2 * MIB).contains(&read), "rank {r} read {read}");
    }
    // A byte of rank 3's rows: rank 0 does not read it (and so cannot see
    // it); rank 3 fails naming its block.
    let at = 3 * MIB + 12_345;
    flip(d.path(), "w", at);
    write_version(d.path(), "2");
    let (res, _) = update(&ranks[0], d.path(), true);
    res.unwrap();
    assert_eq!(ranks[0].status().version.as_deref(), Some("2"));
    let old = params[3].to_vec();
    fails_naming(&ranks[3], d.path(), ("w", at / BLOCK_SIZE), params[3], &old);
}

#[test]
fn fused_qkv_from_three_tensors() {
    let _one = ONE_AT_A_TIME.lock();
    let d = tempfile::tempdir().unwrap();
    let q = tensor("q", &[512, 1024], 3);
    let k = tensor("k", &[128, 1024], 3);
    let v = tensor("v", &[128, 1024], 3);
    checkpoint(d.path(), &[q.clone(), k.clone(), v.clone()], "1");
    manifest(d.path());
    // TP rank 1 of 2: the second half of each, fused along rows.
    let pieces = vec![
        narrow(&q, 0, 256, 256),
        Piece {
            at: vec![256, 0],
            ..narrow(&k, 0, 64, 64)
        },
        Piece {
            at: vec![320, 0],
            ..narrow(&v, 0, 64, 64)
        },
    ];
    let m = manager();
    let qkv = param(&m, "qkv", &[384, 1024], pieces.clone());
    let (res, _) = update(&m, d.path(), true);
    res.unwrap();
    assert!(qkv == stacked(&[&q, &k, &v], &pieces));
    let old = qkv.to_vec();
    // Row 100 of k (inside the rank's rows 64..128).
    flip(d.path(), "k", 100 * 4096);
    fails_naming(&m, d.path(), ("k", 100 * 4096 / BLOCK_SIZE), qkv, &old);
}

#[test]
fn whole_tensors_fused_into_a_param_check_their_whole_checksums() {
    let _one = ONE_AT_A_TIME.lock();
    let d = tempfile::tempdir().unwrap();
    let ts = [
        tensor("q", &[256, 1024], 8),
        tensor("k", &[64, 1024], 8),
        tensor("v", &[64, 1024], 8),
    ];
    checkpoint(d.path(), &ts, "1");
    manifest(d.path());
    let pieces: Vec<Piece> = [0, 256, 320]
        .iter()
        .zip(&ts)
        .map(|(&row, t)| Piece {
            at: vec![row, 0],
            ..Piece::whole(&t.name, &t.shape)
        })
        .collect();
    let m = manager();
    let qkv = param(&m, "qkv", &[384, 1024], pieces);
    update(&m, d.path(), true).0.unwrap();
    assert!(
        qkv == stacked(
            &[&ts[0], &ts[1], &ts[2]],
            &[
                Piece::whole("q", &ts[0].shape),
                Piece::whole("k", &ts[1].shape),
                Piece::whole("v", &ts[2].shape),
            ]
        )
    );
    // k moves whole to row 256: its whole checksum applies, no block is
    // needed (the applier's error, not a block's).
    let old = qkv.to_vec();
    flip(d.path(), "k", 1000);
    let e = update(&m, d.path(), true).0.unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_CHECKSUM, "{e}");
    assert!(
        e.message.contains("tensor 'k'") && !e.message.contains("block"),
        "{e}"
    );
    assert!(qkv == old);
}

#[test]
fn expert_range_verified_and_corruption_named() {
    let _one = ONE_AT_A_TIME.lock();
    let d = tempfile::tempdir().unwrap();
    // 8 experts of [256, 512] f32 (512 KiB each); the rank takes 3..6.
    let e = tensor("experts", &[8, 256, 512], 4);
    checkpoint(d.path(), std::slice::from_ref(&e), "1");
    manifest(d.path());
    let m = manager();
    let piece = narrow(&e, 0, 3, 3);
    let p = param(&m, "experts.ep", &[3, 256, 512], vec![piece.clone()]);
    let (res, read) = update(&m, d.path(), true);
    res.unwrap();
    assert!(p == box_bytes(&e, &piece));
    // Experts 3..6 are bytes 1.5..3 MiB: the blocks covering them.
    let blocks = 3 * MIB / BLOCK_SIZE - 3 * MIB / 2 / BLOCK_SIZE;
    let covering = blocks * BLOCK_SIZE;
    assert!(
        (covering..covering + MIB / 4).contains(&read),
        "read {read}"
    );
    let old = p.to_vec();
    let at = 5 * 512 * 1024 + 77;
    flip(d.path(), "experts", at);
    fails_naming(&m, d.path(), ("experts", at / BLOCK_SIZE), p, &old);
}

/// Remove the block sums from the checksum file (as written before they
/// existed).
fn strip_blocks(dir: &Path) {
    let path = dir.join(CHECKSUM_FILE);
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("block_size");
    for f in json["files"].as_object_mut().unwrap().values_mut() {
        f.as_object_mut().unwrap().remove("blocks");
    }
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
}

#[test]
fn old_checksum_files_verify_whole_tensors_and_refuse_slices() {
    let _one = ONE_AT_A_TIME.lock();
    let d = tempfile::tempdir().unwrap();
    let w = tensor("w", &[256, 1024], 5);
    checkpoint(d.path(), std::slice::from_ref(&w), "1");
    manifest(d.path());
    strip_blocks(d.path());
    let whole = manager();
    let p = param(&whole, "w", &[256, 1024], vec![]);
    update(&whole, d.path(), true).0.unwrap();
    assert!(p == w.data);
    let sliced = manager();
    param(&sliced, "w.tp", &[128, 1024], vec![narrow(&w, 0, 0, 128)]);
    let e = update(&sliced, d.path(), true).0.unwrap_err();
    assert_eq!(e.code, wm_result::WM_ERR_MISMATCH, "{e}");
    assert!(e.message.contains("block sums with `wm manifest"), "{e}");
    // Not verifying, the slice is read as before.
    update(&sliced, d.path(), false).0.unwrap();
}

#[test]
fn short_close_segments_share_a_covering_read_and_others_do_not() {
    let _one = ONE_AT_A_TIME.lock();
    // Columns of 512 B (128 f32) in rows of `row` bytes; no checksum file.
    let (seg, rows) = (512, 256);
    for (row, covering) in [(seg + MAX_GAP, true), (seg + MAX_GAP + 1024, false)] {
        assert!(seg < SHORT_SEGMENT);
        let d = tempfile::tempdir().unwrap();
        let cols = row / 4;
        let w = tensor("w", &[rows, cols], 6);
        checkpoint(d.path(), std::slice::from_ref(&w), "1");
        let m = manager();
        let piece = narrow(&w, 1, cols - 128, 128);
        let p = param(&m, "w.tp", &[rows, 128], vec![piece.clone()]);
        let mapped = mapped_bytes();
        let (res, read) = update(&m, d.path(), false);
        res.unwrap();
        let mapped = mapped_bytes() - mapped;
        assert!(p == box_bytes(&w, &piece), "row {row}");
        // Covering: one mapped read spanning every row's segment, of which
        // only the segments are read; otherwise a `pread` per segment.
        let (wanted, span) = (rows * seg, (rows - 1) * row + seg);
        assert!(read < wanted + 64 * 1024, "row {row}: read {read}");
        match covering {
            true => assert!(mapped >= span, "row {row}: mapped {mapped} < {span}"),
            false => assert_eq!(mapped, 0, "row {row}"),
        }
    }
}

/// Rewrite the checksum file of `dir` with `edit` applied to its JSON.
fn edit_sums(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    manifest(dir);
    let path = dir.join(CHECKSUM_FILE);
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
}

#[test]
fn hostile_block_sums_are_refused_naming_the_field() {
    let _one = ONE_AT_A_TIME.lock();
    let d = tempfile::tempdir().unwrap();
    let w = tensor("w", &[1024, 1024], 7);
    checkpoint(d.path(), std::slice::from_ref(&w), "1");
    let blocks = |j: &mut serde_json::Value| -> String {
        j["files"]["model.safetensors"]["blocks"]["w"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let count = 4 * MIB / BLOCK_SIZE;
    let short = format!(
        "blocks of 'w' in model.safetensors: {} hex digits hold {} block sums",
        32 * (count - 1),
        count - 1
    );
    let doubled = format!("are {} blocks", count / 2);
    type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(move |j| {
                let b = blocks(j);
                j["files"]["model.safetensors"]["blocks"]["w"] = b[32..].into();
            }),
            &short,
        ),
        (
            Box::new(|j| j["block_size"] = 3.into()),
            "block_size 3 is not a power of two",
        ),
        (
            Box::new(|j| j["block_size"] = (BLOCK_SIZE * 2).into()),
            &doubled,
        ),
        (
            Box::new(|j| j["block_size"] = u64::MAX.into()),
            "block_size 18446744073709551615",
        ),
        (
            Box::new(|j| j["block_size"] = serde_json::json!(1e30)),
            "block_size",
        ),
        (
            Box::new(|j| {
                j.as_object_mut().unwrap().remove("block_size");
            }),
            "blocks of model.safetensors given without block_size",
        ),
        (
            Box::new(move |j| {
                let b = blocks(j).replacen(|c: char| c.is_ascii_hexdigit(), "g", 1);
                j["files"]["model.safetensors"]["blocks"]["w"] = b.into();
            }),
            "the sum of block 0 is not 32 hex digits",
        ),
    ];
    let m = manager();
    param(&m, "w.tp", &[512, 1024], vec![narrow(&w, 0, 0, 512)]);
    for (edit, want) in cases {
        edit_sums(d.path(), edit);
        let e = update(&m, d.path(), true).0.unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_FORMAT, "{want}: {e}");
        assert!(e.message.contains(want), "{want}: {e}");
        assert!(e.message.contains(CHECKSUM_FILE), "{e}");
    }
    assert_eq!(m.status().version, None);
}

#[test]
fn unverified_slices_read_only_their_segments_even_with_block_sums() {
    let _one = ONE_AT_A_TIME.lock();
    let d = tempfile::tempdir().unwrap();
    // [512, 2048] f32 rows of 8 KiB, 2 KiB per row for rank 1: one mapped
    // covering read of the rows, of which only the segments are read.
    let w = tensor("w", &[512, 2048], 1);
    checkpoint(d.path(), std::slice::from_ref(&w), "1");
    manifest(d.path());
    let m = manager();
    let piece = narrow(&w, 1, 512, 512);
    let p = param(&m, "w.tp", &[512, 512], vec![piece.clone()]);
    // A flipped byte in another rank's columns of a block rank 1 reads
    // from when verifying: unverified, it reads neither it nor its block.
    flip(d.path(), "w", 300 * 8192 + 100);
    let mapped = mapped_bytes();
    let (r, read) = update(&m, d.path(), false);
    r.unwrap();
    assert!(p == box_bytes(&w, &piece));
    assert!(read < 2 * MIB, "read {read} bytes for a 1 MiB slice");
    // The rows were covered by mappings (the gaps mapped, not read).
    assert!(mapped_bytes() - mapped >= 4 * MIB - 8192);
}
