//! Libraries loaded at run time (`dlopen`), so this library builds, links
//! and loads where they are missing: UCX (`transport::ucx::sys`) and NCCL
//! (`fanout::nccl`). One loader and one symbol-table macro serve both.

use std::ffi::{c_void, CStr, CString};

/// Open the first of `candidates` that loads. The handle stays open for the
/// process's life (RTLD_NODELETE: the library's threads and handlers stay
/// valid until exit). Err: why each candidate failed, in order.
pub(crate) fn open_first(candidates: &[String]) -> Result<(*mut c_void, String), Vec<String>> {
    let mut tried = Vec::new();
    for name in candidates {
        let Ok(c) = CString::new(name.clone()) else {
            tried.push(format!("bad library name {name:?}"));
            continue;
        };
        // SAFETY: dlopen of a library by name or path.
        let handle = unsafe {
            libc::dlopen(
                c.as_ptr(),
                libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE,
            )
        };
        if !handle.is_null() {
            return Ok((handle, name.clone()));
        }
        // SAFETY: dlerror returns a thread-local string or NULL.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                format!("{name}: not found")
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        tried.push(why);
    }
    Err(tried)
}

/// A struct of C entry points resolved by name from a `dlopen` handle:
/// `dynamic_api! { "libname", Api { f: fn(args) -> ret; ... } }` defines
/// `Api` and `unsafe fn Api::resolve(handle) -> Result<Api, String>`, which
/// names the first missing symbol.
macro_rules! dynamic_api {
    ($lib:literal, $api:ident { $($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)* }) => {
        #[expect(
            clippy::allow_attributes,
            reason = "some libraries' names are snake case, where an expect would go unfulfilled"
        )]
        #[allow(non_snake_case, reason = "the fields are the C library's function names")]
        pub struct $api {
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        impl $api {
            /// # Safety
            /// `handle` is a live `dlopen` handle of the library, whose
            /// symbols have the declared signatures.
            pub(crate) unsafe fn resolve(handle: *mut std::ffi::c_void) -> Result<$api, String> {
                Ok($api {
                    $($name: {
                        let sym = libc::dlsym(
                            handle,
                            concat!(stringify!($name), "\0").as_ptr().cast(),
                        );
                        if sym.is_null() {
                            return Err(format!("{} has no symbol {}", $lib, stringify!($name)));
                        }
                        std::mem::transmute::<*mut std::ffi::c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(sym)
                    },)*
                })
            }
        }
    };
}
pub(crate) use dynamic_api;
