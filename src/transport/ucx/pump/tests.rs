//! The pump's tests.

use super::*;

/// Two workers in one process over whatever transport UCX picks
/// (`UCX_TLS=tcp` in the test command): bytes arrive whole, tags match,
/// and a short buffer is an error, not an overflow.
#[test]
fn two_workers_exchange_tagged_messages() {
    if let Err(e) = ucx() {
        eprintln!("SKIP two_workers_exchange_tagged_messages: {e}");
        return;
    }
    let a = Pump::start("a").unwrap();
    let b = Pump::start("b").unwrap();
    a.connect(b.address()).unwrap();
    let src: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; src.len() + 100];
    let mut small = vec![0u8; 10];
    let deadline = Instant::now() + Duration::from_secs(20);
    unsafe {
        b.recv(7, dst.as_mut_ptr(), dst.len()).unwrap();
        a.send(7, src.as_ptr(), src.len()).unwrap();
        b.recv(8, small.as_mut_ptr(), small.len()).unwrap();
        a.send(8, src.as_ptr(), 100).unwrap();
    }
    let mut got = Vec::new();
    while got.len() < 2 {
        if let Some(c) = b.next(deadline).unwrap() {
            got.push(c);
        } else {
            panic!("no completion before the deadline");
        }
    }
    got.sort_by_key(|c| c.tag);
    assert_eq!(*got[0].result.as_ref().unwrap(), src.len());
    assert_eq!(&dst[..src.len()], &src[..]);
    assert!(got[1].result.is_err(), "{:?}", got[1]);
    drop(a);
    drop(b);
}
