//! Page swap: the commit of an atomic update into a library-owned host
//! param without copying its bytes.
//!
//! The update lands in a shadow, a [`HostRegion`] of the param's size. At
//! commit one `mremap(shadow, MREMAP_MAYMOVE | MREMAP_FIXED, param)` moves
//! the shadow's pages over the param's range: the kernel unmaps the old
//! pages (they are freed) and the param's address stays what it was, so
//! pointers the engine captured (and CUDA graphs over host memory) stay
//! valid. The call holds the process's address-space lock for writing, so a
//! thread touching the param meanwhile waits for it and then sees the new
//! pages: the param is old up to one instant and new after it, never a
//! mix of bytes. Both regions start on 2 MiB boundaries (`HostRegion::new`),
//! so huge pages move as single page-table entries.
//!
//! A staged commit (`wm_commit`: the engine reads no param while it runs)
//! frees nothing: [`swap_in_deferring`] first moves the param's old pages
//! out of the way (`MREMAP_DONTUNMAP`, which moves page-table entries and
//! leaves the param's range mapped and empty), then moves the shadow's in,
//! and the caller keeps the old pages as the next update's shadow (or
//! frees them after the commit returned). Freeing them was most of the
//! pause: 16 params of 64 MiB took 2.7 ms to swap with the old pages freed
//! by the swap and 0.5 ms without (2 MiB pages, this 2-core VM); and
//! reused, they spare the next update faulting in fresh pages, which the
//! kernel zeroes. A thread that read the param between the two moves
//! would read zeros, which is why a one-call update, where readers may
//! run, keeps the single move ([`swap_in`]).
//!
//! Why `mremap` of private anonymous memory and not a memfd mapped over
//! the param with `mmap(MAP_FIXED)`: the memfd route keeps the old pages
//! (a double buffer that could be reused without zeroing) but its shared
//! mapping gets 4 KiB pages where shmem huge pages are off (the default),
//! so the engine then pays a fault per 4 KiB on its next read of every
//! param, or the commit pays populating them; anonymous memory keeps
//! huge pages and the commit moves them in constant time per 2 MiB.

//!
//! Not where UCX's memory hooks are loaded (libucm, which the network
//! path's libucp brings in): UCX 1.13's `mremap` hook passes four
//! arguments on, so `MREMAP_FIXED` would get a garbage address, and its
//! registration cache must hear of every unmapping, which a raw system
//! call (used here so that no hook can garble the call) keeps from it. In
//! such a process atomic updates copy into library-owned params, as into
//! engine-owned ones ([`swaps_here`]).

use super::host::HostRegion;
use crate::result::{Error, Result};

/// True when this process may swap pages: UCX's memory hooks (libucm)
/// are not loaded.
pub fn swaps_here() -> bool {
    // SAFETY: RTLD_NOLOAD only looks the library up; a handle found is
    // closed again at once (dropping the reference the lookup took).
    unsafe {
        let h = libc::dlopen(c"libucm.so.0".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if h.is_null() {
            return true;
        }
        libc::dlclose(h);
        false
    }
}

/// Put `shadow`'s pages in place of `param`'s, at `param`'s address; the
/// old pages are freed. Both must be the same size. On failure nothing
/// moved: `shadow` is dropped (its pages freed) and `param` is intact.
pub fn swap_in(param: &HostRegion, shadow: HostRegion) -> Result<()> {
    if shadow.mapped() != param.mapped() {
        return Err(Error::invalid_argument(format!(
            "page swap: a shadow of {} bytes cannot replace a param of {}",
            shadow.mapped(),
            param.mapped()
        )));
    }
    // SAFETY: both ranges are whole mappings of ours, of equal size; the
    // shadow's mapping is moved (not freed) and forgotten below on success.
    // The system call itself: an interposed `mremap` might drop the
    // fifth argument (see the module docs).
    let moved = unsafe {
        libc::syscall(
            libc::SYS_mremap,
            shadow.ptr(),
            shadow.mapped(),
            param.mapped(),
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            param.ptr(),
        )
    };
    if moved == -1 {
        return Err(Error::io(
            "moving the staged pages over the param (mremap)",
            std::io::Error::last_os_error(),
        ));
    }
    shadow.forget();
    debug_assert_eq!(moved as usize, param.ptr() as usize);
    Ok(())
}

/// As [`swap_in`], but the param's old pages are not freed: they come
/// back as a region of their own for the caller to drop later (module
/// docs). Between the two moves the param's range reads as zeros, so only
/// for a commit the engine does not read during. Where the kernel cannot
/// move pages out and leave the range mapped (`MREMAP_DONTUNMAP`: Linux
/// 5.7 on, for private anonymous memory; memory accounting may refuse the
/// second mapping), it swaps as [`swap_in`] and returns None.
pub fn swap_in_deferring(param: &HostRegion, shadow: HostRegion) -> Result<Option<HostRegion>> {
    if shadow.mapped() != param.mapped() {
        return swap_in(param, shadow).map(|()| None);
    }
    // Where the old pages go: a fresh reservation, aligned as the param
    // (2 MiB for regions that large), so that huge pages move whole.
    let Ok(old) = HostRegion::new("a param's old pages", param.len()) else {
        return swap_in(param, shadow).map(|()| None);
    };
    // SAFETY: both ranges are whole mappings of ours, of equal size; the
    // param's pages move over the reservation, which then owns them, and
    // the param's range stays mapped, empty.
    let moved = unsafe {
        libc::syscall(
            libc::SYS_mremap,
            param.ptr(),
            param.mapped(),
            param.mapped(),
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP,
            old.ptr(),
        )
    };
    if moved == -1 {
        return swap_in(param, shadow).map(|()| None);
    }
    match swap_in(param, shadow) {
        Ok(()) => Ok(Some(old)),
        Err(e) => {
            // The param's range is mapped and empty: put the old pages back.
            swap_in(param, old).map_err(|back| back.context(e.message.clone()))?;
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A param of `len` bytes of 1s and a shadow of 2s.
    fn param_and_shadow(len: usize) -> (HostRegion, HostRegion) {
        let param = HostRegion::new("param", len).unwrap();
        unsafe { std::ptr::write_bytes(param.ptr(), 1, len) };
        let shadow = HostRegion::new("shadow", len).unwrap();
        unsafe { std::ptr::write_bytes(shadow.ptr(), 2, len) };
        (param, shadow)
    }

    #[test]
    fn swap_keeps_the_address_and_moves_the_bytes() {
        for len in [100, 3 << 20] {
            let (param, shadow) = param_and_shadow(len);
            let addr = param.ptr();
            swap_in(&param, shadow).unwrap();
            assert_eq!(param.ptr(), addr);
            assert!(unsafe { param.as_slice() }.iter().all(|b| *b == 2));
            assert_eq!(param.resident_bytes().unwrap(), param.mapped());
        }
    }

    #[test]
    fn a_deferring_swap_hands_the_old_pages_back() {
        for len in [100, 3 << 20] {
            let (param, shadow) = param_and_shadow(len);
            let addr = param.ptr();
            let old = swap_in_deferring(&param, shadow).unwrap();
            assert_eq!(param.ptr(), addr);
            assert!(unsafe { param.as_slice() }.iter().all(|b| *b == 2));
            assert_eq!(param.resident_bytes().unwrap(), param.mapped());
            // This kernel moves pages out (5.7 on): the old bytes, intact.
            let old = old.expect("MREMAP_DONTUNMAP");
            assert_eq!(old.mapped(), param.mapped());
            assert!(unsafe { old.as_slice() }[..len].iter().all(|b| *b == 1));
        }
    }

    #[test]
    fn a_shadow_of_another_size_is_refused_and_the_param_kept() {
        let param = HostRegion::new("param", 8192).unwrap();
        unsafe { std::ptr::write_bytes(param.ptr(), 1, 8192) };
        let shadow = HostRegion::new("shadow", 3 << 20).unwrap();
        let e = swap_in(&param, shadow).unwrap_err();
        assert!(e.message.contains("cannot replace"), "{}", e.message);
        assert!(unsafe { param.as_slice() }.iter().all(|b| *b == 1));
    }
}
