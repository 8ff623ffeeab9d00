//! An on-path attacker for the network tests: a TCP proxy between one
//! engine and a publisher that forwards the control frames whole and lets
//! the test alter, replay, drop or reorder them.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Which way a frame goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    ToPublisher,
    ToEngine,
}

/// What the proxy forwards in place of frame `index` (counted per
/// direction from 0; length prefix included) going `dir`.
pub type Tamper = dyn FnMut(Dir, usize, Vec<u8>) -> Vec<Vec<u8>> + Send;

pub struct Proxy {
    pub address: String,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Listen on loopback; the first engine that connects is joined to
    /// the publisher at `upstream`.
    pub fn start(upstream: &str, tamper: Box<Tamper>) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let upstream = upstream.to_string();
        let thread = std::thread::spawn(move || {
            let (engine, _) = listener.accept().unwrap();
            let publisher = TcpStream::connect(&upstream).unwrap();
            let tamper = Arc::new(Mutex::new(tamper));
            let t = tamper.clone();
            let (e, p) = (engine.try_clone().unwrap(), publisher.try_clone().unwrap());
            let up = std::thread::spawn(move || forward(e, p, Dir::ToPublisher, &t));
            forward(publisher, engine, Dir::ToEngine, &tamper);
            up.join().unwrap();
        });
        Proxy {
            address,
            thread: Some(thread),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Copy frames `from` -> `to` until either side closes.
fn forward(mut from: TcpStream, mut to: TcpStream, dir: Dir, tamper: &Mutex<Box<Tamper>>) {
    from.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut index = 0;
    while let Some(frame) = read_frame(&mut from) {
        let out = (tamper.lock().unwrap())(dir, index, frame);
        index += 1;
        if out.iter().any(|f| to.write_all(f).is_err()) {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

fn read_frame(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut frame = len.to_vec();
    frame.resize(4 + u32::from_le_bytes(len) as usize, 0);
    s.read_exact(&mut frame[4..]).ok()?;
    Some(frame)
}
