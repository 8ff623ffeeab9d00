//! Plans without memory (param layouts, as `wm plan` builds them) and the
//! fingerprint that decides when a kept plan is reused.

use super::sharded_tests::{engine_rank, layouts_of, registry_of, trainer};
use super::*;
use crate::logging::Logger;
use crate::manifest::Manifest;

#[test]
fn params_without_memory_plan_like_a_registry_and_sources_are_reused() {
    let sources = trainer(4);
    let ms = manifests_of(&sources);
    let indexed = Sources::new(&ms).unwrap();
    for rank in 0..2 {
        let specs = engine_rank(rank);
        let opts = PlanOptions {
            spread: rank as usize,
            ..Default::default()
        };
        let log = Logger::default();
        let a = make_sharded_plan(&ms, &registry_of(&specs), opts, &log).unwrap();
        let b = make_sharded_plan(&ms, &layouts_of(&specs), opts, &log).unwrap();
        let c = indexed.plan(&layouts_of(&specs), opts, &log).unwrap();
        for p in [&b, &c] {
            assert_eq!(p.runs, a.runs, "rank {rank}");
            let key = |p: &Plan| -> Vec<_> {
                p.entries
                    .iter()
                    .map(|e| (e.source, e.tensor, e.target, e.bytes))
                    .collect()
            };
            assert_eq!(key(p), key(&a), "rank {rank}");
        }
    }
}

fn manifests_of(sources: &[(Manifest, Vec<Vec<u8>>)]) -> Vec<&Manifest> {
    sources.iter().map(|(m, _)| m).collect()
}

#[test]
fn the_fingerprint_follows_every_layout_change() {
    let sources = trainer(2);
    let ms = manifests_of(&sources);
    let params = layouts_of(&engine_rank(0));
    let base = fingerprint(&ms, &params);
    assert_eq!(base, fingerprint(&ms, &params), "deterministic");
    let mut moved = sources.clone();
    moved[1].0.tensors[0].placement.as_mut().unwrap().offset[0] += 1;
    assert_ne!(
        base,
        fingerprint(&manifests_of(&moved), &params),
        "a placement"
    );
    let mut versioned = sources.clone();
    versioned[0].0.version = Some("8".into());
    // A new version with new checksums is the same layout (the plan is
    // reused, taking the new sums); a checksum gone is not.
    versioned[0].0.tensors[0].checksum = Some(7);
    let summed = fingerprint(&manifests_of(&versioned), &params);
    versioned[0].0.version = Some("9".into());
    versioned[0].0.tensors[0].checksum = Some(8);
    assert_eq!(
        summed,
        fingerprint(&manifests_of(&versioned), &params),
        "a version"
    );
    versioned[0].0.tensors[0].checksum = None;
    assert_ne!(
        summed,
        fingerprint(&manifests_of(&versioned), &params),
        "no checksum"
    );
    let mut other = params.clone();
    other[1].pieces[2].at[0] -= 1;
    assert_ne!(base, fingerprint(&ms, &other), "a piece's place");
    let mut renamed = params.clone();
    renamed[0].name.push('x');
    assert_ne!(base, fingerprint(&ms, &renamed), "a name");
    assert_ne!(base, fingerprint(&ms[..1], &params), "a source fewer");
}
