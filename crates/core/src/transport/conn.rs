//! Wire frames over a stream socket: a Unix socket (IPC, with file
//! descriptors attached by SCM_RIGHTS) or a TCP connection (the control
//! channel of the network paths).
//!
//! Every read has a deadline; a closed connection is a peer error naming who
//! closed it. A network connection is sealed once its challenge is done
//! ([`Conn::secure`]): from then on every frame both ways carries a MAC and
//! a sequence number (`transport::seal`); IPC connections are never sealed.

use super::auth::SessionKeys;
use super::seal::{FrameSeal, Role, TAG};
use crate::result::{Error, Result};
use crate::stop::StopFlag;
use crate::wire::{Frame, MAX_FRAME};
use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Most descriptors accepted with one message.
const MAX_FDS: usize = 8;

/// The socket under a [`Conn`].
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl From<UnixStream> for Stream {
    fn from(s: UnixStream) -> Stream {
        Stream::Unix(s)
    }
}

impl From<TcpStream> for Stream {
    fn from(s: TcpStream) -> Stream {
        Stream::Tcp(s)
    }
}

impl Stream {
    fn set_read_timeout(&self, t: Option<std::time::Duration>) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }
}

pub struct Conn {
    stream: Stream,
    /// Who the other side is, for messages ("the publisher", "engine rank 3").
    peer: String,
    fds: VecDeque<OwnedFd>,
    /// Set once the network handshake is done: every frame is authenticated.
    seal: Option<FrameSeal>,
    /// The largest frame taken (`limit_frames`): MAX_FRAME, or less while
    /// a peer is not yet authenticated.
    max_frame: usize,
    /// The most tensors a MANIFEST may announce (`limit_manifest`).
    manifest_tensors: usize,
    /// Set by the engine to stop waiting for this peer (`stop_when`).
    stop: Option<StopFlag>,
    /// Whether any byte came from the peer yet (`heard_anything`).
    heard: bool,
}

/// How often a wait looks at its stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

/// How long a send that found its peer gone reads for the peer's last
/// frame (already in the socket, or not coming).
const LAST_WORDS: Duration = Duration::from_millis(100);

impl Conn {
    pub fn new(stream: impl Into<Stream>, peer: impl Into<String>) -> Conn {
        Conn {
            stream: stream.into(),
            peer: peer.into(),
            fds: VecDeque::new(),
            seal: None,
            max_frame: MAX_FRAME,
            stop: None,
            manifest_tensors: usize::MAX,
            heard: false,
        }
    }

    /// Whether the peer sent any byte yet: a connection closed before its
    /// first is a probe (a publisher checking the socket is live, a port
    /// check), not a peer that failed.
    pub fn heard_anything(&self) -> bool {
        self.heard
    }

    /// End every later wait for a frame, within 50 ms, once `stop` is set
    /// (`WM_ERR_CANCELLED`).
    pub fn stop_when(&mut self, stop: Option<StopFlag>) {
        self.stop = stop;
    }

    /// Refuse a MANIFEST of more than `tensors` tensors before decoding
    /// them (a bound the engine sets from its params).
    pub fn limit_manifest(&mut self, tensors: usize) {
        self.manifest_tensors = tensors;
    }

    /// Take frames of at most `max` bytes (at most MAX_FRAME) from now on:
    /// a handshake takes small frames only, so that a peer without the
    /// secret cannot make this side allocate 64 MiB per connection.
    pub fn limit_frames(&mut self, max: usize) {
        self.max_frame = max.min(MAX_FRAME);
    }

    /// Authenticate every frame from now on, both ways, with this
    /// session's keys (`role`: which end this side is).
    pub fn secure(&mut self, keys: &SessionKeys, role: Role) {
        self.seal = Some(FrameSeal::new(keys, role));
        self.max_frame = MAX_FRAME;
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Name the peer better once it said who it is.
    pub fn set_peer(&mut self, peer: impl Into<String>) {
        self.peer = peer.into();
    }

    /// True once the peer closed its end (or the connection broke), without
    /// consuming any frame: lets a wait on other channels notice a dead peer.
    pub fn peer_hung_up(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one pollfd, no wait.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// True when bytes of the next frame (or a hang-up) are waiting now.
    /// Frames are read straight from the socket, never buffered here, so
    /// the socket tells.
    pub fn readable(&self) -> bool {
        self.readable_within(Duration::ZERO)
    }

    /// True when bytes of the next frame (or a hang-up) came within `wait`
    /// (a source stepping among several waits a little, not a frame long).
    pub fn readable_within(&self, wait: Duration) -> bool {
        let mut p = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = wait.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one pollfd.
        unsafe { libc::poll(&mut p, 1, ms) > 0 }
    }

    pub fn send(&mut self, frame: &Frame) -> Result<()> {
        self.send_with_fds(frame, &[])
    }

    /// Send a frame with descriptors attached to its first byte.
    pub fn send_with_fds(&mut self, frame: &Frame, fds: &[RawFd]) -> Result<()> {
        let mut bytes = frame.encode();
        if let Some(seal) = &mut self.seal {
            seal.seal(&mut bytes);
        }
        let mut sent = 0;
        let mut attach = fds;
        while sent < bytes.len() {
            let n = match sendmsg(self.stream.as_raw_fd(), &bytes[sent..], attach) {
                Ok(n) => n,
                // A peer that died between our reads and this write gets the
                // same words as one noticed on a read, unless it said why.
                Err(e) if super::peer_gone(&e) => {
                    return Err(self.last_words().unwrap_or_else(|| {
                        Error::peer(format!(
                            "{} closed the connection (did it exit or crash?) while we sent {}",
                            self.peer,
                            frame.name()
                        ))
                    }));
                }
                Err(e) => {
                    return Err(Error::peer(format!(
                        "{}: connection lost while sending {} ({e})",
                        self.peer,
                        frame.name()
                    )))
                }
            };
            sent += n;
            attach = &[];
        }
        Ok(())
    }

    fn read_exact(&mut self, buf: &mut [u8], deadline: Instant, what: &str) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(format!(
                    "{} sent no {what} before the deadline",
                    self.peer
                )));
            }
            if crate::stop::stopped(self.stop.as_ref()) {
                return Err(Error::cancelled(format!(
                    "stopped while waiting for a {what} from {}",
                    self.peer
                )));
            }
            let slice = match &self.stop {
                Some(_) => (deadline - now).min(STOP_POLL),
                None => deadline - now,
            };
            self.stream
                .set_read_timeout(Some(slice))
                .map_err(|e| Error::io("setting a read timeout", e))?;
            match recvmsg(self.stream.as_raw_fd(), &mut buf[done..], &mut self.fds) {
                Ok(0) => {
                    return Err(Error::peer(format!(
                        "{} closed the connection (did it exit or crash?)",
                        self.peer
                    )))
                }
                Ok(n) => {
                    done += n;
                    self.heard = true;
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if super::peer_gone(&e) => {
                    return Err(Error::peer(format!(
                        "{} closed the connection (did it exit or crash?)",
                        self.peer
                    )))
                }
                Err(e) => return Err(Error::peer(format!("{}: connection lost ({e})", self.peer))),
            }
        }
        Ok(())
    }

    /// Receive one frame before `deadline`; an ERROR frame becomes an error.
    pub fn recv(&mut self, deadline: Instant) -> Result<Frame> {
        match self.recv_frame(deadline)? {
            Frame::Error { code, text } => Err(self.reported(code, &text)),
            f => Ok(f),
        }
    }

    /// Receive one frame before `deadline`, an ERROR frame as it is.
    fn recv_frame(&mut self, deadline: Instant) -> Result<Frame> {
        let mut len = [0u8; 4];
        self.read_exact(&mut len, deadline, "frame")?;
        let len = u32::from_le_bytes(len) as usize;
        let max = self.max_frame + if self.seal.is_some() { TAG } else { 0 };
        if len == 0 || len > max {
            return Err(Error::peer(format!(
                "{}: frame of {len} bytes (1 to {max} allowed)",
                self.peer
            )));
        }
        let mut body = vec![0u8; len];
        self.read_exact(&mut body, deadline, "frame")?;
        let body = match &mut self.seal {
            Some(seal) => seal.open(&body, &self.peer)?,
            None => &body[..],
        };
        Frame::decode_within(body, self.manifest_tensors).map_err(|e| e.context(&self.peer))
    }

    /// The error a peer's ERROR frame reports: its own code, when it is one
    /// a peer may report.
    fn reported(&self, code: u32, text: &str) -> Error {
        let code = crate::result::wm_result::from_raw(code)
            .filter(|c| {
                use crate::result::wm_result::*;
                matches!(
                    c,
                    WM_ERR_NOT_FOUND
                        | WM_ERR_AUTH
                        | WM_ERR_CHECKSUM
                        | WM_ERR_MISMATCH
                        | WM_ERR_TIMEOUT
                        | WM_ERR_IO
                        | WM_ERR_FORMAT
                        | WM_ERR_OUT_OF_MEMORY
                        | WM_ERR_UNSUPPORTED
                )
            })
            .unwrap_or(crate::result::wm_result::WM_ERR_PEER);
        Error::new(code, format!("{} reports: {text}", self.peer))
    }

    /// What a peer that closed the connection said before it did: its
    /// ERROR frame, when one is waiting to be read (a peer that gives up
    /// says why, then closes; a send that finds it gone reports that
    /// reason, not only the close).
    fn last_words(&mut self) -> Option<Error> {
        if !self.readable() {
            return None;
        }
        match self.recv_frame(Instant::now() + LAST_WORDS) {
            Ok(Frame::Error { code, text }) => Some(self.reported(code, &text)),
            _ => None,
        }
    }

    /// Descriptors received so far, oldest first.
    pub fn take_fds(&mut self, n: usize) -> Result<Vec<OwnedFd>> {
        // Exactly: descriptors travel with the frame that counts them, so
        // more than its count is a peer's error too (not kept for later).
        if self.fds.len() != n {
            return Err(Error::peer(format!(
                "{} announced {n} shared buffers but sent {} descriptors",
                self.peer,
                self.fds.len()
            )));
        }
        Ok(self.fds.drain(..n).collect())
    }

    /// Tell the peer why we give up (best effort).
    pub fn send_error(&mut self, e: &Error) {
        let _ = self.send(&Frame::Error {
            code: e.code as u32,
            text: e.message.clone(),
        });
    }
}

fn sendmsg(fd: RawFd, data: &[u8], fds: &[RawFd]) -> std::io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: CMSG_SPACE is arithmetic on a length; it touches no memory.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
    let mut control = vec![0u8; if fds.is_empty() { 0 } else { space }];
    // SAFETY: msghdr is integers and raw pointers; all zeroes (null
    // pointers, zero lengths) is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer has room for one header and the fds.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c) as *mut RawFd,
                fds.len(),
            );
        }
    }
    loop {
        // SAFETY: msg points at live buffers for the call's duration.
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn recvmsg(fd: RawFd, buf: &mut [u8], fds: &mut VecDeque<OwnedFd>) -> std::io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: CMSG_SPACE is arithmetic on a length; it touches no memory.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: msghdr is integers and raw pointers; all zeroes (null
    // pointers, zero lengths) is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points at live buffers; MSG_CMSG_CLOEXEC keeps fds out of children.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: walking the control messages the kernel wrote.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(c) as *const RawFd;
                for i in 0..count {
                    fds.push_back(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::other("too many descriptors in one message"));
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::shared::SharedBuffer;
    use std::time::Duration;

    /// A frame counting fewer or more descriptors than came with it is
    /// refused, naming both numbers.
    #[test]
    fn descriptors_must_match_their_count() {
        for (sent, counted) in [(2usize, 1usize), (1, 2)] {
            let (a, b) = UnixStream::pair().unwrap();
            let (mut a, mut b) = (Conn::new(a, "a"), Conn::new(b, "b"));
            let bufs: Vec<SharedBuffer> = (0..sent)
                .map(|_| SharedBuffer::create("t", 4096).unwrap())
                .collect();
            let fds: Vec<RawFd> = bufs.iter().map(|b| b.fd().as_raw_fd()).collect();
            let frame = Frame::Buffers {
                sizes: vec![4096; counted],
            };
            a.send_with_fds(&frame, &fds).unwrap();
            let deadline = Instant::now() + Duration::from_secs(5);
            assert_eq!(b.recv(deadline).unwrap(), frame);
            let e = b.take_fds(counted).unwrap_err();
            assert_eq!(e.code, crate::result::wm_result::WM_ERR_PEER);
            let said = format!("announced {counted} shared buffers but sent {sent} descriptors");
            assert!(e.message.contains(&said), "{e}");
        }
    }

    #[test]
    fn frames_and_descriptors_cross_a_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        crate::transport::unix::check_peer_uid(&a, false, "b").unwrap();
        let mut a = Conn::new(a, "a");
        let mut b = Conn::new(b, "b");
        let buf = SharedBuffer::create("t", 8192).unwrap();
        unsafe { *buf.ptr().add(100) = 42 };
        a.send_with_fds(
            &Frame::Buffers { sizes: vec![8192] },
            &[buf.fd().as_raw_fd()],
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        assert_eq!(
            b.recv(deadline).unwrap(),
            Frame::Buffers { sizes: vec![8192] }
        );
        let fd = b.take_fds(1).unwrap().pop().unwrap();
        let got = SharedBuffer::receive(fd, 8192, "t").unwrap();
        assert_eq!(unsafe { *got.ptr().add(100) }, 42);
        a.send(&Frame::Error {
            code: 17,
            text: "stop".into(),
        })
        .unwrap();
        let e = b.recv(deadline).unwrap_err();
        assert!(e.message.contains("b reports: stop"), "{e}");
        assert!(!b.peer_hung_up());
        drop(a);
        assert!(b.peer_hung_up());
        let e = b.recv(deadline).unwrap_err();
        assert!(e.message.contains("closed the connection"), "{e}");
        let e = b.recv(Instant::now()).unwrap_err();
        assert!(
            e.message.contains("closed") || e.message.contains("deadline"),
            "{e}"
        );
    }

    #[test]
    fn a_peer_gone_before_a_send_reads_as_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut a = Conn::new(a, "the publisher");
        drop(b);
        let e = a.send(&Frame::Ack { seq: 1 }).unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_PEER);
        assert!(
            e.message.contains(
                "the publisher closed the connection (did it exit or crash?) while we sent ACK"
            ),
            "{e}"
        );
    }
}
