//! What a WANT may cost a publisher, checked before anything is planned:
//! its size (requests, runs, blocks: an engine checks its own before it
//! sends), and the pieces the requests are cut into at the bucket size
//! and the runs those pieces walk (once the bucket size is known).

use super::buckets::PACK_BELOW;
use super::want::{Request, MAX_BLOCKS, MAX_REQUESTS, MAX_RUNS};
use crate::result::{Error, Result};

/// Check a WANT's size against what a publisher refuses by size alone
/// (more than [`MAX_REQUESTS`] requests, [`MAX_RUNS`] runs or
/// [`MAX_BLOCKS`] blocks), so that an engine finds it before it sends:
/// `WM_ERR_UNSUPPORTED` naming the count.
pub fn check_size(requests: &[Request]) -> Result<()> {
    let runs: usize = requests.iter().map(|q| q.runs.len()).sum();
    let blocks = requests
        .iter()
        .map(Request::blocks)
        .fold(0, u64::saturating_add);
    let over = [
        (requests.len() as u64, MAX_REQUESTS as u64, "requests"),
        (runs as u64, MAX_RUNS as u64, "runs"),
        (blocks, MAX_BLOCKS, "blocks"),
    ]
    .into_iter()
    .find(|&(n, most, _)| n > most);
    match over {
        None => Ok(()),
        Some((n, most, what)) => Err(Error::unsupported(format!(
            "a WANT of {n} {what}: a publisher serves at most {most} in one"
        ))),
    }
}

/// Most pieces (bucket entries, and network messages) a session's
/// requests may be cut into: each is 32 bytes the publisher holds while
/// it serves them, and a READY may ask for buckets of 256 bytes.
pub const MAX_PIECES: u64 = 1 << 24;

/// Most runs passed over, in all, finding where a session's pieces start.
/// A piece of a request walks its runs from the first to the one holding
/// its first byte (a few nanoseconds each), so 2^20 runs in buckets of 256
/// bytes (a 32 MB WANT) would take the publisher minutes; a request's
/// runs are few where its rows are equally spaced.
pub const MAX_RUN_STEPS: u64 = 1 << 30;

/// Check what cutting `requests` into buckets of `bucket` bytes costs,
/// before any is planned: at most [`MAX_PIECES`] pieces, and at most
/// [`MAX_RUN_STEPS`] runs passed over (each request's runs, once per
/// piece). `messages`: the buckets go over the network, as messages of at
/// least `PACK_BELOW` bytes where blocks are smaller (counted as if all
/// were that small).
pub fn check_cuts(requests: &[Request], bucket: u64, messages: bool) -> Result<()> {
    let cut = match messages {
        true => bucket.clamp(1, PACK_BELOW),
        false => bucket.max(1),
    };
    let (mut pieces, mut steps, mut runs) = (0u64, 0u64, 0usize);
    for q in requests {
        let n = q.bytes() / cut + 2;
        pieces = pieces.saturating_add(n);
        steps = steps.saturating_add((q.runs.len() as u64).saturating_mul(n));
        runs += q.runs.len();
    }
    let what = format!(
        "WANT's {} requests in buckets of {bucket} bytes",
        requests.len()
    );
    if pieces > MAX_PIECES {
        return Err(Error::peer(format!(
            "{what}: {pieces} pieces to plan, at most {MAX_PIECES} (larger buckets)"
        )));
    }
    if steps > MAX_RUN_STEPS {
        return Err(Error::peer(format!(
            "{what}: their {runs} runs passed over {steps} times finding where pieces \
             start, at most {MAX_RUN_STEPS} (fewer runs, or larger buckets)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::want::tests::run;

    /// A WANT over a publisher's limits by size alone is found before it
    /// is sent, naming the count.
    #[test]
    fn wants_too_large_for_a_publisher_are_found_before_sending() {
        let rows = |n| Request {
            tensor: 0,
            runs: vec![run(0, 1, n, 2)],
            sums: false,
        };
        assert!(check_size(&[rows(MAX_BLOCKS)]).is_ok());
        let e = check_size(&[rows(MAX_BLOCKS), rows(1)]).unwrap_err();
        assert!(e.message.contains("a WANT of 16777217 blocks"), "{e}");
        let many = vec![Request::whole(0, 8, false); MAX_REQUESTS + 1];
        let e = check_size(&many).unwrap_err();
        assert!(e.message.contains("1048577 requests"), "{e}");
    }

    /// Runs are passed over once per piece a request is cut into: many
    /// runs in small buckets are refused, few runs (or large buckets) not;
    /// so are too many pieces, however few runs.
    #[test]
    fn cuts_are_bounded() {
        let many = Request {
            tensor: 0,
            runs: (0..1u64 << 20).map(|i| run(i * 64, 32, 1, 32)).collect(),
            sums: false,
        };
        let e = check_cuts(std::slice::from_ref(&many), 4096, false).unwrap_err();
        assert!(e.message.contains("1048576 runs passed over"), "{e}");
        assert!(check_cuts(std::slice::from_ref(&many), 1 << 30, false).is_ok());
        let some = Request {
            runs: many.runs[..1000].to_vec(),
            ..many
        };
        assert!(check_cuts(&[some], 256, true).is_ok());
        // One run: its pieces alone (a TiB in MiB messages, 1 GiB in
        // 256-byte buckets).
        let whole = |n| [Request::whole(0, n, false)];
        assert!(check_cuts(&whole(1 << 40), 1 << 30, false).is_ok());
        assert!(check_cuts(&whole(512 << 30), 1 << 20, true).is_ok());
        assert!(check_cuts(&whole(1 << 30), 256, true).is_ok());
        let e = check_cuts(&whole(64 << 30), 256, true).unwrap_err();
        assert!(e.message.contains("pieces to plan"), "{e}");
    }
}
