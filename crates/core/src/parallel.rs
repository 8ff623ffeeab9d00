//! `f` over items on a few threads, results in item order: the one helper
//! for the per-item parallel passes (the quantizer's bands, deltas' bases,
//! checks, decoding and patching), each thread taking the next item not
//! yet taken (items of very different sizes keep every thread busy).

use std::sync::atomic::{AtomicUsize, Ordering};

/// `f` over every item of `items` on up to `threads` threads (the calling
/// thread alone for one), results in item order. A panic in `f` panics
/// here (`what` names the work).
pub(crate) fn map<I: Sync, T: Send>(
    items: &[I],
    threads: usize,
    what: &str,
    f: impl Fn(&I) -> T + Sync,
) -> Vec<T> {
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let mut out: Vec<(usize, T)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        mine.push((i, f(item)));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|_| panic!("{what} panicked")))
            .collect()
    });
    out.sort_unstable_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, t)| t).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn results_keep_the_items_order_on_any_number_of_threads() {
        let items: Vec<u64> = (0..1000).collect();
        for threads in [0, 1, 3, 64, 5000] {
            let got = super::map(&items, threads, "squaring", |x| x * x);
            assert_eq!(got, items.iter().map(|x| x * x).collect::<Vec<_>>());
        }
        assert!(super::map(&[] as &[u8], 4, "nothing", |x| *x).is_empty());
    }
}
