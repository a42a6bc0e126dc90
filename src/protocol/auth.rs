//! The authenticated handshake: both ends of a connection prove they know the cluster's
//! shared secret with HMAC-SHA256 over both ends' random nonces and node identities, so a
//! proof is worth nothing on another connection (fresh nonces) or in the other direction
//! (a domain tag per direction).
//!
//! ```text
//! client                                              server
//!   Handshake{authenticate, client nonce}  ──▶
//!                                          ◀──  Handshake{authenticate, server nonce}
//!                                          ◀──  AuthProof{HMAC(secret, SERVER_TAG|nonces|nodes)}
//!   verify (constant time)
//!   AuthProof{HMAC(secret, CLIENT_TAG|nonces|nodes)}  ──▶
//!   PartitionRequest ...                   ──▶  verify (constant time), then serve
//! ```
//!
//! Both handshakes leave at once (as without authentication), so authentication costs the
//! client one round trip before its first request is served, and nothing when it is off on
//! both sides. Nonces are the one input drawn from outside (the OS's random source,
//! [`Secret::fresh_nonce`]); the connections take them as parameters so tests are
//! deterministic.
//!
//! The direction tags keep a proof from being sent back on its own connection, but one
//! environment plays both roles with one secret and one node id: a man in the middle could
//! pass its consumer's handshake to its own server and the server's proof back to the
//! consumer, and have the environment vouch for itself. Every nonce an environment draws
//! therefore begins with bytes random per [`Secret`] value (per environment), and a server
//! refuses a consumer handshake whose nonce it could have drawn itself; changing those bytes
//! on the way changes the transcript the consumer's proof covers.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof (an HMAC-SHA256 tag).
pub const PROOF_LEN: usize = 32;
/// Fewest secret bytes accepted (128 bits).
pub const MIN_SECRET_LEN: usize = 16;

/// A handshake nonce: per connection and side, its environment's origin bytes, then fresh
/// random bytes ([`Secret::fresh_nonce`]).
pub type Nonce = [u8; NONCE_LEN];
/// A proof of knowing the secret, bound to one connection and one direction.
pub type Proof = [u8; PROOF_LEN];

/// What the producer (server) proves: distinct from the consumer's, so a proof cannot be
/// reflected back to the side that sent it.
const SERVER_TAG: &[u8] = b"fluxgate/2 auth: producer proof";
/// What the consumer (client) proves.
const CLIENT_TAG: &[u8] = b"fluxgate/2 auth: consumer proof";

/// Bytes at the start of every nonce drawn with one [`Secret`] value.
const ORIGIN_LEN: usize = 8;

/// The cluster's shared secret. Its bytes never appear in `Debug` output or logs. A value
/// (and its clones) also marks the nonces drawn with it ([`Secret::fresh_nonce`]): one
/// environment, one value.
#[derive(Clone)]
pub struct Secret {
    bytes: Box<[u8]>,
    /// What this value's nonces begin with; `None` if the OS's random source failed when it
    /// was made: it draws no nonce then ([`fresh_nonce`](Self::fresh_nonce) fails, and every
    /// connection is refused), even once the source works again.
    origin: Option<[u8; ORIGIN_LEN]>,
}

impl PartialEq for Secret {
    /// The same secret, whichever environment holds it.
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for Secret {}

impl Secret {
    /// A secret of at least [`MIN_SECRET_LEN`] bytes; `None` when shorter.
    pub fn new(bytes: &[u8]) -> Option<Self> {
        (bytes.len() >= MIN_SECRET_LEN).then(|| {
            let mut origin = [0; ORIGIN_LEN];
            Self {
                bytes: bytes.into(),
                origin: getrandom::fill(&mut origin).ok().map(|()| origin),
            }
        })
    }

    /// Length in bytes (for diagnostics; the bytes themselves stay private).
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Never true: a secret has at least [`MIN_SECRET_LEN`] bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// A fresh nonce from the operating system's random source: this value's origin bytes,
    /// then random ones (192 bits).
    pub fn fresh_nonce(&self) -> Result<Nonce, getrandom::Error> {
        // Without an origin, this environment could not tell its own consumer's nonce from a
        // peer's, and a relay could make it vouch for itself: no nonce rather than that.
        let Some(origin) = self.origin else {
            return Err(getrandom::Error::UNEXPECTED);
        };
        let mut nonce = [0; NONCE_LEN];
        getrandom::fill(&mut nonce[ORIGIN_LEN..])?;
        nonce[..ORIGIN_LEN].copy_from_slice(&origin);
        Ok(nonce)
    }

    /// True when `nonce` could have been drawn with this value: a consumer handshake
    /// carrying it came from this environment's own consumer.
    pub(crate) fn drew(&self, nonce: &Nonce) -> bool {
        self.origin
            .is_some_and(|origin| nonce[..ORIGIN_LEN] == origin)
    }

    fn mac(&self, tag: &[u8], transcript: &Transcript) -> Hmac<Sha256> {
        // HMAC takes keys of any length: this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.bytes)
            .expect("HMAC accepts keys of any length");
        mac.update(tag);
        mac.update(&transcript.client_nonce);
        mac.update(&transcript.server_nonce);
        mac.update(&transcript.client_node.to_be_bytes());
        mac.update(&transcript.server_node.to_be_bytes());
        mac
    }

    fn prove(&self, tag: &[u8], transcript: &Transcript) -> Proof {
        self.mac(tag, transcript).finalize().into_bytes().into()
    }

    fn verify(&self, tag: &[u8], transcript: &Transcript, proof: &Proof) -> bool {
        // `verify_slice` compares in constant time: a wrong guess learns nothing from timing.
        self.mac(tag, transcript).verify_slice(proof).is_ok()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes, redacted)", self.bytes.len())
    }
}

/// What both proofs of one connection cover (public for tests that play one side by hand).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transcript {
    /// The consumer's (connecting side's) nonce.
    pub client_nonce: Nonce,
    /// The producer's (accepting side's) nonce.
    pub server_nonce: Nonce,
    /// The consumer's node id.
    pub client_node: u128,
    /// The producer's node id.
    pub server_node: u128,
}

impl Transcript {
    /// The proof the producer (server) sends.
    pub fn server_proof(&self, secret: &Secret) -> Proof {
        secret.prove(SERVER_TAG, self)
    }

    /// The proof the consumer (client) sends.
    pub fn client_proof(&self, secret: &Secret) -> Proof {
        secret.prove(CLIENT_TAG, self)
    }

    pub(crate) fn verify_server(&self, secret: &Secret, proof: &Proof) -> bool {
        secret.verify(SERVER_TAG, self, proof)
    }

    pub(crate) fn verify_client(&self, secret: &Secret, proof: &Proof) -> bool {
        secret.verify(CLIENT_TAG, self, proof)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_whose_origin_could_not_be_drawn_draws_no_nonce() {
        // The random source failed when the secret was loaded: its nonces would carry no
        // origin, and the check against our own consumer's nonce would pass every relay.
        let secret = Secret {
            bytes: vec![7; MIN_SECRET_LEN].into(),
            origin: None,
        };
        assert!(secret.fresh_nonce().is_err());
        let drawn = Secret::new(&[7; MIN_SECRET_LEN]).expect("long enough");
        let nonce = drawn.fresh_nonce().expect("the random source works here");
        assert!(drawn.drew(&nonce));
        assert!(!secret.drew(&nonce));
    }

    fn transcript() -> Transcript {
        Transcript {
            client_nonce: [1; NONCE_LEN],
            server_nonce: [2; NONCE_LEN],
            client_node: 3,
            server_node: 4,
        }
    }

    #[test]
    fn a_proof_verifies_only_with_the_same_secret_direction_and_transcript() {
        let secret = Secret::new(b"0123456789abcdef").unwrap();
        let other = Secret::new(b"0123456789abcdeF").unwrap();
        let t = transcript();
        let server = t.server_proof(&secret);
        assert!(t.verify_server(&secret, &server));
        assert!(!t.verify_server(&other, &server), "another secret");
        assert!(!t.verify_client(&secret, &server), "reflected");
        let mut replayed = t;
        replayed.server_nonce[0] ^= 1;
        assert!(
            !replayed.verify_server(&secret, &server),
            "another connection"
        );
        let mut swapped = t;
        swapped.client_node = 4;
        swapped.server_node = 3;
        assert!(!swapped.verify_server(&secret, &server), "other nodes");
        assert_ne!(t.client_proof(&secret), server);
    }

    #[test]
    fn short_secrets_are_refused_and_never_printed() {
        assert!(Secret::new(b"short").is_none());
        let secret = Secret::new(b"a very secret value").unwrap();
        assert!(!format!("{secret:?}").contains("secret value"));
    }

    #[test]
    fn nonces_differ_and_tell_their_origin() {
        let secret = Secret::new(b"a very secret value").unwrap();
        let (first, second) = (secret.fresh_nonce().unwrap(), secret.fresh_nonce().unwrap());
        assert_ne!(first, second);
        assert!(secret.drew(&first) && secret.clone().drew(&second));
        let elsewhere = Secret::new(b"a very secret value").unwrap();
        assert_eq!(elsewhere, secret, "the same secret");
        assert!(!elsewhere.drew(&first), "drawn in another environment");
    }
}
