//! Unix-socket peer credentials: the IPC path serves only processes of the
//! same uid unless told otherwise.

use crate::result::{Error, Result};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// The uid of the process at the other end.
pub fn peer_uid(stream: &UnixStream) -> Result<u32> {
    // SAFETY: ucred is plain integers; all zeroes is a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a ucred of the right size.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(Error::io(
            "reading the peer's credentials",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(cred.uid)
}

/// Refuse a peer of another uid unless allowed.
pub fn check_peer_uid(stream: &UnixStream, allow_other_uids: bool, who: &str) -> Result<()> {
    let uid = peer_uid(stream)?;
    // SAFETY: getuid cannot fail.
    let me = unsafe { libc::getuid() };
    if uid != me && !allow_other_uids {
        return Err(Error::peer(format!(
            "{who} runs as uid {uid}, this process as uid {me}: refused (allow other uids in the config to accept it)"
        )));
    }
    Ok(())
}
