//! What stores in an object store (`crate::remote`) need of a store: segment names, an index
//! read and renumbered for an upload, and sealed stores (`crate::seal`): their key, and a sealed
//! copy of an image.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use super::files::read_index;
use super::index::{self, Slot};
use super::{segment, DiskStore, IndexError, StoreConfig, StoreError, INDEX_FILE, STORE_ID_KEY};
use crate::codec::{BlockKind, Encoded};

/// The name of segment `id`'s file (and of its object in a remote store).
pub(crate) fn segment_file_name(id: u32) -> String {
    segment::file_name(id)
}

/// Whether `name` names a segment file.
pub(crate) fn is_segment_file_name(name: &str) -> bool {
    segment::parse_file_name(name).is_some()
}

/// The segment id `name` names, if it names one.
pub(crate) fn parse_segment_file_name(name: &str) -> Option<u32> {
    segment::parse_file_name(name)
}

/// The largest index a header of [`index::HEADER_LEN`] bytes allows.
pub(crate) fn index_size_limit(head: &[u8]) -> Result<u64, IndexError> {
    index::Index::size_limit(head)
}

/// The next free segment id of the index file at `path` (read and checked as on open) and
/// its segments with their committed lengths.
pub(crate) fn index_segments(path: &Path) -> Result<(u32, BTreeMap<u32, u64>), StoreError> {
    read_index(path).map(|index| (index.next_segment, index.segments))
}

/// Bytes of an index's header: enough for [`index_size_limit`].
pub(crate) const INDEX_HEADER_LEN: usize = index::HEADER_LEN;

/// A segment moved by [`renumbered_index`]: its local id, its new id, its length.
pub(crate) type Renumbered = (u32, u32, u64);

/// The committed index of the store in `dir` with its segments renumbered from `base` on (a
/// remote store's new chunks never take a name its current index uses): the encoded index
/// and, per segment, its local id, its new id and its length.
pub(crate) fn renumbered_index(
    dir: &Path,
    base: u32,
) -> Result<(Vec<u8>, Vec<Renumbered>), StoreError> {
    let path = dir.join(INDEX_FILE);
    let mut index = read_index(&path)?;
    let renumber = |id: u32| -> Result<u32, StoreError> {
        base.checked_add(id)
            .filter(|&n| n <= segment::MAX_ID)
            .ok_or_else(|| StoreError::IndexCorrupt {
                path: path.clone(),
                source: IndexError::Invalid {
                    what: "segment id",
                    detail: format!(
                        "{id} renumbered from {base} passes the last id; pack into a new prefix"
                    ),
                },
            })
    };
    let mut moved = Vec::with_capacity(index.segments.len());
    let mut segments = BTreeMap::new();
    for (&id, &len) in &index.segments {
        let new = renumber(id)?;
        moved.push((id, new, len));
        segments.insert(new, len);
    }
    for slot in &mut index.slots {
        if let Slot::Data(data) = slot {
            data.segment = renumber(data.segment)?;
        }
    }
    index.segments = segments;
    index.next_segment = renumber(index.next_segment)?;
    Ok((index.encode(), moved))
}

impl DiskStore {
    /// Whether the store's payloads are sealed (encrypted and authenticated: see
    /// [`crate::seal`]); reads then need [`set_key`](Self::set_key).
    pub fn is_sealed(&self) -> bool {
        self.how.sealed
    }

    /// The key that opens a sealed store's payloads (for this store and the readers taken
    /// from it from now on). Refused for a store that is not sealed, or has no id.
    pub fn set_key(&mut self, key: Arc<crate::seal::StoreKey>) -> Result<(), StoreError> {
        let mismatch = |what| StoreError::KeyMismatch {
            dir: self.dir.clone(),
            what,
        };
        if !self.how.sealed {
            return Err(mismatch("is not encrypted, but a key was given"));
        }
        let id = self
            .meta
            .get(STORE_ID_KEY)
            .filter(|id| id.len() == crate::seal::STORE_ID_LEN)
            .ok_or_else(|| mismatch("is encrypted but has no store id"))?;
        self.how.key = Some((key, id.as_slice().into()));
        Ok(())
    }

    /// A sealed copy of this store's committed image in `dir` (made, 0700; it must hold no
    /// store): every payload sealed with `key` under a new store id, the metadata (the
    /// working set) kept.
    pub fn sealed_copy(
        &self,
        dir: &Path,
        key: &crate::seal::StoreKey,
    ) -> Result<DiskStore, StoreError> {
        let mut copy = DiskStore::create(
            dir,
            StoreConfig {
                block_size: self.block_size,
                codec: self.codec,
                image_size: self.image_size,
            },
        )?;
        copy.how.sealed = true;
        let id = crate::seal::new_store_id();
        for (key_name, value) in &self.meta {
            copy.set_meta(key_name, value.clone())?;
        }
        copy.set_meta(STORE_ID_KEY, id.to_vec())?;
        let mut payload = Vec::new();
        let mut sealed = Vec::new();
        for block in 0..self.blocks() {
            let Some(kind) = self.get_encoded(block, &mut payload)? else {
                continue;
            };
            let stored: &[u8] = match kind {
                BlockKind::Zero | BlockKind::Fill => &payload,
                _ => {
                    sealed.clear();
                    key.seal(&crate::seal::block_aad(&id, block), &payload, &mut sealed);
                    &sealed
                }
            };
            copy.put_encoded(
                block,
                Encoded {
                    kind,
                    payload: stored,
                },
            )?;
        }
        copy.commit()?;
        Ok(copy)
    }
}
