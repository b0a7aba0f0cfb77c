//! Sealed payloads: guest memory encrypted and authenticated on the client before it leaves
//! for an object store (`--store-key FILE`). AES-256-GCM from `ring` (the crypto library
//! the S3 client's TLS already builds on), a random 96-bit nonce per payload stored before it,
//! the 128-bit tag after it. Each payload's associated data binds the store's id (random per
//! upload) and the block's index, so a payload forged, moved to another block, or replayed
//! from another upload fails to open, as a corrupt one fails its checksum. The index object is
//! sealed as a whole.

use std::fmt;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};

use crate::file::{self, FileError};

/// Bytes of a store's id.
pub const STORE_ID_LEN: usize = 16;

/// Why a key file was refused.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// It cannot be opened or read (a link, a FIFO, missing).
    #[error("key file {path}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: FileError,
    },
    /// Others could read it.
    #[error(
        "key file {path} is readable by others (owner uid {owner}, mode {mode:o}): it must be \
         owned by uid {uid} and 0600 or 0400"
    )]
    NotPrivate {
        /// The file.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// Its mode.
        mode: u32,
        /// This process's effective uid.
        uid: u32,
    },
    /// Its contents are not a key.
    #[error("key file {path} holds {what}: a key is 32 bytes, or 64 hex digits and a newline")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What it holds.
        what: String,
    },
}

/// A sealed payload or index that does not open: forged, damaged, swapped, replayed, or
/// sealed with another key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "it does not open with this key: forged, damaged, moved, replayed or sealed with another key"
)]
pub struct SealError;

/// A store key (AES-256-GCM).
pub struct StoreKey {
    key: LessSafeKey,
}

impl fmt::Debug for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StoreKey(…)")
    }
}

impl StoreKey {
    /// The key of 32 bytes `bytes`.
    pub fn from_bytes(bytes: &[u8; 32]) -> Self {
        let unbound = UnboundKey::new(&AES_256_GCM, bytes).expect("32 bytes make an AES-256 key");
        Self {
            key: LessSafeKey::new(unbound),
        }
    }

    /// Reads a key file: a regular file of this user's that no one else can read (never
    /// through a link), holding 32 bytes, or 64 hex digits and an optional newline.
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        let fail = |source| KeyError::File {
            path: path.to_path_buf(),
            source,
        };
        let mut f = file::open_read(path).map_err(fail)?;
        let meta = f.metadata().map_err(|e| {
            fail(FileError::Io {
                op: "stat",
                path: path.to_path_buf(),
                source: e,
            })
        })?;
        let uid = nix::unistd::geteuid().as_raw();
        if meta.uid() != uid || meta.mode() & 0o077 != 0 {
            return Err(KeyError::NotPrivate {
                path: path.to_path_buf(),
                owner: meta.uid(),
                mode: meta.mode() & 0o7777,
                uid,
            });
        }
        let mut text = Vec::with_capacity(66);
        (&mut f).take(66).read_to_end(&mut text).map_err(|e| {
            fail(FileError::Io {
                op: "read",
                path: path.to_path_buf(),
                source: e,
            })
        })?;
        let malformed = |what: String| KeyError::Malformed {
            path: path.to_path_buf(),
            what,
        };
        let bytes: [u8; 32] = if text.len() == 32 {
            text.as_slice().try_into().expect("32 bytes")
        } else {
            let hex = text.strip_suffix(b"\n").unwrap_or(&text);
            if hex.len() != 64 {
                return Err(malformed(format!("{} bytes", text.len())));
            }
            let mut out = [0u8; 32];
            for (i, pair) in hex.chunks(2).enumerate() {
                let digits = std::str::from_utf8(pair).ok();
                out[i] = digits
                    .and_then(|d| u8::from_str_radix(d, 16).ok())
                    .ok_or_else(|| malformed("64 characters that are not all hex digits".into()))?;
            }
            out
        };
        Ok(Self::from_bytes(&bytes))
    }

    /// Appends `plain` sealed to `out`: nonce, ciphertext, tag.
    pub(crate) fn seal(&self, aad: &[u8], plain: &[u8], out: &mut Vec<u8>) {
        let mut nonce = [0u8; NONCE_LEN];
        fill_random(&mut nonce);
        let start = out.len();
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plain);
        let tag = self
            .key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad),
                &mut out[start + NONCE_LEN..],
            )
            .expect("a payload of at most 2 MiB seals");
        out.extend_from_slice(tag.as_ref());
    }

    /// Opens `sealed` (nonce, ciphertext, tag) in place; the plain bytes are then
    /// `sealed[..len - SEAL_OVERHEAD]`. Returns their length.
    pub(crate) fn open(&self, aad: &[u8], sealed: &mut [u8]) -> Result<usize, SealError> {
        if sealed.len() < NONCE_LEN + 16 {
            return Err(SealError);
        }
        let (nonce, rest) = sealed.split_at_mut(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError)?;
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(aad), rest)
            .map_err(|_| SealError)?;
        let len = plain.len();
        sealed.copy_within(NONCE_LEN..NONCE_LEN + len, 0);
        Ok(len)
    }
}

/// A new random store id.
pub(crate) fn new_store_id() -> [u8; STORE_ID_LEN] {
    let mut id = [0u8; STORE_ID_LEN];
    fill_random(&mut id);
    id
}

/// Fills `bytes` from the system's random source.
fn fill_random(bytes: &mut [u8]) {
    SystemRandom::new()
        .fill(bytes)
        .expect("the system's random source works");
}

/// The associated data of block `block`'s payload in the store `store_id`.
pub(crate) fn block_aad(store_id: &[u8], block: u64) -> Vec<u8> {
    let mut aad = b"pvisor block v1\0".to_vec();
    aad.extend_from_slice(store_id);
    aad.extend_from_slice(&block.to_le_bytes());
    aad
}

/// The associated data of the sealed index of the store at `location` (`s3://BUCKET/PREFIX`):
/// an index copied to another prefix does not open there.
pub(crate) fn index_aad(location: &str) -> Vec<u8> {
    let mut aad = b"pvisor index v1\0".to_vec();
    aad.extend_from_slice(location.as_bytes());
    aad
}

/// The associated data of the object `name` sealed whole under `location`.
pub(crate) fn object_aad(location: &str, name: &str) -> Vec<u8> {
    let mut aad = b"pvisor object v1\0".to_vec();
    aad.extend_from_slice(location.as_bytes());
    aad.push(0);
    aad.extend_from_slice(name.as_bytes());
    aad
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_payloads_open_only_where_they_were_sealed() {
        let key = StoreKey::from_bytes(&[7; 32]);
        let id = new_store_id();
        let mut sealed = Vec::new();
        key.seal(&block_aad(&id, 3), b"guest memory", &mut sealed);
        assert_eq!(sealed.len(), 12 + 28);
        assert!(!sealed.windows(12).any(|w| w == b"guest memory"));
        let mut copy = sealed.clone();
        let n = key.open(&block_aad(&id, 3), &mut copy).expect("opens");
        assert_eq!(&copy[..n], b"guest memory");
        let mut moved = sealed.clone();
        assert_eq!(key.open(&block_aad(&id, 4), &mut moved), Err(SealError));
        let mut replayed = sealed.clone();
        assert_eq!(
            key.open(&block_aad(&new_store_id(), 3), &mut replayed),
            Err(SealError)
        );
        let mut flipped = sealed.clone();
        flipped[20] ^= 1;
        assert_eq!(key.open(&block_aad(&id, 3), &mut flipped), Err(SealError));
        let other = StoreKey::from_bytes(&[8; 32]);
        let mut copy = sealed.clone();
        assert_eq!(other.open(&block_aad(&id, 3), &mut copy), Err(SealError));
    }

    #[test]
    fn key_files_must_be_private_and_well_formed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("key");
        std::fs::write(&path, format!("{}\n", "ab".repeat(32))).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        StoreKey::from_file(&path).expect("a hex key");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(matches!(
            StoreKey::from_file(&path),
            Err(KeyError::NotPrivate { .. })
        ));
        std::fs::write(&path, "short").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert!(matches!(
            StoreKey::from_file(&path),
            Err(KeyError::Malformed { .. })
        ));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).expect("symlink");
        assert!(matches!(
            StoreKey::from_file(&link),
            Err(KeyError::File { .. })
        ));
    }
}
