//! Give the shared library a SONAME so programs linked against it record
//! `libweight_manager.so` (found through their RPATH or the loader path)
//! rather than the build directory's path.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libweight_manager.so");
    println!("cargo:rerun-if-changed=build.rs");
}
