//! The source side of sharded transfer: a trainer rank's publisher serves
//! shards of global tensors with their placement, and what an engine's IPC
//! and network sources decode from it carries that placement. Real
//! publishers on real Unix sockets and TCP connections; the engine side is
//! the library's own sources (`IpcSource`, `NetSource`), stopped after the
//! manifest (the plan that uses placements is not part of these tests).

mod common;

use common::sharded::pull;
use parking_lot::Mutex;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weight_manager_core::internals::source::ipc::{IpcOptions, IpcSource};
use weight_manager_core::internals::source::net::{NetOptions, NetSource};
use weight_manager_core::internals::source::Source;
use weight_manager_core::internals::transport::auth::Secret;
use weight_manager_core::internals::transport::conn::Conn;
use weight_manager_core::internals::wire::Frame;
use weight_manager_core::wm_result;
use weight_manager_core::DType;
use weight_manager_core::{Manifest, Placement, TensorMeta};
use weight_manager_core::{Publisher, PublisherConfig, TensorDesc};

const SECRET: &str = "shards-secret-0123456789";

fn at(global: &[u64], offset: &[u64]) -> Placement {
    Placement {
        global_shape: global.to_vec(),
        offset: offset.to_vec(),
    }
}

/// Trainer rank `r` of 2 holds rows `2r..2r+2` of a [4, 3] f32 "w" (split
/// in two shards of one row each, as a rank may hold several) and the
/// whole "b".
fn add_rank_shards(p: &Publisher, r: u64, data: &[f32; 6], b: &[f32; 3]) {
    let row = |i: usize| data[i * 3..].as_ptr().cast::<u8>();
    // SAFETY: `data` and `b` outlive the publisher's serving (the callers
    // keep them until serve returns).
    unsafe {
        p.add(
            TensorDesc::host("w", DType::F32, &[1, 3], row(0), 12)
                .shard_of(at(&[4, 3], &[2 * r, 0])),
        )
        .unwrap();
        p.add(
            TensorDesc::host("w", DType::F32, &[1, 3], row(1), 12)
                .shard_of(at(&[4, 3], &[2 * r + 1, 0])),
        )
        .unwrap();
        p.add(TensorDesc::host(
            "b",
            DType::F32,
            &[3],
            b.as_ptr().cast(),
            12,
        ))
        .unwrap();
    }
}

fn by_name<'m>(m: &'m Manifest, name: &str) -> Vec<&'m TensorMeta> {
    m.tensors.iter().filter(|t| t.name == name).collect()
}

/// The manifest of trainer rank `r`, as an engine decoded it.
fn check_rank_manifest(m: &Manifest, r: u64) {
    let w = by_name(m, "w");
    let offsets: Vec<Vec<u64>> = w.iter().map(|t| t.offset()).collect();
    assert_eq!(offsets, vec![vec![2 * r, 0], vec![2 * r + 1, 0]]);
    for t in &w {
        assert_eq!(t.shape, vec![1, 3]);
        assert_eq!(t.global_shape(), &[4, 3]);
        assert!(t.checksum.is_some(), "shards are hashed like tensors");
    }
    let b = by_name(m, "b");
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].placement, None, "a whole tensor stays whole");
}

fn ipc_manifest(sock: &Path) -> weight_manager_core::Result<Manifest> {
    let opts = IpcOptions {
        socket: sock.to_path_buf(),
        pull: pull(0, 1),
        allow_other_uids: false,
        gpu: 0,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let src = IpcSource::open(&opts, deadline, Arc::new(Mutex::new(Default::default())))?;
    Ok(src.manifest().clone())
}

/// Serve one engine on `p` while `engine` runs; the engine stops after
/// the manifest, so the session's own result is not checked.
fn serve_one<T: Send>(p: &Publisher, engine: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(1, Duration::from_secs(20)));
        let out = engine();
        let _ = serving.join().unwrap();
        out
    })
}

/// Two trainer ranks, each its own publisher on its own socket, serve one
/// version together: an engine connects to each and gets each rank's
/// shards with their placement; together they cover the global tensor.
/// Nothing on the publisher ties them together beyond the version name.
#[test]
fn two_trainer_ranks_serve_their_shards_over_ipc() {
    let dir = tempfile::tempdir().unwrap();
    let data = [[1.0f32, 2., 3., 4., 5., 6.], [7., 8., 9., 10., 11., 12.]];
    let b = [0.5f32; 3];
    let mut rows = Vec::new();
    for r in 0..2u64 {
        let sock = dir.path().join(format!("trainer{r}.sock"));
        let p = Publisher::bind(&sock, PublisherConfig::default()).unwrap();
        add_rank_shards(&p, r, &data[r as usize], &b);
        p.set_version(Some("step-7".into()));
        if r == 1 {
            // A published copy keeps the placements too.
            p.publish().unwrap();
        }
        let m = serve_one(&p, || ipc_manifest(&sock).unwrap());
        assert_eq!(m.version.as_deref(), Some("step-7"));
        check_rank_manifest(&m, r);
        rows.extend(by_name(&m, "w").iter().map(|t| t.offset()[0]));
    }
    rows.sort();
    assert_eq!(rows, vec![0, 1, 2, 3], "the two publishers cover 'w'");
}

/// The network publisher's manifest (sealed frames, after the challenge)
/// carries the same placements.
#[test]
fn a_network_publisher_serves_shards_with_their_placement() {
    if weight_manager_core::internals::transport::ucx::ucx().is_err() {
        println!("skipped: UCX is not installed");
        return;
    }
    std::env::set_var("UCX_TLS", "tcp");
    let cfg = PublisherConfig {
        secret: Some(SECRET.as_bytes().to_vec()),
        ..Default::default()
    };
    let p = Publisher::bind_net("127.0.0.1:0", cfg).unwrap();
    let data = [7.0f32, 8., 9., 10., 11., 12.];
    let b = [0.5f32; 3];
    add_rank_shards(&p, 1, &data, &b);
    p.set_version(Some("step-7".into()));
    let opts = NetOptions {
        address: p.address(),
        pull: pull(0, 1),
        secret: Secret::resolve(Some(SECRET.as_bytes())).unwrap(),
        bucket_size: 1 << 20,
        depth: 2,
        direct: false,
        keyed: false,
    };
    let m = serve_one(&p, || {
        let src = NetSource::open(opts, Instant::now() + Duration::from_secs(20)).unwrap();
        src.manifest().clone()
    });
    check_rank_manifest(&m, 1);
}

/// A shard to add (name, dtype, box, placement, rank) and the error it gets.
type AddCase<'a> = (
    &'a str,
    DType,
    &'a [u64],
    Option<Placement>,
    Option<u32>,
    &'a str,
);

/// Each shard refused beside the accepted ones, with the words its error
/// must contain.
fn refused_shard_cases() -> [AddCase<'static>; 7] {
    [
        (
            "x",
            DType::U8,
            &[2, 4],
            Some(at(&[4, 4], &[3, 0])),
            None,
            "dimension 0: offset 3",
        ),
        (
            "x",
            DType::U8,
            &[2, 4],
            Some(at(&[4], &[0])),
            None,
            "2 dimensions",
        ),
        (
            "w",
            DType::U8,
            &[2, 4],
            Some(at(&[4, 4], &[0, 0])),
            Some(3),
            "offset [0, 0]",
        ),
        (
            "w",
            DType::U8,
            &[4, 4],
            None,
            Some(2),
            "both whole and as shards",
        ),
        (
            "w",
            DType::U8,
            &[2, 4],
            Some(at(&[8, 4], &[4, 0])),
            Some(2),
            "disagree",
        ),
        (
            "w",
            DType::U16,
            &[1, 4],
            Some(at(&[4, 4], &[2, 0])),
            Some(2),
            "disagree",
        ),
        (
            "x",
            DType::F64,
            &[1],
            Some(at(&[u64::MAX], &[0])),
            None,
            "(global)",
        ),
    ]
}

/// Placements are checked when added, naming the tensor: a box outside the
/// global shape, a duplicate offset, a whole tensor beside its shards, and
/// shards that disagree on the global tensor are refused; the same offset
/// for two different engine ranks is not a duplicate.
#[test]
fn bad_shards_are_refused_when_added() {
    let dir = tempfile::tempdir().unwrap();
    let p = Publisher::bind(&dir.path().join("p.sock"), PublisherConfig::default()).unwrap();
    let data = [0u8; 64];
    let add = |name: &str, dtype, shape: &[u64], pl: Option<Placement>, rank| {
        let len = shape.iter().product::<u64>() as usize * DType::size(dtype);
        // SAFETY: `data` outlives the publisher; nothing is served.
        unsafe {
            p.add(TensorDesc {
                placement: pl,
                ..TensorDesc::host(name, dtype, shape, data.as_ptr(), len).for_rank(rank)
            })
        }
    };
    add("w", DType::U8, &[2, 4], Some(at(&[4, 4], &[0, 0])), None).unwrap();
    add("w", DType::U8, &[2, 4], Some(at(&[4, 4], &[2, 0])), Some(0)).unwrap();
    add("w", DType::U8, &[1, 4], Some(at(&[4, 4], &[3, 0])), Some(1)).unwrap();
    add("v", DType::U8, &[2], Some(at(&[4], &[2])), Some(0)).unwrap();
    add("v", DType::U8, &[2], Some(at(&[4], &[2])), Some(1)).unwrap();
    let cases = refused_shard_cases();
    for (name, dtype, shape, pl, rank, want) in cases {
        let e = add(name, dtype, shape, pl, rank).unwrap_err();
        assert_eq!(e.code, wm_result::WM_ERR_INVALID_ARGUMENT, "{want}: {e}");
        assert!(e.message.contains(&format!("'{name}'")), "{e}");
        assert!(e.message.contains(want), "{want}: {e}");
    }
}

/// An engine of another protocol version gets the publisher's reason in
/// an ERROR frame, not a hang-up.
#[test]
fn an_engine_of_another_protocol_version_is_told_why() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("p.sock");
    let p = Publisher::bind(&sock, PublisherConfig::default()).unwrap();
    std::thread::scope(|s| {
        let serving = s.spawn(|| p.serve(1, Duration::from_secs(5)));
        let mut hello = Frame::Hello {
            rank: 0,
            world_size: 1,
            gpu_id: "0".into(),
            version: String::new(),
            base: String::new(),
        }
        .encode();
        hello[9..13].copy_from_slice(&2u32.to_le_bytes()); // protocol 2
        let mut stream = UnixStream::connect(&sock).unwrap();
        std::io::Write::write_all(&mut stream, &hello).unwrap();
        let mut conn = Conn::new(stream, "the publisher");
        let e = conn
            .recv(Instant::now() + Duration::from_secs(10))
            .unwrap_err();
        assert!(
            e.message.contains("protocol version 2 and the publisher "),
            "{e}"
        );
        assert!(serving.join().unwrap().is_err(), "no engine was admitted");
    });
}

/// The C functions: a placement struct filled by its `_init` and set is
/// taken; NULL, a wrong `struct_size` or NULL arrays are refused with their
/// codes, naming the tensor in the publisher's last error.
#[test]
fn the_c_placement_struct_is_checked() {
    use std::ffi::CString;
    use weight_manager::publisher::*;
    use weight_manager::result::wm_result;
    let dir = tempfile::tempdir().unwrap();
    let path = CString::new(dir.path().join("c.sock").to_str().unwrap()).unwrap();
    let mut p = std::ptr::null_mut();
    // SAFETY: every pointer below is valid for the call; `data` outlives
    // the publisher, which serves nothing.
    unsafe {
        assert_eq!(
            wm_publisher_create(path.as_ptr(), std::ptr::null(), &mut p),
            wm_result::WM_OK
        );
        let name = CString::new("layers.0.w").unwrap();
        let (shape, global, offset) = ([2u64, 4], [6u64, 4], [4u64, 0]);
        let data = [0u8; 8];
        let mut pl = std::mem::MaybeUninit::<wm_shard_placement>::uninit();
        assert_eq!(wm_shard_placement_init(pl.as_mut_ptr()), wm_result::WM_OK);
        let mut pl = pl.assume_init();
        let add = |pl: *const wm_shard_placement| {
            let (ptr, dims) = (shape.as_ptr(), shape.len());
            let u8_ = DType::U8 as u32;
            wm_publisher_add_shard(
                p,
                name.as_ptr(),
                u8_,
                ptr,
                dims,
                pl,
                data.as_ptr().cast(),
                8,
                -1,
            )
        };
        let last_error = || {
            let mut buf = [0 as std::ffi::c_char; 512];
            let mut n = 0;
            wm_publisher_last_error(p, buf.as_mut_ptr(), buf.len(), &mut n);
            std::ffi::CStr::from_ptr(buf.as_ptr())
                .to_string_lossy()
                .into_owned()
        };
        assert_eq!(add(&pl), wm_result::WM_ERR_NULL_ARGUMENT, "arrays unset");
        assert!(last_error().contains("'layers.0.w': placement global_shape is NULL"));
        assert_eq!(add(std::ptr::null()), wm_result::WM_ERR_NULL_ARGUMENT);
        pl.global_shape = global.as_ptr();
        pl.offset = offset.as_ptr();
        pl.struct_size -= 8;
        assert_eq!(add(&pl), wm_result::WM_ERR_STRUCT_SIZE);
        pl.struct_size += 8;
        assert_eq!(add(&pl), wm_result::WM_OK, "{}", last_error());
        assert_eq!(
            add(&pl),
            wm_result::WM_ERR_INVALID_ARGUMENT,
            "same offset twice"
        );
        assert!(last_error().contains("'layers.0.w'"), "{}", last_error());
        // GPU memory is checked with the driver: an address that is none
        // is refused naming the tensor, with or without a GPU.
        let u8_ = DType::U8 as u32;
        let (ptr, dims) = (shape.as_ptr(), shape.len());
        let rc =
            wm_publisher_add_device_shard(p, name.as_ptr(), u8_, ptr, dims, &pl, 0x1000, 8, 0, -1);
        assert_ne!(rc, wm_result::WM_OK);
        assert!(last_error().contains("'layers.0.w'"), "{}", last_error());
        wm_publisher_destroy(p);
    }
}
