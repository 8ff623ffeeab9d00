//! Shared-secret authentication of network peers, before any manifest moves.
//!
//! Both sides prove they hold the secret without sending it: the publisher
//! sends a random challenge, the engine answers with
//! `HMAC-SHA256(secret, "wm-engine" | publisher nonce | engine nonce)` and
//! its own nonce, and the publisher answers that with
//! `HMAC-SHA256(secret, "wm-publisher" | engine nonce | publisher nonce)`.
//! A replayed answer fails (fresh nonces each session), and each side learns
//! that the other holds the secret. Macs are compared in constant time.
//!
//! After both proofs check, each side derives the session's frame keys
//! ([`Secret::session_keys`]): `prk = HMAC-SHA256(secret, "wm-session" | np
//! | ne | SHA-256(HELLO))`, then one key per direction, `HMAC-SHA256(prk,
//! "engine->publisher")` and `HMAC-SHA256(prk, "publisher->engine")`. Every
//! later control frame carries a MAC under its direction's key and an
//! implicit sequence number (`transport::conn`), so an on-path attacker who
//! let the challenge through can neither alter a frame (the manifest, its
//! checksums, the UCX worker address) nor replay, drop or reorder one. The
//! HELLO the engine sent is bound into the keys: rewriting its rank or
//! version makes the two sides' keys differ, and the first frame fails. A
//! third key, `HMAC-SHA256(prk, "bucket-bytes")`, keys the BLAKE3 digests
//! of bucket bytes when the engine asks for them (`keyed_digests`).
//!
//! The secret comes from the config, else from `WM_NET_SECRET`; the network
//! paths refuse to run without one (at least 16 bytes).

use crate::result::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;

pub(crate) const NONCE: usize = 32;
pub(crate) const MAC: usize = 32;
pub(crate) const MIN_SECRET: usize = 16;
pub(crate) const SECRET_ENV: &str = "WM_NET_SECRET";

#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// `configured`, else `WM_NET_SECRET`. Missing: `WM_ERR_AUTH` (no
    /// secret to prove); short: `WM_ERR_INVALID_ARGUMENT` naming where it
    /// came from, as the engine's config refuses it at `wm_init`.
    pub fn resolve(configured: Option<&[u8]>) -> Result<Secret> {
        let (bytes, from) = match configured {
            Some(b) => (b.to_vec(), "the config's"),
            None => (
                std::env::var_os(SECRET_ENV)
                    .map(std::os::unix::ffi::OsStringExt::into_vec)
                    .ok_or_else(|| {
                        Error::auth(format!(
                            "the network paths need a shared secret: set it in the config or in {SECRET_ENV}"
                        ))
                    })?,
                "WM_NET_SECRET's",
            ),
        };
        if bytes.len() < MIN_SECRET {
            return Err(Error::invalid_argument(format!(
                "{from} shared secret has {} bytes; at least {MIN_SECRET} are required",
                bytes.len()
            )));
        }
        Ok(Secret(bytes))
    }

    fn mac(&self, role: &[u8], a: &[u8; NONCE], b: &[u8; NONCE]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key");
        m.update(role);
        m.update(a);
        m.update(b);
        m
    }

    /// The engine's answer to the publisher's challenge.
    pub fn engine_proof(&self, publisher: &[u8; NONCE], engine: &[u8; NONCE]) -> [u8; MAC] {
        self.mac(b"wm-engine", publisher, engine)
            .finalize()
            .into_bytes()
            .into()
    }

    pub fn check_engine_proof(
        &self,
        publisher: &[u8; NONCE],
        engine: &[u8; NONCE],
        proof: &[u8; MAC],
    ) -> bool {
        self.mac(b"wm-engine", publisher, engine)
            .verify_slice(proof)
            .is_ok()
    }

    /// The publisher's answer to the engine's nonce.
    pub fn publisher_proof(&self, engine: &[u8; NONCE], publisher: &[u8; NONCE]) -> [u8; MAC] {
        self.mac(b"wm-publisher", engine, publisher)
            .finalize()
            .into_bytes()
            .into()
    }

    pub fn check_publisher_proof(
        &self,
        engine: &[u8; NONCE],
        publisher: &[u8; NONCE],
        proof: &[u8; MAC],
    ) -> bool {
        self.mac(b"wm-publisher", engine, publisher)
            .verify_slice(proof)
            .is_ok()
    }
}

/// The two frame keys of one network session (see the module docs).
#[derive(Clone)]
pub struct SessionKeys {
    pub engine_to_publisher: [u8; MAC],
    pub publisher_to_engine: [u8; MAC],
    /// Keys the BLAKE3 digests of bucket bytes, when the engine asks for them.
    pub bytes: [u8; MAC],
}

impl Secret {
    /// Both directions' frame keys, from the secret, both nonces and the
    /// HELLO frame (its encoding, as sent by the engine).
    pub fn session_keys(
        &self,
        publisher: &[u8; NONCE],
        engine: &[u8; NONCE],
        hello: &[u8],
    ) -> SessionKeys {
        use sha2::Digest;
        let transcript: [u8; 32] = Sha256::digest(hello).into();
        let mut prk = self.mac(b"wm-session", publisher, engine);
        prk.update(&transcript);
        let prk: [u8; MAC] = prk.finalize().into_bytes().into();
        let expand = |label: &[u8]| -> [u8; MAC] {
            let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&prk).expect("HMAC takes any key");
            m.update(label);
            m.finalize().into_bytes().into()
        };
        SessionKeys {
            engine_to_publisher: expand(b"engine->publisher"),
            publisher_to_engine: expand(b"publisher->engine"),
            bytes: expand(b"bucket-bytes"),
        }
    }
}

/// A fresh random nonce from the kernel.
pub fn nonce() -> Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    let mut got = 0;
    while got < NONCE {
        // SAFETY: writes at most the rest of `n`.
        let r = unsafe { libc::getrandom(n[got..].as_mut_ptr().cast(), NONCE - got, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom", e));
        }
        got += r as usize;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_check_only_with_the_same_secret_and_nonces() {
        let k = Secret::resolve(Some(b"0123456789abcdef-secret")).unwrap();
        let other = Secret::resolve(Some(b"0123456789abcdef-other")).unwrap();
        let (p, e) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(p, e);
        let proof = k.engine_proof(&p, &e);
        assert!(k.check_engine_proof(&p, &e, &proof));
        assert!(!other.check_engine_proof(&p, &e, &proof));
        assert!(!k.check_engine_proof(&e, &p, &proof));
        // The two roles' answers differ, so one cannot be replayed as the other.
        assert!(!k.check_publisher_proof(&p, &e, &proof));
        let back = k.publisher_proof(&e, &p);
        assert!(k.check_publisher_proof(&e, &p, &back));
        // Session keys: one per direction, and bound to the nonces and HELLO.
        let keys = k.session_keys(&p, &e, b"hello");
        assert_ne!(keys.engine_to_publisher, keys.publisher_to_engine);
        let again = k.session_keys(&p, &e, b"hello");
        assert_eq!(keys.engine_to_publisher, again.engine_to_publisher);
        let rewritten = k.session_keys(&p, &e, b"hellO");
        assert_ne!(keys.engine_to_publisher, rewritten.engine_to_publisher);
        let other_keys = other.session_keys(&p, &e, b"hello");
        assert_ne!(keys.publisher_to_engine, other_keys.publisher_to_engine);
        // Short: the caller's bad value, named (as wm_init refuses it).
        let e = Secret::resolve(Some(b"short")).unwrap_err();
        assert_eq!(e.code, crate::result::wm_result::WM_ERR_INVALID_ARGUMENT);
        assert!(
            e.message.contains("the config's shared secret has 5 bytes"),
            "{e}"
        );
    }
}
