//! The committed header is exactly what cbindgen generates from the code,
//! its version macros match Cargo.toml, and it declares exactly the
//! functions the library exports.
//!
//! `WM_BLESS=1 cargo test --test header` rewrites include/weight_manager.h.

use std::path::Path;

fn generate() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut out);
    String::from_utf8(out).expect("utf-8 header")
}

fn header_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include/weight_manager.h")
}

#[test]
fn committed_header_matches_generated() {
    let generated = generate();
    if std::env::var_os("WM_BLESS").is_some() {
        std::fs::write(header_path(), &generated).unwrap();
    }
    let committed = std::fs::read_to_string(header_path()).unwrap_or_default();
    assert!(
        committed == generated,
        "include/weight_manager.h is stale: run `WM_BLESS=1 cargo test --test header` and commit it"
    );
}

#[test]
fn version_macros_match_cargo_toml() {
    let header = std::fs::read_to_string(header_path()).unwrap();
    for (name, want) in [
        ("WM_VERSION_MAJOR", env!("CARGO_PKG_VERSION_MAJOR")),
        ("WM_VERSION_MINOR", env!("CARGO_PKG_VERSION_MINOR")),
        ("WM_VERSION_PATCH", env!("CARGO_PKG_VERSION_PATCH")),
    ] {
        let line = format!("#define {name} {want}\n");
        assert!(header.contains(&line), "header lacks `{}`", line.trim());
    }
    let v = unsafe { std::ffi::CStr::from_ptr(weight_manager::result::wm_version()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

/// Names of `#[no_mangle]` functions in src (the C API crate), with whether their body
/// starts with the panic guard.
fn exported_functions() -> Vec<(String, bool)> {
    let mut files = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    let mut out = Vec::new();
    // Every .rs file under src, sub-folders included.
    while let Some(path) = files.pop() {
        if path.is_dir() {
            files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("\n#[no_mangle]\n") {
            rest = &rest[i + 14..];
            let fn_at = rest.find("fn ").expect("fn after no_mangle");
            let name: String = rest[fn_at + 3..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let body_at = rest.find('{').expect("fn body");
            let body = rest[body_at + 1..].trim_start();
            out.push((
                name,
                body.starts_with("ffi_guard!(") || body.starts_with("ffi_guard_or!("),
            ));
        }
    }
    out.sort();
    out
}

#[test]
fn every_export_uses_the_panic_guard() {
    let fns = exported_functions();
    assert!(fns.len() >= 15, "found only {fns:?}");
    let unguarded: Vec<_> = fns.iter().filter(|(_, g)| !g).map(|(n, _)| n).collect();
    assert!(
        unguarded.is_empty(),
        "exports without ffi_guard!: {unguarded:?}"
    );
}

#[test]
fn header_declares_every_export_and_nothing_else() {
    let header = std::fs::read_to_string(header_path()).unwrap();
    // Function declarations start a line (after their return type) and are
    // not comments or typedefs; a declaration may wrap.
    let mut declared: Vec<String> = header
        .lines()
        .filter(|l| !l.starts_with("//") && !l.starts_with("typedef") && !l.starts_with(' '))
        .filter_map(|l| {
            let name_end = l.find('(')?;
            let name = l[..name_end].rsplit([' ', '*']).next()?;
            name.starts_with("wm_").then(|| name.to_string())
        })
        .collect();
    declared.sort();
    let exported: Vec<String> = exported_functions().into_iter().map(|(n, _)| n).collect();
    assert_eq!(declared, exported);
}

#[test]
fn header_defines_only_wm_names() {
    let header = std::fs::read_to_string(header_path()).unwrap();
    for line in header.lines().filter(|l| l.starts_with("#define ")) {
        let name = line.split_whitespace().nth(1).unwrap();
        assert!(
            name.starts_with("WM_") || name == "WEIGHT_MANAGER_H",
            "stray macro in header: {line} (make the Rust const pub(crate))"
        );
    }
    assert!(
        !header.contains("Option_"),
        "an Option<fn> leaked as an opaque struct"
    );
}
