//! The publisher's own tests: how `publish` writes, reuses and hashes
//! its versions' shared buffers.

use super::*;
use crate::tensor::DType;

/// A fresh version's buffer is written whole (not faulted in, then
/// copied into): each tensor at its aligned offset, zeros between, and
/// every page of the file allocated, so no reader's fault has to.
#[test]
fn a_fresh_version_is_written_whole() {
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let p = Publisher::bind(&dir.path().join("p.sock"), PublisherConfig::default()).unwrap();
    let sizes = [3000usize, 5, 70_001, 1 << 20];
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| (i * 31 + j % 251 + 1) as u8).collect())
        .collect();
    for (i, d) in data.iter().enumerate() {
        // SAFETY: `d` outlives the publish, which copies it.
        unsafe { add_bytes(&p, &format!("t{i}"), d) };
    }
    p.set_version(Some("v".into()));
    p.publish().unwrap();
    let published = p.versions.published.lock();
    let offer = published.back().unwrap();
    let shared = offer.shared().unwrap();
    // SAFETY: the version's own bytes, kept while it is published.
    let all = unsafe { std::slice::from_raw_parts(shared.ptr(), shared.len()) };
    let Content::Tensors(ts) = &offer.content else {
        panic!("tensors")
    };
    let mut end = 0;
    for (t, d) in ts.iter().zip(&data) {
        let at = t.data.0 as usize - shared.ptr() as usize;
        assert_eq!(at % crate::wire::ALIGN as usize, 0);
        assert!(
            all[end..at].iter().all(|&b| b == 0),
            "gap before {}",
            t.name
        );
        assert_eq!(&all[at..at + d.len()], &d[..], "{}", t.name);
        end = at + d.len();
    }
    assert!(all[end..].iter().all(|&b| b == 0));
    // SAFETY: fstat on the buffer's own descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::fstat(shared.fd().as_raw_fd(), &mut st) }, 0);
    let page = crate::memory::page_size() as u64;
    let whole = (shared.len() as u64).next_multiple_of(page);
    assert!(
        st.st_blocks as u64 * 512 >= whole,
        "{} of {whole} bytes allocated",
        st.st_blocks * 512
    );
}

/// Buffers made by `prepare` before the first publish are the ones
/// every publish copies into: none of them creates a buffer. Nothing to
/// prepare, or too many buffers, is an error naming why.
#[test]
fn prepared_buffers_take_every_publish() {
    let dir = tempfile::tempdir().unwrap();
    let p = Publisher::bind(&dir.path().join("p.sock"), PublisherConfig::default()).unwrap();
    let e = p.prepare(0).unwrap_err();
    assert_eq!(e.code, crate::result::wm_result::WM_ERR_INVALID_ARGUMENT);
    assert!(e.message.contains("add the tensors"), "{e}");
    let data = vec![7u8; 5000];
    // SAFETY: `data` outlives the publishes, which copy it.
    unsafe { add_bytes(&p, "t", &data) };
    let e = p.prepare(MAX_PREPARED + 1).unwrap_err();
    assert!(e.message.contains("at most"), "{e}");
    let keep = p.cfg.keep_versions.max(1);
    let made = p.prepare(0).unwrap();
    assert_eq!(
        made,
        (keep as u64 + 1) * 5000,
        "keep_versions + 1 buffers of 5000 bytes"
    );
    let prepared: Vec<*mut u8> = p.versions.spare_ptrs();
    assert_eq!(prepared.len(), keep + 1);
    for k in 0..6u8 {
        // SAFETY: the trainer's tensor, not read while it is written.
        unsafe { std::ptr::write_bytes(data.as_ptr().cast_mut(), k, 5000) };
        p.set_version(Some(format!("v{k}")));
        p.publish().unwrap();
        let published = p.versions.published.lock();
        let at = published.back().unwrap().shared().unwrap().ptr();
        assert!(prepared.contains(&at), "publish {k} made a new buffer");
        // SAFETY: the version's own bytes, kept while it is published.
        let bytes = unsafe { std::slice::from_raw_parts(at, 5000) };
        assert!(bytes.iter().all(|&b| b == k), "version v{k}'s bytes");
    }
}

/// A publish of many tensors hashes each while copying it (one pass):
/// every checksum is the xxh3-128 of the copy.
#[test]
fn published_checksums_are_those_of_the_copies() {
    let dir = tempfile::tempdir().unwrap();
    let p = Publisher::bind(&dir.path().join("p.sock"), PublisherConfig::default()).unwrap();
    let data: Vec<Vec<u8>> = (0..16)
        .map(|i| (0..300_000 + i * 4099).map(|j| (j * 7 + i) as u8).collect())
        .collect();
    for (i, d) in data.iter().enumerate() {
        // SAFETY: `d` outlives the publish, which copies it.
        unsafe { add_bytes(&p, &format!("t{i}"), d) };
    }
    p.prepare(0).unwrap();
    p.set_version(Some("v".into()));
    p.publish().unwrap();
    let published = p.versions.published.lock();
    let Content::Tensors(ts) = &published.back().unwrap().content else {
        panic!("tensors")
    };
    for (t, d) in ts.iter().zip(&data) {
        // SAFETY: the version's own bytes, kept while it is published.
        let copy = unsafe { std::slice::from_raw_parts(t.data.0, t.len) };
        assert_eq!(copy, &d[..], "{}", t.name);
        assert_eq!(t.checksum, Some(crate::checksum::of(d)), "{}", t.name);
    }
}

/// Steady publishing with two versions kept cycles through the same
/// shared buffers (engines keep them mapped), with each version's bytes.
#[test]
fn publishing_reuses_the_buffers_of_dropped_versions() {
    let dir = tempfile::tempdir().unwrap();
    let p = Publisher::bind(&dir.path().join("p.sock"), PublisherConfig::default()).unwrap();
    let mut seen = Vec::new();
    for k in 0..6u8 {
        let data = vec![k; 3000];
        p.clear_tensors();
        // SAFETY: `data` outlives the publish, which copies it.
        unsafe { add_bytes(&p, "t", &data) };
        p.set_version(Some(format!("v{k}")));
        p.publish().unwrap();
        let published = p.versions.published.lock();
        let newest = published.back().unwrap();
        let Content::Tensors(ts) = &newest.content else {
            panic!("tensors")
        };
        let shared = newest.shared().unwrap();
        // SAFETY: the version's own bytes, kept while it is published.
        let bytes = unsafe { std::slice::from_raw_parts(ts[0].data.0, 3000) };
        assert!(bytes.iter().all(|&b| b == k));
        assert_eq!(ts[0].data.0, shared.ptr(), "first tensor at offset 0");
        seen.push(shared.ptr());
    }
    // v0 and v1 got new buffers; from v2 on each reuses the one of the
    // version it pushed out.
    assert_ne!(seen[0], seen[1]);
    for k in 2..6 {
        assert_eq!(seen[k], seen[k - 2], "{seen:?}");
    }
    // A version a session still serves is not reused: hold v4's offer.
    let held = p.versions.published.lock().front().cloned().unwrap();
    assert_eq!(held.version.as_deref(), Some("v4"));
    p.set_version(Some("v6".into()));
    p.publish().unwrap();
    let v6 = p
        .versions
        .published
        .lock()
        .back()
        .unwrap()
        .shared()
        .unwrap()
        .ptr();
    assert_ne!(v6, held.shared().unwrap().ptr());
}

/// Serve `bytes` as the U8 tensor `name`.
///
/// # Safety
/// `bytes` stays valid and unchanged while `p` serves it (until the
/// publishes that copy it are done).
unsafe fn add_bytes(p: &Publisher, name: &str, bytes: &[u8]) {
    let (n, shape) = (bytes.len(), [bytes.len() as u64]);
    let desc = TensorDesc::host(name, DType::U8, &shape, bytes.as_ptr(), n);
    // SAFETY: the caller's promise.
    unsafe { p.add(desc) }.unwrap();
}

/// One serve at a time: a second serve while one waits for its engines
/// is busy at once (two took each other's engines: one refused the second
/// engine, the other timed out), and serving works again after.
#[test]
fn a_second_serve_at_once_is_busy() {
    let dir = tempfile::tempdir().unwrap();
    let p = Publisher::bind(&dir.path().join("p.sock"), PublisherConfig::default()).unwrap();
    std::thread::scope(|s| {
        let first = s.spawn(|| p.serve(1, Duration::from_millis(600)));
        std::thread::sleep(Duration::from_millis(200));
        let e = p.serve(1, Duration::from_millis(10)).unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_BUSY, "{e}");
        let first = first.join().unwrap().unwrap_err();
        assert_eq!(
            first.code,
            crate::result::wm_result::WM_ERR_TIMEOUT,
            "{first}"
        );
    });
    let again = p.serve(1, Duration::from_millis(10)).unwrap_err();
    assert_eq!(
        again.code,
        crate::result::wm_result::WM_ERR_TIMEOUT,
        "{again}"
    );
}

/// Adds are checked against the tensors of their own name only (by an
/// index): 100,000 tensors go in one by one (each was compared with every
/// tensor before it), clashes are still refused, and set_dir or
/// clear_tensors start the index afresh.
#[test]
fn many_adds_check_clashes_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let p = Publisher::bind(&dir.path().join("p.sock"), PublisherConfig::default()).unwrap();
    let byte = [7u8];
    for i in 0..100_000 {
        // SAFETY: `byte` outlives `p`'s use of it (nothing is served).
        unsafe { add_bytes(&p, &format!("experts.{i}.w"), &byte) };
    }
    let desc = || TensorDesc::host("experts.77777.w", DType::U8, &[1], byte.as_ptr(), 1);
    // SAFETY: as above.
    let e = unsafe { p.add(desc()) }.unwrap_err();
    assert!(
        e.message.contains("'experts.77777.w'") && e.message.contains("already published"),
        "{e}"
    );
    p.clear_tensors();
    // SAFETY: as above.
    unsafe { add_bytes(&p, "experts.77777.w", &byte) };
    p.set_dir(dir.path());
    // SAFETY: as above.
    unsafe { add_bytes(&p, "experts.77777.w", &byte) };
    // SAFETY: as above.
    let e = unsafe { p.add(desc()) }.unwrap_err();
    assert!(e.message.contains("already published"), "{e}");
}

/// Adding together checks every tensor's own fields before comparing any
/// with the others: a batch whose second shard overlaps its first and
/// whose third has the wrong byte size is refused naming the third.
#[test]
fn adding_together_checks_each_tensors_own_fields_first() {
    let dir = tempfile::tempdir().unwrap();
    let p = Publisher::bind(&dir.path().join("p.sock"), PublisherConfig::default()).unwrap();
    let bytes = [0u8; 32];
    let placed = |offset: u64| crate::manifest::Placement {
        global_shape: vec![8, 4],
        offset: vec![offset, 0],
    };
    let rows = |offset| {
        TensorDesc::host("x", DType::U8, &[4, 4], bytes.as_ptr(), 16).shard_of(placed(offset))
    };
    let short = TensorDesc::host("y", DType::U8, &[8], bytes.as_ptr(), 3);
    // SAFETY: `bytes` outlives `p`'s use of it (nothing is served).
    let e = unsafe { p.add_all(vec![rows(0), rows(2), short]) }.unwrap_err();
    assert!(
        e.message.contains("tensor 2 of the 3 added together")
            && e.message.contains("3 bytes given"),
        "{e}"
    );
    // SAFETY: as above.
    let e = unsafe { p.add_all(vec![rows(0), rows(2)]) }.unwrap_err();
    assert!(
        e.message.contains("tensor 1 of the 2") && e.message.contains("overlaps"),
        "{e}"
    );
}

/// Adding together is all or nothing: a batch whose third tensor clashes
/// (with one published before, or with one earlier in the batch) is
/// refused naming its place, and none of it stays (each of its tensors can
/// be added alone afterwards); what was published before stays, a served
/// directory too, which a batch that goes through replaces.
#[test]
fn adding_together_adds_every_tensor_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let p = Publisher::bind(&dir.path().join("p.sock"), PublisherConfig::default()).unwrap();
    let byte = [7u8];
    let desc = |name| TensorDesc::host(name, DType::U8, &[1], byte.as_ptr(), 1);
    let names = |p: &Publisher| match &p.content.lock().content {
        Content::Tensors(ts) => ts.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
        Content::Dir(d) => vec![d.display().to_string()],
    };
    // SAFETY: `byte` outlives `p`'s use of it (nothing is served).
    unsafe { add_bytes(&p, "kept", &byte) };
    for clash in ["kept", "a"] {
        // SAFETY: as above.
        let e = unsafe { p.add_all(vec![desc("a"), desc("b"), desc(clash), desc("c")]) };
        let e = e.unwrap_err();
        assert!(
            e.message
                .starts_with("tensor 2 of the 4 added together (none was added): ")
                && e.message.contains(&format!("'{clash}'"))
                && e.message.contains("already published"),
            "{e}"
        );
        assert_eq!(names(&p), ["kept"]);
    }
    // SAFETY: as above.
    unsafe { p.add_all(vec![desc("a"), desc("b"), desc("c")]) }.unwrap();
    assert_eq!(names(&p), ["kept", "a", "b", "c"]);
    // A directory served so far stays served when the batch is refused.
    p.set_dir(dir.path());
    // SAFETY: as above.
    let e = unsafe { p.add_all(vec![desc("x"), desc("x")]) }.unwrap_err();
    assert!(e.message.starts_with("tensor 1 of the 2"), "{e}");
    assert_eq!(names(&p), [dir.path().display().to_string()]);
    // SAFETY: as above.
    unsafe { p.add_all(vec![desc("x")]) }.unwrap();
    assert_eq!(names(&p), ["x"]);
    // One refused alone reads as before, with no batch named.
    // SAFETY: as above.
    let e = unsafe { p.add(desc("x")) }.unwrap_err();
    assert!(
        e.message.starts_with("tensor 'x': already published"),
        "{e}"
    );
}
